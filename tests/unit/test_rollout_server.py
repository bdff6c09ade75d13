"""The rollout pool's one command loop (verl_mega/rollout/server.py RolloutServer) against scripted engines, in
process: the trainer's side is a queue of commands and a queue of answers, the weights arrive when the test says,
and the engines answer when the test says. Two engine sets: the supervised one (rollout/fleet_server.py, with the
real dispatcher over scripted engine handles) and a stepped one with partial rollouts (the in-world kind's
contract; the real in-world engines run in tests/distributed/test_async.py). What is checked is what the loop
decides: the order of answers, which weights sampled what, what a failed engine's late answer counts, that a stop
signal rides on the next answer, that a stop waits for weights in flight."""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from verl_mega.config.rl import FleetConfig
from verl_mega.parallel.pools import PoolPeerError
from verl_mega.rollout.base import STOP_SIGNALS, Sample, SamplingSpec
from verl_mega.rollout.fleet import FleetError
from verl_mega.rollout.fleet_server import SupervisedEngines
from verl_mega.rollout.server import NONE_OPEN, Lockstep, RolloutServer

WAIT_S = 20.0  # the bound of every wait on the loop (it answers in milliseconds)


def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class Wire:
    """The bridge, as the server's inbox and outbox use it: commands in, answers out."""

    timeout = datetime.timedelta(seconds=WAIT_S)
    heartbeat_timeout_s = 0.0

    def __init__(self) -> None:
        self.commands: queue.Queue = queue.Queue()
        self.answers: queue.Queue = queue.Queue()
        self.taken: list = []  # the answers the script took, in order
        self.next_id = 0

    def recv(self, src, tag, what, watch=()):  # noqa: ARG002
        return self.commands.get(timeout=WAIT_S)

    def send(self, obj, dst, tag, what):  # noqa: ARG002
        self.answers.put(obj)
        return []

    def wait(self, *args, **kwargs):
        pass

    def heartbeats(self, ranks):  # noqa: ARG002
        return SimpleNamespace(check=lambda what: None)

    @contextlib.contextmanager
    def answering(self, peer, what):  # as the bridge: a failed wait on the peer becomes an error naming it
        try:
            yield
        except RuntimeError as exc:
            raise PoolPeerError(f"rank {peer} did not answer while {what} ({exc})") from None

    # the trainer's side
    def generate(self, prompts: int, max_tokens: int = 1) -> int:
        request, self.next_id = self.next_id, self.next_id + 1
        self.commands.put({"op": "generate", "id": request, "prompts": [[7, p] for p in range(prompts)],
                           "specs": [SamplingSpec(n=1, max_tokens=max_tokens, seed=3)]})
        return request

    def post(self, op: str) -> None:
        self.commands.put({"op": op})

    def answer(self) -> dict:
        self.taken.append(self.answers.get(timeout=WAIT_S))
        return self.taken[-1]

    def answers_to(self, requests: int) -> None:
        """Take the next ``requests`` batches' answers (a trainer stops only after the batches it trains)."""
        for _ in range(requests):
            self.answer()


class Staged:
    error = None  # the background receive's failure

    def __init__(self, arrived: threading.Event) -> None:
        self.arrived = arrived

    def done(self) -> bool:
        return self.arrived.is_set()

    def wait(self, timeout_s=None) -> None:
        self.arrived.wait(timeout_s)

    def take(self) -> dict:
        return {"w": torch.zeros(1)}

    def apply(self) -> None:
        pass


class WeightSync:
    """Weights that arrive at once, or when the test sets ``gate``."""

    source = 0

    def __init__(self) -> None:
        self.gate: threading.Event | None = None
        self.staged: list[Staged] = []
        self.in_when_served: list[bool] = []  # whether each had arrived when serve() returned

    def receive_in_background(self) -> Staged:
        arrived = self.gate or threading.Event()
        if self.gate is None:
            arrived.set()
        self.staged.append(Staged(arrived))
        return self.staged[-1]

    def close(self) -> None:
        pass


@contextlib.contextmanager
def own_signals():
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def serve(engines, script, sync: WeightSync | None = None) -> tuple[list, WeightSync]:
    """Serve in this thread (it takes the stop signals) while ``script(wire, sync)`` plays the trainer in another;
    returns everything the server sent, in order. A script that fails still stops the server."""
    wire, sync = Wire(), sync or WeightSync()
    failed: list[BaseException] = []

    def drive() -> None:
        try:
            script(wire, sync)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            failed.append(exc)
        wire.post("stop")

    server = RolloutServer(wire, engines, sync)
    driver = threading.Thread(target=drive, daemon=True)
    try:
        with own_signals():
            driver.start()
            server.serve()
        sync.in_when_served = [staged.done() for staged in sync.staged]
    finally:
        server.shutdown()
    driver.join(WAIT_S)
    if failed:
        raise failed[0]
    sent = wire.taken
    while not wire.answers.empty():
        sent.append(wire.answers.get())
    return sent, sync


# ---- supervised engines: the real dispatcher over scripted engine handles ---------------------------------------
class ScriptedEngine:
    """One incarnation of an engine: ready at once, refits at once; generates what the test finishes."""

    def __init__(self, index: int, incarnation: int) -> None:
        self.index, self.incarnation = index, incarnation
        self.inbox: queue.Queue = queue.Queue()
        self.sent: list[tuple] = []
        self.version = 0
        self.ended: str | None = None
        self.inbox.put(("ready", "layout"))

    hold_refits = False  # the test says when a refit is done (refits_done)

    def send(self, message: tuple) -> None:
        self.sent.append(message)
        if message[0] == "weights" and not self.hold_refits:
            self.version = message[2]
            self.inbox.put(("refitted", message[2]))

    def refits_done(self) -> None:
        for message in self.sent:
            if message[0] == "weights" and message[2] > self.version:
                self.version = message[2]
                self.inbox.put(("refitted", message[2]))

    def receive(self) -> list[tuple]:
        out = []
        while not self.inbox.empty():
            out.append(self.inbox.get())
        return out

    def exit_reason(self) -> str | None:
        return self.ended

    def last_heard(self) -> float | None:  # messages count as heard when the dispatcher reads them
        return None

    def kill(self) -> None:
        self.ended = self.ended or "killed"

    def given(self) -> list:
        return [m[1] for m in self.sent if m[0] == "generate"]

    def finish(self, key: tuple) -> None:
        """The group's one sample: its prompt's token, then who made it (engine, incarnation), this engine's
        weights on each token."""
        self.inbox.put(("done", key, ([[10 * key[0] + key[2], 100 * self.index + self.incarnation]], [[-0.5, -0.5]],
                                      [[self.version] * 2])))


class Fleet:
    def __init__(self, engines: int = 2, max_restarts: int = 1) -> None:
        self.incarnations: dict[int, list[ScriptedEngine]] = {}
        self.set = SupervisedEngines(None, (), FleetConfig(engines=engines, max_restarts=max_restarts),
                                     start=self.start)

    def start(self, index: int) -> ScriptedEngine:
        engine = ScriptedEngine(index, len(self.incarnations.get(index, [])))
        self.incarnations.setdefault(index, []).append(engine)
        return engine

    def engine(self, index: int) -> ScriptedEngine:
        return self.incarnations[index][-1]

    def holder(self, key: tuple) -> ScriptedEngine:
        """The live engine that was last given ``key``."""
        until(lambda: any(key in e.given() and not e.ended for e in self.live()), f"group {key} handed out")
        return next(e for e in self.live() if key in e.given() and not e.ended)

    def live(self) -> list[ScriptedEngine]:
        return [self.engine(i) for i in self.incarnations]


def _made(answer: dict) -> list[tuple[int, list[int], list[int]]]:
    return [(s.prompt, s.ids, s.versions) for s in answer["samples"][0]]


def test_answers_go_back_in_the_order_asked_and_a_failed_engines_late_answer_counts_once():
    fleet = Fleet()

    def script(wire: Wire, sync: WeightSync) -> None:
        first, second = wire.generate(2), wire.generate(2)
        for p in range(2):  # the second batch finishes first: it still goes back second
            fleet.holder((second, 0, p)).finish((second, 0, p))
        fleet.holder((first, 0, 1)).finish((first, 0, 1))
        failing = fleet.holder((first, 0, 0))
        # the engine reports an error, and its answer for the group comes after it: that answer is the failed
        # incarnation's, and the group is redone whole (on the other engine, or on this one restarted)
        failing.inbox.put(("error", "RuntimeError: scripted"))
        failing.finish((first, 0, 0))
        until(lambda: any((first, 0, 0) in e.given() and e is not failing for e in fleet.live()), "the redone group")
        fleet.holder((first, 0, 0)).finish((first, 0, 0))
        wire.answers_to(2)

    sent, _ = serve(fleet.set, script)
    assert [a["id"] for a in sent[:2]] == [0, 1] and sent[2] == {"op": "stopped"}
    made = _made(sent[0])
    assert [(p, ids[0]) for p, ids, _ in made] == [(0, 0), (1, 1)]  # one sample per prompt: none twice
    failed = next(e for e in fleet.incarnations[0] + fleet.incarnations[1] if e.ended == "killed")
    assert made[0][1][1] != 100 * failed.index + failed.incarnation  # the failed incarnation's answer is not it
    assert [(p, ids[0]) for p, ids, _ in _made(sent[1])] == [(0, 10), (1, 11)]
    assert sent[0]["fleet"]["redispatched_prompts"] == 1.0 and sent[0]["fleet"]["engine_restarts"] == 1.0


def test_weights_wait_for_the_batches_sent_before_them_and_reach_every_batch_sent_after():
    """Staleness from order, with engines that swap between batches only: batch 0 is sampled by the weights it was
    sent after (version 0) even though new weights arrived while it generated; batch 1, sent after them, by
    version 1, on every engine."""
    fleet = Fleet()

    def script(wire: Wire, sync: WeightSync) -> None:
        first = wire.generate(2)
        wire.post("weights")
        second = wire.generate(2)
        until(lambda: sync.staged and sync.staged[0].done(), "the weights")
        for p in range(2):
            fleet.holder((first, 0, p)).finish((first, 0, p))
        for p in range(2):
            fleet.holder((second, 0, p)).finish((second, 0, p))
        wire.answers_to(2)

    sent, _ = serve(fleet.set, script)
    assert [a["id"] for a in sent[:2]] == [0, 1]
    assert [a["version"] for a in sent[:2]] == [0, 1]
    assert [v for _, _, v in _made(sent[0])] == [[0, 0]] * 2 and [v for _, _, v in _made(sent[1])] == [[1, 1]] * 2
    for engine in fleet.live():  # on each engine: batch 0's groups, then the weights, then batch 1's
        ops = [(m[0], m[1][0] if m[0] == "generate" else None) for m in engine.sent if m[0] != "stop"]
        assert ops.index(("weights", None)) > max((i for i, op in enumerate(ops) if op == ("generate", 0)), default=-1)
        assert ops.index(("weights", None)) < min(i for i, op in enumerate(ops) if op == ("generate", 1))


def test_a_stop_signal_rides_on_the_next_answer_and_a_stop_waits_for_weights_in_flight():
    fleet = Fleet()
    sync = WeightSync()

    def script(wire: Wire, sync: WeightSync) -> None:
        first = wire.generate(1)
        holder = fleet.holder((first, 0, 0))
        os.kill(os.getpid(), signal.SIGTERM)  # a preempted rollout node: the trainer decides when the job stops
        assert wire.answer() == {"op": "signal", "name": "SIGTERM"}
        holder.finish((first, 0, 0))
        got = wire.answer()
        assert got["id"] == first and got["signal"] == "SIGTERM"
        wire.taken.clear()
        sync.gate = threading.Event()  # the next weights arrive only when this script says
        wire.post("weights")
        until(lambda: len(sync.staged) == 1, "the weights to start arriving")
        wire.post("stop")
        time.sleep(0.2)  # a server that did not wait would have returned by now
        sync.gate.set()

    sent, sync = serve(fleet.set, script, sync)
    assert sync.in_when_served == [True]  # the server returned after the weights sent before stop were in
    assert sent == [{"op": "stopped"}]


def test_a_weights_file_stays_while_an_engine_refitting_may_still_open_it():
    """An engine still refitting to version 1 when version 2 arrives may yet open version 1's file (it reads its
    messages in order): the file goes only once no engine refitting may open it."""
    fleet = Fleet()
    files = fleet.set._dir

    def script(wire: Wire, sync: WeightSync) -> None:
        until(lambda: len(fleet.incarnations) == 2, "the engines")
        slow = fleet.engine(1)
        slow.hold_refits = True
        wire.post("weights")
        until(lambda: ("weights", str(files / "weights-1.pt"), 1) in slow.sent, "version 1 sent")
        wire.post("weights")
        until(lambda: ("weights", str(files / "weights-2.pt"), 2) in slow.sent, "version 2 sent")
        assert (files / "weights-1.pt").exists()  # the slow engine has not opened it yet
        slow.refits_done()
        until(lambda: not (files / "weights-1.pt").exists(), "version 1's file removed")
        assert (files / "weights-2.pt").exists()  # the current weights stay, for an engine that restarts

    serve(fleet.set, script)


def test_no_engine_left_ends_the_loop_with_the_error_naming_every_engine():
    fleet = Fleet(engines=2, max_restarts=0)

    def script(wire: Wire, sync: WeightSync) -> None:
        wire.generate(2)
        until(lambda: len(fleet.incarnations) == 2, "the engines")
        for index in range(2):
            fleet.engine(index).ended = f"pid {index} was killed by SIGKILL"

    with pytest.raises(FleetError, match="engine 0: pid 0 was killed by SIGKILL; engine 1: pid 1 was killed"):
        serve(fleet.set, script)


# ---- a stepped engine set with partial rollouts (the in-world kind's contract) ---------------------------------
class SteppedEngines:
    """One engine, stepped by the loop: every step that the test allows adds a token to every running sample, with
    the weights held then; weights go in while samples run when ``partial``."""

    rollout = None

    def __init__(self, partial: bool) -> None:
        self.lockstep, self.partial = Lockstep(), partial
        self.version = 0
        self.steps = threading.Semaphore(0)
        self.running: dict[tuple, list] = {}  # (batch, prompt) → [max tokens, token ids, versions]
        self.done: dict[tuple, list] = {}
        self.tokens = 0  # generated so far, over every sample
        self.refits: list[int] = []  # the tokens generated at each refit

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def poll(self) -> None:
        pass

    def open(self) -> int:
        return min((key[0] for key in self.running), default=NONE_OPEN)

    def submit(self, command: dict, version: int) -> None:
        assert version == self.version
        for p in range(len(command["prompts"])):
            self.running[(command["id"], p)] = [command["specs"][0].max_tokens, [], []]

    def take(self, command: dict) -> list[list[Sample]]:
        return [[Sample(p, ids, [0.0] * len(ids), None, None, versions) for (b, p), (_, ids, versions)
                 in sorted(self.done.items()) if b == command["id"]]]

    def refit(self, staged, version: int) -> None:
        staged.apply()
        self.version = version
        self.refits.append(self.tokens)

    def advance(self) -> None:
        if not self.running or not self.steps.acquire(timeout=0.01):
            return
        for key, (left, ids, versions) in list(self.running.items()):
            ids.append(len(ids))
            versions.append(self.version)
            self.tokens += 1
            if len(ids) == left:
                self.done[key] = self.running.pop(key)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("partial", [True, False])
def test_partial_rollouts_swap_weights_between_two_steps_else_after_the_batch(partial):
    engines = SteppedEngines(partial)

    def script(wire: Wire, sync: WeightSync) -> None:
        wire.generate(1, max_tokens=4)
        engines.steps.release(2)
        until(lambda: engines.tokens == 2, "two tokens")
        wire.post("weights")
        wire.generate(1, max_tokens=2)
        if partial:
            until(lambda: engines.refits, "the swap")
        engines.steps.release(4)
        wire.answers_to(2)

    sent, _ = serve(engines, script)
    first, second = sent[0], sent[1]
    if partial:  # the running sample goes on under the new weights; each token records its own
        assert engines.refits == [2] and _made(first) == [(0, [0, 1, 2, 3], [0, 0, 1, 1])]
    else:  # the swap waits for the batch sent before the weights
        assert engines.refits == [4] and _made(first) == [(0, [0, 1, 2, 3], [0, 0, 0, 0])]
    assert first["version"] == 0  # the oldest weights any of its tokens came from
    assert second["version"] == 1 and _made(second) == [(0, [0, 1], [1, 1])]


class FailingRefit(SteppedEngines):
    def refit(self, staged, version: int) -> None:
        raise RuntimeError("the engine could not write its weights")


@pytest.mark.parametrize("who", ["sender", "engines"])
def test_weights_that_fail_name_the_sender_only_when_the_transfer_failed(who):
    sync = WeightSync()

    def failing() -> Staged:
        staged = WeightSync.receive_in_background(sync)
        staged.error = RuntimeError("Connection closed by peer")
        return staged

    def weights(wire: Wire, sync: WeightSync) -> None:
        wire.post("weights")
        until(lambda: sync.staged, "the weights")  # a stop after this comes after the swap

    if who == "sender":
        sync.receive_in_background = failing
    with pytest.raises(RuntimeError) as err:
        serve(SteppedEngines(False) if who == "sender" else FailingRefit(False), weights, sync)
    if who == "sender":
        assert isinstance(err.value, PoolPeerError), err.value
        assert "rank 0 did not answer while receiving weights" in str(err.value)
    else:
        assert not isinstance(err.value, PoolPeerError) and str(err.value) == "the engine could not write its weights"


# ---- what each engine kind runs, decided at the config --------------------------------------------------------
POOLS = ["placement.pools={train: {size: 1}, gen: {size: 1}}", "placement.roles={actor: train, rollout: gen}"]
KINDS = {"in-world": POOLS, "supervised": POOLS + ["rollout.fleet.engines=2"]}
#: a feature's keys, and the key the refusal names first on each kind (None: it runs there)
FEATURES = {
    "partial rollouts": (["rollout.max_staleness=1", "rollout.partial_rollouts=true"],
                         {"in-world": None, "supervised": "rollout.fleet.engines"}),
    "streaming to the trainer": (["rollout.stream_scoring=reward"], "rollout.stream_scoring=reward"),
    "multi-turn": (["rollout.multi_turn.enable=true"], "rollout.multi_turn.enable=true"),
    "LoRA adapter sync": (["model.lora.rank=8", "model.lora.rollout_sync=adapter"], "model.lora.rollout_sync=adapter"),
    "FP8": (["rollout.quantization=fp8"], "rollout.quantization=fp8"),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("feature", FEATURES)
def test_every_feature_runs_on_an_engine_kind_or_is_refused_at_the_config(kind, feature):
    """A rollout pool's features, on each engine kind: accepted, or refused before anything is built with one line
    that names the key and the fix (``set ...``)."""
    from verl_mega.config.loader import load_config
    from verl_mega.parallel.placement import Placement

    extra, refused = FEATURES[feature]
    refused = refused[kind] if isinstance(refused, dict) else refused
    try:
        cfg = load_config("configs/quickstart_cpu.yaml", KINDS[kind] + extra)
        cfg.validate_runtime(Placement.from_config(cfg, 2), cuda_available=False)
        message = None
    except ValueError as exc:
        message = str(exc)
    if refused is None:
        assert message is None, message
    else:
        assert message is not None and message.startswith(refused) and "\n" not in message, message
        assert any(fix in message for fix in ("; set ", ", set ", " or set ")), message
