"""vLLM's level-2 sleep frees the weights' memory without keeping them: a generation that follows one with no weight
sync in between (a validation, a further DAPO round, the step after a validation) must first have the weights
written again. Here vLLM is a stand-in with those semantics (the CPU build's sleep is a no-op); the GPU tier runs it
for real (jobs/fp8_sync_job.py: two generations without a sync give the same greedy tokens)."""

from types import SimpleNamespace

import torch

from verl_mega.rollout.base import SamplingSpec
from verl_mega.rollout.colocated import ColocatedRollout
from verl_mega.rollout.vllm_rollout import VLLMRollout


class _Profiler:
    def __init__(self) -> None:
        self.stages: list[str] = []

    def now(self) -> float:
        return 0.0

    def record(self, name, start, end, parent=None) -> None:
        self.stages.append(name)

    def add_counter(self, name, value) -> None:
        pass


def _engine(level: int) -> VLLMRollout:
    """VLLMRollout's own sleep/wake bookkeeping over a GPU vLLM stand-in whose level-2 sleep loses the weights."""
    engine = VLLMRollout.__new__(VLLMRollout)
    engine.config = SimpleNamespace(sleep_level=level, kv_cache_dtype="auto", load_format="auto")
    engine.is_cpu, engine.weight_version, engine._sleeping, engine.weights_discarded = False, 0, set(), False
    engine.engine_index, engine.num_engines, engine.weights = 0, 1, torch.zeros(3)

    def sleep(level):
        if level == 2:
            engine.weights = torch.full((3,), float("nan"))  # re-mapped uninitialised at wake-up

    def generate(prompts, spec):
        ok = bool(torch.isfinite(engine.weights).all())
        return SimpleNamespace(phases=None, routed_experts=None, prompt_index=list(range(len(prompts))),
                               token_ids=[[int(ok)]] * len(prompts), logprobs=[[0.0]] * len(prompts))

    engine.llm = SimpleNamespace(sleep=sleep, wake_up=lambda tags: None, reset_prefix_cache=lambda: None)
    engine.generate = generate
    return engine


class _Sync:
    """The weight sync's contract: ``sync`` writes new weights as a new version, ``restore`` the same ones again."""

    def __init__(self, engine: VLLMRollout) -> None:
        self.engine, self.calls = engine, []

    def _write(self) -> None:
        self.engine.wake_up(["weights"])
        self.engine.weights = torch.ones(3)
        self.engine.weights_discarded = False

    def sync(self):
        self._write()
        self.engine.weights_updated()
        self.calls.append("sync")
        return {}

    def restore(self) -> float:
        self._write()
        self.calls.append("restore")
        return 0.0


def _run(level: int):
    engine = _engine(level)
    sync, profiler = _Sync(engine), _Profiler()
    rollout = ColocatedRollout(engine, weight_sync=sync, free_cache=True, profiler=profiler)
    rollout.update_weights()  # the job starts vLLM from the actor's weights
    seen = []
    for _ in range(3):  # a validation, then the step's rollout, then a further DAPO round: no sync in between
        seen += [s.ids[0] for s in rollout.generate([[5]], [SamplingSpec()])[0].samples]
    rollout.update_weights()  # the step's sync
    seen += [s.ids[0] for s in rollout.generate([[5]], [SamplingSpec()])[0].samples]
    return seen, sync.calls, engine, profiler.stages


def test_a_generation_after_a_level_2_sleep_rewrites_the_weights_as_the_same_version():
    seen, calls, engine, stages = _run(level=2)
    assert seen == [1, 1, 1, 1]  # every generation saw the written weights
    assert calls == ["sync", "restore", "restore", "sync"]  # not after the step's sync: it wrote them already
    assert engine.weight_version == 2 and stages.count("weight_restore") == 2


def test_level_1_keeps_the_weights():
    seen, calls, engine, _ = _run(level=1)
    assert seen == [1, 1, 1, 1] and calls == ["sync", "sync"] and not engine.weights_discarded
