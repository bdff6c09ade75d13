"""The launchers check the recipe before they start a job: a recipe that does not load fails every attempt the
same way, so its error is printed once, with exit code 2, and nothing is started or restarted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BAD = ["--config", str(ROOT / "configs" / "quickstart_cpu.yaml"), "trainer.total_steps=many"]
ERROR = "error: trainer.total_steps expects int | null, got 'many'"


@pytest.mark.parametrize("launcher", [
    ["bash", str(ROOT / "launch" / "torchrun.sh"), "--nproc-per-node", "2", "--max-restarts", "3", "--"],
    ["bash", str(ROOT / "launch" / "mpirun.sh"), "-np", "2", "--max-restarts", "3", "--"],
    [sys.executable, str(ROOT / "launch" / "ray_launch.py"), "--nproc-per-node", "2", "--cpu", "--max-restarts",
     "3", "--"],
], ids=["torchrun", "mpirun", "ray"])
def test_a_recipe_error_is_printed_once_and_not_restarted(launcher, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "MPIRUN": "/bin/false"}  # mpirun, if reached, would fail
    proc = subprocess.run([*launcher, *BAD], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert out.count(ERROR) == 1, out
    assert "restart" not in out.lower() and not (tmp_path / "outputs").exists()


def test_the_check_passes_a_good_recipe():
    proc = subprocess.run([sys.executable, "-m", "verl_mega.train", "--config",
                           str(ROOT / "configs" / "quickstart_async_cpu.yaml"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
