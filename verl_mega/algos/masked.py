"""Masked reductions over [B, T] token tensors (mask = 1 on response tokens, 0 on padding)."""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["masked_sum", "masked_mean", "masked_var", "masked_whiten"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set (``where`` rather than a product, so NaN/inf in padding cannot leak)."""
    masked = torch.where(mask.bool(), values, torch.zeros_like(values)) * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked entries; 0 where nothing is masked in (instead of NaN)."""
    total = masked_sum(values, mask, dim)
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return torch.where(count > 0, total / count.clamp_min(torch.finfo(values.dtype).tiny), torch.zeros_like(total))


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all masked entries; Bessel-corrected when ``unbiased``; 0 when fewer than 2 entries."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    count = mask.to(values.dtype).sum()
    if unbiased:
        var = torch.where(count > 1, var * count / (count - 1).clamp_min(1.0), torch.zeros_like(var))
    return var


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8,
    batch_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with mean/var over the masked entries of the whole batch; 0 outside the mask.

    ``shift_mean=False`` keeps the original mean (only rescales). Fewer than 2 masked entries give var 0, so the
    result is the centred value scaled by 1/sqrt(eps) — which is 0 because the single entry equals the mean.
    ``batch_sum``: when the batch is split over ranks, sums a tensor over them (mean and variance are then those
    of the whole batch); None: ``values`` is the whole batch.
    """
    if batch_sum is None:
        mean = masked_mean(values, mask)
        var = masked_var(values, mask)
    else:
        count = batch_sum(mask.to(values.dtype).sum())
        mean = batch_sum(masked_sum(values, mask)) / count.clamp_min(1.0)
        var = batch_sum(masked_sum((values - mean) ** 2, mask)) / (count - 1).clamp_min(1.0)
        var = torch.where(count > 1, var, torch.zeros_like(var))
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
