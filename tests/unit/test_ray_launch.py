"""launch/ray_launch.py's waits, in-process with a fake Ray: placement groups that never become ready end the attempt
with one line naming the node, and a signal to the driver goes on to the ranks as SIGTERM, with a grace period
before they are killed. With a real Ray cluster: tests/distributed/test_async.py (the launcher under a whole run)."""

import argparse
import importlib.util
import signal
import threading
import time
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location("ray_launch", Path(__file__).resolve().parents[2] / "launch" /
                                              "ray_launch.py")
ray_launch = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ray_launch)


class Ref:
    def __init__(self, rc: int | None = None) -> None:
        self.rc, self.done = rc, threading.Event()
        if rc is not None:
            self.done.set()

    def finish(self, rc: int) -> None:
        self.rc = rc
        self.done.set()


class FakeRay:
    def wait(self, refs, num_returns=1, timeout=None):
        end = time.monotonic() + (timeout or 0)
        while True:
            done = [r for r in refs if r.done.is_set()][:num_returns]
            if len(done) == num_returns or time.monotonic() >= end:
                return done, [r for r in refs if r not in done]
            time.sleep(0.01)

    def get(self, ref):
        return ref.rc


class Rank:
    """A rank's actor: ``obeys`` SIGTERM by saving and exiting 0 a little later, or ignores it."""

    def __init__(self, ref: Ref, obeys: bool) -> None:
        self.ref, self.obeys, self.terminated = ref, obeys, 0
        rank = self

        class Method:
            def remote(self) -> None:
                rank.terminated += 1
                if rank.obeys:
                    threading.Timer(0.2, rank.ref.finish, args=(0,)).start()

        self.terminate = Method()


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"timeout": None, "stop_grace_s": 1.0, **kw})


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch):
    monkeypatch.setattr(ray_launch, "POLL_S", 0.05)


def run_with_signal(ranks: list[Rank], stop, *, signals: int = 1, **kw) -> tuple[int, float]:
    refs = {r.ref: i for i, r in enumerate(ranks)}
    for _ in range(signals):
        threading.Timer(0.1, stop.on_signal, args=(signal.SIGTERM, None)).start()
    began = time.monotonic()
    rc = ray_launch._wait_ranks(FakeRay(), refs, ranks, args(**kw), stop)
    return rc, time.monotonic() - began


def test_sigterm_to_the_driver_reaches_every_rank_which_saves_and_exits(capsys):
    ranks = [Rank(Ref(), obeys=True) for _ in range(2)]
    rc, took = run_with_signal(ranks, ray_launch.Stop())
    assert rc == 0 and took < 1.0 and [r.terminated for r in ranks] == [1, 1]
    assert "ray_launch: SIGTERM received: passing SIGTERM to every rank (each saves its step and exits); ranks still " \
           "running after --stop-grace-s 1 are killed" in capsys.readouterr().err


def test_ranks_that_do_not_stop_are_killed_after_the_grace_period_or_a_second_signal(capsys):
    ranks = [Rank(Ref(), obeys=True), Rank(Ref(), obeys=False)]
    rc, took = run_with_signal(ranks, ray_launch.Stop())
    assert rc == 128 + signal.SIGTERM and 1.0 <= took < 2.0
    assert "ray_launch: error: rank(s) [1] still running after SIGTERM and --stop-grace-s 1 passed; killing them" \
        in capsys.readouterr().err
    stuck = [Rank(Ref(), obeys=False)]
    rc, took = run_with_signal(stuck, ray_launch.Stop(), signals=2, stop_grace_s=60.0)
    assert rc == 128 + signal.SIGTERM and took < 1.0
    assert "still running after SIGTERM and a second signal came; killing them" in capsys.readouterr().err


def test_placement_groups_not_ready_end_the_attempt_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(ray_launch, "PG_READY_S", 0.2)
    removed = []

    class Group:
        def ready(self):
            return Ref()  # never

    class Ray(FakeRay):
        def nodes(self):
            return [{"Alive": True, "Resources": {"CPU": 4}, "NodeManagerAddress": "10.0.0.7", "NodeID": "n1"}]

        def remote(self, **kw):
            return lambda cls: cls

    fakes = (Ray(), lambda *a, **kw: Group(), removed.append, None)
    monkeypatch.setattr(ray_launch, "_import_ray", lambda: fakes)
    rc = ray_launch._run_once(args(cpu=True, nnodes=None, nproc_per_node=2, wait_for_nodes=5, master_port=None),
                              ["-c", "pass"], 0)
    err = capsys.readouterr().err
    assert rc == 1 and len(removed) == 1
    assert err == ("ray_launch: error: the placement group of 2 CPU(s) on node(s) ['10.0.0.7'] was not ready after "
                   "0.2 s (other jobs or actors hold them? see `ray status`); stopping this attempt\n")


def test_a_job_stopped_by_a_signal_is_not_restarted(monkeypatch):
    attempts = []

    def attempt(args, prog, restart, stop):
        attempts.append(restart)
        stop.on_signal(signal.SIGTERM, None)  # came while the ranks ran; one of them failed as it stopped
        return 1

    monkeypatch.setattr(ray_launch, "_import_ray", lambda: (None,))
    monkeypatch.setattr(ray_launch, "_connect", lambda *a: None)
    monkeypatch.setattr(ray_launch.signal, "signal", lambda sig, handler: None)  # the test process keeps its own
    monkeypatch.setattr(ray_launch, "_run_once", attempt)
    assert ray_launch.main(["--cpu", "--max-restarts", "3", "--", "-c", "pass"]) == 1 and attempts == [0]


def test_a_job_whose_rank_exited_130_after_ctrl_c_is_not_restarted(monkeypatch):
    """A rank that got Ctrl-C saves its step and exits 128 + SIGINT: a stop, passed on as the job's exit code."""
    attempts = []

    def attempt(args, prog, restart, stop):
        attempts.append(restart)
        return 130

    monkeypatch.setattr(ray_launch, "_import_ray", lambda: (None,))
    monkeypatch.setattr(ray_launch, "_connect", lambda *a: None)
    monkeypatch.setattr(ray_launch.signal, "signal", lambda sig, handler: None)
    monkeypatch.setattr(ray_launch, "_run_once", attempt)
    assert ray_launch.main(["--cpu", "--max-restarts", "3", "--", "-c", "pass"]) == 130 and attempts == [0]
