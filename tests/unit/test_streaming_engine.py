"""StreamingEngine's bookkeeping against a scripted engine: a prompt's n samples are n requests (n = 1, seeds
seed + i·n + j, vLLM's own fan-out of an n > 1 request), each handed over at the step it finishes, and a batch comes
back prompt-major in sample order."""

from __future__ import annotations

from types import SimpleNamespace

from verl_mega.rollout.base import SamplingSpec
from verl_mega.rollout.streaming import StreamingEngine


class _ScriptedEngine:
    """vLLM's engine as StreamingEngine sees it: request ``r`` finishes after ``lengths[r]`` steps, one token a step."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths, self.added, self.steps = lengths, {}, 0

    def add_request(self, request_id, prompt, params, **_):
        self.added[request_id] = params

    def step(self):
        self.steps += 1
        outs = []
        for rid in list(self.added):
            if self.lengths[rid] == self.steps:
                completion = SimpleNamespace(index=0, token_ids=[7] * self.steps, logprobs=None, finish_reason="length")
                outs.append(SimpleNamespace(request_id=rid, outputs=[completion], finished=True))
        return outs


def _engine(lengths: dict[str, int]) -> tuple[StreamingEngine, _ScriptedEngine]:
    scripted = _ScriptedEngine(lengths)
    rollout = SimpleNamespace(llm=SimpleNamespace(llm_engine=scripted), asleep=False, weight_version=0,
                              _lora=lambda: {})
    return StreamingEngine(rollout, deltas=False), scripted


def test_each_sample_is_a_request_handed_over_when_it_finishes():
    # prompt 0's second sample is long, its first short; prompt 1's samples are in between
    stream, scripted = _engine({"b:0:0": 1, "b:0:1": 4, "b:1:0": 2, "b:1:1": 3})
    stream.add("b", [[1, 2], [3]], SamplingSpec(n=2, max_tokens=8, seed=100, logprobs=False))
    assert sorted(scripted.added) == ["b:0:0", "b:0:1", "b:1:0", "b:1:1"]
    assert all(p.n == 1 for p in scripted.added.values())
    assert {r: p.seed for r, p in scripted.added.items()} == {"b:0:0": 100, "b:0:1": 101, "b:1:0": 102,
                                                               "b:1:1": 103}  # no two samples share a stream
    handed = []
    while stream.busy:
        done = stream.step()
        handed.append(list(stream.finished))
        if stream.finished:
            key, prompt, sample = stream.finished[0]
            assert stream.completion(key, prompt, sample)[0] == [7] * scripted.steps
        assert done == (["b"] if not stream.busy else [])
    # prompt 0's first sample is handed over at step 1, three steps before its sibling
    assert handed == [[("b", 0, 0)], [("b", 1, 0)], [("b", 1, 1)], [("b", 0, 1)]]
    got = stream.take("b")
    assert got.prompt_index == [0, 0, 1, 1] and [len(ids) for ids in got.token_ids] == [1, 4, 2, 3]


def test_unseeded_samples_stay_unseeded():
    stream, scripted = _engine({"u:0:0": 1, "u:0:1": 1, "u:0:2": 1})
    stream.add("u", [[5]], SamplingSpec(n=3, max_tokens=4, seed=None, logprobs=False))
    assert [p.seed for p in scripted.added.values()] == [None] * 3
    stream.step()
    assert sorted(stream.finished) == [("u", 0, 0), ("u", 0, 1), ("u", 0, 2)] and not stream.busy
