"""Crash consistency: a run SIGKILLed at many points (before, during and after saves, and mid-run) and resumed each
time reproduces the per-step metrics of an uninterrupted run exactly (deterministic CPU mode); no checkpoint that
`resume=auto` would pick is ever incomplete. SIGTERM leaves a loadable checkpoint of the current step. The same holds
for background saves (checkpoint.async_save), whose checkpoints equal the synchronous ones bit for bit."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runs import RESUME_RUN, RESUME_STEPS, resume_env
from torchrun_util import run_in_session, run_torchrun, start

ROOT = Path(__file__).resolve().parents[2]
STEPS, FAST = RESUME_STEPS, RESUME_RUN  # the reference run's settings (conftest.py: resume_reference)
# counters of syncs performed and wall-clock figures legitimately differ between runs
VOLATILE = ("timing/", "overlap/", "perf/", "weight_sync/seconds", "weight_sync/version", "rollout/weight_version")


_env = resume_env


def _train(out: Path, cache: str, fault: str | None = None, *extra: str) -> subprocess.CompletedProcess:
    """Run the trainer in its own session; afterwards kill the whole session, since a SIGKILLed parent leaves
    its multiprocessing helpers (checkpoint writer, resource tracker) behind as a real crash would."""
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", str(ROOT / "configs" / "quickstart_cpu.yaml"),
           f"trainer.output_dir={out}", *FAST, *extra]
    log = out.parent / "train.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    rc = run_in_session(cmd, env=_env(cache, fault), log=log, timeout=400)
    return subprocess.CompletedProcess(cmd, rc, "", log.read_text()[-6000:])


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _check_checkpoints(out: Path) -> None:
    for d in (out / "checkpoints").glob("step_*"):
        assert (d / "COMPLETE").exists(), f"{d} is visible to resume=auto but incomplete"
        state = json.loads((d / "trainer.json").read_text())
        assert state["step"] == int(d.name.split("_")[1])
        assert (d / "actor" / "metadata.json").exists()


@pytest.fixture(scope="module")
def reference(resume_reference):
    """The uninterrupted run (made once per session, conftest.py): its metrics, its model cache, its directory."""
    run, cache = resume_reference
    _check_checkpoints(run)
    return _rows(run), cache, run


def test_kill9_at_many_points_then_resume_matches(reference, tmp_path):
    ref_rows, cache, _ = reference
    out = tmp_path / "run"
    faults = ["step_start@2", "save_begin@2", "save_shards_written@2", "save_renamed@4", "step_start@5",
              "save_shards_written@6", "save_done@6"]
    for fault in faults:
        proc = _train(out, cache, fault)
        assert proc.returncode == -signal.SIGKILL, f"{fault}: rc={proc.returncode}\n{proc.stderr[-3000:]}"
        _check_checkpoints(out)
    proc = _train(out, cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_checkpoints(out)
    got = _rows(out)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for want, have in zip(ref_rows, got):
        assert have == want, f"step {want['step']} differs after kill/resume"
    # every start after a kill recorded it (trainer/failures.py); a world of one, no launcher's counters
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert len(failures) == len(faults), failures
    assert all(f["cause"].startswith("rank 0 (pid ") and "ended without a word" in f["cause"] for f in failures)


def test_sigterm_saves_current_step(reference, tmp_path):
    _, cache, _ = reference
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", str(ROOT / "configs" / "quickstart_cpu.yaml"),
           f"trainer.output_dir={out}", *FAST, "trainer.total_steps=200", "trainer.save_every=0"]
    err_log = tmp_path / "sigterm.log"
    job = start(cmd, env=_env(cache), log=tmp_path / "sigterm.out", stderr=err_log)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.5)
    job.send_signal(signal.SIGTERM)
    try:
        rc = job.wait(timeout=300)
    finally:
        job.kill_session()
    assert rc == 0, err_log.read_text()[-3000:]
    last_logged = _rows(out)[-1]["step"]
    _check_checkpoints(out)
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert saved and int(saved[-1].name.split("_")[1]) == last_logged
    # and it loads: a resume continues from there
    proc = _train(out, cache, None, f"trainer.total_steps={last_logged + 1}", "trainer.save_every=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _rows(out)[-1]["step"] == last_logged + 1


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_broken_newest_checkpoint_falls_back_and_reproduces(reference, tmp_path, damage):
    """step_000006 damaged after it was written: a truncated shard (caught by its size, before anything is built) or
    flipped bytes (caught by its SHA-256 once the process group exists). resume=auto warns, resumes from step 4 and
    the run's metrics equal the uninterrupted run's."""
    ref_rows, cache, ref_out = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    shard = sorted((out / "checkpoints" / "step_000006" / "actor").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2: len(data) // 2 + 64] = bytes(b ^ 0x5A for b in data[len(data) // 2:][:64])
    shard.write_bytes(bytes(data))
    proc = _train(out, cache)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = (tmp_path / "train.log").read_text()
    problem = f"has {len(data)} bytes" if damage == "truncate" else "does not match its SHA-256"
    assert f"{shard} {problem}" in text and "resuming from the older step_000004 instead" in text, text[-4000:]
    assert "resumed from" in text and "step_000004 (step 4)" in text
    (earlier,) = (out / "earlier_runs").iterdir()  # the broken one, set aside: pruning and resume=auto never see it
    assert sorted(p.name for p in (earlier / "checkpoints").iterdir()) == ["step_000006"]
    _check_checkpoints(out)
    assert _rows(out) == ref_rows


def test_fresh_run_in_a_used_directory_never_mixes_with_the_earlier_one(reference, tmp_path):
    """trainer.resume=off where a longer run left checkpoints (steps 4 and 6) and metrics: the earlier run's records
    are moved to earlier_runs/ (nothing deleted), the new run keeps its own checkpoints (pruning used to remove the
    new step 1, the lowest number), and a later resume=auto continues the new run, not the old one."""
    ref_rows, cache, ref_out = reference
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    proc = _train(out, cache, None, "trainer.resume=off", "trainer.total_steps=2", "trainer.save_every=1")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    (earlier,) = (out / "earlier_runs").iterdir()
    assert sorted(p.name for p in (earlier / "checkpoints").glob("step_*")) == ["step_000004", "step_000006"]
    assert _rows(earlier) == ref_rows
    assert _rows(out) == ref_rows[:2]  # the same seed: a fresh run repeats the reference's first steps
    proc = _train(out, cache, None, "trainer.total_steps=3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step_000002 (step 2)" in (tmp_path / "train.log").read_text()
    _check_checkpoints(out)
    assert _rows(out) == ref_rows[:3]


# ---------------------------------------------------------------- background saves (checkpoint.async_save=true)
ASYNC = "checkpoint.async_save=true"


def _load_dist_checkpoint(path: Path, scratch: Path) -> dict:
    """Every tensor and object of an mcore dist checkpoint, read back without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = scratch / f"{path.parent.name}-{path.name}.pt"
    dcp_to_torch_save(path, flat)
    return {"shards": torch.load(flat, weights_only=False),
            "common": torch.load(path / "common.pt", weights_only=False)}


def _assert_same(a, b, where: str) -> int:
    """Deep, bit-exact equality; returns the number of tensors compared."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
        return 1
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        return sum(_assert_same(a[k], b[k], f"{where}/{k}") for k in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        return sum(_assert_same(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    assert a == b, (where, a, b)
    return 0


def test_async_save_is_a_snapshot_of_its_step(tmp_path):
    """mcore stages CPU tensors for the background writer without copying them; ours must be copies."""
    out = run_torchrun("async_snapshot_job.py", 2, str(tmp_path / "ckpt"), timeout=180,
                       env={"PYTHONPATH": str(ROOT)})
    assert "ASYNC_SNAPSHOT_OK" in out, out[-3000:]


def test_async_checkpoints_equal_sync_ones(reference, tmp_path):
    """Training goes on while step 4 is written; the result equals the synchronous run's step 4 (and 6) exactly."""
    ref_rows, cache, ref_out = reference
    out = tmp_path / "run"
    proc = _train(out, cache, None, ASYNC)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check_checkpoints(out)
    assert _rows(out) == ref_rows
    for name in ("step_000004", "step_000006"):
        sync, bg = ref_out / "checkpoints" / name, out / "checkpoints" / name
        assert (bg / "COMPLETE").exists(), f"{name} missing from the async run"
        n = _assert_same(_load_dist_checkpoint(sync / "actor", tmp_path), _load_dist_checkpoint(bg / "actor", tmp_path),
                         name)
        assert n >= 10, f"only {n} tensors compared"
        _assert_same(torch.load(sync / "rank_00000.pt", weights_only=True),
                     torch.load(bg / "rank_00000.pt", weights_only=True), f"{name}/rng")
        want, got = (json.loads((d / "trainer.json").read_text()) for d in (sync, bg))
        assert got["config"]["checkpoint"].pop("async_save") is True
        want["config"]["checkpoint"].pop("async_save")
        for state in (got, want):  # the only other difference between the two runs
            state["config"]["trainer"].pop("output_dir")
        assert got == want


def test_async_kill9_during_save_then_resume_matches(reference, tmp_path):
    ref_rows, cache, _ = reference
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    # killed while step 4's shards are in flight: only step 2 is visible
    proc = _train(out, cache, "step_start@5", ASYNC)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    _check_checkpoints(out)
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002"]
    assert (ckpts / ".tmp-step_000004").exists()
    # resumed from step 2; killed after every rank wrote step 6's shards, before it was marked COMPLETE
    proc = _train(out, cache, "save_shards_written@6", ASYNC)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    _check_checkpoints(out)
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000002", "step_000004"]
    # resumed from step 4 (written in the background) and finished
    proc = _train(out, cache, None, ASYNC)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step_000004 (step 4)" in (tmp_path / "train.log").read_text()
    _check_checkpoints(out)
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_000004", "step_000006"]
    assert _rows(out) == ref_rows


# what the resharding moves depends on the layout (at ep=1 every rank has every expert)
LAYOUT_METRICS = ("weight_sync/",)


def _close_rows(got: dict, want: dict, where: str) -> None:
    """The same metrics to float rounding: another layout sums the same numbers in another order."""
    assert got.keys() == want.keys(), where
    differ = {key: (got[key], value) for key, value in want.items() if not key.startswith(LAYOUT_METRICS)
              and got[key] != pytest.approx(value, rel=1e-3, abs=1e-5)}
    assert not differ, f"{where}: {differ}"


def test_moe_expert_parallel_resume_matches(tmp_path):
    """The tiny MoE quickstart on 2 ranks with ep=2 (each rank holds 4 of the 8 experts, expert data parallelism 1):
    its checkpoints carry the expert optimizer's state (gathered over the expert-DP group, not the dense DP one), and
    a run stopped after step 4 and resumed reproduces the uninterrupted run's steps 5-6 exactly. At another ep the
    expert state lives in another optimizer (ep=1: the dense one, expert data parallelism 2); the step-4 checkpoint
    resumed at ep=1, and its step-6 checkpoint resumed at ep=2, continue with the exact optimizer state: the steps
    after their first update agree with the runs that kept the layout, to float rounding."""
    from torchrun_util import free_port

    cache = str(tmp_path / "cache")

    def train(out: Path, steps: int, ep: int = 2) -> str:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", f"--master-port={free_port()}",
               "--master-addr=127.0.0.1", "-m", "verl_mega.train", "--config",
               str(ROOT / "configs" / "quickstart_moe_cpu.yaml"), f"trainer.output_dir={out}", f"parallel.ep={ep}",
               *FAST, f"trainer.total_steps={steps}"]
        log = tmp_path / f"{out.name}-{steps}.log"
        rc = run_in_session(cmd, env=_env(cache), log=log, timeout=500, cwd=ROOT)
        assert rc == 0, log.read_text()[-6000:]
        assert "optimizer state restarts" not in log.read_text()
        return log.read_text()

    train(tmp_path / "whole", STEPS)
    train(tmp_path / "split", 4)
    _check_checkpoints(tmp_path / "split")
    shutil.copytree(tmp_path / "split", tmp_path / "to_ep1")
    train(tmp_path / "split", STEPS)
    whole, split = _rows(tmp_path / "whole"), _rows(tmp_path / "split")
    assert [r["step"] for r in split] == list(range(1, STEPS + 1))
    assert all(0.9 < r["actor/router_agreement"] <= 1.0 for r in whole)
    assert split == whole
    # ep=2 -> ep=1, from step 4
    assert "resumed from" in train(tmp_path / "to_ep1", STEPS, ep=1)
    to_ep1 = _rows(tmp_path / "to_ep1")
    assert to_ep1[:4] == whole[:4]
    for want, got in zip(whole[4:], to_ep1[4:], strict=True):
        _close_rows(got, want, f"ep=2 -> ep=1, step {want['step']}")
    # ep=1 -> ep=2, from step 6, against the same checkpoint resumed at ep=1: step 8 shows step 7's update
    shutil.copytree(tmp_path / "to_ep1", tmp_path / "back_to_ep2")
    train(tmp_path / "to_ep1", STEPS + 2, ep=1)
    train(tmp_path / "back_to_ep2", STEPS + 2, ep=2)
    for want, got in zip(_rows(tmp_path / "to_ep1")[STEPS:], _rows(tmp_path / "back_to_ep2")[STEPS:], strict=True):
        _close_rows(got, want, f"ep=1 -> ep=2, step {want['step']}")
