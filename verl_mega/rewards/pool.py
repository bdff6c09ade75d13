"""Run reward functions off the critical path, with a per-call time limit, in threads or worker processes.

``RewardPool.submit(responses, ground_truths, extras) -> Future[RewardBatchResult]`` returns at once; the trainer
collects the future after the GPU scoring stages it overlaps with. A call that raises, returns something that is not a
finite number, or runs past ``timeout_s`` scores 0.0; failures are counted (``total_timeouts`` / ``total_errors``)
and logged once per batch — they never stop the job.

Modes:

* ``thread`` (default): cheap, shares memory; right for fast or I/O-bound functions. A Python thread cannot be
  stopped, so a timed-out call is abandoned (scored 0) and its thread replaced; the stuck thread is a daemon and does
  not block exit.
* ``num_workers=0``: inline — scored in the calling thread when submitted (the Future is already done); for cheap
  functions. Errors still score 0, but the time limit cannot be enforced.
* ``process``: worker processes (``spawn``); right for CPU-heavy or untrusted code. The time limit interrupts the
  call inside the worker (SIGALRM); a worker stuck in native code (past every call's limit plus ``stuck_grace_s``)
  is killed and the pool restarted after the batch.
  Functions given by spec string are re-loaded in each worker; other callables must be picklable.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import pickle
import queue
import signal
import threading
import time
from concurrent.futures import ALL_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from verl_mega.rewards.loader import RewardFunction, load_reward_fn

__all__ = ["RewardPool", "RewardBatchResult"]

logger = logging.getLogger("verl_mega.rewards")

_STARTUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RewardBatchResult:
    scores: list[float]
    num_timeouts: int
    num_errors: int
    elapsed_s: float
    first_error: str | None = None


class _DaemonThreadPool:
    """Minimal pool of daemon threads (``ThreadPoolExecutor`` joins its threads at exit, so one hung user call
    would hang interpreter shutdown)."""

    def __init__(self, num_workers: int, name: str):
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._count = 0
        for _ in range(num_workers):
            self.add_worker()

    def add_worker(self) -> None:
        self._count += 1
        threading.Thread(target=self._loop, name=f"{self._name}-{self._count}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            item = self._tasks.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiting side
                future.set_exception(exc)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        for _ in range(self._count):
            self._tasks.put(None)


# ------------------------------------------------------------------------------------------- process-worker side
_WORKER_FN: RewardFunction | None = None


class _CallTimeout(Exception):
    pass


def _on_alarm(signum, frame):  # noqa: ARG001
    raise _CallTimeout()


def _init_worker(spec: str | None, pickled_fn: bytes | None, batched: bool, reward_kwargs: dict) -> None:
    global _WORKER_FN
    if spec is not None:
        _WORKER_FN = load_reward_fn(spec, batched=batched, reward_kwargs=reward_kwargs)
    else:
        _WORKER_FN = pickle.loads(pickled_fn)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the parent


def _process_unit(responses, ground_truths, extras, timeout_s):
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        outcome = _call_unit(_WORKER_FN, responses, ground_truths, extras)
    except _CallTimeout:
        return ("timeout", None)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    # A call that blocked the alarm (native code) but finished late is still over its limit.
    return ("timeout", None) if time.monotonic() - start > timeout_s else outcome


def _ping(x: int) -> int:
    return x


def _call_unit(fn: RewardFunction, responses, ground_truths, extras) -> tuple[str, Any]:
    """Never raises (except a timeout): ("ok", scores) or ("error", message)."""
    try:
        return ("ok", fn.score_batch(responses, ground_truths, extras))
    except _CallTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: any failure scores 0
        return ("error", f"{type(exc).__name__}: {exc}")


def _timed_thread_unit(fn: RewardFunction, started: dict, key: int, responses, ground_truths, extras):
    started[key] = time.monotonic()
    return _call_unit(fn, responses, ground_truths, extras)


# ------------------------------------------------------------------------------------------------------ the pool
class RewardPool:
    """Score batches of responses asynchronously; see the module docstring."""

    def __init__(
        self,
        reward_fn: RewardFunction | str | Callable[..., Any],
        *,
        mode: str = "thread",
        num_workers: int = 4,
        timeout_s: float = 30.0,
        chunk_size: int | None = None,
        stuck_grace_s: float = 5.0,
    ):
        if mode not in ("thread", "process"):
            raise ValueError(f"reward pool mode must be 'thread' or 'process', got '{mode}'")
        if num_workers < 0:
            raise ValueError(f"reward pool num_workers must be >= 0 (0 scores inline), got {num_workers}")
        if num_workers == 0:
            mode = "inline"
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
        self.fn = reward_fn if isinstance(reward_fn, RewardFunction) else load_reward_fn(reward_fn)
        self.mode, self.num_workers, self.timeout_s, self.chunk_size = mode, num_workers, float(timeout_s), chunk_size
        self.stuck_grace_s = float(stuck_grace_s)
        self.total_timeouts = 0
        self.total_errors = 0
        self.total_scored = 0
        self._closed = False
        self._dispatcher = _DaemonThreadPool(1, "reward-dispatch")  # batches run one after another, in order
        self._threads: _DaemonThreadPool | None = None
        self._procs = None
        self._pickled_fn: bytes | None = None
        if mode == "thread":
            self._threads = _DaemonThreadPool(num_workers, "reward-worker")
        elif mode == "process":
            if self.fn.spec is None:
                try:
                    self._pickled_fn = pickle.dumps(self.fn)
                except Exception as exc:
                    raise ValueError(
                        f"reward function '{self.fn.name}' cannot be sent to worker processes ({exc}); give it as "
                        "'module:function' or use mode='thread'"
                    ) from exc
            self._procs = self._start_processes()

    def _start_processes(self):
        ctx = mp.get_context("spawn")
        procs = ctx.Pool(
            self.num_workers,
            initializer=_init_worker,
            initargs=(self.fn.spec, self._pickled_fn, self.fn.batched, self.fn.reward_kwargs),
        )
        # Wait for the workers to boot so start-up time is not charged to the first batch's time limit. Bounded:
        # a worker that dies while starting is re-spawned by the pool forever, which would otherwise hang here.
        try:
            procs.map_async(_ping, range(self.num_workers), chunksize=1).get(timeout=_STARTUP_TIMEOUT_S)
        except mp.TimeoutError:
            procs.terminate()
            raise RuntimeError(
                f"reward worker processes did not start within {_STARTUP_TIMEOUT_S:g}s (see their errors above; "
                "spawned workers must be able to import the main module and the reward function); use mode='thread'"
            ) from None
        return procs

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
        if self.mode == "inline":
            done: Future = Future()
            done.set_result(self._score_batch(responses, ground_truths, extras))
            return done
        return self._dispatcher.submit(self._score_batch, responses, ground_truths, extras)

    def score(self, responses, ground_truths, extras=None) -> RewardBatchResult:
        """Blocking convenience: ``submit(...).result()``."""
        return self.submit(responses, ground_truths, extras).result()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._dispatcher.shutdown()
        if self._threads is not None:
            self._threads.shutdown()
        if self._procs is not None:
            self._procs.terminate()
            self._procs.join()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------ internals
    def _units(self, n: int) -> list[range]:
        if not self.fn.batched:
            return [range(i, i + 1) for i in range(n)]  # one call = one sample, so the time limit is per sample
        size = self.chunk_size or max(1, math.ceil(n / max(1, self.num_workers)))
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    def _score_batch(self, responses, ground_truths, extras) -> RewardBatchResult:
        start = time.monotonic()
        units = self._units(len(responses))
        args = [([responses[i] for i in u], [ground_truths[i] for i in u], [extras[i] for i in u]) for u in units]
        if self.mode == "thread":
            outcomes = self._run_threads(args)
        elif self.mode == "process":
            outcomes = self._run_processes(args)
        else:
            outcomes = [_call_unit(self.fn, *a) for a in args]
        scores = [0.0] * len(responses)
        timeouts = errors = 0
        first_error = None
        for unit, (status, value) in zip(units, outcomes):
            if status == "ok":
                for i, s in zip(unit, value):
                    scores[i] = s
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
                self.fn.name, timeouts, errors, len(responses), self.total_timeouts, self.total_errors, first_error,
            )
        return RewardBatchResult(scores, timeouts, errors, time.monotonic() - start, first_error)

    def _run_threads(self, args) -> list[tuple[str, Any]]:
        started: dict[int, float] = {}
        futures = [self._threads.submit(_timed_thread_unit, self.fn, started, k, *a) for k, a in enumerate(args)]
        outcomes: list[tuple[str, Any] | None] = [None] * len(futures)
        pending = set(range(len(futures)))
        poll = min(0.05, self.timeout_s / 4)
        while pending:
            now = time.monotonic()
            for k in list(pending):
                if futures[k].done():
                    exc = futures[k].exception()
                    outcomes[k] = ("error", f"{type(exc).__name__}: {exc}") if exc else futures[k].result()
                    pending.discard(k)
                elif k in started and now - started[k] > self.timeout_s:
                    outcomes[k] = ("timeout", None)
                    pending.discard(k)
                    self._threads.add_worker()  # the stuck thread keeps running; keep the pool at full strength
            if pending:  # wake as soon as everything is done, or at the next poll to check time limits
                wait([futures[k] for k in pending], timeout=poll, return_when=ALL_COMPLETED)
        return outcomes

    def _run_processes(self, args) -> list[tuple[str, Any]]:
        handles = [self._procs.apply_async(_process_unit, (*a, self.timeout_s)) for a in args]
        # Each call is interrupted in its worker after timeout_s, so the batch cannot legitimately take longer than
        # this; past it a worker is stuck in native code and the pool is restarted.
        waves = math.ceil(len(args) / self.num_workers)
        deadline = time.monotonic() + waves * self.timeout_s + max(self.stuck_grace_s, self.timeout_s)
        outcomes: list[tuple[str, Any]] = []
        stuck = False
        for handle in handles:
            handle.wait(max(0.0, deadline - time.monotonic()))
            if not handle.ready():
                outcomes.append(("timeout", None))
                stuck = True
                continue
            try:
                outcomes.append(handle.get())
            except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
                outcomes.append(("error", f"{type(exc).__name__}: {exc}"))
        if stuck:
            logger.warning("reward worker process stuck past its time limit; restarting the reward process pool")
            self._procs.terminate()
            self._procs.join()
            self._procs = self._start_processes()
        return outcomes
