"""Long-tailed generation on one vLLM engine: batch after batch vs the rollout pool's step-driven engine, and what a
partial-rollout weight swap costs.

Side by side in one process, on the same prompts and the same forced lengths (lognormal, `benchmarks/long_tail.py`,
EOS ignored):

- ``sequential``: ``VLLMRollout.generate`` per batch, as a synchronous loop does; each batch waits for its longest
  sample before the next starts;
- ``streamed``: every batch in :class:`~verl_mega.rollout.streaming.StreamingEngine` at once, as a rollout pool
  running ``max_staleness`` batches ahead holds them;
- ``streamed+swaps``: the same, with new weights every ``--swap-every`` engine steps: the swap copies a staged
  copy of every parameter into vLLM (what a partial rollout does when the trainer's weights have arrived) and
  preempts the running requests, which resume with their KV cache recomputed.

Prints generated tokens/s per mode and the swap's parts; ``--json`` writes them.

    python benchmarks/bench_streaming.py --model qwen2.5-1.5b --json out.json        # GPU
    python benchmarks/bench_streaming.py --model tiny --prompts 8 --median 16 --high 64  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_model_gpu import QWEN25_1_5B  # noqa: E402
from long_tail import LengthDist, force_lengths  # noqa: E402


def model_dir(kind: str, root: Path) -> tuple[Path, str]:
    if kind == "tiny":
        from verl_mega.models.tiny import make_tiny_hf_model

        return make_tiny_hf_model(root / "tiny"), "float32"
    (root / kind).mkdir(parents=True, exist_ok=True)
    (root / kind / "config.json").write_text(json.dumps({**QWEN25_1_5B, "torch_dtype": "bfloat16"}))
    return root / kind, "bfloat16"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "qwen2.5-1.5b"], default="qwen2.5-1.5b")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32, help="prompts per batch")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--median", type=int, default=384)
    ap.add_argument("--high", type=int, default=4096)
    ap.add_argument("--swap-every", type=int, default=256, help="engine steps between weight swaps")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from verl_mega.rollout.streaming import StreamingEngine
    from verl_mega.rollout.base import SamplingSpec
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    force_lengths(LengthDist(args.median, 1.0, 1, args.high))
    root = Path(tempfile.mkdtemp(prefix="bench_streaming_"))
    path, dtype = model_dir(args.model, root)
    gpu = torch.cuda.is_available()
    batch_seqs = args.prompts * args.n
    rollout = VLLMRollout(VLLMRolloutConfig(
        model_path=str(path), dtype=dtype, load_format="dummy" if args.model != "tiny" else "auto",
        max_model_len=args.prompt_len + args.high + 8, max_num_seqs=batch_seqs * args.batches,
        gpu_memory_utilization=0.85, kv_cache_memory_bytes=None if gpu else 512 << 20))
    vocab = QWEN25_1_5B["vocab_size"] if args.model != "tiny" else 60
    g = torch.Generator().manual_seed(0)
    batches = [[torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
               for _ in range(args.batches)]
    specs = [SamplingSpec(n=args.n, max_tokens=args.high, temperature=1.0, seed=1000 * (b + 1))
             for b in range(args.batches)]
    rollout.generate(batches[0][:2], specs[0])  # warm-up outside the timings

    def sequential() -> dict:
        sync()
        start = time.perf_counter()
        tokens = sum(sum(map(len, rollout.generate(p, s).token_ids)) for p, s in zip(batches, specs))
        sync()
        return {"tokens": tokens, "seconds": time.perf_counter() - start}

    staged = [p.detach().clone() for p in rollout.model.parameters()]

    def streamed(swap_every: int | None) -> dict:
        stream = StreamingEngine(rollout)
        swaps, copy_ms, swap_ms = 0, [], []
        sync()
        start = time.perf_counter()
        for b, (p, s) in enumerate(zip(batches, specs)):
            stream.add(b, p, s)
        steps, tokens = 0, 0
        while stream.busy:
            stream.step()
            steps += 1
            if swap_every and steps % swap_every == 0 and stream.busy:
                sync()
                t0 = time.perf_counter()
                with torch.no_grad():
                    for param, new in zip(rollout.model.parameters(), staged):
                        param.copy_(new)
                sync()
                t1 = time.perf_counter()
                stream.weights_changed()
                sync()
                copy_ms.append((t1 - t0) * 1e3)
                swap_ms.append((time.perf_counter() - t1) * 1e3)
                swaps += 1
        sync()
        seconds = time.perf_counter() - start
        for b in range(len(batches)):
            tokens += sum(map(len, stream.take(b).token_ids))
        out = {"tokens": tokens, "seconds": seconds, "engine_steps": steps}
        if swap_every:
            out.update({"swaps": swaps, "copy_ms_median": statistics.median(copy_ms) if copy_ms else 0.0,
                        "preempt_ms_median": statistics.median(swap_ms) if swap_ms else 0.0})
        return out

    results = {"sequential": sequential(), "streamed": streamed(None), "streamed+swaps": streamed(args.swap_every)}
    base = results["sequential"]["tokens"] / results["sequential"]["seconds"]
    print(f"{'mode':<16} {'tokens':>9} {'seconds':>9} {'tokens/s':>10} {'vs sequential':>14}")
    for name, r in results.items():
        r["tokens_per_s"] = r["tokens"] / r["seconds"]
        print(f"{name:<16} {r['tokens']:9d} {r['seconds']:9.2f} {r['tokens_per_s']:10.0f} "
              f"{r['tokens_per_s'] / base:13.2f}x")
    swaps = results["streamed+swaps"]
    if swaps.get("swaps"):
        print(f"{swaps['swaps']} swaps: parameter copy {swaps['copy_ms_median']:.1f} ms, preempt "
              f"{swaps['preempt_ms_median']:.1f} ms (median); the recompute lands in the next engine steps")
    if args.json:
        import vllm

        args.json.write_text(json.dumps({
            "args": vars(args) | {"json": str(args.json)}, "device": torch.cuda.get_device_name() if gpu else "cpu",
            "vllm": vllm.__version__, "torch": torch.__version__, "modes": results}, indent=1))


if __name__ == "__main__":
    main()
