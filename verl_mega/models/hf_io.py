"""Streaming HF safetensors reader/writer: tensors (or row/column slices of them) are read one at a time from
memory-mapped files, so no process ever holds a whole large checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and the fix."""


class HFCheckpointReader:
    """Read tensors from an HF model directory (single ``model.safetensors`` or an indexed shard set)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise CheckpointError(f"checkpoint: {index} is unreadable ({exc}); re-export the model") from None
            files = sorted(set(weight_map.values()))
        elif single.exists():
            files, weight_map = ["model.safetensors"], None
        else:
            raise CheckpointError(
                f"checkpoint: no model.safetensors or model.safetensors.index.json in {self.path}; "
                "convert .bin weights to safetensors first (only safetensors are loaded, for safety)"
            )
        self._handles = {}
        self._where: dict[str, str] = {}
        for fname in files:
            fpath = self.path / fname
            if not fpath.exists():
                raise CheckpointError(f"checkpoint: shard {fpath} listed in the index is missing; re-download it")
            try:
                handle = safe_open(str(fpath), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for truncated headers
                raise CheckpointError(
                    f"checkpoint: {fpath} is truncated or corrupt ({type(exc).__name__}: {exc}); re-export it"
                ) from None
            self._handles[fname] = handle
            for key in handle.keys():
                self._where[key] = fname
            _check_size(fpath, handle)
        if weight_map is not None:
            missing = sorted(k for k, f in weight_map.items() if self._where.get(k) != f)
            if missing:
                raise CheckpointError(
                    f"checkpoint: {len(missing)} tensors listed in the index are absent from their shard "
                    f"(first: {missing[0]}); the checkpoint is incomplete"
                )

    def keys(self) -> list[str]:
        return sorted(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def _slice(self, name: str):
        if name not in self._where:
            raise CheckpointError(
                f"checkpoint: tensor {name!r} missing from {self.path}; the checkpoint does not match the "
                "model config (wrong model, or an incomplete export)"
            )
        return self._handles[self._where[name]].get_slice(name)

    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only rows [a, b) / columns [a, b) of it (read lazily from the memory-mapped file)."""
        sl = self._slice(name)
        if rows is not None:
            return sl[rows[0]:rows[1]]
        if cols is not None:
            return sl[:, cols[0]:cols[1]]
        return sl[:]


def _check_size(fpath: Path, handle) -> None:
    """Detect truncation: the data section must be as long as the header's largest offset says."""
    with open(fpath, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if fpath.stat().st_size < 8 + header_len + end:
        raise CheckpointError(f"checkpoint: {fpath} is truncated ({fpath.stat().st_size} bytes); re-export it")


class AtomicDir:
    """Write into a temporary sibling directory and rename it into place on success (no partial output)."""

    def __init__(self, final: str | Path, overwrite: bool = False) -> None:
        self.final = Path(final)
        self.overwrite = overwrite
        parent = self.final
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise CheckpointError(f"output: {parent} is a file, not a directory; choose a new --output directory")
        if self.final.exists() and any(self.final.iterdir()) and not overwrite:
            raise CheckpointError(f"output: {self.final} exists and is not empty; choose a new --output directory")

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.tmp-", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)


def write_hf_checkpoint(
    out_dir: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int = 2 * 1024**3
) -> None:
    """Write an HF safetensors checkpoint (sharded + index when larger than one shard) from a tensor stream.

    Only one shard's worth of tensors is held at a time.
    """
    out_dir = Path(out_dir)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    weight_map: dict[str, str] = {}
    names: list[str] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            fname = f"model-{len(names) + 1:05d}.safetensors"
            save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
            names.append(fname)
            weight_map.update({k: fname for k in shard})
            shard, shard_bytes = {}, 0

    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[name] = tensor.contiguous()
        shard_bytes += nbytes
    flush()
    if len(names) == 1:
        os.replace(out_dir / names[0], out_dir / "model.safetensors")
    else:
        total = sum((out_dir / n).stat().st_size for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))

