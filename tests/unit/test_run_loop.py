"""The steps of a built job (trainer/loop.py), as `python -m verl_mega.train` (train.run) and the Python API
(TrainingRun.step) both drive them: checkpoints, the non-finite guard, the stop agreement, and the end of the data
before trainer.total_steps. A stub trainer stands in for the RL step; loader and checkpoint manager are real."""

import math
import os
import signal
import types
from pathlib import Path

import pytest

from verl_mega.checkpoint.manager import CheckpointManager, NonFiniteError
from verl_mega.config import load_config
from verl_mega.data.loader import PromptItem, PromptLoader
from verl_mega.trainer.api import TrainingRun

ROOT = Path(__file__).resolve().parents[2]
QUIET = ("logging.plot=false", "logging.tensorboard=false", "logging.progress_bar=false", "logging.console=false")


class _Trainer:
    """Every `extra_every`-th step draws a second prompt batch, as dynamic sampling does when too many groups have
    equal rewards; `signal_at`: the step during which this process gets SIGTERM; `nan_from`: from that step on, the
    loss is NaN."""

    def __init__(self, loader, *, extra_every=0, signal_at=0, nan_from=0, signum=signal.SIGTERM):
        self.loader, self.extra_every, self.signal_at, self.nan_from = loader, extra_every, signal_at, nan_from
        self.signum = signum
        self.steps = 0

    def step(self, prompts):
        self.steps += 1
        if self.extra_every and self.steps % self.extra_every == 0:
            self.loader.next_batch()
        if self.steps == self.signal_at:
            os.kill(os.getpid(), self.signum)
        loss = math.nan if self.nan_from and self.steps >= self.nan_from else 0.0
        return {"actor/pg_loss": loss, "batch": float(prompts.batch_index)}


def _job(tmp_path, *overrides, epochs_of_20=False, **trainer):
    """A job over 20 prompt batches whose manager records its saves with the loader's state at each."""
    cfg = load_config(str(ROOT / "configs" / "quickstart_cpu.yaml"),
                      [f"trainer.output_dir={tmp_path / 'out'}", *QUIET, *overrides])
    loader = PromptLoader([PromptItem(i, [1, 2], "p", 0) for i in range(40)], global_batch_size=2)
    ckpt = CheckpointManager(cfg, engines={}, loader=loader, kl_ctrl=None)
    saves = []

    def save(step):
        saves.append((step, loader.state_dict()["epoch"]))
        ckpt.last_saved = step

    ckpt.save = save
    rollout = types.SimpleNamespace(prefetch=lambda requests: None, stop_requested="")
    job = types.SimpleNamespace(cfg=cfg, trainer=_Trainer(loader, **trainer), loader=loader, ckpt=ckpt,
                                rollout=rollout, server=None, start_step=0, started=0.0, lookahead=lambda p: [],
                                total_steps=loader.total_batches if epochs_of_20 else cfg.trainer.total_steps,
                                close=lambda: None)
    return job, saves


@pytest.fixture
def one_rank(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: 0)  # train.run's logger; no process group is needed


DAPO_EPOCHS = ("trainer.total_steps=null", "trainer.total_epochs=1", "trainer.save_every=5",
               "algorithm.filter_groups.enable=true")


def test_when_the_data_runs_out_first_the_last_step_is_saved(tmp_path, one_rank):
    """Dynamic sampling with an epoch-based run: 20 batches, every 4th step draws one more, so the data runs out
    after step 16 of 20. Step 16 is saved (with the loader at its end, which a relaunch takes as a complete run:
    test_ckpt_integrity.py), not lost to be trained again by every relaunch."""
    from verl_mega.train import run

    job, saves = _job(tmp_path, *DAPO_EPOCHS, epochs_of_20=True, extra_every=4)
    run(job)
    assert job.trainer.steps == 16 and saves == [(5, 0), (10, 0), (15, 0), (16, 1)]
    job, saves = _job(tmp_path / "api", *DAPO_EPOCHS, epochs_of_20=True, extra_every=4)
    api = TrainingRun(job)
    with pytest.raises(StopIteration):
        while True:
            api.step()
    api.close()
    assert api.steps_done == 16 and saves == [(5, 0), (10, 0), (15, 0), (16, 1)]
    job, saves = _job(tmp_path / "off", *DAPO_EPOCHS, "trainer.save_every=0", epochs_of_20=True, extra_every=4)
    run(job)
    assert saves == []  # trainer.save_every=0 saves no step, the last one included


def test_the_api_steps_as_train_run_does(tmp_path, one_rank):
    """The same job through train.run and through TrainingRun.step: the same saves (every trainer.save_every and
    the last step) and the same metrics."""
    from verl_mega.train import run

    job, cli_saves = _job(tmp_path / "cli", "trainer.total_steps=5", "trainer.save_every=2")
    cli = run(job)
    job, api_saves = _job(tmp_path / "api", "trainer.total_steps=5", "trainer.save_every=2")
    api = TrainingRun(job)
    rows = [api.step() for _ in range(5)]
    with pytest.raises(StopIteration, match="trainer.total_steps=5"):
        api.step()
    api.close()
    assert api_saves == cli_saves == [(2, 0), (4, 0), (5, 0)]
    assert rows[-1] == cli


def test_the_api_writes_what_train_run_writes(tmp_path, one_rank):
    """The API's numbered steps go to the same sinks as train.run's (one shared set-up, trainer/loop.py): the same
    metrics.jsonl rows, and close() writes summary.txt as the end of train.run does."""
    from verl_mega.train import run

    job, _ = _job(tmp_path / "cli", "trainer.total_steps=3")
    run(job)
    job, _ = _job(tmp_path / "api", "trainer.total_steps=3")
    api = TrainingRun(job)
    for _ in range(3):
        api.step()
    api.close()
    cli_rows, api_rows = ((tmp_path / name / "out" / "metrics.jsonl").read_text().splitlines()
                          for name in ("cli", "api"))
    assert len(api_rows) == 3 and api_rows == cli_rows
    for name in ("cli", "api"):
        assert "steps       3 (3 logged)" in (tmp_path / name / "out" / "summary.txt").read_text()


def test_the_api_guards_non_finite_losses(tmp_path):
    job, _ = _job(tmp_path, "trainer.max_consecutive_nonfinite=2", nan_from=2)
    api = TrainingRun(job)
    api.step()
    api.step()
    with pytest.raises(NonFiniteError, match="step 3: 2 consecutive steps with non-finite"):
        api.step()
    api.close()


def test_sigterm_during_an_api_step_saves_it_and_stops_the_run(tmp_path):
    """As under train.run: the step finishes, is saved, and the run stops; the caller's own handler of the signal
    (here one that notes it, so that a regression cannot end the test session) is back between steps."""
    caller = []
    before = signal.signal(signal.SIGTERM, lambda *args: caller.append("SIGTERM"))
    try:
        job, saves = _job(tmp_path, "trainer.save_every=0", signal_at=2)
        api = TrainingRun(job)
        api.step()
        api.step()
        assert saves == [(2, 0)] and caller == []  # the run's handler had it during the step
        with pytest.raises(StopIteration, match=r"stopped after step 2 \(SIGTERM\)"):
            api.step()
        assert job.trainer.steps == 2
        os.kill(os.getpid(), signal.SIGTERM)  # between steps: the caller's handler
        assert caller == ["SIGTERM"]
        api.close()
    finally:
        signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_stop_signal_saves_the_step_and_only_ctrl_c_ends_the_run_as_interrupted(tmp_path, one_rank, signum):
    """Both finish the step and save it; after Ctrl-C train.run raises Interrupted (the process exits 130, which
    launchers do not restart), after SIGTERM (a preemption) it returns (exit 0)."""
    from verl_mega.train import run
    from verl_mega.trainer.stop import Interrupted

    before = signal.getsignal(signum)
    job, saves = _job(tmp_path, "trainer.total_steps=5", "trainer.save_every=0", signal_at=2, signum=signum)
    if signum == signal.SIGINT:
        with pytest.raises(Interrupted, match="stopped by SIGINT after saving step 2"):
            run(job)
    else:
        run(job)
    assert job.trainer.steps == 2 and saves == [(2, 0)]
    assert signal.getsignal(signum) is before
