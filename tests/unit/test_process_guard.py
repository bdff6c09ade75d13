"""A rank's helpers end with it: the process guard (verl_mega/parallel/process_guard.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from verl_mega.parallel.process_guard import should_lead_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

RANK = textwrap.dedent("""
    import signal, subprocess, sys, time
    from verl_mega.parallel.process_guard import end_helpers_with_this_process
    signal.signal(signal.SIGTERM, lambda *_: None)  # a rank finishing its step: a stop signal does not end it
    print(end_helpers_with_this_process(), flush=True)
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a helper (a reward worker)
    print(helper.pid, flush=True)
    time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, bound_s: float = 20.0) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def _wait_group_gone(pgid: int, bound_s: float = 20.0) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        members = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
        if not any(_alive(int(pid)) for pid in members):
            return True
        time.sleep(0.05)
    return False


def _kill(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start_rank():
    proc = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env={**os.environ, "OMPI_COMM_WORLD_RANK": "0"})
    guarded = proc.stdout.readline().strip()
    helper = int(proc.stdout.readline())
    return proc, guarded, helper


def test_a_killed_ranks_helpers_die_with_it():
    """kill -9 of the rank: its helper (not a child of the guard, and never told) is gone, and so is the guard."""
    proc, guarded, helper = _start_rank()
    try:
        assert guarded == "True"
        assert os.getpgid(proc.pid) == proc.pid != os.getpgrp()  # the rank leads a group of its own
        assert _alive(helper)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert _wait_gone(helper), "the killed rank's helper outlived it"
        assert _wait_group_gone(proc.pid), "the guard left members of the rank's group running"
    finally:
        _kill(proc.pid, helper)


def test_a_stop_signal_to_the_group_leaves_the_rank_to_finish():
    """SIGTERM to the rank's whole group (a launcher's stop): the guard does not end the group, so the rank can save
    its step; its helpers end once it does."""
    proc, _, helper = _start_rank()
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGKILL)  # the helper here ignores nothing: SIGTERM ended it; the guard, no
        proc.wait(timeout=10)
        assert _wait_gone(helper)
    finally:
        _kill(proc.pid, helper)


@pytest.mark.parametrize("pid, pgid, foreground, mpi, want", [
    (10, 10, None, True, False),  # leads its group already (torchrun and ray_launch.py start each rank in a session)
    (10, 7, None, True, True),    # in mpirun's group: moves out, so the guard can end its group alone
    (10, 7, 7, True, False),      # in a terminal's foreground group: stays, so Ctrl-C reaches it
    (10, 7, 3, True, True),       # in a background group of a terminal
    (10, 7, None, False, False),  # started by anything else: whoever started it may stop it by its group
])
def test_who_moves_to_a_group_of_its_own(pid, pgid, foreground, mpi, want):
    assert should_lead_group(pid, pgid, foreground, mpi) is want


def test_a_process_in_a_group_it_does_not_lead_stays_and_gets_no_guard():
    """Not under mpirun and not leading its group (e.g. a harness that stops its jobs by group): no move, no guard."""
    code = ("import os; from verl_mega.parallel.process_guard import end_helpers_with_this_process as g; "
            "print(g(), os.getpgrp() == os.getppid() or os.getpgrp() != os.getpid())")
    env = {k: v for k, v in os.environ.items() if k != "OMPI_COMM_WORLD_RANK"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         stdin=subprocess.DEVNULL)
    assert out.stdout.split() == ["False", "True"], out.stderr
