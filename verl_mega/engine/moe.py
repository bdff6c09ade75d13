"""Mixture-of-Experts pieces of the engine: the routers' auxiliary-loss metrics, read from Megatron's own tracker."""

from __future__ import annotations

import torch

from verl_mega.parallel.state import RankGroups, all_reduce


def clear_aux_losses() -> None:
    """Zero Megatron's per-layer aux-loss tracker (process-wide: one engine's step must not see another's)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def aux_loss_metrics(groups: RankGroups, num_layers: int, num_microbatches: int) -> dict[str, float]:
    """Mean over layers and micro-batches of every aux loss the routers logged this step (``moe_load_balancing_loss``,
    ``moe_z_loss``), unscaled by their coefficients, the same on every rank of the pool.

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
