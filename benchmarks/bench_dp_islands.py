"""The data-parallel gradient sync, flat and across islands (parallel.dp_hierarchy), side by side on real links.

    torchrun --nnodes 2 --nproc-per-node 8 ... benchmarks/bench_dp_islands.py --model CONFIG.json --layers 8 \
        --out dp_islands.json                                      # islands = nodes (the default island size)
    torchrun --nproc-per-node 8 benchmarks/bench_dp_islands.py --model CONFIG.json --island-ranks 4
                                                                   # one node cut into two islands of 4 GPUs
    torchrun --nproc-per-node 4 benchmarks/bench_dp_islands.py --tiny   # CPU (gloo): the tiny model, islands of 2

For each mode (flat; islands with fp32, bf16 and fp8 between them) the script builds the model of ``--model``
(random weights, ``--layers`` of its layers) under MegatronEngine (DDP, distributed optimizer) at tensor
parallelism ``--tp``, fills every rank's gradient buffer with the same values in every mode (random, seeded by rank,
magnitudes spread over e^±8), and times Megatron's gradient sync (``finish_grad_sync``: reduce-scatter, and with
islands the step between them) and the parameter all-gather (``start_param_sync``) separately, the median of
``--iters``. It reports the bytes the planner's model (verl_mega/planning/dp_sync.py) predicts per GPU, and each
mode's reduced gradients against the flat fp32 ones: the norm of the difference relative to the norm, and the
largest difference relative to the largest value. Prints a table and writes one JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

MODES = (("flat", "fp32"), ("islands", "fp32"), ("islands", "bf16"), ("islands", "fp8"))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()


def _fill(engine, rank: int) -> None:
    """The same gradients in every mode: per parameter, seeded by (rank, its index)."""
    from verl_mega.models.loader import unwrap

    chunk = engine.chunks[0]
    index = {p: i for i, p in enumerate(unwrap(chunk).parameters())}
    for buf in chunk.buffers:
        buf.grad_data.zero_()
        for param, (lo, hi, _) in buf.param_index_map.items():
            g = torch.Generator().manual_seed(1_000_003 * rank + index[param])
            n = hi - lo
            values = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
            buf.grad_data[lo:hi].copy_(values)


def _reduced(engine, groups) -> dict[int, torch.Tensor]:
    """Every parameter's reduced gradient (each rank's shard gathered over the optimizer's group), on the host."""
    from verl_mega.models.loader import unwrap

    chunk = engine.chunks[0]
    index = {p: i for i, p in enumerate(unwrap(chunk).parameters())}
    group = groups["intra_dp" if groups.pool.dp_islands > 1 else "dp"]
    k, me = dist.get_world_size(group), dist.get_rank(group)
    out = {}
    for buf in chunk.buffers:
        for bucket in buf.buckets:
            full = torch.empty_like(bucket.grad_data)
            dist.all_gather_into_tensor(full, bucket.grad_data.view(k, -1)[me].contiguous(), group=group)
            for param in bucket.params:
                lo, hi, _ = buf.param_index_map[param]
                out[index[param]] = full[lo - bucket.offset:hi - bucket.offset].float().cpu()
    return out


def run_mode(mode: str, dtype: str, args, arch, island: int) -> tuple[dict, dict[int, torch.Tensor]]:
    from megatron.core.optimizer import OptimizerConfig

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import transformer_config
    from verl_mega.parallel.placement import Placement
    from verl_mega.parallel.state import build_groups, seed_everything
    from verl_mega.planning.dp_sync import pool_dp_sync

    world, rank = dist.get_world_size(), dist.get_rank()
    placement = Placement.single(world, tp=args.tp)
    if mode == "islands":
        placement = placement.with_dp_hierarchy("node", island, dtype)
    groups = build_groups(placement)
    seed_everything(1, groups)
    cuda = torch.cuda.is_available()
    dtype_name = "bfloat16" if cuda else "float32"
    tcfg = transformer_config(arch, tp=args.tp, sequence_parallel=args.tp > 1, dtype=dtype_name,
                              use_cpu_initialization=not cuda)
    chunks = build_model_chunks(arch, tcfg, groups, use_te="false")
    if cuda:
        chunks = [c.cuda() for c in chunks]
    optim = OptimizerConfig(optimizer="adam", lr=1e-5, bf16=cuda, params_dtype=tcfg.params_dtype,
                            use_distributed_optimizer=True)
    engine = MegatronEngine(chunks, tcfg, groups, optimizer_config=optim)
    chunk = engine.chunks[0]
    pool = groups.pool
    grad_times, gather_times = [], []
    for it in range(args.warmup + args.iters):
        _fill(engine, rank)
        _sync()
        start = time.perf_counter()
        chunk.finish_grad_sync()
        _sync()
        middle = time.perf_counter()
        chunk.start_param_sync(force_sync=True)
        _sync()
        if it >= args.warmup:
            grad_times.append(middle - start)
            gather_times.append(time.perf_counter() - middle)
    _fill(engine, rank)
    chunk.finish_grad_sync()
    reduced = _reduced(engine, groups)
    elems = sum(b.grad_data.numel() for b in chunk.buffers)
    dense, _ = pool_dp_sync(pool, dense=elems, param_bytes=chunk.buffers[0].param_data.element_size(),
                            island_gpus=island)
    row = {"mode": mode, "cross_island_dtype": dtype, "dp": pool.dp, "islands_per_dp_group": pool.dp_islands,
           "island_ranks": island, "grad_elems_per_rank": elems, "grad_sync_ms": 1e3 * statistics.median(grad_times),
           "param_gather_ms": 1e3 * statistics.median(gather_times),
           "predicted_bytes_per_gpu": dense.sent_bytes, "predicted_cross_island_bytes_per_gpu": dense.cross_bytes}
    del engine, chunks, chunk
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row, reduced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tests/fixtures/hf_configs/qwen2.5-1.5b.json", help="HF config.json")
    ap.add_argument("--layers", type=int, default=None, help="keep this many layers (memory)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--island-ranks", type=int, default=None, help="ranks per island (default: the node's ranks)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the bundled tiny model, islands of 2 ranks")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from verl_mega.models.hf_config import arch_from_hf, load_hf_config
    from verl_mega.parallel.state import init_world

    if args.tiny:
        os.environ.setdefault("VERL_MEGA_FORCE_CPU", "1")
    init_world(timeout_s=300)
    if args.tiny:
        from verl_mega.config import load_config
        from verl_mega.trainer import setup

        root = Path(__file__).resolve().parents[1]
        path = setup.resolve_model_path(load_config(str(root / "configs" / "quickstart_cpu.yaml"), []))
        arch = setup.model_arch(path)
        args.island_ranks = args.island_ranks or 2
        args.iters, args.warmup = min(args.iters, 3), 1
    else:
        arch = arch_from_hf(load_hf_config(args.model))
    if args.layers:
        arch = dataclasses.replace(arch, num_layers=args.layers)
    island = args.island_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    rows, reference = [], None
    for mode, dtype in MODES:
        row, reduced = run_mode(mode, dtype, args, arch, island)
        if reference is None:
            reference = reduced
        diff = torch.cat([(reduced[i] - reference[i]).double() for i in sorted(reference)])
        ref = torch.cat([reference[i].double() for i in sorted(reference)])
        row["error_vs_fp32_norm"] = float(diff.norm() / ref.norm())
        row["error_vs_fp32_max"] = float(diff.abs().max() / ref.abs().max())
        rows.append(row)
    if dist.get_rank() == 0:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (gloo)"
        print(f"{device}, world {dist.get_world_size()}, tp={args.tp}, islands of {island} ranks, "
              f"{rows[0]['grad_elems_per_rank']:,} gradient values per rank")
        print(f"{'mode':<16}{'grad sync ms':>14}{'param AG ms':>13}{'total ms':>10}{'MiB/GPU':>10}"
              f"{'MiB across':>12}{'err (norm)':>12}{'err (max)':>11}")
        for r in rows:
            name = r["mode"] + ("" if r["mode"] == "flat" else f" {r['cross_island_dtype']}")
            print(f"{name:<16}{r['grad_sync_ms']:>14.2f}{r['param_gather_ms']:>13.2f}"
                  f"{r['grad_sync_ms'] + r['param_gather_ms']:>10.2f}{r['predicted_bytes_per_gpu'] / 2**20:>10.1f}"
                  f"{r['predicted_cross_island_bytes_per_gpu'] / 2**20:>12.1f}{r['error_vs_fp32_norm']:>12.2e}"
                  f"{r['error_vs_fp32_max']:>11.2e}")
        result = {"device": device, "world": dist.get_world_size(), "tp": args.tp, "island_ranks": island,
                  "model": "tiny" if args.tiny else args.model, "layers": arch.num_layers, "modes": rows}
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    main()
