"""Show NVLink islands and the topology-aware placement of TP / 3D-HybridEngine groups.

    python tools/topo.py [--file F] --tp N [--pp P] [--cp C] [--gen-tp G] [--nodes K] [--json]

Without --file it runs ``nvidia-smi topo -m`` on this machine. With --nodes K the same topology is used for K
simulated nodes (a cluster of identical machines). --json prints one JSON object with ``gpus`` (GPUs per node),
``islands`` (NVLink islands, lists of local GPU indices), ``tp_groups`` (lists of global ranks), the chosen
``device_order`` per node, ``rank_to_device`` and the worst link of every group.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_mega.parallel.placement import Placement  # noqa: E402
from verl_mega.parallel.scheduler import TopologyAwareScheduler, dp_island_ranks  # noqa: E402
from verl_mega.parallel.topology import (  # noqa: E402
    TopologyParseError,
    TopologyUnavailableError,
    parse_topology,
    read_local_topology_text,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", help="saved output of `nvidia-smi topo -m` (default: run nvidia-smi here)")
    ap.add_argument("--tp", type=int, required=True, help="training tensor-parallel size")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size")
    ap.add_argument("--gen-tp", type=int, default=None, help="generation tensor-parallel size (divides --tp)")
    ap.add_argument("--nodes", type=int, default=1, help="number of identical nodes to plan for")
    ap.add_argument("--dp-hierarchy", choices=("off", "node", "island"), default="off",
                    help="cut data-parallel groups at nodes or NVLink islands (parallel.dp_hierarchy)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = ap.parse_args(argv)
    if args.nodes < 1:
        ap.error("--nodes must be >= 1")
    try:
        text = Path(args.file).read_text() if args.file else read_local_topology_text()
        topo = parse_topology(text)
        placement = Placement.single(topo.num_gpus * args.nodes, tp=args.tp, pp=args.pp, cp=args.cp,
                                     gen_tp=args.gen_tp)
        placement = placement.with_dp_hierarchy(args.dp_hierarchy,
                                                dp_island_ranks(args.dp_hierarchy, topo.num_gpus, topo))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the plan carries its warnings; print them once below
            plan = TopologyAwareScheduler([topo] * args.nodes).plan(placement)
    except (OSError, TopologyParseError, TopologyUnavailableError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    islands = [list(i) for i in topo.nvlink_islands]
    if args.json:
        out = {
            "gpus": topo.num_gpus,
            "islands": islands,
            "numa": [topo.numa_node(g) for g in range(topo.num_gpus)],
            "nearest_nic": [(n.display_name if (n := topo.nearest_nic(g)) else None) for g in range(topo.num_gpus)],
            **plan.to_json(),
        }
        print(json.dumps(out))
        return 0

    print(f"{topo.num_gpus} GPU(s) per node, {len(topo.nics)} NIC(s); planning for {args.nodes} node(s)")
    print("NVLink islands (fully NVLink-connected):")
    for isl in topo.nvlink_islands:
        bond = topo.worst_link(isl) if len(isl) > 1 else "no NVLink"
        print(f"  {list(isl)}  weakest bond {bond}")
    print("GPU  NUMA  nearest NIC")
    for g in range(topo.num_gpus):
        nic = topo.nearest_nic(g)
        nic_txt = f"{nic.display_name} ({topo.gpu_nic_links[g][nic.index]})" if nic else "-"
        print(f"  {g:<4}{str(topo.numa_node(g)):<6}{nic_txt}")
    print("Why:")
    for line in plan.decisions:
        print(f"  - {line}")
    print("Device order per node (local_rank -> GPU):")
    for node in range(min(4, plan.num_nodes)):
        print(f"  node {node}: CUDA_VISIBLE_DEVICES={plan.cuda_visible_devices(node)}")
    if plan.num_nodes > 4:
        print(f"  ... ({plan.num_nodes - 4} more node(s))")
    for kind in ("tp", "gen_tp", "micro_dp", "dp", "pp", "island", "intra_dp", "inter_dp"):
        reps = plan.reports.get(kind)
        if reps is None:  # the island kinds: only with --dp-hierarchy
            continue
        shown = reps[:8]
        print(f"{kind} groups ({len(reps)}):")
        for r in shown:
            devs = " ".join(f"n{n}:g{g}" for n, g in r.devices)
            flag = r.bandwidth_class if (len(r.ranks) == 1 or not r.in_nvlink_island) else "NVLink island"
            print(f"  ranks {list(r.ranks)} -> {devs}  [{r.link}, {flag}]")
        if len(reps) > len(shown):
            print(f"  ... ({len(reps) - len(shown)} more)")
    for w in plan.warnings:
        print(f"WARNING: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
