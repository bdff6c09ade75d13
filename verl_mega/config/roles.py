"""Config sections of the RL roles: `actor`, `critic`, `ref` and `reward`.

Batch sizes follow verl: algorithmic sizes are global and counted in prompts (each prompt brings `rollout.n`
samples); performance sizes are per GPU and counted in samples (`*_per_gpu`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from verl_mega.config.base import ConfigError, ConfigSection, FrozenDict, fmt, option
from verl_mega.config.hub import expand_home

KLEstimator = Literal["kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm",
                      "token-sum"]
PolicyLoss = Literal["vanilla", "gspo", "cispo", "clip_cov", "kl_cov", "decoupled_ppo"]
# Keys read by one policy loss only, and the value their null takes when that loss is selected (the papers' values).
POLICY_LOSS_OPTIONS: dict[str, dict[str, float]] = {
    "gspo": {"gspo_clip_ratio_low": 3e-4, "gspo_clip_ratio_high": 4e-4},
    "clip_cov": {"clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 1.0},
}
ROLLOUT_IS_DEFAULT_THRESHOLD = 2.0


@dataclass(frozen=True, kw_only=True)
class TrainableRoleConfig(ConfigSection):
    """Optimizer, LR schedule, batching and offload keys shared by the actor and the critic."""

    lr: float = option(1e-6, help="Peak learning rate (Adam).")
    min_lr: float = option(0.0, help="Learning rate at the end of the decay.")
    weight_decay: float = option(0.01, help="Decoupled (AdamW) weight decay.")
    adam_beta1: float = option(0.9, help="Adam beta1.")
    adam_beta2: float = option(0.999, help="Adam beta2.")
    adam_eps: float = option(1e-8, help="Adam epsilon.")
    grad_clip: float = option(1.0, help="Clip the global gradient norm to this value; 0 disables clipping.")
    lr_warmup_steps: int = option(0, help="Linear warm-up steps from 0 to `lr`.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = option("constant", help="LR decay after warm-up.")
    lr_decay_steps: int | None = option(
        None, help="Steps over which the LR decays to `min_lr`; null uses the run length (trainer.total_steps).")
    ppo_mini_batch_size: int = option(256, help="Prompts per optimizer step (global); each brings rollout.n samples.")
    micro_batch_size_per_gpu: int = option(
        4, help="Samples per forward/backward pass on one GPU (gradient accumulation unit).", affects_results=False)
    ppo_epochs: int = option(1, help="Passes over each rollout batch.")
    use_dynamic_bsz: bool = option(False, help="Pack micro-batches by token budget (`max_tokens_per_gpu`) instead of "
                                               "a fixed sample count (the actor's also sets the reference's "
                                               "log-prob passes).", affects_results=False)
    max_tokens_per_gpu: int = option(16384, help="Token budget of one micro-batch when `use_dynamic_bsz` is on.",
                                     affects_results=False)
    shuffle: bool = option(False, help="Shuffle samples before splitting a batch into mini-batches.")
    offload_params: bool = option(False, help="Move parameters to CPU while this role is idle.",
                                  affects_results=False)
    offload_grads: bool = option(False, help="Move gradient buffers to CPU while this role is idle.",
                                 affects_results=False)
    offload_optimizer: bool = option(False, help="Move optimizer state to CPU while this role is idle.",
                                     affects_results=False)

    def validate(self) -> None:
        self._check_range("lr", ge=0.0, example=1e-6)
        self._check_range("min_lr", ge=0.0)
        self._require(self.min_lr <= self.lr, f"{self.key('min_lr')}={self.min_lr!r} exceeds {self.key('lr')}="
                                              f"{self.lr!r}; set {self.key('min_lr')} <= {self.key('lr')}")
        self._check_range("weight_decay", ge=0.0)
        self._check_range("adam_beta1", ge=0.0, lt=1.0, example=0.9)
        self._check_range("adam_beta2", ge=0.0, lt=1.0, example=0.999)
        self._check_range("adam_eps", gt=0.0, example=1e-8)
        self._check_range("grad_clip", ge=0.0, example=1.0)
        self._check_range("lr_warmup_steps", ge=0)
        self._check_range("lr_decay_steps", ge=1)
        for name in ("ppo_mini_batch_size", "micro_batch_size_per_gpu", "ppo_epochs", "max_tokens_per_gpu"):
            self._check_range(name, ge=1)


@dataclass(frozen=True, kw_only=True)
class ActorConfig(TrainableRoleConfig):
    """The policy: its loss (`policy_loss`: PPO clip with dual-clip, GSPO, CISPO, Clip-Cov, KL-Cov or decoupled PPO),
    entropy bonus, optional KL loss against the reference, optional off-policy correction between the rollout
    (behaviour) policy and the training engine's old (proximal) policy. Formulas: docs/algorithms.md."""

    SECTION: ClassVar[str] = "actor"

    log_prob_micro_batch_size_per_gpu: int | None = option(
        None, help="Samples per forward-only pass when recomputing log-probs; null uses `micro_batch_size_per_gpu`.",
        affects_results=False)
    policy_loss: PolicyLoss = option(
        "vanilla", help="Policy loss: vanilla (PPO clip + dual-clip), gspo (sequence-level ratio), cispo (clipped, "
                        "detached IS weight × log-prob), clip_cov / kl_cov (covariance-selected tokens lose their "
                        "gradient / get a KL penalty), decoupled_ppo (AReaL: vanilla's clip against the training "
                        "engine's old log-probs, times the weight π_old/π_rollout per token, for stale or mismatched "
                        "rollouts). verl calls it actor.policy_loss.loss_mode.")
    clip_ratio_low: float = option(0.2, help="PPO ratio clip below 1: ratio >= 1 - clip_ratio_low (vanilla, "
                                             "decoupled_ppo, clip_cov; the IS-weight clip of cispo).")
    clip_ratio_high: float = option(0.2, help="PPO ratio clip above 1: ratio <= 1 + clip_ratio_high "
                                              "(raise it for DAPO-style clip-higher; vanilla, decoupled_ppo, "
                                              "clip_cov, cispo).")
    clip_ratio_c: float = option(3.0, help="Dual-clip bound for negative advantages (> 1); vanilla and "
                                           "decoupled_ppo.")
    gspo_clip_ratio_low: float | None = option(
        None, help="GSPO: sequence-ratio clip below 1; only with policy_loss=gspo, where null uses 3e-4 (the GSPO "
                   "paper's value).")
    gspo_clip_ratio_high: float | None = option(
        None, help="GSPO: sequence-ratio clip above 1; only with policy_loss=gspo, where null uses 4e-4.")
    clip_cov_ratio: float | None = option(
        None, help="Clip-Cov: share of tokens whose gradient is dropped; only with policy_loss=clip_cov, where null "
                   "uses 2e-4.")
    clip_cov_lb: float | None = option(
        None, help="Clip-Cov: lower covariance bound of the tokens eligible for dropping; only with "
                   "policy_loss=clip_cov, where null uses 1.0.")
    clip_cov_ub: float | None = option(
        None, help="Clip-Cov: upper covariance bound of the tokens eligible for dropping; only with "
                   "policy_loss=clip_cov, where null uses 5.0.")
    kl_cov_ratio: float | None = option(
        None, help="KL-Cov: share of tokens (largest covariance) given the KL penalty; only with "
                   "policy_loss=kl_cov, where null uses 2e-4.")
    ppo_kl_coef: float | None = option(
        None, help="KL-Cov: coefficient of the |log ratio| penalty; only with policy_loss=kl_cov, where null uses "
                   "1.0.")
    behaviour_weight_cap: float | None = option(
        None, help="Decoupled PPO: truncate the behaviour weight π_old/π_rollout of each token at this value (> 1; "
                   "AReaL's behav_imp_weight_cap zeroes a token's weight above the cap instead); only with "
                   "policy_loss=decoupled_ppo, where null leaves it untruncated.")
    rollout_is: Literal["token", "sequence"] | None = option(
        None, help="Correct the policy loss for the rollout engine sampling from slightly different probabilities "
                   "than training computes: importance weights π_train/π_rollout per token, or their product per "
                   "sequence; null disables.")
    rollout_is_mode: Literal["tis", "mask"] | None = option(
        None, help="tis: weights truncated at rollout_is_threshold multiply the token losses; mask: tokens "
                   "(sequences) whose ratio is outside [rollout_is_threshold_lower, rollout_is_threshold] leave the "
                   "loss, the rest are weighted by their ratio. Only with rollout_is, where null uses tis.")
    rollout_is_threshold: float | None = option(
        None, help=f"Upper ratio bound (> 1); only with rollout_is, where null uses {ROLLOUT_IS_DEFAULT_THRESHOLD}.")
    rollout_is_threshold_lower: float | None = option(
        None, help="Lower ratio bound (0 < lower <= 1); only with rollout_is_mode=mask, where null uses "
                   "1 / rollout_is_threshold.")
    routing_replay: Literal["none", "r2", "r3"] = option(
        "none", help="Mixture-of-Experts routing replay (Megatron's router replay): r2 records every token's experts "
                     "in the old-log-prob pass and replays them in the policy update, so training routes as the "
                     "ratio's denominator did; r3 records the experts vLLM routed every prompt and response token to "
                     "in the rollout and replays them in the old-log-prob pass and the update, so training routes "
                     "as generation did (needs a vLLM that returns routed experts; single-turn rollouts). Logs "
                     "`actor/router_agreement`, the share of replayed experts the routers would pick themselves "
                     "(r3 also `rollout/router_agreement`, in the old-log-prob pass). Needs model.recompute=none.")
    entropy_coeff: float = option(0.0, help="Weight of the entropy bonus in the actor loss.")
    loss_agg_mode: LossAggMode = option(
        "token-mean", help="How token losses are aggregated into the batch loss: token-mean, seq-mean-token-sum, "
                           "seq-mean-token-mean, seq-mean-token-sum-norm (Dr. GRPO, constant horizon "
                           "rollout.max_response_length) or token-sum (no normalisation).")
    use_kl_loss: bool = option(False, help="Add a KL(actor‖ref) term to the actor loss (GRPO style); needs the "
                                           "reference policy.")
    kl_loss_coef: float = option(0.001, help="Weight of the KL loss term.")
    kl_loss_type: KLEstimator = option("low_var_kl", help="KL estimator of the loss term: kl (= k1), abs, mse (= k2), "
                                                          "low_var_kl (= k3).")

    def validate(self) -> None:
        super().validate()
        if self.log_prob_micro_batch_size_per_gpu is None:
            self._set("log_prob_micro_batch_size_per_gpu", self.micro_batch_size_per_gpu)
        self._check_range("log_prob_micro_batch_size_per_gpu", ge=1)
        self._check_range("clip_ratio_low", ge=0.0, lt=1.0, example=0.2)
        self._check_range("clip_ratio_high", ge=0.0, example=0.2)
        self._check_range("clip_ratio_c", gt=1.0, example=3.0)
        self._check_range("kl_loss_coef", ge=0.0, example=0.001)
        self._validate_policy_loss()
        self._validate_rollout_is()
        self._validate_decoupled_ppo()

    def _validate_policy_loss(self) -> None:
        for loss, options in POLICY_LOSS_OPTIONS.items():
            for name, default in options.items():
                value = getattr(self, name)
                if self.policy_loss == loss and value is None:
                    self._set(name, default)
                elif self.policy_loss != loss and value is not None:
                    raise ConfigError(f"actor.{name}={fmt(value)} is only read by actor.policy_loss={loss}, but "
                                      f"actor.policy_loss={self.policy_loss}; set actor.policy_loss={loss} or "
                                      f"actor.{name}=null")
        self._check_range("gspo_clip_ratio_low", ge=0.0, lt=1.0, example=3e-4)
        self._check_range("gspo_clip_ratio_high", ge=0.0, example=4e-4)
        self._check_range("clip_cov_ratio", gt=0.0, le=1.0, example=2e-4)
        self._check_range("kl_cov_ratio", gt=0.0, le=1.0, example=2e-4)
        self._check_range("ppo_kl_coef", ge=0.0, example=1.0)
        if self.policy_loss == "clip_cov":
            self._require(self.clip_cov_lb < self.clip_cov_ub,
                          f"actor.clip_cov_lb={fmt(self.clip_cov_lb)} must be < actor.clip_cov_ub="
                          f"{fmt(self.clip_cov_ub)}; set e.g. actor.clip_cov_lb=1.0 and actor.clip_cov_ub=5.0")
        if self.policy_loss == "gspo":
            # The paper's gradient weighs each sequence equally and its tokens by 1/|y|: seq-mean-token-mean exactly.
            self._require(self.loss_agg_mode == "seq-mean-token-mean",
                          f"actor.policy_loss=gspo clips a per-sequence ratio and needs "
                          f"actor.loss_agg_mode=seq-mean-token-mean, got {fmt(self.loss_agg_mode)}; set "
                          f"actor.loss_agg_mode=seq-mean-token-mean")

    def _validate_decoupled_ppo(self) -> None:
        cap = self.behaviour_weight_cap
        if self.policy_loss != "decoupled_ppo":
            self._require(cap is None, f"actor.behaviour_weight_cap={fmt(cap)} is only read by "
                                       f"actor.policy_loss=decoupled_ppo, but actor.policy_loss={self.policy_loss}; "
                                       f"set actor.policy_loss=decoupled_ppo or actor.behaviour_weight_cap=null")
            return
        self._check_range("behaviour_weight_cap", gt=1.0, example=5.0)
        self._require(self.rollout_is is None,
                      f"actor.policy_loss=decoupled_ppo already weights every token by π_old/π_rollout, "
                      f"actor.rollout_is={self.rollout_is} would correct the same gap twice; set actor.rollout_is=null")

    def _validate_rollout_is(self) -> None:
        names = ("rollout_is_mode", "rollout_is_threshold", "rollout_is_threshold_lower")
        if self.rollout_is is None:
            for name in names:
                value = getattr(self, name)
                self._require(value is None, f"actor.{name}={fmt(value)} has no effect while actor.rollout_is=null; "
                                             f"set actor.rollout_is=token (or sequence), or actor.{name}=null")
            return
        if self.rollout_is_mode is None:
            self._set("rollout_is_mode", "tis")
        if self.rollout_is_threshold is None:
            self._set("rollout_is_threshold", ROLLOUT_IS_DEFAULT_THRESHOLD)
        self._check_range("rollout_is_threshold", gt=1.0, example=ROLLOUT_IS_DEFAULT_THRESHOLD)
        upper, lower = self.rollout_is_threshold, self.rollout_is_threshold_lower
        if self.rollout_is_mode == "tis":
            self._require(lower is None, f"actor.rollout_is_threshold_lower={fmt(lower)} is only read by "
                                         f"actor.rollout_is_mode=mask (tis only truncates from above); set "
                                         f"actor.rollout_is_mode=mask or actor.rollout_is_threshold_lower=null")
            return
        if lower is None:
            self._set("rollout_is_threshold_lower", 1.0 / upper)
            return
        suggestion = round(1.0 / upper, 4)
        self._check_range("rollout_is_threshold_lower", gt=0.0, example=suggestion)
        self._require(lower < upper, f"actor.rollout_is_threshold_lower={fmt(lower)} must be below "
                                     f"actor.rollout_is_threshold={fmt(upper)}; set "
                                     f"actor.rollout_is_threshold_lower={fmt(suggestion)} (or null for 1/upper)")
        # A ratio of 1 means rollout and training agree on the token; such tokens must never be rejected.
        self._require(lower <= 1.0, f"actor.rollout_is_threshold_lower={fmt(lower)} would reject tokens on which "
                                    f"rollout and training agree (ratio 1); set it <= 1, e.g. "
                                    f"actor.rollout_is_threshold_lower={fmt(suggestion)}")


@dataclass(frozen=True, kw_only=True)
class CriticConfig(TrainableRoleConfig):
    """The value model (PPO with GAE): clipped value loss, its own optimizer."""

    SECTION: ClassVar[str] = "critic"

    enable: bool | None = option(None, help="Run a critic; null enables it iff algorithm.adv_estimator is gae.")
    model_path: str | None = option(None, help="HF directory or hub ID to initialise the critic from; null uses "
                                               "model.path (the value head is freshly initialised).")
    lr: float = option(1e-5, help="Peak learning rate (Adam).")
    ppo_mini_batch_size: int | None = option(None, help="Prompts per critic optimizer step; null uses the actor's.")
    ppo_epochs: int | None = option(None, help="Passes over each rollout batch; null uses the actor's.")
    cliprange_value: float = option(0.5, help="Clip range of the value loss around the old values.")

    def validate(self) -> None:
        super().validate()
        self._set("model_path", expand_home(self.model_path))
        self._check_range("cliprange_value", gt=0.0, example=0.5)


@dataclass(frozen=True, kw_only=True)
class RefConfig(ConfigSection):
    """The frozen reference policy (initial actor weights) used for KL."""

    SECTION: ClassVar[str] = "ref"

    enable: bool | None = option(None, help="Compute reference log-probs; null enables it iff a KL is used "
                                            "(algorithm.use_kl_in_reward or actor.use_kl_loss).")
    micro_batch_size_per_gpu: int | None = option(
        None, help="Samples per forward pass; null uses actor.log_prob_micro_batch_size_per_gpu.",
        affects_results=False)
    offload_params: bool = option(False, help="Keep reference weights on CPU between uses.", affects_results=False)

    def validate(self) -> None:
        self._check_range("micro_batch_size_per_gpu", ge=1)


# A built-in name (`gsm8k`), `pkg.module.fn`, `pkg.module:fn`, `path/to/file.py:fn` or `path/to/file.py`.
_REWARD_FN = re.compile(r"[A-Za-z_]\w*((\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?)|[^:\s]+\.py(:[A-Za-z_]\w*)?")


@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig(ConfigSection):
    """DAPO's soft overlong punishment: responses within `len` tokens of rollout.max_response_length lose reward
    linearly, down to -penalty_factor at the limit."""

    SECTION: ClassVar[str] = "reward.overlong_buffer"

    enable: bool = option(False, help="Add the overlong penalty to every response's reward.")
    len: int = option(64, help="Buffer length in tokens before rollout.max_response_length where the penalty starts.")
    penalty_factor: float = option(1.0, help="Penalty at rollout.max_response_length (and beyond).")

    def validate(self) -> None:
        self._check_range("len", ge=1, example=64)
        self._check_range("penalty_factor", ge=0.0, example=1.0)


@dataclass(frozen=True, kw_only=True)
class RewardConfig(ConfigSection):
    """How responses are scored: a rule-based / user function, a reward model, or both (scores are added)."""

    SECTION: ClassVar[str] = "reward"

    function: str | None = option(
        None, help="Reward function: a built-in name (`arithmetic`, `gsm8k`, `math`, `math_dapo`, "
                   "`by_data_source`; docs/algorithms.md), `pkg.module.fn`, `pkg.module:fn` or "
                   "`file.py[:fn]` (default fn: compute_score). Either verl's compute_score(data_source, "
                   "solution_str, ground_truth, extra_info=None) or fn(response, ground_truth, **extras), each also "
                   "batched; a dict return's other values are logged as reward/<key> (docs/from_verl.md). null picks "
                   "the task's own function for `generated:<task>` data, and none when reward.reward_model_path "
                   "is set (the reward model's score is then the whole reward).")
    reward_model_path: str | None = option(None, help="HF directory or hub ID of a reward model: a "
                                                      "sequence-classification checkpoint with one label (e.g. "
                                                      "Qwen2ForSequenceClassification, as verl's reward models), "
                                                      "whose score head rates the last "
                                                      "token; its score is added to reward.function's. A causal LM "
                                                      "is refused. null for function-only rewards.")
    num_workers: int = option(
        2, help="Worker processes (per rank) that run the reward function, off the critical path. A call past "
                "reward.timeout_s, or one that ends its process (os._exit, a crash), scores 0 and its worker is "
                "killed and replaced; the step's metrics count them (reward/timeouts, reward/errors).",
        affects_results=False)
    timeout_s: float = option(30.0, help="Time limit per reward-function call (one sample, or one chunk of a "
                                         "batched function), enforced by killing the worker.")
    max_error_frac: float = option(
        0.1, help="Stop the run with an error naming the function and its first failure when more than this "
                  "fraction of a step's samples failed to score (exception, non-finite or non-number result, "
                  "timeout, crash); the rest of such a batch is not scored. 1.0 never stops.",
        affects_results=False)
    kwargs: Mapping[str, Any] = option(FrozenDict(), help="Extra keyword arguments passed to the reward function "
                                                          "(verl's custom_reward_function.reward_kwargs).")
    overlong_buffer: OverlongBufferConfig = option(factory=OverlongBufferConfig, help="DAPO overlong penalty.")

    def validate(self) -> None:
        self._set("reward_model_path", expand_home(self.reward_model_path))
        if self.function is not None:
            self._require(bool(_REWARD_FN.fullmatch(self.function)),
                          f"reward.function={self.function!r} is not a built-in name, `pkg.module.fn`, "
                          f"`pkg.module:fn` or `file.py[:fn]`; fix reward.function")
        self._require(self.num_workers >= 1, f"reward.num_workers={self.num_workers}: reward functions run in "
                                             f"worker processes, so that a hung or crashing one can be stopped; "
                                             f"set reward.num_workers>=1 (1 suits a cheap function)")
        self._check_range("timeout_s", gt=0.0, example=30.0)
        self._check_range("max_error_frac", ge=0.0, example=0.1)
        self._require(self.max_error_frac <= 1.0, f"reward.max_error_frac={self.max_error_frac} is a fraction of "
                                                  f"the samples; set it in [0, 1] (1.0 never stops)")
