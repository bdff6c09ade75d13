"""The training pool's side of a rollout pool of its own (rollout/disaggregated.py RemoteRollout) against a scripted
pool that answers in order: the asynchronous window is asked for once per batch, and a validation's generation,
which receives the batches asked for ahead in passing, neither strands them nor makes the next steps synchronous.
The real two-pool runs are in tests/distributed/test_async.py."""

import types

import pytest

from verl_mega.rollout import disaggregated
from verl_mega.rollout.base import Sample, SamplingSpec
from verl_mega.rollout.server import Outbox


class ScriptedPool:
    """Job rank 0's bridge to a rollout pool that generates each request with the weights sent before it."""

    rank = 0

    def __init__(self) -> None:
        self.placement = types.SimpleNamespace(pool_of=lambda name: types.SimpleNamespace(ranks=[1]))
        self.version = 0
        self.asked: list[int] = []
        self.answers: list[dict] = []

    def send(self, command: dict, *args, **kwargs) -> list:
        if command["op"] == "generate":
            self.asked.append(command["id"])
            samples = [Sample(p, [1], [0.0], None, None, [self.version]) for p in range(len(command["prompts"]))]
            self.answers.append({"id": command["id"], "version": self.version, "samples": [samples]})
        elif command["op"] == "weights":
            self.version += 1
        return []

    def recv(self, *args, **kwargs) -> dict:
        return self.answers.pop(0)

    def wait(self, *args, **kwargs) -> None:
        pass

    def watching(self, ranks, what, fn):
        return fn()


@pytest.fixture
def remote(monkeypatch):
    monkeypatch.setattr(disaggregated.dist, "broadcast_object_list", lambda box, src, group: None)
    monkeypatch.setattr(disaggregated, "pool_group", lambda: None)
    pool = ScriptedPool()
    rollout = disaggregated.RemoteRollout(pool, types.SimpleNamespace(sync=dict), engine_index=0, num_engines=1,
                                          engine_leader=True)
    return pool, rollout


def _batch(t: int) -> tuple[list[list[int]], list[SamplingSpec]]:
    return [[100 + 2 * t], [101 + 2 * t]], [SamplingSpec(n=1, seed=t)]


@pytest.mark.parametrize("val_every", [0, 1, 3])
def test_a_validation_between_steps_strands_no_batch_asked_for_ahead(remote, val_every):
    pool, rollout = remote
    k, steps = 2, 9
    validation = ([[7], [8]], [SamplingSpec(n=1, temperature=0.0, seed=1)])
    rollout.update_weights()
    staleness = []
    for t in range(steps):
        rollout.prefetch([_batch(u) for u in range(t, min(t + k + 1, steps))])  # the loop's window, t..t+k
        (got,) = rollout.generate(*_batch(t))
        staleness.append(rollout.weight_version - got.version)
        rollout.update_weights()
        if val_every and (t + 1) % val_every == 0:
            (val,) = rollout.generate(*validation)
            assert val.version == rollout.weight_version  # asked for after the update: the newest weights
    validations = steps // val_every if val_every else 0
    assert len(pool.asked) == steps + validations  # every batch asked for once, each validation once
    assert staleness == [0, 1] + [k] * (steps - 2)  # still k steps off-policy after each validation
    assert rollout._received == {}  # nothing held after the run


def test_results_of_batches_no_longer_in_the_window_are_dropped(remote):
    """An API caller that trains its own batch instead of the one asked for ahead: what came back for the batch
    it skipped is not kept for the rest of the run."""
    pool, rollout = remote
    rollout.prefetch([_batch(0), _batch(1)])
    rollout.generate(*_batch(5))  # its own batch: receives batches 0 and 1 on the way
    assert len(rollout._received) == 2
    rollout.prefetch([_batch(6), _batch(7)])
    assert rollout._received == {}
    assert pool.asked == [0, 1, 2, 3, 4]


def test_a_stop_signal_rides_on_the_first_batch_sent_after_it(monkeypatch):
    """Batches finished ahead wait in the pool leader's outbox; a SIGTERM that reaches the pool then is known to the
    trainer with the first batch that leaves after it, not behind every batch already queued."""
    import queue
    import time

    monkeypatch.setattr(disaggregated, "pool_group", lambda: None)
    monkeypatch.setattr(disaggregated.dist, "broadcast_object_list", lambda box, src, group: None)
    wire: queue.Queue = queue.Queue(maxsize=1)  # a send completes only once the trainer has taken the one before

    class Wire:
        def send(self, message, *args):
            wire.put(message)
            return []

        def wait(self, *args, **kwargs):
            pass

    outbox = Outbox(Wire(), 0)
    for request in range(4):  # max_staleness = 3: batches 1-3 finished while the trainer trains on batch 0
        outbox.put({"id": request})
    deadline = time.monotonic() + 5
    while outbox._queue.qsize() > 2 and time.monotonic() < deadline:  # 0 on the wire, 1 being sent, 2 and 3 queued
        time.sleep(0.01)
    outbox.signal("SIGTERM")
    pool = types.SimpleNamespace(placement=types.SimpleNamespace(pool_of=lambda name: types.SimpleNamespace(ranks=[1])),
                                 rank=0, recv=lambda *a, **k: wire.get(timeout=5))
    trainer = disaggregated.RemoteRollout(pool, None, engine_index=0, num_engines=1, engine_leader=True)
    seen = []
    for request in range(4):
        assert trainer._receive(request)["id"] == request
        seen.append(trainer.stop_requested)
    assert seen == ["", "", "SIGTERM", "SIGTERM"]  # batch 1 was on its way already; batch 2 carries it
