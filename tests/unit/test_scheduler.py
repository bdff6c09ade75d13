"""TopologyAwareScheduler on recorded topologies: groups land on NVLink where the hardware allows it."""

from __future__ import annotations

import importlib.util
import json
import os
import time
import warnings
from itertools import combinations
from pathlib import Path

import pytest

from verl_mega.parallel.placement import Placement, PlacementError, Pool
from verl_mega.parallel.scheduler import TopologyAwareScheduler, TopologyFallbackWarning
from verl_mega.parallel.topology import parse_topology

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "topo"


def topo(name: str):
    return parse_topology((FIX / name).read_text())


def layout(topos, **dims) -> Placement:
    """One pool over every GPU of ``topos`` (the colocated placement)."""
    return Placement.single(sum(t.num_gpus for t in topos), **dims)


def plan_quietly(topos, **dims):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TopologyFallbackWarning)
        return TopologyAwareScheduler(topos).plan(layout(topos, **dims))


def test_tp2_lands_on_nvlink_pairs_of_8gpu_box():
    t = topo("a6000_8gpu_nvlink_pairs.txt")
    plan = plan_quietly([t, t], tp=2)
    pairs = set(t.nvlink_islands)
    for rep in plan.reports["tp"]:
        node = rep.devices[0][0]
        assert {d[0] for d in rep.devices} == {node}
        assert tuple(sorted(d[1] for d in rep.devices)) in pairs
        assert rep.link == "NV4" and rep.in_nvlink_island
    assert plan.warnings == ()


@pytest.mark.parametrize("tp,tg", [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4), (8, 2), (8, 4), (8, 8)])
def test_nvswitch_any_grouping_is_island_local(tp, tg):
    t = topo("dgx_h100_8gpu_12nic.txt")
    plan = plan_quietly([t] * 2, tp=tp, gen_tp=tg)
    for kind in ("tp", "gen_tp", "micro_dp"):
        for rep in plan.reports[kind]:
            assert rep.in_nvlink_island
            assert rep.link == ("NV18" if len(rep.ranks) > 1 else "X")


def test_unequal_bonds_prefer_the_strongest():
    # DGX-1 hybrid cube-mesh GPU block (NVIDIA/nccl-tests#29): quads {0..3},{4..7} with NV2 and NV1 bonds.
    rows = ["X NV2 NV2 NV1 NV1 SYS SYS SYS", "NV2 X NV1 NV2 SYS NV1 SYS SYS", "NV2 NV1 X NV1 SYS SYS NV2 SYS",
            "NV1 NV2 NV1 X SYS SYS SYS NV2", "NV1 SYS SYS SYS X NV2 NV2 NV1", "SYS NV1 SYS SYS NV2 X NV1 NV2",
            "SYS SYS NV2 SYS NV2 NV1 X NV1", "SYS SYS SYS NV2 NV1 NV2 NV1 X"]
    text = "\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\n" + "".join(
        f"GPU{i}\t" + "\t".join(r.split()) + "\n" for i, r in enumerate(rows))
    t = parse_topology(text)
    plan = plan_quietly([t], tp=2)
    assert [r.link for r in plan.reports["tp"]] == ["NV2"] * 4  # pairs {0,2},{1,3},{4,6},{5,7}
    plan = plan_quietly([t], tp=4, gen_tp=2)
    assert all(r.in_nvlink_island for r in plan.reports["tp"])
    assert [r.link for r in plan.reports["gen_tp"]] == ["NV2"] * 4  # strided ranks get the NV2 bonds
    # given those, the best micro-DP pairs are one NV2 and one NV1 pair per quad
    assert [r.link for r in plan.reports["micro_dp"]] == ["NV2", "NV1", "NV2", "NV1"]


def test_fallback_warns_and_keeps_locality():
    t = topo("a6000_8gpu_nvlink_pairs.txt")
    with pytest.warns(TopologyFallbackWarning, match="cannot sit inside one NVLink island"):
        plan = TopologyAwareScheduler([t]).plan(layout([t], tp=4, gen_tp=2))
    for rep in plan.reports["tp"]:
        gpus = [d[1] for d in rep.devices]
        assert len({t.numa_node(g) for g in gpus}) == 1  # NODE, never SYS
        assert rep.link == "NODE" and not rep.in_nvlink_island
    assert all(r.link == "NV4" for r in plan.reports["gen_tp"])  # generation TP keeps the NVLink pairs

    one_pair = topo("a100_4gpu_one_nvlink_pair.txt")
    with pytest.warns(TopologyFallbackWarning):
        plan = TopologyAwareScheduler([one_pair]).plan(layout([one_pair], tp=2))
    assert [(r.link, r.in_nvlink_island) for r in plan.reports["tp"]] == [("NV12", True), ("NODE", False)]

    pcie = topo("t4_4gpu_pcie.txt")
    with pytest.warns(TopologyFallbackWarning):
        plan = TopologyAwareScheduler([pcie]).plan(layout([pcie], tp=2))
    assert sorted(r.link for r in plan.reports["tp"]) == ["NODE", "SYS"]  # GPU0 is alone on its socket


def test_tp_spanning_nodes_is_reported_as_network():
    t = topo("a30_4gpu_nvlink_pairs.txt")
    with pytest.warns(TopologyFallbackWarning, match="spans 2 nodes"):
        plan = TopologyAwareScheduler([t] * 4).plan(layout([t] * 4, tp=8))
    assert all(r.link == "NET" for r in plan.reports["tp"])


def test_128_nodes_tp8_pp4_tg4_under_two_seconds():
    text = (FIX / "dgx_h100_8gpu_12nic.txt").read_text()
    start = time.process_time()  # CPU time of this process: other jobs on a shared CI box do not count
    topos = [parse_topology(text) for _ in range(128)]
    plan = plan_quietly(topos, tp=8, pp=4, gen_tp=4)
    elapsed = time.process_time() - start
    assert elapsed < 2.0, f"parsing 128 topologies and planning took {elapsed:.2f}s of CPU"

    assert plan.world_size == 1024 and plan.placement.pool("main").dp == 32
    devices = [plan.device_for(r) for r in range(1024)]
    assert len(set(devices)) == 1024  # a bijection rank <-> (node, GPU)
    for order in plan.device_order:
        assert sorted(order) == list(range(8))
    assert all(devices[r][0] == r // 8 for r in range(1024))  # launchers number ranks node by node
    expect_sizes = {"tp": (128, 8), "gen_tp": (256, 4), "micro_dp": (512, 2), "dp": (32, 32), "pp": (256, 4)}
    for kind, (count, size) in expect_sizes.items():
        reps = plan.reports[kind]
        assert len(reps) == count and all(len(r.ranks) == size for r in reps), kind
        assert sorted(x for r in reps for x in r.ranks) == list(range(1024)), kind  # a partition of the ranks
    for kind in ("tp", "gen_tp", "micro_dp"):
        for rep in plan.reports[kind]:
            assert len({d[0] for d in rep.devices}) == 1 and rep.in_nvlink_island and rep.link == "NV18", kind
    for rep in plan.reports["tp"]:
        assert list(rep.ranks) == list(range(rep.ranks[0], rep.ranks[0] + 8)) and rep.ranks[0] % 8 == 0
    for rep in plan.reports["gen_tp"]:
        assert [b - a for a, b in zip(rep.ranks, rep.ranks[1:])] == [2, 2, 2]  # strided by tp/tg = 2
    for rep in plan.reports["micro_dp"]:
        assert rep.ranks[1] - rep.ranks[0] == 1 and rep.ranks[0] % 2 == 0  # runs of 2 consecutive ranks
    for rep in plan.reports["dp"]:
        assert len({d[0] for d in rep.devices}) == 32 and rep.link == "NET"  # DP crosses nodes
        assert len({r % 8 for r in rep.ranks}) == 1 and len({r // 256 for r in rep.ranks}) == 1
    for rep in plan.reports["pp"]:
        assert len({d[0] for d in rep.devices}) == 4 and rep.link == "NET"  # PP crosses nodes
        assert [b - a for a, b in zip(rep.ranks, rep.ranks[1:])] == [256, 256, 256]


def test_layout_and_topology_validation():
    t = topo("a6000_8gpu_nvlink_pairs.txt")
    with pytest.raises(PlacementError, match="rollout.gen_tp=3 must divide parallel.tp=4"):
        layout([t], tp=4, gen_tp=3)
    with pytest.raises(ValueError, match="parallel.tp=3: TP group \\[6, 7, 8\\] straddles nodes of 8 GPUs"):
        TopologyAwareScheduler([t] * 3).plan(layout([t] * 3, tp=3))
    with pytest.raises(ValueError, match="same number of GPUs"):
        TopologyAwareScheduler([t, topo("a30_4gpu_nvlink_pairs.txt")])
    with pytest.raises(PlacementError, match="world size 8 is not divisible by tp·pp·cp"):
        layout([t], tp=2, pp=3)
    with pytest.raises(ValueError, match="the placement has 4 ranks but 1 node"):
        TopologyAwareScheduler([t]).plan(Placement.single(4, tp=2))


def test_two_pools_share_a_node_with_different_tp():
    """A node split between a tp=4 training pool and a rollout pool of gen_tp=2 engines: every block still lands
    inside an NVLink island of the DGX-1 cube-mesh quads."""
    rows = ["X NV2 NV2 NV1 NV1 SYS SYS SYS", "NV2 X NV1 NV2 SYS NV1 SYS SYS", "NV2 NV1 X NV1 SYS SYS NV2 SYS",
            "NV1 NV2 NV1 X SYS SYS SYS NV2", "NV1 SYS SYS SYS X NV2 NV2 NV1", "SYS NV1 SYS SYS NV2 X NV1 NV2",
            "SYS SYS NV2 SYS NV2 NV1 X NV1", "SYS SYS SYS NV2 NV1 NV2 NV1 X"]
    t = parse_topology("\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\n" + "".join(
        f"GPU{i}\t" + "\t".join(r.split()) + "\n" for i, r in enumerate(rows)))
    placement = Placement(8, (Pool(name="train", ranks=range(4), tp=4), Pool(name="gen", ranks=range(4, 8), gen_tp=2,
                                                                            trains=False)),
                          {"actor": "train", "rollout": "gen"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", TopologyFallbackWarning)
        plan = TopologyAwareScheduler([t]).plan(placement)
    assert sorted(plan.device_order[0]) == list(range(8))
    assert all(r.in_nvlink_island for r in plan.reports["tp"]) and all(r.in_nvlink_island
                                                                      for r in plan.reports["gen_tp"])


def _tools_topo():
    spec = importlib.util.spec_from_file_location("tools_topo", REPO / "tools" / "topo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tools_topo_json_and_text(capsys):
    tool = _tools_topo()
    rc = tool.main(["--file", str(FIX / "a30_4gpu_nvlink_pairs.txt"), "--tp", "2", "--nodes", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["gpus"] == 4 and out["islands"] == [[0, 1], [2, 3]]
    assert out["tp_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]] and out["world_size"] == 8
    for pair in combinations(range(4), 2):  # islands really are NVLink cliques
        assert (pair in [(0, 1), (2, 3)]) == (out["rank_to_device"][pair[0]][1] // 2 == out["rank_to_device"][
            pair[1]][1] // 2)
    rc = tool.main(["--file", str(FIX / "a6000_8gpu_nvlink_pairs.txt"), "--tp", "4", "--gen-tp", "2"])
    text = capsys.readouterr().out
    assert rc == 0 and "NVLink islands" in text and "WARNING" in text and "Why:" in text
    rc = tool.main(["--file", str(FIX / "a30_4gpu_nvlink_pairs.txt"), "--tp", "3", "--nodes", "3"])
    assert rc == 2 and "straddles nodes" in capsys.readouterr().err


def test_tools_topo_without_nvidia_smi(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    tool = _tools_topo()
    assert tool.main(["--tp", "2"]) == 2
    assert "nvidia-smi is not on PATH" in capsys.readouterr().err


def test_header_variants_users_paste():
    """`NUMA` for `NUMA Affinity`, `CPU_Affinity`, a bare `Affinity`, lower case: the same topology."""
    base = (FIX / "4gpu_nvlink_pairs_0_2_and_1_3.txt").read_text()
    want = topo("4gpu_nvlink_pairs_0_2_and_1_3.txt")
    assert want.nvlink_islands == ((0, 2), (1, 3)) and [want.numa_node(g) for g in range(4)] == [0, 1, 0, 1]
    for cpu, numa in (("CPU_Affinity", "NUMA Affinity"), ("Affinity", "NUMA_Node"), ("cpu affinity", "numa")):
        text = base.replace("CPU Affinity", cpu).replace("NUMA\n", numa + "\n", 1)
        got = parse_topology(text)
        assert got.gpu_links == want.gpu_links and [got.numa_node(g) for g in range(4)] == [0, 1, 0, 1], (cpu, numa)
        assert got.gpus[1].cpu_affinity == tuple(range(16, 32))


def test_assign_device_puts_tp_groups_on_nvlink_pairs(monkeypatch):
    """The start-up path of every launcher: local rank -> device from a recorded topology (CPU: recorded only)."""
    from verl_mega.parallel.launch_env import DistEnv
    from verl_mega.parallel.scheduler import assign_device

    placement = Placement.single(4, tp=2)
    path = FIX / "4gpu_nvlink_pairs_0_2_and_1_3.txt"
    devices = []
    for rank in range(4):
        env = DistEnv(rank=rank, world_size=4, local_rank=rank, local_world_size=4, node_rank=0,
                      master_addr="127.0.0.1", master_port=29500, launcher="torchrun")
        rec = assign_device(placement, env, str(path))
        assert rec["topology"] == str(path) and rec["node"] == 0
        devices.append(rec["device"])
    assert {frozenset(devices[g[0]:g[-1] + 1]) for g in placement.pool("main").groups("tp")} == {
        frozenset({0, 2}), frozenset({1, 3})}
    env = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, node_rank=0, master_addr="127.0.0.1",
                  master_port=29500, launcher="torchrun")
    assert assign_device(placement, env, None)["device"] == 0  # no topology on CPU: the launcher's order, silently
    with pytest.raises(ValueError, match="parallel.topology_file='/nope' does not exist"):
        assign_device(placement, env, "/nope")


def test_gpus_the_launcher_names_by_uuid_are_placed_by_their_nvidia_smi_index(monkeypatch, caplog):
    """CUDA_VISIBLE_DEVICES by GPU UUID (or a prefix of one, as CUDA takes it): placed by nvidia-smi's index and
    exported in PCI bus order; MIG instances cannot be placed by index and are left as the launcher gave them."""
    import torch

    from verl_mega.parallel import topology
    from verl_mega.parallel.launch_env import DistEnv
    from verl_mega.parallel.scheduler import assign_device

    assert topology.parse_gpu_uuids("0, GPU-aa11\n1, GPU-bb22\n") == {"GPU-aa11": 0, "GPU-bb22": 1}
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # the CUDA branch, on this CPU box
    monkeypatch.setattr(topology, "read_gpu_uuids",
                        lambda: {"GPU-aa11": 0, "GPU-bb22": 1, "GPU-cc33": 2, "GPU-dd44": 3})
    placement, path = Placement.single(4, tp=2), FIX / "4gpu_nvlink_pairs_0_2_and_1_3.txt"
    exported = []
    for rank in range(4):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-dd,GPU-cc33,GPU-bb,GPU-aa11")
        monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
        env = DistEnv(rank=rank, world_size=4, local_rank=rank, local_world_size=4, node_rank=0,
                      master_addr="127.0.0.1", master_port=29500, launcher="torchrun")
        rec = assign_device(placement, env, str(path))
        exported.append([int(i) for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",")])
        assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and exported[-1][rank] == rec["device"]
    assert sorted(exported[0]) == [0, 1, 2, 3] and all(e == exported[0] for e in exported)
    devices = exported[0]
    assert {frozenset(devices[g[0]:g[-1] + 1]) for g in placement.pool("main").groups("tp")} == {
        frozenset({0, 2}), frozenset({1, 3})}
    # two of the four GPUs, by UUID: the job stays on them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cc33,GPU-aa")
    pair = DistEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, node_rank=0, master_addr="127.0.0.1",
                   master_port=29500, launcher="torchrun")
    assign_device(Placement.single(2, tp=2), pair, str(path))
    assert sorted(int(i) for i in os.environ["CUDA_VISIBLE_DEVICES"].split(",")) == [0, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-0a,MIG-0b,MIG-0c,MIG-0d")
    env = DistEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, node_rank=0, master_addr="127.0.0.1",
                  master_port=29500, launcher="torchrun")
    with caplog.at_level("WARNING"):
        assert assign_device(placement, env, str(path))["device"] == 0
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "MIG-0a,MIG-0b,MIG-0c,MIG-0d" and "MIG instances" in caplog.text
