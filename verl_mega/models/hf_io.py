"""Streaming HF safetensors reader/writer: tensors (or row/column slices of them) are read one at a time from
memory-mapped files, so no process ever holds a whole large checkpoint."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

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
        self._header: dict[str, dict[str, Any]] = {}  # name → {"dtype", "shape", …}, from the file headers
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
            self._header.update(_checked_header(fpath))
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
        """The tensor's shape, from its file's header (no tensor data is read)."""
        return list(self._entry(name)["shape"])

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name (``F32``, ``BF16``, ``F8_E4M3``, …), from its file's header."""
        return self._entry(name)["dtype"]

    def _entry(self, name: str) -> dict[str, Any]:
        if name not in self._where:
            raise CheckpointError(
                f"checkpoint: tensor {name!r} missing from {self.path}; the checkpoint does not match the "
                "model config (wrong model, or an incomplete export)"
            )
        return self._header[name]

    def _slice(self, name: str):
        self._entry(name)
        return self._handles[self._where[name]].get_slice(name)

    def get(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor, or only rows [a, b) / columns [a, b) of it (read lazily from the memory-mapped file)."""
        sl = self._slice(name)
        if rows is not None:
            return sl[rows[0]:rows[1]]
        if cols is not None:
            return sl[:, cols[0]:cols[1]]
        return sl[:]


def _checked_header(fpath: Path) -> dict[str, dict[str, Any]]:
    """The file's tensor entries; detects truncation: the data section must be as long as the header's largest
    offset says."""
    with open(fpath, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if fpath.stat().st_size < 8 + header_len + end:
        raise CheckpointError(f"checkpoint: {fpath} is truncated ({fpath.stat().st_size} bytes); re-export it")
    return header


def write_hf_checkpoint(
    out_dir: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int = 2 * 1024**3
) -> str:
    """Write an HF safetensors checkpoint (sharded + index when larger than one shard) from a tensor stream; returns
    the name of the dtype that holds most of the bytes written (what config.json should say, see
    :func:`config_with_dtype`).

    Only one shard's worth of tensors is held at a time.
    """
    out_dir = Path(out_dir)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    by_dtype: Counter[torch.dtype] = Counter()
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
        by_dtype[tensor.dtype] += nbytes
    flush()
    if len(names) == 1:
        os.replace(out_dir / names[0], out_dir / "model.safetensors")
    else:
        total = sum((out_dir / n).stat().st_size for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return str(by_dtype.most_common(1)[0][0]).removeprefix("torch.") if by_dtype else "float32"


def config_with_dtype(hf_cfg: dict[str, Any], dtype: str) -> dict[str, Any]:
    """``hf_cfg`` saying the weights are ``dtype`` (e.g. "bfloat16"): vLLM and transformers load a model in the
    dtype config.json names, so it must be the one written, not the source's. transformers ≥ 5 writes ``dtype``,
    older versions ``torch_dtype``; whichever the config has is set (``torch_dtype``, which both read, if none)."""
    keys = [k for k in ("dtype", "torch_dtype") if k in hf_cfg] or ["torch_dtype"]
    return {**hf_cfg, **{k: dtype for k in keys}}
