"""Off-policy corrections between the behaviour policy (the rollout engine that sampled the tokens) and the proximal
policy (the training engine's recomputed old log-probs), and the metrics that watch the gap between them.

Three policies meet in one update: π_behav sampled the response (vLLM's log-probs, ``rollout_logprobs``), π_prox is
the training engine's policy before this update (``old_logprobs``, recomputed by Megatron) and π_θ is the policy being
optimised. They differ because the rollout ran on older weights (asynchronous or stale rollouts) and because two
engines never compute exactly the same probabilities (kernels, precision). The corrections reweight each token by
r = π_prox / π_behav:

* :func:`rollout_is_weights` — truncated IS (``tis``: w = min(r, upper)) or masked IS (``mask``: tokens or rows with
  r outside [lower, upper] leave the loss, the rest keep w = r), per token or per sequence (the product of the row's
  token ratios, summed in log space). ``actor.rollout_is*``; used with any policy loss.
* decoupled PPO (:func:`~verl_mega.algos.policy_losses.compute_policy_loss_decoupled_ppo`) — the PPO clip taken
  against π_prox, times the token weight r (optionally truncated). ``actor.policy_loss=decoupled_ppo``.

:func:`off_policy_sums` and :func:`off_policy_metrics` give the step's ``rollout/*`` metrics from sums that add up
over micro-batches and data-parallel ranks. Formulas: docs/algorithms.md, "Off-policy corrections".
"""

from __future__ import annotations

from typing import NamedTuple

import torch


__all__ = [
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "OffPolicyWeights",
    "off_policy_metrics",
    "off_policy_sums",
    "rollout_is_weights",
]

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_IS_MODES = ("tis", "mask")
_LOG_RATIO_LIMIT = 20.0  # |log r| is clamped here so that exp() stays finite


class OffPolicyWeights(NamedTuple):
    """Per-token correction of a [B, T] batch: ``weights`` (detached, 0 outside ``mask``) multiply the per-token
    policy loss; ``mask`` is the response mask with rejected tokens removed (aggregate the loss with it);
    ``truncated`` marks tokens whose weight was cut down to the upper bound."""

    weights: torch.Tensor
    mask: torch.Tensor
    truncated: torch.Tensor


def _dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)  # float64 stays float64; bf16/fp16 are lifted to float32


def behaviour_log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor,
                        response_mask: torch.Tensor) -> torch.Tensor:
    """log π_prox − log π_behav per token, 0 outside the response mask (padding never leaks into a row's sum)."""
    dtype = _dtype(old_log_prob)
    diff = old_log_prob.to(dtype) - rollout_log_prob.to(dtype)
    return torch.where(response_mask.bool(), diff, torch.zeros_like(diff))


def rollout_is_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "tis",
    upper: float | None = 2.0,
    lower: float | None = None,
) -> OffPolicyWeights:
    """Importance weights π_prox / π_behav of the sampled tokens.

    ``level="token"``: r_t = exp(log π_prox,t − log π_behav,t); ``level="sequence"``: r_b = exp(Σ_t m (log π_prox,t −
    log π_behav,t)) — the product of the row's token ratios, taken in log space — on every token of the row. Log-ratios
    are clamped to [−20, 20] before exp().

    * ``mode="tis"``: w = min(r, upper); ``upper=None`` leaves r untruncated. The mask is unchanged.
    * ``mode="mask"``: tokens (rows) with r outside [lower, upper] leave the mask; the rest keep w = r. ``lower=None``
      means 1 / upper.
    """
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"unknown actor.rollout_is '{level}'; choose one of: {', '.join(ROLLOUT_IS_LEVELS)}")
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"unknown actor.rollout_is_mode '{mode}'; choose one of: {', '.join(ROLLOUT_IS_MODES)}")
    if upper is None and mode == "mask":
        raise ValueError("rollout IS mode 'mask' needs an upper ratio bound")
    if mode == "mask":
        lower = 1.0 / upper if lower is None else lower
        if not 0.0 < lower < upper:
            raise ValueError(f"rollout IS thresholds need 0 < lower < upper, got lower={lower}, upper={upper}")
    elif upper is not None and upper <= 0:
        raise ValueError(f"rollout IS upper bound must be > 0, got {upper}")
    with torch.no_grad():
        valid = response_mask.bool()
        log_ratio = behaviour_log_ratio(old_log_prob, rollout_log_prob, response_mask)
        if level == "sequence":
            log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
        ratio = torch.exp(torch.clamp(log_ratio, min=-_LOG_RATIO_LIMIT, max=_LOG_RATIO_LIMIT))
        if mode == "tis":
            keep = valid
            truncated = valid & (ratio > upper) if upper is not None else torch.zeros_like(valid)
            weights = torch.clamp(ratio, max=upper) if upper is not None else ratio
        else:
            keep = valid & (ratio >= lower) & (ratio <= upper)
            truncated = torch.zeros_like(valid)
            weights = ratio
        mask = response_mask * keep.to(response_mask.dtype)
        weights = torch.where(keep, weights, torch.zeros_like(weights)).to(old_log_prob.dtype)
    return OffPolicyWeights(weights, mask, truncated)


# Order of the entries of off_policy_sums: every one is a plain sum, so they add up over micro-batches and ranks.
_SUMS = ("tokens", "kept_tokens", "weight_sum", "truncated", "masked", "log_ratio_sum", "k3_sum")


def off_policy_sums(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor,
                    correction: OffPolicyWeights | None = None) -> torch.Tensor:
    """Float64 sums over the response tokens, for :func:`off_policy_metrics` after an all-reduce: tokens, tokens the
    loss keeps, Σ of their weights, truncated tokens, masked tokens, Σ (log π_behav − log π_prox) and Σ (r − 1 −
    log r) with r = π_prox / π_behav per token (clamped like the weights). ``correction=None``: no correction is
    applied (every weight 1, nothing truncated or masked)."""
    with torch.no_grad():
        mask = response_mask.to(torch.float64)
        d = behaviour_log_ratio(old_log_prob, rollout_log_prob, response_mask).to(torch.float64)
        d = torch.clamp(d, min=-_LOG_RATIO_LIMIT, max=_LOG_RATIO_LIMIT)
        k3 = torch.where(response_mask.bool(), torch.exp(d) - 1.0 - d, torch.zeros_like(d))
        tokens = mask.sum()
        if correction is None:
            kept, weight_sum, truncated = tokens, tokens, torch.zeros((), dtype=torch.float64)
        else:
            kept_mask = correction.mask.to(torch.float64)
            kept = kept_mask.sum()
            weight_sum = (correction.weights.to(torch.float64) * kept_mask).sum()
            truncated = (correction.truncated.to(torch.float64) * mask).sum()
        return torch.stack([tokens, kept, weight_sum, truncated, tokens - kept, -(d * mask).sum(), k3.sum()]).cpu()


def off_policy_metrics(sums: torch.Tensor, *, corrected: bool = True) -> dict[str, float]:
    """The step's metrics from :func:`off_policy_sums` summed over the batch (every rank's share):

    * ``rollout/behaviour_kl``: mean over response tokens of log π_behav − log π_prox, the k1 estimate of
      KL(π_behav ‖ π_prox) from the behaviour policy's samples; ``rollout/behaviour_kl_k3``: the non-negative,
      lower-variance k3 estimate, mean of r − 1 − log r;
    * with ``corrected``: ``rollout/is_weight_mean`` (mean weight over the response tokens the loss keeps),
      ``rollout/is_clip_frac`` (share of response tokens whose weight was truncated) and ``rollout/is_mask_frac``
      (share of response tokens masked out).
    """
    s = dict(zip(_SUMS, sums.to(torch.float64).tolist()))
    tokens = max(s["tokens"], 1.0)
    out = {"rollout/behaviour_kl": s["log_ratio_sum"] / tokens, "rollout/behaviour_kl_k3": s["k3_sum"] / tokens}
    if corrected:
        out.update({"rollout/is_weight_mean": s["weight_sum"] / max(s["kept_tokens"], 1.0),
                    "rollout/is_clip_frac": s["truncated"] / tokens, "rollout/is_mask_frac": s["masked"] / tokens})
    return out
