"""Dynamic batching by token budget gives the same log-probs and the same optimizer step as fixed micro-batches
(the loss is normalised over the whole mini-batch, so the grouping of rows must not matter)."""

import pytest
import torch

from verl_mega.config import load_config
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.trainer.batch import Batch, pack_sequences


@pytest.fixture(scope="module")
def world():
    from verl_mega.parallel.state import init_distributed

    return init_distributed(tp=1, pp=1)


def _actor(cfg, path, world):
    from verl_mega.trainer import setup
    from verl_mega.trainer.roles import Actor

    m = setup.build_role_engine(cfg, world, path, role_cfg=cfg.actor, total_steps=4)
    return Actor(m.engine, cfg.actor, vocab_size=m.arch.vocab_size, temperature=1.0)


def test_token_budget_matches_fixed_micro_batches(world, tmp_path):
    path = make_tiny_hf_model(tmp_path / "m", model_type="qwen2")
    base = ["actor.lr=1e-3", "actor.lr_warmup_steps=0", "actor.use_kl_loss=false", "model.dtype=float32",
            "actor.micro_batch_size_per_gpu=4", f"model.path={path}", "data.max_prompt_length=16",
            "rollout.max_response_length=6"]
    fixed = _actor(load_config("configs/quickstart_cpu.yaml", base), path, world)
    dynamic_keys = ["actor.use_dynamic_bsz=true", "actor.max_tokens_per_gpu=40", "data.max_prompt_length=16",
                    "rollout.max_response_length=6"]
    dynamic = _actor(load_config("configs/quickstart_cpu.yaml", base + dynamic_keys), path, world)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (8,), generator=g)]
    responses = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (8,), generator=g)]
    packed = pack_sequences(prompts, responses, pad_id=0, max_response_length=6)
    batch = Batch(dict(packed), {})
    lp_fixed = fixed.compute_logprobs(batch)["logprobs"]
    lp_dyn = dynamic.compute_logprobs(batch)["logprobs"]
    mask = packed["response_mask"]
    assert torch.allclose(lp_fixed * mask, lp_dyn * mask, atol=1e-5)
    batch["old_logprobs"] = lp_fixed
    batch["ref_logprobs"] = lp_fixed
    batch["advantages"] = torch.randn(8, 6, generator=g) * mask
    from verl_mega.trainer.micro_batching import make_micro_batches

    regrouped = make_micro_batches(batch, ("input_ids", "prompt_len"), rows_per_micro_batch=4, token_budget=40)
    assert len(regrouped) > 2  # really regrouped
    m1 = fixed.update(batch, mini_batch_rows=8)
    m2 = dynamic.update(batch, mini_batch_rows=8)
    assert abs(m1["actor/pg_loss"] - m2["actor/pg_loss"]) < 1e-5
    # the accumulated (DP-reduced) gradients of the step agree; parameters are not compared because Adam's first
    # step maps even 1e-9 gradient noise to ±lr
    g1 = torch.cat([b.grad_data for c in fixed.engine.chunks for b in c.buffers])
    g2 = torch.cat([b.grad_data for c in dynamic.engine.chunks for b in c.buffers])
    assert g1.abs().max() > 1e-3
    assert torch.allclose(g1, g2, atol=1e-6, rtol=1e-4)


def test_log_prob_pass_uses_its_own_micro_batch_size(world, tmp_path):
    """actor.log_prob_micro_batch_size_per_gpu sizes the actor's forward-only log-prob pass; the update keeps
    actor.micro_batch_size_per_gpu. The grouping does not change the log-probs."""
    path = make_tiny_hf_model(tmp_path / "m", model_type="qwen2")
    base = ["model.dtype=float32", f"model.path={path}", "data.max_prompt_length=16", "rollout.max_response_length=6",
            "actor.micro_batch_size_per_gpu=2"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (8,), generator=g)]
    responses = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (8,), generator=g)]
    batch = Batch(dict(pack_sequences(prompts, responses, pad_id=0, max_response_length=6)), {})
    results = {}
    for rows in (2, 4):
        actor = _actor(load_config("configs/quickstart_cpu.yaml",
                                   base + [f"actor.log_prob_micro_batch_size_per_gpu={rows}"]), path, world)
        calls = []
        forward = actor.engine.forward

        def counting(mbs, post, calls=calls, forward=forward, **kw):
            calls.append([mb["input_ids"].shape[0] for mb in mbs])
            return forward(mbs, post, **kw)

        actor.engine.forward = counting
        results[rows] = actor.compute_logprobs(batch)["logprobs"]
        assert calls == [[rows] * (8 // rows)]
    mask = batch["response_mask"]
    assert torch.allclose(results[2] * mask, results[4] * mask, atol=1e-6)
