"""torchrun job: mcore logits (built from a tiny HF checkpoint, or a converted dist checkpoint) vs HF transformers.

Args: --tp --pp [--cp] [--ep] [--etp] [--sp] [--grads] --models qwen2,llama,qwen3 --workdir DIR [--mcore-ckpt DIR]
[--save-ckpt DIR] (saves the loaded model again at this layout, as a dist checkpoint the converters read) [--lora]
(then LoRA adapters vs HF + peft at this layout: jobs/lora_parity.py)
[--replay] (MoE, with --grads: recorded routing equals HF's; replaying other experts gives HF's logits with its routers
forced to them) [--packing] (then packed vs padded micro-batches on qwen2 at this layout: jobs/packing_parity.py)

Logits, log-probs and entropy go through the engine's forward (and, for log-probs, the actor's own path); with
``--grads`` one training step (lr 0) of a log-likelihood loss through the same path leaves the gradient in
Megatron's grad buffers, compared with HF's gradient of the same loss parameter by parameter.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--grads", action="store_true")
    ap.add_argument("--models", default="qwen2,llama,qwen3")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--mcore-ckpt", default=None)
    ap.add_argument("--save-ckpt", default=None)
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--packing", action="store_true", help="also packed vs padded (jobs/packing_parity.py) on qwen2")
    ap.add_argument("--lora", action="store_true", help="also LoRA adapters vs HF + peft (jobs/lora_parity.py)")
    args = ap.parse_args()

    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoModelForCausalLM

    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import load_hf_weights, unwrap
    from verl_mega.checkpoint.mcore import load_model_dist
    from verl_mega.models.weights import hf_to_mcore_shard, rule_for
    from verl_mega.parallel.state import init_distributed
    from verl_mega.trainer.batch import Batch
    from verl_mega.trainer.roles import PolicyRole

    groups = init_distributed(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, etp=args.etp, sequence_parallel=args.sp,
                              seed=1)
    report = {}
    for mt in args.models.split(","):
        path = Path(args.workdir) / mt
        arch = arch_from_hf(load_hf_config(path))
        # HF's loss has no router load-balancing term (output_router_logits is off); DeepSeek's correction bias stays
        # HF's through the lr-0 step (its update from token counts is tested in tests/unit/test_moe.py)
        moe = dict(moe_aux_loss_coeff=0.0) if arch.is_moe else {}
        if arch.moe_expert_bias:
            moe["moe_router_bias_update_rate"] = 0.0
        cfg = transformer_config(arch, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep if arch.is_moe else 1,
                                 etp=args.etp if arch.is_moe else None, sequence_parallel=args.sp,
                                 use_cpu_initialization=True, **moe)
        chunks = build_model_chunks(arch, cfg, groups, use_te="false")
        if args.mcore_ckpt:
            load_model_dist(chunks, args.mcore_ckpt, groups)
        else:
            load_hf_weights(chunks, HFCheckpointReader(path), arch, groups)
        if args.save_ckpt:
            from verl_mega.checkpoint.mcore import META_FILE, save_model_dist

            Path(args.save_ckpt).mkdir(parents=True, exist_ok=True)
            save_model_dist(chunks, args.save_ckpt, groups)
            if dist.get_rank() == 0:
                meta = {"hf_config": load_hf_config(path), "dtype": "float32", "format": "mcore_dist"}
                (Path(args.save_ckpt) / META_FILE).write_text(json.dumps(meta))
        optim = OptimizerConfig(optimizer="adam", lr=0.0, weight_decay=0.0, clip_grad=0.0,
                                use_distributed_optimizer=False, params_dtype=torch.float32) if args.grads else None
        engine = MegatronEngine(chunks, cfg, groups, optimizer_config=optim)
        if args.replay and arch.is_moe:
            engine.enable_routing_replay()
        g = torch.Generator().manual_seed(7)
        # same on every rank; without token 0, the pad token, whose embedding row HF freezes (padding_idx)
        ids = torch.randint(1, arch.vocab_size, (4, 24), generator=g)
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        mbs = [{"input_ids": ids[i:i + 2], "position_ids": pos[i:i + 2]} for i in (0, 2)]

        def post(output, mb, engine=engine, arch=arch):
            full = engine.full_sequence(gather_from_tensor_model_parallel_region(output, group=groups["tp"]))
            nxt = (engine.cp_positions(mb["input_ids"].shape[1]) + 1).clamp(max=mb["input_ids"].shape[1] - 1)
            lp, ent = vocab_parallel_logprobs_entropy(output, mb["input_ids"][:, nxt], vocab_size=arch.vocab_size,
                                                      tp_group=groups["tp"], with_entropy=True)
            return {"logits": full[..., : arch.vocab_size], "logprobs": engine.full_sequence(lp)[:, :-1],
                    "entropy": engine.full_sequence(ent)[:, :-1]}

        res = engine.forward(mbs, post)
        logits = torch.cat([r["logits"] for r in res])
        lp = torch.cat([r["logprobs"] for r in res])
        ent = torch.cat([r["entropy"] for r in res])
        # the actor's own log-prob path: prompt of one token, the rest is the response
        role = PolicyRole(engine, vocab_size=arch.vocab_size, micro_batch_size=2, temperature=1.0)
        batch = Batch({"input_ids": ids, "prompt_len": torch.ones(4, dtype=torch.long),
                       "response_mask": torch.ones(4, ids.shape[1] - 1)})
        role_lp = role.compute_logprobs(batch)["logprobs"]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(ids).logits.double()
        ref_lsm = torch.log_softmax(ref, -1)
        ref_lp = ref_lsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        ref_ent = -(ref_lsm.exp() * ref_lsm).sum(-1)[:, :-1]
        err = (logits.double() - ref).abs().max().item()
        lp_err = max((lp.double() - ref_lp).abs().max().item(), (role_lp.double() - ref_lp).abs().max().item())
        ent_err = (ent.double() - ref_ent).abs().max().item()
        report[mt] = {"logits_max_abs": err, "logprob_max_abs": lp_err, "entropy_max_abs": ent_err}
        assert err < 1e-5, f"{mt}: logits differ from HF by {err}"
        assert lp_err < 1e-5 and ent_err < 1e-5, f"{mt}: logprob {lp_err} / entropy {ent_err} differ from float64"
        if args.grads:
            report[mt]["grad_max_abs"] = _check_grads(engine, role, hf, ids, pos, arch, groups, rule_for,
                                                      hf_to_mcore_shard, unwrap, path)
            if args.replay and arch.is_moe:
                report[mt]["replay_logits_max_abs"] = _check_replay(engine, arch, groups, path, ids, pos)
    if dist.get_rank() == 0:
        print("PARITY " + json.dumps({"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep, "sp": args.sp,
                                      **report}), flush=True)
    if args.lora:
        from lora_parity import check_lora

        lora = check_lora(groups, args.workdir, f"tp{args.tp}-pp{args.pp}" + ("-sp" if args.sp else ""))
        if dist.get_rank() == 0:
            print("LORA " + json.dumps(lora), flush=True)
    if args.packing:
        from packing_parity import check_packing

        packing = check_packing(groups, str(Path(args.workdir) / "qwen2"))
        if dist.get_rank() == 0:
            print("PACKING " + json.dumps(packing), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _route_hooks(hf, forced=None) -> dict:
    """HF's routed experts per MoE layer ({layer: [tokens, k]}, batch-major), or HF's routers forced to
    ``forced[layer]`` with HF's own weighting of those experts (softmax, or DeepSeek's sigmoid with its scaling)."""
    captured = {}
    for i, layer in enumerate(hf.model.layers):
        moe = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if not hasattr(moe, "gate") or not hasattr(moe.gate, "weight") or moe.gate.weight.dim() != 2 \
                or not hasattr(moe, "experts"):
            continue  # a dense layer (DeepSeek's first_k_dense_replace)
        gate = moe.gate

        def hook(module, args, out, i=i):
            logits, scores, indices = out
            captured[i] = indices.detach().clone()
            if forced is None:
                return out
            if hasattr(module, "e_score_correction_bias"):  # DeepSeek: sigmoid scores of the chosen experts
                weights = logits.sigmoid().gather(1, forced[i])
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * module.routed_scaling_factor
                return logits, weights.to(logits.dtype), forced[i]
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, forced[i])
            if getattr(module, "norm_topk_prob", True):  # Mixtral always renormalises
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), forced[i]

        gate.register_forward_hook(hook)
    return captured


def _check_replay(engine, arch, groups, path, ids, pos) -> float:
    """Routing replay across ranks (sequence-parallel token splits, pipeline stages, expert parallelism): the routing
    recorded in a forward pass equals HF's on this rank's layers; a train step replaying other experts computes
    HF's logits with its routers forced to those experts."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoModelForCausalLM


    mbs = [{"input_ids": ids[i:i + 2], "position_ids": pos[i:i + 2]} for i in (0, 2)]
    res = engine.forward([dict(mb) for mb in mbs], lambda out, mb: {}, record_routing=True)
    routed = torch.cat([r["routed_experts"] for r in res]).long()  # [4, s, layers of this stage, k]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    captured = _route_hooks(hf)
    with torch.no_grad():
        hf(ids)
    layers = engine.routing.layers.tolist()  # the model layer of each of this rank's routers
    for i, layer in enumerate(layers):
        want = captured[layer].view(ids.shape[0], ids.shape[1], -1)
        assert torch.equal(routed[:, :, i].sort(-1).values, want.sort(-1).values), f"layer {layer} routing"
    # every layer, this stage's included, replays the next expert after each token's first choice
    everyone = [None] * groups.size("pp")
    torch.distributed.all_gather_object(everyone, routed, group=groups["pp"])
    full = torch.cat(everyone, dim=2)
    forced = full.clone()
    shifted = (forced[..., 0] + 1) % arch.num_experts
    while bool((shifted.unsqueeze(-1) == forced[..., 1:]).any()):
        clash = (shifted.unsqueeze(-1) == forced[..., 1:]).any(-1)
        shifted = torch.where(clash, (shifted + 1) % arch.num_experts, shifted)
    forced[..., 0] = shifted
    first = sum(len(x) for x in _stage_router_layers(engine, groups)[:groups.pp_rank])
    mine = forced[:, :, first:first + routed.shape[2]].to(torch.int16)
    seen = []

    def loss_fn(out, mb):
        full_logits = engine.full_sequence(gather_from_tensor_model_parallel_region(out, group=groups["tp"]))
        seen.append(full_logits[..., :arch.vocab_size].detach().clone())
        return 0.0 * out.float().sum(), {}

    engine.train_step([{**mb, "routed_experts": mine[i:i + 2]} for mb, i in zip(mbs, (0, 2))], loss_fn)
    if not groups.last_stage:
        return 0.0
    hf_forced = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _route_hooks(hf_forced, forced={layer: forced[:, :, i].reshape(-1, arch.moe_topk)
                                    for i, layer in enumerate(arch.moe_layers)})
    with torch.no_grad():
        ref = hf_forced(ids).logits
    err = (torch.cat(seen).double() - ref.double()).abs().max().item()
    assert err < 1e-5, f"replayed logits differ from HF with forced routing by {err}"
    return err


def _stage_router_layers(engine, groups) -> list:
    """The model layers of every pipeline stage's routers, stage by stage."""
    everyone = [None] * groups.size("pp")
    torch.distributed.all_gather_object(everyone, engine.routing.layers.tolist(), group=groups["pp"])
    return everyone


def _checkpoint_names(hf, arch, value) -> dict:
    """``value(param)`` of every HF parameter under its checkpoint name: transformers keeps each MoE layer's experts
    fused ([E, 2f, h] gate|up and [E, h, f] down, under ``mlp``) while checkpoints name them expert by expert."""
    import re

    block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if arch.model_type == "mixtral"
                               else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    out = {}
    for name, param in hf.named_parameters():
        t, m = value(param), re.match(r"model\.layers\.(\d+)\.mlp\.(.+)$", name)
        if not (arch.is_moe and m):
            out[name] = t
            continue
        base = f"model.layers.{m.group(1)}.{block}"
        if m.group(2) == "experts.gate_up_proj":
            for e in range(arch.num_experts):
                out[f"{base}.experts.{e}.{gate}.weight"], out[f"{base}.experts.{e}.{up}.weight"] = t[e].chunk(2)
        elif m.group(2) == "experts.down_proj":
            for e in range(arch.num_experts):
                out[f"{base}.experts.{e}.{down}.weight"] = t[e]
        else:
            out[f"{base}.{m.group(2)}"] = t
    return out


def _check_grads(engine, role, hf, ids, pos, arch, groups, rule_for, hf_to_mcore_shard, unwrap, path) -> float:
    """Mean negative log-likelihood of the 4 rows, one optimizer step at lr 0: Megatron's grad buffers (reduced over
    data and context parallelism) against HF's gradient of the same loss, mapped onto this rank's shards. Each
    data-parallel rank trains its own rows, normalised by the global token count, as the actor does."""
    count = ids.numel() - ids.shape[0]
    mine = torch.arange(ids.shape[0]).chunk(engine.dp_size)[engine.dp_rank]
    mbs = [{"input_ids": ids[i:i + 1], "position_ids": pos[i:i + 1], "prompt_len": torch.ones(1, dtype=torch.long),
            "response_mask": torch.ones(1, ids.shape[1] - 1)} for i in mine.tolist()]
    scale = engine.dp_size * len(mbs)  # undoes the schedule's 1/num_microbatches and DDP's 1/dp

    def loss_fn(output, mb):
        lp, _ = role._logprobs(output, mb, False)
        loss = -lp.sum() / count
        return loss * scale, {"loss": loss.detach()}

    engine.train_step(mbs, loss_fn)
    hf.zero_grad()
    logits = hf(ids).logits.float()
    (-torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum() / count).backward()
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import expert_shard

    reader = HFCheckpointReader(path)  # the renaming of fused experts, checked on the weights themselves
    for name, value in _checkpoint_names(hf, arch, lambda p: p.detach()).items():
        assert torch.equal(value, reader.get(name)), f"{name}: HF parameter layout misread"
    hf_grads = _checkpoint_names(hf, arch, lambda p: p.grad)
    if arch.tie_word_embeddings:
        hf_grads.setdefault("lm_head.weight", hf_grads["model.embed_tokens.weight"])
    def read(name, rows=None, cols=None):
        t = hf_grads[name]
        t = t if rows is None else t[rows[0]:rows[1]]
        return t if cols is None else t[:, cols[0]:cols[1]]

    worst = 0.0
    for chunk in engine.chunks:
        model = unwrap(chunk)
        for name, param in model.named_parameters():
            rule = rule_for(name, arch, model.stage_layout.layer_offset)
            want = hf_to_mcore_shard(rule, read, arch, groups.tp_rank, groups.size("tp"),
                                     model.vocab_size, expert_shard(groups))
            got = param.main_grad.float()
            assert got.shape == want.shape, (name, got.shape, want.shape)
            diff = (got - want).abs().max().item()
            assert diff < 1e-5, f"gradient of {name} differs from HF by {diff}"
            worst = max(worst, diff)
    return worst


if __name__ == "__main__":
    main()
