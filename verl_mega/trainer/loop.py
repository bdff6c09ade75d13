"""A run's life, one function per part for ``python -m verl_mega.train`` (:func:`verl_mega.train.run`) and the
Python API (:class:`verl_mega.trainer.api.TrainingRun`) alike, so that the two cannot drift apart: before the build,
the console and the trackers' checks (:func:`before_build`); the metric sinks (:func:`start_logging`); the prompts
of the next step; the step itself after the asynchronous look-ahead; then the non-finite guard, validation when due,
the metrics line, the stop agreement (trainer/stop.py) and the checkpoint; at the end, curves and the summary
(:func:`finish_logging`)."""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_mega.config import TrainConfig
    from verl_mega.data.loader import PromptBatch
    from verl_mega.trainer.metrics import MetricsLogger
    from verl_mega.trainer.setup import Job
    from verl_mega.trainer.stop import StopRequest

log = logging.getLogger("verl_mega")

__all__ = ["before_build", "start_logging", "next_prompts", "run_step", "finish_logging"]


def before_build(cfg: TrainConfig) -> None:
    """Between the config and the build: the console that logging.verbose asks for (third-party INFO lines off),
    and the one-line refusal of a tracker that cannot start (not installed, no credentials), before anything heavy
    is built."""
    from verl_mega.trainer.console import configure_console
    from verl_mega.trainer.trackers import check_trackers

    configure_console(cfg.logging.verbose)
    check_trackers({"wandb": cfg.logging.wandb, "mlflow": cfg.logging.mlflow})
    if "RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:  # a launcher's rank (the CLI's always are)
        from verl_mega.parallel.process_guard import end_helpers_with_this_process

        end_helpers_with_this_process()  # before the first helper starts: a killed rank's helpers die with it


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def start_logging(job: Job) -> MetricsLogger:
    """The run's metric sinks as logging.* asks (metrics.jsonl, TensorBoard, trackers, the console line or progress
    bar; rank 0 only), and the initial policy's validation score at step 0 with trainer.val_before_train, as verl
    logs it (collective)."""
    from verl_mega.config.loader import to_dict
    from verl_mega.trainer.metrics import MetricsLogger

    cfg = job.cfg
    lc = cfg.logging
    logger = MetricsLogger(cfg.trainer.output_dir, console=lc.console, progress_bar=lc.progress_bar, jsonl=lc.jsonl,
                           tensorboard=lc.tensorboard, plot=lc.plot, total_steps=job.total_steps, rank=_rank(),
                           resume_step=job.start_step or None, log_every=cfg.trainer.log_every, wandb=lc.wandb,
                           mlflow=lc.mlflow, project=lc.project, run_name=lc.run_name, config=to_dict(cfg))
    if cfg.trainer.val_before_train and job.start_step == 0:
        logger.log(job.trainer.validate(), 0)
    return logger


def finish_logging(job: Job, logger: MetricsLogger) -> None:
    """After the last step, once pending checkpoint writes are complete: close the sinks (curves.png), then write
    <output_dir>/summary.txt and print it (rank 0)."""
    from verl_mega.trainer.metrics import write_summary

    logger.close()
    if _rank() == 0:
        latest = job.ckpt.root / "latest"
        last = job.ckpt.root / latest.read_text().strip() if latest.exists() else None
        print(write_summary(job.cfg.trainer.output_dir, wall_s=time.monotonic() - job.started, checkpoint=last),
              end="", flush=True)


def next_prompts(job: Job, step: int) -> PromptBatch | None:
    """The prompt batch of `step`; None when the data ran out first (dynamic sampling draws extra batches, so an
    epoch-based run can end before its trainer.total_steps). Then step − 1, the last one trained, is saved if it
    was not (collective), as the last step of a run is: the run ends with its checkpoint, which a relaunch finds
    complete instead of training those steps again."""
    prompts = job.loader.next_batch()
    if prompts is None:
        log.info("the data ran out after step %d, before the run's %d steps (dynamic sampling drew extra batches)",
                 step - 1, job.total_steps)
        job.ckpt.save_last(step - 1)
    return prompts


def run_step(job: Job, step: int, prompts: PromptBatch, *, stop: StopRequest, began: float | None = None,
             logger: Any = None) -> tuple[dict[str, float], str]:
    """Step `step` on `prompts`, and what follows every step. ``began``: when the step began (default: now), for
    trainer.time_limit_s; ``logger``: a MetricsLogger for its line. Returns the metrics and the stop reason all
    ranks agreed on ('' = go on; otherwise this step was saved and the run stops). Collective."""
    began = time.monotonic() if began is None else began
    cfg, ckpt = job.cfg, job.ckpt
    job.rollout.prefetch(job.lookahead(prompts))  # async: batches t..t+k to a rollout pool of its own
    metrics = job.trainer.step(prompts)
    ckpt.guard_nonfinite(metrics, step)
    if cfg.trainer.val_every and (step % cfg.trainer.val_every == 0 or step == job.total_steps):
        metrics.update(job.trainer.validate())
    if logger is not None:
        logger.log(metrics, step)
    reason = stop.agreed(time.monotonic() - began, peer=job.rollout.stop_requested)
    if ckpt.should_save(step, job.total_steps) or reason:
        ckpt.save(step)
    if reason:
        log.warning("stopping after step %d (%s) with a checkpoint of that step", step, reason)
    return metrics, reason
