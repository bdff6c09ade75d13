"""Colocated PPO step: scoring after generation (synchronous) vs scoring while vLLM generates (rollout.stream_scoring),
side by side in one run: the same job, engines and weights; every prompt batch runs once in each mode (the order
alternates), with long-tailed response lengths forced per request (lognormal, EOS ignored; a request's length
follows its sampling seed, so both modes generate exactly the same number of tokens).

    # one GPU: a Qwen2.5-1.5B-architecture model with random weights; PPO with critic, reference and a rule reward
    torchrun --nproc-per-node 1 benchmarks/bench_colocated_streaming.py --out streaming.json
    # CPU smoke run on the bundled tiny model
    torchrun --nproc-per-node 2 benchmarks/bench_colocated_streaming.py --tiny --out streaming_cpu.json

Prints a table per mode (mean of the timed steps) and writes every step's metrics as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_grpo_gpu import add_model_args, make_model  # noqa: E402
from long_tail import LengthDist, force_lengths  # noqa: E402

KEYS = ("timing/step_s", "timing/rollout_s", "timing/old_logprob_s", "timing/ref_logprob_s", "timing/values_s",
        "timing/reward_s", "timing/advantage_s", "timing/critic_update_s", "timing/actor_update_s",
        "timing/weight_sync_s", "overlap/efficiency", "overlap/scoring_serial_s", "overlap/scoring_exposed_s",
        "rollout/response_length", "count/tokens", "count/prompt_tokens")


def mean_of(steps: list[dict[str, float]], key: str) -> float:
    vals = [s[key] for s in steps if key in s]
    return sum(vals) / len(vals) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--median", type=int, default=128, help="median response length")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-std of the response lengths")
    ap.add_argument("--cap", type=int, default=4096, help="longest response (rollout.max_response_length)")
    ap.add_argument("--chunk", type=int, default=32, help="rollout.stream_chunk")
    ap.add_argument("--warmup", type=int, default=1, help="prompt batches run in both modes before timing")
    ap.add_argument("--pairs", type=int, default=3, help="timed prompt batches, each run in both modes")
    ap.add_argument("--modes", default="sync,stream",
                    help="comma-separated: sync; stream (rollout.stream_scoring=all); stream-reward "
                         "(rollout.stream_scoring=reward); stream-gil5ms (=all, at Python's default 5 ms GIL switch "
                         "interval instead of the scorer's)")
    ap.add_argument("--reward-delay-ms", type=float, default=0.0,
                    help="a reward function that waits this long per sample (benchmarks/slow_reward.py)")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="extra config overrides for the job")
    args = ap.parse_args()

    from verl_mega.config import load_config
    from verl_mega.trainer import stream_scoring
    from verl_mega.trainer.setup import build_job

    force_lengths(LengthDist(args.median, args.sigma, 1, args.cap))
    os.environ["VERL_MEGA_REWARD_DELAY_MS"] = str(args.reward_delay_ms)  # read by the reward workers
    model_dir = Path(args.model_dir or "/tmp/verl_mega_bench/" + ("tiny-random" if args.tiny
                                                                   else f"qwen2.5-{args.arch}-random-v2"))
    make_model(model_dir, args.tiny, args.arch)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = not torch.cuda.is_available()
    rows = args.prompts * args.group_size
    overrides = [
        f"model.path={model_dir}", f"model.dtype={'float32' if cpu else 'bfloat16'}", "parallel.tp=1",
        "rollout.gen_tp=1", f"rollout.n={args.group_size}", f"rollout.max_response_length={args.cap}",
        f"data.train_batch_size={args.prompts}", "data.max_prompt_length=64", "algorithm.adv_estimator=gae",
        "critic.enable=true", "actor.use_kl_loss=true", "ref.enable=true",
        f"actor.ppo_mini_batch_size={args.prompts}", f"critic.ppo_mini_batch_size={args.prompts}",
        # packed sequences under a token budget: a padded micro-batch would be as wide as the longest sample
        "model.use_remove_padding=true", "actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true",
        "actor.max_tokens_per_gpu=8192", "critic.max_tokens_per_gpu=8192", "actor.micro_batch_size_per_gpu=4",
        "critic.micro_batch_size_per_gpu=4", "actor.log_prob_micro_batch_size_per_gpu=4",
        "ref.micro_batch_size_per_gpu=4",
        "rollout.stream_scoring=all", f"rollout.stream_chunk={args.chunk}", "rollout.free_cache_engine=false",
        f"trainer.total_steps={2 * (args.warmup + args.pairs) + 2}", "trainer.save_every=0", "trainer.resume=off",
        f"trainer.output_dir={Path(args.out).resolve().parent / 'bench_streaming_run'}", "trainer.balance_batch=false",
        "trainer.deterministic=false", "logging.tensorboard=false", "logging.plot=false",
        "logging.progress_bar=false", "actor.lr=1e-6", "critic.lr=1e-6",
    ] + ([f"reward.function={Path(__file__).resolve().parent / 'slow_reward.py'}:score"] if args.reward_delay_ms
         else []) + (["rollout.kv_cache_memory_bytes=268435456", "rollout.enforce_eager=true"] if cpu else
         ["rollout.kv_cache_memory_bytes=null", "rollout.gpu_memory_utilization=0.25",
          "rollout.enforce_eager=false"]) + list(args.overrides)
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/quickstart_cpu.yaml", overrides)
    job = build_job(cfg)
    trainer = job.trainer
    modes = args.modes.split(",")
    steps: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    interval = stream_scoring.GIL_SWITCH_INTERVAL_S
    for i in range(args.warmup + args.pairs):
        batch = job.loader.next_batch()
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:  # each mode leads in turn
            # the same job, scoring after or during rollout
            trainer.stream_scoring = {"sync": "off", "stream-reward": "reward"}.get(mode, "all")
            stream_scoring.GIL_SWITCH_INTERVAL_S = 0.005 if mode == "stream-gil5ms" else interval
            metrics = trainer.step(batch)
            if dist.get_rank() == 0:
                print(f"batch {i} {mode}: step {metrics['timing/step_s']:.2f}s rollout "
                      f"{metrics['timing/rollout_s']:.2f}s overlap {metrics.get('overlap/efficiency', 0.0):.3f} "
                      f"tokens {metrics['count/tokens']:.0f}", flush=True)
            if i >= args.warmup:
                steps[mode].append(metrics)
    trainer.stream_scoring = "all"
    if dist.get_rank() == 0:
        summary = {}
        for mode, ms in steps.items():
            s = {k: mean_of(ms, k) for k in KEYS}
            tokens = s["count/tokens"] + s["count/prompt_tokens"]
            s["tokens_per_s_per_gpu"] = tokens / s["timing/step_s"] / world
            s["generated_tokens_per_s_per_gpu"] = s["count/tokens"] / s["timing/step_s"] / world
            summary[mode] = s
        result = {"world": world, "device": "cpu" if cpu else torch.cuda.get_device_name(), "rows": rows,
                  "lengths": {"median": args.median, "sigma": args.sigma, "cap": args.cap}, "chunk": args.chunk,
                  "overrides": list(args.overrides), "summary": summary,
                  "speedup": {m: summary[modes[0]]["timing/step_s"] / summary[m]["timing/step_s"] for m in modes},
                  "steps": steps}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"{'mean per step':<34}" + "".join(f"{mode:>15}" for mode in modes))
        for key in KEYS + ("tokens_per_s_per_gpu", "generated_tokens_per_s_per_gpu"):
            print(f"{key:<34}" + "".join(f"{summary[mode][key]:>15.3f}" for mode in modes))
        for mode in modes[1:]:
            print(f"{mode} vs {modes[0]} (step time): {result['speedup'][mode]:.3f}x")
    job.close()


if __name__ == "__main__":
    main()
