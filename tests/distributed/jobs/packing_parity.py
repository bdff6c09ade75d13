"""Packed (THD) against padded micro-batches on 2 ranks at one layout (--tp/--pp/--cp/--sp): log-probs, entropies and
critic values in the forward, and the accumulated gradients of one actor update, all in float32; any mismatch raises
on the rank that sees it. :func:`check_packing` runs inside jobs/model_parity.py (``--packing``, which prints
``PACKING {json}`` on rank 0), at layouts whose logits that job checks anyway."""

from __future__ import annotations

import torch


def _batch(n: int) -> "object":
    from verl_mega.trainer.batch import Batch, pack_sequences

    g = torch.Generator().manual_seed(0)
    r_len = (1.2 + 0.8 * torch.randn(n, generator=g)).exp().clamp(1, 14).long().tolist()  # lognormal: long-tailed
    prompts = [torch.randint(5, 40, (int(k),), generator=g).tolist() for k in torch.randint(2, 9, (n,), generator=g)]
    responses = [torch.randint(5, 40, (k,), generator=g).tolist() for k in r_len]
    return Batch(dict(pack_sequences(prompts, responses, pad_id=0, max_response_length=14)), {})


def reduced_grads(engine) -> torch.Tensor:
    """The gradients this rank holds reduced over its data- and context-parallel peers: with the distributed
    optimizer only its shard of every bucket (the rest of the buffer keeps this rank's own, unreduced share, which
    depends on how tokens were split over the context-parallel ranks)."""
    import torch.distributed as dist

    group = engine.groups["dp_cp"]
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = []
    for chunk in engine.chunks:
        for buf in chunk.buffers:
            if chunk.ddp_config.use_distributed_optimizer and size > 1:
                parts += [bucket.grad_data.chunk(size)[rank] for bucket in buf.buckets]
            else:
                parts.append(buf.grad_data)
    return torch.cat(parts)


def check_packing(groups, model: str) -> dict:
    """The packed-vs-padded comparison on an initialised layout (``groups``); raises on a mismatch, returns the
    report. tests/distributed/jobs/model_parity.py runs it too (``--packing``), after its own checks."""
    import torch.distributed as dist

    from verl_mega.config import load_config
    from verl_mega.trainer import setup
    from verl_mega.trainer.roles import Actor, Critic

    keys = ["actor.lr=1e-3", "actor.use_kl_loss=true", "model.dtype=float32", "actor.micro_batch_size_per_gpu=3",
            "critic.micro_batch_size_per_gpu=3", f"model.path={model}", "data.max_prompt_length=16",
            "rollout.max_response_length=14", "actor.entropy_coeff=0.01"]
    cfg = load_config("configs/quickstart_cpu.yaml", keys)

    def roles(packed: bool):
        torch.manual_seed(0)
        a = setup.build_role_engine(cfg, groups, model, role_cfg=cfg.actor, total_steps=4)
        c = setup.build_role_engine(cfg, groups, model, role_cfg=cfg.critic, value_head=True, total_steps=4)
        return (Actor(a.engine, cfg.actor, vocab_size=a.arch.vocab_size, temperature=0.9, packed=packed),
                Critic(c.engine, cfg.critic, packed=packed))

    (pad_actor, pad_critic), (pk_actor, pk_critic) = roles(False), roles(True)
    batch = _batch(10)
    mask = batch["response_mask"]
    a = pad_actor.compute_logprobs(batch, with_entropy=True)
    b = pk_actor.compute_logprobs(batch, with_entropy=True)
    report = {k: float((a[k] * mask - b[k] * mask).abs().max()) for k in ("logprobs", "entropy")}
    report["values"] = float((pad_critic.compute_values(batch) - pk_critic.compute_values(batch)).abs().max())

    g = torch.Generator().manual_seed(1)
    batch["old_logprobs"] = a["logprobs"] + 0.05 * torch.randn(mask.shape, generator=g) * mask
    batch["ref_logprobs"] = a["logprobs"]
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    m1 = pad_actor.update(batch, mini_batch_rows=10)
    m2 = pk_actor.update(batch, mini_batch_rows=10)
    for k in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/grad_norm"):
        report[k] = abs(m1[k] - m2[k])
    g1, g2 = reduced_grads(pad_actor.engine), reduced_grads(pk_actor.engine)
    report["grad"] = float((g1 - g2).abs().max())
    report["grad_scale"] = float(g1.abs().max())
    assert report["grad_scale"] > 1e-3, report
    bad = {k: v for k, v in report.items() if k != "grad_scale" and not v < 1e-5}
    assert not bad, f"rank {dist.get_rank()}: packed and padded differ: {bad}"
    return report

