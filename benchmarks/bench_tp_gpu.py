"""Calibration figures of the planner's step-time model (verl_mega/planning/timing.py) on one GPU host.

    torchrun --nproc-per-node 2 benchmarks/bench_tp_gpu.py --tp 1 --out tp1.json
    torchrun --nproc-per-node 2 benchmarks/bench_tp_gpu.py --tp 2 --out tp2.json

Every rank measures, at the same time as the others: an 8192³ bf16 matmul (FLOP/s), a 4 GiB device-to-device copy
(bytes read + written per second), NCCL all-gather / reduce-scatter of a micro-batch's activations over all ranks
(bytes each rank receives per second) and a 16 KiB all-reduce (latency). Then forward + backward of our layer spec
(random weights, bf16, micro-batch `--micro-batch` × `--seq-len`) for the Qwen2.5-1.5B and Qwen2.5-7B
architectures at tensor parallelism `--tp` (with sequence parallelism when tp > 1). At tp=1 every rank trains its own
replica at once (data parallelism without the gradient reduction); the loss is the cross-entropy over the rank's
vocabulary shard (the same kernel on V/tp columns). Prints and writes one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

ARCHS = {
    "qwen2.5-1.5b": "tests/fixtures/hf_configs/qwen2.5-1.5b.json",
    "qwen2.5-7b": "tests/fixtures/hf_configs/qwen2.5-7b.json",
}


def _timed(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def device_figures(world: int) -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    matmul = _timed(lambda: a @ a, 10)
    bufs = [torch.empty(2**31, device="cuda", dtype=torch.bfloat16) for _ in range(2)]  # 4 GiB each
    copy = _timed(lambda: bufs[1].copy_(bufs[0]), 10)
    bufs.clear()
    out: dict = {"matmul_tflops": 2 * 8192**3 / matmul / 1e12, "hbm_copy_gbps": 2 * 2**32 / copy / 1e9}
    if world > 1:
        for hidden in (1536, 3584):
            full = torch.empty(8192 * hidden, device="cuda", dtype=torch.bfloat16)  # 8192 tokens × h
            part = torch.empty(full.numel() // world, device="cuda", dtype=torch.bfloat16)
            ag = _timed(lambda f=full, p=part: dist.all_gather_into_tensor(f, p), 20)
            rs = _timed(lambda f=full, p=part: dist.reduce_scatter_tensor(p, f), 20)
            moved = (world - 1) / world * full.numel() * 2
            out[f"all_gather_8192x{hidden}"] = {"s": ag, "gbps": moved / ag / 1e9}
            out[f"reduce_scatter_8192x{hidden}"] = {"s": rs, "gbps": moved / rs / 1e9}
        small = torch.empty(4096, device="cuda", dtype=torch.float32)
        out["all_reduce_16KiB_s"] = _timed(lambda: dist.all_reduce(small), 50)
    return out


def fwd_bwd(name: str, tp: int, args, groups) -> dict:
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config

    arch = arch_from_hf(load_hf_config(Path(__file__).resolve().parents[1] / ARCHS[name]))
    cfg = transformer_config(arch, tp=tp, sequence_parallel=tp > 1, dtype="bfloat16")
    model = build_model_chunks(arch, cfg, groups, use_te="false")[0].cuda()
    b, s = args.micro_batch, args.seq_len
    gen = torch.Generator(device="cuda").manual_seed(0)  # every TP rank feeds the same tokens
    ids = torch.randint(0, arch.vocab_size, (b, s), device="cuda", generator=gen)
    pos = torch.arange(s, device="cuda").expand(b, s)

    def step():
        logits = model(ids, pos, None)
        local = logits.shape[-1]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, local), ids.reshape(-1) % local)
        loss.backward()

    try:
        sec = _timed(step, args.iters)
    except torch.OutOfMemoryError:
        return {"error": "out of memory"}
    finally:
        model = None
        torch.cuda.empty_cache()
    h, L, a, d = arch.hidden_size, arch.num_layers, arch.num_heads, arch.head_dim
    attn = h * (a + 2 * arch.num_kv_heads) * d + a * d * h
    n_mm = L * (attn + 3 * h * arch.ffn_hidden_size) + arch.vocab_size * h
    causal_flops = b * s * (6 * n_mm + 6 * L * a * d * s)  # forward + backward, causal attention counted once
    return {"tp": tp, "tokens": b * s, "s_per_iter": sec, "causal_tflops_per_gpu": causal_flops / sec / tp / 1e12,
            "gpu_seconds_per_token": sec * tp / (b * s)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--models", default="qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from verl_mega.parallel.state import init_distributed

    groups = init_distributed(tp=args.tp, pp=1)
    world = dist.get_world_size()
    result = {"device": torch.cuda.get_device_name(), "world": world, "tp": args.tp,
              "micro_batch": args.micro_batch, "seq_len": args.seq_len, **device_figures(world)}
    for name in args.models.split(","):
        result[name] = fwd_bwd(name, args.tp, args, groups)
    if dist.get_rank() == 0:
        print(json.dumps(result, indent=1), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's requirement for sequence parallelism
    main()
