"""failures.jsonl (trainer/failures.py): the records of one attempt, read by the next."""

import json
import os

import pytest

from verl_mega.trainer import failures


def _attempt(out, ends: dict[int, str | None], monkeypatch, restart: int) -> None:
    """Every rank of one attempt starts; those with an end record it (None: killed without a word)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
    for rank, end in ends.items():
        failures.start_attempt(out, rank)
        if end is not None:
            failures.end_attempt(end)
    failures._record = None


def test_a_restart_after_a_kill_names_the_silent_rank_first(tmp_path, monkeypatch):
    _attempt(tmp_path, {0: "error: rank 1 of pool 'rollout' did not answer", 1: None}, monkeypatch, 0)
    _attempt(tmp_path, {0: None, 1: None}, monkeypatch, 1)  # the next attempt's ranks set their predecessors aside
    line = failures.record_restart(tmp_path, world_size=2, resume_step=4, launcher="torchrun")
    assert line["cause"].startswith("rank 1 (pid ") and failures.SILENT in line["cause"]
    assert line["cause"].endswith("): error: rank 1 of pool 'rollout' did not answer")
    assert line["restarts"] == {"torchrun": 1} and line["resumed_from_step"] == 4
    assert [r["rank"] for r in line["ranks"]] == [0, 1]  # rank order
    written = [json.loads(x) for x in (tmp_path / failures.FAILURES_FILE).read_text().splitlines()]
    assert written == [line]
    assert not list((tmp_path / failures.ATTEMPTS_DIR / "previous").iterdir())  # read once


def test_no_line_after_a_clean_attempt_or_on_a_first_start(tmp_path, monkeypatch):
    assert failures.record_restart(tmp_path, world_size=2, resume_step=0) is None  # nothing before
    _attempt(tmp_path, {0: "ok", 1: "ok"}, monkeypatch, 0)
    _attempt(tmp_path, {0: None, 1: None}, monkeypatch, 0)
    assert failures.record_restart(tmp_path, world_size=2, resume_step=6) is None
    assert not (tmp_path / failures.FAILURES_FILE).exists()


def test_ranks_beyond_a_smaller_restarted_job_are_read(tmp_path, monkeypatch):
    _attempt(tmp_path, {0: "ok", 1: "ok", 2: None}, monkeypatch, 0)
    _attempt(tmp_path, {0: None, 1: None}, monkeypatch, 1)  # restarted on two ranks: nobody sets rank 2's aside
    line = failures.record_restart(tmp_path, world_size=2, resume_step=0)
    assert line["cause"].startswith("rank 2 (pid ") and len(line["ranks"]) == 1


@pytest.mark.parametrize("spec,counters,killed", [
    ("step_start@3", {}, True), ("step_start@3", {"VERL_MEGA_RESTART_COUNT": "1"}, True),
    ("step_start@3/first", {}, True), ("step_start@3/first", {"TORCHELASTIC_RESTART_COUNT": "0"}, True),
    ("step_start@3/first", {"VERL_MEGA_RESTART_COUNT": "1"}, False),
    ("step_start@3/first", {"SLURM_RESTART_COUNT": "2"}, False), ("step_start@4/first", {}, False),
    ("save_begin@3", {}, False)])
def test_fault_point_fires_where_asked_and_first_only_before_any_restart(monkeypatch, spec, counters, killed):
    from verl_mega.checkpoint import manager

    for var in ("VERL_MEGA_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"VERL_MEGA_FAULT_INJECT": spec, **counters}.items():
        monkeypatch.setenv(var, value)
    kills = []
    monkeypatch.setattr(manager.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    manager.fault_point("step_start", 3)
    assert kills == ([(os.getpid(), 9)] if killed else [])


def test_fault_point_names_a_bad_spec(monkeypatch):
    from verl_mega.checkpoint import manager

    monkeypatch.setenv("VERL_MEGA_FAULT_INJECT", "step_start@3/second")
    with pytest.raises(ValueError, match="step_start@3/second.*<phase>@<step>/first"):
        manager.fault_point("step_start", 3)
