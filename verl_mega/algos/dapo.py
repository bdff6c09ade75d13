"""DAPO's data-side pieces (Yu et al. 2025): the soft overlong penalty and dynamic sampling's group filter.

Clip-higher is ``actor.clip_ratio_high`` and token-level aggregation is ``actor.loss_agg_mode=token-mean``.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple

import torch

from verl_mega.algos.advantages import GroupIndex, _group_ids

__all__ = ["DynamicSamplingKeep", "dynamic_sampling_keep", "overlong_buffer_penalty"]


def overlong_buffer_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, one value per response, to add to its reward.

    With L = ``max_response_length`` and B = ``buffer_len``: 0 for |y| <= L − B, then linear down to
    −``penalty_factor`` at |y| = L: (L − B − |y|) / B · penalty_factor; −``penalty_factor`` beyond L.
    """
    if not 0 < buffer_len <= max_response_length:
        raise ValueError(f"overlong buffer_len must be in [1, max_response_length={max_response_length}], "
                         f"got {buffer_len}")
    if penalty_factor < 0:
        raise ValueError(f"overlong penalty_factor must be >= 0, got {penalty_factor}")
    lengths = response_lengths if response_lengths.is_floating_point() else response_lengths.float()
    excess = (lengths - (max_response_length - buffer_len)).clamp(min=0)
    return (-excess / buffer_len * penalty_factor).clamp(min=-penalty_factor)


class DynamicSamplingKeep(NamedTuple):
    """Result of :func:`dynamic_sampling_keep`."""

    rows: torch.Tensor  # bool [B]: the row belongs to a kept group
    groups: list[Hashable]  # ids of the kept groups, in order of first appearance
    stats: dict[str, float]


def dynamic_sampling_keep(scores: torch.Tensor, group_index: GroupIndex, *, atol: float = 0.0) -> DynamicSamplingKeep:
    """DAPO dynamic sampling: keep the groups whose per-sample metric is not all equal.

    ``scores`` [B] is the metric the filter looks at (DAPO uses accuracy; the reward works too) and
    ``group_index`` the prompt id of each row (ints, strings or a tensor). A group whose values span at most
    ``atol`` gives every sample the same group-relative advantage (0) and no gradient, so it is dropped; a group of
    one sample is dropped for the same reason. Stats: ``num_groups``, ``kept_groups``, ``kept_group_frac``,
    ``kept_rows``.
    """
    values = scores.reshape(-1).double().cpu()
    ids, num_groups = _group_ids(group_index, values.shape[0])
    hi = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, ids, values, "amax")
    lo = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, ids, values, "amin")
    keep_group = (hi - lo) > atol
    rows = keep_group[ids]
    raw = group_index.reshape(-1).tolist() if isinstance(group_index, torch.Tensor) else (
        group_index.tolist() if hasattr(group_index, "tolist") else list(group_index))
    kept: list[Hashable] = []
    seen: set[int] = set()
    for item, gid in zip(raw, ids.tolist()):
        if keep_group[gid] and gid not in seen:
            seen.add(gid)
            kept.append(item)
    stats = {"num_groups": float(num_groups), "kept_groups": float(len(kept)),
             "kept_group_frac": len(kept) / num_groups if num_groups else 0.0, "kept_rows": float(rows.sum())}
    return DynamicSamplingKeep(rows.to(scores.device), kept, stats)
