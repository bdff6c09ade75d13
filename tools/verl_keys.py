"""The key table of tools/from_verl.py: every key of verl's PPO trainer configs (``ppo_trainer.yaml``,
``ppo_megatron_trainer.yaml``, verl 0.5 to 0.10) → a verl_mega key, verl_mega's fixed behaviour, or unsupported with
the reason.

A rule is ``(pattern, handler)``; the first pattern (``fnmatch`` over the dotted key, ``{R}`` standing for the
trainable roles ``actor_rollout_ref.actor`` and ``critic``) that matches a key decides (tools/verl_key_handlers.py).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from verl_key_handlers import (  # noqa: I001
    Ctx, Handler, Map, ROLES, Same, Unsupported, _adv, _betas, _clip_ratio, _critic_enable, _critic_path,
    _cudagraph_sizes, _decay_style, _do_sample, _dtype, _filter_overlong, _free_cache, _freq, _gen_dp, _gen_ep,
    _granularity, _kl_type, _launch, _logger, _lora, _loss_mode, _loss_option, _megatron_dim, _micro_global,
    _min_lr_ratio, _multi_turn, _n, _offload, _optimizer, _output_dir, _per_gpu, _recompute, _resume_mode, _resume_path,
    _reward_fn, _reward_kwargs, _rm_path, _rollout_is, _rollout_quantization, _router_replay, _save_contents, _seed,
    _tp_gen, _train_steps, _truncation, _val_temperature, _vllm_engine_kwargs, _warmup, any_on, expand, files, gated,
    off_only, role_key, role_to, same, to, unsupported, when,
)

__all__ = ["RULES", "classify", "Map", "Same", "Unsupported", "Ctx"]

FSDP = ("FSDP engine setting: verl_mega trains with Megatron-Core (parallel.* sets the layout; actor.offload_* the "
        "offloading)")
MCORE_INTERNAL = "Megatron engine setting that verl_mega decides itself"
PROFILER = "verl's profilers (nsys, torch, npu): verl_mega has trainer.profile and docs/profiling.md"
INTERP = "an interpolation of another verl key, converted there"
MTP = "multi-token prediction: not in verl_mega"
VISION = "multi-modal inputs: verl_mega trains text models"
RAY = ("verl's Ray single controller: verl_mega is SPMD (every rank runs the step; launch/ray_launch.py starts it "
       "on Ray)")

RULES: list[tuple[str, Handler]] = [
    # ------------------------------------------------------------ hydra and interpolated copies
    ("*._target_", same("hydra's instantiation target; nothing to map")),
    ("_target_", same("hydra's instantiation target; nothing to map")),
    ("*.rollout_n", same(INTERP)),
    ("actor_rollout_ref.actor.use_remove_padding", same(INTERP)),
    ("actor_rollout_ref.actor.use_fused_kernels", same(INTERP)),
    ("actor_rollout_ref.ref.strategy", same(INTERP)),
    ("actor_rollout_ref.rollout.prompt_length", same("data.max_prompt_length decides")),
    ("actor_rollout_ref.rollout.response_length", to("rollout.max_response_length")),
    ("actor_rollout_ref.rollout.n_gpus_per_node", same(INTERP)),
    ("*.load_contents", same("loads what it saves")),
    # ------------------------------------------------------------ profilers and ops tooling
    ("*.profiler.*", same(PROFILER)),
    ("global_profiler.*", same(PROFILER)),
    ("actor_rollout_ref.rollout.prometheus.*", gated("prometheus", "enable", "vLLM's Prometheus endpoint: not "
                                                                           "exposed")),
    ("actor_rollout_ref.rollout.trace.*", gated("trace", "backend", "rollout tracing (weave/mlflow traces): not in "
                                                                    "verl_mega")),
    ("transfer_queue.*", gated("transfer_queue", "enable", "verl's TransferQueue data system: verl_mega moves samples "
                                                           "between ranks itself (trainer.sample_transport)")),
    ("skip.*", any_on("skip.", "verl's rollout caching for debugging: not in verl_mega")),
    ("distillation.*", gated("distillation", "enabled", "on-policy distillation: not in verl_mega")),
    ("ray_kwargs.*", same(RAY)),
    ("trainer.ray_wait_register_center_timeout", same(RAY)),
    ("trainer.use_legacy_worker_impl", same(RAY)),
    ("trainer.use_v1", same(RAY)),
    ("trainer.v1.trainer_mode", when("sync", "synchronous training, verl_mega's default (rollout.max_staleness=0)",
                                     "verl's asynchronous trainer: verl_mega's is a rollout pool of its own with "
                                     "rollout.max_staleness (docs/async.md)")),
    ("trainer.v1.*", same("settings of verl's asynchronous trainer modes; see trainer.v1.trainer_mode")),
    ("actor_rollout_ref.hybrid_engine", when(True, "colocated rollout and training: verl_mega's default placement",
                                             "a standalone rollout: placement.roles.rollout (docs/async.md)")),
    ("*.nccl_timeout", to("trainer.collective_timeout_s", float)),
    ("sandbox_fusion.*", gated("sandbox_fusion", "url", "a remote code sandbox for rewards: not in verl_mega")),
    ("*.sandbox_fusion.*", gated("sandbox_fusion", "url", "a remote code sandbox for rewards: not in verl_mega")),
    ("*.qat.*", gated("qat", "enable", "quantization-aware training: not in verl_mega")),
    # ------------------------------------------------------------ model
    ("actor_rollout_ref.model.path", to("model.path", expand)),
    ("actor_rollout_ref.model.tokenizer_path", lambda k, v, c: Same("null: model.path") if v is None else
     Map({"model.tokenizer_path": expand(v)})),
    ("actor_rollout_ref.model.trust_remote_code", to("model.trust_remote_code")),
    ("actor_rollout_ref.model.custom_chat_template", lambda k, v, c: Same("the tokenizer's own") if v is None else
     Map({"model.chat_template": v})),
    ("actor_rollout_ref.model.use_remove_padding", to("model.use_remove_padding")),
    ("actor_rollout_ref.model.use_fused_kernels", to("model.fused_kernels")),
    ("*.model.enable_gradient_checkpointing", _recompute),
    ("*.model.enable_activation_offload", off_only("activation offloading: not in verl_mega")),
    ("*.model.override_config.attn_implementation", same("attention through PyTorch SDPA (flash kernels on CUDA) "
                                                          "or Transformer Engine")),
    ("*.model.override_config.*", off_only("HF config overrides: edit the model's config.json")),
    ("*.model.override_config", off_only("HF config overrides: edit the model's config.json")),
    ("*.model.external_lib", off_only("a module imported to register a model class: verl_mega maps HF families "
                                      "itself")),
    ("*.model.hf_config_path", off_only("a separate HF config path: verl_mega reads model.path/config.json")),
    ("*.model.use_shm", same("loading through /dev/shm: verl_mega reads the checkpoint directly")),
    ("*.model.use_liger", off_only("Liger kernels: verl_mega has its own fused kernels (model.fused_kernels)")),
    ("*.model.fused_kernel_options.*", same("verl's fused-kernel backend choice")),
    ("*.model.tiled_mlp.*", gated("tiled_mlp", "enabled", "tiled MLP: not in verl_mega")),
    ("*.model.lora.*", _lora),
    ("*.model.lora_*", _lora),
    ("*.model.target_modules", _lora),
    ("*.model.exclude_modules", _lora),
    ("*.model.mtp.*", gated("mtp", "enable", MTP)),
    ("actor_rollout_ref.rollout.mtp", same(MTP)),
    ("*.model.custom_chat_template", same("the actor's chat template is the one used")),
    ("*.model.tokenizer_path", same("the actor's tokenizer is the one used")),
    ("*.model.trust_remote_code", same("model.trust_remote_code (from the actor's)")),
    ("*.model.use_fused_kernels", same("model.fused_kernels (from the actor's)")),
    ("*.model.use_remove_padding", same("model.use_remove_padding (from the actor's) applies to every role")),
    ("*.model.input_tokenizer", same("the actor's tokenizer")),
    ("critic.model.path", _critic_path),
    ("reward_model.model.path", _rm_path),
    ("reward.reward_model.model_path", _rm_path),
    # ------------------------------------------------------------ optimizer and schedule (actor and critic)
    ("{R}.optim.lr", role_to("lr", float)),
    ("{R}.optim.weight_decay", role_to("weight_decay", float)),
    ("{R}.optim.betas", _betas),
    ("{R}.optim.clip_grad", role_to("grad_clip", float)),
    ("{R}.grad_clip", role_to("grad_clip", float)),
    ("{R}.optim.lr_warmup_steps", _warmup),
    ("{R}.optim.lr_warmup_steps_ratio", same("read with lr_warmup_steps (a ratio of the run when that is -1)")),
    ("{R}.optim.lr_scheduler_type", _decay_style),
    ("{R}.optim.warmup_style", _decay_style),
    ("{R}.optim.lr_decay_style", _decay_style),
    ("{R}.optim.lr_decay_steps", lambda k, v, c: Same("null: the run length") if v is None else
     Map({f"{role_key(k)}.lr_decay_steps": int(v)})),
    ("{R}.optim.min_lr", lambda k, v, c: Same("0") if not v else Map({f"{role_key(k)}.min_lr": float(v)})),
    ("{R}.optim.min_lr_ratio", _min_lr_ratio),
    ("{R}.optim.num_cycles", same("half a cosine cycle, as verl's default 0.5")),
    ("{R}.optim.optimizer", _optimizer),
    ("{R}.optim.optimizer_impl", same("Megatron's optimizer")),
    ("{R}.optim.total_training_steps", same("filled by verl from trainer.total_training_steps")),
    ("{R}.optim.lr_warmup_init", off_only("warm-up starting above 0: verl_mega's starts at 0")),
    ("{R}.optim.lr_wsd_*", same("WSD schedule settings: see lr_decay_style")),
    ("{R}.optim.weight_decay_incr_style", when("constant", "constant weight decay", "a weight-decay schedule: not in "
                                                                                   "verl_mega")),
    ("{R}.optim.use_checkpoint_opt_param_scheduler", same("the LR schedule resumes from the checkpoint")),
    ("{R}.optim.override_optimizer_config", off_only("Megatron OptimizerConfig overrides: not exposed")),
    ("{R}.optim.muon_*", same("Muon settings: verl_mega trains with AdamW (see optim.optimizer)")),
    ("{R}.optim.use_layer_wise_distributed_optimizer", off_only("layer-wise distributed optimizer: not exposed")),
    ("{R}.optim.use_precision_aware_optimizer", off_only("precision-aware optimizer: optimizer state stays fp32")),
    ("{R}.optim.*_dtype", when("fp32", "fp32 optimizer state and main grads, as in verl_mega",
                               "optimizer state below fp32: verl_mega keeps it fp32")),
    ("{R}.optim.zero_indexed_step", same("Adam's step counting")),
    # ------------------------------------------------------------ batching
    ("{R}.ppo_mini_batch_size", role_to("ppo_mini_batch_size", int)),
    ("actor_rollout_ref.actor.ppo_micro_batch_size", _micro_global),
    ("critic.ppo_micro_batch_size", _micro_global),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", _per_gpu("actor.micro_batch_size_per_gpu")),
    ("critic.ppo_micro_batch_size_per_gpu", _per_gpu("critic.micro_batch_size_per_gpu")),
    ("{R}.ppo_epochs", role_to("ppo_epochs", int)),
    ("{R}.shuffle", role_to("shuffle", bool)),
    ("{R}.use_dynamic_bsz", role_to("use_dynamic_bsz", bool)),
    ("{R}.ppo_max_token_len_per_gpu", role_to("max_tokens_per_gpu", int)),
    ("{R}.data_loader_seed", same("mini-batch order follows trainer.seed")),
    ("critic.forward_*", same("the critic's forward passes use its micro-batch and token budget")),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size", _micro_global),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size", _micro_global),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
     _per_gpu("actor.log_prob_micro_batch_size_per_gpu")),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", _per_gpu("ref.micro_batch_size_per_gpu")),
    ("*.log_prob_use_dynamic_bsz", same("actor.use_dynamic_bsz also sets the log-prob passes")),
    ("*.log_prob_max_token_len_per_gpu", same("actor.max_tokens_per_gpu also bounds the log-prob passes")),
    ("{R}.loss_agg_mode", lambda k, v, c: Map({"actor.loss_agg_mode": v}) if k.startswith("actor") else
     Same("the value loss is averaged over tokens")),
    ("{R}.loss_scale_factor", off_only("a constant loss scale: not in verl_mega")),
    ("{R}.ulysses_sequence_parallel_size", lambda k, v, c: Same("1: no sequence split") if int(v) == 1 else
     (Map({"parallel.cp": int(v)}, "Megatron context parallelism in place of Ulysses") if k.startswith("actor")
      else Same("every role runs at the actor's layout"))),
    ("actor_rollout_ref.ref.ulysses_sequence_parallel_size", same(INTERP)),
    ("reward_model.ulysses_sequence_parallel_size", same("every role runs at the actor's layout")),
    # ------------------------------------------------------------ policy loss (actor)
    ("actor_rollout_ref.actor.policy_loss.loss_mode", _loss_mode),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_*", lambda k, v, c: _loss_option(k.rsplit(".", 1)[1],
                                                                                      ("clip_cov",))(k, v, c)),
    ("actor_rollout_ref.actor.policy_loss.kl_cov_ratio", _loss_option("kl_cov_ratio", ("kl_cov",))),
    ("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", _loss_option("ppo_kl_coef", ("kl_cov",))),
    ("actor_rollout_ref.actor.policy_loss.dro_beta", off_only("DRO's beta: not in verl_mega")),
    ("actor_rollout_ref.actor.clip_ratio", _clip_ratio),
    ("actor_rollout_ref.actor.clip_ratio_low", lambda k, v, c: Same("null: clip_ratio") if v is None else
     Map({"actor.clip_ratio_low": float(v)})),
    ("actor_rollout_ref.actor.clip_ratio_high", lambda k, v, c: Same("null: clip_ratio") if v is None else
     Map({"actor.clip_ratio_high": float(v)})),
    ("actor_rollout_ref.actor.clip_ratio_c", to("actor.clip_ratio_c", float)),
    ("actor_rollout_ref.actor.tau_*", lambda k, v, c: Unsupported("SAPO's temperatures: verl_mega has no SAPO loss")
     if c.get("actor_rollout_ref.actor.policy_loss.loss_mode") == "sapo" else Same("read only by the SAPO loss")),
    ("actor_rollout_ref.actor.entropy_coeff", to("actor.entropy_coeff", float)),
    ("actor_rollout_ref.actor.calculate_entropy", same("the entropy is always logged (actor/entropy)")),
    ("actor_rollout_ref.actor.use_kl_loss", to("actor.use_kl_loss", bool)),
    ("actor_rollout_ref.actor.kl_loss_coef", to("actor.kl_loss_coef", float)),
    ("actor_rollout_ref.actor.kl_loss_type", _kl_type),
    ("actor_rollout_ref.actor.use_prefix_grouper", off_only("prefix grouping: not in verl_mega")),
    ("*.use_torch_compile", same("verl's torch.compile of the log-prob computation; verl_mega's fused kernels: "
                                 "model.fused_kernels")),
    ("*.entropy_*", same("verl_mega computes the entropy in vocab-parallel chunks itself")),
    ("actor_rollout_ref.actor.calculate_sum_pi_squared", off_only("sum of squared probabilities: not logged")),
    ("actor_rollout_ref.actor.sum_pi_squared_checkpointing", same("see calculate_sum_pi_squared")),
    ("actor_rollout_ref.actor.freeze_vision_tower", off_only(VISION)),
    ("*.pad_to_length_bucket", same("read only with pad_to_length")),
    ("*.pad_to_length*", off_only("padding to a fixed length: verl_mega pads to the batch (or packs)")),
    ("*.router_replay.mode", _router_replay),
    ("*.router_replay.*", same("routing replay records in memory (actor.routing_replay)")),
    ("{R}.checkpoint.save_contents", _save_contents),
    ("actor_rollout_ref.actor.checkpoint.async_save", to("checkpoint.async_save", bool)),
    ("critic.checkpoint.async_save", same("one checkpoint policy for every role (from the actor's)")),
    ("*.checkpoint.mbridge_config", same("verl_mega maps HF⇄Megatron weights itself")),
    ("*.checkpoint.strict", same("checkpoints are loaded strictly")),
    ("*.load_weight", same("roles start from model.path's weights")),
    ("*.strategy", same("verl_mega trains every role with Megatron-Core")),
    ("model_engine", same("verl's engine choice (dp, megatron, ...): verl_mega trains every role with Megatron-Core")),
    # ------------------------------------------------------------ FSDP and Megatron engines
    ("*.fsdp_config.param_offload", _offload("params")),
    ("*.fsdp_config.optimizer_offload", _offload("optimizer")),
    ("*.fsdp.param_offload", _offload("params")),
    ("*.fsdp.optimizer_offload", _offload("optimizer")),
    ("*.fsdp_config.dtype", _dtype),
    ("*.fsdp_config.full_determinism", lambda k, v, c: Map({"trainer.deterministic": bool(v)}) if
     k.startswith("actor_rollout_ref.actor.") else Same("trainer.deterministic (from the actor's)")),
    ("*.fsdp_config.model_dtype", same("Megatron keeps fp32 main parameters for the optimizer")),
    ("*.fsdp_config.*", same(FSDP)),
    ("*.fsdp.*", same(FSDP)),
    ("*.megatron.tensor_model_parallel_size", _megatron_dim),
    ("*.megatron.pipeline_model_parallel_size", _megatron_dim),
    ("*.megatron.virtual_pipeline_model_parallel_size", _megatron_dim),
    ("*.megatron.context_parallel_size", _megatron_dim),
    ("*.megatron.expert_model_parallel_size", _megatron_dim),
    ("*.megatron.expert_tensor_parallel_size", _megatron_dim),
    ("*.megatron.sequence_parallel", _megatron_dim),
    ("*.megatron.use_distributed_optimizer", _megatron_dim),
    ("*.megatron.param_offload", _offload("params")),
    ("*.megatron.grad_offload", _offload("grads")),
    ("*.megatron.optimizer_offload", _offload("optimizer")),
    ("*.megatron.dtype", _dtype),
    ("actor_rollout_ref.actor.megatron.seed", to("trainer.seed", int)),
    ("*.megatron.seed", same("trainer.seed (from the actor's)")),
    ("*.megatron.override_transformer_config.recompute_granularity", _granularity),
    ("*.megatron.override_transformer_config.recompute_*", same("Megatron's recompute details follow "
                                                                "model.recompute")),
    ("*.megatron.override_transformer_config.attention_backend", same("flash attention through SDPA on CUDA (or "
                                                                      "Transformer Engine's)")),
    ("*.megatron.override_transformer_config", same("Megatron TransformerConfig overrides of the reference follow the "
                                                    "actor's")),
    ("*.megatron.override_transformer_config.*", unsupported("Megatron TransformerConfig overrides: not exposed; "
                                                             "verl_mega derives the config from the HF one")),
    ("*.megatron.use_remove_padding", lambda k, v, c: Map({"model.use_remove_padding": bool(v)}) if
     k.startswith("actor_rollout_ref.actor.") else Same("model.use_remove_padding (from the actor's)")),
    ("*.megatron.use_dist_checkpointing", off_only("loading weights from a Megatron dist checkpoint: verl_mega "
                                                   "converts HF weights itself (tools/convert_hf_to_mcore.py for "
                                                   "large models)")),
    ("*.megatron.dist_checkpointing_*", same("see use_dist_checkpointing")),
    ("*.megatron.use_mbridge", same("verl_mega maps HF⇄Megatron weights itself")),
    ("*.megatron.vanilla_mbridge", same("verl_mega maps HF⇄Megatron weights itself")),
    ("*.megatron.forward_only", same("set by the role")),
    ("*.megatron.dist_ckpt_optim_fully_reshardable", same("checkpoints (optimizer included) reshard on load")),
    ("*.megatron.distrib_optim_fully_reshardable_mem_efficient", same("checkpoints reshard on load")),
    ("*.megatron.use_megatron_fsdp", off_only("Megatron FSDP: verl_mega shards with TP/PP/CP/EP and the distributed "
                                              "optimizer")),
    ("*.megatron.dynamic_context_parallel", off_only("dynamic context parallelism: not in verl_mega")),
    ("*.megatron.max_seqlen_per_dp_cp_rank", off_only("a per-rank sequence cap: see actor.max_tokens_per_gpu")),
    ("*.megatron.pad_bshd_to_minibatch_max", same("padding follows the micro-batch")),
    ("*.megatron.override_ddp_config", off_only("Megatron DDP config overrides: not exposed")),
    ("*.megatron.override_mcore_model_config", off_only("Megatron model config overrides: not exposed")),
    ("*.megatron.*", unsupported(MCORE_INTERNAL)),
    ("*.turbo_config.*", same(FSDP)),
    # ------------------------------------------------------------ reference
    ("actor_rollout_ref.ref.*", same("the reference is the actor's initial weights at the actor's layout; ref.enable "
                                     "follows actor.use_kl_loss / algorithm.use_kl_in_reward as in verl")),
    # ------------------------------------------------------------ rollout
    ("actor_rollout_ref.rollout.name", lambda k, v, c: Same("vLLM") if v in ("vllm", "???") else
     Unsupported(f"rollout engine {v!r}: verl_mega generates with vLLM")),
    ("actor_rollout_ref.rollout.mode", same("verl_mega drives vLLM in-process (colocated) or on a pool of its own")),
    ("actor_rollout_ref.rollout.n", _n),
    ("actor_rollout_ref.rollout.temperature", to("rollout.temperature", float)),
    ("actor_rollout_ref.rollout.top_p", to("rollout.top_p", float)),
    ("actor_rollout_ref.rollout.top_k", to("rollout.top_k", int)),
    ("actor_rollout_ref.rollout.do_sample", _do_sample),
    ("actor_rollout_ref.rollout.ignore_eos", to("rollout.ignore_eos", bool)),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", to("rollout.gpu_memory_utilization", float)),
    ("actor_rollout_ref.rollout.enforce_eager", to("rollout.enforce_eager", bool)),
    ("actor_rollout_ref.rollout.free_cache_engine", _free_cache),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", _tp_gen),
    ("actor_rollout_ref.rollout.max_num_batched_tokens", to("rollout.max_num_batched_tokens", int)),
    ("actor_rollout_ref.rollout.max_num_seqs", to("rollout.max_num_seqs", int)),
    ("actor_rollout_ref.rollout.seed", same("sampling seeds derive from trainer.seed and the data position "
                                            "(rollout.seed)")),
    ("actor_rollout_ref.rollout.val_kwargs.temperature", _val_temperature),
    ("actor_rollout_ref.rollout.val_kwargs.do_sample", _do_sample),
    ("actor_rollout_ref.rollout.val_kwargs.n", _n),
    ("actor_rollout_ref.rollout.val_kwargs.top_p", when(1.0, "validation samples at top_p 1",
                                                        "validation at top_p < 1: verl_mega validates at top_p 1 "
                                                        "(rollout.val_temperature sets its temperature)")),
    ("actor_rollout_ref.rollout.val_kwargs.top_k", lambda k, v, c: Same("validation samples with no top-k") if v in
     (None, -1, 0) else Unsupported("validation with top-k: verl_mega validates with no top-k "
                                    "(rollout.val_temperature sets its temperature)")),
    ("actor_rollout_ref.rollout.val_kwargs.*", same("validation samples at top_p 1, no top-k")),
    ("actor_rollout_ref.rollout.multi_turn.enable", _multi_turn),
    ("actor_rollout_ref.rollout.multi_turn.max_assistant_turns", lambda k, v, c: Same("null") if v is None else
     Map({"rollout.multi_turn.max_turns": int(v)})),
    ("actor_rollout_ref.rollout.multi_turn.max_tool_response_length", lambda k, v, c: Map(
        {"rollout.multi_turn.max_observation_tokens": int(v)}) if c.get("actor_rollout_ref.rollout.multi_turn.enable")
     else Same("multi-turn is off")),
    ("actor_rollout_ref.rollout.multi_turn.*", lambda k, v, c: Same("multi-turn is off") if not
     c.get("actor_rollout_ref.rollout.multi_turn.enable") else off_only(
         "verl's multi-turn option: verl_mega's tools are rollout.multi_turn.tools (docs/concepts.md)")(k, v, c)),
    ("actor_rollout_ref.rollout.agent.*", same("verl's agent loop workers: verl_mega runs episodes inside the "
                                               "rollout (rollout.multi_turn)")),
    ("actor_rollout_ref.rollout.calculate_log_probs", same("vLLM's log-probs are always kept (rollout/logprob_diff_*, "
                                                           "actor.rollout_is)")),
    ("actor_rollout_ref.rollout.logprobs_mode", when("processed_logprobs", "vLLM reports the log-probs of the "
                                                     "distribution it sampled from (temperature, top-k/p applied)",
                                                     "vLLM's raw log-probs or logits: verl_mega's rollout reports "
                                                     "those of the sampled distribution (processed_logprobs)")),
    ("actor_rollout_ref.rollout.dtype", same("vLLM runs in model.dtype")),
    ("actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes",
     to("rollout.weight_bucket_mb", int)),
    ("actor_rollout_ref.rollout.checkpoint_engine.*", same("the 3D-HybridEngine syncs weights (rollout.weight_sync)")),
    ("actor_rollout_ref.rollout.layered_summon", same("the 3D-HybridEngine syncs weights shard by shard")),
    ("actor_rollout_ref.rollout.layer_name_map.*", same("verl_mega maps weights to vLLM's layout itself")),
    ("actor_rollout_ref.rollout.load_format", same("vLLM starts from the actor's synced weights")),
    ("actor_rollout_ref.rollout.skip_tokenizer_init", same("prompts go to vLLM as token ids")),
    ("actor_rollout_ref.rollout.enable_rollout_routing_replay", lambda k, v, c: Same("off") if not v else
     Map({"actor.routing_replay": "r3"})),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm", _vllm_engine_kwargs),
    ("actor_rollout_ref.rollout.engine_kwargs.vllm.*", _vllm_engine_kwargs),
    ("actor_rollout_ref.rollout.engine_kwargs.*", off_only("SGLang / TensorRT-LLM engine arguments: verl_mega "
                                                           "generates with vLLM")),
    ("actor_rollout_ref.rollout.disaggregation.*", gated("disaggregation", "enabled", "prefill/decode "
                                                                                        "disaggregation: not in "
                                                                                        "verl_mega")),
    ("actor_rollout_ref.rollout.data_parallel_size", _gen_dp),
    ("actor_rollout_ref.rollout.expert_parallel_size", _gen_ep),
    ("actor_rollout_ref.rollout.pipeline_model_parallel_size", when(1, "no pipeline in generation",
                                                                    "pipeline parallelism in vLLM: not supported")),
    ("actor_rollout_ref.rollout.nnodes", same("the rollout shares the training pool unless placement.roles says "
                                              "otherwise")),
    ("actor_rollout_ref.rollout.quantization", _rollout_quantization),
    ("actor_rollout_ref.rollout.quantization_config_file", off_only(
        "a quantization config file (torchao): verl_mega's rollout quantizes with rollout.quantization=fp8 only",
        "null here")),
    ("actor_rollout_ref.rollout.enable_prefix_caching", to("rollout.enable_prefix_caching", bool)),
    ("actor_rollout_ref.rollout.cudagraph_capture_sizes", _cudagraph_sizes),
    ("actor_rollout_ref.rollout.max_model_len", same("data.max_prompt_length + rollout.max_response_length")),
    ("actor_rollout_ref.rollout.enable_chunked_prefill", same("vLLM's chunked prefill is on")),
    ("actor_rollout_ref.rollout.disable_log_stats", same("vLLM's stats are off; trainer.profile turns its request "
                                                         "timestamps on")),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", same("SGLang's option in verl; verl_mega wakes vLLM's weights "
                                                           "before the weight sync and its KV cache after it")),
    ("actor_rollout_ref.rollout.over_sample_rate", when(0, "every request runs to its end",
                                                        "verl's early abort of a rollout's last requests: not in "
                                                        "verl_mega")),
    ("actor_rollout_ref.rollout.scheduling_policy", when("fcfs", "vLLM schedules first come, first served",
                                                         "vLLM's priority scheduling: not exposed")),
    ("actor_rollout_ref.rollout.skip_rollout", off_only("verl's rollout dump and replay for debugging: not in "
                                                        "verl_mega")),
    ("actor_rollout_ref.rollout.skip_dump_dir", same("see skip_rollout")),
    ("actor_rollout_ref.rollout.full_determinism", off_only("deterministic vLLM generation: not in verl_mega")),
    ("actor_rollout_ref.rollout.moe_load_balance_metrics_interval", same("vLLM's MoE load-balance metrics: not "
                                                                         "collected")),
    ("actor_rollout_ref.rollout.qat", off_only("quantization-aware training: not in verl_mega")),
    ("actor_rollout_ref.rollout.mtp.*", same(INTERP)),
    # ------------------------------------------------------------ critic
    ("critic.enable", _critic_enable),
    ("critic.cliprange_value", to("critic.cliprange_value", float)),
    ("critic.model.*", same("the critic shares model.* with the actor")),
    ("critic.*", same("the critic shares the actor's engine settings")),
    # ------------------------------------------------------------ reward
    ("custom_reward_function.path", _reward_fn),
    ("reward.custom_reward_function.path", _reward_fn),
    ("*custom_reward_function.name", same("read with custom_reward_function.path")),
    ("*custom_reward_function.reward_kwargs", _reward_kwargs),
    ("*custom_reward_function.reward_kwargs.*", same("read with custom_reward_function.reward_kwargs")),
    ("reward.num_workers", to("reward.num_workers", int)),
    ("reward_model.num_workers", same("reward.num_workers decides")),
    ("reward_model.enable", lambda k, v, c: Same("off") if not v else Same("with reward_model.model.path")),
    ("reward.reward_model.enable", lambda k, v, c: Same("off") if not v else Same("with its model_path")),
    ("*reward_manager.name", lambda k, v, c: Same(f"{v}: the reward function's signature decides per-sample or "
                                                  f"batched calls") if v in ("naive", "batch", "prime", "dapo")
     else
     Unsupported(f"reward manager {v!r}")),
    ("reward_model.reward_manager", lambda k, v, c: Same(f"{v}: the reward function's signature decides")),
    ("*reward_manager.*", same("verl's reward manager registry: verl_mega calls the function itself")),
    ("reward_model.overlong_buffer.enable", to("reward.overlong_buffer.enable", bool)),
    ("reward_model.overlong_buffer.len", to("reward.overlong_buffer.len", int)),
    ("reward_model.overlong_buffer.penalty_factor", to("reward.overlong_buffer.penalty_factor", float)),
    ("reward_model.overlong_buffer.*", same("DAPO's overlong buffer log flag")),
    ("reward_model.micro_batch_size_per_gpu", same("the reward model scores in actor.micro_batch_size_per_gpu")),
    ("reward_model.launch_reward_fn_async", same("the reward function always runs in worker processes, overlapped "
                                                 "with device work")),
    ("reward_model.*", lambda k, v, c: Same("the reward model is off") if not c.get("reward_model.enable") else
     Same("the reward model runs at the actor's layout and batch sizes")),
    ("reward.reward_model.*", lambda k, v, c: Same("the reward model is off") if not
     c.get("reward.reward_model.enable") else Unsupported("a reward model served by vLLM (generative RM): verl_mega "
                                                          "scores with a sequence-classification reward model "
                                                          "(reward.reward_model_path)")),
    ("reward.*", same("verl's reward loop settings")),
    # ------------------------------------------------------------ algorithm
    ("algorithm.adv_estimator", _adv),
    ("algorithm.gamma", to("algorithm.gamma", float)),
    ("algorithm.lam", to("algorithm.lam", float)),
    ("algorithm.norm_adv_by_std_in_grpo", to("algorithm.norm_adv_by_std_in_grpo", bool)),
    ("algorithm.use_kl_in_reward", to("algorithm.use_kl_in_reward", bool)),
    ("algorithm.kl_penalty", _kl_type),
    ("algorithm.kl_ctrl.type", to("algorithm.kl_ctrl.type")),
    ("algorithm.kl_ctrl.kl_coef", to("algorithm.kl_ctrl.kl_coef", float)),
    ("algorithm.kl_ctrl.target_kl", lambda k, v, c: Map({"algorithm.kl_ctrl.target_kl": float(v)}) if
     c.get("algorithm.kl_ctrl.type") == "adaptive" else Same("read only by the adaptive controller")),
    ("algorithm.kl_ctrl.horizon", to("algorithm.kl_ctrl.horizon", int)),
    ("algorithm.use_pf_ppo", off_only("PF-PPO's sample reweighting: not in verl_mega")),
    ("algorithm.pf_ppo.*", same("read only with use_pf_ppo")),
    ("algorithm.filter_groups.enable", to("algorithm.filter_groups.enable", bool)),
    ("algorithm.filter_groups.max_num_gen_batches", lambda k, v, c: Map(
        {"algorithm.filter_groups.max_num_gen_batches": int(v)}) if int(v or 0) > 0 else
     Same("0 (no limit) in verl; verl_mega's default bound of 10 applies")),
    ("algorithm.filter_groups.metric", lambda k, v, c: Same("groups are filtered on the reward, as verl's "
                                                            "metric=acc/score")
     if v in (None, "acc", "score", "seq_reward", "seq_final_reward") else
     Unsupported(f"filtering groups on {v!r}: verl_mega filters on the reward")),
    ("algorithm.filter_groups.*", same("verl's generation concurrency")),
    ("algorithm.rollout_correction.rollout_is", _rollout_is),
    ("algorithm.rollout_correction.rollout_is_threshold", lambda k, v, c: Map(
        {"actor.rollout_is_threshold": float(v)}) if c.get("algorithm.rollout_correction.rollout_is") else
     Same("read only with rollout_is")),
    ("algorithm.rollout_correction.rollout_rs", lambda k, v, c: Same("off") if v is None else Map(
        {"actor.rollout_is_mode": "mask"}, "rejection sampling: mask mode")),
    ("algorithm.rollout_correction.rollout_rs_threshold", lambda k, v, c: Same("read only with rollout_rs") if v is None
     else Map({"actor.rollout_is_threshold": float(v)})),
    ("algorithm.rollout_correction.bypass_mode", off_only("using the rollout's log-probs as the old ones: verl_mega "
                                                          "recomputes them (decoupled PPO: actor.policy_loss)")),
    ("algorithm.rollout_correction.loss_type", same("read with bypass_mode")),
    ("algorithm.rollout_correction.rollout_is_batch_normalize", off_only("batch-normalised IS weights: not in "
                                                                         "verl_mega")),
    # ------------------------------------------------------------ data
    ("data.train_files", to("data.train_files", files)),
    ("data.val_files", lambda k, v, c: Same("no validation") if not v else
     Same("no validation runs (trainer.val_before_train false, test_freq ≤ 0), so the files are not read")
     if not c.get("trainer.val_before_train", True) and int(c.get("trainer.test_freq", -1)) <= 0 else
     Map({"data.val_files": files(v)})),
    ("data.prompt_key", lambda k, v, c: Same("prompt") if v == "prompt" else Map({"data.prompt_key": v})),
    ("data.reward_fn_key", when("data_source", "data_source reaches the reward function",
                                "a data-source field other than data_source: rename the column")),
    ("data.max_prompt_length", to("data.max_prompt_length", int)),
    ("data.max_response_length", to("rollout.max_response_length", int)),
    ("data.train_batch_size", to("data.train_batch_size", int)),
    ("data.gen_batch_size", lambda k, v, c: Same("null: train_batch_size") if v is None else Unsupported(
        "a generation batch larger than the training batch: DAPO refills with further batches "
        "(algorithm.filter_groups)")),
    ("data.shuffle", to("data.shuffle", bool)),
    ("data.seed", _seed),
    ("data.filter_overlong_prompts", _filter_overlong),
    ("data.truncation", _truncation),
    ("data.*_max_samples", lambda k, v, c: Same("all rows") if v in (None, -1) else Unsupported(
        "a cap on the rows read: cut the file instead")),
    ("data.apply_chat_template_kwargs", off_only("extra chat-template arguments: not passed")),
    ("data.custom_cls.*", off_only("a custom dataset class: verl_mega reads JSONL/JSON/parquet (docs/data.md)")),
    ("data.datagen.*", off_only("dynamic data generation: not in verl_mega")),
    ("data.sampler.*", off_only("a custom sampler: verl_mega shuffles per epoch (data.shuffle)")),
    ("data.tokenizer", same("the model's tokenizer")),
    ("data.trust_remote_code", same("model.trust_remote_code")),
    ("data.return_*", same("how verl's dataset hands prompts to its workers")),
    ("data.dataloader_num_workers", same("prompts are tokenized once at start-up")),
    ("data.filter_overlong_prompts_workers", same("prompts are tokenized once at start-up")),
    ("data.val_batch_size", same("the validation set is generated whole")),
    ("data.validation_shuffle", same("validation follows the file's order")),
    ("data.use_shm", same("files are read directly")),
    ("data.image*", same(VISION)),
    ("data.video_key", same(VISION)),
    ("data.audio_key", same(VISION)),
    ("data.mm_processor_kwargs", same(VISION)),
    ("data.tool_config_path", same(INTERP)),
    ("data.function_tool_path", same(INTERP)),
    # ------------------------------------------------------------ trainer
    ("trainer.total_epochs", to("trainer.total_epochs", int)),
    ("trainer.total_training_steps", _train_steps),
    ("trainer.project_name", to("logging.project", str)),
    ("trainer.experiment_name", to("logging.run_name", str)),
    ("trainer.logger", _logger),
    ("trainer.n_gpus_per_node", _launch),
    ("trainer.nnodes", _launch),
    ("trainer.save_freq", _freq("trainer.save_every")),
    ("trainer.test_freq", _freq("trainer.val_every")),
    ("trainer.val_before_train", to("trainer.val_before_train", bool)),
    ("trainer.val_only", off_only("validation only: not a verl_mega mode")),
    ("trainer.resume_mode", _resume_mode),
    ("trainer.resume_from_path", _resume_path),
    ("trainer.default_local_dir", _output_dir),
    ("trainer.max_actor_ckpt_to_keep", lambda k, v, c: Same("null: keep all") if v is None else
     Map({"checkpoint.keep_last": int(v)})),
    ("trainer.max_critic_ckpt_to_keep", same("a checkpoint holds every role: checkpoint.keep_last")),
    ("trainer.balance_batch", to("trainer.balance_batch", bool)),
    ("trainer.critic_warmup", off_only("critic warm-up steps without actor updates: not in verl_mega")),
    ("trainer.default_hdfs_dir", off_only("copying checkpoints to HDFS: not in verl_mega")),
    ("trainer.del_local_ckpt_after_load", off_only("deleting a checkpoint after loading it: verl_mega keeps "
                                                   "checkpoint.keep_last")),
    ("trainer.device", lambda k, v, c: Same("CUDA when present, else CPU mode") if v in ("cuda", "cpu") else
     Unsupported(f"device {v!r}: verl_mega runs on CUDA or CPU")),
    ("trainer.esi_redundant_time", off_only("saving ahead of an ESI preemption: verl_mega saves on SIGTERM and at "
                                            "trainer.time_limit_s")),
    ("trainer.log_val_generations", off_only("logging validation generations: not in verl_mega")),
    ("trainer.rollout_data_dir", off_only("dumping rollouts to files: not in verl_mega")),
    ("trainer.validation_data_dir", off_only("dumping validation generations to files: not in verl_mega")),
]


def _expand_roles(pattern: str) -> list[str]:
    return [pattern.replace("{R}", role) for role in ROLES] if "{R}" in pattern else [pattern]


_COMPILED = [(p, handler) for pattern, handler in RULES for p in _expand_roles(pattern)]


def classify(key: str, value: Any, ctx: Ctx) -> Map | Same | Unsupported:
    """What the key becomes: the first rule whose pattern matches it decides."""
    for pattern, handler in _COMPILED:
        if fnmatchcase(key, pattern):
            try:
                return handler(key, value, ctx)
            except (TypeError, ValueError, IndexError, KeyError) as exc:
                return Unsupported(f"value {value!r} does not convert ({type(exc).__name__}: {exc})")
    return Unsupported("not a key of verl's PPO trainer configs that this converter knows (verl 0.5 to 0.10); "
                       "check its spelling")
