"""Bytes of the data-parallel gradient sync per GPU and optimizer step, inside islands and between them.

An island is a set of GPUs joined by fast links: an NVLink island, or a whole node when its GPUs sit on one NVSwitch
(``parallel.dp_hierarchy``, docs/topology.md). The counts follow the ring algorithms of NCCL (and gloo), in the
"bus bytes" convention: a rank of an m-rank group sends (m − 1)/m × the buffer in a reduce-scatter or an all-gather,
2·(m − 1)/m × it in an all-reduce, and (m − 1)/m × its input in an all-to-all. A ring visits the members of one
island one after the other, so with k members per island, 1 hop in k leaves the island.

* **flat** (Megatron's distributed optimizer over the whole data-parallel group of m ranks): a reduce-scatter of the
  fp32 gradients and an all-gather of the parameters over all m. Each rank sends (m − 1)/m × (4 + param bytes) × N;
  with k members of the group per island, 1/k of that leaves the island on average: per GPU (and per NIC, since the
  rings' island-leaving hops are spread over the island's GPUs) (m − 1)/m × (4 + pb) × N / k.
* **hierarchical** (I islands per group, k = m/I members in each: Megatron's partial distributed optimizer): the
  reduce-scatter and the all-gather run inside the island, (k − 1)/k × (4 + pb) × N on its links; then each rank's
  shard of N/k gradients is all-reduced across the I islands, every hop leaving the island:
  2·(I − 1)/I × wire bytes of N/k values (fp32: 4 per value; bf16: 2; fp8: 1 plus a 4-byte scale per 128).

So fp32 across islands sends 2·4/(4 + pb) = 4/3 × the flat mode's bytes between islands (bf16 parameters): it does
not save bytes; its gains are fewer ranks per ring (latency: 2·(I − 1) steps instead of 2·(m − 1)) and a collective
that in-network reduction can serve. bf16 across sends 2/3 of the flat bytes, fp8 about 1/3.
``tests/distributed/test_dp_islands_run.py`` counts what a 4-rank job sends and compares it with these numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from verl_mega.parallel.placement import Pool
from verl_mega.parallel.wire import wire_bytes


@dataclass(frozen=True)
class DPSyncTraffic:
    """One data-parallel group's sync of ``elements`` values per rank and optimizer step."""

    elements: int
    group: int  # m: ranks in the data-parallel group
    per_island: int  # k: of them in one island
    islands: int  # I: islands a hierarchical sync reduces across (1: flat)
    sent_bytes: float  # per GPU, on every link
    cross_bytes: float  # per GPU (and NIC), on links that leave the island
    cross_dtype: str
    formula: str

    @property
    def hierarchical(self) -> bool:
        return self.islands > 1

    @property
    def inside_bytes(self) -> float:
        """Per GPU, on links inside the island."""
        return self.sent_bytes - self.cross_bytes

    def seconds(self, *, inside_bps: float, cross_bps: float, latency_s: float) -> float:
        """Flat: one ring, as fast as its slower kind of hop; hierarchical: the island's reduce-scatter and
        all-gather, then the all-reduce (or all-to-all + all-gather) between islands. α per ring step."""
        if self.group == 1:
            return 0.0
        if not self.hierarchical:
            steps = 2 * (self.group - 1)
            return steps * latency_s + max(self.sent_bytes / inside_bps, self.cross_bytes / cross_bps)
        steps = 2 * (self.per_island - 1) + 2 * (self.islands - 1)
        return steps * latency_s + self.inside_bytes / inside_bps + self.cross_bytes / cross_bps


def dp_sync_traffic(*, elements: int, group: int, per_island: int, islands: int = 1, grad_bytes: int = 4,
                    param_bytes: int = 2, cross_dtype: str = "fp32") -> DPSyncTraffic:
    """Bytes per GPU of one optimizer step's gradient reduce-scatter and parameter all-gather for ``elements``
    values per rank, over a data-parallel group of ``group`` ranks with ``per_island`` of them in each island (the
    whole group when it fits one), flat (``islands`` = 1) or cut into ``islands`` (each of group/islands ranks)."""
    m, k = group, min(per_island, group)
    both = grad_bytes + param_bytes
    if m == 1:
        return DPSyncTraffic(elements, 1, 1, 1, 0.0, 0.0, "fp32", "dp = 1: nothing to synchronise")
    if islands == 1:
        if cross_dtype != "fp32":
            raise ValueError(f"cross_dtype={cross_dtype} needs a hierarchical sync (islands > 1)")
        sent = (m - 1) / m * both * elements
        cross = 0.0 if k >= m else sent / k
        how = (f"flat: (m−1)/m × ({grad_bytes} B grads + {param_bytes} B params) × {elements:,}, m={m}"
               + (f", 1/k of it leaving the island, k={k}" if k < m else ", inside one island"))
        return DPSyncTraffic(elements, m, k, 1, sent, cross, "fp32", how)
    if m % islands:
        raise ValueError(f"{islands} islands do not divide a data-parallel group of {m}")
    k = m // islands
    inside = (k - 1) / k * both * elements
    shard = math.ceil(elements / k)
    if cross_dtype == "fp32":  # Megatron's ring all-reduce of the shard
        cross = 2 * (islands - 1) / islands * wire_bytes(shard, "fp32")
    else:  # all-to-all out and all-gather back of I encoded pieces of ceil(shard/I) values
        cross = 2 * (islands - 1) * wire_bytes(math.ceil(shard / islands), cross_dtype)
    how = (f"hierarchical: (k−1)/k × ({grad_bytes} + {param_bytes}) B × {elements:,} inside, k={k}; "
           f"2·(I−1)/I × {cross_dtype} shard of N/k across, I={islands}")
    return DPSyncTraffic(elements, m, k, islands, inside + cross, cross, cross_dtype, how)


def pool_dp_sync(pool: Pool, *, dense: int, experts: int = 0, param_bytes: int = 2, island_gpus: int
                 ) -> tuple[DPSyncTraffic, DPSyncTraffic]:
    """(dense, routed-expert) sync of one rank of ``pool`` holding ``dense`` and ``experts`` parameters, with
    islands of ``island_gpus`` GPUs: the dense values over the dp·cp group (stride tp), the experts over the expert
    data-parallel group (stride etp·ep), both cut into ``pool.dp_islands`` islands."""
    kw = dict(islands=pool.dp_islands, grad_bytes=4, param_bytes=param_bytes, cross_dtype=pool.dp_cross_island_dtype)
    group = pool.dp * pool.cp
    dense_sync = dp_sync_traffic(elements=dense, group=group, per_island=max(1, island_gpus // pool.tp), **kw)
    expert_sync = dp_sync_traffic(elements=experts, group=pool.edp if experts else 1,
                                  per_island=max(1, island_gpus // (pool.etp * pool.ep)), **kw) if experts else \
        dp_sync_traffic(elements=0, group=1, per_island=1)
    return dense_sync, expert_sync
