"""3D-HybridEngine layout planner: every group property checked from first principles on layouts up to 1024 ranks."""

from __future__ import annotations

from fractions import Fraction
from itertools import product

import pytest

from verl_mega.hybrid.layout import HybridLayout, LayoutError, ModelDims, plan_layout


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _layouts():
    """(world, t, p, tg, order) combinations, from 1 rank to 1024."""
    cases = []
    for world in (1, 2, 4, 8, 12, 16, 64, 1024):
        for t, p in product((1, 2, 4, 8), (1, 2, 4)):
            if world % (t * p):
                continue
            if world >= 64 and (t, p) not in {(8, 4), (4, 2), (8, 1), (2, 4)}:
                continue  # keep the big worlds to a few shapes: the properties are the same, only slower
            for tg in _divisors(t):
                for order in ("tp-dp-pp", "tp-pp-dp"):
                    cases.append((world, t, p, tg, order))
    return cases


def _coords_independent(rank: int, t: int, p: int, d: int, order: str) -> tuple[int, int, int]:
    """Megatron's rank → (dp, pp, tp) written out independently of the planner (tp fastest)."""
    tp = rank % t
    if order == "tp-dp-pp":
        return (rank // t) % d, rank // (t * d), tp
    return rank // (t * p), (rank // t) % p, tp


def _needed_shards(block: int, tg: int, t: int) -> set[int]:
    """Training TP shards overlapping generation block `block` (row fractions [block/tg, (block+1)/tg))."""
    lo, hi = Fraction(block, tg), Fraction(block + 1, tg)
    return {i for i in range(t) if Fraction(i, t) < hi and Fraction(i + 1, t) > lo}


@pytest.mark.parametrize("world,t,p,tg,order", _layouts())
def test_group_properties(world, t, p, tg, order):
    layout = plan_layout(world_size=world, tp=t, pp=p, gen_tp=tg, order=order)
    d = world // (t * p)
    m = t // tg
    assert layout.d == d and layout.micro_dp == m
    assert layout.dg == p * t // tg and layout.num_engines == world // tg == d * layout.dg

    plans = [layout.rank_plan(r) for r in range(world)]
    for plan in plans:
        assert (plan.dp_rank, plan.pp_rank, plan.tp_rank) == _coords_independent(plan.rank, t, p, d, order)
        # Reuse of the own shard: the block the rank serves contains its training shard, and the shards that
        # make up that block are exactly its micro-DP group's.
        needed = _needed_shards(plan.gen_tp_rank, tg, t)
        assert plan.tp_rank in needed
        assert {plans[q].tp_rank for q in plan.micro_dp_group} == needed
        assert [plans[q].tp_rank for q in plan.micro_dp_group] == sorted(needed)
        for q in plan.micro_dp_group:
            assert (plans[q].dp_rank, plans[q].pp_rank) == (plan.dp_rank, plan.pp_rank)
        # Generation TP group: one stage, one replica, strided by m, ordered by generation TP rank.
        group = plan.gen_tp_group
        assert len(group) == tg and plan.rank in group
        assert [plans[q].gen_tp_rank for q in group] == list(range(tg))
        assert all((plans[q].dp_rank, plans[q].pp_rank) == (plan.dp_rank, plan.pp_rank) for q in group)
        tps = [plans[q].tp_rank for q in group]
        assert all(b - a == m for a, b in zip(tps, tps[1:]))
        assert all(plans[q].gen_engine == plan.gen_engine for q in group)
        assert list(group) == sorted(group)  # torch.distributed.new_group sorts members; order must survive
        assert [plans[q].tp_rank for q in plan.train_tp_group] == list(range(t))
        assert set(plan.micro_dp_group) <= set(plan.train_tp_group) and set(group) <= set(plan.train_tp_group)
        # PP group = Megatron's: same (dp, tp), every stage in order.
        assert [plans[q].pp_rank for q in plan.pp_group] == list(range(p))
        assert all((plans[q].dp_rank, plans[q].tp_rank) == (plan.dp_rank, plan.tp_rank) for q in plan.pp_group)
        # Gather group: every (stage, shard) piece of block j exactly once → zero redundancy.
        pieces = [(plans[q].pp_rank, plans[q].tp_rank) for q in plan.gather_group]
        assert len(pieces) == len(set(pieces)) == p * m
        assert set(pieces) == {(s, i) for s in range(p) for i in needed}
        assert all(plans[q].gen_tp_rank == plan.gen_tp_rank and plans[q].dp_rank == plan.dp_rank
                   for q in plan.gather_group)
        # Bytes received = needed pieces − own piece, each 1/(p·t) of the model; equals Table 2.
        received = Fraction(p * m - 1, p * t)
        assert layout.predicted_bytes_per_rank(Fraction(1)) == received
        assert layout.predicted_bytes_per_rank(1.0) == pytest.approx(float((t * p - tg) / (tg * t * p)))
        assert layout.generation_weight_bytes(1.0) == pytest.approx(1 / tg)

    # Every family of groups partitions the world.
    for groups, size in (
        (layout.gen_tp_groups, tg),
        (layout.micro_dp_groups, m),
        (layout.pp_groups, p),
        (sorted({pl.gather_group for pl in plans}), m * p),
    ):
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(world))
        assert all(len(g) == size for g in groups)
    assert len(layout.gen_tp_groups) == layout.num_engines
    assert all(plans[g[0]].gen_engine == e for e, g in enumerate(layout.gen_tp_groups))
    # Ranks that hold the same generation block never share an engine; each engine has one rank per block.
    for gather in {pl.gather_group for pl in plans}:
        assert len({plans[q].gen_engine for q in gather}) == len(gather)
    # vLLM's consecutive-rank TP groups, mapped through the order, are ours.
    order_map = layout.vllm_rank_order()
    assert sorted(order_map) == list(range(world))
    assert [tuple(order_map[i : i + tg]) for i in range(0, world, tg)] == layout.gen_tp_groups


def test_paper_example_t4_tg2():
    layout = plan_layout(world_size=4, tp=4, pp=1, gen_tp=2)
    assert layout.gen_tp_groups == [(0, 2), (1, 3)]
    assert layout.micro_dp_groups == [(0, 1), (2, 3)]
    assert layout.vllm_rank_order() == [0, 2, 1, 3]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(world_size=4, tp=4, pp=1, gen_tp=3), "must divide training tp=4"),
        (dict(world_size=6, tp=4, pp=1, gen_tp=2), "not a multiple of tp·pp"),
        (dict(world_size=4, tp=2, pp=1, gen_tp=0), "must be a positive int"),
        (dict(world_size=4, tp=2, pp=1, gen_tp=2, order="pp-tp-dp"), "order="),
        (dict(world_size=4, tp=2, pp=2, gen_tp=2, dims=ModelDims(num_heads=6, num_kv_heads=3, ffn_hidden_size=64,
                                                                num_layers=4)), "num_kv_heads=3"),
        (dict(world_size=4, tp=2, pp=2, gen_tp=1, dims=ModelDims(num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                                                                num_layers=3)), "pp=2 must divide num_layers=3"),
        (dict(world_size=8, tp=8, pp=1, gen_tp=4, dims=ModelDims(num_heads=12, num_kv_heads=4, ffn_hidden_size=64,
                                                                num_layers=2)), "num_heads=12"),
    ],
)
def test_impossible_layouts_are_rejected(kwargs, match):
    with pytest.raises(LayoutError, match=match) as info:
        plan_layout(**kwargs)
    assert "\n" not in str(info.value)


def test_bad_model_dims_rejected():
    with pytest.raises(LayoutError, match="not a multiple"):
        ModelDims(num_heads=6, num_kv_heads=4, ffn_hidden_size=8, num_layers=2)
    with pytest.raises(LayoutError, match="rank 9"):
        HybridLayout(p=1, t=2, d=4, tg=1).coords(9)
