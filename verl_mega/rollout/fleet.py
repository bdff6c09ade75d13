"""Engines as failure domains: the dispatcher of a rollout fleet (``rollout.fleet.engines``).

The rollout pool's one rank supervises N vLLM engines, each a process of its own
(:mod:`verl_mega.rollout.fleet_engine`). No launcher knows these processes, so an engine's death never ends the
job's worker group, under torchrun, mpirun, Ray or Slurm alike. :class:`Dispatcher` is the supervisor's logic, free
of processes and clocks of its own (tested in-process with fake engines):

- it owns every **prompt group** (one prompt under one sampling spec: its n samples) from submission until its
  samples are back. A group runs on one engine at a time; samples count only from the engine that holds it, so a
  group is never returned twice;
- an engine that exits, or that sends no heartbeat for ``hang_timeout_s`` (``start_timeout_s`` while it starts), is
  failed: a hung one is SIGKILLed first, and every group it held goes back to the front of the queue, **whole**,
  for the healthy engines (``rollout/redispatched_prompts``). A refit beats from a thread (loading a model is no
  hang) and is bounded as a whole by ``start_timeout_s``;
- a failed engine is restarted, at most ``max_restarts`` times. It serves again only once it holds the current
  weights: a restarted engine is refitted first (``weights`` → ``refitted``). A group goes only to an engine
  whose weights are the group's version, so no sample mixes policies;
- groups are shared out the least loaded engine first, counting engines that are still refitting to the groups'
  weights: their share is held for them and sent when they report ``refitted``. Were only serving engines counted,
  the first engine to finish a refit would take the whole batch. A serving engine left idle takes half of what a
  refitting engine holds unsent (it runs nowhere yet, so moving it costs nothing): a slow refit delays no batch;
- the first batch waits for every engine's first start (each bounded by ``start_timeout_s``); an engine that
  fails it is restarted as usual and the job starts with the others;
- with no engine left that is healthy or starting, :class:`FleetError` names every engine and why it failed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

from verl_mega.rollout.base import RolloutError, SamplingSpec

log = logging.getLogger(__name__)

STARTING, REFITTING, SERVING, FAILED = "starting", "refitting", "serving", "failed"


class FleetError(RolloutError):
    """No rollout engine is left: each failed more often than rollout.fleet.max_restarts allows. ``reasons``: every
    engine's failures, in order."""

    def __init__(self, reasons: dict[int, list[str]], max_restarts: int) -> None:
        self.reasons = reasons
        said = "; ".join(f"engine {i}: " + ", then ".join(r) for i, r in sorted(reasons.items()))
        super().__init__(f"no healthy rollout engine left ({said}); each was restarted rollout.fleet.max_restarts="
                         f"{max_restarts} times. Fix the cause above, or raise rollout.fleet.max_restarts")


class EngineHandle(Protocol):
    """One incarnation of an engine, as the dispatcher sees it. Messages from the engine:
    ``("ready", layout)``, ``("beat",)``, ``("refitted", version)``, ``("done", key, samples)``, ``("error", text)``;
    to it: ``("generate", key, prompt_ids, spec)``, ``("weights", source, version)``, ``("stop",)``."""

    def send(self, message: tuple) -> None: ...
    def receive(self) -> list[tuple]: ...  # what has arrived, without waiting
    def exit_reason(self) -> str | None: ...  # why it ended, None while it runs
    def last_heard(self) -> float | None: ...  # when its newest message arrived (the dispatcher's clock), or None
    def kill(self) -> None: ...  # SIGKILL (a stopped or hung process too)


@dataclass
class Group:
    """One prompt under one spec: its n samples are generated, lost and redone together."""

    key: Hashable
    prompt_ids: list[int]
    spec: SamplingSpec
    version: int  # the weights it must be sampled with


@dataclass
class _Engine:
    index: int
    handle: Any
    state: str = STARTING
    version: int = 0
    since: float = 0.0  # last heartbeat (or start)
    refit_since: float = 0.0  # when it was last sent weights
    restarts: int = 0
    held: dict = field(default_factory=dict)  # key → Group, in the order given; sent once it serves
    failures: list[str] = field(default_factory=list)


class Dispatcher:
    """Prompt groups over N engines. ``start(i)``: a new incarnation of engine i (an :class:`EngineHandle`)."""

    def __init__(self, engines: int, start: Callable[[int], EngineHandle], *, hang_timeout_s: float,
                 start_timeout_s: float, max_restarts: int, clock: Callable[[], float] = time.monotonic) -> None:
        if engines < 1:
            raise ValueError(f"a fleet needs at least one engine, got {engines}")
        self._start, self.clock = start, clock
        self.hang_timeout_s, self.start_timeout_s, self.max_restarts = hang_timeout_s, start_timeout_s, max_restarts
        self.version, self.weights = 0, None  # the current weights and where an engine reads them
        self.layout = None  # the first engine's layout (announced when it is ready)
        self.pending: deque[Group] = deque()
        self.redispatched = self.restarts = 0
        now = clock()
        self.engines = [_Engine(i, start(i), since=now) for i in range(engines)]

    # ---- what the supervisor asks -------------------------------------------------------------------------
    def submit(self, groups: Sequence[Group]) -> None:
        self.pending.extend(groups)

    @property
    def first_starts(self) -> bool:
        """Whether an engine is still on its first start (not yet up, not yet failed). The supervisor waits for these
        before it takes the first batch: groups already sent stay where they are, so an engine up a few seconds
        before the others would otherwise generate the whole first batch alone."""
        return any(e.state == STARTING and e.restarts == 0 for e in self.engines)

    @property
    def busy(self) -> bool:
        """Whether any group is waiting or generating."""
        return bool(self.pending) or any(e.held for e in self.engines)

    def refit(self, weights: Any, version: int) -> None:
        """New weights for every engine, between batches (nothing may be generating): engines serve again once they
        hold them; one that starts meanwhile receives them when it is ready."""
        if self.busy:
            raise RolloutError("new weights while prompt groups are generating; the fleet swaps between batches only")
        self.weights, self.version = weights, version
        for e in self.engines:
            if e.state in (SERVING, REFITTING):
                self._send_weights(e)

    def metrics(self) -> dict[str, float]:
        # up and serving, or loading the current weights: a snapshot taken between batches finds engines refitting
        return {"healthy_engines": float(sum(e.state in (SERVING, REFITTING) for e in self.engines)),
                "redispatched_prompts": float(self.redispatched), "engine_restarts": float(self.restarts)}

    def poll(self) -> list[tuple[Hashable, Any]]:
        """Take what the engines sent, fail the dead and the hung, hand out waiting groups; returns the groups
        whose samples came back, as ``(key, samples)``."""
        done = []
        for e in self.engines:
            if e.state == FAILED:
                continue
            handle = e.handle
            for message in handle.receive():
                done += self._take(e, message)
                if e.handle is not handle:  # it reported an error: the rest is the old incarnation's
                    break
            if e.handle is not handle or e.state == FAILED:
                continue
            # silence counts from when its last message arrived, not from when this loop read it: a supervisor held
            # up for a while (a weight file written, a slow host) must not take a stale beat for a fresh one
            heard = handle.last_heard()
            if heard is not None:
                e.since = max(e.since, heard)
            reason = e.handle.exit_reason()
            bound = self.start_timeout_s if e.state == STARTING else self.hang_timeout_s
            now = self.clock()
            if reason is None and now - e.since > bound:
                e.handle.kill()
                key = "start_timeout_s" if e.state == STARTING else "hang_timeout_s"
                reason = (f"sent no heartbeat for {now - e.since:.0f} s while {e.state} (stopped or hung; "
                          f"rollout.fleet.{key}={bound:g})")
            elif reason is None and e.state == REFITTING and now - e.refit_since > self.start_timeout_s:
                e.handle.kill()  # it beats while it refits (from a thread), so only the refit's length tells
                reason = (f"did not finish its refit in {now - e.refit_since:.0f} s (stuck or too slow; "
                          f"rollout.fleet.start_timeout_s={self.start_timeout_s:g} bounds a refit)")
            if reason is not None:
                self._fail(e, reason)
        if all(e.state == FAILED for e in self.engines):
            raise FleetError({e.index: e.failures for e in self.engines}, self.max_restarts)
        self._dispatch()
        return done

    def close(self) -> None:
        for e in self.engines:
            if e.state != FAILED:
                try:
                    e.handle.send(("stop",))
                except (OSError, EOFError):
                    pass

    # ---- inside ---------------------------------------------------------------------------------------------
    def _take(self, e: _Engine, message: tuple) -> list[tuple[Hashable, Any]]:
        kind = message[0]
        if kind == "ready":
            if self.layout is None:
                self.layout = message[1]
            if self.weights is not None and e.version != self.version:
                self._send_weights(e)  # serves only after this refit
            else:
                e.state = SERVING
        elif kind == "refitted":
            e.version = message[1]
            if e.version == self.version and e.state == REFITTING:  # what it holds waited for this refit
                e.state = SERVING
                for group in e.held.values():
                    self._send(e, group)
        elif kind == "done":
            group = e.held.pop(message[1], None)
            if group is not None:  # else an answer the engine no longer owes: never counted twice
                return [(group.key, message[2])]
        elif kind == "error":
            self._fail(e, message[1])
        return []

    def _fail(self, e: _Engine, reason: str) -> None:
        e.handle.kill()  # an engine that reported an error or stopped beating may still be running
        e.failures.append(reason)
        lost = list(e.held.values())
        e.held.clear()
        self.pending.extendleft(reversed(lost))  # first in line, in their order
        self.redispatched += len(lost)
        log.warning("rollout engine %d failed: %s; %d prompt groups go to the other engines", e.index, reason,
                    len(lost))
        if e.restarts >= self.max_restarts:
            e.state = FAILED
            log.warning("rollout engine %d is given up (rollout.fleet.max_restarts=%d)", e.index, self.max_restarts)
            return
        e.restarts += 1
        self.restarts += 1
        e.handle, e.state, e.version, e.since = self._start(e.index), STARTING, 0, self.clock()
        log.warning("rollout engine %d restarting (%d of rollout.fleet.max_restarts=%d)", e.index, e.restarts,
                    self.max_restarts)

    def _dispatch(self) -> None:
        """Waiting groups to engines of their version, the least loaded first (a serving one on a tie); an engine
        refitting to that version counts, and its share waits for its ``refitted``."""
        kept: deque[Group] = deque()
        while self.pending:
            group = self.pending.popleft()
            candidates = [e for e in self.engines if (e.state == SERVING and e.version == group.version)
                          or (e.state == REFITTING and self.version == group.version)]
            if not candidates:
                kept.append(group)
                continue
            e = min(candidates, key=lambda x: (len(x.held), x.state != SERVING))
            e.held[group.key] = group
            if e.state == SERVING:
                self._send(e, group)
        self.pending = kept
        self._rebalance()

    def _rebalance(self) -> None:
        """An idle serving engine takes the later half of the share held for the refitting engine that holds the
        most groups of its weights. (A refitting engine has been sent none of what it holds: a refit starts only with
        nothing held, and a restarted engine's groups went back to the queue.)"""
        for e in self.engines:
            if e.state != SERVING or e.held:
                continue
            donors = [d for d in self.engines if d.state == REFITTING and d.held
                      and next(iter(d.held.values())).version == e.version]
            if not donors:
                continue
            donor = max(donors, key=lambda d: len(d.held))
            for key in list(donor.held)[len(donor.held) // 2:]:
                e.held[key] = group = donor.held.pop(key)
                self._send(e, group)

    def _send_weights(self, e: _Engine) -> None:
        e.handle.send(("weights", self.weights, self.version))
        e.state, e.refit_since = REFITTING, self.clock()

    @staticmethod
    def _send(e: _Engine, group: Group) -> None:
        e.handle.send(("generate", group.key, group.prompt_ids, group.spec))


__all__ = ["Dispatcher", "EngineHandle", "FleetError", "Group"]
