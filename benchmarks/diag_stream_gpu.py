"""Where does generation time go when the trainer steps vLLM and scores finished samples beside it?

One vLLM engine, one process, the same requests in every mode (long-tailed lengths forced per request, EOS
ignored), generation only (no Megatron):

- ``generate``: ``VLLMRollout.generate`` (vLLM's own loop);
- ``step``: :class:`StreamingEngine` stepped by this script, nothing else;
- ``step+thread-idle``: the same with a second Python thread blocked on a queue;
- ``step+busy``: the same with a thread that spends ``--busy-us`` of Python work every millisecond;
- ``step+score``: every finished prompt's samples go to a scoring thread that decodes them and scores them in
  the reward pool (worker processes), as ``rollout.stream_scoring=reward`` does, at a GIL switch interval of
  ``--gil-ms``;
- ``step+score-inline``: the same scoring, called in the stepping thread between engine steps (no thread);
- ``step+score-async``: the scoring thread decodes each finished batch and hands it to the pool without waiting
  (``pool.submit``), collecting every score after generation, as ``rollout.stream_scoring=reward`` now does;

``--reward-delay-ms`` makes the reward wait that long per sample (benchmarks/slow_reward.py), ``--workers`` sets the
pool's processes; ``rollout-end s`` is when generation ended and ``scored s`` when the last score arrived.

Each mode reports seconds, engine steps and the distribution of one engine step's wall time.

    python benchmarks/diag_stream_gpu.py --json diag.json                       # one GPU, 1.5B random weights
    python benchmarks/diag_stream_gpu.py --model tiny --prompts 4 --high 64     # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_streaming import model_dir, sync  # noqa: E402
from long_tail import LengthDist, force_lengths  # noqa: E402

MODES = ("generate", "step", "step+thread-idle", "step+busy", "step+score", "step+score-inline", "step+score-async")


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"p50_ms": pick(0.5) * 1e3, "p90_ms": pick(0.9) * 1e3, "p99_ms": pick(0.99) * 1e3,
            "mean_ms": statistics.fmean(v) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["tiny", "qwen2.5-1.5b"], default="qwen2.5-1.5b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--median", type=int, default=128)
    ap.add_argument("--high", type=int, default=4096)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--gil-ms", type=float, default=0.5, help="GIL switch interval while scoring (step+score*)")
    ap.add_argument("--busy-us", type=float, default=200.0)
    ap.add_argument("--workers", type=int, default=4, help="reward worker processes")
    ap.add_argument("--reward-delay-ms", type=float, default=0.0, help="a reward that waits this long per sample")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from verl_mega.rewards.pool import RewardPool
    from verl_mega.rollout.streaming import StreamingEngine
    from verl_mega.rollout.base import SamplingSpec
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    force_lengths(LengthDist(args.median, 1.0, 1, args.high))
    root = Path(tempfile.mkdtemp(prefix="diag_stream_"))
    path, dtype = model_dir(args.model, root)
    gpu = torch.cuda.is_available()
    rollout = VLLMRollout(VLLMRolloutConfig(
        model_path=str(path), dtype=dtype, load_format="dummy" if args.model != "tiny" else "auto",
        max_model_len=args.prompt_len + args.high + 8, max_num_seqs=args.prompts * args.n,
        gpu_memory_utilization=0.5, kv_cache_memory_bytes=None if gpu else 512 << 20))
    vocab = 151_936 if args.model != "tiny" else 60
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    spec = SamplingSpec(n=args.n, max_tokens=args.high, temperature=1.0, seed=1234, logprobs=True)
    rollout.generate(prompts[:2], spec)  # warm-up outside the timings
    import os

    os.environ["VERL_MEGA_REWARD_DELAY_MS"] = str(args.reward_delay_ms)  # read by the spawned workers
    slow = Path(__file__).resolve().parent / "slow_reward.py"
    pool = RewardPool(f"{slow}:score" if args.reward_delay_ms else "arithmetic", num_workers=args.workers)
    from transformers import AutoTokenizer

    detok = AutoTokenizer.from_pretrained(path)  # the trainer decodes every finished sample before scoring it

    def text(ids: list[int]) -> str:
        return detok.decode(ids)

    def score(done: list[list[int]]) -> None:
        pool.score([text(ids) for ids in done], ["0"] * len(done))

    submitted: list = []

    def submit(done: list[list[int]]) -> None:
        submitted.append(pool.submit([text(ids) for ids in done], ["0"] * len(done)))

    def run(mode: str) -> dict:
        if mode == "generate":
            sync()
            start = time.perf_counter()
            out = rollout.generate(prompts, spec)
            sync()
            return {"seconds": time.perf_counter() - start, "tokens": sum(map(len, out.token_ids))}
        stream = StreamingEngine(rollout, deltas=False)
        inbox: queue.Queue = queue.Queue()
        stop = threading.Event()
        thread = None
        old_interval = sys.getswitchinterval()
        submitted.clear()
        if mode in ("step+thread-idle", "step+score", "step+score-async"):
            def consume() -> None:
                while (item := inbox.get()) is not None:
                    if mode == "step+score":
                        score(item)
                    elif mode == "step+score-async":
                        submit(item)
            thread = threading.Thread(target=consume, daemon=True)
        elif mode == "step+busy":
            def busy() -> None:
                while not stop.is_set():
                    until = time.perf_counter() + args.busy_us * 1e-6
                    x = 0
                    while time.perf_counter() < until:
                        x += 1
                    time.sleep(max(0.0, 1e-3 - args.busy_us * 1e-6))
            thread = threading.Thread(target=busy, daemon=True)
        if mode.startswith("step+score"):
            sys.setswitchinterval(args.gil_ms * 1e-3)
        if thread is not None:
            thread.start()
        step_s: list[float] = []
        sync()
        start = time.perf_counter()
        stream.add("b", prompts, spec)
        steps = 0
        while stream.busy:
            t0 = time.perf_counter()
            stream.step()
            step_s.append(time.perf_counter() - t0)
            steps += 1
            if stream.finished:
                done = [stream.completion(key, p, j)[0] for key, p, j in stream.finished]
                if mode == "step+score-inline":
                    score(done)
                elif thread is not None and mode != "step+busy":
                    inbox.put(done)
        sync()
        seconds = time.perf_counter() - start
        stop.set()
        inbox.put(None)
        if thread is not None:
            thread.join()
        for future in submitted:
            future.result()
        scored = time.perf_counter() - start
        sys.setswitchinterval(old_interval)
        tokens = sum(map(len, stream.take("b").token_ids))
        return {"seconds": seconds, "scored_s": scored, "tokens": tokens, "engine_steps": steps,
                **percentiles(step_s)}

    results: dict[str, list[dict]] = {m: [] for m in args.modes.split(",")}
    for _ in range(args.repeats):
        for mode in results:
            results[mode].append(run(mode))
            r = results[mode][-1]
            print(f"{mode:<20} {r['seconds']:8.2f} s {r['tokens']:8d} tok {r['tokens'] / r['seconds']:9.0f} tok/s "
                  f"steps {r.get('engine_steps', '-')!s:>6} p50 {r.get('p50_ms', 0):6.2f} ms "
                  f"p90 {r.get('p90_ms', 0):6.2f} ms p99 {r.get('p99_ms', 0):6.2f} ms "
                  f"scored {r.get('scored_s', r['seconds']):7.2f} s", flush=True)
    pool.close()
    if args.json:
        import vllm

        args.json.write_text(json.dumps({
            "args": {k: str(v) for k, v in vars(args).items()},
            "device": torch.cuda.get_device_name() if gpu else "cpu", "vllm": vllm.__version__,
            "torch": torch.__version__, "modes": results}, indent=1))


if __name__ == "__main__":
    main()
