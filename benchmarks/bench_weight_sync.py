"""Train→generate switch and rollout throughput of the 3D-HybridEngine on GPUs (Llama-2-7B architecture).

Run one layout per launch (2 GPUs):
    torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py --tp 2 --gen-tp 2 --out sync_t2_tg2.json
    torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py --tp 2 --gen-tp 1 --out sync_t2_tg1.json

Megatron holds random bf16 weights (its own init); vLLM starts with ``load_format="dummy"``, so nothing is
downloaded. Per repeat and path (``inplace`` = ours, ``reference`` = full HF tensors through vLLM's loader), in
the same process: sleep (level 2) → wake weights → sync → wake KV cache, timed with CUDA syncs. A floor is
measured too: one in-place copy of every vLLM parameter from a same-shaped buffer. Throughput: B prompts × n
tokens through our rollout layer vs ``vllm.LLM.generate`` with identical sampling parameters, alternating.
Rank 0 prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


def write_config(directory: Path, layers: int | None) -> Path:
    cfg = dict(LLAMA2_7B)
    if layers:
        cfg["num_hidden_layers"] = layers
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def cuda_time(fn) -> tuple[float, object]:
    """Milliseconds of ``fn()`` between device syncs (plain wall time on a CPU-only machine), and its result."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return (time.perf_counter() - start) * 1e3, out


def copy_floor_ms(model: torch.nn.Module) -> float:
    """One in-place copy of every vLLM parameter on this rank (the HBM-bandwidth floor of any sync)."""
    params = [p for p in model.parameters() if p.numel()]
    sources = [torch.empty_like(p) for p in params]
    times = []
    for _ in range(5):
        ms, _ = cuda_time(lambda: [p.data.copy_(s) for p, s in zip(params, sources)])
        times.append(ms)
    sources.clear()
    torch.cuda.empty_cache()
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--gen-tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run (default: 32)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--throughput-repeats", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--resident", action="store_true",
                    help="also time the switch with vLLM resident (rollout.free_cache_engine=auto when it fits): "
                         "no sleep or wake, the switch is the weight sync alone")
    ap.add_argument("--out", default="bench_weight_sync.json")
    args = ap.parse_args()

    from vllm import SamplingParams

    from verl_mega.hybrid.producer import WeightProducer, WeightSync
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rollout.base import SamplingSpec
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    groups = init_distributed(tp=args.tp, pp=1, gen_tp=args.gen_tp, seed=1)
    layout = groups.pool
    rank, world = dist.get_rank(), dist.get_world_size()
    model_dir = Path(tempfile.gettempdir()) / f"verl_mega_llama2_7b_arch_{args.layers or 32}"
    if rank == 0:
        write_config(model_dir, args.layers)
    dist.barrier()
    arch = arch_from_hf(load_hf_config(model_dir))
    cfg = transformer_config(arch, tp=args.tp, dtype="bfloat16")
    chunks = [c.cuda() for c in build_model_chunks(arch, cfg, groups, use_te="false")]

    rollout = VLLMRollout(VLLMRolloutConfig(
        model_path=str(model_dir), gen_tp=args.gen_tp, dtype="bfloat16", load_format="dummy",
        max_model_len=args.prompt_len + args.max_tokens + 8, max_num_seqs=args.batch,
        gpu_memory_utilization=args.gpu_memory_utilization, sleep_level=2, enable_prefix_caching=False,
    ), rank_order=layout.vllm_rank_order(), engine_index=groups.coords["engine"])
    producer = WeightProducer(groups=groups, arch=arch, chunks=chunks)
    syncs = {mode: WeightSync(producer, rollout, mode=mode) for mode in ("inplace", "reference")}
    floor = copy_floor_ms(rollout.model)

    rows: dict[str, list[dict]] = {mode: [] for mode in syncs}
    for sync in syncs.values():  # warm-up: first-touch allocations, NCCL communicators
        sync.sync()
    for _ in range(args.repeats):
        for mode, sync in syncs.items():
            rollout.sleep()
            dist.barrier()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            wake_w, _ = cuda_time(lambda: rollout.wake_up(["weights"]))
            sync_ms, metrics = cuda_time(sync.sync)
            peak_extra = torch.cuda.max_memory_allocated() - base
            wake_kv, _ = cuda_time(lambda: rollout.wake_up(["kv_cache"]))
            rows[mode].append({"wake_weights_ms": wake_w, "sync_ms": sync_ms, "wake_kv_ms": wake_kv,
                               "switch_ms": wake_w + sync_ms + wake_kv, "peak_extra_bytes": peak_extra,
                               "bytes_received": metrics["weight_sync/bytes_received"]})

    if args.resident:  # vLLM never sleeps: its weights and KV cache stay mapped beside the training state
        rollout.wake_up()
        for mode, sync in syncs.items():
            rows[f"{mode}_resident"] = []
            for _ in range(args.repeats):
                dist.barrier()
                sync_ms, metrics = cuda_time(sync.sync)
                rows[f"{mode}_resident"].append({"wake_weights_ms": 0.0, "sync_ms": sync_ms, "wake_kv_ms": 0.0,
                                                 "switch_ms": sync_ms, "peak_extra_bytes": 0,
                                                 "bytes_received": metrics["weight_sync/bytes_received"]})

    throughput = {}
    if not args.skip_throughput:
        g = torch.Generator().manual_seed(rank // args.gen_tp)  # same prompts inside one engine
        prompts = [torch.randint(10, arch.vocab_size, (args.prompt_len,), generator=g).tolist()
                   for _ in range(args.batch)]
        spec = SamplingSpec(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
        raw_params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True,
                                    logprobs=0, detokenize=False)
        raw_prompts = [{"prompt_token_ids": p} for p in prompts]
        times: dict[str, list[float]] = {"ours": [], "raw_vllm": []}
        rollout.generate(prompts[:8], SamplingSpec(max_tokens=8))  # warm-up
        for _ in range(args.throughput_repeats):
            dist.barrier()
            ms, _ = cuda_time(lambda: rollout.generate(prompts, spec))
            times["ours"].append(ms)
            dist.barrier()
            ms, _ = cuda_time(lambda: rollout.llm.generate(raw_prompts, raw_params, use_tqdm=False))
            times["raw_vllm"].append(ms)
        tokens = args.batch * args.max_tokens
        throughput = {k: {"best_ms": min(v), "tokens_per_s": tokens / (min(v) / 1e3)} for k, v in times.items()}
        throughput["overhead"] = throughput["ours"]["best_ms"] / throughput["raw_vllm"]["best_ms"] - 1

    summary = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in rows.items()}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "summary": summary, "floor_ms": floor,
                                      "throughput": throughput})
    if rank == 0:
        report = {
            "layout": layout.describe(), "tp": args.tp, "gen_tp": args.gen_tp, "layers": arch.num_layers,
            "model_bytes": producer.model_bytes(),
            "predicted_bytes_per_rank": layout.sync_bytes_per_rank(producer.model_bytes()),
            "repeats": args.repeats, "batch": args.batch, "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "ranks": gathered,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "rank0_repeats": rows,
        }
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"\n{layout.describe()}  ({arch.num_layers} layers, model {report['model_bytes'] / 1e9:.2f} GB bf16)")
        print(f"{'rank':>4} {'path':>10} {'wake_w ms':>10} {'sync ms':>9} {'wake_kv ms':>10} {'switch ms':>10} "
              f"{'recv MB':>9} {'peak+ MB':>9} {'floor ms':>9}")
        for entry in gathered:
            for mode, s in entry["summary"].items():
                print(f"{entry['rank']:>4} {mode:>10} {s['wake_weights_ms']:>10.2f} {s['sync_ms']:>9.2f} "
                      f"{s['wake_kv_ms']:>10.2f} {s['switch_ms']:>10.2f} {s['bytes_received'] / 1e6:>9.1f} "
                      f"{s['peak_extra_bytes'] / 1e6:>9.1f} {entry['floor_ms']:>9.2f}")
            ratio = entry["summary"]["inplace"]["sync_ms"] / entry["summary"]["reference"]["sync_ms"]
            print(f"{entry['rank']:>4} sync in-place / reference = {ratio:.3f}")
            if entry["throughput"]:
                t = entry["throughput"]
                print(f"{entry['rank']:>4} throughput B={args.batch}: ours {t['ours']['tokens_per_s']:.0f} tok/s, "
                      f"raw vLLM {t['raw_vllm']['tokens_per_s']:.0f} tok/s, overhead {100 * t['overhead']:+.2f}%")
        print(f"JSON written to {os.path.abspath(args.out)}")
    dist.barrier()


if __name__ == "__main__":
    main()
