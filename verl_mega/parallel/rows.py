"""Which data-parallel replica trains on each generated row, and who sends it there: pure arithmetic over a pool's
ranks, the same on every rank (the trainer's sample path, :mod:`verl_mega.trainer.transfer`, and the dry run's
traffic report both use it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class RowTable:
    """The step's rows in their global order, identical on every rank."""

    prompt: torch.Tensor  # [R] index of the row's prompt in the step's prompt list (its group)
    length: torch.Tensor  # [R] response tokens (after the rollout.max_response_length cut)
    version: torch.Tensor  # [R] weight version that generated it
    engine: torch.Tensor  # [R] engine holding it
    masked: bool  # rows carry a loss mask (multi-turn episodes)
    routing: tuple[int, int] | None = None  # (model layers, top-k): rows carry each token's routed experts (R3)
    prompt_len: torch.Tensor | None = None  # [R] prompt tokens of each row (with ``routing``)
    versioned: bool = False  # rows carry each token's weight version (partial rollouts on a rollout pool)

    def __len__(self) -> int:
        return int(self.prompt.numel())

    def words(self) -> torch.Tensor:
        """int32 words each row takes on the wire: ids and log-probs, a mask in multi-turn, each token's weight
        version when ``versioned``, and with ``routing`` the routed experts of its prompt and response tokens."""
        words = self.length * (2 + self.masked + self.versioned)
        if self.routing is not None:
            words = words + routing_words(self.prompt_len + self.length, *self.routing)
        return words


def routing_words(tokens: torch.Tensor, layers: int, topk: int) -> torch.Tensor:
    """int32 words of ``tokens`` tokens' routed experts: ``layers × topk`` int16 each, two to a word."""
    return (tokens * layers * topk + 1) // 2


def assign_rows(prompt: torch.Tensor, tokens: torch.Tensor, dp: int, *, balance: bool) -> torch.Tensor:
    """The data-parallel replica of each row: every replica gets the same number of rows, and a prompt's rows (its
    group) stay on one replica when the groups divide evenly. ``balance=False``: contiguous blocks in row order.
    ``balance=True``: longest unit first to the least-loaded replica that has room (``tokens`` per row: prompt +
    response), which keeps long-tailed lengths from loading one replica with the stragglers."""
    rows = int(prompt.numel())
    if rows % dp:
        raise ValueError(f"{rows} rows do not split over {dp} data-parallel ranks")
    if not balance:
        return torch.arange(rows) // (rows // dp)
    # a group is its prompt's rows wherever they sit: DAPO's batch puts its kept groups before the dropped ones that
    # fill it, so the ids are not in order, and group baselines still need each group on one replica
    groups, sizes = torch.unique(prompt, return_counts=True)
    whole = len(groups) % dp == 0 and bool((sizes == sizes[0]).all())
    if whole:
        units = [torch.nonzero(prompt == g).flatten() for g in groups.tolist()]
    else:
        units = [torch.tensor([i]) for i in range(rows)]
    per_replica = len(units) // dp
    load, count = [0] * dp, [0] * dp
    owner = torch.empty(rows, dtype=torch.long)
    weights = [int(tokens[u].sum()) for u in units]
    for k in sorted(range(len(units)), key=lambda k: (-weights[k], k)):
        r = min((r for r in range(dp) if count[r] < per_replica), key=lambda r: (load[r], r))
        owner[units[k]] = r
        load[r] += weights[k]
        count[r] += 1
    return owner


def split_groups(prompt: torch.Tensor, owner: torch.Tensor) -> list[int]:
    """The prompts whose rows ``owner`` puts on more than one replica (in one pass: it runs every step)."""
    groups, inverse = torch.unique(prompt, return_inverse=True)
    low = torch.zeros(len(groups), dtype=owner.dtype).scatter_reduce(0, inverse, owner, "amin", include_self=False)
    high = torch.zeros(len(groups), dtype=owner.dtype).scatter_reduce(0, inverse, owner, "amax", include_self=False)
    return groups[low != high].tolist()


def imbalance(owner: torch.Tensor, tokens: torch.Tensor, dp: int) -> float:
    """max over replicas of their tokens / the mean, minus 1 (0 = perfectly even)."""
    load = torch.zeros(dp, dtype=torch.float64).index_add_(0, owner, tokens.double())
    return float(load.max() / load.mean() - 1) if float(load.mean()) > 0 else 0.0


@dataclass(frozen=True)
class Route:
    """Who sends which rows to whom, for one rank. ``send[d]``/``recv[s]``: row indices, in row order, this rank
    sends to pool position d / receives from pool position s."""

    send: list[list[int]]
    recv: list[list[int]]
    mine: list[int]  # the rows this rank trains on, in row order


def plan_routes(table: RowTable, owner: torch.Tensor, *, ranks: Sequence[int], replica_of: Sequence[int],
                engines: Sequence[Sequence[int]], rank: int, gather: bool = False) -> Route:
    """The routes of ``rank`` (pure arithmetic, the same on every rank). ``ranks``: the pool's ranks (all_to_all
    positions); ``replica_of[i]``: the data-parallel replica of ``ranks[i]``; ``engines[e]``: engine e's ranks.
    Engine rank k of g sends to the destinations at positions ≡ k (mod g), so an engine's ranks share the sending.
    ``gather``: every rank receives every row (and keeps its own)."""
    pos = {r: i for i, r in enumerate(ranks)}
    me = pos[rank]
    members: dict[int, list[int]] = {}
    for d, replica in enumerate(replica_of):
        members.setdefault(replica, []).append(d)
    everyone = list(range(len(ranks)))
    owner_l, engine_l = owner.tolist(), table.engine.tolist()
    mine = [row for row in range(len(table)) if owner_l[row] == replica_of[me]]
    send: list[list[int]] = [[] for _ in ranks]
    recv: list[list[int]] = [[] for _ in ranks]
    for row in (range(len(table)) if gather else mine):  # what this rank receives, and from whom
        holders = engines[engine_l[row]]
        recv[pos[holders[me % len(holders)]]].append(row)
    my_engine = next((e for e, holders in enumerate(engines) if rank in holders), None)
    if my_engine is not None:  # what this rank sends: rows its engine holds, to the destinations it serves
        holders = engines[my_engine]
        k = holders.index(rank)
        for row in range(len(table)):
            if engine_l[row] == my_engine:
                for d in (everyone if gather else members[owner_l[row]]):
                    if d % len(holders) == k:
                        send[d].append(row)
    return Route(send, recv, mine)


def route_bytes(table: RowTable, owner: torch.Tensor, *, ranks: Sequence[int], replica_of: Sequence[int],
                engines: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Bytes every pool position sends and receives in the sample path's exchange
    (:func:`~verl_mega.trainer.transfer.exchange`): the routes of :func:`plan_routes`, for all ranks at once."""
    pos = {r: i for i, r in enumerate(ranks)}
    members: dict[int, list[int]] = {}
    for d, replica in enumerate(replica_of):
        members.setdefault(replica, []).append(d)
    sent, received = [0] * len(ranks), [0] * len(ranks)
    for words, o, e in zip((table.words() * 4).tolist(), owner.tolist(), table.engine.tolist()):
        holders = engines[e]
        for d in members[o]:
            sent[pos[holders[d % len(holders)]]] += words
            received[d] += words
    return sent, received


def table_bytes(rows: int, engines: int, counts: int = 0) -> int:
    """Bytes of the table the sample path all-reduces (:func:`~verl_mega.trainer.transfer.share_table`; a ring
    all-reduce moves about twice this per rank)."""
    return (rows + engines + 2 + counts) * 8
