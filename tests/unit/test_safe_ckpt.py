"""Checkpoint files are read without running code from them: `.metadata` through an allow-list, objects and
common.pt weights-only; a refused file is a one-line error naming it, and nothing in it is executed."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from verl_mega.models.hf_io import CheckpointError
from verl_mega.checkpoint.safe_load import (UnsafeCheckpointError, _safe_planner_cls, _safe_reader_cls,
                                            check_dist_checkpoint, exception_chain, read_dist_metadata)


class _Payload:
    """Unpickling this writes a marker file: what an attacker's code would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _saved(tmp_path, **objects):
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(4.0), **objects}, checkpoint_id=str(ckpt), no_dist=True)
    return ckpt


def test_real_metadata_reads_through_the_allow_list(tmp_path):
    ckpt = _saved(tmp_path)
    metadata = read_dist_metadata(ckpt / ".metadata")
    assert "w" in metadata.state_dict_metadata
    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=_safe_reader_cls()(str(ckpt)), planner=_safe_planner_cls(ckpt)(), no_dist=True)
    assert torch.equal(state["w"], torch.arange(4.0))


def test_malicious_metadata_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "marker"
    ckpt = _saved(tmp_path)
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(UnsafeCheckpointError) as info:
        read_dist_metadata(ckpt / ".metadata")
    message = str(info.value)
    assert "\n" not in message and str(ckpt / ".metadata") in message and "posix.system" in message
    # torch's own load machinery with the safe reader: it fails (torch reports it in its own words), nothing runs
    with pytest.raises(BaseException, match="posix.system"):
        dcp.load({"w": torch.zeros(4)}, storage_reader=_safe_reader_cls()(str(ckpt)), no_dist=True)
    assert not marker.exists()


def test_malicious_object_inside_a_shard_is_refused(tmp_path):
    marker = tmp_path / "marker"
    ckpt = _saved(tmp_path, obj=_Payload(marker))  # torch.save inside the shard; not run while saving
    assert not marker.exists()
    with pytest.raises(BaseException) as info:
        dcp.load({"w": torch.zeros(4), "obj": None}, storage_reader=_safe_reader_cls()(str(ckpt)),
                 planner=_safe_planner_cls(ckpt)(), no_dist=True)
    ours = next(e for e in exception_chain(info.value) if isinstance(e, UnsafeCheckpointError))
    assert "'obj'" in str(ours) and "posix.system" in str(ours) and "\n" not in str(ours)
    assert not marker.exists()


def test_truncated_or_foreign_metadata(tmp_path):
    ckpt = _saved(tmp_path)
    data = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"\.metadata is truncated or corrupt"):
        read_dist_metadata(ckpt / ".metadata")
    (ckpt / ".metadata").write_bytes(pickle.dumps({"a": [1, 2]}))
    with pytest.raises(CheckpointError, match="holds a dict, not dist-checkpoint metadata"):
        read_dist_metadata(ckpt / ".metadata")


def test_check_dist_checkpoint_names_the_bad_file(tmp_path):
    marker = tmp_path / "marker"
    ckpt = _saved(tmp_path)
    with pytest.raises(CheckpointError, match="not a Megatron dist checkpoint"):
        check_dist_checkpoint(ckpt)
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    torch.save({"step": 1}, ckpt / "common.pt")
    check_dist_checkpoint(ckpt)
    torch.save({"evil": _Payload(marker)}, ckpt / "common.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"common\.pt holds objects a weights-only load refuses.*"
                                                    r"posix\.system"):
        check_dist_checkpoint(ckpt)
    assert not marker.exists()
