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
# The async quickstart's one whole run is the chaos run of an engine fleet: rank 1 supervises two vLLM engine
# processes; engine 0 SIGKILLs itself one engine step into its request 2, engine 1 SIGSTOPs itself in its request
# FLEET_STOP_AT. A fleet redoes a failed engine's prompt groups whole, with their own seeds, on the other engine, so
# the run's metrics are the plain run's: the first ASYNC_REFERENCE_STEPS steps, which hold both faults, are compared.
FLEET_HANG_S = 8
FLEET_STOP_AT = 8
FLEET = ["rollout.fleet.engines=2", f"rollout.fleet.hang_timeout_s={FLEET_HANG_S}", "rollout.fleet.max_restarts=1"]
FLEET_FAULT = f"0:kill@2,1:stop@{FLEET_STOP_AT}"
ASYNC_REFERENCE_STEPS = 12
# the short runs of the checkpoint tests (result-changing settings; test_resume.py and test_bad_inputs.py)
SHORT = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=8", "rollout.n=4",
         "rollout.max_response_length=6", "rollout.kv_cache_memory_bytes=33554432", "logging.progress_bar=false",
         "logging.tensorboard=false", "logging.plot=false"]
RESUME_STEPS = 6
RESUME_RUN = [f"trainer.total_steps={RESUME_STEPS}", "trainer.save_every=2", "checkpoint.keep_last=2", *SHORT]


def metric_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def recipe_steps(recipe: str) -> int:
    """How many steps ``configs/<recipe>`` runs (its trainer.total_steps, defaults included)."""
    from verl_mega.config import load_config

    return load_config(CONFIGS / recipe).trainer.total_steps


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
