"""failures.jsonl (trainer/failures.py): the records of one attempt, read by the next."""

import json

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
