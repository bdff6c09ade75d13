"""Small-batch linears at the Qwen2.5-7B shapes: cuBLAS bf16, FP8 W8A8 with per-token activation scales, and a
weight-only FP8 Triton kernel (W8A16), each timed inside a CUDA graph as vLLM runs them.

Why: a long-tailed rollout is mostly a few sequences decoding for thousands of steps, and there a 7B FP8 step on an
H200 was only 1.36x faster than bf16. Its linears' FP8 GEMMs were 1.82x faster, but the per-token quantization of
the activations in front of each linear took 0.45 ms of the 3.35 ms step back (BENCHMARKS.md, "Where a 7B decode
step goes in bf16 and FP8"). A weight-only kernel reads the same FP8 weights and needs no activation quantization.
This measures whether one written in Triton reads them fast enough at batch 1-64 to be worth putting into vLLM.

The weight-only kernel takes vLLM's per-channel layout as the rollout's FP8 sync writes it: e4m3 codes [out, in]
row-major (vLLM holds their transpose view) and fp32 scales [out]. Each program computes BLOCK_N outputs for all
(at most BLOCK_M) rows of x, reading its weight rows once; the FP8 codes become bf16 in registers, so the product is
exact up to bf16 rounding of x and fp32 accumulation. Split over K (SPLIT_K > 1) adds partial sums atomically into an
fp32 buffer, for the narrow outputs that give too few programs otherwise.

    python benchmarks/bench_fp8_gemv_gpu.py --out gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_mega.hybrid.fp8 import FP8_MAX, quantize_rows_into  # noqa: E402

# Qwen2.5-7B: hidden 3584, 28 query heads and 4 KV heads of 128, MLP 18944; (name, out, in) per layer
SHAPES_7B = [("gate_up_proj", 37888, 3584), ("down_proj", 3584, 18944), ("qkv_proj", 4608, 3584),
             ("o_proj", 3584, 3584)]  # the MLP's first: 87 % of the bytes
LAYERS_7B = 28


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def w8a16(x, w, scale, out, M, N, K, x_row, w_row, out_row,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
              DOT_BF16: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
        k_start = pid_k * k_per_split
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x + rows[:, None] * x_row + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                        other=0.0)
            b = tl.load(w + cols[:, None].to(tl.int64) * w_row + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0)
            b = b.to(tl.float8e4nv, bitcast=True)
            if DOT_BF16:  # tensor cores; exact for e4m3 codes
                acc += tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))
            else:  # Triton's CPU interpreter multiplies bf16 wrongly: the same sums in fp32 there
                acc += tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
        acc = acc * tl.load(scale + cols, mask=cols < N, other=0.0)[None, :]
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        if SPLIT_K == 1:
            tl.store(out + rows[:, None] * out_row + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(out + rows[:, None] * out_row + cols[None, :], acc, mask=mask)

    return w8a16


_W8A16 = None


def w8a16_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, block_n: int = 32,
                 block_k: int = 256, split_k: int = 1, num_warps: int = 4) -> torch.Tensor:
    """x [M, K] (bf16) @ (codes [N, K] e4m3 · scale [N]).T → [M, N] in x's dtype, M ≤ 64."""
    import triton

    global _W8A16
    if _W8A16 is None:
        _W8A16 = _kernel()
    m, k = x.shape
    n = codes.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    if block_m > 64:
        raise ValueError(f"the weight-only kernel is for small batches (M ≤ 64), got M={m}")
    out = (torch.empty if split_k == 1 else torch.zeros)((m, n), device=x.device,
                                                        dtype=x.dtype if split_k == 1 else torch.float32)
    grid = (triton.cdiv(n, block_n), split_k)
    _W8A16[grid](x, codes.view(torch.uint8), scale, out, m, n, k, x.stride(0), codes.stride(0), out.stride(0),
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, DOT_BF16=x.is_cuda,
                 num_warps=num_warps)
    return out if split_k == 1 else out.to(x.dtype)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes and fp32 scales [out], by the rollout's FP8 sync's own quantizer."""
    codes = torch.empty(w.shape, device=w.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(w.shape[0], 1, device=w.device, dtype=torch.float32)
    quantize_rows_into(codes, scale, w)
    return codes, scale.view(-1)


def reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64: x (as given, bf16) times the dequantized weights."""
    return x.double() @ (codes.double() * scale.double()[:, None]).t()


def w8a8_linear(x: torch.Tensor, codes_t: torch.Tensor, scale_row: torch.Tensor) -> torch.Tensor:
    """Per-token activation scales, then torch's row-wise scaled matmul (what vLLM's W8A8 path does)."""
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    xs = amax / FP8_MAX
    xq = (x.float() / xs).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch._scaled_mm(xq, codes_t, scale_a=xs, scale_b=scale_row, out_dtype=x.dtype)


def graph_us(fn, repeats: int = 20, replays: int = 10) -> float:
    """µs per call of fn, run `repeats` times inside one CUDA graph (no launch gaps beyond the graph's own)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * repeats)


CONFIGS = [dict(block_n=bn, block_k=bk, split_k=sk, num_warps=4)
           for bn, bk, sk in itertools.product((16, 32, 64), (256, 512), (1, 2, 4))]


def measure(name: str, w: torch.Tensor, m: int) -> dict:
    """One linear [out, in] at batch m: the three kernels' µs (the weight-only one at its fastest configuration)
    and their errors against float64."""
    n, k = w.shape
    codes, scale = quantize_rows(w)
    codes_t, scale_row = codes.t(), scale.view(1, n)  # vLLM's view: [in, out], column-major
    x = torch.randn(m, k, device=w.device, dtype=torch.bfloat16)
    ref = reference(x, codes, scale)

    def rel_err(got: torch.Tensor) -> float:
        return ((got.double() - ref).abs().max() / ref.abs().max()).item()

    best = None
    for cfg in CONFIGS:
        if cfg["split_k"] > 1 and triton_grid(n, cfg) >= 264:
            continue  # enough programs already: the atomics would only cost
        try:
            err = rel_err(w8a16_linear(x, codes, scale, **cfg))
        except Exception as exc:  # a block too large for shared memory at this batch: not a candidate
            if "out of resource" not in str(exc):
                raise
            continue
        us = graph_us(lambda cfg=cfg: w8a16_linear(x, codes, scale, **cfg))
        if best is None or us < best[0]:
            best = (us, cfg, err)
    row = {"name": name, "out": n, "in": k, "m": m, "bf16_us": graph_us(lambda: torch.nn.functional.linear(x, w)),
           "w8a16_us": best[0], "w8a16_config": best[1], "w8a16_rel_err": best[2],
           "w8a16_tb_per_s": n * k / best[0] / 1e6}
    try:  # torch's row-wise FP8 matmul may refuse a shape
        row["w8a8_us"] = graph_us(lambda: w8a8_linear(x, codes_t, scale_row))
        row["w8a8_rel_err"] = rel_err(w8a8_linear(x, codes_t, scale_row))
    except RuntimeError as exc:
        row["w8a8_us"], row["w8a8_error"] = float("nan"), str(exc)[:200]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": SHAPES_7B,
              "layers": LAYERS_7B, "rows": []}
    t0 = time.perf_counter()
    for name, n, k in SHAPES_7B:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        for m in map(int, args.batches.split(",")):
            result["rows"].append(measure(name, w, m))
            print(json.dumps(result["rows"][-1]), flush=True)
    per_step = {}
    for m in map(int, args.batches.split(",")):
        rows = [r for r in result["rows"] if r["m"] == m]
        per_step[m] = {kind: LAYERS_7B * sum(r[f"{kind}_us"] for r in rows) for kind in ("bf16", "w8a8", "w8a16")}
    result["per_step_us"] = per_step
    result["seconds"] = time.perf_counter() - t0
    print(json.dumps({"per_step_us": per_step}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


def triton_grid(n: int, cfg: dict) -> int:
    return -(-n // cfg["block_n"]) * cfg["split_k"]


if __name__ == "__main__":
    main()
