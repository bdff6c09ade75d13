"""Advantage estimators: GAE, GRPO, RLOO, REINFORCE++ (with/without baseline), ReMax.

All functions take token-level rewards ``[B, T]`` (for outcome rewards: the score sits on the last response token and
zeros elsewhere) and ``response_mask [B, T]`` (1 on response tokens), and return ``(advantages, returns)`` of shape
``[B, T]``, zero outside the mask. Outcome-based estimators (GRPO, RLOO, REINFORCE++-baseline) use the per-sequence
score ``sum_t rewards[b, t] * mask[b, t]`` and group samples by ``group_index`` (one id per row: rows generated from
the same prompt share an id). Formulas and config keys: docs/algorithms.md.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Hashable, Sequence

import torch

from verl_mega.algos.masked import masked_whiten

__all__ = [
    "AdvantageEstimator",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "outcome_to_token_rewards",
]

GroupIndex = torch.Tensor | Sequence[Hashable] | Any  # tensor, numpy array or list of prompt ids
BatchSum = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the ranks that share a batch


class AdvantageEstimator(str, Enum):
    """Values accepted by ``algorithm.adv_estimator``."""

    GAE = "gae"
    GRPO = "grpo"
    DR_GRPO = "dr_grpo"  # GRPO's group baseline without the std division (Liu et al. 2025)
    RLOO = "rloo"
    REINFORCE_PLUS_PLUS = "reinforce_plus_plus"
    REINFORCE_PLUS_PLUS_BASELINE = "reinforce_plus_plus_baseline"
    REMAX = "remax"


def _check_bt(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    if tensor.shape != like.shape:
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but response_mask has {tuple(like.shape)}; "
            "pass [batch, response_len] tensors aligned with the response tokens"
        )


def _float_mask(response_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [batch, response_len], got shape {tuple(response_mask.shape)}")
    return response_mask.to(dtype)


def _sequence_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row outcome score in float64 (group statistics are then exact enough for any batch size)."""
    return (token_level_rewards.double() * mask.double()).sum(dim=-1)


def _group_ids(group_index: GroupIndex, batch_size: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary prompt ids (ints, strings, uuids; tensor/array/list) to dense ids 0..G-1."""
    if isinstance(group_index, torch.Tensor):
        flat = group_index.reshape(-1).cpu()
        if flat.numel() != batch_size:
            raise ValueError(f"group_index has {flat.numel()} entries but the batch has {batch_size} rows")
        _, inverse = torch.unique(flat, return_inverse=True)
        return inverse.long(), int(inverse.max().item()) + 1 if batch_size else 0
    items = list(group_index.tolist() if hasattr(group_index, "tolist") else group_index)
    if len(items) != batch_size:
        raise ValueError(f"group_index has {len(items)} entries but the batch has {batch_size} rows")
    dense: dict[Hashable, int] = {}
    ids = [dense.setdefault(item, len(dense)) for item in items]
    return torch.tensor(ids, dtype=torch.long), len(dense)


def _group_stats(scores: torch.Tensor, ids: torch.Tensor, num_groups: int):
    """Per-row group size, group sum, group mean and unbiased group std (float64)."""
    ids = ids.to(scores.device)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=scores.device)
    counts = zeros.clone().index_add_(0, ids, torch.ones_like(scores))
    sums = zeros.clone().index_add_(0, ids, scores)
    means = sums / counts.clamp_min(1.0)
    sq_dev = zeros.clone().index_add_(0, ids, (scores - means[ids]) ** 2)
    stds = torch.sqrt(sq_dev / (counts - 1.0).clamp_min(1.0))
    return counts[ids], sums[ids], means[ids], stds[ids]


def _broadcast(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_row.to(device=mask.device, dtype=mask.dtype).unsqueeze(-1) * mask


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    batch_sum: BatchSum | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016).

    delta_t = r_t + gamma * V_{t+1} - V_t;  A_t = delta_t + gamma * lam * A_{t+1}, over the masked tokens only
    (masked-out positions inside a row — e.g. tool output in multi-turn — are skipped: V_{t+1} and A_{t+1} are taken
    from the next *masked* token). Returns = A + V (before whitening). Advantages are whitened over the whole batch's
    masked tokens when ``whiten``.
    """
    _check_bt("token_level_rewards", token_level_rewards, response_mask)
    _check_bt("values", values, response_mask)
    with torch.no_grad():
        work = torch.promote_types(values.dtype, torch.float32)  # the recursion accumulates: never in bf16/fp16
        mask = _float_mask(response_mask, work)
        rewards = token_level_rewards.to(work)
        values = values.to(work)
        next_value = torch.zeros_like(values[:, 0])
        last_gae = torch.zeros_like(values[:, 0])
        advantages = torch.zeros_like(values)
        for t in reversed(range(values.shape[-1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            gae = delta + gamma * lam * last_gae
            m = mask[:, t]
            next_value = values[:, t] * m + (1.0 - m) * next_value
            last_gae = gae * m + (1.0 - m) * last_gae
            advantages[:, t] = last_gae
        returns = (advantages + values) * mask
        advantages = masked_whiten(advantages, mask, batch_sum=batch_sum) if whiten else advantages * mask
    return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): A_i = (s_i - mean_g) / (std_g + epsilon), std unbiased, broadcast over the response.

    ``norm_adv_by_std_in_grpo=False`` gives Dr.GRPO's A_i = s_i - mean_g. Groups of one sample get advantage 0
    (no baseline exists; verl instead passes the raw score through). All-equal rewards give 0.
    """
    _check_bt("token_level_rewards", token_level_rewards, response_mask)
    mask = _float_mask(response_mask, token_level_rewards.dtype)
    scores = _sequence_scores(token_level_rewards, mask)
    ids, num_groups = _group_ids(group_index, scores.shape[0])
    counts, _, means, stds = _group_stats(scores, ids, num_groups)
    adv = scores - means
    if norm_adv_by_std_in_grpo:
        adv = adv / (stds + epsilon)
    adv = torch.where(counts > 1, adv, torch.zeros_like(adv))
    adv = _broadcast(adv, mask)
    return adv, adv.clone()


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): A_i = s_i - mean of the *other* samples of the group. Single-sample groups: 0."""
    _check_bt("token_level_rewards", token_level_rewards, response_mask)
    mask = _float_mask(response_mask, token_level_rewards.dtype)
    scores = _sequence_scores(token_level_rewards, mask)
    ids, num_groups = _group_ids(group_index, scores.shape[0])
    counts, sums, _, _ = _group_stats(scores, ids, num_groups)
    leave_one_out = (sums - scores) / (counts - 1.0).clamp_min(1.0)
    adv = torch.where(counts > 1, scores - leave_one_out, torch.zeros_like(scores))
    adv = _broadcast(adv, mask)
    return adv, adv.clone()


def compute_reinforce_plus_plus_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    batch_sum: BatchSum | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): G_t = sum_{k>=t} gamma^{k-t} r_k (within the response), A = whiten(G) over the batch.

    The sum runs over the masked tokens only, like GAE: a masked-out position inside a row (tool output in
    multi-turn) is skipped — the return carries across it and it does not count as a discounting step — and its
    reward is ignored.
    """
    _check_bt("token_level_rewards", token_level_rewards, response_mask)
    with torch.no_grad():
        work = torch.promote_types(token_level_rewards.dtype, torch.float32)
        mask = _float_mask(response_mask, work)
        rewards = token_level_rewards.to(work)
        returns = torch.zeros_like(rewards)
        running = torch.zeros_like(rewards[:, 0])
        for t in reversed(range(rewards.shape[-1])):
            # Only masked-in tokens update the return; tail padding leaves it at 0 until the response starts.
            running = torch.where(mask[:, t] > 0, rewards[:, t] + gamma * running, running)
            returns[:, t] = running
        returns = returns * mask
        advantages = masked_whiten(returns, mask, batch_sum=batch_sum)
    dtype = token_level_rewards.dtype
    return advantages.to(dtype), returns.to(dtype)


def compute_reinforce_plus_plus_baseline_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: GroupIndex,
    batch_sum: BatchSum | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: A = whiten(s_i - mean_g) over all masked tokens of the batch.

    Single-sample groups have s_i - mean_g = 0 before the global whitening.
    """
    _check_bt("token_level_rewards", token_level_rewards, response_mask)
    mask = _float_mask(response_mask, token_level_rewards.dtype)
    scores = _sequence_scores(token_level_rewards, mask)
    ids, num_groups = _group_ids(group_index, scores.shape[0])
    _, _, means, _ = _group_stats(scores, ids, num_groups)
    centred = _broadcast(scores - means, mask)
    adv = masked_whiten(centred, mask, batch_sum=batch_sum)
    return adv, adv.clone()


def compute_remax_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): G_t = sum_{k>=t} r_k; A_t = G_t - b, where b [B] is the greedy response's reward."""
    _check_bt("token_level_rewards", token_level_rewards, response_mask)
    mask = _float_mask(response_mask, token_level_rewards.dtype)
    if reward_baselines.reshape(-1).shape[0] != mask.shape[0]:
        raise ValueError(
            f"reward_baselines has {reward_baselines.numel()} entries but the batch has {mask.shape[0]} rows; "
            "pass one greedy-baseline reward per row"
        )
    masked_rewards = token_level_rewards * mask
    returns = masked_rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1]) * mask
    baselines = reward_baselines.reshape(-1).to(device=mask.device, dtype=mask.dtype)
    advantages = returns - baselines.unsqueeze(-1) * mask
    return advantages, returns


def outcome_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Token-level rewards [B, T] holding each sequence's outcome score [B] on its last response token (the last
    position where the mask is set), zeros elsewhere; rows with an empty mask get nothing."""
    mask = _float_mask(response_mask, torch.float32).bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values
    scores = scores.reshape(-1).to(device=mask.device)
    rewards = torch.zeros(mask.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32,
                          device=mask.device)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = scores[rows].to(rewards.dtype)
    return rewards


def _require(name: str, value: Any, estimator: str) -> Any:
    if value is None:
        raise ValueError(f"advantage estimator '{estimator}' needs `{name}`; pass it to compute_advantage")
    return value


def compute_advantage(
    name: str | AdvantageEstimator,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    group_index: GroupIndex | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    batch_sum: BatchSum | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on ``algorithm.adv_estimator``. Inputs an estimator does not use are ignored, so the trainer can pass
    everything it has; a missing required input raises a one-line error.

    The batch may be one data-parallel rank's rows: group estimators then need each group's rows on the same rank,
    and ``batch_sum`` (a sum over the ranks) makes whitening see the whole batch."""
    try:
        estimator = AdvantageEstimator(name)
    except ValueError:
        choices = ", ".join(e.value for e in AdvantageEstimator)
        raise ValueError(f"unknown algorithm.adv_estimator '{name}'; choose one of: {choices}") from None
    key = estimator.value
    if estimator is AdvantageEstimator.GAE:
        return compute_gae_advantage_return(
            token_level_rewards, _require("values", values, key), response_mask, gamma=gamma, lam=lam,
            batch_sum=batch_sum,
        )
    if estimator in (AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO):
        return compute_grpo_outcome_advantage(
            token_level_rewards,
            response_mask,
            _require("group_index", group_index, key),
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo and estimator is AdvantageEstimator.GRPO,
            epsilon=epsilon,
        )
    if estimator is AdvantageEstimator.RLOO:
        return compute_rloo_outcome_advantage(
            token_level_rewards, response_mask, _require("group_index", group_index, key)
        )
    if estimator is AdvantageEstimator.REINFORCE_PLUS_PLUS:
        return compute_reinforce_plus_plus_advantage(token_level_rewards, response_mask, gamma=gamma,
                                                     batch_sum=batch_sum)
    if estimator is AdvantageEstimator.REINFORCE_PLUS_PLUS_BASELINE:
        return compute_reinforce_plus_plus_baseline_advantage(
            token_level_rewards, response_mask, _require("group_index", group_index, key), batch_sum=batch_sum
        )
    return compute_remax_advantage(
        token_level_rewards, response_mask, _require("reward_baselines", reward_baselines, key)
    )
