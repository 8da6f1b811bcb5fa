"""The budget's choice among plain / tree / drafter by measured engine cycles
(policy/option_choice.py), on synthetic cycle timings: each option is picked where it is the
cheapest per produced token, the choice follows a change, a price holds only its own option's
cycles, batch buckets are priced apart, and the cutter turns the choice into the drafter's k."""

import pytest

from vllm_onlinespec.config import ConfigError, LengthHeadConfig, OnlineSpecConfig
from vllm_onlinespec.policy.budget import StepCostModel
from vllm_onlinespec.policy.cutter import DraftCutter
from vllm_onlinespec.policy.option_choice import OptionChoice, laggard_tokens
from test_step_gate import K, stats_with_rate

# (tokens per cycle, seconds per cycle) at batch 8: each table has another cheapest option.
TABLES = {
    "plain": {"plain": (8, 0.080), "tree": (9, 0.100), "drafter": (11, 0.140)},
    "tree": {"plain": (8, 0.080), "tree": (12, 0.095), "drafter": (13, 0.125)},
    "drafter": {"plain": (8, 0.080), "tree": (9, 0.090), "drafter": (16, 0.110)},
}


def run(choice: OptionChoice, table: dict, steps: int, batch: int = 8, gate_pick: str = "drafter",
        noise: float = 0.0, seed: int = 0) -> list[str]:
    """Each step: choose, then the cycle that verifies the choice is measured from `table`."""
    import random

    rng = random.Random(seed)
    picks = []
    for _ in range(steps):
        o = choice.choose(batch, gate_pick).option
        tokens, seconds = table[o]
        choice.observe(o, batch, tokens * (1 + noise * rng.uniform(-1, 1)), seconds)
        picks.append(o)
    return picks


@pytest.mark.parametrize("best", list(TABLES))
def test_each_option_is_picked_where_it_is_cheapest_per_token(best):
    choice = OptionChoice(explore_every=16)
    picks = run(choice, TABLES[best], 400, noise=0.3)
    tail = picks[200:]
    # Everything but the 1-in-16 exploring steps runs the cheapest option.
    assert tail.count(best) >= len(tail) * (1 - 1 / 16) - 1, (best, choice.shares())
    # Exploration kept every other option's price current.
    assert all(tail.count(o) >= 3 for o in TABLES if o != best)
    ms = choice.ms_per_token()
    assert min(ms, key=ms.get) == f"{best}@B8"


def test_the_choice_follows_a_change():
    choice = OptionChoice(explore_every=8)
    run(choice, TABLES["drafter"], 300)
    assert choice.choose(8, "drafter").option == "drafter"
    picks = run(choice, TABLES["plain"], 300)  # e.g. the load grew: speculation stopped paying
    switched = next(i for i, o in enumerate(picks) if picks[i:i + 20].count("plain") >= 17)
    assert switched < 120, switched
    assert picks[-40:].count("plain") >= 34


def test_exploring_is_spread_by_what_it_costs():
    """An option x dearer per token than the best runs once in x / regret steps (never more
    often than the floor), so exploring it costs about `regret` of the serving time; a dearer
    option that becomes the cheapest is still found within 16 * explore_every steps."""
    choice = OptionChoice(explore_every=16, regret=0.01)
    # plain 100 tok/s, tree 90 (11 % dearer: the floor, 32), drafter 50 (2x dearer: 100 steps)
    table = {"plain": (8, 0.080), "tree": (9, 0.100), "drafter": (8, 0.160)}
    picks = run(choice, table, 2200)[200:]
    assert 18 <= picks.count("drafter") <= 22, choice.shares()
    assert 55 <= picks.count("tree") <= 66, choice.shares()
    assert choice.interval(100.0, 50.0) == 100 and choice.interval(100.0, 90.0) == 32
    assert choice.interval(100.0, 1.0) == 256 and choice.interval(100.0, 0.0) == 256
    # What exploring cost: serving time against running plain on every step, per token.
    cost = sum(table[o][1] / table[o][0] for o in picks) / (len(picks) * 0.080 / 8)
    assert cost < 1 + 0.01 + 0.11 / 32 + 0.005, cost
    # The drafter learns (now 2x cheaper per token than plain): its price follows as it is
    # explored, each run more often as it nears the best, and it takes over.
    table["drafter"] = (20, 0.100)
    later = run(choice, table, 1500)
    took = next(i for i in range(len(later)) if later[i:i + 50].count("drafter") >= 45)
    assert took <= 1200 and later[-100:].count("drafter") >= 90, (took, choice.shares())


def test_the_slowest_objective_prices_a_closed_batch_by_its_slowest_request():
    """Batch 8, the tree 50 % more tokens per step for 10 % more time, all of them on some
    requests while others gain none: 'tokens' runs the tree, 'slowest' (a closed batch ends with
    its last sequence) plain; at batch 1, where the slowest request is the only one, the tree
    under both. A plain cycle counts B tokens under both."""
    # (tokens, slowest request's tokens, seconds) per option and batch size
    table = {8: {"plain": (8, 1, 0.100), "tree": (12, 1, 0.110), "drafter": (13, 1, 0.160)},
             1: {"plain": (1, 1, 0.070), "tree": (2, 2, 0.080), "drafter": (2, 2, 0.120)}}
    for objective, at_8 in (("tokens", "tree"), ("slowest", "plain")):
        choice = OptionChoice(explore_every=16, objective=objective)
        picks = {8: [], 1: []}
        for _ in range(400):
            for batch in (8, 1):
                o = choice.choose(batch, "tree").option
                tokens, slowest, seconds = table[batch][o]
                choice.observe(o, batch, tokens, seconds, slowest=slowest)
                picks[batch].append(o)
        assert picks[8][-100:].count(at_8) >= 85, (objective, choice.ms_per_token())
        assert picks[1][-100:].count("tree") >= 85, (objective, choice.ms_per_token())
        assert choice.ms_per_token()["plain@B8"] == pytest.approx(12.5)
    with pytest.raises(ValueError, match="objective"):
        OptionChoice(objective="latency")


def test_auto_counts_a_closed_batch_by_its_laggard_and_an_open_one_by_every_token():
    """Objective 'auto': the same measured cycles (batch 8, the tree's extra tokens all on
    requests other than the one furthest from its end) choose the tree while new requests
    arrive and plain once the batch is closed, from the next step on (every price keeps both
    counts)."""
    table = {"plain": (8, 1, 0.100), "tree": (12, 1, 0.110), "drafter": (13, 1, 0.160)}
    choice = OptionChoice(explore_every=16, objective="auto")
    picks = []
    for step in range(600):
        choice.closed = step >= 300
        o = choice.choose(8, "tree").option
        tokens, laggard, seconds = table[o]
        choice.observe(o, 8, tokens, seconds, slowest=laggard)
        picks.append(o)
    assert picks[200:300].count("tree") >= 85 and picks[300:310].count("plain") >= 9, picks[290:310]
    assert picks[-100:].count("plain") >= 85
    # What the prices report stays every token's price.
    assert choice.ms_per_token()["tree@B8"] == pytest.approx(110 / 12, rel=0.01)


def test_laggard_tokens_are_those_of_the_request_furthest_from_its_end():
    assert laggard_tokens([10, 30, 30], [5, 1, 2]) == 2.5  # a tie: the mean of 1 + accepted
    assert laggard_tokens([10, 3], [0, 4]) == 1.0
    assert laggard_tokens(None, [1]) is None and laggard_tokens([1], None) is None
    assert laggard_tokens([1, None], [0, 0]) is None and laggard_tokens([1], [0, 0]) is None


def test_a_price_holds_only_its_own_options_cycles():
    """Plain cycles are priced by plain cycles: tree cycles that happen to verify nothing must
    not land in the plain price (the defect of the cost-model gate's 'k0' residual)."""
    choice = OptionChoice()
    for _ in range(50):
        choice.observe("plain", 8, 8, 0.080)
        choice.observe("tree", 8, 8, 0.089)  # a tree cycle whose drafts were all rejected
    ms = choice.ms_per_token()
    assert ms["plain@B8"] == pytest.approx(10.0)
    assert ms["tree@B8"] == pytest.approx(11.125)


def test_a_tree_cycle_that_verified_nothing_is_priced_as_plain():
    """The choice is made before the tree's drafts exist: a tree step that matched nothing is a
    plain cycle and keeps the plain price current. Batch 1, plain measured once at a slow
    moment (120 ms a token); the tree matches on 3 cycles in 10 (4 tokens in 80 ms) and
    nothing on the others (1 token in 62 ms): the plain price follows the 62 ms cycles while
    the tree runs, and the tree is priced by its drafted cycles."""
    choice = OptionChoice(explore_every=16)
    for _ in range(4):
        choice.observe("plain", 1, 1, 0.120)
        choice.observe("drafter", 1, 2, 0.150)
    for i in range(200):
        o = choice.choose(1, "tree").option
        matched = o == "tree" and i % 10 < 3
        tokens, seconds, drafts = {"plain": (1, 0.060, 0), "drafter": (2, 0.150, 8)}.get(
            o, (4, 0.080, 6) if matched else (1, 0.062, 0))
        choice.observe(o, 1, tokens, seconds, drafts=drafts)
    ms = choice.ms_per_token()
    assert ms["plain@B1"] == pytest.approx(62, abs=2) and ms["tree@B1"] == pytest.approx(20)
    assert choice.tree_as_plain > 100
    assert choice.shares()["tree"] > 0.9
    # Without the draft count (None) a tree cycle stays the tree's.
    other = OptionChoice()
    other.observe("tree", 1, 1, 0.062)
    assert other.ms_per_token() == {"tree@B1": 62.0} and other.tree_as_plain == 0


def test_a_rarely_measured_price_forgets_by_steps():
    """Batch 1: the drafter is the best (2 tokens in 100 ms a cycle) and the tree, explored,
    measured at 1.4 in 100 ms; then the text turns repetitive and the tree's cycles yield 3 in
    100 ms. Explored once in 32-256 steps, the tree's price must follow within a few of its
    cycles: forgetting by its own cycles alone (half-life 16) the switch took 356 steps."""
    def switch_after(half_life_steps):
        choice = OptionChoice(explore_every=16, half_life_steps=half_life_steps)
        table = {"plain": (1, 0.060, 0), "tree": (1.4, 0.100, 4), "drafter": (2, 0.100, 8)}
        picks = []
        for step in range(1600):
            if step == 600:
                table["tree"] = (3, 0.100, 4)
            o = choice.choose(1, "drafter").option
            tokens, seconds, drafts = table[o]
            choice.observe(o, 1, tokens, seconds, drafts=drafts)
            picks.append(o)
        after = picks[600:]
        return next((i for i in range(len(after)) if after[i:i + 20].count("tree") >= 18), None)

    assert switch_after(128.0) <= 130  # 96
    assert switch_after(1e9) >= 250  # by its own cycles alone: 356
    with pytest.raises(ValueError, match="half_life_steps"):
        OptionChoice(half_life_steps=0)


def test_a_stall_weighs_on_a_price_as_at_most_clip_cycles():
    """One 2 s cycle (an engine stall) in a 60 ms-a-cycle price counts as 3 cycles' time, not
    33: the price recovers within a few of its cycles instead of dozens."""
    choice = OptionChoice(clip=3.0)
    for _ in range(8):
        choice.observe("plain", 1, 1, 0.060)
    choice.observe("plain", 1, 1, 2.0)
    assert choice.clipped == 1
    d = 0.5 ** (1 / choice.half_life_cycles)
    assert choice.price("plain", 1).seconds == pytest.approx(d * 0.060 + (1 - d) * 0.180)
    with pytest.raises(ValueError, match="clip"):
        OptionChoice(clip=1.0)


def test_batch_buckets_are_priced_apart():
    choice = OptionChoice(explore_every=8)
    small = {"plain": (1, 0.030), "tree": (2.2, 0.034), "drafter": (2.0, 0.040)}
    large = {"plain": (32, 0.100), "tree": (34, 0.130), "drafter": (36, 0.180)}
    picks = {1: [], 32: []}
    for _ in range(200):
        picks[1] += run(choice, small, 1, batch=1)
        picks[32] += run(choice, large, 1, batch=32)
    assert picks[1][-100:].count("tree") >= 85
    assert picks[32][-100:].count("plain") >= 85


def test_until_measured_the_gates_pick_stands_and_unmeasured_options_are_measured_first():
    choice = OptionChoice(explore_every=16, min_cycles=4)
    picks = run(choice, TABLES["drafter"], 40, gate_pick="tree")
    assert picks[0] == "tree"  # nothing measured: the gate's verdict
    # Exploring every 4th step while unmeasured: both others measured min_cycles times by 32.
    assert picks[:32].count("plain") == 4 and picks[:32].count("drafter") == 4
    assert picks[-1] == "drafter"


def test_a_new_bucket_runs_what_won_in_the_nearest_measured_one():
    """A closed batch's tail opens smaller buckets for a few steps each: there the step runs
    the nearest measured bucket's winner (not the gate's pick) until its own options are
    measured, then its own prices decide; 'gate' keeps the gate's pick."""
    B8 = {"plain": (8, 0.080), "tree": (12, 0.095), "drafter": (13, 0.125)}  # tree cheapest
    B2 = {"plain": (2, 0.050), "tree": (2.2, 0.060), "drafter": (4, 0.060)}  # drafter cheapest
    for cold_pick, first in (("neighbour", "tree"), ("gate", "drafter")):
        choice = OptionChoice(explore_every=16, min_cycles=4, cold_pick=cold_pick)
        run(choice, B8, 200, batch=8, gate_pick="drafter")
        picks = run(choice, B2, 60, batch=2, gate_pick="drafter")
        assert picks[0] == first, cold_pick
        assert picks[-10:].count("drafter") >= 9  # B2's own prices, once measured
        assert choice.choose(2, "drafter").reason.startswith("options at B<=2")
    nearest = OptionChoice(explore_every=16, min_cycles=4)
    run(nearest, B8, 100, batch=8, gate_pick="drafter")
    run(nearest, B2, 100, batch=2, gate_pick="drafter")
    assert nearest.choose(1, "plain").option == "drafter"  # B2 (one bucket away), not B8
    assert "best measured at B<=2" in nearest.choose(1, "plain").reason
    assert nearest.choose(4, "plain").option == "tree"  # B8 and B2 equally near: the larger
    fresh = OptionChoice(explore_every=16, min_cycles=4)
    assert fresh.choose(8, "plain").option == "plain"  # nothing measured anywhere: the gate


def test_a_drafting_option_must_beat_plain_by_the_margin():
    """Within `margin` of plain's rate plain is chosen (what drafting costs outside the priced
    cycles shows there); beyond it the drafting option; margin 0 keeps the bare best rate."""
    close = {"plain": (8, 0.080), "tree": (8.3, 0.080), "drafter": (8, 0.100)}  # tree +3.75 %
    clear = {"plain": (8, 0.080), "tree": (8.6, 0.080), "drafter": (8, 0.100)}  # tree +7.5 %
    for table, margin, want in ((close, 0.05, "plain"), (close, 0.0, "tree"),
                                (clear, 0.05, "tree")):
        choice = OptionChoice(explore_every=16, min_cycles=4, margin=margin)
        picks = run(choice, table, 300)
        assert picks[-100:].count(want) >= 90, (margin, picks[-100:])
    only_drafting = OptionChoice(options=("tree", "drafter"), explore_every=16, min_cycles=4)
    assert run(only_drafting, close, 300)[-100:].count("tree") >= 90  # no plain to hold to


def test_options_are_validated():
    with pytest.raises(ValueError, match="options"):
        OptionChoice(options=("plain", "fast"))
    with pytest.raises(ValueError, match="explore_every"):
        OptionChoice(explore_every=1)
    with pytest.raises(ValueError, match="margin"):
        OptionChoice(margin=1.0)
    with pytest.raises(ValueError, match="cold_pick"):
        OptionChoice(cold_pick="nearest")
    with pytest.raises(ConfigError, match="prompt_lookup"):
        OnlineSpecConfig.from_any({"length_head": {"policy": "budget", "options": ["tree"]}})
    with pytest.raises(ConfigError, match="twice"):
        OnlineSpecConfig.from_any({"length_head": {"policy": "budget",
                                                   "options": ["plain", "plain"]}})
    with pytest.raises(ConfigError, match="options"):
        OnlineSpecConfig.from_any({"length_head": {"options": ["foo"]}})


def cutter(options=None, lookup=True):
    cfg = LengthHeadConfig(policy="budget", k_min=0, explore_every=10**6, options=options,
                           option_explore_every=4)
    c = DraftCutter(cfg, K, cost_model=StepCostModel(a=0.05, b=5e-3, half_life=None,
                                                     prior_weight=1e6), lookup=lookup)
    c.policy.stats = stats_with_rate(0.95)  # the gate alone would draft at K
    return c


def test_the_cutter_runs_the_measured_choice():
    c = cutter()
    assert c.options.options == ("plain", "tree", "drafter")
    for o, (tokens, seconds) in TABLES["tree"].items():
        for _ in range(8):
            c.observe_option(o, 8, tokens, seconds)
    d = c.plan_next(8, 8)
    assert (d.option, d.k) == ("tree", 0) and "tree (best measured)" in d.reason
    assert c.next_option == "tree"
    for o, (tokens, seconds) in TABLES["drafter"].items():
        for _ in range(64):
            c.observe_option(o, 8, tokens, seconds)
    d = c.plan_next(8, 8)
    assert (d.option, d.k) == ("drafter", K)
    # Without a lookup the options are plain and the drafter; ['drafter'] is the gate alone.
    assert cutter(lookup=False).options.options == ("plain", "drafter")
    alone = cutter(options=["drafter"])
    assert alone.options is None and alone.plan_next(8, 8).option is None


def test_tensor_parallel_ranks_draft_what_rank_0_decided():
    """Each rank's gate and options decide from its own timings; the drafter's forward is a
    collective, so every rank adopts rank 0's (k, option) for the step (one int broadcast)."""
    from test_serving_hooks import FakeTpGroup

    from vllm_onlinespec.policy.step_gate import GateDecision
    from vllm_onlinespec.serving.drafting import DraftStage

    wire: list = []
    stages = []
    for rank in (0, 1):
        c = cutter()
        stages.append(DraftStage(None, None, c, None, K, 16, None, tp=FakeTpGroup(rank, wire)))
    # rank 0 measured the tree as cheapest, rank 1 the drafter: they would part ways
    d0 = stages[0].agree(GateDecision(0, False, "r0", option="tree"))
    d1 = stages[1].agree(GateDecision(K, False, "r1", option="drafter"))
    assert (d0.k, d0.option) == (d1.k, d1.option) == (0, "tree")
    assert stages[1].cutter.next_option == "tree" and not wire
    for k, option in ((3, "drafter"), (0, "plain"), (K, None)):
        d0 = stages[0].agree(GateDecision(k, False, "r0", option=option))
        d1 = stages[1].agree(GateDecision(1, False, "r1", option="tree"))
        assert (d1.k, d1.option) == (k, option) == (d0.k, d0.option)
    # one rank: nothing is exchanged
    alone = DraftStage(None, None, cutter(), None, K, 16, None)
    d = GateDecision(2, False, "x", option="drafter")
    assert alone.agree(d) is d
