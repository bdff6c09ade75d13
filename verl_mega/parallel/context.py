"""Which sequence positions a context-parallel rank holds (Megatron's load-balanced split), for padded rows and for
packed (THD) sequences."""

from __future__ import annotations

from verl_mega.parallel.placement import PlacementError


def context_chunks(seq_len: int, cp: int, cp_rank: int) -> list[int]:
    """Sequence positions a context-parallel rank holds: of 2·cp equal chunks, chunks ``cp_rank`` and
    ``2·cp − 1 − cp_rank`` (Megatron's load-balanced split: every rank gets as much of the causal triangle)."""
    if seq_len % (2 * cp):
        raise PlacementError(f"context parallelism: sequence length {seq_len} is not a multiple of 2·cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return list(range(first, first + chunk)) + list(range(second, second + chunk))


def packed_context_chunks(cu_seqlens: list[int], cp: int, cp_rank: int) -> list[int]:
    """Positions of a pack (THD; ``cu_seqlens`` marks its sequences, each a multiple of 2·cp long) that a
    context-parallel rank holds: :func:`context_chunks` of every sequence, shifted to where it starts."""
    out: list[int] = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        out += [start + p for p in context_chunks(end - start, cp, cp_rank)]
    return out
