"""The RL step and its DataflowBuilder façade: step() runs the stages in order and merges their metrics;
RLTrainer.dataflow() declares the same stages, each depending on the stages whose results it reads, and running
the graph calls them with those results."""

from __future__ import annotations

import threading

import pytest

from verl_mega.trainer.dataflow import DataflowBuilder
from verl_mega.trainer.profiler import StageProfiler
from verl_mega.trainer.rl_trainer import RLTrainer, StepData


class Recorded(RLTrainer):
    """The step's stages, recording what each was given (no model runs)."""

    def __init__(self, *, ref: bool, critic: bool, reward_model: bool) -> None:  # no engines: not the parent's
        self.actor, self.profiler = object(), StageProfiler()
        self.ref, self.critic, self.reward_model = (object() if on else None for on in (ref, critic, reward_model))
        self.calls: list[tuple] = []
        self.threads: dict[str, str] = {}

    def _record(self, name: str, *args):
        self.calls.append((name, *args))
        self.threads[name] = threading.current_thread().name
        return f"{name} result"

    def _rollout(self, prompts):
        self.calls.append(("rollout", prompts))
        return StepData(prompts)

    def _reward(self, data):
        return self._record("reward", data)

    def _old_logprob(self, data):
        return self._record("old_logprob", data)

    def _ref_logprob(self, data):
        return self._record("ref_logprob", data)

    def _values(self, data):
        return self._record("values", data)

    def _rm_score(self, data):
        return self._record("rm_score", data)

    def _advantage(self, data, rewards, rm_scores):
        return self._record("advantage", data, rewards, rm_scores)

    def _critic_update(self, data):
        return self._record("critic_update", data)

    def _actor_update(self, data):
        return self._record("actor_update", data)

    def _weight_sync(self):
        return self._record("weight_sync")


def _deps(builder: DataflowBuilder) -> dict[str, tuple[str, ...]]:
    return {stage.name: stage.deps for stage in builder.build().stages}


def test_the_graph_declares_what_each_stage_reads():
    full = Recorded(ref=True, critic=True, reward_model=True)
    assert _deps(full.dataflow()) == {
        "rollout": (), "reward": ("rollout",), "old_logprob": ("rollout",), "ref_logprob": ("rollout",),
        "values": ("rollout",), "rm_score": ("rollout",),
        "advantage": ("rollout", "reward", "old_logprob", "ref_logprob", "values", "rm_score"),
        "critic_update": ("rollout", "values", "advantage"),
        "actor_update": ("rollout", "old_logprob", "ref_logprob", "advantage"), "weight_sync": ("actor_update",)}
    grpo = Recorded(ref=False, critic=False, reward_model=False)
    assert _deps(grpo.dataflow()) == {
        "rollout": (), "reward": ("rollout",), "old_logprob": ("rollout",), "advantage": ("rollout", "reward",
                                                                                          "old_logprob"),
        "actor_update": ("rollout", "old_logprob", "advantage"), "weight_sync": ("actor_update",)}


def test_running_the_graph_runs_the_steps_stages_on_the_step_record():
    trainer = Recorded(ref=True, critic=True, reward_model=True)
    out = trainer.dataflow().build().run({"prompts": "batch"})
    data = out["rollout"]
    assert isinstance(data, StepData) and data.prompts == "batch"
    names = [call[0] for call in trainer.calls]
    device = [n for n in names if n != "reward"]  # the reward runs in a thread beside them
    assert device == ["rollout", "old_logprob", "ref_logprob", "values", "rm_score", "advantage", "critic_update",
                      "actor_update", "weight_sync"]
    assert trainer.threads["reward"].startswith("host-stage") and trainer.threads["values"] == "MainThread"
    assert ("advantage", data, "reward result", "rm_score result") in trainer.calls
    assert out["weight_sync"] == "weight_sync result"
    assert set(trainer.profiler.intervals()) >= {"rollout", "reward", "advantage", "weight_sync"}


def test_a_failing_stage_names_itself():
    trainer = Recorded(ref=False, critic=False, reward_model=False)

    def failing(data, rewards, rm_scores):
        raise RuntimeError("no advantage")

    trainer._advantage = failing
    with pytest.raises(RuntimeError, match="no advantage") as info:
        trainer.dataflow().build().run({"prompts": "batch"})
    assert info.value.__notes__ == ["(in RL stage 'advantage')"]


class Stepped(Recorded):
    """Stages that return what RLTrainer.step merges: metric dicts (non-float values are left out)."""

    overlap_host_stages = True

    def __init__(self, **roles) -> None:
        super().__init__(**roles)
        self.print_each_step, self._host_pool = False, None

    def _rollout(self, prompts):
        data = super()._rollout(prompts)
        data.metrics = {"rollout/response_length": 3.0, "rollout/note": "text"}
        return data

    def _old_logprob(self, data):
        self._record("old_logprob", data)
        return {"rollout/logprob_diff_max": 0.5}

    def _advantage(self, data, rewards, rm_scores):
        self._record("advantage", data, rewards, rm_scores)
        return {"reward/mean": 0.25, "advantage/count": 4}

    def _critic_update(self, data):
        self._record("critic_update", data)
        return {"critic/vf_loss": 1.5}

    def _actor_update(self, data):
        self._record("actor_update", data)
        return {"actor/pg_loss": -0.5}

    def _weight_sync(self):
        self._record("weight_sync")
        return {"actor/version": 2.0}

    def _reward_health(self, tally):
        return {"reward/errors": float(tally.errors)}


def test_the_step_runs_the_stages_in_order_and_merges_their_metrics():
    from types import SimpleNamespace

    trainer = Stepped(ref=True, critic=True, reward_model=False)
    metrics = trainer.step(SimpleNamespace(epoch=1, batch_index=7))
    names = [call[0] for call in trainer.calls]
    assert [n for n in names if n != "reward"] == ["rollout", "old_logprob", "ref_logprob", "values", "advantage",
                                                   "critic_update", "actor_update", "weight_sync"]
    assert trainer.threads["reward"].startswith("host-stage")
    advantage = next(call for call in trainer.calls if call[0] == "advantage")
    assert advantage[2:] == ("reward result", None)  # the reward future's result; no reward model
    assert {k: v for k, v in metrics.items() if not k.startswith(("timing/", "overlap/", "perf/"))} == {
        "rollout/response_length": 3.0, "rollout/logprob_diff_max": 0.5, "reward/mean": 0.25, "critic/vf_loss": 1.5,
        "actor/pg_loss": -0.5, "actor/version": 2.0, "data/epoch": 1.0, "data/batch_index": 7.0,
        "reward/errors": 0.0}
    assert metrics["timing/advantage_s"] >= 0 and "timing/reward_s" in metrics
