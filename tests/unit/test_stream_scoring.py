"""Scoring while vLLM generates (trainer/stream_scoring.py): micro-batches in arrival order, per-row outputs,
stage intervals for the profiler, errors surfacing on the main thread; the config checks of rollout.stream_scoring."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from verl_mega.trainer.batch import Batch
from verl_mega.trainer.profiler import StageProfiler
from verl_mega.trainer.stream_scoring import PendingScores, StreamScorer, gather_rows


def _pack(pairs):
    return Batch({"x": torch.tensor([float(v) for _, v in pairs])}, {"row": [r for r, _ in pairs]})


def test_micro_batches_are_fixed_slices_of_the_arrival_order():
    seen = []

    def double(b):
        seen.append(list(b.meta["row"]))
        return {"double": b["x"] * 2, "plus": b["x"][:, None] + torch.tensor([[0.0, 1.0]])}

    prof = StageProfiler()
    scorer = StreamScorer(stages=[("old_logprob", double)], pack=_pack, chunk_rows=3, profiler=prof)
    scorer.start()
    assert scorer.active
    for pairs in ([(7, 1), (3, 2)], [(0, 3), (5, 4)], [(1, 5)], [(2, 6), (4, 7)]):
        scorer.add(pairs)
    out = scorer.results()
    assert not scorer.active and scorer.chunks == 3
    # 7 samples in chunks of 3: two full micro-batches as they arrived, the last takes the remaining one
    assert seen == [[7, 3, 0], [5, 1, 2], [4]]
    assert {r: float(v) for r, v in out["double"].items()} == {7: 2, 3: 4, 0: 6, 5: 8, 1: 10, 2: 12, 4: 14}
    assert gather_rows(out["plus"], [0, 4]).tolist() == [[3.0, 4.0], [7.0, 8.0]]
    assert len(prof.intervals()["old_logprob"]) == 3


def test_stages_run_during_the_generation_and_are_timed():
    """Intervals are recorded under the stage names while the caller still adds samples, so the profiler's overlap
    with rollout is what really ran beside it."""
    prof = StageProfiler()
    release = threading.Event()

    def slow(b):
        time.sleep(0.05)
        return {"v": b["x"]}

    def reward(b):
        release.set()
        return {"r": b["x"] + 1}

    scorer = StreamScorer(stages=[("values", slow), ("reward", reward)], pack=_pack, chunk_rows=2, profiler=prof)
    with prof.stage("rollout"):
        scorer.start()
        scorer.add([(0, 1), (1, 1)])
        assert release.wait(5), "the first micro-batch was not scored while samples were still arriving"
        scorer.add([(2, 1)])
    out = scorer.results()
    assert sorted(out["r"]) == [0, 1, 2]
    iv = prof.intervals()
    rollout_end = iv["rollout"][0][1]
    assert iv["values"][0][1] <= rollout_end and iv["values"][0][1] - iv["values"][0][0] >= 0.05
    assert iv["values"][1][0] >= iv["values"][0][1]  # the last micro-batch after the first
    assert prof.step_summary()["overlap/efficiency"] > 0


def test_pending_scores_do_not_hold_up_the_next_micro_batch():
    """A stage that hands its micro-batch to a pool (PendingScores) returns at once: every micro-batch is submitted
    before the first is scored, the outputs arrive by row, and each interval ends when its future completed."""
    prof = StageProfiler()
    futures: list[Future] = []
    submitted = threading.Semaphore(0)

    def reward(b):
        future: Future = Future()
        futures.append(future)
        submitted.release()
        return PendingScores(future, lambda b=b, future=future: {"r": b["x"] * future.result()})

    scorer = StreamScorer(stages=[("reward", reward)], pack=_pack, chunk_rows=2, profiler=prof)
    scorer.start()
    scorer.add([(4, 1), (2, 2), (0, 3), (1, 4), (3, 5)])
    scorer.close()
    for _ in range(3):  # two full micro-batches and the last one, none of them scored yet
        assert submitted.acquire(timeout=5), "a pending micro-batch held up the next one"
    assert not any(f.done() for f in futures)
    done_at = []
    for i, future in enumerate(futures):
        done_at.append(prof.now())
        future.set_result(10.0 * (i + 1))
    out = scorer.results()
    assert {r: float(v) for r, v in out["r"].items()} == {4: 10, 2: 20, 0: 60, 1: 80, 3: 150}
    ends = [end for _, end in prof.intervals()["reward"]]
    assert len(ends) == 3 and all(end >= at for end, at in zip(ends, done_at)) and scorer.chunks == 3


def test_errors_reach_the_caller_and_the_next_step_starts_clean():
    def broken(b):
        raise KeyError("no such tensor")

    scorer = StreamScorer(stages=[("old_logprob", broken)], pack=_pack, chunk_rows=1)
    scorer.start()
    scorer.add([(0, 1), (1, 2)])  # the second arrives after the thread failed: it must not block
    with pytest.raises(RuntimeError, match="scoring during generation failed: KeyError"):
        scorer.results()
    scorer.stages = [("old_logprob", lambda b: {"v": b["x"]})]
    scorer.start()
    scorer.add([(5, 3)])
    assert float(scorer.results()["v"][5]) == 3.0
    with pytest.raises(RuntimeError, match="call start"):
        scorer.results()


def test_a_stage_returning_the_wrong_rows_is_an_error():
    scorer = StreamScorer(stages=[("values", lambda b: {"v": b["x"][:1]})], pack=_pack, chunk_rows=2)
    scorer.start()
    scorer.add([(0, 1), (1, 2)])
    with pytest.raises(RuntimeError, match="returned 1 rows of 'v' for a micro-batch of 2"):
        scorer.results()
    with pytest.raises(RuntimeError, match=r"rows \[3\] were never scored"):
        gather_rows({0: torch.zeros(1)}, [0, 3])
    with pytest.raises(ValueError, match="chunk_rows=0"):
        StreamScorer(stages=[], pack=_pack, chunk_rows=0)


def test_consecutive_steps_each_get_their_own_samples():
    """results() after close() (the trainer closes when generation ends, the first scoring stage collects): the
    next step's thread must not see the last step's end marker."""
    scorer = StreamScorer(stages=[("values", lambda b: {"v": b["x"]})], pack=_pack, chunk_rows=4)
    for step in range(3):
        scorer.start()
        scorer.add([(step, step), (10 + step, step)])
        scorer.close()
        out = scorer.results()
        assert sorted(out["v"]) == [step, 10 + step], step


def test_flush_scores_a_partial_micro_batch_and_restores_the_switch_interval():
    """In the tail (fewer samples still generating than a micro-batch) the caller flushes: what has arrived is
    scored at once. While a step is scored the GIL switch interval is short; afterwards it is what it was."""
    import sys

    seen, before = [], sys.getswitchinterval()
    scorer = StreamScorer(stages=[("values", lambda b: seen.append(list(b.meta["row"])) or {"v": b["x"]})],
                          pack=_pack, chunk_rows=4)
    scorer.start()
    assert sys.getswitchinterval() <= 0.0005
    scorer.add([(0, 1), (1, 1), (2, 1)])
    scorer.add([(3, 1), (4, 1)], flush=True)  # a full micro-batch, then the remaining one
    scorer.add([(5, 1)], flush=True)
    scorer.add([], flush=True)  # nothing pending: no empty micro-batch
    assert sorted(scorer.results()["v"]) == [0, 1, 2, 3, 4, 5]
    assert seen == [[0, 1, 2, 3], [4], [5]] and sys.getswitchinterval() == before


def test_micro_batches_released_during_generation_are_counted_from_the_finishing_order():
    """A micro-batch completed by samples that finished while others still generated counts as released during
    generation; the tail flushed at generating=0 and the remainder scored at close() do not. The count follows the
    adds alone, however the scoring thread is scheduled."""
    scorer = StreamScorer(stages=[("values", lambda b: {"v": b["x"]})], pack=_pack, chunk_rows=2)
    scorer.start()
    scorer.add([(0, 1)], generating=5)
    scorer.add([(1, 1), (2, 1)], generating=3)  # completes [0, 1]: during generation
    scorer.add([(3, 1)], flush=True, generating=1)  # completes [2, 3]: during generation
    scorer.add([(4, 1)], flush=True, generating=0)  # the last sample: after generation
    scorer.add([(5, 1)])  # left pending, scored by close()
    assert sorted(scorer.results()["v"]) == [0, 1, 2, 3, 4, 5]
    assert scorer.chunks == 4 and scorer.chunks_during_generation == 2
