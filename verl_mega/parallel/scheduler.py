"""TopologyAwareScheduler: map Megatron ranks onto (node, GPU) so that bandwidth-hungry groups stay on NVLink.

Launchers number ranks node by node (rank = node_rank * gpus_per_node + local_rank) and Megatron builds its
groups from rank numbers in the order tp-cp-dp-pp (``megatron.core.parallel_state.RankGenerator``, default order
"tp-cp-ep-dp-pp", with ep=1 for the dense groups). The only freedom left is which physical GPU each local rank
drives. This module chooses that per-node device order so that

* every training TP group (``tp`` consecutive ranks) lies inside one NVLink island, on the strongest bonds;
* inside it, the 3D-HybridEngine generation TP groups (ranks strided by tp/gen_tp) and micro-DP groups (runs of
  tp/gen_tp consecutive ranks) get the best remaining bonds (generation TP all-reduces every decode step, the
  micro-DP all-gather runs once per train->generate switch, so generation TP is preferred);
* DP and PP groups then cross nodes as the rank order dictates. With ``parallel.dp_hierarchy=island`` the blocks of
  a node are laid out island by island, so that every run of ``island size`` local ranks is one NVLink island: the
  data-parallel reduce-scatter and all-gather of the placement's ``intra_dp`` groups stay on NVLink and only the
  ``inter_dp`` all-reduce leaves the island (``dp_island_ranks`` decides the island size).

When a TP group cannot fit an NVLink island it is placed by PCIe/NUMA locality and a warning says so. Every group
gets a bandwidth class in the report. Pure functions over parsed topologies: 1024-GPU layouts plan in one process.
"""

from __future__ import annotations

import functools

import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import combinations, permutations
from typing import Sequence

from verl_mega.parallel.placement import ISLAND_JSON_KINDS, Placement, PlacementError
from verl_mega.parallel.topology import Link, LinkKind, NodeTopology, parse_topology

__all__ = ["GroupReport", "PlacementPlan", "TopologyAwareScheduler", "TopologyFallbackWarning", "assign_device",
           "check_islands_agree", "dp_island_ranks", "place_on_devices", "write_placement_json"]

# Above this many GPUs per TP group, we do not search orderings inside a block (8! is the largest we brute-force).
_MAX_ORDER_SEARCH = 8
# Above this island size, partitioning an island with unequal bonds into TP blocks is greedy instead of exhaustive.
_MAX_PARTITION_SEARCH = 12
REPORTED_KINDS = ("tp", "gen_tp", "micro_dp", "cp", "ep", "dp", "pp")


class TopologyFallbackWarning(UserWarning):
    """A group could not be placed inside one NVLink island."""


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
    placement: Placement
    num_nodes: int
    gpus_per_node: int
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

    def cuda_visible_devices(self, node_rank: int) -> str:
        """CUDA_VISIBLE_DEVICES for a node so that local_rank i sees the chosen GPU as device i."""
        return ",".join(str(g) for g in self.device_order[node_rank])

    def to_json(self) -> dict:
        return {
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.num_nodes,
            "world_size": self.world_size,
            "pools": [p.describe() for p in self.placement.pools],
            "device_order": [list(o) for o in self.device_order],
            "rank_to_device": [list(self.device_for(r)) for r in range(self.world_size)],
            **{f"{k}_groups": [list(g) for g in v] for k, v in self.groups.items()},
            "dp_hierarchy": self.placement.dp_hierarchy,
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


def _closeness(topo: NodeTopology, block: list[int], g: int) -> tuple[int, int, int, int]:
    """How well GPU ``g`` joins ``block``: its worst link to it, then same NUMA node, then its total link rank."""
    worst = min(_rank(topo, g, b) for b in block)
    same_numa = int(topo.numa_node(g) == topo.numa_node(block[0]))
    return (worst, same_numa, sum(_rank(topo, g, b) for b in block), -g)


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
            nxt = max(free, key=functools.partial(_closeness, topo, block))
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
def _node_blocks(topo: NodeTopology, shapes: tuple[tuple[int, int], ...], by_island: bool = False
                 ) -> tuple[tuple[_Block, ...], tuple[str, ...]]:
    """GPU blocks for the node's rank blocks ((size, gen_tp) each, in rank order), plus explanation lines.
    ``by_island``: blocks island after island (data-parallel islands), else by their lowest GPU."""
    if len(set(shapes)) == 1:
        blocks = _uniform_blocks(topo, *shapes[0], by_island=by_island)
    else:  # pools of different tp share the node: largest blocks first, each in the smallest island that holds it
        free, out = set(range(topo.num_gpus)), [None] * len(shapes)
        for i in sorted(range(len(shapes)), key=lambda i: -shapes[i][0]):
            size, gen_tp = shapes[i]
            fits = [f for f in (tuple(g for g in isl if g in free) for isl in topo.nvlink_islands) if len(f) >= size]
            pool, inside = (min(fits, key=len), True) if fits else (tuple(sorted(free)), False)
            block = _greedy_blocks(topo, pool, size, count=1)[0]
            free -= set(block)
            nvlink = size == 1 or topo.worst_link(block).is_nvlink
            out[i] = _Block(_best_order(topo, block, gen_tp), inside and nvlink)
        blocks = tuple(out)
    islands_txt = ", ".join("[" + ",".join(map(str, isl)) + "]" + (f" ({topo.worst_link(isl)})" if len(isl) > 1
                                                                  else "") for isl in topo.nvlink_islands)
    notes = [f"NVLink islands: {islands_txt}"]
    for b in blocks:
        worst = topo.worst_link(b.gpus)
        where = "inside one NVLink island" if b.in_island else "no NVLink island fits: placed by PCIe/NUMA locality"
        notes.append(f"TP block GPUs {list(b.gpus)}: {where}, worst link {worst}")
    return blocks, tuple(notes)


def _uniform_blocks(topo: NodeTopology, tp: int, gen_tp: int, by_island: bool = False) -> tuple[_Block, ...]:
    """Blocks of ``tp`` local GPUs covering the node (tp divides the GPU count), island blocks first: by their lowest
    GPU, or (``by_island``) island after island, lowest GPU first inside each."""
    island_blocks: list[_Block] = []
    leftovers: list[int] = []
    for island in sorted(topo.nvlink_islands, key=min) if by_island else topo.nvlink_islands:
        k = len(island) // tp
        if len(island) % tp == 0:
            chosen = _best_partition(topo, island, tp)
        else:  # some GPUs of this island cannot join a full block: keep the best-connected ones together
            chosen = _greedy_blocks(topo, island, tp, count=k)
        ordered = [_Block(_best_order(topo, b, gen_tp), True) for b in chosen]
        island_blocks.extend(sorted(ordered, key=lambda b: min(b.gpus)) if by_island else ordered)
        used = {g for b in chosen for g in b}
        leftovers.extend(g for g in island if g not in used)
    fallback = [_Block(_best_order(topo, b, gen_tp), False) for b in _greedy_blocks(topo, leftovers, tp)]
    if not by_island:
        island_blocks.sort(key=lambda b: min(b.gpus))
    return tuple(island_blocks + sorted(fallback, key=lambda b: min(b.gpus)))


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

    def plan(self, placement: Placement) -> PlacementPlan:
        g, n = self.gpus_per_node, len(self.topologies)
        if placement.world_size != g * n:
            raise ValueError(f"the placement has {placement.world_size} ranks but {n} node(s) x {g} GPU(s) = {g * n}; "
                             f"start one rank per GPU")
        decisions = [f"{n} node(s) x {g} GPU(s); {placement.describe()}; rank = node*{g} + local_rank, Megatron "
                     f"order tp-cp-dp-pp inside each pool"]
        fallback_msgs: list[str] = []
        order, seen_notes, spanning = [], set(), 0
        for node, topo in enumerate(self.topologies):
            blocks, spans = _rank_blocks(placement, node, g)
            if spans:
                order.append(tuple(gpu for isl in topo.nvlink_islands for gpu in isl))
                spanning = max(spanning, spans)
                continue
            gpu_blocks, notes = _node_blocks(topo, tuple((len(b), gen_tp) for b, gen_tp in blocks),
                                             placement.dp_hierarchy == "island")
            local = [0] * g
            for (ranks, _), gpu_block in zip(blocks, gpu_blocks):
                for r, gpu in zip(ranks, gpu_block.gpus):
                    local[r] = gpu
            order.append(tuple(local))
            key = (topo.signature(), tuple((len(b), t) for b, t in blocks))
            if key in seen_notes:
                continue
            seen_notes.add(key)
            decisions.append(f"node {node} (and nodes with the same topology and blocks): " + "; ".join(notes))
            bad = [b for b in gpu_blocks if not b.in_island]
            if bad:
                fallback_msgs.append(
                    f"{len(bad)} TP group(s) on node {node} cannot sit inside one NVLink island (islands "
                    f"{[list(i) for i in topo.nvlink_islands]}); placed by PCIe/NUMA locality, e.g. GPUs "
                    f"{list(bad[0].gpus)} worst link {topo.worst_link(bad[0].gpus)}")
        if spanning:
            fallback_msgs.append(f"TP groups of {spanning} ranks: every TP group spans {spanning // g} nodes of {g} "
                                 f"GPUs and its all-reduce crosses the network; local GPUs ordered island by island")
        decisions.append("3D-HybridEngine: inside each TP group, generation TP groups take ranks strided by tp/gen_tp, "
                         "micro-DP groups are runs of tp/gen_tp consecutive ranks")
        for pool in placement.pools:
            if pool.dp_islands > 1:
                decisions.append(
                    f"data-parallel islands ({placement.dp_hierarchy}): pool {pool.name!r} cuts each pipeline stage "
                    f"into {pool.dp_islands} islands of {pool.island_ranks} ranks; gradients are reduce-scattered "
                    f"and parameters all-gathered inside an island, shards all-reduced across islands in "
                    f"{pool.dp_cross_island_dtype}")
        order_t = tuple(order)

        def device(rank: int) -> tuple[int, int]:
            node, local = divmod(rank, g)
            return node, order_t[node][local]

        islands = tuple(t.nvlink_islands for t in self.topologies)
        island_of = [{gpu: k for k, isl in enumerate(isls) for gpu in isl} for isls in islands]
        kinds = REPORTED_KINDS + (ISLAND_JSON_KINDS if any(p.dp_islands > 1 for p in placement.pools) else ())
        groups = {kind: tuple(grp for pool in placement.pools if kind in REPORTED_KINDS or pool.dp_islands > 1
                              for grp in pool.groups(kind)) for kind in kinds}
        reports: dict[str, tuple[GroupReport, ...]] = {}
        for kind, grps in groups.items():
            reps = []
            for ranks in grps:
                devs = tuple(device(r) for r in ranks)
                if len({d[0] for d in devs}) > 1:
                    reps.append(GroupReport(kind, tuple(ranks), devs, "NET", "inter-node network", False))
                    continue
                node = devs[0][0]
                local = [d[1] for d in devs]
                worst: Link = self.topologies[node].worst_link(local)
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
        return PlacementPlan(placement=placement, num_nodes=n, gpus_per_node=g, device_order=order_t,
                             groups=groups, reports=reports, islands=islands, decisions=tuple(decisions),
                             warnings=tuple(fallback_msgs))


def _rank_blocks(placement: Placement, node: int, g: int) -> tuple[list[tuple[tuple[int, ...], int]], int]:
    """The TP groups (engines, for pools that only generate) on ``node`` as local ranks, with their gen_tp; and
    the size of a group that spans whole nodes (0 if none)."""
    lo, hi = node * g, (node + 1) * g
    blocks, spans = [], 0
    for pool in placement.pools:
        for grp in pool.groups("tp" if pool.trains else "gen_tp"):
            inside = [r for r in grp if lo <= r < hi]
            if inside and len(inside) != len(grp):
                if len(grp) <= g or len(grp) % g:
                    raise ValueError(f"{pool._key('tp')}={len(grp)}: TP group {list(grp)[:8]} straddles nodes of {g} "
                                     f"GPUs; choose a tp that divides {g} (or a multiple of {g})")
                spans = len(grp)
            elif inside:
                blocks.append((tuple(r - lo for r in grp), pool.gen_tp if pool.trains else len(grp)))
    return sorted(blocks), spans


def dp_island_ranks(level: str, gpus_per_node: int, topology: NodeTopology | None) -> int | None:
    """Ranks per data-parallel island for ``parallel.dp_hierarchy=level``: the node's ranks (node), or the size of
    the node's NVLink islands (island; every island must have the same size, and the topology is needed). None for
    ``off``. A one-line error names the key and the fix."""
    if level == "off":
        return None
    if level == "node":
        return gpus_per_node
    if level != "island":
        raise PlacementError(f"parallel.dp_hierarchy={level!r} is not one of off, node, island")
    if topology is None:
        raise PlacementError("parallel.dp_hierarchy=island needs the node's NVLink islands, but there is no topology "
                             "(set parallel.topology_file to a saved `nvidia-smi topo -m`, or use "
                             "parallel.dp_hierarchy=node)")
    sizes = sorted({len(i) for i in topology.nvlink_islands})
    if len(sizes) > 1:
        raise PlacementError(f"parallel.dp_hierarchy=island: the node's NVLink islands "
                             f"{[list(i) for i in topology.nvlink_islands]} differ in size {sizes}; data-parallel "
                             f"islands must be alike, set parallel.dp_hierarchy=node")
    return sizes[0]


def place_on_devices(placement: Placement, env, topology_file: str | None = None, *, dp_hierarchy: str = "off",
                     cross_island_dtype: str = "fp32") -> tuple[Placement, dict]:
    """This rank's device, chosen from its node's topology so that TP and generation-TP groups sit inside NVLink
    islands: a recorded ``parallel.topology_file``, else ``nvidia-smi topo -m``. On CUDA it exports
    CUDA_VISIBLE_DEVICES in the chosen order, so local rank i drives its GPU as ``cuda:i`` — for torch and vLLM
    alike, under any launcher. Call it before anything initialises CUDA. Without a topology: one warning line and
    the launcher's order. With ``dp_hierarchy`` node or island, the training pools' data-parallel groups are cut at
    the islands (:meth:`Placement.with_dp_hierarchy`) and, for island, each node's devices ordered island by island.
    Returns that placement and what placement.json records for this rank."""
    import logging
    import os
    import shutil
    from pathlib import Path

    import torch

    from verl_mega.parallel.topology import read_local_topology_text

    log = logging.getLogger("verl_mega.placement")
    g, node, local_rank = env.local_world_size, env.node_rank, env.local_rank
    cuda = torch.version.cuda is not None and os.environ.get("VERL_MEGA_FORCE_CPU", "0") != "1"
    record = {"node": node, "local_rank": local_rank, "device": local_rank, "topology": None}
    text = source = None
    if topology_file:
        path = Path(topology_file)
        if not path.is_file():
            raise ValueError(f"parallel.topology_file={topology_file!r} does not exist; save `nvidia-smi topo -m` "
                             f"there or unset it")
        text, source = path.read_text(), str(path)
    elif cuda and shutil.which("nvidia-smi"):
        text, source = read_local_topology_text(), "nvidia-smi topo -m"
    elif cuda and env.rank == 0:
        log.warning("no GPU topology (nvidia-smi not found, parallel.topology_file unset): ranks drive GPUs in "
                    "launcher order, so TP groups may leave NVLink islands")
    topo = visible = None
    if text is not None:
        full = parse_topology(text)
        visible = _visible_gpus(full.num_gpus) if cuda else list(range(full.num_gpus))
        order = os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        if visible is None or (cuda and order != "PCI_BUS_ID"):  # by index, we would leave the launcher's devices
            if env.rank == 0:
                log.warning("CUDA_VISIBLE_DEVICES=%s (CUDA_DEVICE_ORDER=%s) names MIG instances, GPUs nvidia-smi does "
                            "not list or GPUs in another order than nvidia-smi's: ranks drive them in the launcher's "
                            "order, so TP groups may leave NVLink islands", os.environ.get("CUDA_VISIBLE_DEVICES"),
                            order)
            text = None
    if text is not None:
        if len(visible) < g:
            raise ValueError(f"the topology ({source}) shows {len(visible)} usable GPU(s) but {g} ranks run on each "
                             f"node; start at most {len(visible)} ranks per node")
        visible = visible[:g]
        topo = full.subset(visible)
    island = dp_island_ranks(dp_hierarchy, g, topo)
    placement = placement.with_dp_hierarchy(dp_hierarchy, island, cross_island_dtype)
    if island:
        record["dp_island_ranks"] = island
    if topo is None:
        return placement, record
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        plan = TopologyAwareScheduler([topo] * (placement.world_size // g)).plan(placement)
    physical = [visible[i] for i in plan.device_order[node]]
    if env.rank == 0:
        for msg in plan.warnings:
            log.warning("topology: %s", msg)
    record.update(device=physical[local_rank], topology=source, decisions=list(plan.decisions))
    if cuda:
        # the indices are nvidia-smi's, which number GPUs in PCI bus order; CUDA's default order may differ
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, physical))
    return placement, record


def assign_device(placement: Placement, env, topology_file: str | None = None) -> dict:
    """:func:`place_on_devices` with flat data-parallel groups: what placement.json records for this rank."""
    return place_on_devices(placement, env, topology_file)[1]


def check_islands_agree(records: list[dict]) -> None:
    """Every rank must have cut its data-parallel groups at islands of the same size (each node reads only its own
    topology): otherwise a one-line error names the nodes that differ."""
    sizes = {}
    for rec in records:
        sizes.setdefault(rec.get("dp_island_ranks"), set()).add(rec["node"])
    if len(sizes) > 1:
        raise PlacementError("parallel.dp_hierarchy: the nodes' islands differ in size (ranks per island: nodes) "
                             + "; ".join(f"{k}: {sorted(v)[:8]}" for k, v in sizes.items())
                             + "; use nodes with alike NVLink islands or parallel.dp_hierarchy=node")


def _visible_gpus(n: int) -> list[int] | None:
    """The nvidia-smi indices of the GPUs this process may use: CUDA_VISIBLE_DEVICES by index or by GPU UUID (or a
    unique prefix of one, as CUDA accepts), else all ``n``. None when they cannot be told (MIG instances, a UUID
    nvidia-smi does not list): the launcher's devices must then be left as they are."""
    import os

    from verl_mega.parallel.topology import read_gpu_uuids

    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(range(n))
    entries = [v.strip() for v in value.split(",") if v.strip()]
    if all(v.isdigit() for v in entries):
        return [int(v) for v in entries]
    known = read_gpu_uuids()
    out = []
    for v in entries:
        match = [i for u, i in known.items() if u.startswith(v)] if not v.isdigit() else [int(v)]
        if len(match) != 1:
            return None
        out.append(match[0])
    return out


def write_placement_json(placement: Placement, device: dict, path, records: list | None = None) -> None:
    """Gather every rank's device (collective over the whole job) and, on rank 0, write ``path``: the pools, the
    roles and, per rank, its node, local device, pool and the members of its groups. ``records``: every rank's
    device, gathered already (a disaggregated job gathers them over its bridge)."""
    import json
    import os
    from pathlib import Path

    import torch.distributed as dist

    if records is None:
        from verl_mega.parallel.state import pool_group

        records = [None] * dist.get_world_size()
        dist.all_gather_object(records, device, group=pool_group())
    if dist.get_rank() != 0:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = [{**placement.rank_record(r), **{k: v for k, v in records[r].items() if k != "decisions"}}
             for r in range(placement.world_size)]
    out = {"world_size": placement.world_size, "pools": [p.to_json() for p in placement.pools],
           "roles": dict(placement.roles), "colocated": placement.colocated, "topology": records[0]["topology"],
           "decisions": records[0].get("decisions", []), "dp_hierarchy": _islands_json(placement, ranks),
           "ranks": ranks}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, path)


def _islands_json(placement: Placement, ranks: list[dict]) -> dict:
    """placement.json's data-parallel islands: the level, and per training pool with islands the ranks and devices
    ((node, device)) of every island, and the groups that reduce inside islands and across them."""
    out: dict = {"level": placement.dp_hierarchy, "pools": {}}
    for pool in placement.pools:
        if pool.dp_islands > 1:
            out["pools"][pool.name] = {
                "islands_per_dp_group": pool.dp_islands, "ranks_per_island": pool.island_ranks,
                "cross_island_dtype": pool.dp_cross_island_dtype,
                "islands": [{"ranks": list(g), "devices": [[ranks[r]["node"], ranks[r]["device"]] for r in g]}
                            for g in pool.groups("island")],
                "intra_dp_groups": [list(g) for g in pool.groups("intra_dp")],
                "inter_dp_groups": [list(g) for g in pool.groups("inter_dp")]}
    return out
