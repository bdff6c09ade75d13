"""KL between the policy and the reference: per-token estimators, KL as a reward penalty or a loss term, and the
fixed / adaptive KL-coefficient controllers.

Estimators of KL(pi || pi_ref) from samples of pi, with d = log pi(a) - log pi_ref(a) (Schulman, "Approximating KL
divergence", 2020):

* ``kl`` / ``k1``:        d                        (unbiased, high variance, can be negative)
* ``abs``:                |d|
* ``mse`` / ``k2``:       0.5 d^2
* ``low_var_kl`` / ``k3``: exp(-d) + d - 1, with -d clamped to [-20, 20] and the result clamped to [-10, 10]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from verl_mega.algos.losses import agg_loss
from verl_mega.algos.masked import masked_mean

__all__ = [
    "KL_ESTIMATORS",
    "kl_penalty",
    "apply_kl_penalty",
    "compute_kl_loss",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
]

_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
KL_ESTIMATORS = tuple(_ALIASES)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token KL estimate (same shape as the inputs); see the module docstring for ``kind``."""
    canonical = _ALIASES.get(kind)
    if canonical is None:
        raise ValueError(f"unknown KL estimator '{kind}'; choose one of: {', '.join(KL_ESTIMATORS)}")
    diff = log_prob - ref_log_prob
    if canonical == "k1":
        return diff
    if canonical == "abs":
        return diff.abs()
    if canonical == "k2":
        return 0.5 * diff.square()
    log_ratio_ref = torch.clamp(-diff, min=-20.0, max=20.0)  # log(pi_ref / pi)
    k3 = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0
    return torch.clamp(k3, min=-10.0, max=10.0)


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward (``algorithm.use_kl_in_reward``): r'_t = r_t - coef * kl_t on masked tokens.

    Returns the penalised rewards and metrics: ``kl`` = batch mean of the per-sequence masked-mean KL (feed it to
    the controller's ``update``), ``kl_coef`` = the coefficient used.
    """
    kld = kl_penalty(logprob, ref_logprob, kind) * mask.to(logprob.dtype)
    rewards = token_rewards - coef * kld.to(token_rewards.dtype)
    per_seq = masked_mean(kld, mask, dim=-1)
    current_kl = float(per_seq.mean().item()) if per_seq.numel() else 0.0
    return rewards, {"kl": current_kl, "kl_coef": float(coef)}


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    *,
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """KL as a loss term (``actor.use_kl_loss``): agg(kl_t); the actor adds ``actor.kl_loss_coef`` times this."""
    return agg_loss(
        kl_penalty(log_prob, ref_log_prob, kind),
        response_mask,
        loss_agg_mode,
        normalizer=normalizer,
        loss_scale_factor=loss_scale_factor,
    )


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        if kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {kl_coef}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so both controllers are used the same way)."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive coefficient of Ziegler et al. 2019: e = clip(KL / target - 1, -0.2, 0.2);
    beta <- beta * (1 + e * n_steps / horizon)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if init_kl_coef < 0:
            raise ValueError(f"algorithm.kl_ctrl.kl_coef must be >= 0, got {init_kl_coef}")
        if not target_kl > 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0 for the adaptive controller, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """``n_steps``: samples (sequences) seen since the last update, as in verl."""
        if not math.isfinite(current_kl):
            return  # a NaN KL would poison the coefficient for the rest of the run
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = int(state.get("horizon", self.horizon))


def make_kl_controller(
    type: str = "fixed", kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Build the controller named by ``algorithm.kl_ctrl.type`` (``fixed`` or ``adaptive``)."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown algorithm.kl_ctrl.type '{type}'; choose 'fixed' or 'adaptive'")
