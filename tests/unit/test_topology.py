"""Parser tests on recorded `nvidia-smi topo -m` outputs (tests/fixtures/topo, sources in SOURCES.md).

Expected values were read off the fixture text by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_mega.parallel.topology import (
    Link,
    LinkKind,
    TopologyParseError,
    parse_cpu_list,
    parse_topology,
)

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "topo"


def load(name: str) -> str:
    return (FIX / name).read_text()


# name -> (gpus, NIC display names, islands, NUMA per GPU, nearest NIC per GPU)
EXPECTED = {
    "dgx_h100_8gpu_12nic.txt": (
        8, [f"mlx5_{i}" for i in range(12)], [(0, 1, 2, 3, 4, 5, 6, 7)], [0, 0, 0, 0, 1, 1, 1, 1],
        ["mlx5_0", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_9", "mlx5_10", "mlx5_11"]),
    "a30_4gpu_nvlink_pairs.txt": (
        4, ["mlx5_0"], [(0, 1), (2, 3)], [0, 0, 1, 1], ["mlx5_0"] * 4),
    "a6000_8gpu_nvlink_pairs.txt": (
        8, ["mlx5_0", "mlx5_1"], [(0, 1), (2, 3), (4, 5), (6, 7)], [0, 0, 0, 0, 1, 1, 1, 1], ["mlx5_0"] * 8),
    "a100_4gpu_one_nvlink_pair.txt": (
        4, ["mlx5_0", "mlx5_1"], [(0, 1), (2,), (3,)], [0, 0, 1, 1], ["mlx5_0"] * 4),
    "h200_2gpu_nvlink.txt": (2, [], [(0, 1)], [0, 0], [None, None]),
    "rtx3090_2gpu_pcie_sys.txt": (2, [], [(0,), (1,)], [None, 1], [None, None]),
    "rtx4090_8gpu_pcie.txt": (
        8, ["NIC0", "NIC1"], [(g,) for g in range(8)], [0, 0, 0, 0, 1, 1, 1, 1], ["NIC0"] * 8),
    "pcie_8gpu_switches_mlx5.txt": (
        8, ["mlx5_0"], [(g,) for g in range(8)], [None] * 8, ["mlx5_0"] * 8),
    "t4_4gpu_pcie.txt": (4, [], [(0,), (1,), (2,), (3,)], [None] * 4, [None] * 4),
    "4gpu_nvlink_pairs_0_2_and_1_3.txt": (4, [], [(0, 2), (1, 3)], [0, 1, 0, 1], [None] * 4),
}


def test_every_fixture_is_covered():
    assert {p.name for p in FIX.glob("*.txt")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_parses(name):
    gpus, nics, islands, numa, nearest = EXPECTED[name]
    topo = parse_topology(load(name))
    assert topo.num_gpus == gpus
    assert [n.display_name for n in topo.nics] == nics
    assert [tuple(i) for i in topo.nvlink_islands] == islands
    assert [topo.numa_node(g) for g in range(gpus)] == numa
    assert [(n.display_name if (n := topo.nearest_nic(g)) else None) for g in range(gpus)] == nearest
    for g in range(gpus):
        assert topo.link(g, g).kind is LinkKind.SELF


def test_specific_links_and_affinity():
    dgx = parse_topology(load("dgx_h100_8gpu_12nic.txt"))
    assert dgx.link(0, 5) == Link(LinkKind.NVLINK, 18) and str(dgx.link(3, 4)) == "NV18"
    assert dgx.gpus[0].cpu_affinity == (4, 6, 8, 10, 12)
    assert dgx.gpus[7].cpu_affinity == (1, 3, 5, 7, 9, 11)
    assert dgx.gpus[0].gpu_numa_id is None
    assert str(dgx.gpu_nic_links[5][9]) == "PIX" and str(dgx.gpu_nic_links[5][0]) == "SYS"

    pairs = parse_topology(load("a30_4gpu_nvlink_pairs.txt"))
    assert str(pairs.link(0, 1)) == "NV4" and str(pairs.link(0, 2)) == "SYS"
    assert pairs.gpus[2].cpu_affinity == tuple(range(24, 48)) + tuple(range(72, 96))
    assert [str(pairs.gpu_nic_links[g][0]) for g in range(4)] == ["SYS", "SYS", "PXB", "PIX"]

    switches = parse_topology(load("pcie_8gpu_switches_mlx5.txt"))  # older driver: NIC named by device
    assert [str(switches.link(0, g)) for g in range(1, 8)] == ["PIX", "PXB", "PXB", "SYS", "SYS", "SYS", "SYS"]
    assert switches.nics[0].name == "mlx5_0" and switches.gpus[4].cpu_affinity == tuple(range(14, 28))
    assert str(switches.gpu_nic_links[4][0]) == "PHB"

    a6000 = parse_topology(load("a6000_8gpu_nvlink_pairs.txt"))
    assert str(a6000.link(0, 2)) == "NODE" and str(a6000.link(0, 4)) == "SYS"
    assert a6000.gpus[6].cpu_affinity == tuple(range(64, 128))

    sys_box = parse_topology(load("rtx3090_2gpu_pcie_sys.txt"))  # NUMA Affinity printed as N/A for GPU0
    assert sys_box.gpus[0].cpu_affinity == tuple(range(8)) + tuple(range(16, 24))
    assert sys_box.gpus[0].numa_affinity is None and sys_box.gpus[1].numa_affinity == (1,)


def test_bandwidth_rank_order():
    order = ["NV18", "NV12", "NV4", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]
    kinds = {"PIX": LinkKind.PIX, "PXB": LinkKind.PXB, "PHB": LinkKind.PHB, "NODE": LinkKind.NODE,
             "SYS": LinkKind.SYS}
    links = [Link(LinkKind.NVLINK, int(s[2:])) if s.startswith("NV") else Link(kinds[s]) for s in order]
    ranks = [ln.bandwidth_rank for ln in links]
    assert ranks == sorted(ranks, reverse=True) and len(set(ranks)) == len(ranks)
    assert Link(LinkKind.SELF).bandwidth_rank > ranks[0]


def test_real_h200_output_with_its_ansi_underline():
    text = load("h200_2gpu_nvlink.txt")  # nvidia-smi 580 underlines the header even when writing to a file
    assert "\x1b[4m" in text
    topo = parse_topology(text)
    assert str(topo.link(0, 1)) == "NV18" and topo.gpus[1].cpu_affinity == tuple(range(32))


def test_ansi_escapes_and_crlf_are_ignored():
    plain = load("dgx_h100_8gpu_12nic.txt")
    coloured = (plain.replace("NV18", "\x1b[32mNV18\x1b[0m").replace("PIX", "\x1b[1;33mPIX\x1b[0m")
                .replace("\n", "\r\n"))
    assert parse_topology(coloured) == parse_topology(plain)


@pytest.mark.parametrize("name", ["rtx4090_8gpu_pcie.txt", "a100_4gpu_one_nvlink_pair.txt", "h200_2gpu_nvlink.txt",
                                  "rtx3090_2gpu_pcie_sys.txt", "pcie_8gpu_switches_mlx5.txt"])
def test_tab_and_space_layouts_agree(name):
    text = load(name)
    assert "\t" in text
    assert parse_topology(text.expandtabs(8)) == parse_topology(text)


def test_empty_cpu_affinity_cell():
    # Rows as a 4x A100 Slurm node prints them when the job's cpuset hides the affinity of GPUs 2-3.
    text = ("\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
            "GPU0\t X \tNV4\tNV4\tNV4\tNODE\t0\t0\t\tN/A\n"
            "GPU1\tNV4\t X \tNV4\tNV4\tNODE\t0\t0\t\tN/A\n"
            "GPU2\tNV4\tNV4\t X \tNV4\tNODE\t\t1\t\tN/A\n"
            "GPU3\tNV4\tNV4\tNV4\t X \tNODE\t\t1\t\tN/A\n"
            "NIC0\tNODE\tNODE\tNODE\tNODE\t X \n")
    topo = parse_topology(text)
    assert topo.gpus[0].cpu_affinity == (0,) and topo.gpus[2].cpu_affinity is None
    assert [topo.numa_node(g) for g in range(4)] == [0, 0, 1, 1]
    assert topo.nvlink_islands == ((0, 1, 2, 3),)


def test_hybrid_cube_mesh_splits_into_cliques():
    # GPU block of a DGX-1 (V100) matrix from NVIDIA/nccl-tests#29: NVLink-connected but not all-to-all.
    rows = ["X NV2 NV2 NV1 NV1 SYS SYS SYS", "NV2 X NV1 NV2 SYS NV1 SYS SYS", "NV2 NV1 X NV1 SYS SYS NV2 SYS",
            "NV1 NV2 NV1 X SYS SYS SYS NV2", "NV1 SYS SYS SYS X NV2 NV2 NV1", "SYS NV1 SYS SYS NV2 X NV1 NV2",
            "SYS SYS NV2 SYS NV2 NV1 X NV1", "SYS SYS SYS NV2 NV1 NV2 NV1 X"]
    text = "\t" + "\t".join(f"GPU{i}" for i in range(8)) + "\n" + "".join(
        f"GPU{i}\t" + "\t".join(r.split()) + "\n" for i, r in enumerate(rows))
    topo = parse_topology(text)
    assert topo.nvlink_islands == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert str(topo.worst_link((0, 1, 2, 3))) == "NV1"


def _locate(text: str, token: str) -> tuple[int, int]:
    for i, line in enumerate(text.splitlines(), 1):
        if token in line:
            return i, line.index(token) + 1
    raise AssertionError(token)


def test_unknown_token_names_line_and_column():
    text = load("dgx_h100_8gpu_12nic.txt").replace("NODE    PIX     SYS     SYS     SYS     SYS     SYS     SYS     4",
                                                   "NODE    PIXNODE SYS     SYS     SYS     SYS     SYS     SYS     4",
                                                   1)
    line, col = _locate(text, "PIXNODE")
    with pytest.raises(TopologyParseError) as exc:
        parse_topology(text)
    msg = str(exc.value)
    assert f"line {line}, column {col}" in msg and "'PIXNODE'" in msg and "\n" not in msg


def test_malformed_inputs_are_rejected():
    good = load("a30_4gpu_nvlink_pairs.txt")
    with pytest.raises(TopologyParseError, match="no `nvidia-smi topo -m` matrix"):
        parse_topology("No devices were found\n")
    lines = good.splitlines()
    with pytest.raises(TopologyParseError, match="no row for GPU3"):
        parse_topology("\n".join(lines[:4]) + "\n")
    asym = good.replace("GPU1    NV4      X      SYS     SYS", "GPU1    NV4      X      NODE    SYS", 1)
    with pytest.raises(TopologyParseError, match="symmetric"):
        parse_topology(asym)
    off_diag = good.replace("GPU1    NV4      X ", "GPU1     X       X ", 1)
    with pytest.raises(TopologyParseError, match="diagonal"):
        parse_topology(off_diag)
    short = good.replace("GPU3    SYS     SYS     NV4      X      PIX", "GPU3    SYS     SYS     NV4      X", 1)
    with pytest.raises(TopologyParseError, match=r"line 5, column 40: unknown link token '24-47,72-95'"):
        parse_topology(short)  # a missing cell shifts the CPU affinity into the NIC0 column
    nic_only = "\n".join(lines[:5]) + "\n"  # no NIC row is fine: NIC rows add nothing the GPU rows lack
    assert parse_topology(nic_only).num_gpus == 4


def test_cpu_list_parsing():
    assert parse_cpu_list("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    assert parse_cpu_list("N/A") is None and parse_cpu_list("") is None
    with pytest.raises(ValueError):
        parse_cpu_list("0-x")
