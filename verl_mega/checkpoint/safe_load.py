"""Read Megatron dist checkpoints without running code from them.

A dist checkpoint (``torch_dist`` backend) holds four kinds of files; this is how each is read:

* ``metadata.json``: JSON.
* ``.metadata``: a pickle of torch's ``Metadata``. Plain ``pickle.load`` (what torch and mcore use) runs any code a
  crafted file names, so it is read with :class:`RestrictedUnpickler`: only the classes of torch's dist-checkpoint
  metadata, ``torch.Size``, dtypes, layouts and plain containers are allowed (:data:`ALLOWED_GLOBALS`); anything else
  refuses the file with :class:`UnsafeCheckpointError`, naming it.
* ``common.pt`` and the objects inside the ``*.distcp`` shards (``_extra_state`` and the like): torch's weights-only
  unpickler (``torch.load(..., weights_only=True)``), where torch's default load planner uses ``weights_only=False``.
* tensor data in ``*.distcp``: ``torch.load(weights_only=True)``, as torch does.

:func:`load_dist` is ``dist_checkpointing.load`` with these readers; resume and the converters use it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import pickle
from pathlib import Path
from typing import Any, Iterator

import torch

from verl_mega.models.hf_io import CheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_DCP_PLANNER = "torch.distributed.checkpoint.planner"
# What torch's FileSystemWriter pickles into `.metadata` (torch 2.x): the Metadata tree, the planner's per-rank
# save plans (`all_local_plans`), storage records, and the torch scalars inside them.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {(_DCP_METADATA, n) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                  "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    | {(_DCP_PLANNER, n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan",
                                   "ReadItem", "LoadItemType")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
       ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}  # StorageMeta.checkpoint_id may be a path
    | {("torch", name) for name, value in vars(torch).items() if isinstance(value, (torch.dtype, torch.layout,
                                                                                       torch.memory_format))}
)


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file that names code outside the allow-list; it is never unpickled."""


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only :data:`ALLOWED_GLOBALS` (the Python docs' "restricting globals" recipe)."""

    def __init__(self, file, *, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise UnsafeCheckpointError(
                f"checkpoint: {self.source} refers to {module}.{name}, which dist-checkpoint metadata never holds; "
                f"refusing to load it (unpickling it could run code): use a checkpoint from a trusted source")
        return super().find_class(module, name)


def read_dist_metadata(path: str | Path):
    """The ``Metadata`` pickled in a dist checkpoint's ``.metadata``, unpickled with the allow-list."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    try:
        with open(path, "rb") as f:
            metadata = RestrictedUnpickler(f, source=str(path)).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {path} is missing; the checkpoint is incomplete") from None
    except Exception as exc:  # noqa: BLE001 - truncated or garbled pickles raise many types
        raise CheckpointError(f"checkpoint: {path} is truncated or corrupt ({type(exc).__name__}: "
                              f"{_first_line(exc)}); use another checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint: {path} holds a {type(metadata).__name__}, not dist-checkpoint metadata")
    return metadata


def weights_only_load(source: str | Path | io.BytesIO, *, what: str) -> Any:
    """``torch.load(weights_only=True)`` with a one-line error naming ``what`` when the content is refused."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"checkpoint: {what} holds objects a weights-only load refuses "
                                    f"({_first_line(exc)}); refusing to load it (unpickling it could run code): "
                                    f"use a checkpoint from a trusted source") from None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {what} is missing; the checkpoint is incomplete") from None
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint: {what} is truncated or corrupt ({type(exc).__name__}: "
                              f"{_first_line(exc)}); use another checkpoint") from None


def check_dist_checkpoint(ckpt_dir: str | Path) -> None:
    """Cheap checks of one dist checkpoint before anything is built: its metadata files exist and read safely."""
    import json

    ckpt_dir = Path(ckpt_dir)
    meta = ckpt_dir / "metadata.json"
    try:
        json.loads(meta.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint: {ckpt_dir} is not a Megatron dist checkpoint (no metadata.json)") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint: {meta} is unreadable ({exc}); use another checkpoint") from None
    read_dist_metadata(ckpt_dir / ".metadata")
    weights_only_load(ckpt_dir / "common.pt", what=str(ckpt_dir / "common.pt"))


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [""]
    # torch's weights-only refusal explains itself at length; the line naming the refused global is the useful one
    named = [line.strip() for line in lines if "unsupported global" in line.lower()]
    return (named or lines)[0][:200]


def exception_chain(exc: BaseException):
    """`exc` and every exception behind it: causes, contexts, arguments, and the per-rank failures that
    torch.distributed.checkpoint collects into a CheckpointException."""
    seen: set[int] = set()
    stack: list[Any] = [exc]
    while stack:
        item = stack.pop()
        if isinstance(item, tuple):
            stack += list(item)
            continue
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        stack += [item.__cause__, item.__context__, *item.args]
        failures = getattr(item, "failures", None)
        if isinstance(failures, dict):
            stack += list(failures.values())


# ------------------------------------------------------------------------------------ mcore strategies over them

def disk_full_error(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind `exc`, if any: a full disk may surface wrapped, e.g. in torch's
    CheckpointException (per-rank failures) or as the cause of another error."""
    return next((e for e in exception_chain(exc)
                 if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)), None)

def _safe_reader_cls():
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """torch's reader with `.metadata` unpickled through the allow-list (and cached, like mcore's reader)."""

        _cached = None

        def read_metadata(self, *args: Any, **kwargs: Any):
            if self._cached is None or kwargs.get("rank") is not None:
                metadata = read_dist_metadata(self._get_metadata_path(kwargs.get("rank")))
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                if kwargs.get("rank") is not None:
                    return metadata
                self._cached = metadata
            return self._cached

    return SafeFileSystemReader


def _safe_planner_cls(ckpt_dir: Path):
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner

    class SafeLoadPlanner(MCoreLoadPlanner):
        """mcore's planner; objects stored as bytes are read weights-only (torch's default planner does not)."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = weights_only_load(value, what=f"object {fqn!r} in {ckpt_dir}")
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner


@contextlib.contextmanager
def _safe_torch_dist_io(ckpt_dir: Path) -> Iterator[None]:
    """mcore's torch_dist strategy builds its reader and planner internally; swap in the safe ones while it runs
    (one load at a time, on the calling thread)."""
    import megatron.core.dist_checkpointing.strategies.torch as mcore_torch

    reader_cls, planner_cls = _safe_reader_cls(), _safe_planner_cls(ckpt_dir)
    saved = mcore_torch._get_filesystem_reader, mcore_torch.MCoreLoadPlanner
    mcore_torch._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: reader_cls(checkpoint_dir)
    mcore_torch.MCoreLoadPlanner = planner_cls
    try:
        yield
    finally:
        mcore_torch._get_filesystem_reader, mcore_torch.MCoreLoadPlanner = saved


def _strategies(ckpt_dir: Path):
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir):
            with _safe_torch_dist_io(ckpt_dir):
                return super().load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            with _safe_torch_dist_io(ckpt_dir):
                return super().load_tensors_metadata(checkpoint_dir, metadata)

        def load_sharded_metadata(self, checkpoint_dir):
            with _safe_torch_dist_io(ckpt_dir):
                return super().load_sharded_metadata(checkpoint_dir)

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            path = Path(checkpoint_dir) / "common.pt"
            return weights_only_load(path, what=str(path))

        def load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
            raise CheckpointError(f"checkpoint: {checkpoint_dir} stores objects as separate pickles, a format "
                                  "verl_mega does not read; re-save it with the torch_dist backend")

    return SafeTorchDistLoadStrategy(), SafeCommonLoadStrategy()


def load_dist(sharded_state_dict: dict, ckpt_dir: str | Path) -> dict:
    """``megatron.core.dist_checkpointing.load`` with the safe readers above (collective, like mcore's)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    ckpt_dir = Path(ckpt_dir)
    check_dist_checkpoint(ckpt_dir)  # refusals surface here, not inside torch's error collection
    sharded, common = _strategies(ckpt_dir)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(ckpt_dir), sharded_strategy=sharded,
                                       common_strategy=common)
    except (Exception, CheckpointException) as exc:  # many types for missing or corrupt shards
        found = [e for e in exception_chain(exc) if isinstance(e, CheckpointError)]
        ours = next((e for e in found if isinstance(e, UnsafeCheckpointError)), found[0] if found else None)
        if ours is not None:  # our own one-line error, possibly wrapped by torch's per-rank collection
            raise ours from None
        raise CheckpointError(f"checkpoint: cannot load {ckpt_dir} ({type(exc).__name__}: {_first_line(exc)}); "
                              "the checkpoint is incomplete, corrupt or belongs to another model") from None
