"""Placement: pools, roles and every group, checked against Megatron-Core's own rank generators and first
principles (HybridFlow §5) on layouts up to 1024 ranks."""

from __future__ import annotations

from fractions import Fraction
from itertools import product

import pytest
import torch

from verl_mega.parallel.placement import GROUP_KINDS, Placement, PlacementError, Pool


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _layouts():
    """(world, t, p, tg), from 1 rank to 1024."""
    cases = []
    for world in (1, 2, 4, 8, 12, 16, 64, 1024):
        for t, p in product((1, 2, 4, 8), (1, 2, 4)):
            if world % (t * p):
                continue
            if world >= 64 and (t, p) not in {(8, 4), (4, 2), (8, 1), (2, 4)}:
                continue  # big worlds: a few shapes (same properties, only slower)
            cases += [(world, t, p, tg) for tg in _divisors(t)]
    return cases


def _needed_shards(block: int, tg: int, t: int) -> set[int]:
    """Training TP shards overlapping generation block `block` (row fractions [block/tg, (block+1)/tg))."""
    lo, hi = Fraction(block, tg), Fraction(block + 1, tg)
    return {i for i in range(t) if Fraction(i, t) < hi and Fraction(i + 1, t) > lo}


@pytest.mark.parametrize("world,t,p,tg", _layouts())
def test_generation_groups_reuse_own_shards(world, t, p, tg):
    pool = Placement.single(world, tp=t, pp=p, gen_tp=tg).pool("main")
    d, m = world // (t * p), t // tg
    assert pool.dp == d and pool.micro_dp == m and pool.num_engines == world // tg
    for rank in range(world):
        c = pool.coords(rank)
        # Megatron's rank → coordinates, written out independently: tp fastest, then dp, then pp (cp = 1)
        assert (c["tp"], c["dp"], c["pp"]) == (rank % t, (rank // t) % d, rank // (t * d))
        needed = _needed_shards(c["gen_tp"], tg, t)
        assert c["tp"] in needed  # the block a rank serves contains its own training shard
        micro = pool.group_of("micro_dp", rank)
        assert [pool.coords(q)["tp"] for q in micro] == sorted(needed)
        gen = pool.group_of("gen_tp", rank)
        assert [pool.coords(q)["gen_tp"] for q in gen] == list(range(tg))
        assert all((pool.coords(q)["dp"], pool.coords(q)["pp"]) == (c["dp"], c["pp"]) for q in gen)
        tps = [pool.coords(q)["tp"] for q in gen]
        assert all(b - a == m for a, b in zip(tps, tps[1:])) and list(gen) == sorted(gen)
        assert all(pool.coords(q)["engine"] == c["engine"] for q in gen)
        assert [pool.coords(q)["pp"] for q in pool.group_of("pp", rank)] == list(range(p))
    assert pool.sync_bytes_per_rank(Fraction(1)) == Fraction(p * m - 1, p * t)  # HybridFlow Table 2
    assert pool.generation_weight_bytes(1.0) == pytest.approx(1 / tg)
    order = pool.vllm_rank_order()
    assert sorted(order) == list(range(world))
    assert tuple(tuple(order[i:i + tg]) for i in range(0, world, tg)) == pool.groups("gen_tp")
    Placement.single(world, tp=t, pp=p, gen_tp=tg).check()


def test_paper_example_t4_tg2():
    pool = Placement.single(4, tp=4, gen_tp=2).pool("main")
    assert pool.groups("gen_tp") == ((0, 2), (1, 3))
    assert pool.groups("micro_dp") == ((0, 1), (2, 3))
    assert pool.vllm_rank_order() == [0, 2, 1, 3]


@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp", [(2, 1, 4, 2, 1, 2), (4, 2, 2, 1, 2, 2), (1, 1, 8, 1, 4, 1),
                                                (8, 1, 2, 4, 2, 4), (2, 2, 2, 2, 4, 1), (2, 1, 2, 1, 2, 1)])
def test_groups_match_megatron_rank_generator(tp, cp, dp, pp, ep, etp):
    from megatron.core.parallel_state import RankGenerator

    world = tp * cp * dp * pp
    pool = Placement.single(world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp).pool("main")
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    for kind, token in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp_cp", "cp-dp"),
                        ("tp_cp", "tp-cp"), ("mp", "tp-pp"), ("tp_dp_cp", "tp-cp-dp")):
        assert sorted(map(tuple, dense.get_ranks(token))) == sorted(pool.groups(kind)), kind
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for kind, token in (("ep", "ep"), ("etp", "tp"), ("edp", "dp"), ("tp_ep", "tp-ep"), ("tp_ep_pp", "tp-ep-pp")):
        assert sorted(map(tuple, expert.get_ranks(token))) == sorted(pool.groups(kind)), kind


def test_two_pools_at_1024_ranks(monkeypatch):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    train = Pool(name="train", ranks=tuple(range(768)), tp=8, pp=4)
    rollout = Pool(name="gen", ranks=tuple(range(768, 1024)), gen_tp=4, trains=False)
    placement = Placement(1024, (train, rollout), {"actor": "train", "rollout": "gen"})
    assert not placement.colocated and placement.pool_of("critic") is train
    assert placement.pool_of_rank(800) is rollout and train.dp == 24 and rollout.num_engines == 64
    assert rollout.groups("gen_tp")[0] == (768, 769, 770, 771)
    checks = placement.check()
    assert len(checks) == 2
    # mcore's HyperCommGrid with a rank offset is an independent enumeration of the training pool's groups
    monkeypatch.setenv("WORLD_SIZE", "1024")  # HyperCommGrid checks its grid against the world size
    grid = HyperCommGrid([8, 1, 24, 4], ["tp", "cp", "dp", "pp"], rank_offset=0)
    for kind, dims in (("tp", ["tp"]), ("dp", ["dp"]), ("pp", ["pp"])):
        assert sorted(map(tuple, grid._gen_rank_enum(dims))) == sorted(train.groups(kind)), kind
    rec = placement.rank_record(1000)
    assert rec["pool"] == "gen" and rec["groups"]["gen_tp"] == [1000, 1001, 1002, 1003]


@pytest.mark.parametrize("make,match", [
    (lambda: Pool(name="a", ranks=range(6), tp=4), "placement.pools.a: its 6 ranks are not divisible by tp·pp·cp"),
    (lambda: Pool(name="a", ranks=range(4), tp=4, gen_tp=3), "pools.a.gen_tp=3 must divide placement.pools.a.tp=4"),
    (lambda: Pool(name="main", ranks=range(4), tp=4, gen_tp=3), "rollout.gen_tp=3 must divide parallel.tp=4"),
    (lambda: Pool(name="a", ranks=range(4), tp=2, ep=4), "etp·ep = 2·4 must divide"),
    (lambda: Pool(name="a", ranks=range(4), tp=2, gen_tp=0), "positive int"),
    (lambda: Pool(name="a", ranks=range(4), pp=1, vpp=2), "vpp=2 needs"),
    (lambda: Pool(name="main", ranks=range(4), sequence_parallel=True), "parallel.sequence_parallel=true needs"),
    (lambda: Placement(4, (Pool(name="a", ranks=range(3)),)), "world has 4"),
    (lambda: Placement(4, (Pool(name="a", ranks=range(3)), Pool(name="b", ranks=(2, 3)))), "rank 2 is in pools"),
    (lambda: Placement(4, (Pool(name="a", ranks=range(2)), Pool(name="b", ranks=(2, 3))), {"rollout": "b"}),
     "roles.actor is not set"),
    (lambda: Placement(2, (Pool(name="a", ranks=range(2)),), {"actor": "b"}), "'b' is not a pool"),
    (lambda: Placement(2, (Pool(name="a", ranks=range(2)),), {"critc": "a"}), "unknown role"),
    (lambda: Placement(4, (Pool(name="a", ranks=range(2)), Pool(name="b", ranks=(2, 3), trains=False)),
                       {"actor": "a", "critic": "b"}), "only generates"),
])
def test_impossible_placements_are_rejected(make, match):
    with pytest.raises(PlacementError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


def test_every_kind_is_known():
    pool = Placement.single(8, tp=2, pp=2).pool("main")
    assert all(pool.groups(k) for k in GROUP_KINDS)
    assert pool.groups("embd") == ((0, 4), (1, 5), (2, 6), (3, 7))
    with pytest.raises(PlacementError, match="unknown group kind"):
        pool.groups("zz")


def test_generation_expert_parallelism_errors_are_one_line():
    from verl_mega.parallel.placement import Pool

    with pytest.raises(PlacementError, match=r"rollout.gen_ep=3 must be gen_tp·D with D dividing the cp·dp "
                                             r"training TP groups of a pipeline stage \(4\).*choose "
                                             r"rollout.gen_ep among \[2, 4, 8\]"):
        Placement.single(16, tp=2, pp=2, gen_tp=2, gen_ep=3)
    with pytest.raises(PlacementError, match=r"placement.pools.gen.gen_ep=6 must be gen_tp·D"):
        Pool(name="gen", ranks=tuple(range(4)), gen_tp=2, gen_ep=6, trains=False)
    pools = (Pool(name="train", ranks=(0, 1), tp=2), Pool(name="gen", ranks=(2, 3), gen_tp=1, gen_ep=2, trains=False))
    with pytest.raises(PlacementError, match="gen_ep > 1: expert-parallel generation runs with the rollout on the "
                                             "actor's pool"):
        Placement(4, pools, {"actor": "train", "rollout": "gen"})


def _vllm_groups(order: list[int], tp: int, dp: int) -> dict[str, list[tuple[int, ...]]]:
    """The groups vLLM's initialize_model_parallel builds (vllm/distributed/parallel_state.py, pp = pcp = 1) over
    vLLM ranks, mapped to our ranks through ``order`` (position v: the rank that plays vLLM rank v)."""
    all_ranks = torch.arange(len(order)).reshape(-1, dp, 1, 1, tp)
    vllm = {"tp": all_ranks.view(-1, tp), "dp": all_ranks.transpose(1, 4).reshape(-1, dp),
            "ep": all_ranks.transpose(1, 2).reshape(-1, dp * tp)}
    return {k: [tuple(order[v] for v in g.tolist()) for g in groups] for k, groups in vllm.items()}


@pytest.mark.parametrize("world,tp,pp,gen_tp,gen_ep", [(16, 4, 2, 2, 4), (16, 4, 2, 2, 2), (32, 2, 2, 2, 8),
                                                       (16, 1, 2, 1, 8), (1024, 8, 4, 4, 64), (1024, 4, 2, 1, 128)])
def test_generation_expert_parallel_groups_are_vllms(world, tp, pp, gen_tp, gen_ep):
    """Expert-parallel generation groups join D = gen_ep/gen_tp engines at the same position of D consecutive
    training TP groups of one stage: with the placement's vLLM rank order, the TP, data-parallel and expert-parallel
    groups vLLM builds for itself (its own construction, reproduced) are exactly ours, each ascending; a rank's vLLM
    EP rank (its position in the EP group) is its gen_ep coordinate; every pipeline group shares one generation
    layout; and ``Placement.check`` sweeps it all."""
    placement = Placement.single(world, tp=tp, pp=pp, gen_tp=gen_tp, gen_ep=gen_ep)
    pool = placement.pool("main")
    vllm = _vllm_groups(pool.vllm_rank_order(), gen_tp, gen_ep // gen_tp)
    assert sorted(vllm["tp"]) == sorted(pool.groups("gen_tp"))
    assert sorted(vllm["ep"]) == sorted(pool.groups("gen_ep"))
    for kind in ("tp", "dp", "ep"):
        assert all(list(g) == sorted(g) for g in vllm[kind]), kind
    for group in vllm["ep"]:
        assert len(group) == gen_ep and all(pool.coords(r)["gen_ep"] == i for i, r in enumerate(group))
        stages = {pool.coords(r)["pp"] for r in group}
        assert len(stages) == 1  # one pipeline stage: its ranks hold the same layers
    for group in pool.groups("pp"):
        assert len({(pool.coords(r)["gen_tp"], pool.coords(r)["gen_ep"]) for r in group}) == 1
    assert "expert-parallel generation groups of" in placement.check()[0]
