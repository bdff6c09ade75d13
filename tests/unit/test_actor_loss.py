"""The actor's update reads actor.policy_loss and actor.rollout_is*: on-policy values of each loss, the rollout IS
correction (truncated weights scale the loss; masked tokens leave the loss and its normaliser), decoupled PPO and the
rollout/* off-policy metrics. The learning rate is 0, so every update sees the same parameters and pg_loss is the loss
of the old policy on the batch."""

import dataclasses
import math

import pytest
import torch

from verl_mega.algos import POLICY_LOSSES
from verl_mega.config import load_config
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.trainer.batch import Batch, pack_sequences


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from verl_mega.parallel.state import init_distributed
    from verl_mega.trainer import setup as trainer_setup
    from verl_mega.trainer.roles import Actor

    groups = init_distributed(tp=1, pp=1)
    path = make_tiny_hf_model(tmp_path_factory.mktemp("actor") / "m", model_type="qwen2")
    cfg = load_config("configs/quickstart_cpu.yaml", [
        "actor.lr=0", "actor.lr_warmup_steps=0", "actor.use_kl_loss=false", "model.dtype=float32",
        "actor.micro_batch_size_per_gpu=4", f"model.path={path}", "data.max_prompt_length=16",
        "rollout.max_response_length=6"])
    m = trainer_setup.build_role_engine(cfg, groups, path, role_cfg=cfg.actor, total_steps=4)
    actor = Actor(m.engine, cfg.actor, vocab_size=m.arch.vocab_size, temperature=1.0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (8,), generator=g)]
    responses = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (8,), generator=g)]
    batch = Batch(dict(pack_sequences(prompts, responses, pad_id=0, max_response_length=6)), {})
    mask = batch["response_mask"]
    batch["old_logprobs"] = actor.compute_logprobs(batch)["logprobs"] * mask
    batch["ref_logprobs"] = batch["old_logprobs"]
    batch["rollout_logprobs"] = batch["old_logprobs"].clone()
    batch["advantages"] = torch.randn(8, 6, generator=g) * mask
    return actor, batch


def _update(actor, batch, **changes) -> dict[str, float]:
    base = actor.cfg
    actor.cfg = dataclasses.replace(base, **changes)
    try:
        return actor.update(batch, mini_batch_rows=8)
    finally:
        actor.cfg = base


def _token_mean(values, mask) -> float:
    return float((values * mask).sum() / mask.sum())


def test_each_policy_loss_on_policy(setup):
    actor, batch = setup
    mask, adv, lp = batch["response_mask"], batch["advantages"], batch["old_logprobs"]
    expected = {
        "vanilla": -_token_mean(adv, mask),  # ratio 1
        "gspo": -float(((adv * mask).sum(-1) / mask.sum(-1)).mean()),  # seq-mean-token-mean of -A s, s = 1
        "cispo": -_token_mean(adv * lp, mask),  # weight 1: -A log pi
        "kl_cov": -_token_mean(adv, mask),  # |log ratio| = 0: the penalty vanishes
        "decoupled_ppo": -_token_mean(adv, mask),  # rollout == old: behaviour weight 1, ratio 1
    }
    for name in POLICY_LOSSES:
        changes = {"policy_loss": name}
        if name == "gspo":
            changes["loss_agg_mode"] = "seq-mean-token-mean"
        metrics = _update(actor, batch, **changes)
        assert math.isfinite(metrics["actor/pg_loss"]), name
        if name in expected:
            assert metrics["actor/pg_loss"] == pytest.approx(expected[name], abs=1e-5), name
    assert "actor/covfrac" in _update(actor, batch, policy_loss="clip_cov", clip_cov_ratio=0.5)


def test_token_sum_is_the_plain_sum(setup):
    actor, batch = setup
    metrics = _update(actor, batch, loss_agg_mode="token-sum")
    mask, adv = batch["response_mask"], batch["advantages"]
    assert metrics["actor/pg_loss"] == pytest.approx(-float((adv * mask).sum()), abs=1e-5)


def test_rollout_is_truncated_weights_scale_the_loss(setup):
    actor, batch = setup
    mask, adv = batch["response_mask"], batch["advantages"]
    shifted = Batch(dict(batch.tensors), {})
    shifted["rollout_logprobs"] = batch["old_logprobs"] - math.log(1.5)  # every token: pi_train / pi_rollout = 1.5
    metrics = _update(actor, shifted, rollout_is="token")
    assert metrics["actor/pg_loss"] == pytest.approx(-1.5 * _token_mean(adv, mask), abs=1e-5)
    assert metrics["rollout/is_weight_mean"] == pytest.approx(1.5)
    assert metrics["rollout/is_clip_frac"] == 0.0 and metrics["rollout/is_mask_frac"] == 0.0
    assert metrics["rollout/behaviour_kl"] == pytest.approx(-math.log(1.5), abs=1e-6)
    metrics = _update(actor, shifted, rollout_is="token", rollout_is_threshold=1.2)
    assert metrics["actor/pg_loss"] == pytest.approx(-1.2 * _token_mean(adv, mask), abs=1e-5)
    assert metrics["rollout/is_weight_mean"] == pytest.approx(1.2)
    assert metrics["rollout/is_clip_frac"] == pytest.approx(1.0)


def test_rollout_is_mask_drops_tokens_from_the_loss_and_its_normaliser(setup):
    actor, batch = setup
    mask, adv = batch["response_mask"], batch["advantages"]
    shifted = Batch(dict(batch.tensors), {})
    rejected = torch.zeros(8, 1)
    rejected[:3] = 1.0  # rows 0-2: ratio 3 > 2 on every token
    shifted["rollout_logprobs"] = batch["old_logprobs"] - math.log(3.0) * rejected
    metrics = _update(actor, shifted, rollout_is="token", rollout_is_mode="mask")
    kept = mask * (1 - rejected)
    assert metrics["actor/pg_loss"] == pytest.approx(-_token_mean(adv, kept), abs=1e-5)
    # the share of the batch's response tokens rejected (a token mean over the whole batch, not per micro-batch)
    assert metrics["rollout/is_mask_frac"] == pytest.approx(float((mask * rejected).sum() / mask.sum()))
    assert metrics["rollout/is_weight_mean"] == pytest.approx(1.0)
    # the same rows dropped at sequence level give the same loss
    metrics = _update(actor, shifted, rollout_is="sequence", rollout_is_mode="mask")
    assert metrics["actor/pg_loss"] == pytest.approx(-_token_mean(adv, kept), abs=1e-5)


def test_rollout_is_needs_rollout_logprobs(setup):
    actor, batch = setup
    without = Batch({k: v for k, v in batch.tensors.items() if k != "rollout_logprobs"}, {})
    with pytest.raises(ValueError, match="rollout_logprobs"):
        _update(actor, without, rollout_is="token")
    with pytest.raises(ValueError, match="rollout_logprobs"):
        _update(actor, without, policy_loss="decoupled_ppo")
    assert "rollout/behaviour_kl" not in _update(actor, without)


def test_decoupled_ppo_weights_the_loss_by_proximal_over_behaviour(setup):
    actor, batch = setup
    mask, adv = batch["response_mask"], batch["advantages"]
    same = _update(actor, batch, policy_loss="decoupled_ppo")  # rollout == old: exactly vanilla
    assert same["actor/pg_loss"] == _update(actor, batch)["actor/pg_loss"]
    assert same["rollout/is_weight_mean"] == 1.0 and same["rollout/behaviour_kl"] == 0.0
    shifted = Batch(dict(batch.tensors), {})
    shifted["rollout_logprobs"] = batch["old_logprobs"] - math.log(1.5) * mask  # pi_prox / pi_behav = 1.5
    metrics = _update(actor, shifted, policy_loss="decoupled_ppo")
    assert metrics["actor/pg_loss"] == pytest.approx(-1.5 * _token_mean(adv, mask), abs=1e-5)
    assert metrics["rollout/is_weight_mean"] == pytest.approx(1.5) and metrics["rollout/is_clip_frac"] == 0.0
    metrics = _update(actor, shifted, policy_loss="decoupled_ppo", behaviour_weight_cap=1.25)
    assert metrics["actor/pg_loss"] == pytest.approx(-1.25 * _token_mean(adv, mask), abs=1e-5)
    assert metrics["rollout/is_clip_frac"] == pytest.approx(1.0)
    k3 = 1.5 - 1 - math.log(1.5)
    assert metrics["rollout/behaviour_kl_k3"] == pytest.approx(k3, abs=1e-6)
    assert all(math.isfinite(v) for v in metrics.values())


def test_off_policy_metrics_without_a_correction(setup):
    actor, batch = setup
    metrics = _update(actor, batch)
    assert metrics["rollout/behaviour_kl"] == 0.0 and metrics["rollout/behaviour_kl_k3"] == 0.0
    assert "rollout/is_weight_mean" not in metrics  # no correction configured: no IS metrics
