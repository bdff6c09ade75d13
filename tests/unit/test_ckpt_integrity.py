"""Which checkpoint a run resumes from: manifests with a SHA-256 per 64 MiB block of each file, cheap checks before
anything is built, checksums, the fallback of trainer.resume=auto to the newest intact checkpoint, and one-line
errors for the rest."""

import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from verl_mega.config import load_config, to_dict
from verl_mega.checkpoint import integrity
from verl_mega.checkpoint.integrity import (MANIFEST, BrokenCheckpointError, ResumeError, RunComplete, SCHEMA,
                                            bad_checksums, check_steps_left, checkpoint_files, digest_files,
                                            find_checkpoint, read_manifest, verify_checkpoint, verify_items,
                                            write_manifest)

ROOT = Path(__file__).resolve().parents[2]


def _cfg(out: Path, *overrides: str):
    return load_config(str(ROOT / "configs" / "quickstart_cpu.yaml"), [f"trainer.output_dir={out}", *overrides])


def _checkpoint(out: Path, step: int, cfg) -> Path:
    """A checkpoint laid out as CheckpointManager writes it (a small dist checkpoint for the actor)."""
    path = out / "checkpoints" / f"step_{step:06d}"
    actor = path / "actor"
    dcp.save({"w": torch.full((64, 64), float(step))}, checkpoint_id=str(actor), no_dist=True)
    (actor / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"optimizer": {"step": step}}, actor / "common.pt")
    torch.save({"torch": torch.get_rng_state()}, path / "rank_00000.pt")
    state = {"schema": SCHEMA, "step": step, "loader": {}, "kl_ctrl": {}, "engines": {}, "world_size": 1,
             "layout": {"tp": 1, "pp": 1, "dp": 1}, "config": to_dict(cfg)}
    (path / "trainer.json").write_text(json.dumps(state))
    write_manifest(path, digest_files(path, checkpoint_files(path)))
    (path / "COMPLETE").write_text("ok\n")
    return path


@pytest.fixture
def run(tmp_path):
    cfg = _cfg(tmp_path / "out")
    return cfg, [_checkpoint(tmp_path / "out", step, cfg) for step in (2, 4)]


def _shard(path: Path) -> Path:
    return next((path / "actor").glob("*.distcp"))


def test_manifest_lists_every_file_with_size_and_sha256(run):
    _, (_, newest) = run
    manifest = read_manifest(newest)
    assert set(manifest) == {"trainer.json", "rank_00000.pt", "actor/.metadata", "actor/metadata.json",
                             "actor/common.pt", _shard(newest).relative_to(newest).as_posix()}
    for name, entry in manifest.items():  # one SHA-256 per 64 MiB block; these files are each one block
        assert entry["size"] > 0
        assert entry["blocks"] == [hashlib.sha256((newest / name).read_bytes()).hexdigest()]
    assert not bad_checksums(newest, manifest)


def _big_file(path: Path, size: int) -> bytes:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    path.write_bytes(data.numpy().tobytes())
    return path.read_bytes()


@pytest.mark.parametrize("threads", [1, 3])
def test_block_digests_equal_hashlib_of_each_slice(tmp_path, monkeypatch, threads):
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1000)
    data = _big_file(tmp_path / "shard", 3500)
    (tmp_path / "empty").write_bytes(b"")
    entries = digest_files(tmp_path, ["shard", "empty"], threads=threads)
    assert entries["empty"] == {"size": 0, "blocks": []}
    assert entries["shard"] == {"size": 3500, "blocks": [hashlib.sha256(data[i:i + 1000]).hexdigest()
                                                          for i in range(0, 3500, 1000)]}


def test_a_flip_in_a_later_block_is_found_and_ranks_share_the_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "BLOCK_BYTES", 1000)
    data = bytearray(_big_file(tmp_path / "shard", 3500))
    (tmp_path / "other").write_bytes(b"x" * 1500)
    manifest = digest_files(tmp_path, ["shard", "other"], threads=2)
    items = verify_items(manifest)
    assert items == [("other", 0), ("other", 1), ("shard", 0), ("shard", 1), ("shard", 2), ("shard", 3)]
    data[2999] ^= 0x01  # the last byte of block 2
    (tmp_path / "shard").write_bytes(bytes(data))
    per_rank = [bad_checksums(tmp_path, manifest, items[rank::2], threads=2) for rank in range(2)]
    assert per_rank[1] == []  # rank 1 holds blocks 1 and 3 of the shard, both intact
    assert len(per_rank[0]) == 1 and "shard does not match its SHA-256" in per_rank[0][0]


def test_a_whole_file_manifest_still_verifies(run, caplog):
    cfg, (older, newest) = run
    entries = {name: {"size": (newest / name).stat().st_size,
                      "sha256": hashlib.sha256((newest / name).read_bytes()).hexdigest()}
               for name in checkpoint_files(newest)}
    (newest / "manifest.json").write_text(json.dumps({"algorithm": "sha256", "files": entries}))
    assert verify_checkpoint(cfg, newest) == newest
    shard = _shard(newest)
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert verify_checkpoint(cfg, newest) == older
    assert f"{shard} does not match its SHA-256" in caplog.text


def test_a_manifest_with_a_wrong_block_count_is_broken(run):
    _, (_, newest) = run
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["files"]["trainer.json"]["blocks"].append("0" * 64)
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BrokenCheckpointError, match="lacks its size or its digests"):
        read_manifest(newest)


def test_intact_newest_is_chosen(run):
    cfg, (_, newest) = run
    assert find_checkpoint(cfg) == newest
    assert verify_checkpoint(cfg, newest) == newest


def test_truncated_newest_falls_back_with_a_warning(run, caplog):
    cfg, (older, newest) = run
    shard = _shard(newest)
    shard.write_bytes(shard.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        assert find_checkpoint(cfg) == older
    assert f"{shard} has 100 bytes" in caplog.text and "resuming from the older step_000002" in caplog.text
    explicit = _cfg(cfg.trainer.output_dir, f"trainer.resume={newest}")
    with pytest.raises(BrokenCheckpointError, match=f"{shard} has 100 bytes, manifest.json records"):
        find_checkpoint(explicit)


def test_flipped_bytes_are_detected_by_checksum(run, caplog):
    cfg, (older, newest) = run
    shard = _shard(newest)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    assert find_checkpoint(cfg) == newest  # the cheap checks pass
    with caplog.at_level(logging.WARNING):
        assert verify_checkpoint(cfg, newest) == older
    assert f"{shard} does not match its SHA-256" in caplog.text
    explicit = _cfg(cfg.trainer.output_dir, f"trainer.resume={newest}")
    with pytest.raises(BrokenCheckpointError, match="does not match its SHA-256") as info:
        verify_checkpoint(explicit, newest)
    assert "\n" not in str(info.value)
    skip = _cfg(cfg.trainer.output_dir, "checkpoint.verify_checksums=false")
    assert verify_checkpoint(skip, newest) == newest


def test_every_checkpoint_broken_is_an_error(run):
    cfg, paths = run
    for path in paths:
        (path / "rank_00000.pt").unlink()
    with pytest.raises(BrokenCheckpointError, match="rank_00000.pt is missing.*no older intact checkpoint"):
        find_checkpoint(cfg)


def test_a_step_directory_must_hold_its_step(run, caplog):
    """A checkpoint renamed (or copied in from another run) under another step's name is refused, and
    trainer.resume=auto falls back past it."""
    cfg, (older, newest) = run
    impostor = newest.with_name("step_000009")
    newest.rename(impostor)
    with caplog.at_level(logging.WARNING):
        assert find_checkpoint(cfg) == older
    assert f"{impostor} is named for step 9 but its trainer.json records step 4" in caplog.text
    with pytest.raises(BrokenCheckpointError, match="rename it step_000004 or remove it"):
        find_checkpoint(_cfg(cfg.trainer.output_dir, f"trainer.resume={impostor}"))


@pytest.mark.parametrize("edit,pattern", [
    (lambda s: s.pop("config"), "lacks 'config'"),
    (lambda s: s.update(loader=[1]), "has a list as 'loader'"),
    (lambda s: s.update(schema=SCHEMA + 1), f"has schema {SCHEMA + 1}"),
])
def test_trainer_json_schema(run, edit, pattern):
    cfg, (_, newest) = run
    state = json.loads((newest / "trainer.json").read_text())
    edit(state)
    (newest / "trainer.json").write_text(json.dumps(state))
    (newest / MANIFEST).unlink()  # as if written so: only the schema is wrong
    explicit = _cfg(cfg.trainer.output_dir, f"trainer.resume={newest}")
    with pytest.raises(ResumeError, match=pattern):
        find_checkpoint(explicit)


def test_optimizer_type_and_config_mismatch(run):
    cfg, (_, newest) = run
    flipped = _cfg(cfg.trainer.output_dir, "parallel.use_distributed_optimizer=false")
    with pytest.raises(ResumeError, match="distributed optimizer, which the plain one cannot load; set "
                                          "parallel.use_distributed_optimizer=true"):
        find_checkpoint(flipped)
    assert find_checkpoint(_cfg(cfg.trainer.output_dir, "parallel.use_distributed_optimizer=false",
                                "checkpoint.save_optimizer=false")) == newest
    with pytest.raises(ResumeError, match="config differs from step_000004 in result-changing keys"):
        find_checkpoint(_cfg(cfg.trainer.output_dir, "actor.lr=0.1"))


class _Payload:
    def __reduce__(self):
        return (print, ("unpickled",))


def test_a_rank_file_that_would_run_code_is_refused_before_the_build(run):
    from verl_mega.checkpoint.safe_load import UnsafeCheckpointError

    cfg, (_, newest) = run
    torch.save({"torch": _Payload()}, newest / "rank_00000.pt")
    write_manifest(newest, digest_files(newest, checkpoint_files(newest)))  # as an attacker would
    with pytest.raises(UnsafeCheckpointError, match="rank_00000.pt holds objects a weights-only load refuses"):
        find_checkpoint(cfg)  # the cheap checks, which run before anything is built


def test_an_allowed_config_change_is_listed(run, caplog):
    cfg, (_, newest) = run
    allowed = _cfg(cfg.trainer.output_dir, "actor.lr=0.1", "trainer.resume_allow_config_change=true")
    with caplog.at_level(logging.WARNING):
        assert find_checkpoint(allowed) == newest
    assert "config differs from step_000004 in result-changing keys (actor.lr:" in caplog.text
    assert "resuming with the new values" in caplog.text


def test_steps_left(run):
    _, (_, newest) = run
    check_steps_left(newest, 5)
    check_steps_left(newest, 4, complete_ok=True)
    with pytest.raises(RunComplete, match="already holds step 4, the last of this run"):
        check_steps_left(newest, 4)
    with pytest.raises(ResumeError, match="trainer.total_steps=3 is below step 4"):
        check_steps_left(newest, 3)


def test_legacy_checkpoint_without_manifest(run, caplog):
    """Written before manifests, and before trainer.json's schema field, which came with them: resumed unverified."""
    cfg, (_, newest) = run
    state = json.loads((newest / "trainer.json").read_text())
    state.pop("schema")
    (newest / "trainer.json").write_text(json.dumps(state))
    (newest / MANIFEST).unlink()
    assert find_checkpoint(cfg) == newest
    assert find_checkpoint(_cfg(cfg.trainer.output_dir, f"trainer.resume={newest}")) == newest
    with caplog.at_level(logging.WARNING):
        assert verify_checkpoint(cfg, newest) == newest
    assert "written without a manifest" in caplog.text


def _fake_world(monkeypatch, *, rank: int, rank0_path):
    """This process as rank `rank` of 2: rank 0's broadcast delivers `rank0_path`; rank 0 finds every block
    intact."""
    monkeypatch.setattr(integrity.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(integrity.dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(integrity.dist, "get_rank", lambda *a, **k: rank)

    def broadcast_object_list(objects, src, group=None):
        assert src == 0
        objects[0] = None if rank0_path is None else str(rank0_path)

    def all_gather_object(out, obj, group=None):
        out[:] = [[], obj] if rank == 1 else [obj, []]

    monkeypatch.setattr(integrity.dist, "broadcast_object_list", broadcast_object_list)
    monkeypatch.setattr(integrity.dist, "all_gather_object", all_gather_object)


def test_every_rank_resumes_from_rank_0s_choice(run, monkeypatch, caplog):
    """Each rank runs the cheap checks alone, before the process group exists: a transient read error made rank 1
    fall back to the older checkpoint while rank 0 chose the newest. Every rank must load rank 0's choice."""
    cfg, (older, newest) = run
    _fake_world(monkeypatch, rank=1, rank0_path=newest)
    with caplog.at_level(logging.WARNING):
        assert verify_checkpoint(cfg, older) == newest
    assert f"this rank (1) chose {older} on its own, rank 0 chose {newest}" in caplog.text
    caplog.clear()
    skip = _cfg(cfg.trainer.output_dir, "checkpoint.verify_checksums=false")  # no hashing: still one choice
    assert verify_checkpoint(skip, older) == newest
    _fake_world(monkeypatch, rank=1, rank0_path=None)  # rank 0 starts fresh, so does every rank
    assert verify_checkpoint(cfg, older) is None


def _with_loader_state(path: Path, **loader) -> None:
    state = json.loads((path / "trainer.json").read_text())
    state["loader"] = {"epoch": 0, "index": 0, "seed": 0, "dataset_size": 40, "global_batch_size": 2, **loader}
    (path / "trainer.json").write_text(json.dumps(state))
    write_manifest(path, digest_files(path, checkpoint_files(path)))


def _loader(prompts: int = 40, num_epochs: int = 1):
    from verl_mega.data.loader import PromptItem, PromptLoader

    return PromptLoader([PromptItem(i, [1, 2], "p", 0) for i in range(prompts)], global_batch_size=2,
                        num_epochs=num_epochs)


def test_a_loader_state_that_does_not_fit_the_data_is_refused_before_the_build(run):
    """A dataset that changed size since the save: refused with the checks that run before anything is built
    (setup.py passes the loader), not after every model is built and the checkpoint loaded."""
    _, (_, newest) = run
    _with_loader_state(newest, index=3)
    check_steps_left(newest, 20, loader=_loader(), complete_ok=True)
    with pytest.raises(ResumeError, match=f"resume: {newest}: data loader state has dataset_size=40 but this run "
                                          "has 44; resume with the same data") as info:
        check_steps_left(newest, 20, loader=_loader(44), complete_ok=True)
    assert "\n" not in str(info.value)


def test_a_checkpoint_where_the_data_ran_out_is_a_complete_run(run):
    """Dynamic sampling with trainer.total_epochs: the data ran out at step 4 of a run of 20 batches, and the run
    saved step 4 there. A relaunch finds the run complete instead of building everything to train nothing."""
    _, (_, newest) = run
    _with_loader_state(newest, epoch=1, index=0)  # after the last of the 20 batches of the only epoch
    check_steps_left(newest, 20, loader=_loader(), complete_ok=True)
    with pytest.raises(RunComplete, match="already holds step 4, where the data ran out"):
        check_steps_left(newest, 20, loader=_loader())
    check_steps_left(newest, 40, loader=_loader(num_epochs=2))  # trainer.total_epochs raised: steps are left


def test_a_deleted_manifest_is_damage_not_the_older_format(run, caplog):
    """A checkpoint whose trainer.json has the schema field was written with a manifest: without it, its files
    cannot be verified, so it is broken (resume=auto falls back to the older intact one), even when the rest is
    damaged in a way only the manifest would show. An intact checkpoint named explicitly still resumes."""
    cfg, (older, newest) = run
    assert find_checkpoint(_cfg(cfg.trainer.output_dir, f"trainer.resume={newest}")) == newest
    shard = _shard(newest)
    shard.write_bytes(shard.read_bytes()[:100])
    (newest / MANIFEST).unlink()
    with caplog.at_level(logging.WARNING):
        assert find_checkpoint(cfg) == older
        assert verify_checkpoint(cfg, find_checkpoint(cfg)) == older
    assert f"{newest / MANIFEST} is missing" in caplog.text and "resuming from the older step_000002" in caplog.text
    with pytest.raises(BrokenCheckpointError, match=f"{newest / MANIFEST} is missing .*resume another checkpoint") \
            as info:
        find_checkpoint(_cfg(cfg.trainer.output_dir, f"trainer.resume={newest}"))
    assert "\n" not in str(info.value)
    (older / MANIFEST).unlink()
    with pytest.raises(BrokenCheckpointError, match="manifest.json is missing.*no older intact checkpoint"):
        find_checkpoint(cfg)
