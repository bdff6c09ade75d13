"""The wire formats of the cross-island gradient step (parallel.dp_cross_island_dtype) and the bytes each puts on
the wire: fp32 is Megatron's own all-reduce; bf16 and fp8 (e4m3 with a scale per block) are
verl_mega/engine/grad_sync.py's."""

from __future__ import annotations

CROSS_ISLAND_DTYPES = ("fp32", "bf16", "fp8")
FP8_BLOCK = 128  # values per fp8 scale


def wire_bytes(numel: int, dtype: str) -> int:
    """Bytes that encode ``numel`` values between islands: 4 per value in fp32, 2 in bf16, in fp8 1 per value
    (padded to whole blocks of FP8_BLOCK) plus a 4-byte scale per block."""
    if dtype == "fp32":
        return 4 * numel
    if dtype == "bf16":
        return 2 * numel
    if dtype == "fp8":
        blocks = -(-numel // FP8_BLOCK)
        return blocks * FP8_BLOCK + 4 * blocks
    raise ValueError(f"unknown cross-island dtype {dtype!r}; one of {', '.join(CROSS_ISLAND_DTYPES)}")
