"""Policy losses beside PPO's clipped surrogate (the rollout IS weights live in :mod:`verl_mega.algos.off_policy`).

Every loss takes the inputs of :func:`~verl_mega.algos.losses.compute_policy_loss` (``vanilla``): ``log_prob``,
``old_log_prob``, ``advantages``, ``response_mask`` ([B, T]), ``loss_agg_mode``, ``normalizer``,
``loss_scale_factor`` and ``rollout_is_weights``, plus its own parameters, and returns ``(loss, metrics)``; metrics
are detached masked means over the micro-batch. Select one with ``actor.policy_loss``; formulas, defaults and
references: docs/algorithms.md.

Notation: ρ_t = exp(clamp(log π_t − log π_old,t, −20, 20)), A_t the advantage, m the response mask, sg() stop-gradient.

* ``gspo``     (Zheng et al. 2025): s_b = exp(Σ_t m log ρ_t / Σ_t m), the geometric mean of the row's ratios, used
               at token level as s_b,t = sg(s_b) · π_t / sg(π_t) (value s_b, gradient s_b ∇log π_t);
               L_t = max(−A s_b,t, −A clip(s_b,t, 1 − ε_low, 1 + ε_high)). With ``seq-mean-token-mean`` this is the
               paper's sequence-level objective and gradient.
* ``cispo``    (MiniMax-M1, 2025): L_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A_t · log π_t — every token keeps
               a gradient; only the IS weight is clipped.
* ``clip_cov`` (Cui et al. 2025): PPO clip (no dual-clip), then among tokens whose covariance
               c_t = (A_t − mean A) (log π_t − mean log π) lies in (lb, ub) and that the PPO clip left alone,
               max(1, ⌊ratio · N⌋) chosen uniformly at random (N = masked tokens) lose their loss and gradient.
* ``kl_cov``   (Cui et al. 2025): L_t = −A_t ρ_t, plus coef · |log ρ_t| on the max(1, ⌊ratio · N⌋) tokens of
               largest c_t; no clipping.
* ``decoupled_ppo`` (AReaL, Fu et al. 2025): vanilla's clip against the proximal policy (``old_log_prob``), times
               sg(min(π_old,t / π_rollout,t, cap)), the behaviour correction towards the policy that sampled.

Covariance means are taken over the micro-batch's masked tokens (as in the reference implementation).
"""

from __future__ import annotations

from typing import Callable

import torch

from verl_mega.algos.losses import agg_loss, compute_policy_loss
from verl_mega.algos.masked import masked_mean
from verl_mega.algos.off_policy import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    rollout_is_weights as rollout_is_weights_fn,
)

__all__ = [
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "compute_policy_loss_gspo",
    "compute_policy_loss_cispo",
    "compute_policy_loss_clip_cov",
    "compute_policy_loss_decoupled_ppo",
    "compute_policy_loss_kl_cov",
    "get_policy_loss_fn",
]

POLICY_LOSSES = ("vanilla", "gspo", "cispo", "clip_cov", "kl_cov", "decoupled_ppo")

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


def _log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)  # exp() stays finite


def _check_clip(low: float, high: float, keys: str) -> None:
    if low < 0 or high < 0:
        raise ValueError(f"{keys} must be >= 0, got {low} / {high}")


def _aggregate(pg_losses: torch.Tensor, response_mask: torch.Tensor, rollout_is_weights: torch.Tensor | None,
               loss_agg_mode: str, normalizer: torch.Tensor | float | None,
               loss_scale_factor: float | None) -> torch.Tensor:
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    return agg_loss(pg_losses, response_mask, loss_agg_mode, normalizer=normalizer,
                    loss_scale_factor=loss_scale_factor)


def _token_covariance(advantages: torch.Tensor, log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token contribution to Cov(A, log π) over the masked tokens; selection only, so no gradient."""
    with torch.no_grad():
        lp = log_prob.detach()
        return (advantages - masked_mean(advantages, mask)) * (lp - masked_mean(lp, mask))


def compute_policy_loss_gspo(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: clipped surrogate on the sequence-level (geometric-mean) ratio; see the module docstring.

    The defaults 3e-4 / 4e-4 are the paper's clip ranges: a sequence ratio is a mean over many tokens, so it moves
    far less than a token ratio. Metrics: ``clipfrac`` (share of tokens whose row is clipped), ``approx_kl``.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, "actor.gspo_clip_ratio_low/gspo_clip_ratio_high")
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, min=-20.0, max=20.0))
    losses_unclipped = -advantages * seq_ratio
    losses_clipped = -advantages * torch.clamp(seq_ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(losses_unclipped, losses_clipped)
    metrics = {
        "clipfrac": masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), response_mask).detach(),
        "approx_kl": masked_mean(-_log_ratio(log_prob, old_log_prob), response_mask).detach(),
    }
    loss = _aggregate(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, normalizer, loss_scale_factor)
    return loss, metrics


def compute_policy_loss_cispo(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: L_t = −sg(clip(ρ_t, 1 − clip_ratio_low, 1 + clip_ratio_high)) · A_t · log π_t.

    Unlike PPO, a token whose ratio left the trust region still gets the (bounded) gradient −w A ∇log π. Metrics:
    ``clipfrac`` (share of tokens whose IS weight was clipped), ``approx_kl``.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, "actor.clip_ratio_low/clip_ratio_high")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    pg_losses = -advantages * weight * log_prob
    clipped = (ratio < 1.0 - clip_ratio_low) | (ratio > 1.0 + clip_ratio_high)
    metrics = {
        "clipfrac": masked_mean(clipped.float(), response_mask).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    loss = _aggregate(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, normalizer, loss_scale_factor)
    return loss, metrics


def compute_policy_loss_clip_cov(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO clip, and the gradient of a random few high-covariance tokens dropped; see the module docstring.

    ``generator`` (a CPU generator) makes the random choice reproducible; under tensor parallelism every rank
    computes this loss and must pass a generator in the same state, or the ranks drop different tokens. Metrics:
    ``clipfrac`` (PPO clip active), ``covfrac`` (share of tokens dropped by the covariance rule), ``approx_kl``.
    """
    _check_clip(clip_ratio_low, clip_ratio_high, "actor.clip_ratio_low/clip_ratio_high")
    if not 0.0 < clip_cov_ratio <= 1.0:
        raise ValueError(f"actor.clip_cov_ratio must be in (0, 1], got {clip_cov_ratio}")
    if clip_cov_lb >= clip_cov_ub:
        raise ValueError(f"actor.clip_cov_lb={clip_cov_lb} must be < actor.clip_cov_ub={clip_cov_ub}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    valid = response_mask.bool()
    clipped = torch.gt(losses_clipped, losses_unclipped) & valid
    cov = _token_covariance(advantages, log_prob, response_mask)
    eligible = (valid & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)).reshape(-1)
    budget = max(int(clip_cov_ratio * int(valid.sum().item())), 1)
    chosen = torch.nonzero(eligible).squeeze(-1)
    if chosen.numel() > budget:
        pick = torch.randperm(chosen.numel(), generator=generator)[:budget].to(chosen.device)
        chosen = chosen[pick]
    dropped = torch.zeros_like(eligible)
    dropped[chosen] = True
    dropped = dropped.reshape(valid.shape)
    pg_losses = torch.maximum(losses_unclipped, losses_clipped)
    pg_losses = torch.where(dropped, torch.zeros_like(pg_losses), pg_losses)  # no value, no gradient
    metrics = {
        "clipfrac": masked_mean(clipped.float(), response_mask).detach(),
        "covfrac": masked_mean(dropped.float(), response_mask).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    loss = _aggregate(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, normalizer, loss_scale_factor)
    return loss, metrics


def compute_policy_loss_kl_cov(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
    loss_agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: unclipped −A ρ, plus ``ppo_kl_coef`` · |log ρ| on the top ``kl_cov_ratio`` share of tokens by
    covariance (at least one). Metrics: ``covfrac`` (share of penalised tokens), ``approx_kl``, ``abs_kl`` (mean
    |log ρ|)."""
    if not 0.0 < kl_cov_ratio <= 1.0:
        raise ValueError(f"actor.kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
    if ppo_kl_coef < 0:
        raise ValueError(f"actor.ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    log_ratio = _log_ratio(log_prob, old_log_prob)
    pg_losses = -advantages * torch.exp(log_ratio)
    valid = response_mask.bool()
    n_valid = int(valid.sum().item())
    penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if n_valid > 0:
        cov = _token_covariance(advantages, log_prob, response_mask).reshape(-1)
        cov = torch.where(valid.reshape(-1), cov, torch.full_like(cov, -torch.inf))
        penalised[torch.topk(cov, max(1, int(n_valid * kl_cov_ratio))).indices] = True
    penalised = penalised.reshape(valid.shape)
    pg_losses = torch.where(penalised, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    metrics = {
        "covfrac": masked_mean(penalised.float(), response_mask).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
        "abs_kl": masked_mean(log_ratio.abs(), response_mask).detach(),
    }
    loss = _aggregate(pg_losses, response_mask, rollout_is_weights, loss_agg_mode, normalizer, loss_scale_factor)
    return loss, metrics


def compute_policy_loss_decoupled_ppo(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    behaviour_weight_cap: float | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO (AReaL; Fu et al. 2025, arXiv:2505.24298): the PPO clip is taken against the proximal policy
    π_prox (``old_log_prob``, the training engine's recomputed log-probs) and the behaviour policy π_behav that
    sampled the tokens (``rollout_log_prob``) is corrected by the token weight w_t = π_prox,t / π_behav,t:

    L_t = sg(w_t) · max(−A_t u_t, −A_t clip(u_t, 1 − ε_low, 1 + ε_high)), u_t = π_θ,t / π_prox,t, with vanilla's
    dual-clip for A_t < 0 (``clip_ratio_c``). ``behaviour_weight_cap`` truncates w at that value (null: no truncation).
    When π_prox = π_behav every w_t is exactly 1 and the loss is :func:`compute_policy_loss` bit for bit. Further
    ``rollout_is_weights`` multiply on top. Metrics: vanilla's.
    """
    weights = rollout_is_weights_fn(old_log_prob, rollout_log_prob, response_mask, level="token", mode="tis",
                                    upper=behaviour_weight_cap).weights
    if rollout_is_weights is not None:
        weights = weights * rollout_is_weights.detach()
    return compute_policy_loss(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages,
                               response_mask=response_mask, clip_ratio_low=clip_ratio_low,
                               clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                               normalizer=normalizer, loss_scale_factor=loss_scale_factor, rollout_is_weights=weights)


_POLICY_LOSS_FNS: dict[str, PolicyLossFn] = {
    "vanilla": compute_policy_loss,
    "gspo": compute_policy_loss_gspo,
    "cispo": compute_policy_loss_cispo,
    "clip_cov": compute_policy_loss_clip_cov,
    "kl_cov": compute_policy_loss_kl_cov,
    "decoupled_ppo": compute_policy_loss_decoupled_ppo,
}


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The loss named by ``actor.policy_loss``."""
    try:
        return _POLICY_LOSS_FNS[name]
    except KeyError:
        raise ValueError(f"unknown actor.policy_loss '{name}'; choose one of: {', '.join(POLICY_LOSSES)}") from None
