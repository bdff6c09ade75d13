"""TopologyAwareScheduler: map Megatron ranks onto (node, GPU) so that bandwidth-hungry groups stay on NVLink.

Launchers number ranks node by node (rank = node_rank * gpus_per_node + local_rank) and Megatron builds its
groups from rank numbers in the order tp-cp-dp-pp (``megatron.core.parallel_state.RankGenerator``, default order
"tp-cp-ep-dp-pp", with ep=1 for the dense groups). The only freedom left is which physical GPU each local rank
drives. This module chooses that per-node device order so that

* every training TP group (``tp`` consecutive ranks) lies inside one NVLink island, on the strongest bonds;
* inside it, the 3D-HybridEngine generation TP groups (ranks strided by tp/gen_tp) and micro-DP groups (runs of
  tp/gen_tp consecutive ranks) get the best remaining bonds (generation TP all-reduces every decode step, the
  micro-DP all-gather runs once per train->generate switch, so generation TP is preferred);
* DP and PP groups then cross nodes as the rank order dictates.

When a TP group cannot fit an NVLink island it is placed by PCIe/NUMA locality and a warning says so. Every group
gets a bandwidth class in the report. Pure functions over parsed topologies: 1024-GPU layouts plan in one process.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import combinations, permutations
from typing import Sequence

from verl_mega.parallel.topology import Link, LinkKind, NodeTopology, parse_topology

__all__ = [
    "ParallelLayout",
    "GroupReport",
    "PlacementPlan",
    "TopologyAwareScheduler",
    "TopologyFallbackWarning",
    "megatron_rank_groups",
    "hybrid_engine_groups",
    "gather_node_topologies",
]

# Above this many GPUs per TP group, we do not search orderings inside a block (8! is the largest we brute-force).
_MAX_ORDER_SEARCH = 8
# Above this island size, partitioning an island with unequal bonds into TP blocks is greedy instead of exhaustive.
_MAX_PARTITION_SEARCH = 12


class TopologyFallbackWarning(UserWarning):
    """A group could not be placed inside one NVLink island."""


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Training layout (tp, cp, dp, pp) plus the generation TP size of the 3D-HybridEngine."""

    tp: int
    pp: int = 1
    cp: int = 1
    dp: int | None = None  # None: derived from the world size
    gen_tp: int | None = None  # None: same as tp (no resharding)

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "cp"):
            if getattr(self, key) < 1:
                raise ValueError(f"layout.{key} must be >= 1, got {getattr(self, key)}")
        if self.dp is not None and self.dp < 1:
            raise ValueError(f"layout.dp must be >= 1 or None (derived), got {self.dp}")
        tg = self.tp if self.gen_tp is None else self.gen_tp
        if tg < 1 or self.tp % tg:
            raise ValueError(f"layout.gen_tp={tg} must divide layout.tp={self.tp} (generation TP groups are "
                             f"formed inside each training TP group); pick a divisor of tp")

    @property
    def tg(self) -> int:
        return self.tp if self.gen_tp is None else self.gen_tp

    def resolve_dp(self, world_size: int) -> int:
        model_parallel = self.tp * self.cp * self.pp
        if world_size % model_parallel:
            raise ValueError(f"world size {world_size} is not divisible by tp*cp*pp={model_parallel}; "
                             f"change tp/cp/pp or the number of GPUs")
        dp = world_size // model_parallel
        if self.dp is not None and self.dp != dp:
            raise ValueError(f"layout.dp={self.dp} but world size {world_size} / (tp*cp*pp={model_parallel}) = {dp}; "
                             f"set dp to {dp} or leave it unset")
        return dp


def megatron_rank_groups(world_size: int, tp: int, cp: int, dp: int, pp: int) -> dict[str, list[tuple[int, ...]]]:
    """Rank groups in Megatron's default order tp-cp-(ep=1)-dp-pp: tp fastest, pp slowest."""
    if tp * cp * dp * pp != world_size:
        raise ValueError(f"tp*cp*dp*pp={tp * cp * dp * pp} != world size {world_size}")

    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + cp * (d + dp * p))

    return {
        "tp": [tuple(rank(t, c, d, p) for t in range(tp)) for p in range(pp) for d in range(dp) for c in range(cp)],
        "cp": [tuple(rank(t, c, d, p) for c in range(cp)) for p in range(pp) for d in range(dp) for t in range(tp)],
        "dp": [tuple(rank(t, c, d, p) for d in range(dp)) for p in range(pp) for c in range(cp) for t in range(tp)],
        "pp": [tuple(rank(t, c, d, p) for p in range(pp)) for d in range(dp) for c in range(cp) for t in range(tp)],
    }


def hybrid_engine_groups(tp_groups: Sequence[Sequence[int]], gen_tp: int) -> tuple[list[tuple[int, ...]],
                                                                                    list[tuple[int, ...]]]:
    """3D-HybridEngine groups (HybridFlow §5) inside each training TP group [r0..r_{t-1}].

    With m = t / gen_tp: generation TP groups take ranks strided by m ({r_j, r_{j+m}, ...}), micro-DP groups are
    consecutive runs of m ranks ({r_{k*m} .. r_{k*m+m-1}}). Example t=4, gen_tp=2: gen TP {0,2},{1,3};
    micro-DP {0,1},{2,3}. Each GPU then keeps its own training shard for generation.
    """
    gen, micro = [], []
    for group in tp_groups:
        t = len(group)
        if t % gen_tp:
            raise ValueError(f"gen_tp={gen_tp} must divide the TP group size {t}")
        m = t // gen_tp
        gen.extend(tuple(group[j::m]) for j in range(m))
        micro.extend(tuple(group[k * m:(k + 1) * m]) for k in range(gen_tp))
    return gen, micro


@dataclass(frozen=True)
class GroupReport:
    """Where one communication group landed and the slowest link it crosses."""

    kind: str  # tp, gen_tp, micro_dp, cp, dp, pp
    ranks: tuple[int, ...]
    devices: tuple[tuple[int, int], ...]  # (node, local GPU) per rank
    link: str  # worst link label: NV18, PIX, ..., SYS, or NET when the group spans nodes
    bandwidth_class: str  # human-readable class of that link
    in_nvlink_island: bool


@dataclass(frozen=True)
class PlacementPlan:
    layout: ParallelLayout
    num_nodes: int
    gpus_per_node: int
    dp: int
    device_order: tuple[tuple[int, ...], ...]  # [node][local_rank] -> local GPU index
    groups: dict[str, tuple[tuple[int, ...], ...]]
    reports: dict[str, tuple[GroupReport, ...]]
    islands: tuple[tuple[tuple[int, ...], ...], ...]  # [node] -> NVLink islands
    decisions: tuple[str, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def device_for(self, rank: int) -> tuple[int, int]:
        """(node, local GPU) that global ``rank`` drives."""
        node, local_rank = divmod(rank, self.gpus_per_node)
        return node, self.device_order[node][local_rank]

    def cuda_device(self, node_rank: int, local_rank: int) -> int:
        """The CUDA ordinal a process should ``torch.cuda.set_device`` to (before any CUDA_VISIBLE_DEVICES)."""
        return self.device_order[node_rank][local_rank]

    def cuda_visible_devices(self, node_rank: int) -> str:
        """CUDA_VISIBLE_DEVICES for a node so that local_rank i sees the chosen GPU as device i."""
        return ",".join(str(g) for g in self.device_order[node_rank])

    def to_json(self) -> dict:
        return {
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.num_nodes,
            "world_size": self.world_size,
            "layout": {"tp": self.layout.tp, "cp": self.layout.cp, "pp": self.layout.pp, "dp": self.dp,
                       "gen_tp": self.layout.tg},
            "device_order": [list(o) for o in self.device_order],
            "rank_to_device": [list(self.device_for(r)) for r in range(self.world_size)],
            **{f"{k}_groups": [list(g) for g in v] for k, v in self.groups.items()},
            "group_links": {k: [{"ranks": list(r.ranks), "devices": [list(d) for d in r.devices], "link": r.link,
                                 "class": r.bandwidth_class, "in_nvlink_island": r.in_nvlink_island}
                                for r in v] for k, v in self.reports.items()},
            "decisions": list(self.decisions),
            "warnings": list(self.warnings),
        }


# ----------------------------------------------------------------------------------------------------------------
# Per-node block construction (cached per topology signature: identical nodes are solved once)
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Block:
    gpus: tuple[int, ...]  # in TP-rank order
    in_island: bool


def _rank(topo: NodeTopology, a: int, b: int) -> int:
    return topo.gpu_links[a][b].bandwidth_rank


def _group_score(topo: NodeTopology, groups: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(worst link over all groups, total of link ranks): maximise lexicographically."""
    worst, total = 1 << 30, 0
    for g in groups:
        for a, b in combinations(g, 2):
            r = _rank(topo, a, b)
            worst = min(worst, r)
            total += r
    return worst, total


def _best_partition(topo: NodeTopology, gpus: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    """Split ``gpus`` (a multiple of ``size``) into blocks of ``size`` with the best worst/total link ranks."""
    ranks = {_rank(topo, a, b) for a, b in combinations(gpus, 2)}
    if len(ranks) <= 1 or size == 1 or size == len(gpus):
        return [gpus[i:i + size] for i in range(0, len(gpus), size)]
    if len(gpus) > _MAX_PARTITION_SEARCH:
        return _greedy_blocks(topo, list(gpus), size)

    best: tuple[tuple[int, int], list[tuple[int, ...]]] | None = None

    def rec(remaining: tuple[int, ...], acc: list[tuple[int, ...]]) -> None:
        nonlocal best
        if not remaining:
            score = _group_score(topo, acc)
            if best is None or score > best[0]:
                best = (score, list(acc))
            return
        first, rest = remaining[0], remaining[1:]
        for others in combinations(rest, size - 1):
            block = (first, *others)
            rec(tuple(g for g in rest if g not in others), acc + [block])

    rec(gpus, [])
    assert best is not None
    return best[1]


def _greedy_blocks(topo: NodeTopology, pool: Sequence[int], size: int, count: int | None = None
                   ) -> list[tuple[int, ...]]:
    """Grow up to ``count`` blocks from the lowest free GPU, adding the GPU whose worst link to the block is best
    (then same NUMA node, then best total). Without ``count`` the pool (a multiple of ``size``) is used up."""
    free = sorted(pool)
    count = len(free) // size if count is None else count
    blocks = []
    while free and len(blocks) < count:
        block = [free.pop(0)]
        while len(block) < size:
            def key(g: int) -> tuple[int, int, int, int]:
                worst = min(_rank(topo, g, b) for b in block)
                same_numa = int(topo.numa_node(g) == topo.numa_node(block[0]))
                return (worst, same_numa, sum(_rank(topo, g, b) for b in block), -g)

            nxt = max(free, key=key)
            free.remove(nxt)
            block.append(nxt)
        blocks.append(tuple(sorted(block)))
    return blocks


def _best_order(topo: NodeTopology, block: tuple[int, ...], gen_tp: int) -> tuple[int, ...]:
    """Order a TP block so generation-TP (strided) then micro-DP (consecutive) groups get the best links."""
    t = len(block)
    m = t // gen_tp
    if gen_tp in (1, t) or t > _MAX_ORDER_SEARCH or len({_rank(topo, a, b) for a, b in combinations(block, 2)}) <= 1:
        return tuple(sorted(block))
    best_key, best = None, tuple(sorted(block))
    for perm in permutations(sorted(block)):
        if perm[0] != min(block):  # rotating which GPU is TP rank 0 changes nothing we score
            break
        gen = [perm[j::m] for j in range(m)]
        micro = [perm[k * m:(k + 1) * m] for k in range(gen_tp)]
        key = (_group_score(topo, gen), _group_score(topo, micro))
        if best_key is None or key > best_key:
            best_key, best = key, perm
    return best


@lru_cache(maxsize=64)
def _node_blocks(topo: NodeTopology, tp: int, gen_tp: int) -> tuple[tuple[_Block, ...], tuple[str, ...]]:
    """Blocks of ``tp`` local GPUs covering the node (tp divides the GPU count), plus explanation lines."""
    notes = []
    island_blocks: list[_Block] = []
    leftovers: list[int] = []
    for island in topo.nvlink_islands:
        k = len(island) // tp
        if len(island) % tp == 0:
            chosen = _best_partition(topo, island, tp)
        else:  # some GPUs of this island cannot join a full block: keep the best-connected ones together
            chosen = _greedy_blocks(topo, island, tp, count=k)
        island_blocks.extend(_Block(_best_order(topo, b, gen_tp), True) for b in chosen)
        used = {g for b in chosen for g in b}
        leftovers.extend(g for g in island if g not in used)
    fallback = [_Block(_best_order(topo, b, gen_tp), False) for b in _greedy_blocks(topo, leftovers, tp)]
    blocks = sorted(island_blocks, key=lambda b: min(b.gpus)) + sorted(fallback, key=lambda b: min(b.gpus))
    islands_txt = ", ".join("[" + ",".join(map(str, isl)) + "]" + (f" ({topo.worst_link(isl)})" if len(isl) > 1
                                                                  else "") for isl in topo.nvlink_islands)
    notes.append(f"NVLink islands: {islands_txt}")
    for b in blocks:
        worst = topo.worst_link(b.gpus)
        where = "inside one NVLink island" if b.in_island else "no NVLink island fits: placed by PCIe/NUMA locality"
        notes.append(f"TP block GPUs {list(b.gpus)}: {where}, worst link {worst}")
    return tuple(blocks), tuple(notes)


# ----------------------------------------------------------------------------------------------------------------
# The scheduler
# ----------------------------------------------------------------------------------------------------------------


class TopologyAwareScheduler:
    """Plan rank -> (node, GPU) placement from per-node ``nvidia-smi topo -m`` topologies."""

    def __init__(self, topologies: Sequence[NodeTopology]):
        if not topologies:
            raise ValueError("TopologyAwareScheduler needs at least one node topology")
        counts = {t.num_gpus for t in topologies}
        if len(counts) != 1:
            raise ValueError(f"all nodes must have the same number of GPUs (launchers start the same number of "
                             f"ranks per node), got {sorted(counts)}")
        self.topologies = tuple(topologies)
        self.gpus_per_node = counts.pop()

    @classmethod
    def from_texts(cls, texts: Sequence[str]) -> "TopologyAwareScheduler":
        return cls([parse_topology(t) for t in texts])

    def plan(self, layout: ParallelLayout) -> PlacementPlan:
        g, n = self.gpus_per_node, len(self.topologies)
        world = g * n
        dp = layout.resolve_dp(world)
        tp, tg = layout.tp, layout.tg
        decisions: list[str] = [f"{n} node(s) x {g} GPU(s); tp={tp} cp={layout.cp} dp={dp} pp={layout.pp} "
                                f"gen_tp={tg}; Megatron rank order tp-cp-dp-pp, rank = node*{g} + local_rank"]
        fallback_msgs: list[str] = []

        if tp <= g:
            if g % tp:
                raise ValueError(f"tp={tp} does not divide the {g} GPUs of a node, so TP groups would straddle "
                                 f"nodes; choose tp dividing {g} (or a multiple of {g})")
            order = []
            seen_notes: dict[tuple, int] = {}
            for node, topo in enumerate(self.topologies):
                blocks, notes = _node_blocks(topo, tp, tg)
                order.append(tuple(gpu for b in blocks for gpu in b.gpus))
                sig = topo.signature()
                if sig in seen_notes:
                    continue
                seen_notes[sig] = node
                same = sum(1 for t in self.topologies if t.signature() == sig)
                decisions.append(f"node {node} (and {same - 1} other node(s) with the same topology): "
                                 + "; ".join(notes))
                bad = [b for b in blocks if not b.in_island]
                if bad:
                    fallback_msgs.append(
                        f"{len(bad)} TP group(s) per node on {same} node(s) cannot sit inside one NVLink island "
                        f"(islands {[list(i) for i in topo.nvlink_islands]}, tp={tp}); placed by PCIe/NUMA "
                        f"locality, e.g. GPUs {list(bad[0].gpus)} worst link {topo.worst_link(bad[0].gpus)}")
        else:
            if tp % g:
                raise ValueError(f"tp={tp} exceeds the {g} GPUs per node and is not a multiple of it; choose tp "
                                 f"dividing {g} or a multiple of {g}")
            order = [tuple(gpu for isl in topo.nvlink_islands for gpu in isl) for topo in self.topologies]
            fallback_msgs.append(f"tp={tp} > {g} GPUs per node: every TP group spans {tp // g} nodes and its "
                                 f"all-reduce crosses the network")
            decisions.append("TP groups span nodes; local GPUs ordered island by island")

        groups_raw = megatron_rank_groups(world, tp, layout.cp, dp, layout.pp)
        gen, micro = hybrid_engine_groups(groups_raw["tp"], tg)
        groups = {"tp": groups_raw["tp"], "gen_tp": gen, "micro_dp": micro, "cp": groups_raw["cp"],
                  "dp": groups_raw["dp"], "pp": groups_raw["pp"]}
        decisions.append(f"3D-HybridEngine: inside each TP group, generation TP groups of {tg} take ranks strided by "
                         f"{tp // tg}, micro-DP groups are runs of {tp // tg} consecutive ranks")

        order_t = tuple(order)

        def device(rank: int) -> tuple[int, int]:
            node, local = divmod(rank, g)
            return node, order_t[node][local]

        islands = tuple(t.nvlink_islands for t in self.topologies)
        island_of = [{gpu: k for k, isl in enumerate(isls) for gpu in isl} for isls in islands]
        reports: dict[str, tuple[GroupReport, ...]] = {}
        for kind, grps in groups.items():
            reps = []
            for ranks in grps:
                devs = tuple(device(r) for r in ranks)
                nodes = {d[0] for d in devs}
                if len(nodes) > 1:
                    reps.append(GroupReport(kind, tuple(ranks), devs, "NET", "inter-node network", False))
                    continue
                node = devs[0][0]
                topo = self.topologies[node]
                local = [d[1] for d in devs]
                worst: Link = topo.worst_link(local)
                in_island = len({island_of[node][x] for x in local}) == 1 and (
                    len(local) == 1 or worst.kind is LinkKind.NVLINK)
                cls = worst.bandwidth_class if worst.kind is not LinkKind.SELF else "single GPU"
                reps.append(GroupReport(kind, tuple(ranks), devs, worst.label, cls, in_island))
            reports[kind] = tuple(reps)

        outside = [r for r in reports["tp"] if not r.in_nvlink_island]
        if outside and not fallback_msgs:  # e.g. an island partition that still left a weak pair
            fallback_msgs.append(f"{len(outside)} TP group(s) are not inside one NVLink island, e.g. ranks "
                                 f"{list(outside[0].ranks)} over {outside[0].link}")
        for msg in fallback_msgs:
            warnings.warn(msg, TopologyFallbackWarning, stacklevel=2)
        return PlacementPlan(layout=layout, num_nodes=n, gpus_per_node=g, dp=dp, device_order=order_t,
                             groups={k: tuple(v) for k, v in groups.items()}, reports=reports, islands=islands,
                             decisions=tuple(decisions), warnings=tuple(fallback_msgs))


def gather_node_topologies(local_text: str | None = None, group=None) -> list[NodeTopology]:
    """All-gather each node's ``nvidia-smi topo -m`` text (from its local rank 0) over torch.distributed.

    Needs an initialised process group and LOCAL_RANK / LOCAL_WORLD_SIZE in the environment (every launcher here
    sets them). Returns one parsed topology per node, in node-rank order.
    """
    import os

    import torch.distributed as dist

    from verl_mega.parallel.topology import read_local_topology_text

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = dist.get_rank(group)
    text = None
    if local_rank == 0:
        text = local_text if local_text is not None else read_local_topology_text()
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (rank // local_world, text), group=group)
    by_node = {node: t for node, t in gathered if t is not None}
    return [parse_topology(by_node[k]) for k in sorted(by_node)]
