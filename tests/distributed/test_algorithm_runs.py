"""The algorithm menu on the README's bar, as users run it (slow: whole training runs).

- GRPO + DAPO (clip-higher, dynamic sampling, overlong penalty, no KL loss) and GSPO runs of the quickstart: mean
  reward over the first 10 steps < 0.3 and over the last 10 > 0.6, like the plain quickstart. For DAPO the bar is
  read on the reward of every generated sample (`dapo/generated_reward_mean`): `reward/mean` is the filtered batch's,
  which drops the all-wrong groups.
- The multi-turn calculator task (configs/multi_turn_calculator_cpu.yaml): the policy calls the calc tool and
  copies its answer; mean reward over the first 10 steps < 0.25, last 10 > 0.45.
"""

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import slots

from torchrun_util import free_port, run_in_session

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

DAPO = ["actor.clip_ratio_high=0.28", "algorithm.filter_groups.enable=true", "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=4", "actor.use_kl_loss=false"]
GSPO = ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"]


def _train(tmp_path: Path, name: str, recipe: str, overrides: list[str], nproc: int = 1) -> list[dict]:
    out = tmp_path / name
    env = {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                f"--master-port={free_port()}"] if nproc > 1 else [sys.executable]
    cmd = [*launcher, "-m", "verl_mega.train", "--config", str(ROOT / "configs" / recipe),
           f"trainer.output_dir={out}", "trainer.save_every=0", "logging.progress_bar=false", *overrides]
    log = tmp_path / f"{name}.log"
    rc = run_in_session(cmd, env=env, log=log, timeout=1200, cwd=ROOT)
    assert rc == 0, f"{name}: {log.read_text()[-5000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _first_last(rows: list[dict], key: str) -> tuple[float, float]:
    return sum(r[key] for r in rows[:10]) / 10, sum(r[key] for r in rows[-10:]) / 10


def test_dapo_and_gspo_meet_the_quickstart_bar(tmp_path):
    with slots.reserve(2), ThreadPoolExecutor(2) as pool:  # one process each, side by side
        dapo, gspo = pool.map(lambda args: _train(tmp_path, *args),
                              [("dapo", "quickstart_cpu.yaml", DAPO), ("gspo", "quickstart_cpu.yaml", GSPO)])
    assert len(dapo) == len(gspo) == 150
    first, last = _first_last(dapo, "dapo/generated_reward_mean")
    print(f"DAPO generated reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.3 and last > 0.6, (first, last)
    assert all(r["dapo/gen_batches"] >= 1 for r in dapo) and max(r["dapo/gen_batches"] for r in dapo) > 1
    assert sum(r["dapo/kept_group_frac"] for r in dapo) / len(dapo) < 1  # groups were dropped and refilled
    first, last = _first_last(gspo, "reward/mean")
    print(f"GSPO reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.3 and last > 0.6, (first, last)


def test_multi_turn_calculator_reward_rises(tmp_path):
    rows = _train(tmp_path, "calculator", "multi_turn_calculator_cpu.yaml", [])
    # the same episodes when one engine spans two ranks (tp=2: its first rank calls the tools and broadcasts them)
    two = _train(tmp_path, "calculator_tp2", "multi_turn_calculator_cpu.yaml", ["trainer.total_steps=1",
                                                                                "parallel.tp=2"], nproc=2)
    for key in ("reward/mean", "rollout/tool_calls", "rollout/turns", "rollout/response_length"):
        assert two[0][key] == rows[0][key], (key, two[0][key], rows[0][key])
    assert len(rows) == 80
    first, last = _first_last(rows, "reward/mean")
    print(f"multi-turn calculator reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    # the warm start leaves the tool call and the copy half learnt; RL must make them reliable
    assert first < 0.4 and last > 0.45 and last - first > 0.2, (first, last)
    calls = sum(r["rollout/tool_calls"] for r in rows[-10:]) / 10
    assert calls > 0.9, calls  # the policy calls the tool in nearly every episode
    assert all(r["rollout/turns"] >= 1 and 0 <= r["rollout/tool_error_frac"] <= 1 for r in rows)
    # the tools' answers are masked out of the loss: the policy's own tokens still match vLLM's log-probs
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
