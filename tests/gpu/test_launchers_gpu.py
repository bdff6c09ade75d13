"""On a real multi-GPU machine: tools/topo.py reads nvidia-smi, and each launcher runs a 2-GPU NCCL job."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "distributed" / "_allreduce_job.py"
LAUNCH = REPO / "launch"

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _reference(world: int) -> list[float]:
    spec = importlib.util.spec_from_file_location("_allreduce_job", JOB)
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    x, y = (t.numpy() for t in job.global_batch(world))
    w, b = (t.numpy().copy() for t in job.initial_weights())
    out = []
    for _ in range(job.STEPS):
        r = x @ w.T + b - y
        out.append(float(np.mean(r**2)))
        w, b = w - job.LR * 2.0 / len(x) * (r.T @ x), b - job.LR * 2.0 / len(x) * r.sum(0)
    return out


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                   "OMPI_", "PMI", "SLURM_"))}
    return {**env, "PYTHONPATH": f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", "PYTHONUNBUFFERED": "1"}


def _run(cmd: list[str], timeout: float = 240) -> str:
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"{cmd[:3]} timed out:\n{out[-6000:]}") from None
    assert proc.returncode == 0, f"{cmd[:3]} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def test_topo_tool_on_this_machine():
    n = _gpus()
    if n < 1 or shutil.which("nvidia-smi") is None:
        pytest.skip("needs nvidia-smi and a GPU")
    out = json.loads(_run([sys.executable, str(REPO / "tools" / "topo.py"), "--tp", "1", "--json"]))
    assert out["gpus"] == n
    assert sorted(g for isl in out["islands"] for g in isl) == list(range(n))
    text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, check=True).stdout
    from verl_mega.parallel.topology import parse_topology

    topo = parse_topology(text)
    for isl in out["islands"]:
        for a in isl:
            for b in isl:
                assert a == b or topo.link(a, b).is_nvlink


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "ray"])
def test_two_gpu_job(launcher, tmp_path):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    out = tmp_path / "losses.json"
    job = [str(JOB), "--out", str(out), "--backend", "nccl"]
    if launcher == "torchrun":
        cmd = ["bash", str(LAUNCH / "torchrun.sh"), "--nproc-per-node", "2", "--", *job]
    elif launcher == "mpirun":
        if shutil.which("mpirun") is None:
            pytest.skip("mpirun not installed")
        cmd = ["bash", str(LAUNCH / "mpirun.sh"), "-np", "2", "--", *job]
    else:
        if importlib.util.find_spec("ray") is None:
            pytest.skip("ray not installed")
        cmd = [sys.executable, str(LAUNCH / "ray_launch.py"), "--nnodes", "1", "--nproc-per-node", "2",
               "--timeout", "180", "--", *job]
    log = _run(cmd)
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and {r["launcher"] for r in res["ranks"]} == {launcher}
    assert all("H200" in r["device"] or "NVIDIA" in r["device"] for r in res["ranks"]), res["ranks"]
    np.testing.assert_allclose(res["losses"], _reference(2), rtol=1e-10)
    assert log.count("JOB OK") == 2
