"""The rollout pool's loop when the pool is a fleet of engine processes (``rollout.fleet.engines``).

The pool has one rank, the supervisor. Towards the training pool it is the rollout pool of
:mod:`verl_mega.rollout.disaggregated`: the same commands in the same order (``generate``, ``weights``, ``stop``),
the same answers, the same staleness. Inside, every batch becomes prompt groups that the
:class:`~verl_mega.rollout.fleet.Dispatcher` hands to the engines and redoes, whole, when an engine fails.

- Weights arrive in the background, into the supervisor's memory (``PoolWeightSync`` with the engines' layout),
  while the engines generate. They go in once the batches sent before them are done (as with
  ``rollout.partial_rollouts=false``): the supervisor writes them to one file (in /dev/shm where there is one) and
  every engine reads it. The file of the current weights stays until the next, so that an engine that restarts
  later is refitted from it before it serves.
- A batch's answer goes back once all its groups are back, in the order asked, with the fleet's counters
  (``rollout/healthy_engines``, ``rollout/redispatched_prompts``, ``rollout/engine_restarts``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections import OrderedDict, deque
from dataclasses import replace
from pathlib import Path
from typing import Any

from verl_mega.parallel.pools import HEARTBEAT_S, Bridge
from verl_mega.rollout.base import STOP_REASONS, Sample, prompt_seed
from verl_mega.rollout.disaggregated import _Inbox, _Outbox, record_stop_signals
from verl_mega.rollout.fleet import Dispatcher, Group
from verl_mega.rollout.fleet_engine import FAULT_ENV, EngineProcess, faults

log = logging.getLogger(__name__)

POLL_S = 0.02  # the longest the supervisor sleeps on its engines while it has work
IDLE_S = 0.5  # ... and on the trainer while it has none (engines that fail meanwhile are found after it)


_PREFIX = "verl-mega-fleet-"  # + the supervisor's pid: the weights of a supervisor that was killed are removed later


def _remove_stale(root: str) -> None:
    """Weight files of supervisors that died without cleaning up (SIGKILL, a lost node): in /dev/shm they hold
    memory until removed."""
    for path in Path(root).glob(f"{_PREFIX}*"):
        pid = path.name[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


class FleetServer:
    """The supervisor. ``engine_config``: each engine's vLLM config (gen_tp=1); ``hooks``: (layout of a vLLM model,
    write weights into one), functions the engines import; ``fleet``: the rollout.fleet section."""

    def __init__(self, bridge: Bridge, engine_config: Any, hooks: tuple, fleet: Any) -> None:
        self.bridge, self.trainer = bridge, 0  # the training pool's first rank
        self.weight_sync: Any = None  # set once the engines' layout is known (attach_weights)
        self.rollout = None  # no engine in this process
        self._setup = {"config": engine_config, "hooks": hooks}
        self._faults = faults(os.environ.get(FAULT_ENV))
        self._started: set[int] = set()
        self._arrived = threading.Event()  # set by the engines' reader threads
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        _remove_stale(root)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root))
        self.dispatcher = Dispatcher(fleet.engines, self._start_engine, hang_timeout_s=fleet.hang_timeout_s,
                                     start_timeout_s=fleet.start_timeout_s, max_restarts=fleet.max_restarts)

    def _start_engine(self, index: int) -> EngineProcess:
        first = index not in self._started  # a test's fault hits the first incarnation only
        self._started.add(index)
        fault = self._faults.get(index) if first else None
        engine = EngineProcess.spawn(index, {**self._setup, "fault": fault}, self._arrived)
        log.info("rollout engine %d started (pid %d)", index, engine.pid)
        return engine

    def layout(self) -> Any:
        """The engines' weight layout (the transfer plan needs it), once every engine is up or has failed its first
        start, so that the first batch is shared over all of them."""
        while self.dispatcher.layout is None or self.dispatcher.first_starts:
            self._wait()
            self.dispatcher.poll()
        return self.dispatcher.layout

    def _wait(self) -> None:
        """Until an engine sends something or ends, at most POLL_S. Cleared before the next poll takes the
        messages, so none that comes meanwhile is slept through."""
        self._arrived.wait(POLL_S)
        self._arrived.clear()

    def serve(self) -> None:
        """Run the trainer's commands until ``stop`` (see :class:`~verl_mega.rollout.disaggregated.RolloutServer`
        for signals and the order of commands)."""
        received = record_stop_signals()
        passed_on = 0
        inbox, outbox = _Inbox(self.bridge, self.trainer), _Outbox(self.bridge, self.trainer)
        queue: deque[dict] = deque()
        started: OrderedDict[int, dict] = OrderedDict()  # batches asked for and not answered, in order
        results: dict[tuple, Any] = {}
        staged, version = None, 0
        weights_watch = self.bridge.heartbeats(())
        while True:
            outbox.check()
            if received[0] > passed_on:
                passed_on = received[0]
                outbox.signal(STOP_REASONS[passed_on])
            for key, samples in self.dispatcher.poll():
                results[key] = samples
            while started and self._complete(next(iter(started.values())), results):
                outbox.put(self._answer(started.popitem(last=False)[1], results))
            if staged is not None and not staged.done():
                weights_watch.check("receiving weights from the training pool")
            if staged is not None and staged.done() and not self.dispatcher.busy:
                with self.bridge.answering(self.weight_sync.source, "receiving weights from the training pool"):
                    tensors = staged.take()
                version += 1
                self._refit(tensors, version)
                staged = None
            idle = staged is None and not queue and not started
            queue.extend(inbox.take(wait=True, timeout=IDLE_S) if idle else inbox.take(wait=False))
            if any(command["op"] == "stop" for command in queue):
                while staged is not None and not staged.done():  # the trainer sent every bucket before stop
                    weights_watch.check("receiving weights from the training pool")
                    staged.wait(HEARTBEAT_S)
                outbox.close()
                return
            while queue and staged is None:  # a command waits for the weights sent before it
                command = queue.popleft()
                if command["op"] == "weights":
                    staged = self.weight_sync.receive_in_background()
                    weights_watch = self.bridge.heartbeats((self.weight_sync.source,))
                    continue
                self.dispatcher.submit(self._groups(command, version))
                started[command["id"]] = command
            if started or staged is not None or self.dispatcher.busy:
                self._wait()

    def _refit(self, tensors: dict, version: int) -> None:
        import torch

        path = self._dir / f"weights-{version}.pt"
        torch.save(tensors, path)
        previous = self.dispatcher.weights
        self.dispatcher.refit(str(path), version)
        if previous is not None:  # an engine reading it has it open (its mmap stays valid after the unlink)
            Path(previous).unlink(missing_ok=True)

    @staticmethod
    def _groups(command: dict, version: int) -> list[Group]:
        """One group per prompt and spec; prompt p's seed is ``prompt_seed(spec.seed, p, n)``, as for a colocated
        engine, so a group redone on another engine draws the same samples."""
        groups = []
        for i, spec in enumerate(command["specs"]):
            for p, prompt in enumerate(command["prompts"]):
                seeded = spec if spec.seed is None else replace(spec, seed=prompt_seed(spec.seed, p, spec.n))
                groups.append(Group((command["id"], i, p), list(prompt), seeded, version))
        return groups

    @staticmethod
    def _complete(command: dict, results: dict) -> bool:
        return all((command["id"], i, p) in results
                   for i in range(len(command["specs"])) for p in range(len(command["prompts"])))

    def _answer(self, command: dict, results: dict) -> dict:
        samples = []
        for i in range(len(command["specs"])):
            part = []
            for p in range(len(command["prompts"])):
                token_ids, logprobs, versions = results.pop((command["id"], i, p))
                part += [Sample(p, ids, lps, None, None, v) for ids, lps, v in zip(token_ids, logprobs, versions)]
            samples.append(part)
        version = min((s.versions[0] for part in samples for s in part if s.versions), default=0)
        return {"id": command["id"], "version": version, "samples": samples, "fleet": self.dispatcher.metrics()}

    def shutdown(self) -> None:
        self.dispatcher.close()
        for e in self.dispatcher.engines:  # a stopped engine ends at "stop"; any other is ended here
            try:
                e.handle.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - still running (or stopped): killed
                e.handle.kill()
        if self.weight_sync is not None:
            self.weight_sync.close()
        shutil.rmtree(self._dir, ignore_errors=True)


__all__ = ["FleetServer"]
