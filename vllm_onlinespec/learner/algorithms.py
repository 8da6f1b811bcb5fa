"""Online update rules over a fixed list of parameter tensors.

Every rule updates `params` in place (under no_grad) from one gradient list per step and keeps
its state across steps for the life of the learner: in online learning there is no epoch
boundary at which to reset moments. `state_dict()` returns detached clones, so a checkpoint
written later (or from another thread) sees the state of the moment it was taken.

A gradient entry may be None (parameter unused by this batch): that parameter and its state
are left alone, like torch.optim does.

Uniform driver for the learner: `step_closure(closure, check)` where `closure()` computes the
loss and gradients at the *current* values of `params` and returns `(loss: float, grads)`.
Single-model rules call it once; `HedgeEnsemble` calls it once per member with that member's
weights loaded.

Transactions: `step_closure` is all-or-nothing. Before the rule runs it takes an `Undo` of
exactly what the step may change (`snapshot`); if the step or `check()` (the learner's
finiteness test) raises, `restore` puts parameters, per-parameter state, step count and, for
Hedge, member weights, member optimizer states and Hedge weights back bit for bit, and the
exception propagates. `step` itself is the raw rule and is not transactional.

What a snapshot costs (kept between updates and reused, so an update allocates nothing for
it: one undo is alive at a time per rule, and fresh buffers per update made the copies a
measured ~1/8 of a CPU update through page faults alone): one copy of every
parameter that has a gradient and of each state tensor the rule changes *in place*; state the
rule *replaces* (the optimistic hint `prev_u`) is kept by reference, free. In units of the
trainable parameters' bytes: OGD and OptimisticMomentum +3x (p, m, v), Optimistic +2x (p, v),
Hedge over N OGD members +(1 + 3N)x (the served average plus each member's p, m, v). For the
8.7 M-parameter fp32 drafter used here that is ~0.1 GB for OGD; for a 1 B-parameter fp32
drafter it is ~12 GB on top of the ~12 GB the weights and Adam moments already take.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

Grads = Sequence[torch.Tensor | None]
Closure = Callable[[], tuple[float, Grads]]
Check = Callable[[], None]


class NonFiniteUpdate(RuntimeError):
    """An update met a non-finite value (loss, gradient or result); it was undone."""


@dataclass
class Undo:
    """What one step may change, saved before it runs (OnlineAlgorithm.snapshot)."""

    t: int
    state: list[dict[str, torch.Tensor]]  # shallow copies: restores rebound and new slots
    saved: list[tuple[torch.Tensor, torch.Tensor]]  # (tensor the step changes in place, copy)


@dataclass
class HedgeUndo(Undo):
    members: list[Undo] = field(default_factory=list)
    log_w: torch.Tensor | None = None  # replaced by each step, never mutated: a reference
    cum_loss: torch.Tensor | None = None  # likewise
    last_losses: list[float] = field(default_factory=list)


def reuse_buffers(pool: list[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Uninitialised tensors shaped like `like`, taken from `pool` where the shape, dtype and
    device match the same slot and allocated (and kept in `pool`) where not."""
    del pool[len(like):]
    for j, t in enumerate(like):
        if j == len(pool):
            pool.append(torch.empty_like(t, memory_format=torch.preserve_format))
        elif (pool[j].shape, pool[j].dtype, pool[j].device) != (t.shape, t.dtype, t.device):
            pool[j] = torch.empty_like(t, memory_format=torch.preserve_format)
    return list(pool)


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """True when no element of `tensors` is inf or nan, with one host sync. A tensor's sum is
    non-finite exactly when it holds an inf or nan, or when its finite values overflow float32
    together (|values| ~1e32 for a 4 M-element tensor: far beyond any trained weight, and then
    refusing the update is right too); one streaming read instead of isfinite's bool copy."""
    if not tensors:
        return True
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors])
    return bool(torch.isfinite(sums).all())


class OnlineAlgorithm:
    """Base class; subclasses implement `step` and declare their state slots."""

    def __init__(self, params: Sequence[torch.Tensor], lr: float) -> None:
        self.params = list(params)
        self.lr = float(lr)
        self.t = 0  # steps taken
        self._undo_buffers: list[torch.Tensor] = []  # snapshot copies, reused by the next one

    def step(self, grads: Grads) -> None:
        raise NotImplementedError

    def step_closure(self, closure: Closure, check: Check | None = None) -> float:
        loss, grads = closure()
        undo = self.snapshot(grads)
        self._commit_or_undo(undo, lambda: self.step(grads), check)
        return float(loss)

    def _commit_or_undo(self, undo: Undo, run: Callable[[], None], check: Check | None) -> None:
        try:
            run()
            if check is not None:
                check()
        except BaseException:
            self.restore(undo)
            raise

    def _check(self, grads: Grads) -> None:
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")

    # -- undo -----------------------------------------------------------------------------------
    # Slots a step *rebinds* to a new tensor instead of changing in place: the snapshot keeps
    # the old reference instead of a copy. Every other slot is copied (safe by default).
    _rebound_slots: tuple[str, ...] = ()

    @torch.no_grad()
    def snapshot(self, grads: Grads) -> Undo:
        """Everything step(grads) may change: only parameters with a gradient (the others and
        their state are left alone by contract) and their in-place state slots."""
        self._check(grads)
        live = []
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            live.append(p.detach())
            live.extend(s for name, s in self.state[i].items()
                        if name not in self._rebound_slots)
        return Undo(t=self.t, state=[dict(st) for st in self.state],
                    saved=list(zip(live, self._undo_copies(live))))

    @torch.no_grad()
    def _undo_copies(self, live: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of `live` in this rule's reused undo buffers (valid until the next call)."""
        copies = reuse_buffers(self._undo_buffers, live)
        if copies:
            torch._foreach_copy_(copies, list(live))
        return copies

    @torch.no_grad()
    def restore(self, undo: Undo) -> None:
        for live, copy in undo.saved:
            live.copy_(copy)
        # Slots created by the failed step are absent from the shallow copies; rebound ones
        # point at their old tensors again.
        self.state = [dict(st) for st in undo.state]
        self.t = undo.t

    # -- memory ---------------------------------------------------------------------------------
    @torch.no_grad()
    def reserve(self) -> None:
        """Allocate now what the first updates would allocate: every in-place state slot (the
        zeros `_slot` would create at the first step: the update is the same) and the undo
        buffers of a snapshot of every parameter. Called before vLLM profiles memory, so the
        learner's steady state counts against vLLM's budget instead of failing after the KV
        cache took the device."""
        live = []
        for i, p in enumerate(self.params):
            live.append(p.detach())
            live.extend(self._slot(i, n) for n in self._slots if n not in self._rebound_slots)
        self._undo_copies(live)

    def held_tensors(self) -> list[torch.Tensor]:
        """Tensors this rule owns besides the parameters: state slots and undo buffers."""
        return [t for st in self.state for t in st.values()] + list(self._undo_buffers)

    def transient_slots(self) -> int:
        """Per-parameter tensors a step allocates anew (rebound slots): the old and the new one
        are alive together while it runs."""
        return len(self._rebound_slots)

    # -- state ----------------------------------------------------------------------------------
    _slots: tuple[str, ...] = ()  # names of per-parameter state tensors

    def _init_state(self) -> None:
        self.state: list[dict[str, torch.Tensor]] = [{} for _ in self.params]

    def _slot(self, i: int, name: str) -> torch.Tensor:
        st = self.state[i]
        if name not in st:
            st[name] = torch.zeros_like(self.params[i], memory_format=torch.preserve_format)
        return st[name]

    def state_dict(self) -> dict:
        return {"type": type(self).__name__, "t": self.t, "lr": self.lr,
                "state": [{k: v.detach().clone() for k, v in st.items()} for st in self.state]}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("type") != type(self).__name__:
            raise ValueError(f"state is for {sd.get('type')}, not {type(self).__name__}")
        if len(sd["state"]) != len(self.params):
            raise ValueError(f"state has {len(sd['state'])} parameters, expected "
                             f"{len(self.params)}")
        new = []
        for p, st in zip(self.params, sd["state"]):
            for k, v in st.items():
                if k not in self._slots or v.shape != p.shape:
                    raise ValueError(f"bad state entry {k!r} {tuple(v.shape)} for parameter "
                                     f"{tuple(p.shape)}")
            new.append({k: v.detach().to(p.device, p.dtype).clone() for k, v in st.items()})
        self.state = new
        self.t = int(sd["t"])
        self.lr = float(sd["lr"])


class OGD(OnlineAlgorithm):
    """Online gradient descent with AdamW preconditioning; the same arithmetic as
    torch.optim.AdamW's single-tensor path, state kept across the whole stream."""

    _slots = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Sequence[torch.Tensor], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        self._init_state()
        self._denom_buffers: list[torch.Tensor] = []

    @torch.no_grad()
    def reserve(self) -> None:
        super().reserve()
        reuse_buffers(self._denom_buffers, [self._slot(i, "exp_avg_sq")
                                            for i in range(len(self.params))])

    def held_tensors(self) -> list[torch.Tensor]:
        return super().held_tensors() + list(self._denom_buffers)

    @torch.no_grad()
    def step(self, grads: Grads) -> None:
        self._check(grads)
        self.t += 1
        b1, b2 = self.betas
        bc1 = 1 - b1 ** self.t
        bc2_sqrt = math.sqrt(1 - b2 ** self.t)
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return
        ps, gs = [self.params[i] for i in idx], [grads[i] for i in idx]
        ms = [self._slot(i, "exp_avg") for i in idx]
        vs = [self._slot(i, "exp_avg_sq") for i in idx]
        # AdamW's single-tensor arithmetic (p *= 1 - lr wd; m = lerp(m, g, 1 - b1);
        # v = b2 v + (1 - b2) g^2; p -= lr / bc1 * m / (sqrt(v) / bc2_sqrt + eps)), one
        # multi-tensor op per line (the same kernels per element, so bit-identical) with the
        # denominator in reused buffers: the update is memory-bound on a CPU, and fresh sqrt
        # outputs cost page faults every update.
        if self.weight_decay:  # p * 1.0 is p: skip a whole pass over the weights without decay
            torch._foreach_mul_(ps, 1 - self.lr * self.weight_decay)
        torch._foreach_lerp_(ms, gs, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        denom = reuse_buffers(self._denom_buffers, vs)
        for d, v in zip(denom, vs):
            torch.sqrt(v, out=d)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-self.lr / bc1)


class Optimistic(OnlineAlgorithm):
    """Optimistic online gradient descent (Rakhlin & Sridharan 2013; hint = last gradient).

    Two-step form: theta_{t+1} = theta_t - lr * (2 u_t - u_{t-1}), first step u_1, where u_t is
    the gradient after preconditioning. With `precondition="rms"` (default, what the learner
    uses) u_t = g_t / (sqrt(v_hat_t) + eps) with v the bias-corrected EMA of g^2 (Adam's second
    moment, no first moment); u_{t-1} is kept as it was computed, with its own preconditioner,
    which is the exact two-step form of optimistic mirror descent. With `precondition="none"`
    it is the textbook rule theta -= lr * (2 g_t - g_{t-1}). Weight decay is decoupled.
    """

    _slots = ("exp_avg_sq", "prev_u")
    _rebound_slots = ("prev_u",)  # step() stores a new tensor there, never writes into it

    def __init__(self, params: Sequence[torch.Tensor], lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, precondition: str = "rms") -> None:
        super().__init__(params, lr)
        if precondition not in ("rms", "none"):
            raise ValueError(f"precondition must be 'rms' or 'none' (got {precondition!r})")
        self.betas, self.eps, self.weight_decay = tuple(betas), eps, weight_decay
        self.precondition = precondition
        self._init_state()

    def _direction(self, i: int, g: torch.Tensor) -> torch.Tensor:
        if self.precondition == "none":
            return g.clone()
        b2 = self.betas[1]
        v = self._slot(i, "exp_avg_sq")
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        return g / (v.sqrt() / math.sqrt(1 - b2 ** self.t)).add_(self.eps)

    @torch.no_grad()
    def step(self, grads: Grads) -> None:
        self._check(grads)
        self.t += 1
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            u = self._direction(i, g)
            prev = self.state[i].get("prev_u")
            d = u if prev is None else 2 * u - prev
            p.mul_(1 - self.lr * self.weight_decay)
            p.add_(d, alpha=-self.lr)
            self.state[i]["prev_u"] = u


class OptimisticMomentum(Optimistic):
    """Optimistic Adam (Daskalakis et al. 2018): the optimistic correction 2 u_t - u_{t-1} is
    applied to the preconditioned *momentum* u_t = m_hat_t / (sqrt(v_hat_t) + eps), and the
    momentum m persists across steps (and across the whole stream). `precondition="none"` gives
    u_t = m_hat_t (optimistic heavy-ball SGD)."""

    _slots = ("exp_avg", "exp_avg_sq", "prev_u")

    def _direction(self, i: int, g: torch.Tensor) -> torch.Tensor:
        b1, b2 = self.betas
        m = self._slot(i, "exp_avg")
        m.lerp_(g, 1 - b1)
        m_hat = m / (1 - b1 ** self.t)
        if self.precondition == "none":
            return m_hat
        v = self._slot(i, "exp_avg_sq")
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        return m_hat / (v.sqrt() / math.sqrt(1 - b2 ** self.t)).add_(self.eps)


def hedge_log_weights(log_w: torch.Tensor, losses: torch.Tensor, eta: float,
                      share: float) -> torch.Tensor:
    """One Hedge round with fixed share (Herbster & Warmuth 1998), in the log domain, float64.

    Exponential update w'_i ~ w_i exp(-eta l_i), normalised; then every member gets back a
    share of the mass: w_i = (1 - share) w'_i + share / N. share = 0 is plain Hedge, whose
    weights are exp(-eta L_i) / sum_j exp(-eta L_j) for cumulative losses L; with share > 0 no
    weight falls below share / N, so a member that becomes the best after a drift regains the
    lead within about log(N / share) / (eta * loss gap) rounds instead of as many rounds as the
    old leader spent ahead."""
    z = log_w - eta * losses
    z = z - torch.logsumexp(z, dim=0)
    if share > 0:
        n = z.numel()
        z = torch.logaddexp(z + math.log1p(-share), torch.full_like(z, math.log(share / n)))
        z = z - torch.logsumexp(z, dim=0)  # (1 - s) + s sums to 1 only up to rounding
    return z


class HedgeEnsemble(OnlineAlgorithm):
    """Hedge over N learners that differ in learning rate.

    Each member owns a copy of the trainable parameters and its own inner rule. Per step every
    member's loss on the fresh batch is measured *before* that member updates; the Hedge
    weights take one exponential step with learning rate `eta` on those losses, then a fixed
    share `share` of the mass is spread uniformly (see hedge_log_weights; log domain, float64,
    so large losses never overflow). The served `params` are then set to the p-weighted
    average of the members' parameters. Averaging is meaningful because all members start
    from the same weights and move by small online steps. `cum_loss` keeps each member's
    cumulative loss (a statistic; the weights are the state `log_weights`).
    """

    def __init__(self, params: Sequence[torch.Tensor], lrs: Sequence[float],
                 eta: float | None = None,
                 member_factory: Callable[[list[torch.Tensor], float], OnlineAlgorithm]
                 | None = None, share: float = 0.0, *, eps: float | None = None) -> None:
        """eta: Hedge learning rate per unit of loss (default 0.1; `eps` is its old name, still
        accepted). share: fixed-share mixing in [0, 1) (0 = plain Hedge)."""
        super().__init__(params, lr=max(lrs))
        eta = eta if eta is not None else (eps if eps is not None else 0.1)
        if len(lrs) < 1 or eta <= 0 or not 0 <= share < 1:
            raise ValueError("need >= 1 learning rate, eta > 0 and 0 <= share < 1")
        self.lrs = [float(x) for x in lrs]
        self.eta = float(eta)
        self.share = float(share)
        factory = member_factory or (lambda ps, lr: OGD(ps, lr=lr))
        self.members = [[p.detach().clone() for p in self.params] for _ in self.lrs]
        self.algos = [factory(ps, lr) for ps, lr in zip(self.members, self.lrs)]
        n = len(self.lrs)
        self.log_w = torch.full((n,), -math.log(n), dtype=torch.float64)
        self.cum_loss = torch.zeros(n, dtype=torch.float64)
        self.last_losses: list[float] = [float("nan")] * n

    @property
    def log_weights(self) -> torch.Tensor:
        return self.log_w

    @property
    def weights(self) -> torch.Tensor:
        """Current Hedge weights p (float64, sums to 1)."""
        return self.log_w.exp()

    @torch.no_grad()
    def load_member(self, i: int) -> None:
        """Copy member i's parameters into the served params (for evaluating it)."""
        for p, q in zip(self.params, self.members[i]):
            p.copy_(q)

    @torch.no_grad()
    def _write_average(self) -> None:
        w = self.weights.tolist()
        for j, p in enumerate(self.params):
            acc = torch.zeros_like(p, dtype=torch.float32)
            for wi, mem in zip(w, self.members):
                acc.add_(mem[j].float(), alpha=wi)
            p.copy_(acc)

    def step(self, grads: Sequence[Grads],  # type: ignore[override]
             losses: Sequence[float] | None = None) -> None:
        """One gradient list and one pre-update loss per member."""
        if losses is None or len(losses) != len(self.members) or len(grads) != len(self.members):
            raise ValueError(f"need {len(self.members)} gradient lists and losses")
        if not all(math.isfinite(x) for x in losses):
            raise NonFiniteUpdate(f"non-finite member loss {list(losses)}")
        self.t += 1
        lt = torch.tensor([float(x) for x in losses], dtype=torch.float64)
        # Rebound, never written in place: an Undo keeps the old tensors by reference.
        self.cum_loss = self.cum_loss + lt
        self.log_w = hedge_log_weights(self.log_w, lt, self.eta, self.share)
        self.last_losses = [float(x) for x in losses]
        for algo, g in zip(self.algos, grads):
            algo.step(g)
        self._write_average()

    @torch.no_grad()
    def reserve(self) -> None:
        for algo in self.algos:
            algo.reserve()
        self._undo_copies([p.detach() for p in self.params])

    def held_tensors(self) -> list[torch.Tensor]:
        members = [q for mem in self.members for q in mem]
        return members + [t for a in self.algos for t in a.held_tensors()] + list(self._undo_buffers)

    def transient_slots(self) -> int:
        return max((a.transient_slots() for a in self.algos), default=0)

    @torch.no_grad()
    def snapshot(self, grads: Sequence[Grads],  # type: ignore[override]
                 served: list[torch.Tensor] | None = None) -> HedgeUndo:
        """Members' own snapshots, the Hedge weights, and the served average (all of it: it is
        rewritten from every member). `served`: copies of the served params already taken."""
        if len(grads) != len(self.members):
            raise ValueError(f"need {len(self.members)} gradient lists")
        if served is None:
            served = self._undo_copies([p.detach() for p in self.params])
        return HedgeUndo(t=self.t, state=[], saved=list(zip(self.params, served)),
                         members=[a.snapshot(g) for a, g in zip(self.algos, grads)],
                         log_w=self.log_w, cum_loss=self.cum_loss,
                         last_losses=self.last_losses)

    @torch.no_grad()
    def restore(self, undo: Undo) -> None:
        assert isinstance(undo, HedgeUndo)
        for algo, u in zip(self.algos, undo.members):
            algo.restore(u)
        for live, copy in undo.saved:
            live.copy_(copy)
        self.t = undo.t
        self.log_w, self.cum_loss = undo.log_w, undo.cum_loss
        self.last_losses = undo.last_losses

    def _check_members(self) -> None:
        # A member that went non-finite would poison every later average: refuse the step.
        for i, mem in enumerate(self.members):
            if not all_finite(mem):
                raise NonFiniteUpdate(f"ensemble member {i} (lr {self.lrs[i]:g}) after its update")

    def step_closure(self, closure: Closure, check: Check | None = None) -> float:
        """Evaluate every member first, then update all, as one transaction: a failure in any
        evaluation, member update or `check` leaves members, their optimizer states, the
        Hedge weights and the served average bit-identical to before."""
        p_before = self.weights
        # Evaluation loads each member into the served params: keep them to put back exactly
        # (re-averaging would not reproduce the initial weights bit for bit).
        served = self._undo_copies([p.detach() for p in self.params])
        losses, grads = [], []
        try:
            for i in range(len(self.members)):
                self.load_member(i)
                loss, g = closure()
                losses.append(float(loss))
                grads.append(list(g))
        except BaseException:
            with torch.no_grad():
                for p, b in zip(self.params, served):
                    p.copy_(b)
            raise
        undo = self.snapshot(grads, served=served)

        def run() -> None:
            self.step(grads, losses)
            self._check_members()

        self._commit_or_undo(undo, run, check)
        # The loss the served mixture "paid" this round, in Hedge's own accounting.
        return float((p_before * torch.tensor(losses, dtype=torch.float64)).sum())

    def state_dict(self) -> dict:
        return {"type": type(self).__name__, "t": self.t, "lrs": list(self.lrs), "eta": self.eta,
                "share": self.share, "log_weights": self.log_w.clone(),
                "cum_loss": self.cum_loss.clone(),
                "members": [[q.detach().clone() for q in mem] for mem in self.members],
                "algos": [a.state_dict() for a in self.algos]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Also loads checkpoints written before fixed share existed: those have `eps` (the old
        name of eta) and no `share` / `log_weights`; their weights follow from cum_loss, and
        the share stays what this ensemble was built with."""
        if sd.get("type") != type(self).__name__ or len(sd["members"]) != len(self.members):
            raise ValueError(f"state is not for a {len(self.members)}-member HedgeEnsemble")
        for mem, saved in zip(self.members, sd["members"]):
            if len(saved) != len(mem) or any(a.shape != b.shape for a, b in zip(mem, saved)):
                raise ValueError("HedgeEnsemble member parameter shapes differ")
        for mem, saved in zip(self.members, sd["members"]):
            for q, s in zip(mem, saved):
                q.copy_(s)
        for algo, s in zip(self.algos, sd["algos"]):
            algo.load_state_dict(s)
        self.cum_loss = sd["cum_loss"].detach().to(torch.float64).clone()
        self.t = int(sd["t"])
        self.lrs = [float(x) for x in sd["lrs"]]
        self.eta = float(sd["eta"] if "eta" in sd else sd["eps"])
        self.share = float(sd.get("share", self.share))
        if "log_weights" in sd:
            self.log_w = sd["log_weights"].detach().to(torch.float64).clone()
        else:
            self.log_w = torch.log_softmax(-self.eta * self.cum_loss, dim=0)
        self._write_average()


def make_algorithm(cfg, params: Sequence[torch.Tensor]) -> OnlineAlgorithm:
    """The update rule an OnlineSpecConfig asks for (its `update` section)."""
    u = cfg.update
    kw = dict(betas=tuple(u.betas), eps=u.adam_eps, weight_decay=u.weight_decay)
    if u.algorithm == "ogd":
        return OGD(params, lr=u.lr, **kw)
    if u.algorithm == "optimistic":
        return Optimistic(params, lr=u.lr, **kw)
    if u.algorithm == "optimistic_momentum":
        return OptimisticMomentum(params, lr=u.lr, **kw)
    if u.algorithm == "ensemble":
        return HedgeEnsemble(params, u.ensemble_lrs, eta=u.hedge_lr, share=u.hedge_share,
                             member_factory=lambda ps, lr: OGD(ps, lr=lr, **kw))
    raise ValueError(f"unknown algorithm {u.algorithm!r}")
