"""Stop requests: SIGTERM, SIGUSR1 (launch/mpirun.sh's SIGTERM) and SIGINT are noted by a handler, a second SIGINT
aborts, the time limit stops before another step would overrun it (the all-reduce across ranks is exercised by
tests/distributed/test_stop.py)."""

import os
import signal
import time

import pytest

from verl_mega.trainer.stop import StopRequest


def test_signals_are_noted_not_fatal_and_handlers_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert stop.agreed(0.1) == ""
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed(0.1) == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(0.1) == "SIGTERM"  # the more severe reason stays
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("first", [(signal.SIGINT,), (signal.SIGTERM, signal.SIGINT)], ids=["sigint", "sigterm"])
def test_second_sigint_aborts(first):
    """A second Ctrl-C aborts at once, also after a SIGTERM (the SIGINTs are counted on their own)."""
    with StopRequest() as stop:
        for sig in first:
            os.kill(os.getpid(), sig)
        assert stop.agreed(0.0) == signal.Signals(first[0]).name
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)


def test_sigusr1_is_a_sigterm():
    """launch/mpirun.sh passes SIGTERM on as SIGUSR1: Open MPI would kill the ranks on SIGTERM."""
    caller = []
    before = signal.signal(signal.SIGUSR1, lambda *args: caller.append("SIGUSR1"))  # else SIGUSR1 ends pytest
    try:
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGUSR1)
            assert stop.agreed(0.1) == "SIGTERM" and not caller
        os.kill(os.getpid(), signal.SIGUSR1)  # the caller's handler is back
        assert caller == ["SIGUSR1"]
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_time_limit_stops_before_a_step_would_overrun_it():
    stop = StopRequest(time_limit_s=10.0, started=time.monotonic() - 7.0)
    assert stop.agreed(1.0) == ""
    assert stop.agreed(4.0) == "trainer.time_limit_s"


def test_a_signal_another_pool_received_stops_the_run():
    with StopRequest() as stop:
        assert stop.agreed(0.1, peer="") == ""
        assert stop.agreed(0.1, peer="SIGTERM") == "SIGTERM"
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(0.1, peer="SIGTERM") == "SIGTERM"  # the more severe of the two


def test_a_rollout_pool_rank_takes_sigusr1_as_a_sigterm():
    """launch/mpirun.sh passes a SIGTERM on as SIGUSR1: a rollout pool's rank must record it, not die of it."""
    from verl_mega.rollout.base import STOP_REASONS
    from verl_mega.rollout.server import record_stop_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        received = record_stop_signals()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert STOP_REASONS[received[0]] == "SIGTERM"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


# ------------------------------------------------------------------------------------------- Ctrl-C's exit codes
def test_exit_codes_of_a_stopped_run():
    """Ctrl-C exits 128 + SIGINT, as a shell reports it (launchers do not restart it); a preemption or the time
    limit exits 0, as launchers expect of a job that saved its step."""
    from verl_mega.rollout.base import STOP_REASONS
    from verl_mega.trainer.stop import exit_code

    assert {reason: exit_code(reason) for reason in STOP_REASONS} == {
        "": 0, "trainer.time_limit_s": 0, "SIGINT": 130, "SIGTERM": 0}


def test_the_second_ctrl_c_line_names_the_newest_checkpoint(tmp_path):
    from verl_mega.trainer.stop import interrupted_twice

    assert interrupted_twice(tmp_path / "checkpoints") == ("interrupted twice: exiting without saving; no "
                                                           "checkpoint was saved yet")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000004\n")
    assert interrupted_twice(tmp_path / "checkpoints") == (
        f"interrupted twice: exiting without saving; the newest checkpoint is {tmp_path}/checkpoints/step_000004")


def test_a_second_sigint_calls_the_abort_given_instead_of_raising():
    class Aborted(Exception):
        pass

    def abort():
        raise Aborted

    with StopRequest(abort=abort) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.agreed(0.0) == "SIGINT"
        with pytest.raises(Aborted):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)


TWICE = """
import functools, os, signal, sys, time
from pathlib import Path
from verl_mega.trainer.stop import StopRequest, abort_now
with StopRequest(abort=functools.partial(abort_now, Path(sys.argv[1]))):
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(30)
print("not reached")
"""


def test_ctrl_c_twice_exits_130_at_once_with_one_line_and_no_traceback(tmp_path):
    import subprocess
    import sys

    (tmp_path / "latest").write_text("step_000002")
    done = subprocess.run([sys.executable, "-c", TWICE, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 130 and done.stdout == ""
    lines = [line for line in done.stderr.splitlines() if line.strip() and "SIGINT received" not in line]
    assert lines == [f"interrupted twice: exiting without saving; the newest checkpoint is {tmp_path}/step_000002"]


@pytest.mark.parametrize("raised, code, said", [("Interrupted", 130, ""), ("KeyboardInterrupt", 130, "interrupted: "),
                                                ("none", 0, "")])
def test_the_entry_point_exits_130_after_ctrl_c(monkeypatch, capsys, raised, code, said):
    import verl_mega.train as entry
    from verl_mega.trainer.stop import Interrupted

    def train(cfg):
        if raised == "Interrupted":
            raise Interrupted("stopped by SIGINT after saving step 2")
        if raised == "KeyboardInterrupt":
            raise KeyboardInterrupt
        return {}

    monkeypatch.setattr(entry, "train", train)
    monkeypatch.setattr(entry, "load_config", lambda *args: None)
    assert entry.main(["--config", "unused.yaml"]) == code
    err = capsys.readouterr().err
    assert (err.startswith(said) and len(err.splitlines()) == 1) if said else err == ""
