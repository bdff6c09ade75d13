"""Data-parallel islands (parallel.dp_hierarchy): the groups against Megatron-Core's own construction, the islands the
topology scheduler chooses, the one-line errors, the planner's byte model by hand, and the lossy step's codec against
a float64 reference."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

from verl_mega.config import ConfigError, load_config
from verl_mega.engine.grad_sync import decode, encode, error_bound, sum_decoded
from verl_mega.parallel.launch_env import DistEnv
from verl_mega.parallel.placement import Placement, PlacementError
from verl_mega.parallel.wire import FP8_BLOCK, wire_bytes
from verl_mega.parallel.scheduler import (TopologyAwareScheduler, check_islands_agree, dp_island_ranks,
                                          place_on_devices)
from verl_mega.parallel.topology import parse_topology
from verl_mega.planning.dp_sync import dp_sync_traffic

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "topo"
PAIRS = FIX / "4gpu_nvlink_pairs_0_2_and_1_3.txt"


def topo(name: str):
    return parse_topology((FIX / name).read_text())


# ------------------------------------------------------------------------------------------------ groups
def mcore_island_groups(spec: dict) -> dict:
    """Megatron-Core's own groups for ``spec`` (world, dims, islands, ranks): initialize_model_parallel with
    num_distributed_optimizer_instances, run as each rank of a fake world. Leaves mcore's globals as it found them."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from verl_mega.planning.dry_run import fake_world

    def ranks(group):
        return list(dist.get_process_group_ranks(group))

    out = {}
    saved = ps._GLOBAL_MEMORY_BUFFER  # another test's build_groups may have made mcore's scratch buffer
    for rank in spec["ranks"]:
        with fake_world(rank, spec["world"]):
            ps._GLOBAL_MEMORY_BUFFER = None
            try:
                ps.initialize_model_parallel(**spec["dims"], create_gloo_process_groups=False)
                out[rank] = {
                    "intra_dp": ranks(ps.get_data_parallel_group(with_context_parallel=True,
                                                                 partial_data_parallel=True)),
                    "intra_edp": ranks(ps.get_expert_data_parallel_group(partial_expert_data_parallel=True)),
                    "inter_dp": ranks(ps.get_inter_distributed_optimizer_instance_group()),
                    "dist_opt": ranks(ps.get_intra_distributed_optimizer_instance_group())}
            finally:
                ps.destroy_model_parallel()
                ps._GLOBAL_MEMORY_BUFFER = saved
    return out


ISLAND_CASES = [(16, dict(tp=2, pp=2, ep=2), 4), (32, dict(tp=1), 8), (16, dict(tp=2, cp=2), 8),
                (64, dict(tp=4, pp=2), 8), (64, dict(tp=2, pp=2, ep=4, etp=1), 8), (24, dict(tp=1, pp=3), 4)]


def _island_case(world: int, dims: dict, island: int) -> tuple:
    """The placement's pool, Megatron's arguments for it and the ranks to compare."""
    pool = Placement.single(world, **dims).with_dp_hierarchy("node", island).pool("main")
    mcore_dims = dict(tensor_model_parallel_size=pool.tp, pipeline_model_parallel_size=pool.pp,
                      context_parallel_size=pool.cp, expert_model_parallel_size=pool.ep,
                      expert_tensor_parallel_size=pool.etp, num_distributed_optimizer_instances=pool.dp_islands)
    ranks = sorted({0, 1, world // 2 + 1, world - 1, island + pool.tp})
    return pool, {"world": world, "dims": mcore_dims, "ranks": ranks}


@pytest.fixture(scope="module")
def mcore_groups_of_every_case() -> list[dict]:
    """Megatron's groups for every case of ISLAND_CASES: in this process when it has no torch.distributed state,
    else all of them in one fresh one (the fake world needs that; one interpreter start, not one per case)."""
    import subprocess
    import sys

    import torch.distributed as dist

    specs = [_island_case(*case)[1] for case in ISLAND_CASES]
    if not dist.is_initialized():
        return [mcore_island_groups(spec) for spec in specs]
    code = ("import json, sys, warnings; warnings.filterwarnings('ignore'); sys.path.insert(0, sys.argv[2]); "
            "from test_dp_islands import mcore_island_groups; "
            "print('GROUPS ' + json.dumps([mcore_island_groups(s) for s in json.loads(sys.argv[1])]))")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(specs), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("GROUPS "))
    return [{int(k): v for k, v in groups.items()} for groups in json.loads(line[len("GROUPS "):])]


def _case_id(i: int) -> str:
    world, dims, island = ISLAND_CASES[i]
    return "-".join([str(world), *(f"{k}{v}" for k, v in dims.items()), f"island{island}"])


@pytest.mark.parametrize("case", range(len(ISLAND_CASES)), ids=_case_id)
def test_island_groups_equal_megatrons_partial_distributed_optimizer(case, mcore_groups_of_every_case):
    """Megatron-Core's own initialize_model_parallel(num_distributed_optimizer_instances=I), run as every rank of a
    fake world, builds the same intra-island, inter-island and optimizer-instance groups as the placement."""
    world, dims, island = ISLAND_CASES[case]
    pool, spec = _island_case(world, dims, island)
    assert pool.dp_islands == pool.tp * pool.cp * pool.dp // island
    mcore = mcore_groups_of_every_case[case]
    for rank in spec["ranks"]:
        assert {k: tuple(v) for k, v in mcore[rank].items()} == {
            k: pool.group_of(k, rank) for k in ("intra_dp", "intra_edp", "inter_dp", "dist_opt")}, rank
    # the intra-island groups lie inside islands of `island` consecutive ranks; the inter-island ones cross them
    for g in pool.groups("intra_dp") + pool.groups("intra_edp"):
        assert len({r // island for r in g}) == 1
    for g in pool.groups("inter_dp"):
        assert len({r // island for r in g}) == len(g) == pool.dp_islands
    Placement.single(world, **dims).with_dp_hierarchy("node", island).check()


def test_flat_pool_keeps_megatrons_groups():
    placement = Placement.single(8, tp=2)
    assert placement.with_dp_hierarchy("off", None) is placement
    pool = placement.pool("main")
    assert pool.dp_islands == 1 and pool.groups("intra_dp") == pool.groups("dp_cp")
    assert pool.groups("dist_opt") == (pool.ranks,) and all(len(g) == 1 for g in pool.groups("inter_dp"))
    assert "intra_dp" not in placement.rank_record(0)["groups"]


@pytest.mark.parametrize("world,dims,level,island,match", [
    (8, dict(tp=1), "node", 8, "already lies inside a single node"),  # a single island
    (16, dict(tp=8), "node", 8, "tp·cp = 8 fills an island"),
    (16, dict(tp=4, ep=4, etp=4), "node", 8, r"expert etp·ep = 16\) does not fit an island"),
    (24, dict(tp=1), "node", 16, "do not cover whole islands"),
    (16, dict(tp=1), "node", None, "the size of an island is unknown"),
    (16, dict(tp=1), "bogus", 8, "is not one of off, node, island"),
])
def test_impossible_hierarchies_are_one_line(world, dims, level, island, match):
    with pytest.raises(PlacementError, match=match) as info:
        Placement.single(world, **dims).with_dp_hierarchy(level, island)
    assert "\n" not in str(info.value) and "parallel.dp_hierarchy" in str(info.value)


def test_cross_island_dtype_needs_islands():
    with pytest.raises(PlacementError, match="dp_cross_island_dtype=bf16 needs islands; set parallel.dp_hierarchy"):
        Placement.single(8).with_dp_hierarchy("off", None, "bf16")
    with pytest.raises(PlacementError, match="'fp16' is not one of fp32, bf16, fp8"):
        Placement.single(16).with_dp_hierarchy("node", 8, "fp16")


def test_config_keys_are_validated_with_one_line():
    path = str(REPO / "configs" / "quickstart_cpu.yaml")
    with pytest.raises(ConfigError, match=r"parallel.dp_cross_island_dtype=bf16 compresses .* set "
                                          r"parallel.dp_hierarchy=node or island"):
        load_config(path, ["parallel.dp_cross_island_dtype=bf16"])
    with pytest.raises(ConfigError, match="needs the distributed optimizer; set parallel.use_distributed_optimizer"):
        load_config(path, ["parallel.dp_hierarchy=node", "parallel.use_distributed_optimizer=false"])
    with pytest.raises(ConfigError, match="parallel.dp_hierarchy"):
        load_config(path, ["parallel.dp_hierarchy=nodes"])
    cfg = load_config(path, ["parallel.dp_hierarchy=island", "parallel.dp_cross_island_dtype=fp8"])
    assert (cfg.parallel.dp_hierarchy, cfg.parallel.dp_cross_island_dtype) == ("island", "fp8")


# ------------------------------------------------------------------------------------------------ scheduler
def test_island_size_comes_from_the_topology():
    assert dp_island_ranks("off", 8, None) is None and dp_island_ranks("node", 8, None) == 8
    assert dp_island_ranks("island", 4, topo("4gpu_nvlink_pairs_0_2_and_1_3.txt")) == 2
    assert dp_island_ranks("island", 8, topo("a6000_8gpu_nvlink_pairs.txt")) == 2
    assert dp_island_ranks("island", 8, topo("dgx_h100_8gpu_12nic.txt")) == 8  # NVSwitch: the node
    with pytest.raises(PlacementError, match="needs the node's NVLink islands.*parallel.topology_file"):
        dp_island_ranks("island", 8, None)
    with pytest.raises(PlacementError, match="differ in size"):  # one NVLink pair next to two lone GPUs
        dp_island_ranks("island", 4, topo("a100_4gpu_one_nvlink_pair.txt"))


@pytest.mark.parametrize("name,nodes,tp", [("4gpu_nvlink_pairs_0_2_and_1_3.txt", 1, 1),
                                           ("a6000_8gpu_nvlink_pairs.txt", 2, 1), ("dgx_h100_8gpu_12nic.txt", 4, 2)])
def test_scheduler_lays_islands_out_in_rank_order(name, nodes, tp):
    """With parallel.dp_hierarchy=island every island of the placement is one NVLink island of the hardware, the
    intra-island groups run on NVLink and the inter-island groups leave it."""
    t = topo(name)
    placement = Placement.single(t.num_gpus * nodes, tp=tp).with_dp_hierarchy(
        "island", dp_island_ranks("island", t.num_gpus, t))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = TopologyAwareScheduler([t] * nodes).plan(placement)
    assert plan.reports["island"] and all(r.in_nvlink_island for r in plan.reports["island"])
    assert all(r.in_nvlink_island and r.link.startswith("NV") for r in plan.reports["intra_dp"])
    assert all(not r.in_nvlink_island for r in plan.reports["inter_dp"])
    assert all(r.in_nvlink_island for r in plan.reports["tp"])
    assert plan.to_json()["dp_hierarchy"] == "island"
    if name.startswith("4gpu"):
        assert plan.device_order == ((0, 2, 1, 3),)  # the pairs (0,2) and (1,3), island after island


def test_place_on_devices_cuts_islands_and_records_them():
    envs = [DistEnv(rank=r, world_size=4, local_rank=r, local_world_size=4, node_rank=0, master_addr="127.0.0.1",
                    master_port=29500, launcher="torchrun") for r in range(4)]
    base = Placement.single(4)
    records = []
    for env in envs:
        placement, rec = place_on_devices(base, env, str(PAIRS), dp_hierarchy="island", cross_island_dtype="bf16")
        records.append(rec)
    assert [r["device"] for r in records] == [0, 2, 1, 3] and records[0]["dp_island_ranks"] == 2
    pool = placement.pool("main")
    assert placement.dp_hierarchy == "island" and pool.dp_islands == 2 and pool.dp_cross_island_dtype == "bf16"
    assert pool.groups("intra_dp") == ((0, 1), (2, 3)) and pool.groups("inter_dp") == ((0, 2), (1, 3))
    check_islands_agree(records)
    with pytest.raises(PlacementError, match="islands differ in size"):
        check_islands_agree(records[:2] + [{**records[2], "node": 1, "dp_island_ranks": 4}])
    # a node of 4 ranks is the whole world: one island, nothing to cut
    with pytest.raises(PlacementError, match="already lies inside a single node"):
        place_on_devices(base, envs[0], None, dp_hierarchy="node")
    assert place_on_devices(base, envs[0], None)[0] is base  # off: the placement as it was


def test_trainer_refuses_a_single_island_before_building(tmp_path, monkeypatch, capsys):
    """The run path: a one-rank world asked for islands stops with one line, before any output is written."""
    from verl_mega.train import main

    monkeypatch.setenv("VERL_MEGA_CACHE", str(tmp_path / "cache"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    saved = dict(os.environ)  # the launcher variables it exports must not outlive the test
    try:
        rc = main(["--config", str(REPO / "configs" / "quickstart_cpu.yaml"),
                   f"trainer.output_dir={tmp_path / 'out'}", "parallel.dp_hierarchy=node"])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1, errors
    assert "parallel.dp_hierarchy=node" in errors[0] and "set parallel.dp_hierarchy=off" in errors[0]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ bytes
def test_sync_bytes_by_hand():
    n = 1 << 20  # values per rank
    flat = dp_sync_traffic(elements=n, group=64, per_island=8)
    assert flat.sent_bytes == 63 / 64 * 6 * n and flat.cross_bytes == 63 / 64 * 6 * n / 8
    inside = dp_sync_traffic(elements=n, group=8, per_island=8)
    assert inside.cross_bytes == 0 and inside.inside_bytes == 7 / 8 * 6 * n
    fp32 = dp_sync_traffic(elements=n, group=64, per_island=8, islands=8)
    assert fp32.inside_bytes == 7 / 8 * 6 * n and fp32.cross_bytes == 2 * 7 / 8 * 4 * n / 8
    bf16 = dp_sync_traffic(elements=n, group=64, per_island=8, islands=8, cross_dtype="bf16")
    assert bf16.cross_bytes == 2 * 7 * 2 * (n // 64)  # all-to-all out and all-gather back of 8 pieces of N/64
    fp8 = dp_sync_traffic(elements=n, group=64, per_island=8, islands=8, cross_dtype="fp8")
    assert fp8.cross_bytes == 2 * 7 * (n // 64 + 4 * n // 64 // FP8_BLOCK)
    # between islands, against the flat rings of 1024 ranks, 8 to a node: fp32 4/3 (no saving), bf16 2/3, fp8
    # about 1/3 (plus a 4-byte scale per 128 values)
    big = {dtype: dp_sync_traffic(elements=n, group=1024, per_island=8, islands=128, cross_dtype=dtype).cross_bytes
           / dp_sync_traffic(elements=n, group=1024, per_island=8).cross_bytes for dtype in ("fp32", "bf16", "fp8")}
    assert big == pytest.approx({"fp32": 4 / 3, "bf16": 2 / 3, "fp8": 1 / 3 * 33 / 32}, rel=0.01)
    assert wire_bytes(130, "fp8") == 2 * 128 + 8 and wire_bytes(130, "bf16") == 260
    # latency: a flat ring takes 2·(m − 1) steps, islands 2·(k − 1) + 2·(I − 1)
    assert flat.seconds(inside_bps=1e30, cross_bps=1e30, latency_s=1.0) == pytest.approx(126)
    assert fp32.seconds(inside_bps=1e30, cross_bps=1e30, latency_s=1.0) == pytest.approx(28)


def test_plans_count_the_bytes_between_islands(capsys):
    """tools/plan.py at 1024 GPUs: bf16 between nodes halves fp32's bytes there and undercuts the flat rings."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_cli", REPO / "tools" / "plan.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    common = ["--model", str(REPO / "tests/fixtures/hf_configs/qwen2.5-7b.json"), "--gpus", "1024",
              "--gpu-mem-gb", "141", "--tp", "2", "--pp", "1", "--gen-tp", "2", "--json", "--no-critic"]
    got = {}
    for extra in ([], ["--dp-hierarchy", "node"], ["--dp-hierarchy", "node", "--dp-cross-island-dtype", "bf16"],
                  ["--dp-hierarchy", "node", "--dp-cross-island-dtype", "fp8"]):
        assert cli.main(common + extra) == 0
        plan = json.loads(capsys.readouterr().out)["plans"][0]
        got[tuple(extra[1::2])] = plan
    flat, fp32, bf16, fp8 = (got[k]["dp_sync"] for k in ((), ("node",), ("node", "bf16"), ("node", "fp8")))
    assert got[("node",)]["dp_islands"] == 128 and flat["islands_per_dp_group"] == 1
    assert fp32["cross_island_bytes_per_gpu"] > flat["cross_island_bytes_per_gpu"]
    assert bf16["cross_island_bytes_per_gpu"] == pytest.approx(fp32["cross_island_bytes_per_gpu"] / 2, rel=1e-6)
    assert bf16["cross_island_bytes_per_gpu"] < 0.7 * flat["cross_island_bytes_per_gpu"]
    assert fp8["cross_island_bytes_per_gpu"] < 0.36 * flat["cross_island_bytes_per_gpu"]
    # the price: optimizer state sharded over the 4 data-parallel ranks of a node instead of all 512
    assert got[("node",)]["memory_gb"]["train"] > got[()]["memory_gb"]["train"]
    with pytest.raises(SystemExit):
        cli.main(common + ["--dp-hierarchy", "rack"])
    capsys.readouterr()
    llama = ["--model", str(REPO / "tests/fixtures/hf_configs/llama-2-7b.json")] + common[2:-2]
    assert cli.main(llama + ["--tp", "8", "--gen-tp", "8", "--dp-hierarchy", "node"]) == 2
    assert "tp·cp = 8 fills an island" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ codec
def _partials(islands: int, n: int, seed: int) -> torch.Tensor:
    """Islands' partial sums: mixed magnitudes, exact cancellations, zeros and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(islands, n, generator=g) * torch.exp(4 * torch.randn(islands, n, generator=g))
    x[:, :64] = 0.0
    x[0, 64:128] = 3e-3
    x[1, 64:128] = -3e-3 + 1e-7  # cancels to 1e-7
    x[:, 128:192] *= 1e-30  # far below e4m3's normals after scaling
    return x


def _lossy_sum(partials: torch.Tensor, dtype: str) -> torch.Tensor:
    """What every island ends with: its pieces encoded, summed in fp32 by the owner, the sum encoded and decoded."""
    n = partials.shape[1]
    total = sum_decoded(decode(encode(p, dtype), dtype, n) for p in partials)
    return decode(encode(total, dtype), dtype, n)


@pytest.mark.parametrize("dtype,islands", [("bf16", 2), ("bf16", 16), ("fp8", 2), ("fp8", 16), ("bf16", 128)])
def test_lossy_step_stays_within_its_bound_of_float64(dtype, islands):
    x = _partials(islands, 4096 + 77, seed=islands)
    exact = x.double().sum(dim=0)
    err = (_lossy_sum(x, dtype).double() - exact).abs()
    bound = error_bound(x, dtype)
    assert (err <= bound).all(), float((err / bound.clamp_min(1e-300)).max())
    mag = x.double().abs().sum(dim=0)
    u = {"bf16": 2.0 ** -8, "fp8": 2.0 ** -4}[dtype]
    # the bound is the derivation's, not vacuous: about 2u·Σ|x_i| (fp8: plus the subnormal term) ...
    if dtype == "bf16":
        assert (bound <= (2 * u + u * u + islands * 2.0 ** -23) * mag * 1.0001 + 1e-300).all()
    # ... and the step really is lossy: somewhere the error is more than a tenth of u·Σ|x_i|
    assert ((err > 0.1 * u * mag) & (mag > 0)).any()
    assert (err[:64] == 0).all()  # zeros stay zeros
    relative = float(err.sum() / mag.sum())  # measured: the mean error relative to the magnitudes summed
    assert relative < u


def test_codec_round_trip_and_wire_size():
    v = torch.tensor([0.0, 1.0, -448.0, 3.3e-3, 1e-40, 2.5])
    for dtype in ("bf16", "fp8"):
        payload = encode(v, dtype)
        assert payload.dtype == torch.uint8 and payload.numel() == wire_bytes(v.numel(), dtype)
        back = decode(payload, dtype, v.numel())
        assert back.dtype == torch.float32 and back.shape == v.shape
        assert float((back - v).abs().max()) <= {"bf16": 2.0 ** -8, "fp8": 2.0 ** -4}[dtype] * 448
    assert decode(encode(v, "fp8"), "fp8", 6)[2] == -448.0  # the block's largest value is exact
    assert math.isclose(float(decode(encode(v, "bf16"), "bf16", 6)[1]), 1.0)
