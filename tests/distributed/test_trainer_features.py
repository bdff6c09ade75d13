"""Trainer features end to end on CPU: ReMax (greedy-baseline rollout), the validation loop, and a failing stage
that ends the run with its own error only."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrun_util import run_captured

from verl_mega.data.tasks import generated_task

ROOT = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).parent / "jobs"
QUICK = ["trainer.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false",
         "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=4"]


def _run(args: list[str], tmp_path: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1",
           "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}
    return run_captured([sys.executable, *args], timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_remax_with_validation(tmp_path):
    """ReMax trains from a greedy baseline per prompt; validation scores greedy answers on data.val_files, also before
    the first step (trainer.val_before_train)."""
    val = tmp_path / "val.jsonl"
    records = generated_task("addition_small").generate(12, seed=123)
    val.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in records))
    out = tmp_path / "run"
    proc = _run(["-m", "verl_mega.train", "--config", "configs/quickstart_cpu.yaml", f"trainer.output_dir={out}",
                 "algorithm.adv_estimator=remax", "trainer.total_steps=4", "trainer.val_every=2",
                 "trainer.val_before_train=true",
                 f"data.val_files=[{val}]", "reward.function=arithmetic", *QUICK], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    before, rows = rows[0], rows[1:]  # trainer.val_before_train: the initial weights' score, nothing trained yet
    assert set(before) == {"step", "val/reward/mean", "val/response_length", "val/num_samples"}
    assert before["val/num_samples"] == 12 and 0.0 <= before["val/reward/mean"] <= 1.0
    for r in rows:
        assert 0.0 <= r["reward/baseline_mean"] <= 1.0 and abs(r["actor/pg_loss"]) < 1e3
        assert ("val/reward/mean" in r) == (r["step"] % 2 == 0)
    for r in rows[1::2]:
        assert r["val/num_samples"] == 12 and 0.0 <= r["val/reward/mean"] <= 1.0 and r["val/response_length"] >= 1


@pytest.mark.slow
def test_failing_stage_prints_one_error(tmp_path):
    proc = _run([str(JOBS / "failing_stage.py"), "configs/quickstart_cpu.yaml", str(tmp_path / "run"),
                 "trainer.total_steps=3", *QUICK], tmp_path)
    assert proc.returncode != 0
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-4000:]
    tail = proc.stderr.rstrip().splitlines()[-2:]  # the error, then the note naming the stage it came from
    assert tail[0].endswith("RuntimeError: advantage stage failed on purpose"), proc.stderr[-2000:]
    assert tail[1].endswith("(in RL stage 'advantage')"), proc.stderr[-2000:]
    for noise in ("Invalid process group", "sys.meta_path is None", "During handling of the above exception"):
        assert noise not in proc.stderr, noise
