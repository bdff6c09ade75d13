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


# ------------------------------------------------------------------------------------------- experiment trackers
def _wandb_history(run_dir):
    """(step -> logged values) of an offline wandb run, read from its transaction log (a LevelDB-format log of
    wandb's protobuf records after a 7-byte ':W&B' header), independently of the wandb client."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, partial = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            records.append(partial + chunk)
    history, config, ended = {}, {}, False
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        ended = ended or record.WhichOneof("record_type") == "exit"
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[row["_step"]] = {k: v for k, v in row.items() if not k.startswith("_")}
        elif record.WhichOneof("record_type") == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return history, config, ended


def _finished_wandb_run(run_dir):
    """The run's history and config once wandb's service has written the run's last (exit) record: finish()
    returns before its writer process has put everything on disk."""
    import time

    deadline = time.monotonic() + 120
    while True:
        history, config, ended = _wandb_history(run_dir)
        if ended or time.monotonic() > deadline:
            assert ended, f"{run_dir}: wandb never wrote the run's exit record"
            return history, config
        time.sleep(0.2)


def _tracker(module: str):
    """The tracker's module; where VERL_MEGA_REQUIRE_LAUNCHERS=1 (CI installs the dev extras, trackers included) a
    missing one fails the test instead of skipping it."""
    import importlib
    import os

    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("VERL_MEGA_REQUIRE_LAUNCHERS") == "1":
            pytest.fail(f"VERL_MEGA_REQUIRE_LAUNCHERS=1 but {module} is not installed (setup.py's dev extra)")
        pytest.skip(f"{module} is not installed (pip install the dev extra)")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    _tracker("wandb")
    for key, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wcfg"),
                       "WANDB_CACHE_DIR": str(tmp_path / "wcache"), "WANDB_DATA_DIR": str(tmp_path / "wdata")}.items():
        monkeypatch.setenv(key, value)


def test_wandb_offline_gets_every_step_and_a_resume_continues_the_run(tmp_path, offline_wandb):
    out = tmp_path / "run"
    with MetricsLogger(out, tensorboard=False, plot=False, console=False, wandb=True, project="p",
                       config={"actor": {"lr": 0.5}}) as log:
        log.log(_step_metrics(1) | {"critic/loss": float("nan")}, step=1)
        log.log(_step_metrics(2), step=2)
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]
    import time

    # wandb names an offline run's directory by the second it started: two runs in one second would share it
    time.sleep(1.01 - time.time() % 1)
    with MetricsLogger(out, tensorboard=False, plot=False, console=False, wandb=True, project="p",
                       resume_step=2) as log:
        log.log(_step_metrics(3), step=3)
    assert json.loads((out / "trackers.json").read_text())["wandb"] == run_id
    runs = sorted((out / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 2  # the first run and its continuation, under one id
    first, config = _finished_wandb_run(runs[0])
    assert first == {1: _step_metrics(1), 2: _step_metrics(2)}  # a NaN is not sent
    assert config["actor"] == {"lr": 0.5}
    assert _finished_wandb_run(runs[1])[0] == {3: _step_metrics(3)}


def test_mlflow_file_store_gets_every_step_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    mlflow = _tracker("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    out = tmp_path / "run"
    with MetricsLogger(out, tensorboard=False, plot=False, console=False, mlflow=True, project="exp",
                       run_name="first", config={"actor": {"lr": 0.5}}) as log:
        log.log(_step_metrics(1) | {"critic/loss": float("inf")}, step=1)
        log.log(_step_metrics(2), step=2)
    run_id = json.loads((out / "trackers.json").read_text())["mlflow"]
    with MetricsLogger(out, tensorboard=False, plot=False, console=False, mlflow=True, project="exp",
                       resume_step=2) as log:
        log.log(_step_metrics(3), step=3)
    client = mlflow.MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    run = client.get_run(run_id)
    assert run.info.run_name == "first" and run.data.params["actor.lr"] == "0.5"
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "reward/mean")] == [
        (1, 0.1), (2, 0.2), (3, 0.1 * 3)]
    assert client.get_metric_history(run_id, "critic/loss") == []  # inf is not sent
    # a fresh run in the same directory starts a run of its own
    with MetricsLogger(out, tensorboard=False, plot=False, console=False, mlflow=True, project="exp") as log:
        log.log(_step_metrics(1), step=1)
    assert json.loads((out / "trackers.json").read_text())["mlflow"] != run_id


def test_a_tracker_that_is_not_installed_is_one_line_before_anything(tmp_path, monkeypatch):
    import importlib.util

    from verl_mega.trainer.trackers import TrackerNotInstalled

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("wandb", "mlflow") else
                        real(name, *a))
    for tracker, package in (("wandb", "wandb"), ("mlflow", "mlflow-skinny")):
        with pytest.raises(TrackerNotInstalled) as info:
            MetricsLogger(tmp_path / "out", **{tracker: True})
        assert str(info.value) == (f"logging.{tracker}=true needs the {tracker} package, which is not installed; pip "
                                   f"install {package} (or verl_mega[{tracker}]) or set logging.{tracker}=false")
        assert not (tmp_path / "out").exists()
    # the job checks it before it builds anything: a one-line error and exit code 2
    from verl_mega import train

    monkeypatch.setattr("verl_mega.trainer.setup.build_job", lambda cfg: pytest.fail("the job was built"))
    assert train.main(["--config", "configs/quickstart_cpu.yaml", "logging.mlflow=true",
                       f"trainer.output_dir={tmp_path / 'job'}"]) == 2


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    """A fresh home (no ~/.netrc, no wandb settings) and none of wandb's credential variables."""
    _tracker("wandb")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "WANDB_CONFIG_DIR",
                "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)  # no ./wandb/settings either
    return home


def test_wandb_without_credentials_is_one_line_before_anything(tmp_path, monkeypatch, capsys,
                                                                no_wandb_credentials):
    from pathlib import Path

    from verl_mega import train
    from verl_mega.trainer.trackers import TrackerNotConfigured, check_trackers

    with pytest.raises(TrackerNotConfigured) as info:
        check_trackers({"wandb": True})
    message = str(info.value)
    assert "\n" not in message and message.startswith("logging.wandb=true, but there are no W&B credentials for ")
    assert "set WANDB_API_KEY, run `wandb login`, or set WANDB_MODE=offline" in message
    assert message.endswith("or set logging.wandb=false")
    # the job stops with that line and exit code 2 before it builds anything
    monkeypatch.setattr("verl_mega.trainer.setup.build_job", lambda cfg: pytest.fail("the job was built"))
    recipe = Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml"
    capsys.readouterr()
    assert train.main(["--config", str(recipe), "logging.wandb=true", f"trainer.output_dir={tmp_path / 'job'}"]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not (tmp_path / "job").exists()
    from verl_mega import RLTrainer  # the Python API checks it as early

    with pytest.raises(TrackerNotConfigured, match="no W&B credentials"):
        RLTrainer.create(actor="tiny", overrides={"logging.wandb": True, "trainer.output_dir": str(tmp_path / "api")})


def test_wandb_credentials_as_wandb_finds_them(monkeypatch, no_wandb_credentials):
    from verl_mega.trainer.trackers import TrackerNotConfigured, check_trackers

    monkeypatch.setenv("WANDB_MODE", "offline")  # offline needs none
    check_trackers({"wandb": True})
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_trackers({"wandb": True})
    monkeypatch.delenv("WANDB_API_KEY")
    netrc = no_wandb_credentials / ".netrc"  # what `wandb login` writes, for wandb's default server
    from wandb.sdk.wandb_settings import Settings

    host = Settings().base_url.split("://")[1]
    netrc.write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    check_trackers({"wandb": True})
    netrc.write_text(f"machine {host}\n  login user\n  password short\n")  # wandb itself would refuse this key
    with pytest.raises(TrackerNotConfigured, match="W&B credentials for .* are unusable .*40"):
        check_trackers({"wandb": True})


def test_an_mlflow_server_that_does_not_answer_is_one_line(monkeypatch):
    import socket

    _tracker("mlflow")
    from verl_mega.trainer.trackers import TrackerNotConfigured, check_trackers

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
        check_trackers({"mlflow": True})  # a server that accepts connections
    with pytest.raises(TrackerNotConfigured) as info:  # the port is closed now
        check_trackers({"mlflow": True})
    assert str(info.value).startswith(f"logging.mlflow=true, but the MLflow tracking server MLFLOW_TRACKING_URI="
                                      f"http://127.0.0.1:{port} does not answer (")
    assert "unset MLFLOW_TRACKING_URI to log to <output_dir>/mlruns" in str(info.value)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    check_trackers({"mlflow": True})  # unset: a local file store
