"""The step-driven vLLM engine of a rollout pool (rollout/streaming.py), against vLLM's own generate."""

import os
import sys
from pathlib import Path

import pytest
from torchrun_util import run_captured

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_streaming_engine_matches_generate_and_resumes_under_new_weights(tmp_path):
    from verl_mega.models.tiny import make_tiny_hf_model

    make_tiny_hf_model(tmp_path / "a", seed=0)
    make_tiny_hf_model(tmp_path / "b", seed=1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1", "PYTHONWARNINGS": "ignore"}
    done = run_captured([sys.executable, str(ROOT / "tests" / "distributed" / "jobs" / "streaming_job.py"),
                         "--workdir", str(tmp_path)], env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and "STREAMING OK" in done.stdout, (done.stdout + done.stderr)[-5000:]
