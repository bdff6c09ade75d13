"""Mixture-of-Experts pieces of the engine: the routers' auxiliary-loss metrics, read from Megatron's own tracker."""

from __future__ import annotations

import torch

from verl_mega.parallel.state import RankGroups, all_reduce


def clear_aux_losses() -> None:
    """Zero Megatron's per-layer aux-loss tracker (process-wide: one engine's step must not see another's)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def moe_layer_count(config) -> int:
    """How many layers of a TransformerConfig route to experts (``moe_layer_freq``: every k-th layer, or a 0/1 list;
    DeepSeek's first dense layers are zeros of the list)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return sum(1 for i in range(config.num_layers) if i % freq == 0)
    return int(sum(freq))


def aux_loss_metrics(groups: RankGroups, num_layers: int, num_microbatches: int) -> dict[str, float]:
    """Mean over the MoE layers (``num_layers``: :func:`moe_layer_count`; dense layers log nothing) and micro-batches
    of every aux loss the routers logged this step (``moe_load_balancing_loss`` or, with DeepSeek's sequence-level
    loss, ``moe_seq_load_balancing_loss``; ``moe_z_loss``), unscaled by their coefficients, the same on every rank
    of the pool.

    Megatron logs each layer's value on the stage that owns it, as a partial sum over the tokens of one
    tensor(·context)-parallel rank when it names a reduce group (the load-balancing loss), else as that rank's own
    mean (the z-loss); data-parallel replicas are averaged. Megatron's own reduction averages with ``ReduceOp.AVG``,
    which gloo lacks, so the sums are made here."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    out = {}
    for name in sorted(tracker):
        entry = tracker[name]
        total = all_reduce(entry["values"].detach().double().sum().cpu(), groups["pp"])
        if entry.get("reduce_group") is not None:
            total = all_reduce(total, entry["reduce_group"])
        else:
            total = all_reduce(total, groups["tp_cp"], "mean")
        if not entry.get("reduce_group_has_dp"):
            total = all_reduce(total, groups["dp"], "mean")
        entry["values"].zero_()
        if float(total) != 0.0:  # both losses are positive whenever on: zero is a loss this model does not use
            out[f"moe_{name}"] = float(total) / (num_layers * max(num_microbatches, 1))
    return out


def router_modules(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every MoE router of the model chunks, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)]


class _MeasuredReplay:
    """A router's replay state (mcore's ``RouterReplay`` protocol, installed on ``TopKRouter.router_replay``):
    records the top-k indices it computes, or replays given ones while counting how many of them the router would
    have picked itself on the real tokens (the router-agreement metric)."""

    def __init__(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._actions = RouterReplayAction
        self.router_replay_action = None
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # [tokens] bool: real (not padding) tokens of the replayed batch
        self.hits = self.total = 0.0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.router_replay_action == self._actions.RECORD:
            probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
            self.recorded_topk_idx = indices.detach()
            return probs, indices
        if self.router_replay_action == self._actions.REPLAY_FORWARD:
            target = self.target_topk_idx.to(scores.device)
            with torch.no_grad():
                _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                hits = (own.unsqueeze(-1) == target.unsqueeze(-2)).any(-1).sum(-1).double()
                known = (target >= 0).all(-1)  # R3: -1 marks a token the rollout never ran; it routes itself
                valid = (self.valid.to(hits.device) & known).double()
                self.hits += float((hits * valid).sum())
                self.total += float(valid.sum()) * topk
                if not bool(known.all()):
                    target = torch.where(known.unsqueeze(-1), target, own)
            return scores.gather(1, target), target
        return default_compute_topk(scores, topk, num_groups, group_topk)


class RoutingReplay:
    """Records each MoE router's top-k experts during a forward pass and replays them in a later one (R2: the
    old-log-prob pass's routing in the policy update; R3: the rollout's routing in the old-log-prob pass and the
    update), for the routers of one engine's model chunks. A replayed expert of -1 (a token the rollout never ran)
    lets the router choose for that token.

    Routing travels with the samples as ``[batch, seq, layers of this rank, k]`` (int16): recorded indices are
    gathered back to whole sequences over the tensor-parallel group (sequence parallelism splits tokens there) and
    the context-parallel group, so a sample can be replayed in a micro-batch of another width or composition; each
    rank keeps the layers of its own pipeline stage."""

    def __init__(self, chunks: list[torch.nn.Module], groups: RankGroups, *, sequence_parallel: bool) -> None:
        from verl_mega.parallel.context import context_chunks

        self._chunks_positions = context_chunks
        self.groups, self.sequence_parallel = groups, sequence_parallel
        self.routers = [router_modules([c]) for c in chunks]  # per chunk, in layer order (none for dense layers)
        for router in (r for rs in self.routers for r in rs):
            router.router_replay = _MeasuredReplay()
        self.topk = chunks[0].config.moe_router_topk
        self.offsets = [sum(len(rs) for rs in self.routers[:i]) for i in range(len(self.routers))]
        #: the model layer (0-based, counting dense layers too) of each of this rank's routers, in their order
        self.layers = torch.tensor([r.layer_number - 1 for rs in self.routers for r in rs], dtype=torch.long)

    def local_layers(self, routing: torch.Tensor) -> torch.Tensor:
        """Routing over every layer of the model [b, s, model layers, k] (R3: the rollout's, from vLLM) → the layers
        of this rank's routers [b, s, layers of this rank, k], the layout :meth:`set_targets` replays."""
        return routing.index_select(2, self.layers)

    @property
    def num_layers(self) -> int:
        return sum(len(rs) for rs in self.routers)

    def _local_positions(self, seq: int) -> torch.Tensor:
        """Sequence positions, in order, of the tokens this rank's routers see."""
        cp, tp = self.groups.size("cp"), self.groups.size("tp")
        pos = torch.tensor(self._chunks_positions(seq, cp, self.groups.coords["cp"]))
        if self.sequence_parallel and tp > 1:
            n = pos.numel() // tp
            pos = pos[self.groups.tp_rank * n:(self.groups.tp_rank + 1) * n]
        return pos

    def set_action(self, action: str | None) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        value = {None: None, "record": RouterReplayAction.RECORD,
                 "replay": RouterReplayAction.REPLAY_FORWARD}[action]
        for router in (r for rs in self.routers for r in rs):
            router.router_replay.router_replay_action = value

    def collect(self, chunk: int, batch: int, seq: int) -> torch.Tensor:
        """The routing chunk ``chunk`` recorded in its last forward, as whole sequences [b, s, layers, k]."""
        if not self.routers[chunk]:  # a chunk of dense layers only (DeepSeek's first_k_dense_replace)
            return torch.empty((batch, seq, 0, self.topk), dtype=torch.int16)
        # int32 on the wire: gloo has no int16 collectives
        local = torch.stack([r.router_replay.recorded_topk_idx.to(torch.int32) for r in self.routers[chunk]], -2)
        pos = self._local_positions(seq).to(local.device)
        local = local.view(pos.numel(), batch, len(self.routers[chunk]), self.topk).transpose(0, 1)
        parts, order = [local], [pos]
        for kind, on in (("tp", self.sequence_parallel), ("cp", True)):
            n = self.groups.size(kind)
            if n > 1 and on:
                gathered = [torch.empty_like(parts[0]) for _ in range(n)]
                where = [torch.empty_like(order[0]) for _ in range(n)]
                torch.distributed.all_gather(gathered, torch.cat(parts, 1).contiguous(), group=self.groups[kind])
                torch.distributed.all_gather(where, torch.cat(order), group=self.groups[kind])
                parts, order = gathered, where
        full = torch.empty((batch, seq, *local.shape[2:]), dtype=torch.int16)
        full[:, torch.cat(order).cpu()] = torch.cat(parts, 1).cpu().to(torch.int16)
        return full

    def set_targets(self, chunk: int, routing: torch.Tensor, valid: torch.Tensor) -> None:
        """Replay ``routing`` [b, ≥s, layers of this rank, k] in chunk ``chunk``'s next forward over sequences of
        ``valid`` [b, s] (True: a real token, counted by the agreement metric)."""
        pos = self._local_positions(valid.shape[1])
        first = self.offsets[chunk]
        for i, router in enumerate(self.routers[chunk]):
            target = routing[:, pos, first + i].transpose(0, 1).reshape(-1, self.topk)
            router.router_replay.target_topk_idx = target.long()
            router.router_replay.valid = valid[:, pos].transpose(0, 1).reshape(-1)

    def agreement(self) -> tuple[float, float]:
        """(hits, total) since the last call: replayed experts the routers would have chosen, of all replayed."""
        hits = sum(r.router_replay.hits for rs in self.routers for r in rs)
        total = sum(r.router_replay.total for rs in self.routers for r in rs)
        for router in (r for rs in self.routers for r in rs):
            router.router_replay.hits = router.router_replay.total = 0.0
        return hits, total
