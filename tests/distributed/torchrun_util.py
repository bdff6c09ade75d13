"""Run a job script under torchrun with a hard timeout; any rank failing fails the test with its output."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "jobs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def skip_unless_required(reason: str) -> None:
    """Skip when a launcher is not installed, except where VERL_MEGA_REQUIRE_LAUNCHERS=1 (CI installs every one):
    there a missing launcher fails the test instead of passing it by silence."""
    if os.environ.get("VERL_MEGA_REQUIRE_LAUNCHERS") == "1":
        pytest.fail(f"VERL_MEGA_REQUIRE_LAUNCHERS=1 but {reason}")
    pytest.skip(reason)


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 600, env: dict | None = None) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", str(JOBS / script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "VLLM_CPU_CI_ENV": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{script} timed out after {timeout}s:\n{out[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"{script} failed (rc={proc.returncode}):\n{out[-8000:]}")
    return out


def run_in_session(cmd: list[str], *, env: dict, log: Path, timeout: float, cwd: Path | None = None) -> int:
    """Run `cmd` in its own session with output to `log`; afterwards kill the whole session (a killed trainer
    leaves multiprocessing helpers behind, which would otherwise hold pipes or linger). Returns the exit code."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)
        try:
            return proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def tagged_report(out: str, tag: str) -> dict:
    """The last ``<TAG> {json}`` report a job printed. The ranks share one pipe, so another rank's progress bar may
    precede the report on its line, or follow it."""
    import json

    marker = f"{tag} {{"
    found = [line[line.index(marker) + len(tag) + 1:] for line in out.splitlines() if marker in line]
    assert found, out[-3000:]
    return json.JSONDecoder().raw_decode(found[-1])[0]
