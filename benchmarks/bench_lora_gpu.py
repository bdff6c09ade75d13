"""LoRA against full fine-tuning, side by side on one GPU: optimizer-step time, peak memory and weight-sync time.

A Qwen2.5-7B-architecture model with random bf16 weights (Megatron's own initialisation, vLLM's ``dummy`` load: no
download). Each mode runs in a fresh process, so that one's peak memory cannot hide the other's:

1. the actor engine (Megatron DDP + distributed optimizer, bf16): ``--micro-batches`` × [``--micro-batch``,
   ``--seq-len``] tokens per optimizer step, a cross-entropy loss, ``--steps`` timed steps after one warm-up;
   peak = ``torch.cuda.max_memory_allocated`` over training;
2. an in-process vLLM engine (colocated, ``load_format=dummy``) fed by the 3D-HybridEngine's in-place sync:
   for LoRA the merged weights ``W + s·B·A``, made layer by layer (``--sync-repeats`` timed syncs after one warm-up).

    python benchmarks/bench_lora_gpu.py --out lora_gpu.json                 # both modes, one H200
    python benchmarks/bench_lora_gpu.py --smoke --out lora_cpu.json         # CPU: the tiny model, same code

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "fixtures" / "hf_configs" / "qwen2.5-7b.json"
TINY = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "max_position_embeddings": 512}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def write_config(directory: Path, layers: int | None, smoke: bool) -> Path:
    cfg = json.loads(FIXTURE.read_text())
    cfg.update(TINY if smoke else {})
    if layers:
        cfg["num_hidden_layers"] = layers
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    return directory


def run_mode(args) -> dict:
    from megatron.core.optimizer import OptimizerConfig

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.hybrid.producer import WeightProducer, WeightSync
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.lora import LoRASpec, is_lora_param
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    smoke = args.smoke
    groups = init_distributed(tp=1, pp=1, gen_tp=1, seed=1)
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    dtype = "float32" if smoke else "bfloat16"
    model_dir = write_config(Path(tempfile.gettempdir()) / f"verl_mega_qwen2.5_7b_arch_{'tiny_' if smoke else ''}"
                                                            f"{args.layers or 'all'}", args.layers, smoke)
    arch = arch_from_hf(load_hf_config(model_dir))
    lora = LoRASpec(rank=args.rank, alpha=2.0 * args.rank) if args.mode == "lora" else None
    tcfg = transformer_config(arch, dtype=dtype, use_cpu_initialization=smoke, fused_kernels=not smoke)
    chunks = [c.to(device) for c in build_model_chunks(arch, tcfg, groups, use_te="false", lora=lora)]
    if lora is not None:  # a trained adapter: the sync merges a non-zero B·A
        with torch.no_grad():
            for name, p in chunks[0].named_parameters():
                if ".lora_b_" in name:
                    p.normal_(std=1e-3)
    trainable = sum(p.numel() for p in chunks[0].parameters() if p.requires_grad)
    frozen = sum(p.numel() for n, p in chunks[0].named_parameters() if not is_lora_param(n) and not p.requires_grad)
    engine = MegatronEngine(chunks, tcfg, groups, optimizer_config=OptimizerConfig(
        optimizer="adam", lr=1e-6, bf16=not smoke, params_dtype=tcfg.params_dtype, use_distributed_optimizer=True))
    g = torch.Generator().manual_seed(0)
    mbs = [{"input_ids": (ids := torch.randint(0, arch.vocab_size, (args.micro_batch, args.seq_len), generator=g)),
            "position_ids": torch.arange(args.seq_len).expand_as(ids)} for _ in range(args.micro_batches)]

    def loss_fn(output, mb):
        logits = output[..., :arch.vocab_size].float()
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, arch.vocab_size),
                                                 mb["input_ids"][:, 1:].reshape(-1)), {}

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine.train_step([dict(mb) for mb in mbs], loss_fn)  # warm-up
    step_s = []
    for _ in range(args.steps):
        _sync()
        t0 = time.perf_counter()
        engine.train_step([dict(mb) for mb in mbs], loss_fn)
        _sync()
        step_s.append(time.perf_counter() - t0)
    train_peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    train_resident = torch.cuda.memory_allocated() if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.empty_cache()

    rollout = VLLMRollout(VLLMRolloutConfig(
        model_path=str(model_dir), gen_tp=1, dtype=dtype, load_format="dummy", max_model_len=args.seq_len + 8,
        max_num_seqs=8, gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True,
        kv_cache_memory_bytes=(64 << 20) if smoke else None, sleep_level=2, enable_prefix_caching=False,
    ), rank_order=groups.pool.vllm_rank_order(), engine_index=groups.coords["engine"])
    sync = WeightSync(WeightProducer(groups=groups, arch=arch, chunks=engine.chunks), rollout, mode="inplace")
    sync.sync()  # warm-up
    sync_s, metrics = [], {}
    for _ in range(args.sync_repeats):
        _sync()
        t0 = time.perf_counter()
        metrics = sync.sync()
        _sync()
        sync_s.append(time.perf_counter() - t0)
    return {"mode": args.mode, "rank": args.rank if lora else None, "trainable_params": trainable,
            "frozen_params": frozen, "tokens_per_step": args.micro_batches * args.micro_batch * args.seq_len,
            "step_s_median": statistics.median(step_s), "step_s": step_s,
            "train_peak_gib": train_peak / 2**30 if train_peak is not None else None,
            "train_resident_gib": train_resident / 2**30 if train_resident is not None else None,
            "sync_s_median": statistics.median(sync_s), "sync_s": sync_s,
            "sync_bytes_received": metrics.get("weight_sync/bytes_received"),
            "sync_peak_buffer_bytes": metrics.get("weight_sync/peak_buffer_bytes"),
            "model_bytes": metrics.get("weight_sync/model_bytes")}


def versions() -> dict:
    import megatron.core
    import transformers
    import vllm

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "vllm": vllm.__version__,
            "megatron_core": megatron.core.__version__, "transformers": transformers.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench_lora_gpu.json")
    ap.add_argument("--mode", choices=("both", "lora", "full"), default="both")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2·rank), every projection")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model's 28 (quick runs)")
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--micro-batches", type=int, default=None, help="micro-batches per optimizer step")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--sync-repeats", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--smoke", action="store_true", help="CPU: the tiny model")
    args = ap.parse_args()
    for key, gpu, cpu in (("micro_batch", 1, 2), ("micro_batches", 4, 2), ("seq_len", 4096, 32), ("steps", 5, 2),
                          ("sync_repeats", 3, 2), ("layers", None, 2)):
        if getattr(args, key) is None:
            setattr(args, key, cpu if args.smoke else gpu)
    if args.mode != "both":
        result = run_mode(args)
        Path(args.out).write_text(json.dumps(result))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("full", "lora"):  # each in a process of its own: separate peaks, a fresh vLLM
            out = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, __file__, "--mode", mode, "--out", str(out)] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k not in ("out", "mode", "smoke") and v is not None] + (["--smoke"] if args.smoke else [])
            path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": path})
            rows.append(json.loads(out.read_text()))
    report = {"benchmark": "bench_lora_gpu", "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec="seconds"), "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "model": "tiny qwen2 (smoke)" if args.smoke else "Qwen2.5-7B architecture, random bf16",
              "versions": versions(), "args": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\n{report['model']} on {report['device']}: {rows[0]['tokens_per_step']} tokens per optimizer step")
    print(f"{'mode':<6} {'trainable':>14} {'step s':>9} {'peak GiB':>9} {'resident GiB':>13} {'sync s':>9}")
    for r in rows:
        peak = f"{r['train_peak_gib']:.2f}" if r["train_peak_gib"] is not None else "n/a"
        res = f"{r['train_resident_gib']:.2f}" if r["train_resident_gib"] is not None else "n/a"
        print(f"{r['mode']:<6} {r['trainable_params']:>14,} {r['step_s_median']:>9.3f} {peak:>9} {res:>13} "
              f"{r['sync_s_median']:>9.4f}")
    print(f"JSON written to {Path(args.out).resolve()}")


if __name__ == "__main__":
    main()
