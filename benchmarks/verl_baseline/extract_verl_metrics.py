"""Summarise a verl run's per-step metrics (its 'file' logger JSONL, else the console lines 'step:N - key:value - ...')
into one JSON: means over the timed steps (warm-up steps dropped) of verl's throughput and stage timings; with
``--ours`` (a ``bench_grpo_gpu.py`` JSON of the same workload), the ratios to verl_mega's measured figures."""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
from pathlib import Path

KEYS = [
    "perf/throughput", "perf/time_per_step", "perf/total_num_tokens", "perf/mfu/actor", "perf/mfu/actor_infer",
    "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb", "perf/cpu_memory_used_gb",
    "timing_s/step", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv",
    "timing_s/update_actor", "timing_s/update_weights", "timing_s/start_profile",
    "response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio",
    "prompt_length/mean", "critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr",
]
def _from_jsonl(path: Path) -> dict[int, dict]:
    steps = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            steps.setdefault(int(rec["step"]), {}).update(rec["data"])
    return steps


def _from_log(path: Path) -> dict[int, dict]:
    steps = {}
    for line in path.read_text(errors="replace").splitlines():
        m = re.search(r"step:(\d+) - (.*)$", line)
        if not m:
            continue
        data = {}
        for part in m.group(2).split(" - "):
            k, _, v = part.rpartition(":")
            v = re.sub(r"^np\.\w+\((.*)\)$", r"\1", v.strip())  # numpy 2 scalars print as np.float64(1.0)
            try:
                data[k.strip()] = float(ast.literal_eval(v))
            except (ValueError, SyntaxError, TypeError):
                pass
        if data:
            steps.setdefault(int(m.group(1)), {}).update(data)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--n-gpus", type=int, default=2)
    ap.add_argument("--rc", type=int, default=None)
    ap.add_argument("--setup", default="")
    ap.add_argument("--ours", default=None, help="verl_mega's bench_grpo_gpu.py JSON of the same workload")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    source, steps = None, {}
    if Path(args.metrics).is_file():
        source, steps = "file_logger", _from_jsonl(Path(args.metrics))
    if not steps and args.log and Path(args.log).is_file():
        source, steps = "console_log", _from_log(Path(args.log))
    order = sorted(steps)
    timed = order[args.warmup:] if len(order) > args.warmup else order
    result = {"verl_exit_code": args.rc, "setup": args.setup, "metrics_source": source, "steps_logged": order,
              "timed_steps": timed, "n_gpus": args.n_gpus}
    if timed:
        mean = {}
        for k in KEYS:
            vals = [steps[s][k] for s in timed if isinstance(steps[s].get(k), (int, float))]
            if vals:
                mean[k] = statistics.fmean(vals)
        result["mean"] = mean
        step_s = mean.get("timing_s/step") or mean.get("perf/time_per_step")
        tokens = mean.get("perf/total_num_tokens")
        resp = mean.get("response_length/mean")
        samples = None
        if tokens and resp is not None and "prompt_length/mean" in mean:
            samples = tokens / (resp + mean["prompt_length/mean"])
        derived = {"step_s": step_s, "tokens_per_s_per_gpu": mean.get("perf/throughput"),
                   "samples_per_step": samples}
        if samples and resp and mean.get("timing_s/gen"):
            derived["generation_tokens_per_s"] = samples * resp / mean["timing_s/gen"]
        if step_s and args.ours:
            ours = json.loads(Path(args.ours).read_text())["hybrid"]
            derived["verl_mega_step_s"] = ours["step_s"]
            derived["verl_mega_tokens_per_s_per_gpu"] = ours["tokens_per_s_per_gpu"]
            derived["step_time_ratio_verl_over_verl_mega"] = step_s / ours["step_s"]
        result["derived"] = derived
        result["per_step"] = {s: {k: steps[s][k] for k in KEYS if k in steps[s]} for s in order}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result.get(k) for k in ("verl_exit_code", "metrics_source", "timed_steps", "derived")}))
    for k, v in result.get("mean", {}).items():
        if k.startswith(("timing_s/", "perf/")):
            print(f"  {k:<34}{v:12.3f}")


if __name__ == "__main__":
    main()
