"""Small-batch linears at the Qwen2.5-7B and 1.5B shapes: cuBLAS bf16, FP8 W8A8 with per-token activation scales, and
weight-only FP8 Triton kernels (W8A16), each timed inside a CUDA graph as vLLM runs them.

Why: a long-tailed rollout is mostly a few sequences decoding for thousands of steps, and there a 7B FP8 step on an
H200 was only 1.36x faster than bf16. Its linears' FP8 GEMMs were 1.82x faster, but the per-token quantization of
the activations in front of each linear took 0.45 ms of the 3.35 ms step back (BENCHMARKS.md, "Where a 7B decode
step goes in bf16 and FP8"). A weight-only kernel reads the same FP8 weights and needs no activation quantization.
This measures whether one written in Triton reads them fast enough at batch 1-64 to be worth putting into vLLM.

The weight-only kernels take vLLM's per-channel layout as the rollout's FP8 sync writes it: e4m3 codes [out, in]
row-major (vLLM holds their transpose view) and fp32 scales [out]. Three formulations: x as the tensor-core product's
first operand, the weights as its first operand (``swap``), and fp32 FMAs without tensor cores (``gemv``, batch <= 4).
Each launch shape (output tile, K step, K splits, warps, pipeline stages) is timed and the fastest reported, beside
what `default_config` picks. None of them beat vLLM's fused W8A8 path on an H200 (BENCHMARKS.md, 2026-12-04), so
none is on the rollout's path.

    python benchmarks/bench_fp8_gemv_gpu.py --out gemv.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_mega.hybrid.fp8 import FP8_DTYPE, FP8_MAX, quantize_rows_into  # noqa: E402

# Qwen2.5-7B: hidden 3584, 28 query heads and 4 KV heads of 128, MLP 18944; (name, out, in) per layer
SHAPES = {"7b": [("gate_up_proj", 37888, 3584), ("down_proj", 3584, 18944), ("qkv_proj", 4608, 3584),
                  ("o_proj", 3584, 3584)],  # the MLP's: 87 % of the bytes
          # Qwen2.5-1.5B: hidden 1536, 12 query heads and 2 KV heads of 128, MLP 8960
          "1.5b": [("gate_up_proj", 17920, 1536), ("down_proj", 1536, 8960), ("qkv_proj", 2048, 1536),
                   ("o_proj", 1536, 1536)]}
LAYERS = 28  # both


@dataclass(frozen=True)
class KernelConfig:
    """One launch shape of the weight-only kernel: an [block_m, block_n] output tile per program, the K dimension
    walked in ``block_k`` steps and split over ``split_k`` programs (partial sums then reduced by a second kernel)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False  # weights as the MMA's first operand: out^T = W · x^T (a 64-128 row tile of W per step)
    gemv: bool = False  # no tensor cores: each program multiplies its weight tile by every row of x in fp32 FMAs


# the H200 has 132 SMs; two programs per SM keep enough weight bytes in flight to near its bandwidth
_TARGET_PROGRAMS = 264


def default_config(m: int, n: int, k: int) -> KernelConfig:
    """The launch shape for an [m, k] × [k, n] product (see :func:`pick_split`)."""
    block_n = 64 if n >= 16384 else 32
    block_k = 256 if m > 16 else 512
    return KernelConfig(block_n=block_n, block_k=block_k, split_k=pick_split(n, k, block_n, block_k))


def pick_split(n: int, k: int, block_n: int, block_k: int) -> int:
    """Split K until there are enough programs to fill the GPU, keeping every split at least two K blocks long."""
    tiles = -(-n // block_n)
    split = 1
    while tiles * split < _TARGET_PROGRAMS and k >= 4 * split * block_k:
        split *= 2
    return split


@functools.cache
def _kernels():
    """The Triton kernels (built on first use: Triton comes with CUDA builds of torch, and with its interpreter
    for the CPU tests)."""
    import triton
    import triton.language as tl

    @triton.jit
    def w8a16(x, w, scale, bias, out, part, M, N, K, k_per_split, x_row, w_row, out_row,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
              HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_BF16: tl.constexpr, GEMV: tl.constexpr):
        # [BLOCK_M, BLOCK_N] outputs per program. The tensor-core form loads the weight tile as [BLOCK_K, BLOCK_N]
        # for tl.dot; GEMV loads it as [BLOCK_N, BLOCK_K], widens it to fp32 in the registers it was loaded into (no
        # shared memory, no operand layout change) and reduces the products along K with FMAs
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        # rows past M and columns past N read row 0 / column 0 instead of masking: in bounds, and never stored
        x_ptr = x + tl.where(rows < M, rows, 0)[:, None].to(tl.int64) * x_row
        if GEMV:
            w_ptr = w + tl.where(col_ok, cols, 0)[:, None].to(tl.int64) * w_row
        else:
            w_ptr = w + tl.where(col_ok, cols, 0)[None, :].to(tl.int64) * w_row
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            w_ks = ks[None, :] if GEMV else ks[:, None]
            if EVEN_K:
                a = tl.load(x_ptr + ks[None, :])
                b = tl.load(w_ptr + w_ks)
            else:
                a = tl.load(x_ptr + ks[None, :], mask=ks[None, :] < k_hi, other=0.0)
                b = tl.load(w_ptr + w_ks, mask=w_ks < k_hi, other=0)
            b = b.to(tl.float8e4nv, bitcast=True)
            if GEMV:
                acc += tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)
            elif DOT_BF16:  # e4m3 → bf16 is exact; tensor cores with fp32 accumulation
                acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
            else:  # Triton's CPU interpreter multiplies bf16 wrongly: the same sums in fp32 there
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        mask = (rows[:, None] < M) & col_ok[None, :]
        if PARTIAL:
            tl.store(part + (pid_k * M + rows[:, None]) * N + cols[None, :], acc, mask=mask)
        else:
            acc = acc * tl.load(scale + cols, mask=col_ok, other=0.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out + rows[:, None] * out_row + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def w8a16_swapped(x, w, scale, bias, out, part, M, N, K, k_per_split, x_row, w_row, out_row,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTIAL: tl.constexpr,
                      HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_BF16: tl.constexpr):
        # the transposed product: acc [BLOCK_N, BLOCK_M] = W [BLOCK_N, BLOCK_K] · x^T [BLOCK_K, BLOCK_M], so the
        # weight tile, widened in registers, is the large operand and the few rows of x the small one
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        x_ptr = x + tl.where(rows < M, rows, 0)[None, :].to(tl.int64) * x_row
        w_ptr = w + tl.where(col_ok, cols, 0)[:, None].to(tl.int64) * w_row
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                b = tl.load(w_ptr + ks[None, :])
                a = tl.load(x_ptr + ks[:, None])
            else:
                b = tl.load(w_ptr + ks[None, :], mask=ks[None, :] < k_hi, other=0)
                a = tl.load(x_ptr + ks[:, None], mask=ks[:, None] < k_hi, other=0.0)
            b = b.to(tl.float8e4nv, bitcast=True)
            if DOT_BF16:
                acc = tl.dot(b.to(tl.bfloat16), a.to(tl.bfloat16), acc)
            else:
                acc = tl.dot(b.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
        mask = col_ok[:, None] & (rows[None, :] < M)
        if PARTIAL:
            tl.store(part + (pid_k * M + rows[None, :]) * N + cols[:, None], acc, mask=mask)
        else:
            acc = acc * tl.load(scale + cols, mask=col_ok, other=0.0)[:, None]
            if HAS_BIAS:
                acc += tl.load(bias + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
            tl.store(out + rows[None, :] * out_row + cols[:, None], acc.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def reduce_splits(part, scale, bias, out, M, N, SPLIT_K, out_row, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
        row = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, SPLIT_K):  # a fixed order: deterministic sums
            acc += tl.load(part + (s * M + row) * N + cols, mask=ok, other=0.0)
        acc = acc * tl.load(scale + cols, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + row * out_row + cols, acc.to(out.dtype.element_ty), mask=ok)

    return w8a16, w8a16_swapped, reduce_splits


def w8a16_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                 config: KernelConfig | None = None) -> torch.Tensor:
    """``x`` [M, K] @ (``codes`` [N, K] e4m3 row-major · ``scale`` [N]).T + ``bias`` → [M, N] in x's dtype, by the
    Triton kernel (tensor cores on CUDA; fp32 in Triton's interpreter elsewhere)."""
    m, k = x.shape
    n = codes.shape[0]
    if codes.shape[1] != k or codes.stride(1) != 1 or codes.dtype != FP8_DTYPE or scale.numel() != n:
        raise ValueError(f"w8a16_matmul: x {tuple(x.shape)}, codes {codes.dtype} {tuple(codes.shape)} strides "
                         f"{codes.stride()}, scale {tuple(scale.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or default_config(m, n, k)
    block_m = (1 if m == 1 else 2 if m == 2 else 4) if cfg.gemv else 16 if m <= 16 else 32 if m <= 32 else 64
    k_per_split = -(-k // (cfg.split_k * cfg.block_k)) * cfg.block_k
    split = -(-k // k_per_split)  # splits that hold any K (the last ones may be empty otherwise)
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    part = torch.empty((split, m, n), device=x.device, dtype=torch.float32) if split > 1 else out
    scale = scale.reshape(-1)
    has_bias = bias is not None
    w8a16, w8a16_swapped, reduce_splits = _kernels()
    grid = (-(-n // cfg.block_n), split, -(-m // block_m))
    kernel, form = (w8a16_swapped, {}) if cfg.swap else (w8a16, {"GEMV": cfg.gemv})
    kernel[grid](x, codes.view(torch.uint8), scale, bias if has_bias else scale, out, part, m, n, k, k_per_split,
                x.stride(0), codes.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, PARTIAL=split > 1, HAS_BIAS=has_bias, EVEN_K=k % k_per_split == 0,
                DOT_BF16=x.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **form)
    if split > 1:
        block = 1024
        reduce_splits[(-(-n // block), m)](part, scale, bias if has_bias else scale, out, m, n, split, out.stride(0),
                                           BLOCK=block, HAS_BIAS=has_bias, num_warps=4)
    return out


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


GEMV_ONLY = False


def candidates(m: int, n: int, k: int) -> list[KernelConfig]:
    """Launch shapes worth timing: x as the first operand with 32-64 output columns per tile, or the weights first
    (``swap``) with 64-128; K steps of 128-512, 3-6 pipeline stages within the H200's shared memory, and K splits
    from none up to the one that gives ~1,000 programs."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    out = []
    shapes = [(False, bn, bk, st) for bn, bk, st in itertools.product((32, 64), (256, 512) if m <= 16 else (128, 256),
                                                                        (3, 4))]
    shapes += [(True, bn, bk, st) for bn, bk, st in itertools.product((64, 128), (128, 256, 512), (3, 4, 6))]
    if GEMV_ONLY:
        shapes = []
    for swap, bn, bk, stages in shapes:
        if stages * (block_m * bk * 2 + bk * bn * 3) > 200_000:  # codes, and their bf16 copy
            continue
        tiles = -(-n // bn)
        for split in (1, 2, 4, 8, 16):
            if split > 1 and (tiles * split > 1024 or k < 2 * split * bk):
                continue
            for warps in ((4, 8) if swap or bn * bk >= 32768 else (4,)):
                out.append(KernelConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages,
                                        swap=swap))
    if m <= 4:  # fp32 FMAs without tensor cores: for the smallest batches only
        for bn, bk, warps, stages in itertools.product((4, 8, 16), (512, 1024), (4, 8), (1, 3)):
            if bn * bk > 16384 or bn * bk < 2048 * warps // 4:
                continue
            tiles = -(-n // bn)
            for split in (1, 2, 4, 8):
                if split > 1 and (tiles * split > 4096 or k < 2 * split * bk):
                    continue
                out.append(KernelConfig(block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages,
                                        gemv=True))
    return out


def measure(name: str, w: torch.Tensor, m: int, deadline: float) -> dict:
    """One linear [out, in] at batch m: bf16, W8A8 and the weight-only kernel (its default launch shape and the
    fastest of :func:`candidates`) in µs, with their errors against float64."""
    n, k = w.shape
    codes, scale = quantize_rows(w)
    codes_t, scale_row = codes.t(), scale.view(1, n)  # vLLM's view: [in, out], column-major
    x = torch.randn(m, k, device=w.device, dtype=torch.bfloat16)
    ref = reference(x, codes, scale)

    def rel_err(got: torch.Tensor) -> float:
        return ((got.double() - ref).abs().max() / ref.abs().max()).item()

    default = default_config(m, n, k)
    row = {"name": name, "out": n, "in": k, "m": m, "bf16_us": graph_us(lambda: torch.nn.functional.linear(x, w)),
           "default_config": default.__dict__,
           "default_us": graph_us(lambda: w8a16_matmul(x, codes, scale)),
           "default_rel_err": rel_err(w8a16_matmul(x, codes, scale))}
    timed = []
    for cfg in candidates(m, n, k):
        if time.perf_counter() > deadline:
            row["sweep_cut_short"] = True
            break
        try:
            err = rel_err(w8a16_matmul(x, codes, scale, config=cfg))
        except Exception as exc:  # a tile too large for shared memory at this batch: not a candidate
            if "out of resource" not in str(exc):
                raise
            continue
        timed.append((graph_us(lambda cfg=cfg: w8a16_matmul(x, codes, scale, config=cfg)), cfg, err))
    timed.sort(key=lambda t: t[0])
    best = timed[0] if timed else (row["default_us"], default, row["default_rel_err"])
    row.update(w8a16_us=best[0], w8a16_config=best[1].__dict__, w8a16_rel_err=best[2],
               w8a16_tb_per_s=n * k / best[0] / 1e6, top5=[(t[0], t[1].__dict__) for t in timed[:5]],
               configs_timed=len(timed))
    try:  # torch's row-wise FP8 matmul may refuse a shape
        row["w8a8_us"] = graph_us(lambda: w8a8_linear(x, codes_t, scale_row))
        row["w8a8_rel_err"] = rel_err(w8a8_linear(x, codes_t, scale_row))
    except RuntimeError as exc:
        row["w8a8_us"], row["w8a8_error"] = float("nan"), str(exc)[:200]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="7b,1.5b")
    ap.add_argument("--batches", default="1,4,8,16,32,64")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop sweeping launch shapes after this long")
    ap.add_argument("--gemv-only", action="store_true", help="time only the tensor-core-free kernel")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    global GEMV_ONLY
    GEMV_ONLY = args.gemv_only
    torch.manual_seed(0)
    device = torch.device("cuda")
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shapes": {mdl: SHAPES[mdl] for mdl in models}, "layers": LAYERS, "rows": []}
    t0 = time.perf_counter()
    n_rows = len(batches) * sum(len(SHAPES[mdl]) for mdl in models)
    for mdl in models:
        for name, n, k in SHAPES[mdl]:
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            for m in batches:
                done = len(result["rows"])
                share = (args.budget_s - (time.perf_counter() - t0)) / max(1, n_rows - done)
                row = measure(name, w, m, time.perf_counter() + share)
                row["model"] = mdl
                result["rows"].append(row)
                print(json.dumps({key: val for key, val in row.items() if key != "top5"}), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(result, indent=1))
    per_step = {}
    for mdl in models:
        for m in batches:
            rows = [r for r in result["rows"] if r["m"] == m and r["model"] == mdl]
            per_step[f"{mdl}/{m}"] = {kind: LAYERS * sum(r[f"{kind}_us"] for r in rows)
                                      for kind in ("bf16", "w8a8", "w8a16", "default")}
    result["per_step_us"] = per_step
    result["seconds"] = time.perf_counter() - t0
    print(json.dumps({"per_step_us": per_step}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
