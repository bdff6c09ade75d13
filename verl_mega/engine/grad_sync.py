"""The data-parallel gradient sync's step between islands in a lower precision (``parallel.dp_cross_island_dtype``).

With data-parallel islands (``parallel.dp_hierarchy``) Megatron-Core's partial distributed optimizer reduce-scatters
each gradient bucket inside an island, then all-reduces every rank's shard across the islands (its
``inter_dist_opt`` group) in the gradient buffer's dtype, fp32. ``bf16`` and ``fp8`` replace that all-reduce only:

1. each rank cuts its fp32 shard into one piece per island and encodes every piece (bf16: rounded to nearest; fp8:
   e4m3 with one fp32 scale per block of ``FP8_BLOCK`` values, the block's largest magnitude mapped to 448);
2. an all-to-all hands piece j of every island to the rank of island j;
3. that rank decodes the pieces and adds them in fp32, in island order;
4. it encodes the sum, and an all-gather hands every encoded sum to every island, where it is decoded.

Nothing is summed in the low precision, and every island decodes the same bytes, so the optimizer instances stay
identical. The wire carries 2·(I − 1)/I × the encoded shard per rank, as a ring all-reduce of the encoded shard
would. The error of one element against the exact sum of the islands' fp32 partial sums x_i is bounded by
:func:`error_bound` (docs/performance.md); ``tests/unit/test_grad_sync.py`` holds it to a float64 reference.

The step is installed on Megatron's own bucket groups (:func:`install_cross_island_step`): their gradient sync runs
as before inside the island, then this step runs instead of their fp32 all-reduce. Megatron stays unforked.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import torch
import torch.distributed as dist

from verl_mega.parallel.wire import FP8_BLOCK, wire_bytes

E4M3_MAX = 448.0
# Largest error of rounding one value, relative (normal numbers; u = 2^-p for p significant bits) and, for fp8, in
# units of the block's scale (half the spacing of e4m3's subnormals, 2^-9)
_UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp8": 2.0 ** -4}
_FP8_SUBNORMAL_HALF_SPACING = 2.0 ** -10
LOSSY_DTYPES = ("bf16", "fp8")


def encode(values: torch.Tensor, dtype: str) -> torch.Tensor:
    """fp32 values (1-D) → their bytes on the wire, a uint8 tensor of :func:`wire_bytes` length."""
    values = values.float().contiguous()
    if dtype == "bf16":
        return values.to(torch.bfloat16).view(torch.uint8)
    if dtype != "fp8":
        raise ValueError(f"encode: dtype {dtype!r} is not bf16 or fp8")
    n = values.numel()
    blocks = math.ceil(n / FP8_BLOCK)
    padded = torch.zeros(blocks * FP8_BLOCK, dtype=torch.float32, device=values.device)
    padded[:n] = values
    padded = padded.view(blocks, FP8_BLOCK)
    scale = padded.abs().amax(dim=1) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = (padded / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1)
    return torch.cat([codes, scale.view(torch.uint8)])


def decode(payload: torch.Tensor, dtype: str, numel: int) -> torch.Tensor:
    """The inverse of :func:`encode`: ``numel`` fp32 values."""
    if dtype == "bf16":
        return payload.view(torch.bfloat16).float()[:numel]
    blocks = math.ceil(numel / FP8_BLOCK)
    codes = payload[:blocks * FP8_BLOCK].view(torch.float8_e4m3fn).float().view(blocks, FP8_BLOCK)
    scale = payload[blocks * FP8_BLOCK:].view(torch.float32)
    return (codes * scale[:, None]).reshape(-1)[:numel]


def sum_decoded(pieces: Iterable[torch.Tensor]) -> torch.Tensor:
    """Decoded pieces of the islands added in fp32, in island order (the same order on every rank)."""
    total = None
    for piece in pieces:
        total = piece.clone() if total is None else total.add_(piece)
    return total


def error_bound(partials: torch.Tensor, dtype: str) -> torch.Tensor:
    """Per element, the largest |result − Σ_i x_i| the lossy step can give, for the islands' partial sums ``partials``
    [I, n] (float64 math). With u the unit roundoff (bf16 2^-8, fp8 2^-4), v = 2^-24 (fp32), s' = Σ_i Q(x_i) summed
    in fp32 and γ = (I − 1)·v / (1 − (I − 1)·v):

        |Q(x_i) − x_i| ≤ u·|x_i| + a_i          |s' − Σ_i Q(x_i)| ≤ γ·Σ_i |Q(x_i)|          |Q(s') − s'| ≤ u·|s'| + a'

    so |Q(s') − Σ x_i| ≤ u·M + (γ + u·(1 + γ))·Σ_i (|x_i| + u·|x_i| + a_i) + a', M = Σ|x_i|. In bf16 a = 0. In fp8 a
    value is divided by its 128-value block's scale S (the block's largest magnitude / 448) and multiplied back in
    fp32 (2·v relative), and a quotient below e4m3's smallest normal loses up to e = 2^-10 of S: a_i = 2v·(1 + u)·
    |x_i| + e·S_i, with S_i the scale of x_i's block and S' that of the sum's block (bounded by the block maximum of
    (1 + γ)·Σ_i (1 + u)·|x_i| + a_i)."""
    x = partials.double()
    islands = x.shape[0]
    u, v = _UNIT_ROUNDOFF[dtype], 2.0 ** -24
    gamma = (islands - 1) * v / (1 - (islands - 1) * v)
    mag = x.abs().sum(dim=0)
    if dtype == "bf16":
        return u * mag + (gamma + u * (1 + gamma)) * (1 + u) * mag
    e = _FP8_SUBNORMAL_HALF_SPACING

    def block_scale(t: torch.Tensor) -> torch.Tensor:  # per element: its block's largest magnitude / 448
        n = t.shape[-1]
        blocks = math.ceil(n / FP8_BLOCK)
        padded = torch.zeros(*t.shape[:-1], blocks * FP8_BLOCK, dtype=t.dtype)
        padded[..., :n] = t.abs()
        amax = padded.view(*t.shape[:-1], blocks, FP8_BLOCK).amax(dim=-1) / E4M3_MAX
        return amax.repeat_interleave(FP8_BLOCK, dim=-1)[..., :n]

    slack = 2 * v * (1 + u) * x.abs() + e * block_scale(x)  # a_i
    decoded = ((1 + u) * x.abs() + slack).sum(dim=0)  # ≥ Σ_i |Q(x_i)|
    sum_scale = block_scale(((1 + gamma) * decoded)[None])[0]
    final = 2 * v * (1 + u) * (1 + gamma) * decoded + e * sum_scale  # a'
    return u * mag + slack.sum(dim=0) + (gamma + u * (1 + gamma)) * decoded + final


def cross_island_all_reduce(shard: torch.Tensor, group: Any, dtype: str) -> None:
    """Sum the fp32 ``shard`` over ``group`` (one rank per island) in place, with ``dtype`` on the wire."""
    islands = dist.get_world_size(group)
    if islands == 1:
        return
    n = shard.numel()
    piece = math.ceil(n / islands)
    flat = torch.zeros(piece * islands, dtype=torch.float32, device=shard.device)
    flat[:n] = shard.view(-1)
    size = wire_bytes(piece, dtype)
    send = torch.cat([encode(p, dtype) for p in flat.view(islands, piece)])
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    mine = sum_decoded(decode(r, dtype, piece) for r in received.view(islands, size))
    gathered = torch.empty(islands * size, dtype=torch.uint8, device=shard.device)
    dist.all_gather_into_tensor(gathered, encode(mine, dtype), group=group)
    out = torch.cat([decode(g, dtype, piece) for g in gathered.view(islands, size)])
    shard.view(-1).copy_(out[:n])


class _CrossIslandStep:
    """A bucket group's gradient sync with the lossy step between islands: Megatron's reduce-scatter inside the
    island (its config told one optimizer instance, so it skips its own fp32 all-reduce across islands), then
    :func:`cross_island_all_reduce` of each bucket's shard."""

    def __init__(self, bucket_group: Any, group: Any, dtype: str) -> None:
        missing = [a for a in ("buckets", "cached_grad_buffer_shard_list", "intra_distributed_optimizer_instance_rank",
                               "intra_distributed_optimizer_instance_size", "start_grad_sync", "ddp_config")
                   if not hasattr(bucket_group, a)]
        if missing:
            raise RuntimeError(f"parallel.dp_cross_island_dtype={dtype}: this Megatron-Core's bucket groups lack "
                               f"{missing} (written for 0.16); use parallel.dp_cross_island_dtype=fp32")
        cfg = bucket_group.ddp_config
        if cfg.overlap_grad_reduce or not cfg.use_distributed_optimizer:
            raise RuntimeError("the lossy cross-island step needs the distributed optimizer without overlapped "
                               "gradient reduction")
        self.bucket_group, self.group, self.dtype = bucket_group, group, dtype
        self._intra_only = bucket_group.start_grad_sync
        bucket_group.ddp_config = dataclasses.replace(cfg, num_distributed_optimizer_instances=1)
        bucket_group.start_grad_sync = self

    def __call__(self, force_all_reduce: bool | None = False) -> None:
        from megatron.core.distributed.param_and_grad_buffer import shard_buffer

        self._intra_only(force_all_reduce=force_all_reduce)
        bg = self.bucket_group
        for idx, bucket in enumerate(bg.buckets):  # the shard of each bucket this rank owns, as Megatron cuts it
            if bg.cached_grad_buffer_shard_list[idx] is None:
                bg.cached_grad_buffer_shard_list[idx] = shard_buffer(
                    bucket.grad_data, bg.intra_distributed_optimizer_instance_size)
            shard = bg.cached_grad_buffer_shard_list[idx][bg.intra_distributed_optimizer_instance_rank]
            cross_island_all_reduce(shard, self.group, self.dtype)


def install_cross_island_step(chunks: list[Any], group: Any, dtype: str) -> int:
    """Put the ``dtype`` step between islands into every bucket group of the DDP-wrapped ``chunks`` (dense and
    expert buffers alike: Megatron uses one inter-island group for both). fp32 leaves Megatron's own all-reduce.
    Returns the number of bucket groups changed."""
    if dtype == "fp32":
        return 0
    if dtype not in LOSSY_DTYPES:
        raise ValueError(f"parallel.dp_cross_island_dtype={dtype!r} is not one of fp32, bf16, fp8")
    count = 0
    for chunk in chunks:
        for bucket_group in list(chunk.bucket_groups) + list(chunk.expert_parallel_bucket_groups):
            _CrossIslandStep(bucket_group, group, dtype)
            count += 1
    return count
