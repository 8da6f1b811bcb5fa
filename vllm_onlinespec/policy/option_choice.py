"""The budget's choice among what the preset holds, priced by measured engine cycles.

A step can verify one of three things:

    plain     nothing: vLLM's drafter at K = 0 (its context pass) and no lookup draft
    tree      the suffix tree's drafts alone (the drafter at K = 0)
    drafter   the drafter's blocks at the gate's k, with the tree's drafts where it is confident

The step gate (policy/step_gate.py) picks the drafter's k from a cost model; that model cannot
see what a kind of step costs beyond the target and drafter spans (the tree's proposing, the
rejection sampler, bookkeeping), and whatever it mispriced made the recipe lose to the tree
alone or to plain decoding. This module prices each option by what its cycles measured: tokens
produced per second of engine cycle, per batch-size bucket, comparing like with like (only
cycles without prefill tokens, each labelled with the option whose drafts it verified, its
drafting time counted to the option that drafted). It picks the option with the best measured
rate, and runs each other option now and then so that every price stays current and a change
in the load (or the drafter learning) moves the choice. Exploring costs what the explored
option loses against the best, so it is spread by that loss: an option whose cycles cost a
fraction x more per token than the best's runs once in max(explore_every * (options - 1),
x / regret) steps of its bucket (at most 16 * explore_every), which keeps each option's
exploring under `regret` of the serving time (1 %: a drafter at 1.8x the plain price per token,
as sampled rollouts on a 2-vCPU box measured, runs once in 80 steps instead of once in 32). An
option with fewer than `min_cycles` measured cycles in a bucket is measured first, every
explore_every / 4 steps. Until every option has its cycles there, the step runs what won in the
nearest bucket whose options are all measured (`cold_pick` 'neighbour'), or the gate's own
choice where no bucket is measured yet ('gate': always). A closed batch of 8 greedy requests
opens B4, B2 and B1 in its tail, a few steps each: the gate's cost model picked the drafter
there at 1.4-2x the tree's measured price at B8 (9 of 16 and 18 of 25 drafter steps of a
bench order were such steps, docs/results/dominance.md), while the tree was the cheapest
measured option at B8 and B32 in both orders and at B1 in three of four (greedy and sampled).

A drafting option (tree, drafter) is chosen over plain only where its measured rate beats
plain's by `margin` (5 %): its prices count decode cycles, and what drafting costs outside them
shows only where the rates are close. Where the tree and plain were priced within 2 %, the
preset lost to plain decoding by 10-22 % (batch 32 greedy offline, 0.87x nospec; 64 served
requests in one wave, 0.78x, where the tree alone served 0.82-0.87x plain alone in the same
worker at an equal TPOT: finishing some requests early leaves a tail of small, dear steps; and
the prefill steps mixed with drafts go unpriced); where the tree beat plain by 20 % or more it
paid (batch 1 and 8 greedy, 16 served requests with the server kept full). Tuned on those
points' prices (docs/results/dominance.md, dominance_served.md), measured on other prompts.

A step chooses before its drafts exist, so a 'tree' step whose tree matched nothing verifies
nothing: it costs and produces what a plain cycle does (plus the tree's look-up, ~0.6 ms), and
it is priced as one. That keeps the plain price current while the tree runs (plain is otherwise
measured only when explored, and a stale plain price can hold the choice on plain for hundreds
of steps), and prices the tree by the cycles it drafts in: where it matches nothing the step is
a plain one whichever was chosen, so the tree is worth choosing exactly where its drafted
cycles beat plain ones. At batch 1 on Spec-Bench's math questions, 342 of 655 tree cycles
verified nothing before the tree's weaker drafts were taken (serving/lookup.py), 76 of 591 after.
A cycle longer than `clip` times its price's mean cycle (an engine stall, a first-shape
compile) counts as `clip` times: one stall otherwise weighs on a rarely run option's price
for as many of its cycles as the half-life.

What a cycle's tokens count is the `objective`. 'tokens': every token produced, the throughput
of a server whose requests come and go. 'slowest': the batch size times the tokens of the
request furthest from its end (the most tokens left to its max_tokens, the mean over a tie),
for a closed batch that ends with its last sequence (RL rollouts, a wave of requests sent
together). There a step's accepted drafts shorten the round only where they land on the
sequence that ends last: on sampled rollouts at batch 8 the tree and the drafter produced 1.45
tokens per request per step, yet the rounds took 185-188 steps against plain decoding's 194
at 8-20 % more per step (docs/results/rl_objective.md); a CPU step's cost is mostly fixed
(a batch-32 step ~90 ms where one request's costs ~40), so the requests that finish early
leave steps barely cheaper. 'auto': 'slowest' while the batch is closed (no new request
scheduled for `closed_after` steps: the caller sets `closed` each step), 'tokens' otherwise.
Every price keeps both counts, so a switch reads a current price. A plain step counts B under
each.

Core module: no vLLM import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vllm_onlinespec.policy.cycle_overhead import batch_bucket

OPTIONS = ("plain", "tree", "drafter")


@dataclass
class OptionPrice:
    """Exponential averages of one option's measured cycles in one batch bucket."""

    tokens: float = 0.0  # tokens produced per cycle (accepted drafts + one per request)
    # the batch size times the tokens of the request furthest from its end, per cycle
    lagging: float = 0.0
    seconds: float = 0.0  # seconds per cycle
    cycles: int = 0
    last: int = 0  # the choice's step counter when this option last ran here
    seen: int = 0  # ... when a cycle of it was last measured here

    @property
    def rate(self) -> float:
        """Tokens per second (0 until measured)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def rate_for(self, closed: bool) -> float:
        """Tokens per second as a closed batch counts them (`lagging`) or as a server does."""
        if not closed:
            return self.rate
        return self.lagging / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class OptionDecision:
    option: str  # one of OPTIONS
    explore: bool  # run to keep its price current, not because it is the best
    reason: str


@dataclass
class OptionChoice:
    """Measured prices of `options` per batch bucket and the choice made from them."""

    options: tuple[str, ...] = OPTIONS
    explore_every: int = 16
    regret: float = 0.01  # the serving time each option's exploring may cost, at most
    min_cycles: int = 4
    half_life_cycles: float = 16.0
    # An option measured only when explored (once in 32-256 steps) forgets by steps too: its
    # old average loses half its weight per `half_life_steps` steps of its bucket, whatever
    # its own cycle count. With the cycle half-life alone, a tree that overtook the drafter
    # (3 tokens a cycle where it had made 1.4) took 356 steps to be chosen, 96 with this.
    half_life_steps: float = 128.0
    clip: float = 3.0  # a measured cycle counts at most this many times its price's mean cycle
    objective: str = "tokens"  # or "slowest" / "auto": what a cycle's tokens count (docstring)
    closed: bool = False  # the batch takes no new requests now ('auto' reads it; caller sets)
    cold_pick: str = "neighbour"  # or "gate": what runs in a bucket not yet measured
    # a drafting option is chosen over plain only where its measured rate is this much higher
    margin: float = 0.05
    prices: dict[tuple[str, int], OptionPrice] = field(default_factory=dict)
    chosen: dict[str, int] = field(default_factory=dict)  # steps run per option
    steps: int = 0
    # Steps per bucket: each bucket explores on its own count (one shared count, with batch
    # sizes that alternate, could land every exploring step in the same bucket).
    bucket_steps: dict[int, int] = field(default_factory=dict)
    tree_as_plain: int = 0  # tree cycles that verified nothing, priced as plain
    clipped: int = 0  # cycles counted at `clip` times their price's mean

    def __post_init__(self) -> None:
        unknown = [o for o in self.options if o not in OPTIONS]
        if unknown or not self.options:
            raise ValueError(f"options must be a non-empty subset of {OPTIONS} (got "
                             f"{list(self.options)})")
        if (self.explore_every < 2 or self.min_cycles < 1 or self.half_life_cycles <= 0
                or not 0 < self.regret <= 1 or self.clip <= 1 or self.half_life_steps <= 0):
            raise ValueError("OptionChoice: want explore_every >= 2, min_cycles >= 1, "
                             "half_life_cycles > 0, half_life_steps > 0, 0 < regret <= 1 "
                             "and clip > 1")
        if self.objective not in ("tokens", "slowest", "auto"):
            raise ValueError(f"OptionChoice: objective must be 'tokens', 'slowest' or 'auto' "
                             f"(got {self.objective!r})")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"OptionChoice: margin must be in [0, 1) (got {self.margin})")
        if self.cold_pick not in ("neighbour", "gate"):
            raise ValueError(f"OptionChoice: cold_pick must be 'neighbour' or 'gate' (got "
                             f"{self.cold_pick!r})")
        self.chosen = {o: self.chosen.get(o, 0) for o in self.options}

    def price(self, option: str, batch_size: int) -> OptionPrice:
        return self.prices.setdefault((option, batch_bucket(batch_size)), OptionPrice())

    def choose(self, batch_size: int, gate_pick: str) -> OptionDecision:
        """The option for a step of `batch_size` requests; `gate_pick` is what the cost-model
        gate would run (it stands until every option has been measured here)."""
        self.steps += 1
        if gate_pick not in self.options:
            gate_pick = self.options[-1]
        prices = {o: self.price(o, batch_size) for o in self.options}
        b = batch_bucket(batch_size)
        n = self.bucket_steps[b] = self.bucket_steps.get(b, 0) + 1
        measured = self._measured(b)
        cold = None if measured or self.cold_pick == "gate" else self._nearest_measured(b)
        closed = self.counts_closed
        rate = {o: prices[o].rate_for(closed) for o in self.options}
        if measured:
            best = self._best(rate)
        elif cold is not None:
            best = self._best({o: self.prices[(o, cold)].rate_for(closed) for o in self.options})
        else:
            best = gate_pick
        rates = ", ".join(f"{o} {rate[o]:.1f}" + ("" if prices[o].cycles >= self.min_cycles
                                                   else f" ({prices[o].cycles} cycles)")
                          for o in self.options) + (" (closed batch)" if closed else "")
        others = [o for o in self.options if o != best]
        if not measured:
            # Unmeasured options are measured 4x as often: a new bucket has prices within
            # ~4 * min_cycles * explore_every / 4 steps.
            every = max(2, self.explore_every // 4)
            unmeasured = [o for o in others if prices[o].cycles < self.min_cycles]
            if unmeasured and n % every == 0:  # the least measured first
                pick = min(unmeasured, key=lambda o: (prices[o].cycles, prices[o].last))
                return self._run(pick, b, True, f"options at B<={b}: explore {pick} (1 step in "
                                                f"{every} until measured); measured tok/s {rates}")
        else:
            due = {o: n - prices[o].last - self.interval(rate[best], rate[o]) for o in others}
            due = {o: late for o, late in due.items() if late >= 0}
            if due:  # the most overdue
                pick = max(due, key=lambda o: (due[o], -prices[o].last))
                every = self.interval(rate[best], rate[pick])
                return self._run(pick, b, True, f"options at B<={b}: explore {pick} (1 step in "
                                                f"{every}); measured tok/s {rates}")
        why = ("best measured" if measured else f"best measured at B<={cold} until every option "
               "is measured here" if cold is not None else "the gate's pick until every option "
               "is measured")
        return self._run(best, b, False, f"options at B<={b}: {best} ({why}); measured tok/s "
                                         f"{rates}")

    @property
    def counts_closed(self) -> bool:
        """Whether a cycle's tokens count as a closed batch's now (module docstring)."""
        return self.objective == "slowest" or (self.objective == "auto" and self.closed)

    def _best(self, rates: dict[str, float]) -> str:
        """The option with the best measured rate, a drafting one only where it beats plain's
        by `margin` (module docstring)."""
        plain = rates.get("plain")
        if plain is None:
            return max(rates, key=rates.__getitem__)
        best = max((o for o in rates if o != "plain"), key=rates.__getitem__, default="plain")
        return best if rates[best] > plain * (1.0 + self.margin) else "plain"

    def _measured(self, bucket: int) -> bool:
        return all(self.prices.get((o, bucket), OptionPrice()).cycles >= self.min_cycles
                   for o in self.options)

    def _nearest_measured(self, bucket: int) -> int | None:
        """The measured bucket nearest `bucket` in powers of two (the larger on a tie: a wave's
        tail comes from it)."""
        done = {b for _, b in self.prices if b != bucket and self._measured(b)}
        if not done:
            return None
        return min(done, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), -b))

    def interval(self, best_rate: float, rate: float) -> int:
        """Steps between two exploring runs of an option measured at `rate` tokens/s where the
        best runs at `best_rate`: its loss per token over `regret`, within [explore_every *
        (options - 1), 16 * explore_every] (so all of them together explore at most one step in
        explore_every)."""
        lo = self.explore_every * max(1, len(self.options) - 1)
        cap = max(lo, 16 * self.explore_every)
        if rate <= 0:
            return cap
        loss = max(0.0, best_rate / rate - 1.0)
        return int(min(cap, max(lo, math.ceil(loss / self.regret))))

    def _run(self, option: str, bucket: int, explore: bool, reason: str) -> OptionDecision:
        self.chosen[option] += 1
        self.prices.setdefault((option, bucket), OptionPrice()).last = self.bucket_steps[bucket]
        return OptionDecision(option, explore, reason)

    def observe(self, option: str, batch_size: int, tokens: float, seconds: float, *,
                slowest: float | None = None, drafts: int | None = None) -> None:
        """One measured cycle that verified `option`'s drafts: `tokens` produced in `seconds`
        (its drafting included), `slowest` of them by the request furthest from its end
        (`laggard_tokens`; None: not known, counted as the mean), `drafts` the draft tokens it
        verified (None: not known). A 'tree' cycle that verified none is priced as plain
        (module docstring). Cycles with prefill must not come here (not comparable)."""
        if option == "tree" and drafts == 0 and "plain" in self.options:
            option = "plain"
            self.tree_as_plain += 1
        if option not in self.options or batch_size <= 0 or not seconds > 0 or tokens < 0:
            return
        lagging = float(tokens) if slowest is None else batch_size * float(slowest)
        p = self.price(option, batch_size)
        if p.cycles >= self.min_cycles and seconds > self.clip * p.seconds:
            seconds = self.clip * p.seconds
            self.clipped += 1
        now = self.bucket_steps.get(batch_bucket(batch_size), 0)
        d = 0.5 ** max(1.0 / self.half_life_cycles, (now - p.seen) / self.half_life_steps)
        p.seen = now
        if p.cycles == 0:
            p.tokens, p.lagging, p.seconds = float(tokens), lagging, float(seconds)
        else:
            p.tokens = d * p.tokens + (1 - d) * float(tokens)
            p.lagging = d * p.lagging + (1 - d) * lagging
            p.seconds = d * p.seconds + (1 - d) * float(seconds)
        p.cycles += 1

    def ms_per_token(self) -> dict[str, float]:
        """What each option's cycles cost per produced token, by bucket ("tree@B8": ms)."""
        return {f"{o}@B{b}": round(1e3 / p.rate, 3) for (o, b), p in sorted(self.prices.items())
                if p.cycles and p.rate > 0}

    def shares(self) -> dict[str, float]:
        """Fraction of the choice's steps each option ran."""
        n = max(1, sum(self.chosen.values()))
        return {o: round(c / n, 4) for o, c in self.chosen.items()}


def laggard_tokens(left: list[int | None] | None, accepted: list[int] | None) -> float | None:
    """Tokens one cycle produced for the request furthest from its end: 1 + its accepted
    drafts, `left` each request's tokens to its max_tokens before the cycle (the mean over the
    requests that tie for the most); None where either list is missing or they disagree."""
    if not left or not accepted or len(left) != len(accepted) or any(x is None for x in left):
        return None
    most = max(left)
    lag = [a for x, a in zip(left, accepted) if x == most]
    return 1.0 + sum(lag) / len(lag)
