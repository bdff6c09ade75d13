"""The RL job: ``python -m verl_mega.train --config configs/<recipe>.yaml [key=value …]`` (under torchrun, mpirun
or Ray for several ranks; a plain ``python`` run is a world of one)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

from verl_mega.config import ConfigError, ParallelDims, load_config
from verl_mega.trainer.checkpoint import NonFiniteError


@dataclass
class Job:
    """Everything one RL run needs, built and ready: the loop in :func:`train` only drives it."""

    cfg: Any
    trainer: Any
    loader: Any
    ckpt: Any
    profiler: Any
    reward_pool: Any
    rollout: Any
    total_steps: int
    start_step: int
    arch: Any


def build_job(cfg, trainer_cls: type | None = None) -> Job:
    """Validate what can be validated before any heavy allocation, then build roles, rollout, the 3D-HybridEngine
    and the checkpoint manager (resuming when asked). ``trainer_cls``: an :class:`RLTrainer` subclass that changes
    a stage (custom rollout, extra metrics) while reusing everything else."""
    import torch
    import torch.distributed as dist

    from verl_mega import algos
    from verl_mega.data.prompts import PromptDataset, PromptLoader, load_prompt_records
    from verl_mega.parallel import launch_env
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rewards.loader import load_reward_fn
    from verl_mega.rewards.pool import RewardPool
    from verl_mega.trainer import setup
    from verl_mega.trainer.checkpoint import CheckpointManager, find_checkpoint
    from verl_mega.trainer.profiler import StageProfiler, detect_peak_flops
    from verl_mega.trainer.rl_trainer import RLTrainer
    from verl_mega.trainer.roles import Actor, Critic, PolicyRole, RewardModel

    # --- validate everything that can be validated before any heavy allocation
    launch_env.discover().export_to_os_environ()
    path = setup.resolve_model_path(cfg)
    arch = setup.model_arch(path)
    dims = ParallelDims.resolve(cfg.parallel, int(launch_env.discover().world_size), num_layers=arch.num_layers,
                                num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads)
    cfg.validate_runtime(dims)
    find_checkpoint(cfg)  # a bad resume target fails here, before anything is built
    reward_fn = load_reward_fn(cfg.reward.function, reward_kwargs=dict(cfg.reward.kwargs))
    tokenizer = setup.load_tokenizer(cfg.model.tokenizer_path if cfg.model.path != "tiny" else path)
    records = load_prompt_records(cfg.data.train_files, prompt_key=cfg.data.prompt_key,
                                  answer_key=cfg.data.answer_key, generated_seed=cfg.data.seed)
    dataset = PromptDataset(records, tokenizer, max_prompt_length=cfg.data.max_prompt_length,
                            apply_chat_template=cfg.data.apply_chat_template,
                            filter_overlong=cfg.data.filter_overlong_prompts)
    # every rank sees the global prompt batch: vLLM engines split it, DP ranks split the samples
    # trainer.total_steps, when set, wins over trainer.total_epochs: the loader then cycles epochs as needed
    epochs = cfg.trainer.total_epochs if not cfg.trainer.total_steps else 1 + cfg.trainer.total_steps * \
        cfg.data.train_batch_size // max(len(dataset), 1)
    loader = PromptLoader(dataset, global_batch_size=cfg.data.train_batch_size, seed=cfg.data.seed,
                          shuffle=cfg.data.shuffle, num_epochs=epochs or 1)
    total_steps = cfg.trainer.total_steps or loader.total_batches

    # --- build roles, rollout and the 3D-HybridEngine
    init_distributed(tp=dims.tp, pp=dims.pp, vpp=dims.vpp, cp=dims.cp, seed=cfg.trainer.seed,
                     timeout_s=cfg.trainer.collective_timeout_s)
    actor_m = setup.build_role_engine(cfg, dims, path, role_cfg=cfg.actor, total_steps=total_steps)
    actor = Actor(actor_m.engine, cfg.actor, vocab_size=arch.vocab_size, temperature=cfg.rollout.temperature)
    ref = critic = reward_model = None
    if cfg.ref.enable:
        ref = PolicyRole(setup.build_role_engine(cfg, dims, path).engine, vocab_size=arch.vocab_size,
                         micro_batch_size=cfg.ref.micro_batch_size_per_gpu, temperature=cfg.rollout.temperature)
    if cfg.critic.enable:
        critic = Critic(setup.build_role_engine(cfg, dims, setup.resolve_critic_path(cfg, path), role_cfg=cfg.critic,
                                                value_head=True, total_steps=total_steps).engine, cfg.critic)
    if cfg.reward.reward_model_path:
        reward_model = RewardModel(setup.build_role_engine(cfg, dims, cfg.reward.reward_model_path,
                                                           value_head=True).engine,
                                   micro_batch_size=cfg.actor.micro_batch_size_per_gpu)
    rollout, weight_sync = setup.build_rollout(cfg, dims, path, actor_m)
    weight_sync.sync()  # vLLM starts from the actor's exact weights (and version 1)
    reward_pool = RewardPool(reward_fn, num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s,
                             mode="thread")
    kc = cfg.algorithm.kl_ctrl
    kl_ctrl = algos.make_kl_controller(kc.type, kc.kl_coef, kc.target_kl or 0.1, kc.horizon)
    # the tokens/flops counters are global (all ranks' samples), so per-device rates divide by the world size
    cuda = torch.cuda.is_available()
    peak = cfg.trainer.peak_tflops * 1e12 if cfg.trainer.peak_tflops else \
        detect_peak_flops(torch.cuda.get_device_name() if cuda else None, cfg.model.dtype)
    profiler = StageProfiler(n_devices=dist.get_world_size(), peak_flops=peak,
                             synchronize=torch.cuda.synchronize if cuda else None)
    trainer = (trainer_cls or RLTrainer)(
        cfg, actor=actor, ref=ref, critic=critic, reward_model=reward_model, rollout=rollout, weight_sync=weight_sync,
        reward_pool=reward_pool, tokenizer=tokenizer, profiler=profiler, kl_ctrl=kl_ctrl, arch=arch)
    if cfg.trainer.profile:
        trainer.enable_profiling()
    ckpt = CheckpointManager(cfg, engines={"actor": actor_m.engine, "critic": critic and critic.engine},
                             loader=loader, kl_ctrl=kl_ctrl, hf_source=path, arch=arch)
    start_step = ckpt.maybe_resume()
    if start_step:
        weight_sync.sync()
    return Job(cfg=cfg, trainer=trainer, loader=loader, ckpt=ckpt, profiler=profiler, reward_pool=reward_pool,
               rollout=rollout, total_steps=total_steps, start_step=start_step, arch=arch)


def train(cfg) -> dict[str, float]:
    import torch.distributed as dist

    from verl_mega.trainer.checkpoint import fault_point
    from verl_mega.trainer.metrics import MetricsLogger

    job = build_job(cfg)
    trainer, loader, ckpt = job.trainer, job.loader, job.ckpt
    start_step, total_steps = job.start_step, job.total_steps
    logger = MetricsLogger(cfg.trainer.output_dir, console=cfg.logging.console,
                           progress_bar=cfg.logging.progress_bar, jsonl=cfg.logging.jsonl,
                           tensorboard=cfg.logging.tensorboard, plot=cfg.logging.plot, total_steps=total_steps,
                           rank=dist.get_rank(), resume_step=start_step, log_every=cfg.trainer.log_every)
    stop = {"signal": None}
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))

    # --- the RL loop
    metrics: dict[str, float] = {}
    for step in range(start_step + 1, total_steps + 1):
        fault_point("step_start", step)
        prompts = loader.next_batch()
        if prompts is None:
            break
        metrics = trainer.step(prompts)
        ckpt.guard_nonfinite(metrics, step)
        logger.log(metrics, step)
        if ckpt.should_save(step, total_steps) or stop["signal"] is not None:
            ckpt.save(step)
        if stop["signal"] is not None:
            break
    ckpt.close()  # a background save (checkpoint.async_save) becomes complete and visible
    logger.close()
    job.reward_pool.close()
    job.rollout.shutdown()  # vLLM's process groups go before torch.distributed's
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_mega.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML recipe (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6 parallel.tp=2")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        train(cfg)
    except (ConfigError, ValueError, FileNotFoundError, NonFiniteError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        from verl_mega.parallel.state import destroy_distributed

        destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
