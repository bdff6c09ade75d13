"""MetricsLogger sinks: jsonl content and resume truncation, TensorBoard events, curve PNG, rank filtering."""

import json
import sys

import numpy as np
import pytest
import torch

from verl_mega.trainer.metrics import MetricsLogger, plot_curves, read_metrics


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _step_metrics(step: int) -> dict:
    return {"reward/mean": 0.1 * step, "actor/kl": 0.01 * step, "actor/entropy": 2.0 - 0.1 * step,
            "timing/step_s": 1.5}


def test_jsonl_lines_are_durable_and_typed(tmp_path):
    log = MetricsLogger(tmp_path, tensorboard=False, plot=False, console=False)
    log.log({"reward/mean": torch.tensor(0.25), "actor/kl": np.float32(0.5), "critic/loss": float("nan"),
             "count/tokens": 7, "phase": "train", "skipped": False}, step=1)
    # Visible before close: each line is flushed (and fsync'ed) as it is logged.
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 0.25, "actor/kl": 0.5,
                                                   "critic/loss": None, "count/tokens": 7, "phase": "train",
                                                   "skipped": False}]
    log.log({"reward/mean": 0.5}, step=2)
    with pytest.raises(ValueError, match="not after the last logged step 2"):
        log.log({"reward/mean": 0.5}, step=2)
    with pytest.raises(ValueError, match="disagrees"):
        log.log({"step": 9}, step=3)
    with pytest.raises(TypeError, match="'bad'"):
        log.log({"bad": torch.ones(3)}, step=3)
    with pytest.raises(TypeError, match="'obj'"):
        log.log({"obj": object()}, step=3)
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    with pytest.raises(RuntimeError, match="after close"):
        log.log({}, step=5)


def test_resume_truncates_later_steps_and_torn_lines(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, plot=False, console=False) as log:
        for step in range(1, 6):
            log.log(_step_metrics(step), step)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')  # a write torn by a kill
    with MetricsLogger(tmp_path, tensorboard=False, plot=False, console=False, resume_step=3) as log:
        assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
        with pytest.raises(ValueError, match="last logged step 3"):
            log.log({}, step=3)
        for step in range(4, 7):
            log.log(_step_metrics(step), step)
    records = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[5]["reward/mean"] == pytest.approx(0.6)

    # A fresh run (no resume_step) in the same directory starts the file empty.
    with MetricsLogger(tmp_path, tensorboard=False, plot=False, console=False) as log:
        log.log({"reward/mean": 1.0}, step=1)
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": 1.0}]


def test_tensorboard_event_file_holds_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, plot=False, console=False) as log:
        for step in range(1, 4):
            log.log({**_step_metrics(step), "phase": "train"}, step)
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "reward/mean" in acc.Tags()["scalars"] and "phase" not in acc.Tags()["scalars"]
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.2), (3, 0.3)]

    # Resuming from step 1 purges the events a killed run wrote for steps 2 and 3.
    with MetricsLogger(tmp_path, plot=False, console=False, resume_step=1) as log:
        log.log({"reward/mean": 0.9}, step=2)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("reward/mean")] == [(1, 0.1), (2, 0.9)]


def test_missing_tensorboard_gives_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ImportError, match="logging.tensorboard=false"):
        MetricsLogger(tmp_path, console=False)


def test_curves_png_written_at_close(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False, console=False) as log:
        for step in range(1, 8):
            log.log(_step_metrics(step), step)
    png = tmp_path / "curves.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000

    # Panels are skipped when their key is absent; with no curve key at all nothing is written.
    only_reward = tmp_path / "r"
    only_reward.mkdir()
    (only_reward / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{"step": 2, "reward/mean": 0.3}\n')
    assert plot_curves(only_reward / "metrics.jsonl", only_reward / "c.png")
    assert (only_reward / "c.png").stat().st_size > 0
    (only_reward / "none.jsonl").write_text('{"step": 1, "timing/step_s": 1.0}\n')
    assert not plot_curves(only_reward / "none.jsonl", only_reward / "none.png")
    assert not (only_reward / "none.png").exists()

    with pytest.raises(ValueError, match="logging.jsonl=true"):
        MetricsLogger(tmp_path, jsonl=False, plot=True)


def test_nonzero_rank_writes_nothing(tmp_path, capsys):
    out = tmp_path / "rank1"
    with MetricsLogger(out, rank=1, total_steps=3) as log:
        for step in range(1, 4):
            log.log(_step_metrics(step), step)
    assert not out.exists()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_console_compact_line_without_tty(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False, plot=False, total_steps=4, log_every=2) as log:
        for step in range(1, 5):
            log.log(_step_metrics(step), step)
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["step 2/4 | reward/mean 0.2 | actor/kl 0.02 | actor/entropy 1.8 | step_s 1.50",
                     "step 4/4 | reward/mean 0.4 | actor/kl 0.04 | actor/entropy 1.6 | step_s 1.50"]


def test_progress_bar_postfix_on_a_tty(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with MetricsLogger(tmp_path, tensorboard=False, plot=False, total_steps=2) as log:
        for step in range(1, 3):
            log.log(_step_metrics(step), step)
    captured = capsys.readouterr()
    assert captured.out == ""  # the bar replaces the per-step lines
    assert "2/2" in captured.err and "reward 0.2 kl 0.02 ent 1.8 1.50s/step" in captured.err


def test_curve_keys_follow_the_trainer_names(tmp_path, capsys):
    with MetricsLogger(tmp_path, tensorboard=False, plot=False) as log:
        log.log({"reward/mean": 0.5, "kl/coef": 0.1, "kl/actor_ref": 0.02, "actor/entropy_rollout": 1.25}, step=1)
        log.log({"reward/mean": 0.5, "kl/coef": 0.1, "kl/reward_kl": 0.03}, step=2)
        log.log({"reward/mean": 0.5, "kl/coef": 0.1, "my/kl": 0.04, "policy/entropy": 1.5}, step=3)
    assert capsys.readouterr().out.splitlines() == [
        "step 1 | reward/mean 0.5 | kl/actor_ref 0.02 | actor/entropy_rollout 1.25",
        "step 2 | reward/mean 0.5 | kl/reward_kl 0.03",
        "step 3 | reward/mean 0.5 | my/kl 0.04 | policy/entropy 1.5",
    ]
