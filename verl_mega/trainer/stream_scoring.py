"""Scoring while the colocated vLLM still generates (rollout.stream_scoring).

A synchronous step scores after its slowest sample: with long-tailed response lengths the roles wait through the
tail, then vLLM waits through scoring. Here the trainer steps vLLM itself and hands every finished prompt's samples
to a :class:`StreamScorer`, whose thread scores them in micro-batches of ``chunk_rows`` samples while the engine
keeps decoding the stragglers: the reward function (``reward``) and, with ``all``, reference log-probs, critic
values, reward model and old log-probs.

- With device stages the thread runs on a CUDA stream of its own, so its kernels run beside vLLM's rather than
  between them; each stage's interval is taken after its stream has finished, and goes to the profiler under the
  stage's own name, so the Overlap Efficiency counts only what really ran during generation.
- A micro-batch is the next ``chunk_rows`` samples in the order they finished, which is the same on every rank of
  an engine (their schedulers step on identical inputs): the ranks of a tensor-parallel group score the same rows
  in the same order, and their collectives match.
- Only the tail is exposed: once fewer samples than a micro-batch are still generating, the caller flushes each
  engine step's finished samples, and what finishes last is scored after generation ends.
- The reward function runs in the reward pool's worker processes: its stage hands each micro-batch to the pool and
  returns at once (:class:`PendingScores`), so the workers always have the next micro-batch queued and never wait
  for this thread to decode it; the thread collects the scores at the end. With ``reward`` alone nothing is packed
  into tensors: the function needs the texts only.
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from verl_mega.parallel.cpu_mode import comm_device
from verl_mega.trainer.batch import Batch, pack_sequences


@dataclass
class PendingScores:
    """A stage's outputs still being computed elsewhere (the reward pool): ``future`` completes when they are ready,
    then ``finish()`` returns them."""

    future: Future
    finish: Callable[[], dict[str, torch.Tensor]]


#: a scoring stage: its profiler name and a function from a micro-batch to per-row tensors (first dim: its rows), or
#: to :class:`PendingScores` of them
ScoreStage = tuple[str, Callable[[Batch], "dict[str, torch.Tensor] | PendingScores"]]
_END = object()
GIL_SWITCH_INTERVAL_S = 0.0005


class StreamScorer:
    """Scores ``(row, sample)`` pairs as they arrive; :meth:`results` waits for the last micro-batch.

    ``pack``: turns a list of ``(row, sample)`` pairs into a :class:`Batch` of those rows, in that order.
    ``stages``: run on every micro-batch in this order. ``device``: the CUDA device of this rank (None on CPU).
    """

    def __init__(self, *, stages: Sequence[ScoreStage], pack: Callable[[list[tuple[int, Any]]], Batch],
                 chunk_rows: int, profiler: Any = None, device: torch.device | None = None) -> None:
        if chunk_rows < 1:
            raise ValueError(f"StreamScorer: chunk_rows={chunk_rows} must be >= 1")
        self.stages, self.pack, self.chunk_rows = list(stages), pack, chunk_rows
        self.profiler, self.device = profiler, device
        self._inbox: queue.Queue = queue.Queue()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._scored: dict[str, dict[int, torch.Tensor]] = {}
        self._chunks = self._live_chunks = 0
        self._waiting: list = []
        self._collect = threading.Lock()
        self._outcome: tuple[bool, Any] | None = None  # what results() gave this step, for outputs()

    @property
    def active(self) -> bool:
        """Whether a step's samples are being scored (between :meth:`start` and :meth:`results`)."""
        return self._thread is not None

    def start(self) -> None:
        """A new step: forget the last one's results and start the scoring thread."""
        if self._thread is not None:
            raise RuntimeError("StreamScorer.start: the previous step's scoring was not collected with results()")
        self._scored, self._error, self._chunks, self._live_chunks, self._outcome = {}, None, 0, 0, None
        self._waiting = []  # (stage, start, {"at": end}, rows, PendingScores) in the order submitted
        # vLLM's loop and this thread share the GIL; a shorter switch interval hands it back to the engine
        # sooner after each of its device waits (the interval is restored in results())
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, GIL_SWITCH_INTERVAL_S))
        self._inbox, self._closed = queue.Queue(), False  # a fresh queue: nothing of the last step is left in it
        self._thread = threading.Thread(target=self._run, name="stream-scoring", daemon=True)
        self._thread.start()

    def add(self, pairs: Sequence[tuple[int, Any]], *, flush: bool = False, generating: int = 0) -> None:
        """Finished samples (their rows and samples); thread-safe, returns at once. ``flush``: score what has
        arrived without waiting for a full micro-batch (the caller decides it from the engine's state, so that every
        rank of an engine cuts its micro-batches alike). ``generating``: the engine's samples still generating when
        these finished; a micro-batch completed by such an add is released during generation."""
        if pairs or flush:
            self._inbox.put((list(pairs), flush, generating))

    def close(self) -> None:
        """No more samples this step: the thread scores what is left as one last micro-batch."""
        if self._thread is not None and not self._closed:
            self._closed = True
            self._inbox.put(_END)

    def results(self) -> dict[str, dict[int, torch.Tensor]]:
        """Wait for the thread (closing the input first if need be); every output, by name then row. Re-raises
        the thread's error."""
        if self._thread is None:
            raise RuntimeError("StreamScorer.results: no step is being scored; call start() first")
        self.close()
        self._thread.join()
        self._thread = None
        sys.setswitchinterval(self._switch_interval)
        if self._error is not None:
            raise RuntimeError(f"scoring during generation failed: {type(self._error).__name__}: "
                               f"{self._error}") from self._error
        return self._scored

    def outputs(self) -> dict[str, dict[int, torch.Tensor]]:
        """:meth:`results`, waited for by whichever thread asks first; the others get the same outputs (or error)."""
        with self._collect:
            if self._outcome is None:
                try:
                    self._outcome = (True, self.results())
                except BaseException as exc:
                    self._outcome = (False, exc)
        ok, value = self._outcome
        if not ok:
            raise value
        return value

    @property
    def chunks(self) -> int:
        """Micro-batches scored in the last step."""
        return self._chunks

    @property
    def chunks_during_generation(self) -> int:
        """Micro-batches of the last step released while the engine still had samples generating: decided by the
        finishing order alone, not by how the scoring thread happened to be scheduled."""
        return self._live_chunks

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        from verl_mega.parallel import cpu_mode

        try:
            with cpu_mode.in_this_thread():
                self._score_until_closed()
        except BaseException as exc:  # surfaces in results(), on the main thread
            self._error = exc
            while self._inbox.get() is not _END:  # let close() / results() through
                pass

    def _score_until_closed(self) -> None:
        stream = None
        if self.device is not None:  # the current device and stream are per thread
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            pending: list[tuple[int, Any]] = []
            while True:
                item = self._inbox.get()
                if item is _END:
                    break
                pairs, flush, generating = item
                pending += pairs
                while len(pending) >= self.chunk_rows or (flush and pending):
                    self._score(pending[:self.chunk_rows], stream, during_generation=generating > 0)
                    pending = pending[self.chunk_rows:]
            if pending:
                self._score(pending, stream, during_generation=False)
            for name, start, done, rows, scores in self._waiting:
                outputs = scores.finish()  # waits for the pool
                self._store(name, start, done.get("at", self._now()), rows, outputs)
            self._waiting = []

    def _score(self, pairs: list[tuple[int, Any]], stream, *, during_generation: bool) -> None:
        batch = self.pack(pairs)
        rows = [row for row, _ in pairs]
        for name, fn in self.stages:
            start = self._now()
            outputs = fn(batch)
            if isinstance(outputs, PendingScores):  # its interval ends when the pool has scored it
                done: dict[str, float] = {}
                outputs.future.add_done_callback(lambda _, done=done: done.setdefault("at", self._now()))
                self._waiting.append((name, start, done, rows, outputs))
                continue
            if stream is not None:
                stream.synchronize()
            self._store(name, start, self._now(), rows, outputs)
        self._chunks += 1
        self._live_chunks += during_generation
        if self.profiler is not None:
            self.profiler.add_counter("stream_chunks", 1.0)
            self.profiler.add_counter("stream_chunks_during_generation", float(during_generation))

    def _store(self, name: str, start: float, end: float, rows: list[int], outputs: dict[str, torch.Tensor]) -> None:
        if self.profiler is not None:
            self.profiler.record(name, start, end)
        for key, value in outputs.items():
            if len(value) != len(rows):
                raise ValueError(f"stream scoring stage {name!r} returned {len(value)} rows of {key!r} for a "
                                 f"micro-batch of {len(rows)}")
            into = self._scored.setdefault(key, {})
            for row, v in zip(rows, value):
                into[row] = v

    def _now(self) -> float:
        return self.profiler.now() if self.profiler is not None else time.perf_counter()


def build_stream_scorer(trainer: Any, items: list, tally: Any, *, roles: bool) -> StreamScorer:
    """The scoring stages of rollout.stream_scoring for one generation of ``items`` (the prompts), over
    micro-batches of finished samples: the same reward function (its errors counted in ``tally``) and, with
    ``roles`` (``all``), the same roles as the synchronous stages, per micro-batch."""
    limit, pad = trainer.cfg.rollout.max_response_length, trainer.tokenizer.pad_token_id or 0

    def pack(pairs) -> Batch:
        samples = [s for _, s in pairs]
        meta = {"row": [row for row, _ in pairs], "group": [s.prompt for s in samples], "ids": [s.ids for s in samples]}
        if not roles:  # the reward function reads texts: nothing to pack into tensors
            return Batch({}, meta)
        packed = pack_sequences([items[s.prompt].prompt_ids for s in samples], [s.ids for s in samples], pad_id=pad,
                                max_response_length=limit, multiple_of=trainer.actor.engine.seq_multiple)
        return Batch(packed, meta)

    def old_logprob(b: Batch):
        out = trainer.actor.compute_logprobs(b, with_entropy=True)
        return {"old_logprobs": out["logprobs"], "entropy": out["entropy"]}

    def reward(b: Batch):  # this rank's share of the micro-batch; its engine's other ranks score the rest
        rows = b.meta["row"]
        share = set(trainer.path.engine_share(rows))
        mine = [i for i, row in enumerate(rows) if row in share]
        if not mine:  # nothing of it is this rank's to score
            return {"reward": torch.zeros(len(rows), dtype=torch.float32)}
        ids = [b.meta["ids"][i] for i in mine]
        pending = trainer._submit_scores([trainer._text(x) for x in ids], [items[b.meta["group"][i]] for i in mine],
                                         [min(len(x), limit) for x in ids], tally)

        def finish() -> dict[str, torch.Tensor]:
            out = torch.zeros(len(rows), dtype=torch.float32)
            out[mine] = pending.finish()
            return {"reward": out}

        return PendingScores(pending.future, finish)

    stages = []
    if roles:  # rollout.stream_scoring=all: the roles' forward passes too
        stages.append(("old_logprob", old_logprob))
        if trainer.ref is not None:
            stages.append(("ref_logprob", lambda b: {"ref_logprobs": trainer.ref.compute_logprobs(b)["logprobs"]}))
        if trainer.critic is not None:
            stages.append(("values", lambda b: {"values": trainer.critic.compute_values(b)}))
        if trainer.reward_model is not None:
            stages.append(("rm_score", lambda b: {"rm_score": trainer.reward_model.score(b)}))
    stages.append(("reward", reward))
    device = comm_device() if roles and torch.cuda.is_available() else None  # the reward function alone: no device
    return StreamScorer(stages=stages, pack=pack, chunk_rows=trainer.cfg.rollout.stream_chunk,
                        profiler=trainer.profiler, device=device)


def gather_rows(scored: dict[int, torch.Tensor], rows: Sequence[int]) -> torch.Tensor:
    """The scored rows ``rows``, stacked in that order (every one of them must have been scored)."""
    missing = [r for r in rows if r not in scored]
    if missing:
        raise RuntimeError(f"rows {missing[:5]} were never scored during generation")
    return torch.stack([scored[r] for r in rows])


__all__ = ["PendingScores", "StreamScorer", "ScoreStage", "build_stream_scorer", "gather_rows"]
