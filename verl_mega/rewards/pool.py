"""Run reward functions in worker processes, off the critical path, under a time limit.

``RewardPool.submit(responses, ground_truths, extras) -> Future[RewardBatchResult]`` returns at once; the trainer
collects the future after the device stages it overlaps with.

Every call of the user function runs in one of ``num_workers`` worker processes (``rewards/worker.py``; each loads
the function once, within ``IMPORT_TIMEOUT_S``), because only a process can be stopped whatever the function does. A
function given by spec string is loaded in the workers only, never in this process: its module is user code, and its
import may never return. For each call the pool waits
for the answer, the worker's death or the time limit, whichever comes first:

* an answer: the scores; a call that raises or returns something that is not a finite number is an *error*;
* the worker died (``os._exit``, a segfault, the OOM killer): an *error* saying so, with the exit code; the worker is
  replaced;
* ``timeout_s`` passed: the worker is killed (SIGKILL) and replaced; a *timeout*.

Errors and timeouts score 0.0 and are counted per batch (:class:`RewardBatchResult`) and per pool. Once more than
``max_error_frac`` of a batch's samples failed, its remaining calls are not run (scored 0, counted as errors): a
function that always hangs costs about one time limit per batch, not one per sample, and the trainer then stops
(:class:`RewardFunctionFailed`, raised by the trainer from the step's counts). Nothing leaks: killed workers are
joined, one dispatcher thread serves the pool, and ``close()`` (also run at exit) kills every worker. Workers ignore
SIGINT and SIGTERM, which are the trainer's to handle, and die with the trainer (Linux parent-death signal).

Functions given by spec string (or as a :class:`RewardFunction` loaded from one) are loaded in each worker; other
callables must be picklable.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Mapping, Sequence

from verl_mega.rewards.loader import (IMPORT_TIMEOUT_S, RewardFunction, RewardFunctionError, die_with_parent,
                                      import_too_slow, load_reward_fn)

__all__ = ["RewardPool", "RewardBatchResult", "RewardFunctionFailed", "info_metrics"]

logger = logging.getLogger("verl_mega.rewards")

_STARTUP_TIMEOUT_S = IMPORT_TIMEOUT_S  # a worker's start: the interpreter and the function's import


class RewardFunctionFailed(RuntimeError):
    """A reward function failed on more than reward.max_error_frac of a step's samples."""


@dataclass(frozen=True)
class RewardBatchResult:
    scores: list[float]
    num_timeouts: int
    num_errors: int
    elapsed_s: float
    first_error: str | None = None
    # each sample's other numeric values of a dict return ({} for a float, an error or a timeout)
    infos: list[dict[str, float]] | None = None

    def info_sums(self) -> dict[str, tuple[float, int]]:
        """(sum, count) of each dict-return key over the samples that returned it: their mean is logged as
        ``reward/<key>``."""
        sums: dict[str, tuple[float, int]] = {}
        for info in self.infos or ():
            for key, value in info.items():
                total, count = sums.get(key, (0.0, 0))
                sums[key] = (total + value, count + 1)
        return sums


# metrics the trainer logs itself: a dict value of the reward function under one of these names is logged as
# reward/fn_<name>
_OWN_REWARD_KEYS = ("mean", "max", "min", "errors", "timeouts", "baseline_mean")


def info_metrics(parts: Sequence[Mapping[str, tuple[float, int]]]) -> dict[str, float]:
    """``reward/<key>``: the mean of each value the reward function returned in its dict beside ``score``, over the
    samples that returned it, from the (sum, count) pairs of :meth:`RewardBatchResult.info_sums` of several batches
    or ranks."""
    sums: dict[str, list[float]] = {}
    for part in parts:
        for key, (total, count) in part.items():
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + total, acc[1] + count
    return {f"reward/{'fn_' + k if k in _OWN_REWARD_KEYS else k}": total / count
            for k, (total, count) in sorted(sums.items()) if count}


# ------------------------------------------------------------------------------------------- worker process side
def _call_unit(fn: RewardFunction, responses, ground_truths, extras) -> tuple[str, Any]:
    """Never raises: ("ok", (scores, infos)) or ("error", message)."""
    try:
        return ("ok", fn.score_batch_info(responses, ground_truths, extras))
    except Exception as exc:  # noqa: BLE001 - user code: any failure is counted and scores 0
        return ("error", f"{type(exc).__name__}: {exc}")


def _worker_main(conn, spec: str | None, pickled_fn: bytes | None, batched: bool, reward_kwargs: dict) -> None:
    die_with_parent()  # SIGKILLed when the trainer dies, even by SIGKILL
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer handles Ctrl-C and SIGTERM; it kills us when done
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        fn = load_reward_fn(spec, batched=batched, reward_kwargs=reward_kwargs) if spec is not None \
            else pickle.loads(pickled_fn)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("init_error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", fn.batched))
    while True:
        try:
            unit = conn.recv()
        except (EOFError, OSError):  # the trainer is gone
            return
        if unit is None:
            return
        outcome = _call_unit(fn, *unit)
        try:
            conn.send(outcome)
        except Exception as exc:  # noqa: BLE001 - e.g. a score that cannot be pickled
            conn.send(("error", f"its result could not be sent back ({type(exc).__name__}: {exc})"))


# ------------------------------------------------------------------------------------------------- parent side
class _WorkerProcess:
    """A worker started as ``python -m verl_mega.rewards.worker``, not by multiprocessing's spawn, which would re-run
    this process's main script in it (a user's script without a ``__main__`` guard would start a second job there).
    It offers what the pool uses of multiprocessing.Process: is_alive, kill, join, exitcode and a sentinel that is
    ready once it has exited."""

    def __init__(self, fd: int) -> None:
        self._popen = subprocess.Popen([sys.executable, "-m", "verl_mega.rewards.worker", str(fd)], pass_fds=(fd,),
                                       stdin=subprocess.DEVNULL)
        self.sentinel = os.pidfd_open(self._popen.pid)
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        self.exitcode = self._popen.poll()
        return self.exitcode is None

    def kill(self) -> None:
        self._popen.kill()

    def join(self) -> None:
        self.exitcode = self._popen.wait()
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class _Worker:
    def __init__(self, initargs: tuple) -> None:
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        child = theirs.detach()
        try:
            self.proc = _WorkerProcess(child)
        finally:
            os.close(child)
        self.conn.send((sys.path, initargs))  # the worker imports what this process can import
        self.ready = False
        self.started = time.monotonic()
        self.unit: int | None = None  # the unit it is scoring
        self.deadline = math.inf

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join()
        self.conn.close()

    def death(self) -> str:
        self.proc.join()
        code = self.proc.exitcode
        how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        if not self.ready:
            return f"the worker process died while starting ({how}; its error is printed above)"
        return f"the worker process died ({how}) inside the function (os._exit, a crash or the OOM killer)"


class RewardPool:
    """Score batches of responses asynchronously in worker processes; see the module docstring."""

    def __init__(
        self,
        reward_fn: RewardFunction | str | Callable[..., Any],
        *,
        num_workers: int = 4,
        timeout_s: float = 30.0,
        max_error_frac: float = 1.0,
        chunk_size: int | None = None,
        reward_kwargs: Mapping[str, Any] | None = None,
    ):
        if num_workers < 1:
            raise ValueError(f"reward pool num_workers must be >= 1 (reward functions run in worker processes), "
                             f"got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        if not 0 <= max_error_frac <= 1:
            raise ValueError(f"reward max_error_frac must be in [0, 1], got {max_error_frac}")
        if isinstance(reward_fn, str):  # loaded (user code imported) in the workers only
            spec, self.name, batched, kwargs = reward_fn.strip(), reward_fn.strip(), None, dict(reward_kwargs or {})
            fn = None
        else:
            fn = reward_fn if isinstance(reward_fn, RewardFunction) else \
                load_reward_fn(reward_fn, reward_kwargs=reward_kwargs)
            spec, self.name, batched, kwargs = fn.spec, fn.name, fn.batched, fn.reward_kwargs
        self.batched: bool | None = batched  # for a spec string: as the first worker that loaded it says
        self.num_workers, self.timeout_s, self.chunk_size = num_workers, float(timeout_s), chunk_size
        self.max_error_frac = float(max_error_frac)
        self.total_timeouts = self.total_errors = self.total_scored = 0
        self._closed = False
        pickled = None
        if spec is None:
            if getattr(fn.fn, "__module__", None) == "__main__":
                raise ValueError(f"reward function '{self.name}' is defined in the main script, which worker "
                                 "processes do not run; define it in a module and give it as 'module:function' or "
                                 "'path/to/file.py:function'")
            try:
                pickled = pickle.dumps(fn)
            except Exception as exc:
                raise ValueError(f"reward function '{self.name}' cannot be sent to worker processes ({exc}); "
                                 "give it as 'module:function' or define it at module level") from None
        self._initargs = (spec, pickled, batched, kwargs)
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()  # close() may run while the dispatcher scores
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        try:
            for _ in range(num_workers):
                self._workers.append(_Worker(self._initargs))
            # start-up time is not charged to the first batch's time limit
            self._await_ready(self._workers)
        except BaseException:
            self._kill_all()
            raise
        self._dispatcher = threading.Thread(target=self._serve, name="reward-dispatch", daemon=True)
        self._dispatcher.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # -------------------------------------------------------------------------------------------------- public
    def submit(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extras: Sequence[Mapping[str, Any]] | None = None,
    ) -> Future:
        """Start scoring a batch; returns a Future of :class:`RewardBatchResult` (scores in input order)."""
        if self._closed:
            raise RuntimeError("RewardPool is closed; create a new one")
        responses, ground_truths = list(responses), list(ground_truths)
        extras = [dict(e) for e in extras] if extras is not None else [{} for _ in responses]
        if not len(responses) == len(ground_truths) == len(extras):
            raise ValueError(
                f"reward batch lengths differ: {len(responses)} responses, {len(ground_truths)} ground truths, "
                f"{len(extras)} extras"
            )
        future: Future = Future()
        self._tasks.put((future, responses, ground_truths, extras))
        return future

    def score(self, responses, ground_truths, extras=None) -> RewardBatchResult:
        """Blocking convenience: ``submit(...).result()``."""
        return self.submit(responses, ground_truths, extras).result()

    def close(self) -> None:
        """Stop the dispatcher and kill every worker (a call in progress is abandoned)."""
        if self._closed:
            return
        self._closed = True
        self._tasks.put(None)
        self._kill_all()  # wakes the dispatcher if it waits on a call
        self._dispatcher.join(timeout=10)

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _kill_all(self) -> None:
        with self._lock:
            for worker in self._workers:
                worker.kill()
            self._workers = []

    def _await_ready(self, workers: list[_Worker]) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        for worker in workers:
            if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                if not worker.proc.is_alive():
                    raise RuntimeError(f"reward function '{self.name}': {worker.death()}")
                raise self._start_timeout()
            self._on_ready_message(worker)

    def _on_ready_message(self, worker: _Worker) -> None:
        try:
            kind, detail = worker.conn.recv()
        except (EOFError, OSError):
            kind, detail = "init_error", worker.death()
        if kind != "ready":
            raise RuntimeError(f"reward function '{self.name}' cannot be loaded in a worker process ({detail}); "
                               f"worker processes must be able to import it")
        worker.ready = True
        if self.batched is None:
            self.batched = bool(detail)

    def _start_timeout(self) -> RewardFunctionError:
        return RewardFunctionError(import_too_slow("reward function", self.name, _STARTUP_TIMEOUT_S,
                                                   "a reward worker process"))

    def _serve(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            future, responses, ground_truths, extras = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._score_batch(responses, ground_truths, extras))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiting side
                future.set_exception(exc)

    def _units(self, n: int) -> list[range]:
        if not self.batched:
            return [range(i, i + 1) for i in range(n)]  # one call = one sample, so the time limit is per sample
        size = self.chunk_size or max(1, math.ceil(n / self.num_workers))
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    def _score_batch(self, responses, ground_truths, extras) -> RewardBatchResult:
        start = time.monotonic()
        units = self._units(len(responses))
        args = [([responses[i] for i in u], [ground_truths[i] for i in u], [extras[i] for i in u]) for u in units]
        outcomes = self._run(args, sizes=[len(u) for u in units], n=len(responses))
        scores = [0.0] * len(responses)
        infos: list[dict[str, float]] = [{} for _ in responses]
        timeouts = errors = 0
        first_error = None
        for unit, (status, value) in zip(units, outcomes):
            if status == "ok":
                for i, s, info in zip(unit, *value):
                    scores[i], infos[i] = s, info
            elif status == "timeout":
                timeouts += len(unit)
                first_error = first_error or f"timed out after {self.timeout_s:g}s"
            else:
                errors += len(unit)
                first_error = first_error or value
        self.total_timeouts += timeouts
        self.total_errors += errors
        self.total_scored += len(responses)
        if timeouts or errors:
            logger.warning(
                "reward function '%s': %d timeout(s) and %d error(s) in a batch of %d scored 0 "
                "(run totals: %d timeouts, %d errors); first: %s",
                self.name, timeouts, errors, len(responses), self.total_timeouts, self.total_errors, first_error,
            )
        return RewardBatchResult(scores, timeouts, errors, time.monotonic() - start, first_error, infos)

    def _run(self, args: list[tuple], *, sizes: list[int], n: int) -> list[tuple[str, Any]]:
        """Outcome of every unit: each goes to an idle worker; a worker past its deadline is killed, a dead one
        replaced. Once more than max_error_frac of the batch's samples failed, the units not started are skipped."""
        outcomes: list[tuple[str, Any] | None] = [None] * len(args)
        todo = collections.deque(range(len(args)))
        failed = 0
        while todo or any(w.unit is not None for w in self._workers):
            if self._closed:
                raise RuntimeError("RewardPool was closed while scoring")
            if todo and failed > self.max_error_frac * n:
                while todo:
                    outcomes[todo.popleft()] = ("error", "not run: the batch already failed on more than "
                                                         f"{self.max_error_frac:g} of its samples")
                continue
            now = time.monotonic()
            for worker in self._workers:
                if worker.ready and worker.unit is None and todo:
                    worker.unit = todo.popleft()
                    worker.deadline = now + self.timeout_s
                    try:
                        worker.conn.send(args[worker.unit])
                    except OSError:  # it just died: _check reports that as the unit's outcome
                        worker.deadline = now
            busy = [w for w in self._workers if w.unit is not None or not w.ready]
            deadlines = [w.deadline if w.ready else w.started + _STARTUP_TIMEOUT_S for w in busy]
            wait_any([w.conn for w in busy] + [w.proc.sentinel for w in busy],
                     timeout=max(0.0, min(deadlines, default=now) - time.monotonic()))
            now = time.monotonic()
            for i, worker in enumerate(list(self._workers)):
                outcome = self._check(worker, now)
                if outcome is None:
                    continue
                unit = worker.unit
                if outcome[0] != "ok" and unit is not None:
                    failed += sizes[unit]
                if unit is not None:
                    outcomes[unit] = outcome
                    worker.unit, worker.deadline = None, math.inf
                if not worker.proc.is_alive() or outcome[0] == "timeout":
                    worker.kill()
                    with self._lock:
                        if not self._closed:
                            self._workers[i] = _Worker(self._initargs)
        return outcomes  # type: ignore[return-value]

    def _check(self, worker: _Worker, now: float) -> tuple[str, Any] | None:
        """What happened to `worker` since the last look: None (still busy or idle), or the outcome of its unit."""
        if worker.conn.poll():
            if not worker.ready:
                self._on_ready_message(worker)
                return None
            try:
                return worker.conn.recv()
            except (EOFError, OSError):
                return ("error", worker.death())
        if not worker.proc.is_alive():
            if not worker.ready:
                raise RuntimeError(f"reward function '{self.name}': {worker.death()}")
            return ("error", worker.death()) if worker.unit is not None else ("idle_death", None)
        if worker.ready and worker.unit is not None and now >= worker.deadline:
            return ("timeout", None)
        if not worker.ready and now >= worker.started + _STARTUP_TIMEOUT_S:
            raise self._start_timeout()
        return None


def _close_at_exit(ref: "weakref.ref[RewardPool]") -> None:
    pool = ref()
    if pool is not None:
        pool.close()
