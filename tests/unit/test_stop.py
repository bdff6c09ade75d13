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
    from verl_mega.rollout.disaggregated import record_stop_signals

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        received = record_stop_signals()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert STOP_REASONS[received[0]] == "SIGTERM"
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
