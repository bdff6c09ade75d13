"""A rank's helper processes end with it, however it ends (kill -9, the OOM killer, a crash in native code).

A rank starts helpers of its own and through the libraries it uses: reward and tool workers, multiprocessing's
resource tracker, Megatron's background checkpoint writer and its multiprocessing manager, rollout engines. A helper
whose rank is SIGKILLed is re-parented to init and lives on, holding the rank's stdout and stderr: Open MPI's
``mpirun`` waits for those to close and then never restarts the job, and every launcher leaves the helpers running.

:func:`end_helpers_with_this_process` starts a guard in the rank's process group when the rank leads it (torchrun
and launch/ray_launch.py start each rank in a session of its own), after moving an Open MPI rank, which shares
``mpirun``'s group, to a group of its own (Open MPI signals its ranks by pid, never by group). The guard is a
``/bin/sh`` loop that the kernel signals when the rank dies (``PR_SET_PDEATHSIG``, SIGUSR2), and which then SIGKILLs
the whole group, helpers and itself. The guard ignores SIGTERM and SIGINT, so a launcher's stop signal to the group
still lets the rank finish its step and save. A helper that leaves the group (``setsid``) is not covered by the
guard and ends through its own ``PR_SET_PDEATHSIG``.

No other process changes its group: whoever started it may stop it by its group (a test harness, a batch system,
a terminal's Ctrl-C), and a rank that left that group would escape them. Such a process gets no guard.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import threading

log = logging.getLogger(__name__)

__all__ = ["GUARD_SIGNAL", "end_helpers_with_this_process", "should_lead_group"]

GUARD_SIGNAL = signal.SIGUSR2  # nothing in the job sends it; launchers send TERM, INT or USR1 to stop a job
_PR_SET_PDEATHSIG = 1
# $1: the group to end. The guard waits in `wait`, which a trapped signal interrupts at once.
# It says "ready" once its trap is set: until then the death signal's default action would end the guard alone.
_GUARD_SCRIPT = ('trap "" TERM INT HUP USR1; trap \'kill -s KILL -- -"$1"\' USR2; echo ready; exec >/dev/null; '
                 '[ "$PPID" = "$2" ] || kill -s KILL -- -"$1"; while :; do sleep 3600 & wait $!; done')
_READY_TIMEOUT_S = 10.0
_guard: subprocess.Popen | None = None
_guard_parent = 0  # the process that started _guard (a forked child starts its own)


def should_lead_group(pid: int, pgid: int, foreground_pgid: int | None, under_mpirun: bool) -> bool:
    """Whether the rank moves to a process group of its own: only an Open MPI rank that does not lead its group,
    and not when that group is a terminal's foreground group (Ctrl-C must still reach it)."""
    return under_mpirun and pid != pgid and foreground_pgid != pgid


def _foreground_pgid() -> int | None:
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            if stream is not None and stream.isatty():
                return os.tcgetpgrp(stream.fileno())
        except (OSError, ValueError):
            continue
    return None


def end_helpers_with_this_process() -> bool:
    """Start the guard (once per process; a forked child starts its own). Returns whether a guard watches this
    process's group."""
    global _guard
    if not sys.platform.startswith("linux") or not os.path.exists("/bin/sh"):
        return False
    if threading.current_thread() is not threading.main_thread():  # the death signal follows the starting thread
        return False
    if _guard is not None and _guard.poll() is None and _guard_parent == os.getpid():
        return True
    pid, pgid, foreground = os.getpid(), os.getpgrp(), _foreground_pgid()
    if foreground == pgid:
        return False
    if pid != pgid and not should_lead_group(pid, pgid, foreground, "OMPI_COMM_WORLD_RANK" in os.environ):
        return False  # a group that is not the rank's own: ending it would end others
    if pid != pgid:
        try:
            os.setpgid(0, 0)
        except OSError as exc:  # e.g. a session leader's group cannot change; then it leads its group already
            log.debug("process guard: cannot lead a process group (%s)", exc)
            return False
    _start_guard(os.getpgrp(), pid)
    return True



def _arm() -> None:
    # between fork and exec in the guard: the kernel sends GUARD_SIGNAL when the rank's thread ends
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(GUARD_SIGNAL), 0, 0, 0)


def _start_guard(pgid: int, pid: int) -> None:
    global _guard, _guard_parent
    _guard = subprocess.Popen(["/bin/sh", "-c", _GUARD_SCRIPT, "verl-mega-guard", str(pgid), str(pid)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              close_fds=True, preexec_fn=_arm)
    _guard_parent = pid
    # no helper starts before the guard can end it
    ready, _, _ = select.select([_guard.stdout], [], [], _READY_TIMEOUT_S)
    if not ready or _guard.stdout.readline() != b"ready\n":
        log.warning("process guard: the guard (pid %d) did not start within %g s; a killed rank's helpers may "
                    "outlive it", _guard.pid, _READY_TIMEOUT_S)
    _guard.stdout.close()
