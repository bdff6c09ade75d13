"""The checkpoint directory over a run's life: what a save finalises, prunes and cleans, and how checkpoints are
deleted (renamed to a hidden name first), so that resume=auto only ever sees this run's complete checkpoints."""

import errno
import json
import logging
import shutil
from pathlib import Path

import pytest

from test_ckpt_integrity import _cfg, _checkpoint
from verl_mega.checkpoint.integrity import find_checkpoint
from verl_mega.checkpoint.manager import CheckpointManager
from verl_mega.trainer.run_dir import EARLIER_RUNS


def _manager(out: Path, *overrides: str) -> CheckpointManager:
    """A manager of no engines whose saves hold trainer.json, the RNG file, the manifest and COMPLETE."""
    mgr = CheckpointManager(_cfg(out, *overrides), engines={}, loader=None, kl_ctrl=None)
    mgr._trainer_state = lambda step: {"step": step}
    return mgr


def _finalize(mgr: CheckpointManager, out: Path, step: int, cfg) -> Path:
    """Save `step` as a real checkpoint (one find_checkpoint accepts): written where a save writes it, then
    finalised by the manager."""
    path = _checkpoint(out, step, cfg)
    tmp = path.with_name(f".tmp-{path.name}")
    path.rename(tmp)
    for name in ("COMPLETE", "manifest.json"):
        (tmp / name).unlink()
    mgr._finalize(step, tmp, (tmp / "trainer.json").read_text())
    return path


def _steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name != "latest")


def test_a_rollback_continues_its_own_timeline(tmp_path, caplog):
    """trainer.resume=PATH to step 20 of a run that went on to 50: the later checkpoints are set aside at resume
    (not deleted), so the resumed run's saves are kept by pruning, `latest` names them, and resume=auto continues
    the resumed run instead of the abandoned one."""
    from verl_mega.trainer.run_dir import set_aside_later_checkpoints

    out = tmp_path / "out"
    first = _cfg(out, "checkpoint.keep_last=null")
    for step in (10, 20, 30, 40, 50):
        _checkpoint(out, step, first)
    (out / "checkpoints" / "latest").write_text("step_000050\n")
    cfg = _cfg(out, f"trainer.resume={out}/checkpoints/step_000020")
    assert find_checkpoint(cfg).name == "step_000020"
    moved = set_aside_later_checkpoints(str(out), 20)  # what build_job does once step 20 is loaded
    assert moved.parent == out / EARLIER_RUNS and "later ones (step_000030..step_000050)" in caplog.text
    assert sorted(p.name for p in (moved / "checkpoints").iterdir()) == ["step_000030", "step_000040", "step_000050"]
    assert (out / "checkpoints" / "latest").read_text() == "step_000020\n"  # it named one moved away
    mgr = _manager(out)
    _finalize(mgr, out, 25, first)
    assert _steps(out) == ["step_000020", "step_000025"]  # keep_last=2: the resumed one and the new one
    assert (out / "checkpoints" / "latest").read_text() == "step_000025\n"
    assert find_checkpoint(_cfg(out)).name == "step_000025"


def test_a_launcher_restart_of_a_rolled_back_run_goes_on_from_its_own_checkpoints(tmp_path, monkeypatch, caplog):
    """The launcher restarts the job with the same command, trainer.resume=PATH included: once the run resumed from
    PATH and saved since, a restart continues from its newest checkpoint (falling back over a broken one, down to
    PATH); a relaunch by hand (no restart counter) resumes PATH as asked, and so does a restart before any save."""
    from verl_mega.checkpoint.integrity import record_explicit_resume
    from verl_mega.trainer.run_dir import set_aside_later_checkpoints

    for var in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT", "VERL_MEGA_RESTART_COUNT"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "out"
    first = _cfg(out, "checkpoint.keep_last=null")
    for step in (10, 20, 30):
        _checkpoint(out, step, first)
    path = out / "checkpoints" / "step_000010"
    cfg = _cfg(out, f"trainer.resume={path}")
    set_aside_later_checkpoints(str(out), 10)
    record_explicit_resume(out, path, 10)  # what build_job does once step 10 is loaded
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert find_checkpoint(cfg) == path  # restarted before the resumed run saved anything: PATH again
    for step in (15, 20):
        _checkpoint(out, step, first)  # the resumed run's own
    assert find_checkpoint(cfg).name == "step_000020"
    assert "this is a restart (torchrun 1) of a run that already resumed from it; continuing from its own newest " \
           "checkpoint, step_000020, instead of going back to step 10 again" in caplog.text
    (out / "checkpoints" / "step_000020" / "trainer.json").write_text("{}")  # broken: the one before it
    assert find_checkpoint(cfg).name == "step_000015"
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert find_checkpoint(cfg) == path  # relaunched by hand with the same PATH: roll back, as asked
    monkeypatch.setenv("VERL_MEGA_RESTART_COUNT", "2")
    other = _cfg(out, f"trainer.resume={out}/checkpoints/step_000015")
    assert find_checkpoint(other).name == "step_000015"  # another PATH than the one recorded: as asked

def test_pruning_never_deletes_the_checkpoint_it_just_wrote(tmp_path):
    """Newer checkpoints than the one just written (nothing set them aside) are not counted and not deleted: the
    new one and the newest older ones stay, keep_last in all."""
    out = tmp_path / "out"
    cfg = _cfg(out)
    for step in (10, 20, 40, 50):
        _checkpoint(out, step, cfg)
    _finalize(_manager(out, "checkpoint.keep_last=1"), out, 25, cfg)
    assert _steps(out) == ["step_000025", "step_000040", "step_000050"]
    _finalize(_manager(out, "checkpoint.keep_last=2"), out, 30, cfg)
    assert _steps(out) == ["step_000025", "step_000030", "step_000040", "step_000050"]


class _Killed(BaseException):
    pass


def test_a_deletion_killed_midway_leaves_no_checkpoint_look_alike(tmp_path, monkeypatch):
    """Pruning killed in the middle of deleting step 2, after its manifest and shards went but before COMPLETE and
    trainer.json did: what is left must not pass as a (pre-manifest, unverified) checkpoint. It is hidden, and the
    next save removes it."""
    out = tmp_path / "out"
    cfg = _cfg(out, "checkpoint.keep_last=1")
    _checkpoint(out, 2, cfg)
    rmtree = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        path = Path(path)
        if (path / "COMPLETE").exists():
            (path / "manifest.json").unlink()
            rmtree(path / "actor")
            raise _Killed
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    mgr = _manager(out, "checkpoint.keep_last=1")
    with pytest.raises(_Killed):
        _finalize(mgr, out, 4, cfg)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert _steps(out) == [".trash-step_000002", "step_000004"]
    assert find_checkpoint(cfg).name == "step_000004"
    (out / "checkpoints" / "step_000004" / "rank_00000.pt").unlink()  # the newest broken: nothing older is left
    with pytest.raises(ValueError, match="no older intact checkpoint"):
        find_checkpoint(cfg)
    mgr.save(6)
    assert _steps(out) == ["step_000006"]


def test_the_next_save_removes_what_failed_saves_left(tmp_path, caplog):
    """A save that failed (a full disk) leaves .tmp-step_3; the next save of any step removes it, and any
    .trash-* of a killed deletion."""
    caplog.set_level(logging.INFO, logger="verl_mega.checkpoint")
    out = tmp_path / "out"
    mgr = _manager(out)

    def disk_full(step):
        raise OSError(errno.ENOSPC, "No space left on device")

    mgr._trainer_state = disk_full
    with pytest.raises(OSError, match="No space left on device"):
        mgr.save(3)
    assert _steps(out) == [".tmp-step_000003"]
    (out / "checkpoints" / ".trash-step_000001" / "actor").mkdir(parents=True)
    mgr._trainer_state = lambda step: {"step": step}
    mgr.save(5)
    assert _steps(out) == ["step_000005"]
    assert json.loads((out / "checkpoints" / "step_000005" / "trainer.json").read_text()) == {"step": 5}
    assert "left: .tmp-step_000003, .trash-step_000001" in caplog.text


def test_the_hf_export_carries_the_tokenizer_the_run_used(tmp_path, monkeypatch):
    """checkpoint.export_hf writes the run's tokenizer (model.tokenizer_path, model.chat_template applied), not the
    tokenizer files that happen to sit in model.path, and a config.json that names the dtype written."""
    from types import SimpleNamespace

    import torch
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    import verl_mega.models.loader as loader
    import verl_mega.models.lora as lora
    from verl_mega.models.tiny import build_char_tokenizer

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(build_char_tokenizer(tmp_path / "tokenizer")))
    tokenizer.chat_template = "{{ messages[0]['content'] }} ="
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    (model / "tokenizer_config.json").write_text('{"chat_template": "stale"}')
    weights = [("lm_head.weight", torch.zeros(2, 2, dtype=torch.bfloat16))]
    monkeypatch.setattr(loader, "iter_hf_tensors", lambda *args: iter(weights))
    monkeypatch.setattr(lora, "has_adapters", lambda modules: False)
    mgr = _manager(tmp_path / "run")
    mgr.engines = {"actor": SimpleNamespace(modules=[], chunks=[], groups=None)}
    mgr.hf_source, mgr.tokenizer = model, tokenizer
    mgr._export_hf(tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert exported.chat_template == tokenizer.chat_template
    assert exported("12+34").input_ids == tokenizer("12+34").input_ids
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config == {"model_type": "qwen2", "torch_dtype": "bfloat16"}  # the dtype written, not the source's
