"""Build every component of an RL job from a validated TrainConfig (one place, so the driver loop stays short)."""

from __future__ import annotations

import fcntl
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from verl_mega.config import ParallelDims, TrainConfig
from verl_mega.engine.megatron_engine import MegatronEngine, ScheduleSpec
from verl_mega.models.build import build_model_chunks
from verl_mega.models.hf_config import ModelArch, arch_from_hf, load_hf_config, transformer_config
from verl_mega.models.hf_io import HFCheckpointReader
from verl_mega.models.loader import check_checkpoint_matches, load_hf_weights

log = logging.getLogger("verl_mega")

TINY_SIZES = dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                  num_kv_heads=2, tie_word_embeddings=True)


def resolve_model_path(cfg: TrainConfig) -> Path:
    """`model.path: tiny` → build (once, under a lock) the bundled tiny model, warm-started on the generated task."""
    if cfg.model.path != "tiny":
        return Path(cfg.model.path)
    from verl_mega.data.tasks import generated_task, is_generated
    from verl_mega.models.tiny import make_tiny_hf_model, warm_start

    entry = next((f for f in cfg.data.train_files if is_generated(f)), "generated:arithmetic")
    seed = cfg.trainer.seed
    root = Path(os.environ.get("VERL_MEGA_CACHE", Path.home() / ".cache" / "verl_mega"))
    steps = cfg.model.tiny_warmstart_steps
    target = root / f"tiny-{entry.split(':')[-1]}-s{seed}-w{steps}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # every local rank waits while one builds
        if not (target / "warmstart.json").exists():
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            make_tiny_hf_model(tmp, seed=seed, **TINY_SIZES)
            records = generated_task(entry).generate(1024, seed=seed)
            stats = warm_start(tmp, records, steps=steps, seed=seed)
            (tmp / "warmstart.json").write_text(json.dumps(stats))
            os.replace(tmp, target)
    return target


def model_arch(path: Path) -> ModelArch:
    return arch_from_hf(load_hf_config(path))


@dataclass
class RoleModel:
    arch: ModelArch
    config: Any  # mcore TransformerConfig
    engine: MegatronEngine


def build_role_engine(cfg: TrainConfig, dims: ParallelDims, path: Path, *, role_cfg=None, value_head: bool = False,
                      total_steps: int = 1) -> RoleModel:
    """An mcore model of `path` for this rank, HF weights loaded, wrapped in an engine (trainable if role_cfg)."""
    from megatron.core.optimizer import OptimizerConfig

    arch = model_arch(path)
    reader = HFCheckpointReader(path)
    check_checkpoint_matches(reader, arch)
    tcfg = transformer_config(arch, tp=dims.tp, pp=dims.pp, vpp=dims.vpp, cp=dims.cp,
                              sequence_parallel=cfg.parallel.sequence_parallel, dtype=cfg.model.dtype,
                              recompute=cfg.model.recompute, use_cpu_initialization=not torch.cuda.is_available())
    use_te = {True: "true", False: "false"}.get(cfg.model.use_te, cfg.model.use_te)
    chunks = build_model_chunks(arch, tcfg, value_head=value_head, use_te=use_te,
                                make_vocab_size_divisible_by=cfg.model.make_vocab_size_divisible_by)
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    load_hf_weights(chunks, reader, arch, skip_value_head=value_head)
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
    return RoleModel(arch, tcfg, MegatronEngine(chunks, tcfg, optimizer_config=optim, schedule=schedule))


def build_rollout(cfg: TrainConfig, dims: ParallelDims, path: Path, actor: RoleModel):
    from verl_mega.hybrid.layout import ModelDims, plan_layout
    from verl_mega.hybrid.sync import WeightSync
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    arch = actor.arch
    layout = plan_layout(world_size=dist.get_world_size(), tp=dims.tp, pp=dims.pp, gen_tp=cfg.rollout.tg,
                         dims=ModelDims(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                                        num_layers=arch.num_layers, ffn_hidden_size=arch.ffn_hidden_size))
    rcfg = cfg.rollout
    extra = {k: v for k, v in (("max_num_batched_tokens", rcfg.max_num_batched_tokens),) if v is not None}
    vcfg = VLLMRolloutConfig(
        model_path=str(path), gen_tp=rcfg.tg, dtype=cfg.model.dtype,
        max_model_len=cfg.data.max_prompt_length + rcfg.max_response_length,
        max_num_seqs=rcfg.max_num_seqs or 256, gpu_memory_utilization=rcfg.gpu_memory_utilization,
        kv_cache_memory_bytes=rcfg.kv_cache_memory_bytes, enforce_eager=rcfg.enforce_eager,
        seed=rcfg.seed, request_stats=cfg.trainer.profile, engine_kwargs=extra)
    rollout = VLLMRollout(vcfg, layout)
    sync = WeightSync(layout=layout, arch=arch, chunks=actor.engine.chunks, rollout=rollout, mode=rcfg.weight_sync)
    return rollout, sync


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def resolve_critic_path(cfg: TrainConfig, actor_path: Path) -> Path:
    """The critic starts from critic.model_path, or from the actor's weights (value head freshly initialised)."""
    if cfg.critic.model_path in (None, "tiny", cfg.model.path):
        return actor_path
    return Path(cfg.critic.model_path)
