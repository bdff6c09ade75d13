"""RL algorithms as pure tensor functions: advantage estimators, PPO losses, loss aggregation, KL and controllers."""

from verl_mega.algos.advantages import (
    AdvantageEstimator,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_outcome_advantage,
    outcome_to_token_rewards,
)
from verl_mega.algos.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
    make_kl_controller,
)
from verl_mega.algos.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    agg_loss_normalizer,
    compute_policy_loss,
    compute_value_loss,
    entropy_bonus,
    entropy_from_logits,
)
from verl_mega.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "AdvantageEstimator",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "compute_rloo_outcome_advantage",
    "outcome_to_token_rewards",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "compute_kl_loss",
    "kl_penalty",
    "make_kl_controller",
    "LOSS_AGG_MODES",
    "agg_loss",
    "agg_loss_normalizer",
    "compute_policy_loss",
    "compute_value_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]
