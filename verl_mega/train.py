"""The RL job: ``python -m verl_mega.train --config configs/<recipe>.yaml [key=value …]`` (under torchrun, mpirun
or Ray for several ranks; a plain ``python`` run is a world of one)."""

# Only light imports at module level: reward worker processes are spawned, and spawning re-imports this module.
from __future__ import annotations

import argparse
import logging
import sys

from verl_mega.config import ConfigError, load_config

log = logging.getLogger("verl_mega")


def train(cfg) -> dict[str, float]:
    from verl_mega.trainer.loop import before_build

    before_build(cfg)  # first: the console before Megatron's and vLLM's imports log, the trackers' checks
    from verl_mega.checkpoint.integrity import RunComplete
    from verl_mega.parallel.process_guard import end_helpers_with_this_process
    from verl_mega.trainer.setup import build_job

    end_helpers_with_this_process()  # before the first helper starts: a killed rank's helpers die with it
    try:
        job = build_job(cfg)
    except RunComplete as done:
        log.info("%s", done)
        return {}
    from verl_mega.trainer.stop import Interrupted

    try:
        metrics = run(job)
    except Interrupted:  # Ctrl-C: the step was saved, and the job closes as after any stop
        job.close()
        raise
    except BaseException:
        job.close(after_error=True)
        raise
    job.close()
    return metrics


def run(job) -> dict[str, float]:
    """The RL loop over a built job: per step, the asynchronous look-ahead (docs/async.md), then the step.
    SIGTERM, SIGINT and trainer.time_limit_s stop it after a step, on every rank together, with a checkpoint of
    that step (trainer/stop.py); after SIGINT it raises Interrupted (the process exits 130), and a second SIGINT
    exits 130 at once, without saving. The summary's wall time counts from the build."""
    import functools
    import time

    from verl_mega.checkpoint.manager import fault_point
    from verl_mega.trainer.loop import finish_logging, next_prompts, run_step, start_logging
    from verl_mega.trainer.stop import Interrupted, StopRequest, abort_now, exit_code

    if job.server is not None:  # a rank of a rollout pool of its own: serve the trainer until it stops
        job.server.serve()
        return {}
    cfg, ckpt = job.cfg, job.ckpt
    start_step, total_steps = job.start_step, job.total_steps
    logger = start_logging(job)  # metrics.jsonl, TensorBoard, trackers; trainer.val_before_train's step 0

    # --- the RL loop: the step and what follows it are trainer/loop.py's, which the Python API shares
    metrics: dict[str, float] = {}
    reason = ""
    with StopRequest(cfg.trainer.time_limit_s, started=job.started,
                     abort=functools.partial(abort_now, ckpt.root)) as stop:
        for step in range(start_step + 1, total_steps + 1):
            began = time.monotonic()
            fault_point("step_start", step)
            prompts = next_prompts(job, step)
            if prompts is None:  # the data ran out first (dynamic sampling): the last step trained was saved
                break
            metrics, reason = run_step(job, step, prompts, stop=stop, began=began, logger=logger)
            if reason:
                break
        ckpt.close()  # a background save (checkpoint.async_save) becomes complete and visible
    finish_logging(job, logger)  # curves.png, summary.txt
    if exit_code(reason):
        raise Interrupted(f"stopped by {reason} after saving step {step}")
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_mega.train", description=__doc__)
    parser.add_argument("--config", required=True, help="YAML recipe (see configs/)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6 parallel.tp=2")
    parser.add_argument("--check", action="store_true",
                        help="load and check the recipe, then exit: 0, or 2 with the error (launch/ runs this first, "
                             "so that an error no restart can fix is printed once and not restarted)")
    args = parser.parse_args(argv)
    if args.check:
        try:
            load_config(args.config, args.overrides)
        except (ConfigError, ValueError, FileNotFoundError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from verl_mega.parallel.pools import PoolPeerError
    from verl_mega.rewards import RewardFunctionFailed
    from verl_mega.rollout.fleet import FleetError
    from verl_mega.rollout.tools import ToolsFailed
    from verl_mega.checkpoint.manager import NonFiniteError
    from verl_mega.checkpoint.safe_load import disk_full_error
    from verl_mega.trainer.failures import end_attempt
    from verl_mega.trainer.preflight import describe_os_error
    from verl_mega.trainer.stop import INTERRUPTED_EXIT_CODE, Interrupted

    try:
        train(load_config(args.config, args.overrides))
    except (ConfigError, ValueError, FileNotFoundError, NonFiniteError, RewardFunctionFailed, PoolPeerError,
            ToolsFailed, FleetError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        end_attempt(f"error: {exc}")  # the cause a restarted job records (trainer/failures.py)
        return 2
    except Interrupted:  # the step was saved; 128 + SIGINT tells launchers not to restart the job
        end_attempt("ok")
        return INTERRUPTED_EXIT_CODE
    except KeyboardInterrupt:  # Ctrl-C outside the training loop's handlers (building, validating)
        print("interrupted: exiting without saving (Ctrl-C came outside a training step)", file=sys.stderr)
        end_attempt("interrupted (SIGINT) outside a training step")
        return INTERRUPTED_EXIT_CODE
    except BaseException as exc:  # torch's CheckpointException is a BaseException
        full = disk_full_error(exc)  # a full disk may surface wrapped in a checkpoint writer's error
        if full is None:
            end_attempt(f"{type(exc).__name__}: {exc}")
            raise
        print(f"error: {describe_os_error(full)}; free space there or point trainer.output_dir at another disk, then "
              f"resume (a checkpoint being written when it happened is incomplete and never loaded)", file=sys.stderr)
        end_attempt(f"error: {describe_os_error(full)}")
        return 2
    end_attempt("ok")
    return 0


def exit_now(code: int) -> None:
    """End the process the way the interpreter would (non-daemon threads joined, atexit handlers run, output
    flushed), less its teardown of the imported modules: with torch, vLLM and Megatron loaded that takes seconds
    (3-5 s measured on a 2-core box) and frees nothing the operating system does not free anyway. The job has
    already closed what it opened (checkpoints written, workers and process groups shut down). Under a profiler
    or a tracer (``python -m cProfile``, coverage), which write their results after the program returns, it
    returns instead."""
    import atexit
    import os
    import threading

    if sys.getprofile() is not None or sys.gettrace() is not None:
        sys.exit(code)

    shutdown = getattr(threading, "_shutdown", None)  # what interpreter exit calls first
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
