"""Stopping a run cleanly on SIGTERM, SIGINT (Ctrl-C) or ``trainer.time_limit_s``, agreed by every rank.

A signal may reach only some ranks: preempting one node of a job signals its processes only. Each rank notes what it
received (a rollout pool of its own passes its signals on to the trainer's first rank); at the end of every step all
ranks combine their notes (an all-reduce of one number over the world), so either every rank saves that step and
exits, or none does: no rank waits in a collective that the others never join. A second SIGINT on a
rank aborts it at once, whatever other signals came in between: ``python -m verl_mega.train`` prints one line and
exits 130 without saving (:func:`abort_now`); the Python API raises KeyboardInterrupt. SIGUSR1 is a SIGTERM passed on
by ``launch/mpirun.sh``: Open MPI ends the ranks a moment after it receives SIGTERM, but forwards SIGUSR1 untouched.

Exit codes: a run stopped by SIGINT exits 130 (128 + SIGINT, as a shell reports an interrupted command), so that
launchers take it for a stop, not a failure to restart; one stopped by SIGTERM (a preemption) or the time limit
exits 0, as launchers and schedulers expect of a job that saved its step.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from verl_mega.parallel.state import pool_group
from verl_mega.rollout.base import STOP_REASONS, STOP_SIGNALS  # by severity: the all-reduce keeps the largest

log = logging.getLogger("verl_mega")

INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT  # 130


class Interrupted(Exception):
    """The run stopped on SIGINT after saving its step: the process exits :data:`INTERRUPTED_EXIT_CODE`."""


def exit_code(reason: str) -> int:
    """The exit code of a run that stopped for ``reason`` (a STOP_REASONS entry; '' when it ran to its end)."""
    return INTERRUPTED_EXIT_CODE if reason == "SIGINT" else 0


def interrupted_twice(checkpoints: Path) -> str:
    """The one line of a second Ctrl-C: what is lost and where the run can resume from."""
    latest = checkpoints / "latest"
    try:
        newest = f"the newest checkpoint is {checkpoints / latest.read_text().strip()}"
    except OSError:
        newest = "no checkpoint was saved yet"
    return f"interrupted twice: exiting without saving; {newest}"


def abort_now(checkpoints: Path) -> NoReturn:
    """The second Ctrl-C of ``python -m verl_mega.train``: one line, then exit 130 at once. Nothing is closed: the
    step in progress and a save being written are dropped (an unfinished checkpoint is never loaded), and the
    helpers die with the process."""
    from verl_mega.trainer.failures import end_attempt

    line = interrupted_twice(checkpoints)
    try:
        sys.stderr.write(f"\n{line}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    end_attempt(line)
    os._exit(INTERRUPTED_EXIT_CODE)


class StopRequest:
    """Signal handlers plus the per-step agreement. Use as a context manager around the training loop."""

    def __init__(self, time_limit_s: float | None = None, *, started: float | None = None,
                 abort: Callable[[], Any] | None = None) -> None:
        self.time_limit_s = time_limit_s
        self._abort = abort  # the second Ctrl-C; without it, a KeyboardInterrupt
        self.started = time.monotonic() if started is None else started
        self.received: str = ""
        self._sigints = 0  # counted on their own: a SIGTERM before them must not keep a second Ctrl-C from aborting
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:  # noqa: ARG002
        reason = STOP_SIGNALS[signal.Signals(signum)]
        if signum == signal.SIGINT:
            self._sigints += 1
            if self._sigints > 1:  # the second Ctrl-C: stop now, without the checkpoint
                if self._abort is not None:
                    self._abort()
                raise KeyboardInterrupt
        if STOP_REASONS.index(reason) > STOP_REASONS.index(self.received):
            self.received = reason
        hint = " (Ctrl-C again aborts at once)" if signum == signal.SIGINT else ""
        log.warning("%s received: the current step finishes, every rank saves a checkpoint, then the run exits%s",
                    signal.Signals(signum).name, hint)

    def agreed(self, last_step_s: float, *, peer: str = "") -> str:
        """Collective, once per step on every rank: the stop reason all ranks agree on ('' = go on). The time limit
        stops the run when another step of the last one's duration would end past it. ``peer``: a signal that ranks
        outside this world received (a rollout pool of its own), as this rank has heard of it."""
        local = max(STOP_REASONS.index(self.received), STOP_REASONS.index(peer))
        if self.time_limit_s is not None and time.monotonic() - self.started + last_step_s > self.time_limit_s:
            local = max(local, STOP_REASONS.index("trainer.time_limit_s"))
        if dist.is_initialized() and dist.get_world_size() > 1:
            from verl_mega.parallel.cpu_mode import comm_device

            flag = torch.tensor([local], dtype=torch.int32, device=comm_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pool_group())
            local = int(flag.item())
        return STOP_REASONS[local]
