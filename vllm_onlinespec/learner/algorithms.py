"""Online update rules over a fixed list of parameter tensors.

Every rule updates `params` in place (under no_grad) from one gradient list per step and keeps
its state across steps for the life of the learner: in online learning there is no epoch
boundary at which to reset moments. `state_dict()` returns detached clones, so a checkpoint
written later (or from another thread) sees the state of the moment it was taken.

A gradient entry may be None (parameter unused by this batch): that parameter and its state
are left alone, like torch.optim does.

Uniform driver for the learner: `step_closure(closure)` where `closure()` computes the loss and
gradients at the *current* values of `params` and returns `(loss: float, grads)`. Single-model
rules call it once; `HedgeEnsemble` calls it once per member with that member's weights loaded.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

Grads = Sequence[torch.Tensor | None]
Closure = Callable[[], tuple[float, Grads]]


class OnlineAlgorithm:
    """Base class; subclasses implement `step`, `_state` and `_load_state`."""

    def __init__(self, params: Sequence[torch.Tensor], lr: float) -> None:
        self.params = list(params)
        self.lr = float(lr)
        self.t = 0  # steps taken

    def step(self, grads: Grads) -> None:
        raise NotImplementedError

    def step_closure(self, closure: Closure) -> float:
        loss, grads = closure()
        self.step(grads)
        return float(loss)

    def _check(self, grads: Grads) -> None:
        if len(grads) != len(self.params):
            raise ValueError(f"got {len(grads)} gradients for {len(self.params)} parameters")

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

    @torch.no_grad()
    def step(self, grads: Grads) -> None:
        self._check(grads)
        self.t += 1
        b1, b2 = self.betas
        bc1 = 1 - b1 ** self.t
        bc2_sqrt = math.sqrt(1 - b2 ** self.t)
        for i, (p, g) in enumerate(zip(self.params, grads)):
            if g is None:
                continue
            m, v = self._slot(i, "exp_avg"), self._slot(i, "exp_avg_sq")
            p.mul_(1 - self.lr * self.weight_decay)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / bc2_sqrt).add_(self.eps)
            p.addcdiv_(m, denom, value=-self.lr / bc1)


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


class HedgeEnsemble(OnlineAlgorithm):
    """Hedge over N learners that differ in learning rate.

    Each member owns a copy of the trainable parameters and its own inner rule. Per step every
    member's loss on the fresh batch is measured *before* that member updates and added to its
    cumulative loss L_i; the weights are p_i = exp(-eps L_i) / sum_j exp(-eps L_j) (computed by
    log-sum-exp in float64, so large L never overflows); the served `params` are then set to the
    p-weighted average of the members' parameters. Averaging is meaningful because all members
    start from the same weights and move by small online steps.
    """

    def __init__(self, params: Sequence[torch.Tensor], lrs: Sequence[float], eps: float = 0.1,
                 member_factory: Callable[[list[torch.Tensor], float], OnlineAlgorithm]
                 | None = None) -> None:
        super().__init__(params, lr=max(lrs))
        if len(lrs) < 1 or eps <= 0:
            raise ValueError("need >= 1 learning rate and eps > 0")
        self.lrs = [float(x) for x in lrs]
        self.eps = float(eps)
        factory = member_factory or (lambda ps, lr: OGD(ps, lr=lr))
        self.members = [[p.detach().clone() for p in self.params] for _ in self.lrs]
        self.algos = [factory(ps, lr) for ps, lr in zip(self.members, self.lrs)]
        self.cum_loss = torch.zeros(len(self.lrs), dtype=torch.float64)
        self.last_losses: list[float] = [float("nan")] * len(self.lrs)

    @property
    def log_weights(self) -> torch.Tensor:
        z = -self.eps * self.cum_loss
        return z - torch.logsumexp(z, dim=0)

    @property
    def weights(self) -> torch.Tensor:
        """Current Hedge weights p (float64, sums to 1)."""
        return self.log_weights.exp()

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
            raise ValueError(f"non-finite member loss {list(losses)}")
        self.t += 1
        self.cum_loss += torch.tensor([float(x) for x in losses], dtype=torch.float64)
        self.last_losses = [float(x) for x in losses]
        for algo, g in zip(self.algos, grads):
            algo.step(g)
        self._write_average()

    def step_closure(self, closure: Closure) -> float:
        """Evaluate every member first, then update all: a failure in any evaluation leaves
        members, cumulative losses and the served average as they were."""
        p_before = self.weights
        losses, grads = [], []
        try:
            for i in range(len(self.members)):
                self.load_member(i)
                loss, g = closure()
                losses.append(float(loss))
                grads.append(list(g))
        except BaseException:
            self._write_average()
            raise
        self.step(grads, losses)
        # The loss the served mixture "paid" this round, in Hedge's own accounting.
        return float((p_before * torch.tensor(losses, dtype=torch.float64)).sum())

    def state_dict(self) -> dict:
        return {"type": type(self).__name__, "t": self.t, "lrs": list(self.lrs), "eps": self.eps,
                "cum_loss": self.cum_loss.clone(),
                "members": [[q.detach().clone() for q in mem] for mem in self.members],
                "algos": [a.state_dict() for a in self.algos]}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
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
        self.eps = float(sd["eps"])
        self._write_average()


def make_algorithm(cfg, params: Sequence[torch.Tensor]) -> OnlineAlgorithm:
    """The update rule an OnlineSpecConfig asks for."""
    kw = dict(betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if cfg.algorithm == "ogd":
        return OGD(params, lr=cfg.lr, **kw)
    if cfg.algorithm == "optimistic":
        return Optimistic(params, lr=cfg.lr, **kw)
    if cfg.algorithm == "optimistic_momentum":
        return OptimisticMomentum(params, lr=cfg.lr, **kw)
    if cfg.algorithm == "ensemble":
        return HedgeEnsemble(params, cfg.ensemble_lrs, eps=cfg.hedge_eps,
                             member_factory=lambda ps, lr: OGD(ps, lr=lr, **kw))
    raise ValueError(f"unknown algorithm {cfg.algorithm!r}")
