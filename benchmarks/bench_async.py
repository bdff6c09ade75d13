"""Synchronous colocated vs a rollout pool of its own (max_staleness 0 and 1), side by side on the same ranks.

Runs ``python -m verl_mega.train`` three times, one after the other, on ``--nproc`` processes of this machine:

- ``colocated``: the recipe as written (every rank trains and generates, data-parallel);
- ``pools-s0``: the first half of the ranks train, the second half generate, synchronously;
- ``pools-s1``: the same pools, one step off-policy;
- ``pools-s2-partial``: the same pools, two steps ahead with partial rollouts (weights swapped into running
  requests).

``--long-tail MEDIAN,HIGH`` forces every request to its own lognormal length (sigma 1, at most HIGH tokens; see
benchmarks/long_tail.py), the same in every mode.

and prints, per mode, the median step time after the first ``--skip`` steps, the median time the trainer waited for
its rollout, and the mean reward of the last 10 steps. ``--json`` writes the table.

    python benchmarks/bench_async.py --config configs/quickstart_cpu.yaml --nproc 2 --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(config: str, nproc: int, out: Path, overrides: list[str], long_tail: str | None) -> tuple[list[dict], float]:
    entry = ["-m", "verl_mega.train"]
    if long_tail:
        median, high = long_tail.split(",")
        entry = [str(ROOT / "benchmarks" / "long_tail.py"), f"--median={median}", f"--high={high}", "--"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", *entry, "--config", config, f"trainer.output_dir={out}",
           "trainer.save_every=0", "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false",
           *overrides]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.monotonic() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart_cpu.yaml"))
    ap.add_argument("--nproc", type=int, default=2, help="ranks; the pools split them in half")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--long-tail", metavar="MEDIAN,HIGH", help="lognormal response lengths (benchmarks/long_tail.py)")
    ap.add_argument("--modes", default="colocated,pools-s0,pools-s1,pools-s2-partial")
    ap.add_argument("overrides", nargs="*", help="key=value for every mode")
    args = ap.parse_args()
    half = args.nproc // 2
    pools = [f"placement.pools={{train: {{size: {half}}}, rollout: {{size: {args.nproc - half}}}}}",
             "placement.roles={actor: train, ref: train, rollout: rollout}"]
    modes = {"colocated": [], "pools-s0": [*pools, "rollout.max_staleness=0"],
             "pools-s1": [*pools, "rollout.max_staleness=1", "actor.rollout_is=token"],
             "pools-s2-partial": [*pools, "rollout.max_staleness=2", "rollout.partial_rollouts=true",
                                  "actor.rollout_is=token"]}
    modes = {name: modes[name] for name in args.modes.split(",")}
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in modes.items():
            rows, wall = run(args.config, args.nproc, Path(tmp) / name,
                             [f"trainer.total_steps={args.steps}", *args.overrides, *extra], args.long_tail)
            timed = rows[args.skip:]
            table[name] = {"step_s_median": statistics.median(r["timing/step_s"] for r in timed),
                           "rollout_wait_s_median": statistics.median(r["timing/rollout_s"] for r in timed),
                           "wall_s": wall, "steps": len(rows),
                           "reward_last10": sum(r["reward/mean"] for r in rows[-10:]) / min(10, len(rows)),
                           "staleness_mean": statistics.fmean(r.get("rollout/staleness_mean", 0.0) for r in timed),
                           "token_staleness_mean": statistics.fmean(r.get("rollout/token_staleness_mean", 0.0)
                                                                    for r in timed),
                           "partial_frac_mean": statistics.fmean(r.get("rollout/partial_frac", 0.0) for r in timed),
                           "response_length_mean": statistics.fmean(r["rollout/response_length"] for r in timed),
                           "tokens_per_s": sum(r["count/tokens"] for r in timed) / sum(r["timing/step_s"]
                                                                                      for r in timed)}
    base = next(iter(table.values()))["step_s_median"]
    print(f"{'mode':<17} {'step s':>8} {'rollout wait s':>15} {'speed-up':>9} {'wall s':>8} {'reward last10':>14} "
          f"{'staleness':>10} {'partial':>8} {'tokens/s':>9}")
    for name, row in table.items():
        print(f"{name:<17} {row['step_s_median']:8.3f} {row['rollout_wait_s_median']:15.3f} "
              f"{base / row['step_s_median']:8.2f}x {row['wall_s']:8.1f} {row['reward_last10']:14.3f} "
              f"{row['token_staleness_mean']:10.2f} {row['partial_frac_mean']:8.2f} {row['tokens_per_s']:9.1f}")
    if args.json:
        args.json.write_text(json.dumps({"config": args.config, "nproc": args.nproc, "steps": args.steps,
                                         "long_tail": args.long_tail, "overrides": args.overrides,
                                         "cpu_count": os.cpu_count(), "modes": table}, indent=1))


if __name__ == "__main__":
    main()
