"""The bridge's heartbeat checks and the rollout leader's wait for commands (verl_mega/parallel/pools.py,
verl_mega/rollout/server.py), in-process with fake stores and groups: a store whose host (job rank 0) is
stopped or dead is named as rank 0's silence or death instead of blocking the check for good, and the wait for the
trainer's next command ends, naming it, even when the thread that waits is stuck. The same with real processes:
tests/distributed/test_fault_tolerance.py."""

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from verl_mega.config.base import ConfigError
from verl_mega.config.run import TrainerConfig
from verl_mega.parallel.placement import Placement, Pool
from verl_mega.parallel.pools import Bridge, PoolPeerError

PLACEMENT = Placement(2, (Pool(name="train", ranks=(0,)), Pool(name="rollout", ranks=(1,), trains=False)),
                      {"actor": "train", "rollout": "rollout"})


class Store:
    """The job's store as a client sees it: counters, or a host that stopped (every call blocks) or died."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.frozen = threading.Event()
        self.dead = False

    def add(self, key: str, n: int) -> int:
        if self.frozen.is_set():
            threading.Event().wait(60)  # a stopped host: no answer (the store's timeout does not bound add)
        if self.dead:
            raise dist.DistNetworkError("Connection reset by peer")
        self.counts[key] = self.counts.get(key, 0) + n
        return self.counts[key]


def bridge(store, *, heartbeat_timeout_s: float, control=None, timeout_s: float = 1800.0) -> Bridge:
    return Bridge(PLACEMENT, 1, 2, store, datetime.timedelta(seconds=timeout_s), control,
                  heartbeat_timeout_s=heartbeat_timeout_s)


def within(seconds: float, fn):
    """``fn()``'s exception (or None), failing the test if it is still running after ``seconds``."""
    out: list = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"still blocked after {seconds} s"
    return out[0]


def poll(watch, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        watch.check("waiting for the training pool's next command")
        time.sleep(0.02)


@pytest.fixture
def fast_beats(monkeypatch):
    """Heartbeats read every 0.05 s (a tenth of the real period), so that each test takes a fraction of a second."""
    import verl_mega.parallel.pools as pools

    monkeypatch.setattr(pools, "HEARTBEAT_S", 0.1)


def test_a_stopped_store_host_is_named_after_the_heartbeat_timeout(fast_beats):
    store = Store()
    watch = bridge(store, heartbeat_timeout_s=0.5).heartbeats((0,))
    store.frozen.set()  # job rank 0, which hosts the store, is SIGSTOPped
    began = time.monotonic()
    err = within(10, lambda: poll(watch, 10))
    took = time.monotonic() - began
    assert isinstance(err, PoolPeerError), err
    text = str(err)
    assert text.startswith("rank 0 of pool 'train' sent no heartbeat for ") and "\n" not in text
    assert "while waiting for the training pool's next command: the job's store on its node did not answer" \
        in text and "(trainer.pool_heartbeat_timeout_s=0.5)" in text
    assert 0.5 < took < 2, took


def test_a_dead_store_host_is_a_peer_error_not_a_raw_network_error(fast_beats):
    store = Store()
    watch = bridge(store, heartbeat_timeout_s=6).heartbeats((0,))
    store.dead = True
    err = within(10, lambda: poll(watch, 2))
    assert isinstance(err, PoolPeerError), err
    assert str(err).startswith("rank 0 of pool 'train' did not answer while waiting for the training pool's next "
                               "command (reading heartbeats from the job's store on its node) (Connection reset")


def test_a_peer_that_stops_beating_is_named_and_one_that_beats_is_not(fast_beats):
    store = Store()
    watch = bridge(store, heartbeat_timeout_s=0.5).heartbeats((0,))
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            store.add("verl_mega/alive/0", 1)

    threading.Thread(target=beat, daemon=True).start()
    poll(watch, 1.0)  # twice the timeout, beating: no error
    stop.set()
    began = time.monotonic()
    err = within(10, lambda: poll(watch, 10))
    assert isinstance(err, PoolPeerError) and "rank 0 of pool 'train' sent no heartbeat for" in str(err)
    assert ": it is stopped (SIGSTOP, a frozen node) or hung" in str(err)
    assert time.monotonic() - began < 2


class StuckControl:
    """A control group whose receive never completes, its own timeout notwithstanding (the case the inbox's bound
    is for)."""

    def recv(self, tensors, src, tag):
        class Work:
            def wait(self, timeout=None):
                threading.Event().wait(60)

        return Work()


def test_the_wait_for_the_next_command_ends_naming_the_trainer(monkeypatch):
    import verl_mega.rollout.server as server

    monkeypatch.setattr(server, "HEARTBEAT_S", 0.1)  # the slack over the wait's own bounds
    inbox = server.Inbox(bridge(Store(), heartbeat_timeout_s=0, control=StuckControl(), timeout_s=0.2), 0)
    assert inbox.take(wait=True, timeout=0.05) == []  # a short wait that finds nothing is no error
    err = within(10, lambda: inbox.take(wait=True))
    assert isinstance(err, PoolPeerError), err
    text = str(err)
    assert text.startswith("rank 0 of pool 'train' did not answer while waiting for the training pool's next command "
                           "(no command and no error for ") and "\n" not in text
    assert "trainer.collective_timeout_s=0.2" in text


def test_heartbeat_timeouts_shorter_than_three_beats_are_refused():
    assert TrainerConfig(pool_heartbeat_timeout_s=0).pool_heartbeat_timeout_s == 0  # off
    assert TrainerConfig(pool_heartbeat_timeout_s=6).pool_heartbeat_timeout_s == 6
    for bad in (1, 5.9):
        with pytest.raises(ConfigError) as err:
            TrainerConfig(pool_heartbeat_timeout_s=bad)
        assert str(err.value) == (f"trainer.pool_heartbeat_timeout_s={bad:g} is shorter than 3 heartbeats (one "
                                  f"every 2 s), so a healthy peer would be reported hung; set it to 0 (off) or at "
                                  f"least 6, e.g. trainer.pool_heartbeat_timeout_s=60")
