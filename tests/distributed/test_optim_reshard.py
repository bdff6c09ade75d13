"""Optimizer state reshards across tp/pp/dp: Adam's exp_avg, exp_avg_sq, fp32 main params and step saved at one
layout are, after a resume at another, exactly the state the old layout held (compared per HF-named parameter, as
full tensors assembled independently of the checkpoint code), and the next two steps' losses equal the uninterrupted
run's. Checkpoints in the older per-bucket form still resume exactly at their own layout, and at another one load
the weights with a warning that the optimizer state restarts."""

import json
from pathlib import Path

import pytest

from torchrun_util import run_torchrun

ROOT = Path(__file__).resolve().parents[2]
JOB = "optim_reshard_job.py"
FULL = 78  # 26 HF tensors of the tiny model x (param, exp_avg, exp_avg_sq)


def _job(cache: str, *args: str) -> dict:
    out = run_torchrun(JOB, 2, *args, timeout=300, env={"PYTHONPATH": str(ROOT), "VERL_MEGA_CACHE": cache})
    lines = [line for line in out.splitlines() if line.startswith("OPTIM_RESHARD_OK ")]
    assert lines, out[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Trained and saved on 2 ranks: at tp=2 (distributed optimizer, plus an older-form copy; and the
    non-distributed optimizer), and at dp=2 (distributed optimizer, state gathered over DP on save)."""
    root = tmp_path_factory.mktemp("optim")
    cache = str(root / "cache")
    _job(cache, "train", "--tp", "2", str(root / "tp2"), f"{root / 'tp2_nodist'}:nodist")
    _job(cache, "train", str(root / "dp2"))
    return root, cache


@pytest.mark.parametrize("target,sources,expect", [
    (["--pp", "2"], ["tp2", "tp2:legacy"], {"tp": 1, "pp": 2, "dp": 1, "tp2": FULL, "tp2:legacy": 0}),
    ([], ["tp2", "tp2_nodist:nodist"], {"tp": 1, "pp": 1, "dp": 2, "tp2": FULL, "tp2_nodist:nodist": FULL}),
    (["--tp", "2"], ["dp2", "tp2:legacy"], {"tp": 2, "pp": 1, "dp": 1, "dp2": FULL, "tp2:legacy": FULL}),
], ids=["to-pp2", "to-dp2", "to-tp2"])
def test_optimizer_state_reshards(runs, target, sources, expect):
    """The job asserts exact state and matching losses per checkpoint; 0 tensors marks the older form resumed at
    another layout (weights only, by design)."""
    root, cache = runs
    report = _job(cache, "resume", *target, *(str(root / s) for s in sources))
    assert report["layout"] == {k: expect[k] for k in ("tp", "pp", "dp")}, report
    got = {Path(r["run"]).name: r["tensors"] for r in report["runs"]}
    assert got == {s: expect[s] for s in sources}, report
