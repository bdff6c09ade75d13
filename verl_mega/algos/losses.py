"""PPO policy/value losses, entropy, and loss aggregation over [B, T] token losses.

Aggregation modes (``actor.loss_agg_mode``), with m the response mask and L the per-token loss:

* ``token-mean``               sum_{b,t} m L / sum_{b,t} m
* ``seq-mean-token-sum``       mean over sequences of sum_t m L
* ``seq-mean-token-mean``      mean over sequences of (sum_t m L / sum_t m)
* ``seq-mean-token-sum-norm``  mean over sequences of (sum_t m L / H), H a constant horizon (Dr.GRPO):
                               ``loss_scale_factor`` if given, else ``mask.shape[-1]``
* ``token-sum``                sum_{b,t} m L (no normalisation)

"Sequences" are rows with at least one masked-in token, so padding rows added to even out micro-batches never count.

Gradient accumulation and data parallelism — one normaliser for the whole mini-batch
------------------------------------------------------------------------------------
Averaging per-micro-batch means is *not* the mean of the whole batch when micro-batches hold different token counts.
To get exactly the gradient of one big batch, the engine should, per optimizer step:

1. on every DP rank, sum ``agg_loss_normalizer(mask_mb, mode)`` over its micro-batches;
2. ``all_reduce(SUM)`` that number over the data-parallel group -> ``n_global``;
3. per micro-batch use ``agg_loss(..., normalizer=n_global)`` (same for the value/entropy/KL terms). Each result is
   that micro-batch's *share*, and the sum over micro-batches and ranks equals the big-batch loss;
   ``token-sum`` has the constant denominator 1 for the whole mini-batch, which no per-micro-batch count can add up
   to: its ``agg_loss_normalizer`` is 0 (so the summed normaliser stays 0) and ``agg_loss`` ignores ``normalizer``;
   each share is the micro-batch's plain token sum and the shares add up to the mini-batch's plain sum;
4. undo the averaging that would otherwise happen on top: with a loss function returning ``(loss, metrics)``,
   megatron-core's schedule multiplies the loss by the CP size and divides it by ``num_microbatches``, and DDP scales
   gradients by 1 / (DP x CP) (``calculate_per_token_loss`` off) — a net 1 / (num_microbatches x DP). So hand
   ``share * num_microbatches * dp_size`` to the schedule.

Context parallelism (rows split across CP ranks) is not covered: token counts would have to be summed over the CP
group too, and ``seq-mean-token-mean`` would need each row's full token count.

With ``normalizer=None`` everything is normalised locally (fine for a single micro-batch on a single rank).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl_mega.algos.masked import masked_mean, masked_sum

__all__ = [
    "LOSS_AGG_MODES",
    "agg_loss",
    "agg_loss_normalizer",
    "compute_policy_loss",
    "compute_value_loss",
    "entropy_from_logits",
    "entropy_bonus",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown actor.loss_agg_mode '{mode}'; choose one of: {', '.join(LOSS_AGG_MODES)}")


def agg_loss_normalizer(mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """This micro-batch's contribution to the global denominator: token count (``token-mean``), the number of
    non-empty rows (``seq-*`` modes) or 0 (``token-sum``, whose denominator is the constant 1). Sum it over
    micro-batches and DP ranks and pass it as ``normalizer``."""
    _check_mode(mode)
    fmask = mask.float()
    if mode == "token-mean":
        return fmask.sum()
    if mode == "token-sum":
        return fmask.new_zeros(())
    return (fmask.sum(dim=-1) > 0).float().sum()


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a [B, T] token loss to a scalar; see the module docstring for modes and ``normalizer``."""
    _check_mode(mode)
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat shape {tuple(loss_mat.shape)} != mask shape {tuple(mask.shape)}")
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)  # the mini-batch denominator is 1 whatever ``normalizer`` says
    if mode in ("token-mean", "seq-mean-token-sum"):
        numerator = masked_sum(loss_mat, mask)
    elif mode == "seq-mean-token-mean":
        row_tokens = mask.to(loss_mat.dtype).sum(dim=-1)
        row_sums = masked_sum(loss_mat, mask, dim=-1)
        row_means = torch.where(row_tokens > 0, row_sums / row_tokens.clamp_min(1e-12), torch.zeros_like(row_sums))
        numerator = row_means.sum()
    else:
        horizon = float(loss_scale_factor) if loss_scale_factor is not None else float(mask.shape[-1])
        if horizon <= 0:
            raise ValueError(f"loss_scale_factor must be > 0 for seq-mean-token-sum-norm, got {horizon}")
        numerator = masked_sum(loss_mat, mask) / horizon
    if normalizer is None:
        normalizer = agg_loss_normalizer(mask, mode)
    denom = torch.as_tensor(normalizer, dtype=numerator.dtype, device=numerator.device)
    return torch.where(denom > 0, numerator / denom.clamp_min(1e-12), torch.zeros_like(numerator))


def compute_policy_loss(
    *,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with asymmetric clip range and dual-clip (Ye et al. 2020): ``actor.policy_loss=vanilla``.

    r = exp(log_prob - old_log_prob) (log-ratio clamped to [-20, 20]);
    L = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)); for A < 0 additionally L = min(L, -A c).
    ``clip_ratio_c=None`` turns dual-clip off. Metrics (masked means over this micro-batch, detached):
    ``clipfrac`` (share of tokens where the clipped term is active), ``approx_kl`` (mean of old - new log-prob),
    ``clipfrac_lower`` (share where the dual-clip bound is active). ``rollout_is_weights`` ([B, T], from
    :func:`~verl_mega.algos.off_policy.rollout_is_weights`) multiply the per-token loss, detached.
    """
    if clip_ratio_low < 0 or clip_ratio_high < 0:
        raise ValueError("actor.clip_ratio_low/clip_ratio_high must be >= 0 (e.g. 0.2)")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"actor.clip_ratio_c must be > 1.0 (e.g. 3.0), or None for no dual-clip; got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses = torch.maximum(losses_unclipped, losses_clipped)
    metrics = {
        "clipfrac": masked_mean(torch.gt(losses_clipped, losses_unclipped).float(), response_mask).detach(),
        "approx_kl": masked_mean(-log_ratio, response_mask).detach(),
    }
    if clip_ratio_c is not None:
        dual_bound = -advantages * clip_ratio_c
        negative = advantages < 0
        pg_losses = torch.where(negative, torch.minimum(clip_losses, dual_bound), clip_losses)
        lower_active = (torch.gt(clip_losses, dual_bound) & negative).float()
        metrics["clipfrac_lower"] = masked_mean(lower_active, response_mask).detach()
    else:
        pg_losses = clip_losses
        metrics["clipfrac_lower"] = torch.zeros((), device=advantages.device)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    loss = agg_loss(
        pg_losses, response_mask, loss_agg_mode, normalizer=normalizer, loss_scale_factor=loss_scale_factor
    )
    return loss, metrics


def compute_value_loss(
    *,
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * agg(max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)).

    ``cliprange_value=None`` gives the plain 0.5 * agg((V - R)^2). Metric ``vf_clipfrac``: share of tokens where the
    clipped term is the larger one.
    """
    if cliprange_value is not None and cliprange_value < 0:
        raise ValueError(f"critic.cliprange_value must be >= 0 (e.g. 0.5) or null, got {cliprange_value}")
    losses = (values - returns) ** 2
    if cliprange_value is None:
        clipped_losses = losses
        clipfrac = torch.zeros((), device=values.device)
    else:
        values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
        losses_clipped = (values_clipped - returns) ** 2
        clipped_losses = torch.maximum(losses, losses_clipped)
        clipfrac = masked_mean(torch.gt(losses_clipped, losses).float(), response_mask).detach()
    loss = 0.5 * agg_loss(
        clipped_losses, response_mask, loss_agg_mode, normalizer=normalizer, loss_scale_factor=loss_scale_factor
    )
    return loss, {"vf_clipfrac": clipfrac}


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(z) - sum softmax(z) z, computed in float32.

    ``chunk_size`` bounds the float32 temporaries for large vocabularies by processing that many rows at a time.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    rows = flat.shape[0] if chunk_size is None else max(1, int(chunk_size))
    out = []
    for start in range(0, flat.shape[0], rows):
        z = flat[start : start + rows].float()
        out.append(torch.logsumexp(z, dim=-1) - (F.softmax(z, dim=-1) * z).sum(dim=-1))
    entropy = torch.cat(out) if out else flat.new_zeros(0, dtype=torch.float32)
    return entropy.reshape(logits.shape[:-1])


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    entropy_coeff: float,
    loss_agg_mode: str = "token-mean",
    *,
    normalizer: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Term to *add* to the policy loss to reward entropy: -entropy_coeff * agg(entropy)."""
    return -entropy_coeff * agg_loss(
        entropy, response_mask, loss_agg_mode, normalizer=normalizer, loss_scale_factor=loss_scale_factor
    )
