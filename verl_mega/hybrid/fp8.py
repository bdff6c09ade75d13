"""FP8 rollout weights: each slice is quantized on the device while the weight sync writes it into vLLM.

Format: float8 e4m3 with one fp32 scale per output channel (row of the row-major [out, in] weight), the dequantized
weight being ``q · scale`` with ``scale = amax(|row|) / 448`` (e4m3's largest finite value). It is the format of
vLLM's compressed-tensors W8A8-FP8 linears (:data:`verl_mega.rollout.vllm_rollout.FP8_QUANTIZATION_CONFIG`), chosen
because a row's scale depends on that row alone:

* a fused parameter (``qkv_proj`` = [q_j; k_j; v_j], ``gate_up_proj`` = [gate_j; up_j]) is written slice by slice from
  different Megatron tensors and shards; with per-channel scales every slice quantizes on its own, in the copy that
  writes it, with no second pass over the fused tensor (a per-tensor scale would need the whole parameter's amax
  first, and re-quantizing every other slice whenever one changes);
* it is finer than one scale per tensor (an outlier row does not coarsen every other row) and coarser than 128×128
  blocks only along the input dimension.

The one case where a row is split across writes is a row-parallel weight (``o_proj``, ``down_proj``) built from m > 1
training shards (micro-DP gather): each shard holds a column block of every row, so the row's amax is the maximum
over the m shards, taken before any of them is written (:class:`Fp8Rows` receives them together).

vLLM keeps such a weight as the transpose of a row-major [out, in] tensor (``weight`` [in, out], strides (1, in));
``weight.t()`` is that row-major tensor, so the destination rows are plain contiguous views. The sync writes through
it and never re-runs vLLM's post-load processing on these layers (it would transpose the weight again).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from verl_mega.hybrid.convert import block_copies
from verl_mega.models.hf_config import ModelArch
from verl_mega.models.weights import ParamRule

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
# 1/448 rounded to fp32: a scale is amax · FP8_INV_MAX, the product torch computes for ``amax / 448`` on CUDA (a
# division by a scalar is a multiplication by its fp32 reciprocal there), here on every device and in the kernel
FP8_INV_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
# rows quantized per step: bounds the fp32 temporaries of one copy to ~64 MiB whatever the slice
_CHUNK_ELEMS = 1 << 24


def row_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-row dequantization scales from per-row amax (fp32): amax / 448, as ``amax · fp32(1/448)``; an all-zero row
    gets scale 1 (its codes are zeros, so any positive scale dequantizes it exactly)."""
    amax = amax.float()
    return torch.where(amax > 0, amax * FP8_INV_MAX, torch.ones_like(amax))


def _check_shapes(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> None:
    if dst.shape != src.shape or scale.shape != (*src.shape[:-1], 1):
        raise ValueError(f"fp8 quantize: source {tuple(src.shape)}, destination {tuple(dst.shape)}, scales "
                         f"{tuple(scale.shape)}")


def quantize_rows(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor) -> None:
    """``dst`` (e4m3) = ``src`` ([..., in], any float dtype) / ``scale`` ([..., 1]), rounded to nearest even and
    saturated at ±448, in chunks of leading rows so the fp32 temporaries stay small."""
    _check_shapes(dst, src, scale)
    step = max(1, _CHUNK_ELEMS // max(1, src[0].numel())) if src.dim() > 1 else 1
    if src.dim() == 1 or src.shape[0] <= step:
        dst.copy_((src.float() / scale).clamp_(-FP8_MAX, FP8_MAX))
        return
    for a in range(0, src.shape[0], step):
        dst[a:a + step].copy_((src[a:a + step].float() / scale[a:a + step]).clamp_(-FP8_MAX, FP8_MAX))


def _launch(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor, *, given_scale: bool) -> None:
    """One Triton kernel over the rows of ``src`` ([..., in], any strides): per row, its amax and scale (unless
    ``given_scale``: read from ``scale``), then its e4m3 codes into ``dst``."""
    cols = src.shape[-1]
    src2, dst2, scale2 = src.reshape(-1, cols), dst if dst.dim() == 2 else dst.view(-1, cols), scale.view(-1, 1)
    rows = src2.shape[0]
    if rows == 0 or cols == 0:
        return
    one_block = cols <= _ONE_BLOCK_COLS
    block = _next_power_of_2(cols) if one_block else _LOOP_BLOCK
    _rows_to_e4m3()[(rows,)](src2, dst2, scale2, cols, src2.stride(0), src2.stride(1), dst2.stride(0), dst2.stride(1),
                             scale2.stride(0), FP8_MAX, FP8_INV_MAX, BLOCK=block, ONE_BLOCK=one_block,
                             GIVEN_SCALE=given_scale, num_warps=4 if block <= 2048 else 8)


# a row up to this long is held in registers (read once); a longer one is read twice (amax, then codes) in blocks
_ONE_BLOCK_COLS = 8192
_LOOP_BLOCK = 4096


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _rows_to_e4m3():
    """The quantizer as one Triton kernel (built on first use: Triton comes with CUDA builds of torch only). One
    program per row; the scale is :func:`row_scales`' product, the codes' division is IEEE round-to-nearest
    (``div_rn``) and the cast rounds to nearest even, so codes and scales are bit for bit those of :func:`row_scales`
    + :func:`quantize_rows` (tests/gpu). A kernel whose scale was the division amax / 448 gave, on an H200, the codes
    of vLLM's per-token kernel (x · 448 / amax), which differ from these in 1.7e-4 of a 7B model's codes (one e4m3
    step at near-ties) and failed the sync's float64 check."""
    import triton
    import triton.language as tl

    @triton.jit
    def rows_to_e4m3(src, dst, scale, cols, src_row, src_col, dst_row, dst_col, scale_row, fp8_max, fp8_inv_max,
                     BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr, GIVEN_SCALE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        src += row * src_row
        dst += row * dst_row
        offs = tl.arange(0, BLOCK)
        if ONE_BLOCK:
            x = tl.load(src + offs * src_col, mask=offs < cols, other=0.0).to(tl.float32)
            if GIVEN_SCALE:
                s = tl.load(scale + row * scale_row)
            else:
                amax = tl.max(tl.abs(x), axis=0)
                s = tl.where(amax > 0, amax * fp8_inv_max, 1.0)
                tl.store(scale + row * scale_row, s)
            q = tl.clamp(tl.div_rn(x, s), -fp8_max, fp8_max)
            tl.store(dst + offs * dst_col, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=offs < cols)
        else:
            if GIVEN_SCALE:
                s = tl.load(scale + row * scale_row)
            else:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for start in range(0, cols, BLOCK):
                    idx = start + offs
                    x = tl.load(src + idx * src_col, mask=idx < cols, other=0.0).to(tl.float32)
                    acc = tl.maximum(acc, tl.abs(x))
                amax = tl.max(acc, axis=0)
                s = tl.where(amax > 0, amax * fp8_inv_max, 1.0)
                tl.store(scale + row * scale_row, s)
            for start in range(0, cols, BLOCK):
                idx = start + offs
                x = tl.load(src + idx * src_col, mask=idx < cols, other=0.0).to(tl.float32)
                q = tl.clamp(tl.div_rn(x, s), -fp8_max, fp8_max)
                tl.store(dst + idx * dst_col, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=idx < cols)

    return rows_to_e4m3


def use_kernel(src: torch.Tensor) -> bool:
    """The Triton kernel on CUDA: one launch and ~3 bytes moved per bf16 element where the eager path makes ~6 passes
    with fp32 temporaries (5x the plain copy on an H200) and ``torch.compile``'s kernels cost 89 us of host time a
    call (2.5x). It is deterministic (no atomics), so it also runs under ``torch.use_deterministic_algorithms``.
    Eager on other devices: the CPU sync is not bandwidth bound."""
    return src.is_cuda


def quantize_rows_into(dst: torch.Tensor, scale_out: torch.Tensor, src: torch.Tensor, *,
                       kernel: bool | None = None) -> None:
    """Quantize whole rows of ``src`` into e4m3 ``dst`` with per-row scales written to ``scale_out`` ([..., 1]).
    ``kernel``: the Triton kernel (default: :func:`use_kernel`); both give the same codes and scales."""
    _check_shapes(dst, src, scale_out)
    if use_kernel(src) if kernel is None else kernel:
        _launch(dst, src, scale_out, given_scale=False)
        return
    scale = row_scales(src.abs().amax(dim=-1, keepdim=True))
    scale_out.copy_(scale)
    quantize_rows(dst, src, scale)


def quantize_rows_with(dst: torch.Tensor, src: torch.Tensor, scale: torch.Tensor, *, kernel: bool | None = None
                       ) -> None:
    """:func:`quantize_rows`, through the Triton kernel where :func:`use_kernel` (or ``kernel``) says so."""
    if use_kernel(src) if kernel is None else kernel:
        _check_shapes(dst, src, scale)
        _launch(dst, src, scale.float(), given_scale=True)
        return
    quantize_rows(dst, src, scale)


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q · scale`` in fp32 (row-major [out, in] weight, [out, 1] scales)."""
    return weight.float() * scale.float()


class Fp8Rows:
    """A destination in vLLM's FP8 layout: e4m3 rows ``weight`` [rows, in] (row-major views of vLLM's transposed
    parameter) and their scales ``scale`` [rows, 1]. Stands where the sync's destination tensor stands: ``copy_``
    quantizes whole rows, indexing selects rows, and :func:`~verl_mega.hybrid.convert.block_copies` hands a
    generation block's slices to :meth:`quantized_copies`. ``record``: (dict, name) — every write adds the elements it
    wrote to ``dict[name]`` (slices inherit it), which is how a sync proves it wrote every FP8 parameter whole."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor,
                 record: tuple[dict[str, int], str] | None = None) -> None:
        if weight.dtype != FP8_DTYPE or weight.shape[:-1] != scale.shape[:-1] or scale.shape[-1] != 1:
            raise ValueError(f"Fp8Rows: weight {weight.dtype} {tuple(weight.shape)}, scale {tuple(scale.shape)}")
        self.weight, self.scale, self.record = weight, scale, record

    def _written(self) -> None:
        if self.record is not None:
            counts, name = self.record
            counts[name] = counts.get(name, 0) + self.weight.numel()

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    def __getitem__(self, rows) -> "Fp8Rows":
        return Fp8Rows(self.weight[rows], self.scale[rows], self.record)

    def copy_(self, src: torch.Tensor) -> "Fp8Rows":
        """Quantize whole rows: each row's scale is its own amax / 448."""
        quantize_rows_into(self.weight, self.scale, src)
        self._written()
        return self

    def quantized_copies(self, rule: ParamRule, shards: Sequence[torch.Tensor],
                         arch: ModelArch) -> list[tuple[object, object]]:
        """(destination, source) pairs writing generation block j of ``shards`` quantized: the same slices as the
        unquantized sync (:func:`block_copies` run on the e4m3 rows and, with the same structure, on the scales),
        each destination quantizing its source's rows as it copies them."""
        if rule.kind == "row" and len(shards) > 1:  # every row spans the m shards: one amax over all of them
            return [(_SplitRows(self, shards[0].shape[1]), tuple(shards))]
        weights = block_copies(rule, self.weight, shards, arch)
        placeholders = [torch.empty((s.shape[0], 1), device="meta") for s in shards]
        scales = block_copies(rule, self.scale, placeholders, arch)
        if len(weights) != len(scales):
            raise ValueError(f"fp8 block copies of {rule.kind}: {len(weights)} weight slices, {len(scales)} scale "
                             "slices")
        return [(Fp8Rows(w, s, self.record), src) for (w, src), (s, _) in zip(weights, scales)]


class _SplitRows:
    """Rows split by columns over m training shards (a row-parallel weight gathered over micro-DP): the rows' scale is
    the maximum amax over every shard, then each shard's column block is quantized with it."""

    def __init__(self, dest: Fp8Rows, cols: int) -> None:
        self.dest, self.cols = dest, cols

    def copy_(self, shards: Sequence[torch.Tensor]) -> "_SplitRows":
        amax = torch.stack([s.abs().amax(dim=-1, keepdim=True).float() for s in shards]).amax(dim=0)
        scale = row_scales(amax)
        self.dest.scale.copy_(scale)
        c = self.cols
        for i, shard in enumerate(shards):
            quantize_rows_with(self.dest.weight[:, i * c:(i + 1) * c], shard, scale)
        self.dest._written()
        return self
