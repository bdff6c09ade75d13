"""With one PPO epoch over one mini-batch of the whole batch, the old log-probs are the log-probs of the update's own
first forward pass (the same weights): the step takes them from there and runs no forward pass of its own for them.
Checked against the step with that pass, on two actors built alike from one tiny model (fp32, CPU)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from verl_mega import algos
from verl_mega.config import load_config
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.trainer.batch import Batch, pack_sequences
from verl_mega.trainer.rl_trainer import RLTrainer, StepData
from verl_mega.trainer.roles import old_logprobs_from_update

ROWS, WIDTH = 8, 6
ONE_MINI_BATCH = ["actor.lr=1e-2", "actor.lr_warmup_steps=0", "model.dtype=float32", "data.train_batch_size=2",
                  "actor.ppo_mini_batch_size=2", "rollout.n=4", "actor.micro_batch_size_per_gpu=3",
                  "actor.log_prob_micro_batch_size_per_gpu=5", "actor.shuffle=true", "data.max_prompt_length=16",
                  f"rollout.max_response_length={WIDTH}"]


@pytest.fixture(scope="module")
def actors(tmp_path_factory):
    from verl_mega.parallel.state import init_distributed
    from verl_mega.trainer import setup as trainer_setup
    from verl_mega.trainer.roles import Actor

    groups = init_distributed(tp=1, pp=1)
    path = make_tiny_hf_model(tmp_path_factory.mktemp("actor") / "m", model_type="qwen2")
    cfg = load_config("configs/quickstart_cpu.yaml", [f"model.path={path}", *ONE_MINI_BATCH])
    built = []
    for _ in range(2):  # the same checkpoint twice: the same weights and optimizer
        m = trainer_setup.build_role_engine(cfg, groups, path, role_cfg=cfg.actor, total_steps=4)
        built.append(Actor(m.engine, cfg.actor, vocab_size=m.arch.vocab_size, temperature=1.0))
    return cfg, built


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (ROWS,), generator=g)]
    responses = [torch.randint(5, 40, (int(n),), generator=g).tolist()
                 for n in torch.randint(1, WIDTH + 1, (ROWS,), generator=g)]
    batch = Batch(dict(pack_sequences(prompts, responses, pad_id=0, max_response_length=WIDTH)), {})
    mask = batch["response_mask"]
    batch["rollout_logprobs"] = -torch.rand(ROWS, WIDTH, generator=g) * mask
    batch["ref_logprobs"] = -torch.rand(ROWS, WIDTH, generator=g) * mask
    batch["advantages"] = torch.randn(ROWS, WIDTH, generator=g) * mask
    return batch


def _step(cfg, actor, *, in_update: bool) -> tuple[dict[str, float], Batch, int]:
    """The old-log-prob stage and the actor's update of RLTrainer's step; returns their metrics, the batch and how
    many forward-only passes the actor's engine ran."""
    trainer = RLTrainer(cfg, actor=actor, ref=SimpleNamespace(), critic=None, reward_model=None, rollout=None,
                        reward_pool=None, tokenizer=None, profiler=None, kl_ctrl=None, sample_path=None)
    assert trainer.old_logprobs_in_update  # this config's decision
    trainer.old_logprobs_in_update = in_update
    forwards = []
    plain = actor.engine.forward
    actor.engine.forward = lambda *a, **k: forwards.append(1) or plain(*a, **k)
    try:
        data = StepData(prompts=None, batch=_batch())
        torch.manual_seed(7)  # actor.shuffle: the same row order in both steps
        metrics = trainer._old_logprob(data)
        metrics |= trainer._actor_update(data)
    finally:
        actor.engine.forward = plain
    return metrics, data.batch, len(forwards)


def test_the_update_supplies_the_old_logprobs_and_the_step_is_the_same(actors):
    cfg, (separate, own) = actors
    for _ in range(2):  # two steps: the second from the weights the first one's updates left
        expected, before, passes = _step(cfg, separate, in_update=False)
        got, after, own_passes = _step(cfg, own, in_update=True)
        assert (passes, own_passes) == (1, 0)  # the old log-probs' own forward pass is skipped
        assert torch.equal(after["old_logprobs"], before["old_logprobs"])
        assert torch.equal(after["entropy"], before["entropy"])
        assert got["actor/ppo_kl"] == 0.0 and got["actor/clipfrac"] == 0.0  # the ratio is exactly 1
        # after the update, what the step computes before it otherwise (the advantage stage: the KL to the reference)
        kl = algos.masked_mean(algos.kl_penalty(before["old_logprobs"], before["ref_logprobs"], "kl"),
                               before["response_mask"])
        assert got.pop("kl/actor_ref") == float(kl)
        assert got == expected  # every other metric, rollout/* included
        for a, b in zip(separate.engine.chunks[0].parameters(), own.engine.chunks[0].parameters()):
            assert torch.equal(a, b)  # the same optimizer step


def _decision(**changes) -> bool:
    parts = {"actor": dict(ppo_epochs=1, ppo_mini_batch_size=16, rollout_is=None, policy_loss="vanilla",
                           routing_replay="none"), "data": dict(train_batch_size=16), "parallel": dict(pp=1),
             "algorithm": dict(use_kl_in_reward=False), "rollout": dict(stream_scoring="reward")}
    for key, value in changes.items():
        section, name = key.split("__")
        parts[section][name] = value
    return old_logprobs_from_update(SimpleNamespace(**{k: SimpleNamespace(**v) for k, v in parts.items()}))


def test_only_where_nothing_reads_the_old_logprobs_before_an_update_on_the_same_weights():
    assert _decision() and _decision(actor__ppo_mini_batch_size=32)
    for change in ({"actor__ppo_epochs": 2}, {"actor__ppo_mini_batch_size": 8}, {"parallel__pp": 2},
                   {"algorithm__use_kl_in_reward": True}, {"actor__rollout_is": "token"},
                   {"actor__policy_loss": "decoupled_ppo"}, {"actor__routing_replay": "r2"},
                   {"rollout__stream_scoring": "all"}):
        assert not _decision(**change), change


def test_the_recipes_decide_from_their_own_settings():
    quickstart = load_config("configs/quickstart_cpu.yaml")  # two mini-batches per step: the pass stays
    assert not old_logprobs_from_update(quickstart)
    assert old_logprobs_from_update(dataclasses.replace(
        quickstart, actor=dataclasses.replace(quickstart.actor, ppo_mini_batch_size=16)))


def test_the_one_gpu_recipe_passes_check_config_and_skips_the_pass(capsys):
    import importlib.util

    recipe = "configs/grpo_1gpu.yaml"
    spec = importlib.util.spec_from_file_location("check_config", "tools/check_config.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main([recipe, "--world-size", "1", "--model-shape", "28,12,2", "--no-check-paths"]) == 0
    cfg = load_config(recipe, check_paths=False)
    assert old_logprobs_from_update(cfg)
    assert (cfg.model.dtype, cfg.rollout.enforce_eager, cfg.model.use_remove_padding, cfg.actor.use_dynamic_bsz,
            cfg.trainer.deterministic) == ("bfloat16", False, True, True, False)
