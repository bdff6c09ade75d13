"""The output directory of a run: one job at a time (a lock) and one run's records (a fresh run sets an earlier
run's records aside, deleting nothing)."""

import contextlib
import logging
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from verl_mega.trainer.run_dir import EARLIER_RUNS, LOCK_FILE, lock_output_dir, set_aside_earlier_run

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_job_in_the_directory_is_refused(tmp_path):
    out = tmp_path / "run"
    with contextlib.ExitStack() as first:
        lock_output_dir(str(out), first)
        assert (out / LOCK_FILE).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
        with pytest.raises(ValueError, match=f"is in use by another job \\(pid {os.getpid()} on ") as info:
            lock_output_dir(str(out), contextlib.ExitStack())
        assert "choose another trainer.output_dir" in str(info.value) and "\n" not in str(info.value)
    with contextlib.ExitStack() as second:  # released with the first job
        lock_output_dir(str(out), second)
        (out / "metrics.jsonl").write_text("")
    assert out.is_dir() and (out / "metrics.jsonl").exists()  # a directory with records stays


def test_a_forked_helper_that_outlives_the_job_does_not_hold_the_lock(tmp_path):
    """A trainer killed while its forked checkpoint writer still runs: the next job gets the directory."""
    out = tmp_path / "run"
    ready, helper_pid = tmp_path / "ready", tmp_path / "helper.pid"
    job = os.fork()
    if job == 0:  # the trainer: takes the lock, forks a long-lived helper, then dies
        try:
            lock_output_dir(str(out), contextlib.ExitStack())
            helper = os.fork()
            if helper == 0:
                time.sleep(60)
                os._exit(0)
            helper_pid.write_text(str(helper))
            ready.touch()
        finally:
            os._exit(0)  # as if killed: nothing released
    os.waitpid(job, 0)
    assert ready.exists()
    try:
        with contextlib.ExitStack() as next_job:
            lock_output_dir(str(out), next_job)
    finally:
        os.kill(int(helper_pid.read_text()), signal.SIGKILL)


def test_a_directory_made_for_a_refused_job_is_removed(tmp_path):
    out = tmp_path / "a" / "run"
    with contextlib.ExitStack() as job:
        lock_output_dir(str(out), job)
        assert out.is_dir()
    assert not out.exists()
    existing = tmp_path / "mine"
    existing.mkdir()
    with contextlib.ExitStack() as job:
        lock_output_dir(str(existing), job)
        assert (existing / LOCK_FILE).exists()
    assert existing.is_dir() and not any(existing.iterdir())  # the user's directory stays, as it was


def test_the_trainer_refuses_a_locked_directory_before_building(tmp_path, capsys):
    from verl_mega.train import main

    out = tmp_path / "run"
    saved = dict(os.environ)
    try:
        with contextlib.ExitStack() as other_job:
            lock_output_dir(str(out), other_job)
            rc = main(["--config", str(ROOT / "configs" / "quickstart_cpu.yaml"), f"trainer.output_dir={out}"])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and "is in use by another job" in errors[0]
    assert not out.exists()


def _earlier_run(out: Path) -> None:
    for step in (2, 4):
        (out / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
        (out / "checkpoints" / f"step_{step:06d}" / "COMPLETE").write_text("ok\n")
    (out / "checkpoints" / "latest").write_text("step_000004\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "tensorboard").mkdir()
    (out / "notes.txt").write_text("the user's own file\n")


def test_a_fresh_run_sets_the_earlier_run_aside(tmp_path, caplog):
    out = tmp_path / "run"
    _earlier_run(out)
    with caplog.at_level(logging.WARNING):
        dest = set_aside_earlier_run(str(out))
    assert dest.parent == out / EARLIER_RUNS
    assert sorted(p.name for p in out.iterdir()) == [EARLIER_RUNS, "notes.txt"]
    assert sorted(p.name for p in dest.iterdir()) == ["checkpoints", "metrics.jsonl", "tensorboard"]
    assert sorted(p.name for p in (dest / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000004"]
    assert "held an earlier run (checkpoints step_000002..step_000004, metrics.jsonl, tensorboard)" in caplog.text
    assert set_aside_earlier_run(str(out)) is None  # nothing left to move
    _earlier_run(out)
    again = set_aside_earlier_run(str(out))
    assert again != dest and again.parent == out / EARLIER_RUNS and (dest / "metrics.jsonl").exists()


def test_a_resumed_run_sets_later_checkpoints_aside(tmp_path, caplog):
    """Resuming from step 2 (a rollback, or resume=auto past a broken step 4): step 4 goes to earlier_runs/, step 2
    and everything else stay, and `latest` names step 2 again; from another directory's checkpoint, `latest` goes."""
    from verl_mega.trainer.run_dir import set_aside_later_checkpoints

    out = tmp_path / "run"
    _earlier_run(out)
    assert set_aside_later_checkpoints(str(out), 4) is None  # the newest: nothing to move
    with caplog.at_level(logging.WARNING):
        dest = set_aside_later_checkpoints(str(out), 2)
    assert dest.parent == out / EARLIER_RUNS and sorted(p.name for p in dest.iterdir()) == ["checkpoints"]
    assert sorted(p.name for p in (dest / "checkpoints").iterdir()) == ["step_000004"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000002"]
    assert (out / "checkpoints" / "latest").read_text() == "step_000002\n"
    assert (out / "metrics.jsonl").exists()  # the metrics logger truncates it to the resumed step itself
    assert "held later ones (step_000004..step_000004)" in caplog.text
    set_aside_later_checkpoints(str(out), 1)  # resumed from step 1 of another directory
    assert not (out / "checkpoints" / "latest").exists()
