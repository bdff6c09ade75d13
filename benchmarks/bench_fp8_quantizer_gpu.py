"""Where the quantizing weight sync's time goes, without Megatron: one colocated sync's copies of the Qwen2.5-7B
architecture's linears at t = tg = 1 (:func:`~verl_mega.hybrid.convert.block_copies`' pairs: per layer the q, k and v
rows of the interleaved QKV, gate and up, o, down), into bf16 and into e4m3 with per-row scales, each way timed over
the whole model between device syncs.

    python benchmarks/bench_fp8_quantizer_gpu.py --out fp8_quantizer.json

Rows: ``bf16_copy`` (the plain in-place copy), ``fp8_kernel`` (the per-row Triton quantizer, as the sync runs it),
``fp8_eager``, ``fp8_vllm_kernel`` (vLLM's dynamic per-token FP8 op, where vLLM is installed) and ``*_graph`` (the
same calls captured once in a CUDA graph and replayed: the device's own time, no per-call host cost).
``per_call_us_*``: one call on a [4, 256] slice, i.e. the host cost of a call. ``codes_differing_from_eager``: each
FP8 way's codes against the eager quantizer's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from verl_mega.hybrid import fp8
from verl_mega.hybrid.convert import block_copies


def layer_shards(hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, device) -> dict:
    """One layer's Megatron tensors at t = 1 (QKV interleaved by query group, fc1 = [gate; up])."""
    def rand(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16, device=device)
    return {"qkv": rand((heads + 2 * kv_heads) * head_dim, hidden), "gate_up": rand(2 * ffn, hidden),
            "row_o": rand(hidden, heads * head_dim), "row_down": rand(hidden, ffn)}


def copy_pairs(shards: dict, dtype, arch) -> list:
    """The sync's (destination, source) pairs for one layer (:func:`~verl_mega.hybrid.convert.block_copies`), into
    bf16 tensors or :class:`~verl_mega.hybrid.fp8.Fp8Rows` in vLLM's layout."""
    pairs = []
    for name, shard in shards.items():
        rule = SimpleNamespace(kind=name.partition("_")[0] if name.startswith("row") else name)
        weight = torch.empty_like(shard, dtype=dtype)
        dst = fp8.Fp8Rows(weight, torch.empty(shard.shape[0], 1, device=shard.device)) \
            if dtype == fp8.FP8_DTYPE else weight
        pairs += block_copies(rule, dst, [shard], arch)
    return pairs


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def graphed(fn):
    """``fn``'s kernels captured once (after a warm-up on a side stream) and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def codes_differing_from_eager(e4m3: list) -> tuple[list[int], float]:
    """[codes that differ, codes] and the largest relative scale difference of the rows last written into ``e4m3``
    against the eager quantizer."""
    mismatched, total, scale_diff = 0, 0, 0.0
    for dst, src in e4m3:
        ref_dst, ref_scale = torch.empty_like(dst.weight), torch.empty_like(dst.scale)
        fp8.quantize_rows_into(ref_dst, ref_scale, src, kernel=False)
        mismatched += int((ref_dst.view(torch.uint8) != dst.weight.view(torch.uint8)).sum())
        total += ref_dst.numel()
        scale_diff = max(scale_diff, float(((dst.scale - ref_scale).abs() / ref_scale).max()))
    return [mismatched, total], scale_diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_quantizer_gpu.py needs a CUDA GPU")
    dev = torch.device("cuda")
    arch = SimpleNamespace(head_dim=128, q_per_group=7)
    layers = [layer_shards(3584, 28, 4, 128, 18944, dev) for _ in range(args.layers)]
    bf16 = [p for shards in layers for p in copy_pairs(shards, torch.bfloat16, arch)]
    e4m3 = [p for shards in layers for p in copy_pairs(shards, fp8.FP8_DTYPE, arch)]
    calls = len(e4m3)

    def copy():
        for dst, src in bf16:
            dst.copy_(src)

    def quantize(kernel: bool):
        def run():
            for dst, src in e4m3:
                fp8.quantize_rows_into(dst.weight, dst.scale, src, kernel=kernel)
        return run

    def vllm_kernel():
        # vLLM's dynamic per-token (per-row) FP8 quantization: one custom op per slice (scale = amax/448, codes
        # = x · (448/amax)); a strided source is made contiguous first
        op = torch.ops._C.dynamic_per_token_scaled_fp8_quant
        for dst, src in e4m3:
            hidden = src.shape[-1]
            op(dst.weight.view(-1, hidden), src.reshape(-1, hidden), dst.scale.view(-1, 1), None)

    results = {"calls_per_sync": calls, "layers": args.layers, "torch": torch.__version__,
               "device": torch.cuda.get_device_name()}
    variants = {"bf16_copy": copy, "fp8_kernel": quantize(True), "fp8_eager": quantize(False)}
    try:
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C

        variants["fp8_vllm_kernel"] = vllm_kernel
    except Exception as exc:  # noqa: BLE001 - without vLLM the other rows still count
        results["fp8_vllm_kernel_error"] = repr(exc)
    mismatch = {}
    for name, fn in variants.items():
        fn()  # compiles, warms the allocator
        results[name] = timed(fn, args.repeats)
        if name.startswith("fp8") and name != "fp8_eager":
            mismatch[name] = codes_differing_from_eager(e4m3)
    for name in variants:
        try:
            results[f"{name}_graph"] = timed(graphed(variants[name]), args.repeats)
        except Exception as exc:  # noqa: BLE001
            results[f"{name}_graph_error"] = repr(exc)
    small_src = torch.randn(4, 256, dtype=torch.bfloat16, device=dev)
    small_dst = torch.empty(4, 256, dtype=fp8.FP8_DTYPE, device=dev)
    small_scale = torch.empty(4, 1, dtype=torch.float32, device=dev)
    per_call = {"kernel": lambda: fp8.quantize_rows_into(small_dst, small_scale, small_src, kernel=True),
                "eager": lambda: fp8.quantize_rows_into(small_dst, small_scale, small_src, kernel=False)}
    if "fp8_vllm_kernel" in variants:
        op = torch.ops._C.dynamic_per_token_scaled_fp8_quant
        per_call["vllm_kernel"] = lambda: op(small_dst, small_src, small_scale, None)
    for name, call in per_call.items():
        call()  # compiles
        # milliseconds for 1000 calls = microseconds per call
        results[f"per_call_us_{name}"] = timed(lambda call=call: [call() for _ in range(1000)], 1)[0]
    timings = {k: v for k, v in results.items() if isinstance(v, list)}
    results["codes_differing_from_eager"] = {k: v[0] for k, v in mismatch.items()}
    results["max_scale_rel_diff"] = {k: v[1] for k, v in mismatch.items()}
    summary = {k: round(statistics.median(v), 2) for k, v in timings.items()}
    results["median_ms"] = summary
    print(json.dumps({"calls_per_sync": calls, **summary,
                      **{k: v for k, v in results.items()
                         if k.startswith(("per_call", "codes", "max_scale")) or k.endswith("error")}},
                     indent=1))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
