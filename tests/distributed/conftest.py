"""Runs that several tests read, each made once per test session by whichever pytest-xdist worker asks first
(tests/shared_runs.py): the whole training runs held to the README's reward bars, and the reference runs that
tests compare against."""

from __future__ import annotations

from pathlib import Path

import pytest
from runs import (ASYNC_REFERENCE_STEPS, FLEET, FLEET_FAULT, QUIET, RESUME_RUN, metric_rows, resume_env,
                  train)

from shared_runs import shared_dir


def _whole(factory, key: str, recipe: str, overrides: list[str], *, nproc: int = 1, env: dict | None = None) -> Path:
    """A whole run of ``recipe``; returns its output directory."""
    return shared_dir(factory, key, lambda d: train(d / "out", recipe, overrides, nproc=nproc, env=env)) / "out"


ASYNC_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1", "PYTHONWARNINGS": "ignore"}  # test_async.py's env


# ------------------------------------------------------------------ whole runs (the README's reward bars)
@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> Path:
    """configs/quickstart_cpu.yaml as the README runs it: 100 steps, checkpoints, curves, TensorBoard."""
    return _whole(tmp_path_factory, "quickstart", "quickstart_cpu.yaml", ["logging.progress_bar=false"])


@pytest.fixture(scope="session")
def lora_quickstart_run(tmp_path_factory) -> Path:
    """configs/quickstart_lora_cpu.yaml as the README runs it: 150 steps, checkpoints every 50 with the HF export
    (merged model + PEFT adapter)."""
    return _whole(tmp_path_factory, "quickstart-lora", "quickstart_lora_cpu.yaml",
                  ["logging.progress_bar=false", "logging.plot=false", "logging.tensorboard=false"],
                  env={**ASYNC_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # test_quickstart.py resumes it


@pytest.fixture(scope="session")
def moe_quickstart_run(tmp_path_factory) -> Path:
    return _whole(tmp_path_factory, "quickstart-moe", "quickstart_moe_cpu.yaml",
                  ["logging.progress_bar=false", "trainer.save_every=0", "logging.plot=false"])


DAPO = ["actor.clip_ratio_high=0.28", "algorithm.filter_groups.enable=true", "reward.overlong_buffer.enable=true",
        "reward.overlong_buffer.len=4", "actor.use_kl_loss=false"]
# GSPO's run also generates with FP8 weights: the quickstart's reward bar with FP8 rollouts, in the same run
GSPO = ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean", "rollout.quantization=fp8"]
ALGO_RUN = ["trainer.save_every=0", "logging.progress_bar=false"]


@pytest.fixture(scope="session")
def dapo_run(tmp_path_factory) -> Path:
    return _whole(tmp_path_factory, "quickstart-dapo", "quickstart_cpu.yaml", [*ALGO_RUN, *DAPO])


@pytest.fixture(scope="session")
def gspo_run(tmp_path_factory) -> Path:
    return _whole(tmp_path_factory, "quickstart-gspo", "quickstart_cpu.yaml", [*ALGO_RUN, *GSPO])


@pytest.fixture(scope="session")
def calculator_run(tmp_path_factory) -> Path:
    return _whole(tmp_path_factory, "calculator", "multi_turn_calculator_cpu.yaml", ALGO_RUN)


@pytest.fixture(scope="session")
def async_quickstart_run(tmp_path_factory) -> Path:
    """configs/quickstart_async_cpu.yaml, every step of the recipe (rank 0 trains, rank 1 generates one step ahead),
    run once as the chaos run of an engine fleet with two faults (runs.FLEET): its metrics are the plain run's bit
    for bit. test_async.py holds it to the README's bar, test_fleet.py to the plain run's first
    ASYNC_REFERENCE_STEPS steps and to what the fleet must do. Its log is ``out.log`` beside it."""
    return _whole(tmp_path_factory, "quickstart-async-fleet", "quickstart_async_cpu.yaml", [*QUIET, *FLEET], nproc=2,
                  env={**ASYNC_ENV, "VERL_MEGA_FLEET_FAULT": FLEET_FAULT})


# ------------------------------------------------------------------ reference runs
@pytest.fixture(scope="session")
def parity_models(tmp_path_factory) -> Path:
    """Tiny HF models of every supported family (test_model_parity.py, test_packing_parity.py)."""
    from verl_mega.models.tiny import make_tiny_hf_model, moe_fields

    def make(root: Path) -> None:
        for mt in ("qwen2", "llama", "qwen3"):
            make_tiny_hf_model(root / mt, model_type=mt, tie_word_embeddings=(mt == "llama"))
        for mt in MOE_FAMILIES:  # 8 experts, top-2, sharp enough routing (init_std 0.1) that every expert sees tokens
            make_tiny_hf_model(root / mt, model_type=mt, init_std=0.1, extra=moe_fields(mt))
        # DeepSeek-V3: MLA, a dense first layer then an MoE layer, sigmoid top-4 of 8 over 2 of 4 groups, YaRN
        make_tiny_hf_model(root / "deepseek_v3", model_type="deepseek_v3", init_std=0.1, num_kv_heads=4,
                           extra=moe_fields("deepseek_v3"))

    return shared_dir(tmp_path_factory, "parity-models", make)


MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")

@pytest.fixture(scope="session")
def resume_reference(tmp_path_factory) -> tuple[Path, str]:
    """An uninterrupted 6-step quickstart run that saves every 2 steps and keeps the last 2 checkpoints, with a
    model cache of its own: the run directory and the cache. test_resume.py compares interrupted runs with it;
    test_bad_inputs.py breaks copies of its step-4 checkpoint."""
    def make(d: Path) -> None:
        train(d / "run", "quickstart_cpu.yaml", RESUME_RUN, env=resume_env(str(d / "cache")), timeout=400)

    d = shared_dir(tmp_path_factory, "resume-reference", make)
    return d / "run", str(d / "cache")


@pytest.fixture(scope="session")
def async_torchrun_reference(tmp_path_factory) -> list[dict]:
    """The first ASYNC_REFERENCE_STEPS steps of configs/quickstart_async_cpu.yaml under torchrun, no fleet: what the
    other launchers (their first 3 steps) and the fleet's chaos run must reproduce."""
    def make(d: Path) -> None:
        train(d / "torchrun", "quickstart_async_cpu.yaml", [f"trainer.total_steps={ASYNC_REFERENCE_STEPS}", *QUIET],
              nproc=2, env=ASYNC_ENV, timeout=600)

    return metric_rows(shared_dir(tmp_path_factory, f"async-torchrun-{ASYNC_REFERENCE_STEPS}", make) / "torchrun")
