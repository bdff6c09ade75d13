"""Packed (THD) micro-batches against padded rows: the same log-probs, entropies, values and optimizer-step
gradients in float32, and the pure packing logic (first-fit-decreasing, cu_seqlens, row order)."""

import pytest
import torch

from verl_mega.config import load_config
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.trainer.batch import Batch, pack_sequences
from verl_mega.trainer.micro_batching import make_micro_batches, response_frame


def _batch(n: int = 8, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    # long-tailed response lengths (a few long ones among short ones), as RL rollouts have
    r_len = (1.0 + 0.8 * torch.randn(n, generator=g)).exp().clamp(1, 12).long().tolist()  # lognormal
    prompts = [torch.randint(5, 40, (int(k),), generator=g).tolist() for k in torch.randint(2, 9, (n,), generator=g)]
    responses = [torch.randint(5, 40, (k,), generator=g).tolist() for k in r_len]
    return Batch(dict(pack_sequences(prompts, responses, pad_id=0, max_response_length=12)), {})


def test_first_fit_decreasing_and_cu_seqlens():
    torch.manual_seed(0)
    batch = _batch(10)
    mbs = make_micro_batches(batch, ("input_ids", "prompt_len", "response_mask"), rows_per_micro_batch=4,
                             token_budget=40, multiple=8, packed=True)
    seen = sorted(int(r) for r in mbs.rows)
    assert seen == list(range(10))  # every row once
    padded = make_micro_batches(batch, ("input_ids", "prompt_len"), rows_per_micro_batch=4, token_budget=40)
    assert len(mbs) < len(padded)  # packing needs fewer micro-batches than padding rows to the longest
    for mb in mbs:
        cu, ids = mb["cu_seqlens"].tolist(), mb["input_ids"]
        assert ids.shape[0] == 1 and ids.shape[1] % 8 == 0 and cu[-1] == ids.shape[1]
        used = 0
        for k, start in enumerate(mb["row_start"].tolist()):
            length = int(mb["prompt_len"][k]) + int(mb["response_mask"][k].sum())
            assert cu[k] == start == used
            assert mb["position_ids"][0, start:start + length].tolist() == list(range(length))
            used += length
        assert used <= 40 and ids.shape[1] - used < 8  # within the budget; padding only up to the multiple of 8
    # the same shape everywhere when the pipeline needs it
    same = make_micro_batches(batch, ("input_ids", "prompt_len"), rows_per_micro_batch=3, packed=True,
                              same_shape=True)
    assert len({mb["input_ids"].shape for mb in same}) == 1
    # a rank with fewer micro-batches than its expert-parallel peers runs fillers with nothing to learn from
    filled = make_micro_batches(batch, ("input_ids", "prompt_len", "response_mask"), rows_per_micro_batch=4,
                                token_budget=40, packed=True, agree_count=lambda n: n + 2)
    assert len(filled) == len(mbs) + 2 and filled.batches[-1]["response_mask"].sum() == 0


def test_response_frame_reads_each_rows_positions():
    batch = _batch(5, seed=3)
    mbs = make_micro_batches(batch, ("input_ids", "prompt_len", "response_mask"), rows_per_micro_batch=5, packed=True)
    mb = mbs.batches[0]
    per_token = mb["input_ids"].double()  # "value at position t" = the token at t
    frame = response_frame(per_token, mb, 12)
    for k in range(5):
        p, r = int(batch["prompt_len"][k]), int(batch["response_len"][k])
        assert frame[k, :r].tolist() == batch["input_ids"][k, p - 1:p - 1 + r].double().tolist()
    restored = mbs.restore([frame])
    assert torch.equal(restored, frame[torch.argsort(mbs.rows)])


@pytest.fixture(scope="module")
def world():
    from verl_mega.parallel.state import init_distributed

    return init_distributed(tp=1, pp=1)


def _roles(cfg, path, world, packed):
    from verl_mega.trainer import setup
    from verl_mega.trainer.roles import Actor, Critic

    torch.manual_seed(0)
    m = setup.build_role_engine(cfg, world, path, role_cfg=cfg.actor, total_steps=4)
    actor = Actor(m.engine, cfg.actor, vocab_size=m.arch.vocab_size, temperature=0.9, packed=packed)
    c = setup.build_role_engine(cfg, world, path, role_cfg=cfg.critic, value_head=True, total_steps=4)
    return actor, Critic(c.engine, cfg.critic, packed=packed)


@pytest.mark.parametrize("budget", [None, 48], ids=["fixed-rows", "token-budget"])
def test_packed_matches_padded(world, tmp_path, budget, monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    def no_thd(*args, **kwargs):  # our spec takes rotary embeddings per token, not sequence by sequence
        raise AssertionError("Megatron's THD rotary path ran")

    monkeypatch.setattr(rope_utils, "_apply_rotary_pos_emb_thd", no_thd)
    path = make_tiny_hf_model(tmp_path / "m", model_type="qwen2")
    keys = ["actor.lr=1e-3", "actor.use_kl_loss=true", "model.dtype=float32", "actor.micro_batch_size_per_gpu=3",
            "critic.micro_batch_size_per_gpu=3", f"model.path={path}", "data.max_prompt_length=16",
            "rollout.max_response_length=12", "actor.entropy_coeff=0.01"]
    if budget:
        keys += ["actor.use_dynamic_bsz=true", f"actor.max_tokens_per_gpu={budget}"]
    padded_actor, padded_critic = _roles(load_config("configs/quickstart_cpu.yaml", keys), path, world, False)
    packed_actor, packed_critic = _roles(load_config("configs/quickstart_cpu.yaml", keys), path, world, True)
    batch = _batch(8)
    mask = batch["response_mask"]
    a = padded_actor.compute_logprobs(batch, with_entropy=True)
    b = packed_actor.compute_logprobs(batch, with_entropy=True)
    for k in ("logprobs", "entropy"):
        assert (a[k] * mask - b[k] * mask).abs().max() < 1e-5, k
    assert (a["logprobs"] * mask).abs().max() > 0.1  # not trivially zero
    va, vb = padded_critic.compute_values(batch), packed_critic.compute_values(batch)
    assert (va - vb).abs().max() < 1e-5 and va.abs().max() > 0

    g = torch.Generator().manual_seed(1)
    batch["old_logprobs"] = a["logprobs"] + 0.05 * torch.randn(a["logprobs"].shape, generator=g) * mask
    batch["ref_logprobs"] = a["logprobs"]
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    m1 = padded_actor.update(batch, mini_batch_rows=8)
    m2 = packed_actor.update(batch, mini_batch_rows=8)
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        assert abs(m1[k] - m2[k]) < 1e-5, (k, m1[k], m2[k])
    g1 = torch.cat([b.grad_data for c in padded_actor.engine.chunks for b in c.buffers])
    g2 = torch.cat([b.grad_data for c in packed_actor.engine.chunks for b in c.buffers])
    assert g1.abs().max() > 1e-3 and (g1 - g2).abs().max() < 1e-5
