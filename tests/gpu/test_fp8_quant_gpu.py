"""The quantizing sync's Triton kernel (hybrid/fp8.py) on a GPU: bit for bit the eager quantizer's codes and scales,
and within the e4m3 format of a float64 reference, for rows held in registers and rows read in blocks, strided
sources and destinations (vLLM's transposed parameter), given scales (a row-parallel weight gathered over micro-DP),
and 1-D and 3-D slices."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_fp8_sync import assert_quantized  # noqa: E402

from verl_mega.hybrid import fp8  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _weights(rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64) * torch.exp(3 * torch.randn(rows, 1, generator=g))
    w[1] = 0.0  # an all-zero row: scale 1, zero codes
    w[2, cols // 3] = 1e3 * w[2].abs().max()  # an outlier: the rest of its row falls into e4m3's subnormals
    w[3] *= 1e-30  # tiny magnitudes
    w[4, :] = -2.5  # a constant row: every code is -448
    return w.to(dtype).cuda()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [96, 3584, 8192, 18944])  # one block (held in registers) and looped blocks
def test_kernel_equals_eager_and_float64(dtype, cols):
    rows = 64
    w = _weights(rows, cols, dtype, seed=cols)
    kernel = torch.zeros(cols, rows, dtype=fp8.FP8_DTYPE, device="cuda").t()  # rows of a transposed parameter
    kernel_scale = torch.empty(rows, 1, device="cuda")
    eager = torch.empty(rows, cols, dtype=fp8.FP8_DTYPE, device="cuda")
    eager_scale = torch.empty(rows, 1, device="cuda")
    fp8.quantize_rows_into(kernel, kernel_scale, w)  # the default on CUDA
    fp8.quantize_rows_into(eager, eager_scale, w, kernel=False)
    assert _same(kernel, eager) and torch.equal(kernel_scale, eager_scale)
    assert_quantized(kernel.cpu(), kernel_scale.cpu(), w.cpu(), f"{dtype} × {cols}")
    assert kernel_scale[1].item() == 1.0 and (kernel[4].float() == -448).all()


def test_kernel_given_scales_strided_source_and_shapes():
    w = _weights(48, 10000, torch.bfloat16, seed=7)
    eager = torch.empty(48, 10000, dtype=fp8.FP8_DTYPE, device="cuda")
    scale = torch.empty(48, 1, device="cuda")
    fp8.quantize_rows_into(eager, scale, w, kernel=False)
    blocks = torch.zeros(48, 10000, dtype=fp8.FP8_DTYPE, device="cuda")
    for a, b in ((0, 4000), (4000, 10000)):  # column blocks of a row-parallel weight, each with the rows' scales
        fp8.quantize_rows_with(blocks[:, a:b], w[:, a:b], scale)
    assert _same(blocks, eager)
    src = w.t().contiguous().t()[:, 100:900]  # a source with column stride > 1
    got, got_scale = torch.empty(48, 800, dtype=fp8.FP8_DTYPE, device="cuda"), torch.empty(48, 1, device="cuda")
    want, want_scale = torch.empty_like(got), torch.empty_like(got_scale)
    fp8.quantize_rows_into(got, got_scale, src)
    fp8.quantize_rows_into(want, want_scale, src, kernel=False)
    assert _same(got, want) and torch.equal(got_scale, want_scale)
    vec = w[5]  # one row: scales of shape (1,)
    got, got_scale = torch.empty(10000, dtype=fp8.FP8_DTYPE, device="cuda"), torch.empty(1, device="cuda")
    want, want_scale = torch.empty_like(got), torch.empty_like(got_scale)
    fp8.quantize_rows_into(got, got_scale, vec)
    fp8.quantize_rows_into(want, want_scale, vec, kernel=False)
    assert _same(got, want) and torch.equal(got_scale, want_scale)
    cube = w[:48].reshape(4, 12, 10000)  # leading dimensions fold into rows
    got, got_scale = torch.empty(4, 12, 10000, dtype=fp8.FP8_DTYPE, device="cuda"), torch.empty(4, 12, 1, device="cuda")
    fp8.quantize_rows_into(got, got_scale, cube)
    assert _same(got.reshape(48, 10000), eager) and torch.equal(got_scale.reshape(48, 1), scale)
    with pytest.raises(ValueError, match="fp8 quantize"):
        fp8.quantize_rows_into(torch.empty(2, 3, dtype=fp8.FP8_DTYPE, device="cuda"), torch.empty(2, 1, device="cuda"),
                               torch.ones(2, 4, device="cuda"))
