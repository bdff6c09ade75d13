"""Starting training runs from tests: the job, its settings, its metrics."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torchrun_util import free_port, run_in_session

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
QUIET = ["trainer.save_every=0", "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false"]
# the short runs of the checkpoint tests (result-changing settings; test_resume.py and test_bad_inputs.py)
SHORT = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=8", "rollout.n=4",
         "rollout.max_response_length=6", "rollout.kv_cache_memory_bytes=33554432", "logging.progress_bar=false",
         "logging.tensorboard=false", "logging.plot=false"]
RESUME_STEPS = 6
RESUME_RUN = [f"trainer.total_steps={RESUME_STEPS}", "trainer.save_every=2", "checkpoint.keep_last=2", *SHORT]


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train(out: Path, recipe: str, overrides: list[str], *, nproc: int = 1, env: dict | None = None,
          timeout: float = 1200) -> list[dict]:
    """``python -m verl_mega.train`` (under torchrun for ``nproc`` > 1) with output in ``out``; returns its
    metrics.jsonl rows. The log is ``out``.log."""
    full_env = {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(out.parent / "cache")),
                **(env or {})}
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                f"--master-port={free_port()}", "--master-addr=127.0.0.1"] if nproc > 1 else [sys.executable]
    cmd = [*launcher, "-m", "verl_mega.train", "--config", str(CONFIGS / recipe), f"trainer.output_dir={out}",
           *overrides]
    log = out.with_name(out.name + ".log")
    rc = run_in_session(cmd, env=full_env, log=log, timeout=timeout, cwd=ROOT)
    assert rc == 0, f"{recipe} {overrides}: rc={rc}\n{log.read_text()[-5000:]}"
    return metric_rows(out)


def resume_env(cache: str, fault: str | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "VLLM_CPU_CI_ENV": "1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VERL_MEGA_CACHE": cache}
    env.pop("VERL_MEGA_FAULT_INJECT", None)
    if fault:
        env["VERL_MEGA_FAULT_INJECT"] = fault
    return env
