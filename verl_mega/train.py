"""The RL job: ``python -m verl_mega.train --config configs/<recipe>.yaml [key=value …]`` (under torchrun, mpirun
or Ray for several ranks; a plain ``python`` run is a world of one)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from verl_mega.config import ConfigError, load_config
from verl_mega.trainer.checkpoint import NonFiniteError
from verl_mega.trainer.console import configure_console


def train(cfg) -> dict[str, float]:
    import time

    from verl_mega.trainer.setup import build_job

    started = time.monotonic()
    job = build_job(cfg)
    try:
        metrics = run(job, started=started)
    except BaseException:
        job.close(after_error=True)
        raise
    job.close()
    return metrics


def run(job, *, started: float | None = None) -> dict[str, float]:
    """The RL loop over a built job; the summary's wall time counts from ``started`` (``time.monotonic()``, by
    default the loop's start)."""
    import time

    import torch.distributed as dist

    from verl_mega.trainer.checkpoint import fault_point
    from verl_mega.trainer.metrics import MetricsLogger, write_summary

    cfg, trainer, loader, ckpt = job.cfg, job.trainer, job.loader, job.ckpt
    start_step, total_steps = job.start_step, job.total_steps
    logger = MetricsLogger(cfg.trainer.output_dir, console=cfg.logging.console,
                           progress_bar=cfg.logging.progress_bar, jsonl=cfg.logging.jsonl,
                           tensorboard=cfg.logging.tensorboard, plot=cfg.logging.plot, total_steps=total_steps,
                           rank=dist.get_rank(), resume_step=start_step, log_every=cfg.trainer.log_every)
    started = time.monotonic() if started is None else started
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
        if cfg.trainer.val_every and (step % cfg.trainer.val_every == 0 or step == total_steps):
            metrics.update(trainer.validate())
        logger.log(metrics, step)
        if ckpt.should_save(step, total_steps) or stop["signal"] is not None:
            ckpt.save(step)
        if stop["signal"] is not None:
            break
    ckpt.close()  # a background save (checkpoint.async_save) becomes complete and visible
    logger.close()
    if dist.get_rank() == 0:
        latest = ckpt.root / "latest"
        last = ckpt.root / latest.read_text().strip() if latest.exists() else None
        print(write_summary(cfg.trainer.output_dir, wall_s=time.monotonic() - started, checkpoint=last), end="",
              flush=True)
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_mega.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML recipe (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6 parallel.tp=2")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        configure_console(cfg.logging.verbose)
        train(cfg)
    except (ConfigError, ValueError, FileNotFoundError, NonFiniteError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
