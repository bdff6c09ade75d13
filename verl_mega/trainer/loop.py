"""The steps of a built job, one function for ``python -m verl_mega.train`` (:func:`verl_mega.train.run`) and the
Python API (:class:`verl_mega.trainer.api.TrainingRun`) alike, so that the two cannot drift apart: the prompts of
the next step; the step itself after the asynchronous look-ahead; then the non-finite guard, validation when due,
the metrics line, the stop agreement (trainer/stop.py) and the checkpoint."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from verl_mega.data.loader import PromptBatch
    from verl_mega.trainer.setup import Job
    from verl_mega.trainer.stop import StopRequest

log = logging.getLogger("verl_mega")

__all__ = ["next_prompts", "run_step"]


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
