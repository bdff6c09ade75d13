"""The rollout fleet's dispatcher (verl_mega/rollout/fleet.py) with scripted engine handles and a manual clock:
whole groups redone after a death or a hang, nothing returned twice, refits before serving, bounded restarts, and
the typed error that names every engine. The chaos test with real engine processes is in
tests/distributed/test_fleet.py."""

import pytest

from verl_mega.config.base import ConfigError
from verl_mega.config.rl import FleetConfig
from verl_mega.rollout.base import SamplingSpec
from verl_mega.rollout.fleet import Dispatcher, FleetError, Group
from verl_mega.rollout.fleet_engine import faults


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """One incarnation: records what it was sent; the test scripts what it says and how it ends."""

    def __init__(self, index: int, incarnation: int, clock: "Clock") -> None:
        self.index, self.incarnation, self.clock = index, incarnation, clock
        self.sent: list[tuple] = []
        self.inbox: list[tuple] = []
        self.ended: str | None = None
        self.killed = False
        self.heard: float | None = None
        self.arrived_at: float | None = None  # when what is in the inbox came; None: as it is read

    def last_heard(self) -> float | None:
        return self.heard

    def send(self, message: tuple) -> None:
        self.sent.append(message)

    def receive(self) -> list[tuple]:
        out, self.inbox = self.inbox, []
        if out:
            self.heard = self.clock() if self.arrived_at is None else self.arrived_at
        return out

    def exit_reason(self) -> str | None:
        return self.ended

    def kill(self) -> None:
        self.killed = True
        self.ended = self.ended or "killed"

    def generating(self) -> list:
        """Keys it was asked to generate."""
        return [m[1] for m in self.sent if m[0] == "generate"]


class Fleet:
    def __init__(self, engines: int = 2, max_restarts: int = 1, hang: float = 10.0) -> None:
        self.clock = Clock()
        self.incarnations: dict[int, list[FakeEngine]] = {}
        self.d = Dispatcher(engines, self.start, hang_timeout_s=hang, start_timeout_s=100.0,
                            max_restarts=max_restarts, clock=self.clock)

    def start(self, index: int) -> FakeEngine:
        engine = FakeEngine(index, len(self.incarnations.get(index, [])), self.clock)
        self.incarnations.setdefault(index, []).append(engine)
        return engine

    def now(self, i: int) -> FakeEngine:
        return self.incarnations[i][-1]

    def ready(self, *engines: int) -> None:
        for i in engines:
            self.now(i).inbox.append(("ready", f"layout{i}"))
        self.d.poll()

    def finish(self, i: int, out: dict) -> None:
        """Engine i returns every group it holds now."""
        e = self.now(i)
        for key in list(self.d.engines[i].held):
            e.inbox.append(("done", key, f"samples of {key} by {i}.{e.incarnation}"))
        out.update(self.d.poll())


def groups(request: int, prompts: int, version: int = 0) -> list[Group]:
    return [Group((request, 0, p), [p], SamplingSpec(n=4, seed=p), version) for p in range(prompts)]


def test_groups_spread_over_serving_engines_and_come_back_once():
    f = Fleet()
    f.ready(0, 1)
    assert f.d.layout == "layout0" and f.d.metrics()["healthy_engines"] == 2.0
    f.d.submit(groups(0, 6))
    f.d.poll()
    assert sorted(f.now(0).generating() + f.now(1).generating()) == [(0, 0, p) for p in range(6)]
    assert len(f.now(0).generating()) == len(f.now(1).generating()) == 3
    out: dict = {}
    f.finish(0, out)
    f.finish(1, out)
    assert sorted(out) == [(0, 0, p) for p in range(6)] and not f.d.busy
    # an answer the engine no longer owes (sent twice, or late) is not returned again
    f.now(0).inbox.append(("done", (0, 0, 0), "again"))
    assert f.d.poll() == []


def test_a_dead_engine_s_groups_are_redone_whole_on_the_other_and_it_restarts_with_the_weights():
    f = Fleet()
    f.ready(0, 1)
    f.d.refit("w1", 1)  # the first weights: both engines refit before serving, and count as healthy meanwhile
    assert [e.state for e in f.d.engines] == ["refitting"] * 2 and f.d.metrics()["healthy_engines"] == 2.0
    for i in (0, 1):
        assert f.now(i).sent[-1] == ("weights", "w1", 1)
        f.now(i).inbox.append(("refitted", 1))
    f.d.poll()
    f.d.submit(groups(3, 4, version=1))
    f.d.poll()
    lost = f.now(0).generating()
    f.now(0).inbox.append(("done", lost[0], "finished before the death"))  # kept: not redone
    out = dict(f.d.poll())
    f.now(0).ended = "pid 1 was killed by SIGKILL"
    out.update(f.d.poll())
    assert f.d.redispatched == len(lost) - 1 == 1
    assert f.now(1).generating() == [*[k for k in groups_keys(3, 4) if k not in lost], *lost[1:]]
    assert len(f.incarnations[0]) == 2 and f.d.restarts == 1 and f.d.engines[0].state == "starting"
    assert f.d.metrics()["healthy_engines"] == 1.0  # a starting engine is not
    f.finish(1, out)
    assert sorted(out) == groups_keys(3, 4)  # every group once
    assert out[lost[0]] == "finished before the death"
    # the new incarnation joins: refitted with the current weights before it is sent anything; its share of the
    # next batch is held for it meanwhile (the serving engine takes the first group of a tie)
    f.now(0).inbox.append(("ready", "layout0"))
    f.d.submit(groups(4, 2, version=1))
    f.d.poll()
    assert f.now(0).sent == [("weights", "w1", 1)] and f.d.engines[0].state == "refitting"
    assert f.now(1).generating()[-1] == (4, 0, 0) and (4, 0, 1) not in f.now(1).generating()
    f.now(0).inbox.append(("refitted", 1))
    f.d.poll()
    assert f.now(0).generating() == [(4, 0, 1)]
    assert f.d.metrics() == {"healthy_engines": 2.0, "redispatched_prompts": 1.0, "engine_restarts": 1.0}
    f.finish(0, out)
    f.finish(1, out)
    assert sorted(out) == groups_keys(3, 4) + groups_keys(4, 2) and not f.d.busy


def test_after_a_refit_the_batch_is_shared_however_the_engines_finish_refitting():
    """The engine that reports "refitted" first does not take the whole batch: the one still refitting keeps its
    share, sent to it once it serves. An engine that dies while refitting gives its share back whole."""
    f = Fleet(max_restarts=1)
    f.ready(0, 1)
    f.d.refit("w1", 1)
    f.now(1).inbox.append(("refitted", 1))  # engine 1 first, before the batch comes
    f.d.poll()
    f.d.submit(groups(1, 6, version=1))
    f.d.poll()
    assert f.now(1).generating() == [(1, 0, 0), (1, 0, 2), (1, 0, 4)]
    assert f.now(0).generating() == [] and list(f.d.engines[0].held) == [(1, 0, 1), (1, 0, 3), (1, 0, 5)]
    f.now(0).inbox.append(("refitted", 1))
    f.d.poll()
    assert f.now(0).generating() == [(1, 0, 1), (1, 0, 3), (1, 0, 5)]
    out: dict = {}
    f.finish(0, out)
    f.finish(1, out)
    assert sorted(out) == groups_keys(1, 6) and not f.d.busy
    # the next refit: engine 0 dies before it holds the new weights; its held share goes to engine 1, sent once
    f.d.refit("w2", 2)
    f.d.submit(groups(2, 4, version=2))
    f.d.poll()
    assert f.now(0).generating()[3:] == f.now(1).generating()[3:] == []  # both refitting: nothing sent yet
    share = list(f.d.engines[0].held)
    assert share == [(2, 0, 0), (2, 0, 2)]
    f.now(0).ended = "pid 1 was killed by SIGKILL"
    f.now(1).inbox.append(("refitted", 2))
    f.d.poll()
    assert f.d.redispatched == 2 and f.incarnations[0][0].generating() == [(1, 0, 1), (1, 0, 3), (1, 0, 5)]
    assert f.now(1).generating()[3:] == [(2, 0, 1), (2, 0, 3), (2, 0, 0), (2, 0, 2)]  # its own, then the dead one's
    f.finish(1, out)
    assert sorted(k for k in out if k[0] == 2) == groups_keys(2, 4)


def groups_keys(request: int, prompts: int) -> list:
    return [(request, 0, p) for p in range(prompts)]


def test_an_idle_engine_takes_half_of_what_a_slow_refit_holds_unsent():
    f = Fleet()
    f.ready(0, 1)
    f.d.refit("w1", 1)
    f.d.submit(groups(1, 6, version=1))
    f.d.poll()
    assert [list(e.held) for e in f.d.engines] == [groups_keys(1, 6)[0::2], groups_keys(1, 6)[1::2]]
    f.now(1).inbox.append(("refitted", 1))
    out: dict = {}
    f.finish(1, out)  # engine 1 serves its three and is idle; engine 0 is still refitting
    assert f.now(1).generating()[3:] == [(1, 0, 2), (1, 0, 4)]  # the later half of engine 0's share
    assert f.d.engines[0].state == "refitting" and list(f.d.engines[0].held) == [(1, 0, 0)]
    f.now(0).inbox.append(("refitted", 1))
    f.d.poll()
    assert f.now(0).generating() == [(1, 0, 0)]
    f.finish(0, out)
    f.finish(1, out)
    assert sorted(out) == groups_keys(1, 6) and not f.d.busy and f.d.redispatched == 0


def test_a_hung_engine_is_killed_after_its_heartbeat_timeout_and_its_groups_move():
    f = Fleet(hang=10.0)
    f.ready(0, 1)
    f.d.submit(groups(0, 4))
    f.d.poll()
    held = f.now(1).generating()
    for _ in range(3):  # engine 0 keeps beating, engine 1 is silent (SIGSTOP)
        f.clock.now += 4.0
        f.now(0).inbox.append(("beat",))
        f.d.poll()
    assert f.incarnations[1][0].killed and len(f.incarnations[1]) == 2
    assert f.d.engines[1].failures == ["sent no heartbeat for 12 s while serving (stopped or hung; "
                                       "rollout.fleet.hang_timeout_s=10)"]
    assert f.now(0).generating()[-len(held):] == held and f.d.redispatched == len(held)


def test_silence_counts_from_the_last_beat_s_arrival_not_from_when_the_supervisor_read_it():
    """A supervisor held up for 8 s (a weight file written, a slow host) then reads a beat that came at 1 s, just
    before the engine was stopped: the engine has been silent for 7 s, past the 5 s bound, and is failed now, not
    5 s after this late read (a stopped engine went unnoticed for 16 s against a 5 s bound that way)."""
    f = Fleet(hang=5.0)
    f.ready(0, 1)
    f.d.submit(groups(0, 4))
    f.d.poll()
    f.clock.now = 8.0
    f.now(0).inbox.append(("beat",))  # engine 0 beats as it is read
    stopped = f.now(1)
    stopped.inbox.append(("beat",))
    stopped.arrived_at = 1.0  # its last beat, read 7 s late
    f.d.poll()
    assert stopped.killed and len(f.incarnations[1]) == 2 and f.d.restarts == 1
    assert f.d.engines[1].failures == ["sent no heartbeat for 7 s while serving (stopped or hung; "
                                       "rollout.fleet.hang_timeout_s=5)"]
    assert not f.incarnations[0][0].killed


def test_a_refit_longer_than_the_hang_timeout_is_no_hang_but_a_stuck_one_is_bounded():
    """An engine beats while it refits (test_an_engine_beats_while_it_refits), so a refit of many hang timeouts
    goes on; the refit as a whole is bounded by start_timeout_s (100 s here)."""
    f = Fleet(hang=10.0)
    f.ready(0, 1)
    f.d.refit("w1", 1)
    f.now(0).inbox.append(("refitted", 1))
    for _ in range(9):  # engine 1 refits for 36 s, beating; engine 0 serves
        f.clock.now += 4.0
        for i in (0, 1):
            f.now(i).inbox.append(("beat",))
        f.d.poll()
    assert f.d.engines[1].state == "refitting" and f.d.restarts == 0
    f.now(1).inbox.append(("refitted", 1))
    f.d.poll()
    assert [e.state for e in f.d.engines] == ["serving", "serving"]
    f.d.refit("w2", 2)  # this one never ends, though its heartbeat goes on
    for _ in range(26):
        f.clock.now += 4.0
        for i in (0, 1):
            f.now(i).inbox.append(("beat",))
        f.d.poll()
    assert f.d.restarts == 2 and all(len(f.incarnations[i]) == 2 for i in (0, 1))
    assert f.d.engines[0].failures == ["did not finish its refit in 104 s (stuck or too slow; "
                                       "rollout.fleet.start_timeout_s=100 bounds a refit)"]


def test_restarts_are_bounded_and_the_last_error_names_every_engine():
    f = Fleet(max_restarts=1)
    f.ready(0, 1)
    f.now(0).ended = "pid 10 exited with code 3"
    f.d.poll()
    f.now(0).inbox.append(("error", "RuntimeError: vLLM failed"))
    f.d.poll()
    assert f.d.engines[0].state == "failed" and len(f.incarnations[0]) == 2  # one restart, then given up
    f.d.submit(groups(0, 2))
    f.d.poll()
    assert len(f.now(1).generating()) == 2  # the job goes on with engine 1
    f.now(1).ended = "pid 11 was killed by SIGKILL"
    f.d.poll()  # engine 1's restart
    f.clock.now += 101.0  # ... never comes up: past rollout.fleet.start_timeout_s
    with pytest.raises(FleetError) as err:
        f.d.poll()
    text = str(err.value)
    assert text.startswith("no healthy rollout engine left (engine 0: pid 10 exited with code 3, then RuntimeError: "
                           "vLLM failed; engine 1: pid 11 was killed by SIGKILL, then sent no heartbeat for 101 s "
                           "while starting (stopped or hung; rollout.fleet.start_timeout_s=100))")
    assert "rollout.fleet.max_restarts=1" in text and "\n" not in text
    assert set(err.value.reasons) == {0, 1}


def test_groups_wait_for_an_engine_of_their_weights():
    f = Fleet(engines=1, max_restarts=0)
    f.ready(0)
    f.d.refit("w1", 1)
    f.d.submit(groups(1, 2, version=1))
    f.d.poll()
    assert f.now(0).generating() == []  # still refitting
    f.now(0).inbox.append(("refitted", 1))
    f.d.poll()
    assert f.now(0).generating() == groups_keys(1, 2)
    with pytest.raises(Exception, match="between batches only"):
        f.d.refit("w2", 2)


def test_fleet_config_and_fault_spec_errors():
    assert FleetConfig(engines=2).max_restarts == 3
    with pytest.raises(ConfigError, match=r"rollout\.fleet\.hang_timeout_s"):
        FleetConfig(engines=2, hang_timeout_s=0)
    # under three beats (one every 0.5 s) a healthy engine between two beats would be killed
    assert FleetConfig(engines=2, hang_timeout_s=1.5).hang_timeout_s == 1.5
    with pytest.raises(ConfigError) as err:
        FleetConfig(engines=2, hang_timeout_s=1.4)
    assert str(err.value) == ("rollout.fleet.hang_timeout_s=1.4 is shorter than 3 heartbeats (one every 0.5 s), so a "
                              "healthy engine would be killed as hung; set it to at least 1.5, e.g. "
                              "rollout.fleet.hang_timeout_s=60")
    with pytest.raises(ConfigError, match=r"rollout\.fleet\.max_restarts"):
        FleetConfig(max_restarts=-1)
    assert faults("0:kill@2,1:stop@4") == {0: ("kill", 2), 1: ("stop", 4)}
    with pytest.raises(ValueError, match="<engine>:<kill|stop>@<request>"):
        faults("0:hang@2")


def test_a_batch_becomes_seeded_groups_and_comes_back_in_prompt_order():
    """The supervisor's side (rollout/fleet_server.py): one group per prompt and spec, prompt p seeded seed + p·n as on
    a colocated engine (so a redone group draws the same samples), and the answer in prompt order, spec by spec."""
    from types import SimpleNamespace

    from verl_mega.rollout.fleet_server import SupervisedEngines
    from verl_mega.rollout.server import NONE_OPEN, answer

    specs = [SamplingSpec(n=2, seed=7), SamplingSpec(n=1, seed=None)]
    command = {"id": 5, "prompts": [[1, 2], [3]], "specs": specs}
    made = SupervisedEngines.groups(command, version=3)
    assert [(g.key, g.prompt_ids, g.spec.seed, g.version) for g in made] == [
        ((5, 0, 0), [1, 2], 7, 3), ((5, 0, 1), [3], 9, 3), ((5, 1, 0), [1, 2], None, 3), ((5, 1, 1), [3], None, 3)]
    # samples as engines return them: token ids, log-probs, per-token versions; they arrive in any order
    results = [((5, 1, 1), ([[9]], [[-0.9]], [[3]])), ((5, 0, 1), ([[6], [7]], [[-0.6], [-0.7]], [[3], [3]])),
               ((5, 0, 0), ([[4], [5]], [[-0.4], [-0.5]], [[3], [3]])), ((5, 1, 0), ([[8]], [[-0.8]], [[3]]))]
    arrived: list = []
    engines = SimpleNamespace(dispatcher=SimpleNamespace(poll=lambda: [arrived.pop()] if arrived else [],
                                                         submit=lambda groups: None,
                                                         metrics=lambda: {"engine_restarts": 1.0}),
                              _results={}, _open={}, _files={}, groups=SupervisedEngines.groups)
    SupervisedEngines.submit(engines, command, 3)
    for result in results:
        assert SupervisedEngines.open(engines) == 5  # not all back yet
        arrived.append(result)
        SupervisedEngines.poll(engines)
    assert SupervisedEngines.open(engines) == NONE_OPEN
    reply = answer(5, SupervisedEngines.take(engines, command), engines.dispatcher.metrics())
    assert reply["id"] == 5 and reply["version"] == 3 and reply["fleet"] == {"engine_restarts": 1.0}
    assert [[(s.prompt, s.ids, s.logprobs) for s in part] for part in reply["samples"]] == [
        [(0, [4], [-0.4]), (0, [5], [-0.5]), (1, [6], [-0.6]), (1, [7], [-0.7])], [(0, [8], [-0.8]), (1, [9], [-0.9])]]
    assert not engines._results  # taken


def test_weights_left_by_a_dead_supervisor_are_removed(tmp_path):
    import os

    from verl_mega.rollout.fleet_server import _remove_stale

    dead, alive = tmp_path / "verl-mega-fleet-999999999-a", tmp_path / f"verl-mega-fleet-{os.getpid()}-b"
    for d in (dead, alive):
        d.mkdir()
        (d / "weights-1.pt").write_bytes(b"x")
    _remove_stale(str(tmp_path))
    assert not dead.exists() and (alive / "weights-1.pt").exists()


# ---- the engine process and the supervisor's handle on it (rollout/fleet_engine.py) -------------------------------
def _layout(model):
    return "layout"


def _slow_write(model, is_cpu, tensors):
    import time

    time.sleep(1.3)  # loading weights: more than two heartbeat periods (0.5 s)


def test_an_engine_beats_while_it_refits(monkeypatch, tmp_path):
    """serve() (the engine's loop) with a fake vLLM: while write() loads the weights, beats go on from a thread."""
    import multiprocessing
    import threading
    from types import SimpleNamespace

    import torch

    import verl_mega.rollout.streaming as streaming
    import verl_mega.rollout.vllm_rollout as vllm_rollout
    from verl_mega.rollout.fleet_engine import serve

    monkeypatch.setattr(vllm_rollout, "VLLMRollout", lambda config: SimpleNamespace(
        model=None, is_cpu=True, weight_version=0, shutdown=lambda: None))
    monkeypatch.setattr(streaming, "StreamingEngine", lambda rollout, deltas: SimpleNamespace(
        busy=False, weights_changed=lambda: None))
    torch.save({}, tmp_path / "w.pt")
    ours, theirs = multiprocessing.Pipe(duplex=True)
    engine = threading.Thread(target=serve, args=(theirs, 0), daemon=True)
    engine.start()
    ours.send(("setup", {"hooks": (_layout, _slow_write), "config": None}))
    assert ours.recv() == ("ready", "layout")
    ours.send(("weights", str(tmp_path / "w.pt"), 1))
    during = []
    while ours.poll(10) and (message := ours.recv()) != ("refitted", 1):
        during.append(message)
    beats = [m for m in during if m == ("beat",)]
    assert len(beats) >= 2 and len(beats) == len(during), during
    ours.send(("stop",))
    engine.join(10)
    assert not engine.is_alive()


class _Proc:
    """A process that SIGKILL does not end (stuck in the kernel)."""

    pid = 4242

    def __init__(self) -> None:
        self.killed = 0

    def poll(self):
        return None

    def kill(self) -> None:
        self.killed += 1

    def wait(self, timeout=None):
        import subprocess
        import threading

        threading.Event().wait(5 if timeout is None else timeout)
        raise subprocess.TimeoutExpired("engine", timeout)


def test_a_message_cut_off_midway_does_not_block_the_supervisor_nor_does_a_process_that_will_not_die(
        monkeypatch, caplog):
    import multiprocessing
    import os
    import pickle
    import struct
    import threading
    import time

    import verl_mega.rollout.fleet_engine as fleet_engine
    from verl_mega.rollout.fleet_engine import EngineProcess

    monkeypatch.setattr(fleet_engine, "KILL_WAIT_S", 0.2)
    ours, theirs = multiprocessing.Pipe(duplex=True)
    arrived = threading.Event()
    handle = EngineProcess(0, _Proc(), ours, arrived)
    data = pickle.dumps(("done", (0, 0, 0), "x" * 100_000))
    os.write(theirs.fileno(), struct.pack("!i", len(data)) + data[:1000])  # the engine stops halfway (SIGSTOP)
    got: list = []
    supervisor = threading.Thread(target=lambda: got.append(handle.receive()), daemon=True)
    supervisor.start()
    supervisor.join(2)
    assert got == [[]], "receive() blocked on a message cut off midway"
    assert not arrived.is_set()
    # the rest arrives (SIGCONT): the message is whole, and the supervisor is woken for it
    os.write(theirs.fileno(), data[1000:])
    assert arrived.wait(5) and handle.receive() == [("done", (0, 0, 0), "x" * 100_000)]
    # kill(): SIGKILL, a bounded wait, then a log line; the reader is woken and the connection closed
    began = time.monotonic()
    with caplog.at_level("WARNING"):
        handle.kill()
    assert time.monotonic() - began < 2 and handle.proc.killed == 1 and handle.closed
    assert "rollout engine 0: pid 4242 did not end within 0.2 s of SIGKILL; left behind" in caplog.text
    assert not handle._reader.is_alive() and ours.closed


def test_the_first_batch_waits_for_every_engine_s_first_start_but_not_for_a_restart():
    f = Fleet(engines=3, max_restarts=1)
    f.ready(1)
    assert f.d.layout == "layout1" and f.d.first_starts  # engines 0 and 2 are still on their first start
    f.now(0).ended = "pid 10 exited with code 1"  # engine 0 fails its first start: restarted, not waited for
    f.d.poll()
    assert f.d.engines[0].state == "starting" and len(f.incarnations[0]) == 2 and f.d.first_starts
    f.ready(2)
    assert not f.d.first_starts


def test_sending_to_an_engine_that_stopped_reading_never_blocks_the_supervisor(monkeypatch):
    import multiprocessing
    import threading
    import time

    import verl_mega.rollout.fleet_engine as fleet_engine
    from verl_mega.rollout.fleet_engine import EngineProcess

    monkeypatch.setattr(fleet_engine, "KILL_WAIT_S", 0.2)
    ours, theirs = multiprocessing.Pipe(duplex=True)
    handle = EngineProcess(0, _Proc(), ours, threading.Event())
    prompt = list(range(32_768))  # a long prompt: a few of them fill the socket's buffer of an engine that reads none
    began = time.monotonic()
    for request in range(64):
        handle.send(("generate", (request, 0, 0), prompt, None))
    assert time.monotonic() - began < 2, "send() waited on an engine that reads nothing"
    assert handle._writer.is_alive()  # the writer is the one blocked, on the full buffer
    assert theirs.recv() == ("generate", (0, 0, 0), prompt, None)  # in order, whole
    handle.kill()  # shutting the socket ends the blocked send: no thread left behind
    assert not handle._writer.is_alive() and not handle._reader.is_alive() and handle.closed
