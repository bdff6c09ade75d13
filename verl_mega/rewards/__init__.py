"""Rule-based verifiable rewards, loading of user reward functions, and an asynchronous reward pool.

This package does not import torch, so reward worker processes start fast.
"""

from verl_mega.rewards.loader import BUILTIN_REWARDS, RewardFunction, RewardFunctionError, load_reward_fn, to_score
from verl_mega.rewards.math_reward import (
    arithmetic_score,
    compute_score,
    extract_boxed,
    extract_solution,
    first_integer,
    format_reward,
    numbers_match,
    parse_number,
)
from verl_mega.rewards.pool import RewardBatchResult, RewardFunctionFailed, RewardPool

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "RewardFunctionError",
    "load_reward_fn",
    "to_score",
    "arithmetic_score",
    "compute_score",
    "extract_boxed",
    "extract_solution",
    "first_integer",
    "format_reward",
    "numbers_match",
    "parse_number",
    "RewardBatchResult",
    "RewardPool",
    "RewardFunctionFailed",
]
