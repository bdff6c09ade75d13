"""Supervised engines (``rollout.fleet.engines``): the engine set of a rollout pool whose one rank supervises engine
processes, each a world of its own, under :class:`~verl_mega.rollout.server.RolloutServer`.

Towards the training pool it is any rollout pool: the same commands in the same order (``generate``, ``weights``,
``stop``), the same answers, the same staleness (the server's). Inside, every batch becomes prompt groups that the
:class:`~verl_mega.rollout.fleet.Dispatcher` hands to the engines and redoes, whole, when an engine fails.

- Weights arrive in the background, into the supervisor's memory (``PoolWeightSync`` with the engines' layout),
  while the engines generate. They go in once the batches sent before them are done (as with
  ``rollout.partial_rollouts=false``): the supervisor writes them to one file (in /dev/shm where there is one) and
  every engine reads it. The file of the current weights stays, so that an engine that restarts later is refitted
  from it before it serves; an older one stays while an engine still refitting may open it.
- A batch's answer goes back once all its groups are back, in the order asked, with the fleet's counters
  (``rollout/healthy_engines``, ``rollout/redispatched_prompts``, ``rollout/engine_restarts``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from verl_mega.rollout.base import Sample, prompt_seed
from verl_mega.rollout.fleet import REFITTING, Dispatcher, EngineHandle, Group
from verl_mega.rollout.fleet_engine import FAULT_ENV, EngineProcess, faults
from verl_mega.rollout.server import NONE_OPEN, Lockstep

log = logging.getLogger(__name__)

POLL_S = 0.02  # the longest the supervisor sleeps on its engines while it has work


_PREFIX = "verl-mega-fleet-"  # + the supervisor's pid: the weights of a supervisor that was killed are removed later


def _remove_stale(root: str) -> None:
    """Weight files of supervisors that died without cleaning up (SIGKILL, a lost node): in /dev/shm they hold
    memory until removed."""
    for path in Path(root).glob(f"{_PREFIX}*"):
        pid = path.name[len(_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


class SupervisedEngines:
    """The supervisor's engine set (an :class:`~verl_mega.rollout.server.EngineSet` of one process).
    ``engine_config``: each engine's vLLM config (gen_tp=1); ``hooks``: (layout of a vLLM model, write weights into
    one), functions the engines import; ``fleet``: the rollout.fleet section. ``start(i)``: a new incarnation of
    engine i (default: a process of its own, :class:`~verl_mega.rollout.fleet_engine.EngineProcess`)."""

    partial = False  # weights go in between batches: a group is sampled by one version, wherever it is redone
    rollout = None  # no engine in this process

    def __init__(self, engine_config: Any, hooks: tuple, fleet: Any, *,
                 start: Callable[[int], EngineHandle] | None = None) -> None:
        self.lockstep = Lockstep()
        self._setup = {"config": engine_config, "hooks": hooks}
        self._faults = faults(os.environ.get(FAULT_ENV))
        self._started: set[int] = set()
        self._arrived = threading.Event()  # set by the engines' reader threads
        self._results: dict[tuple, Any] = {}  # a group's samples, until its batch is taken
        self._open: dict[int, int] = {}  # batch id → its groups not back yet
        self._files: dict[int, Path] = {}  # weight version → its file, while an engine may still open it
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        _remove_stale(root)
        self._dir = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root))
        self.dispatcher = Dispatcher(fleet.engines, start or self._start_engine, hang_timeout_s=fleet.hang_timeout_s,
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
            self.poll()
        return self.dispatcher.layout

    def _wait(self) -> None:
        """Until an engine sends something or ends, at most POLL_S. Cleared before the next poll takes the
        messages, so none that comes meanwhile is slept through."""
        self._arrived.wait(POLL_S)
        self._arrived.clear()

    # ---- the engine set ---------------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.dispatcher.busy

    def poll(self) -> None:
        for key, samples in self.dispatcher.poll():
            self._results[key] = samples
            self._open[key[0]] -= 1
            if not self._open[key[0]]:
                del self._open[key[0]]
        if len(self._files) > 1:
            self._remove_read()

    def open(self) -> int:
        return min(self._open, default=NONE_OPEN)

    def submit(self, command: dict, version: int) -> None:
        made = self.groups(command, version)
        if made:
            self._open[command["id"]] = len(made)
        self.dispatcher.submit(made)

    def take(self, command: dict) -> list[list[Sample]]:
        """The batch's samples per spec, in prompt order."""
        samples = []
        for i in range(len(command["specs"])):
            part = []
            for p in range(len(command["prompts"])):
                token_ids, logprobs, versions = self._results.pop((command["id"], i, p))
                part += [Sample(p, ids, lps, None, None, v) for ids, lps, v in zip(token_ids, logprobs, versions)]
            samples.append(part)
        return samples

    def refit(self, staged: Any, version: int) -> None:
        import torch

        tensors = staged.take()
        path = self._dir / f"weights-{version}.pt"
        torch.save(tensors, path)
        self._files[version] = path
        self.dispatcher.refit(str(path), version)
        self._remove_read()

    def _remove_read(self) -> None:
        """Remove the weight files no engine will open any more. An engine still refitting may yet open any file it
        was sent after the weights it last reported (a restarted engine is sent the current file when it is up,
        and the next update may come before it opens that one); an engine reading a file has it open, and its mmap
        stays valid after the unlink."""
        current = self.dispatcher.version
        refitting = [e.version for e in self.dispatcher.engines if e.state == REFITTING]
        oldest = min(refitting, default=current)  # files after this version may still be opened
        for version in [v for v in self._files if v < current and v <= oldest]:
            self._files.pop(version).unlink(missing_ok=True)

    def advance(self) -> None:
        if self.dispatcher.busy:
            self._wait()

    def metrics(self) -> dict[str, float]:
        return self.dispatcher.metrics()

    def close(self) -> None:
        self.dispatcher.close()
        for e in self.dispatcher.engines:  # a stopped engine ends at "stop"; any other is ended here
            try:
                e.handle.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - still running (or stopped), or no process of its own: killed
                e.handle.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    @staticmethod
    def groups(command: dict, version: int) -> list[Group]:
        """One group per prompt and spec; prompt p's seed is ``prompt_seed(spec.seed, p, n)``, as for a colocated
        engine, so a group redone on another engine draws the same samples."""
        groups = []
        for i, spec in enumerate(command["specs"]):
            for p, prompt in enumerate(command["prompts"]):
                seeded = spec if spec.seed is None else replace(spec, seed=prompt_seed(spec.seed, p, spec.n))
                groups.append(Group((command["id"], i, p), list(prompt), seeded, version))
        return groups


__all__ = ["SupervisedEngines"]
