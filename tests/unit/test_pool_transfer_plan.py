"""Who sends and who receives each generation block across pools (hand-worked layouts), and the refusals."""

import pytest

from verl_mega.parallel.pools import transfer_plan
from verl_mega.parallel.placement import Placement, PlacementError, Pool


def _disaggregated(train_tp: int, train_gen_tp: int, train_size: int, gen_tp: int, gen_size: int) -> Placement:
    return Placement(train_size + gen_size,
                     (Pool(name="train", ranks=tuple(range(train_size)), tp=train_tp, gen_tp=train_gen_tp),
                      Pool(name="gen", ranks=tuple(range(train_size, train_size + gen_size)), gen_tp=gen_tp,
                           trains=False)),
                     {"actor": "train", "rollout": "gen"})


def test_blocks_strided_inside_tp_groups_go_to_rank_j_of_every_engine():
    # training TP groups {0..3}, {4..7}; generation blocks strided by m=2: ranks 0,1,4,5 build block 0 and 2,3,6,7
    # block 1. Rollout engines {8,9} and {10,11}.
    plan = transfer_plan(_disaggregated(4, 2, 8, 2, 4))
    assert plan.sources == (0, 2)
    assert plan.receivers == ((8, 10), (9, 11))
    assert [plan.block_of(r) for r in (0, 2, 1, 8, 11)] == [0, 1, None, 0, 1]


def test_one_block_one_source_many_engines():
    plan = transfer_plan(_disaggregated(2, 1, 2, 1, 3))
    assert plan.sources == (0,) and plan.receivers == ((2, 3, 4),)


def test_refusals_name_the_fix():
    with pytest.raises(PlacementError, match=r"placement.pools.train.gen_tp=2 .*set placement.pools.train.gen_tp=1"):
        transfer_plan(_disaggregated(2, 2, 2, 1, 2))
    with pytest.raises(PlacementError, match="colocated"):
        transfer_plan(Placement.single(2, tp=2))
