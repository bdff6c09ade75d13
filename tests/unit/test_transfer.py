"""The rollout → train sample path: row assignment, routes, the wire format, and whitening over split batches."""

import random
import threading

import pytest
import torch

from verl_mega.algos import masked_whiten
from verl_mega.parallel.placement import Placement
from verl_mega.parallel.rows import RowTable, assign_rows, imbalance, plan_routes, split_groups
from verl_mega.rollout.base import Sample
from verl_mega.trainer.transfer import exchange


def _long_tailed(rows: int, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed)  # lognormal response lengths, capped like max_response_length
    return torch.tensor([min(4096, int(rng.lognormvariate(5.5, 1.0))) + 1 for _ in range(rows)])


def test_contiguous_assignment_is_block_order():
    prompt = torch.arange(8).repeat_interleave(4)
    assert assign_rows(prompt, torch.ones(32), 4, balance=False).tolist() == [r for r in range(4) for _ in range(8)]
    with pytest.raises(ValueError, match="do not split"):
        assign_rows(torch.arange(6), torch.ones(6), 4, balance=False)


@pytest.mark.parametrize("groups, n, dp", [(64, 8, 8), (256, 16, 32), (32, 4, 4)])
def test_balanced_assignment_keeps_groups_whole_and_tokens_even(groups, n, dp):
    prompt = torch.arange(groups).repeat_interleave(n)
    tokens = 64 + _long_tailed(groups * n, seed=groups)
    owner = assign_rows(prompt, tokens, dp, balance=True)
    assert torch.bincount(owner, minlength=dp).tolist() == [groups * n // dp] * dp  # same rows everywhere
    for g in range(groups):  # whole groups
        assert len(set(owner[prompt == g].tolist())) == 1
    contiguous = imbalance(assign_rows(prompt, tokens, dp, balance=False), tokens, dp)
    balanced = imbalance(owner, tokens, dp)
    print(f"token imbalance: contiguous {contiguous:.3f}, balanced {balanced:.3f}")
    assert balanced <= 0.10 and balanced < contiguous


def test_groups_stay_whole_when_their_ids_are_out_of_order():
    # DAPO's batch: the kept groups, then dropped ones that fill it, so the prompt ids are not ascending
    prompt = torch.tensor([0, 2, 5, 1, 7, 3, 4, 6]).repeat_interleave(4)
    tokens = _long_tailed(32, seed=2)
    owner = assign_rows(prompt, tokens, 2, balance=True)
    assert torch.bincount(owner).tolist() == [16, 16]
    assert split_groups(prompt, owner) == []
    # a group's rows need not even be next to each other
    shuffled = torch.randperm(32, generator=torch.Generator().manual_seed(0))
    owner = assign_rows(prompt[shuffled], tokens[shuffled], 4, balance=True)
    assert torch.bincount(owner).tolist() == [8] * 4 and split_groups(prompt[shuffled], owner) == []
    assert split_groups(prompt, torch.arange(32) % 2) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_rows_are_balanced_one_by_one_when_groups_cannot_stay_whole():
    prompt = torch.arange(6).repeat_interleave(4)  # 6 groups over 4 ranks
    tokens = _long_tailed(24, seed=1)
    owner = assign_rows(prompt, tokens, 4, balance=True)
    assert torch.bincount(owner).tolist() == [6] * 4


def _routes(world: int, tp: int, gen_tp: int, rows_per_prompt: int, prompts: int, gather: bool = False):
    pool = Placement.single(world, tp=tp, gen_tp=gen_tp).pool("main")
    engines = [tuple(g) for g in pool.groups("gen_tp")]
    share = [e * prompts // len(engines) for e in range(len(engines) + 1)]  # each engine's contiguous prompts
    prompt = torch.arange(prompts).repeat_interleave(rows_per_prompt)
    engine = torch.tensor([next(e for e in range(len(engines)) if share[e] <= int(p) < share[e + 1])
                           for p in prompt])
    table = RowTable(prompt, _long_tailed(len(prompt)), torch.zeros_like(prompt), engine, masked=False)
    owner = assign_rows(prompt, table.length, pool.dp, balance=True)
    replica_of = [pool.coords(r)["dp"] for r in pool.ranks]
    routes = {r: plan_routes(table, owner, ranks=list(pool.ranks), replica_of=replica_of, engines=engines, rank=r,
                             gather=gather) for r in pool.ranks}
    return pool, table, owner, engines, routes


@pytest.mark.parametrize("world, tp, gen_tp", [(8, 1, 1), (8, 2, 2), (8, 4, 2), (16, 4, 1)])
def test_no_rank_receives_rows_it_does_not_train_on(world, tp, gen_tp):
    pool, table, owner, engines, routes = _routes(world, tp, gen_tp, rows_per_prompt=4, prompts=32)
    for r, route in routes.items():
        replica = pool.coords(r)["dp"]
        received = [row for rows in route.recv for row in rows]
        assert sorted(received) == route.mine  # every row it trains on, once, and nothing else
        assert all(int(owner[row]) == replica for row in received)
        for d, rows in enumerate(route.send):  # a rank sends only rows its engine holds, to their replica
            assert all(r in engines[int(table.engine[row])] for row in rows)
            assert all(int(owner[row]) == pool.coords(pool.ranks[d])["dp"] for row in rows)
    for s in pool.ranks:  # what s sends to d is what d expects from s, in the same order
        for d in pool.ranks:
            assert routes[s].send[d] == routes[d].recv[s]
    sent = [sum(len(rows) for rows in routes[r].send) for r in pool.ranks]
    if gen_tp > 1:  # an engine's ranks share the sending
        assert max(sent) <= 2 * min(x for x in sent if x) or min(sent) == 0


def test_gather_transport_receives_every_row():
    pool, table, _, _, routes = _routes(8, 2, 2, rows_per_prompt=2, prompts=16, gather=True)
    for route in routes.values():
        assert sorted(row for rows in route.recv for row in rows) == list(range(len(table)))


def test_wire_format_round_trip():
    samples = {0: Sample(0, [5, 6, 7], [-0.5, -1.25, -3.0e-8], [1, 0, 1]), 1: Sample(0, [9], [-2.0], None),
               2: Sample(1, list(range(10)), [float(-i) / 7 for i in range(10)], [1] * 10)}
    table = RowTable(torch.tensor([0, 0, 1]), torch.tensor([3, 1, 6]), torch.zeros(3, dtype=torch.long),
                     torch.zeros(3, dtype=torch.long), masked=True)
    route = plan_routes(table, torch.zeros(3, dtype=torch.long), ranks=[0], replica_of=[0], engines=[(0,)], rank=0)
    got = {row: Sample(s.prompt, s.ids.tolist(), s.logprobs.tolist(), s.mask.tolist())  # tensors on arrival
           for row, s in exchange(samples, table, route, group=None).items()}
    assert got[0] == Sample(0, [5, 6, 7], [-0.5, -1.25, torch.tensor(-3.0e-8).item()], [1, 0, 1])
    assert got[1] == Sample(0, [9], [-2.0], [1])  # a row without a mask travels with an all-ones mask
    assert got[2].ids == list(range(6)) and got[2].logprobs == [torch.tensor(-i / 7).item() for i in range(6)]


def test_whitening_over_split_batch_equals_whole_batch():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(8, 10, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 10, generator=g) > 0.3).double()
    whole = masked_whiten(values, mask)
    # two "ranks" (threads) each whiten their half; batch_sum is an all-reduce between them
    barrier, slots, parts = threading.Barrier(2), [None, None], [None, None]

    def rank(k: int) -> None:
        def batch_sum(x):
            slots[k] = x
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total
        parts[k] = masked_whiten(values[4 * k:4 * k + 4], mask[4 * k:4 * k + 4], batch_sum=batch_sum)

    threads = [threading.Thread(target=rank, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-12, atol=1e-12)


def test_dry_run_sample_path_bytes_do_not_grow_with_world_size():
    from verl_mega.planning.dry_run import sample_path_report

    reports = [sample_path_report(Placement.single(world, tp=2, gen_tp=2), samples_per_rank=64, n=8,
                                  max_response_length=8192, prompt_length=512) for world in (8, 128, 1024)]
    received = [r["max_bytes_received"] for r in reports]
    assert max(received) < 1.1 * min(received)  # fixed per-rank batch: fixed per-rank traffic
    assert [r["gather_bytes_received"] > 0.9 * r["dp"] * received[0] for r in reports] == [True] * 3
    assert reports[-1]["metadata_bytes"] < 0.05 * reports[-1]["gather_bytes_received"]
    assert all(r["token_imbalance"] < 0.1 for r in reports)


def test_wire_format_carries_routed_experts():
    """Routing replay R3: each row's routed experts [prompt + response, layers, k] ride in its int32 words, two int16
    to a word, cut with the response at max_response_length; tokens vLLM never ran travel as -1. Without routing the
    rows' words are what they were."""
    from verl_mega.parallel.rows import routing_words
    from verl_mega.trainer.transfer import pack_routing, unpack_routing

    layers, k = 3, 2  # 6 int16 per token: a row of 3 tokens has an odd count → one pad half-word
    g = torch.Generator().manual_seed(0)
    routing = [torch.randint(0, 8, (p + r - 1, layers, k), generator=g).to(torch.int16) for p, r in ((2, 3), (1, 1),
                                                                                                      (4, 10))]
    samples = {0: Sample(0, [5, 6, 7], [-0.5, -1.25, -3.0], None, routing[0]),
               1: Sample(0, [9], [-2.0], None, routing[1]),
               2: Sample(1, list(range(10)), [float(-i) / 8 for i in range(10)], None, routing[2])}
    base = RowTable(torch.tensor([0, 0, 1]), torch.tensor([3, 1, 6]), torch.zeros(3, dtype=torch.long),
                    torch.zeros(3, dtype=torch.long), masked=False)
    assert base.words().tolist() == [6, 2, 12]
    table = RowTable(base.prompt, base.length, base.version, base.engine, masked=False, routing=(layers, k),
                     prompt_len=torch.tensor([2, 1, 4]))
    assert table.words().tolist() == [6 + 15, 2 + 6, 12 + 30]
    assert routing_words(torch.tensor([5]), layers, k).tolist() == [15]
    route = plan_routes(table, torch.zeros(3, dtype=torch.long), ranks=[0], replica_of=[0], engines=[(0,)], rank=0)
    got = exchange(samples, table, route, group=None)
    assert got[0].ids.tolist() == [5, 6, 7] and got[1].ids.tolist() == [9] and got[2].ids.tolist() == list(range(6))
    for row, tokens in ((0, 5), (1, 2), (2, 10)):
        r = got[row].routing
        assert r.shape == (tokens, layers, k) and r.dtype == torch.int16
        have = min(tokens, routing[row].shape[0])
        assert torch.equal(r[:have], routing[row][:have])
        assert bool((r[have:] == -1).all())  # the last token: vLLM never ran it
    # a sample without routing (e.g. from an engine that returned none) travels as all -1
    words = pack_routing(None, 3, layers, k)
    assert bool((unpack_routing(words, 3, layers, k) == -1).all())
    with pytest.raises(ValueError, match="rows carry"):
        pack_routing(torch.zeros(2, 1, k, dtype=torch.int16), 3, layers, k)


def test_rollout_routing_packs_rows_left_aligned():
    from verl_mega.rollout.routing_capture import packed_routing

    r0 = torch.arange(12, dtype=torch.int16).view(3, 2, 2)
    packed = packed_routing([Sample(0, [1], [0.0], None, r0), Sample(0, [1], [0.0], None, None)], 8, (2, 2))
    assert packed.shape == (2, 8, 2, 2) and packed.dtype == torch.int16
    assert torch.equal(packed[0, :3], r0) and bool((packed[0, 3:] == -1).all()) and bool((packed[1] == -1).all())
