"""Optimizer state in dist checkpoints, loadable at any tp/pp/dp.

The distributed optimizer is saved in mcore's ``fully_reshardable`` form: each parameter's fp32 main copy, exp_avg
and exp_avg_sq are gathered over the data-parallel group into tensors shaped like the (TP-sharded) parameter and
stored under the parameter's own sharding metadata, so mcore reshards them like the weights. Adam's step lives in the
param groups. mcore 0.16.1 loads this form into torch's Adam (no apex/TE) only with help: its per-parameter copy
expects a ``step`` entry that the format does not carry, so the step is set aside during that copy and restored from
the param groups. The non-distributed optimizer's own sharded form is already layout-free.

Mixture-of-Experts models change the optimizer's split with the layout: at ``parallel.ep`` > 1 the expert parameters
have an optimizer of their own (mcore chains it after the dense one), at ep = 1 they join the dense one. The state is
saved under each parameter's own key, without the chained optimizer's per-optimizer prefix, so a parameter's state
is found wherever it now lives; when the split differs, each optimizer's param groups are its own with Adam's step
from the checkpoint (lr and weight decay come from the schedulers and the config, as always).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer

# what trainer.json records for the state written now: mcore's fully_reshardable form under unprefixed keys
FORMAT = "fully_reshardable/unprefixed"
# the same form under the chained optimizer's prefixes (written before): any tp/pp/dp, not another MoE ep
PREFIXED_FORMAT = "fully_reshardable"
RESHARDABLE = (FORMAT, PREFIXED_FORMAT)
# what checkpoints without an "optimizer_format" entry in trainer.json hold: reloadable at the same layout only
LEGACY_FORMAT = "dp_reshardable"


def _metadata(fmt: str) -> dict:
    if fmt not in RESHARDABLE:
        return {"distrib_optim_sharding_type": fmt}
    # mem_efficient: the per-parameter state is gathered over the gloo DP group onto DP rank 0, the only rank that
    # writes it (otherwise mcore all-gathers it onto every DP rank)
    return {"distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True,
            "chained_optim_avoid_prefix": fmt == FORMAT}


def _subs(optimizer: "MegatronOptimizer") -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def sharded_state_dict(optimizer: "MegatronOptimizer", model_sd: dict, *, is_loading: bool = False,
                       fmt: str = FORMAT) -> dict:
    """The optimizer's sharded state dict for dist_checkpointing.save/load; `model_sd` is the flat model part."""
    if is_loading:
        _prime(optimizer)
    return optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_metadata(fmt))


def common_for_consistency_check(common: Any) -> Any:
    """mcore compares every rank's common (non-tensor) state with rank 0's before a save and warns on differences.
    In the mem-efficient form only DP rank 0 returns the per-parameter state; the other DP ranks' None placeholder
    is expected, so it is left out of the comparison (a copy; mcore saves rank 0's original)."""
    if not isinstance(common, dict):
        return common
    return {k: common_for_consistency_check(v) for k, v in common.items() if not (k == "param_state" and v is None)}


def _prime(optimizer: "MegatronOptimizer") -> None:
    """Give a fresh optimizer the state slots a checkpoint fills. mcore's Adam init fills exp_avg/exp_avg_sq but not
    `step`, which torch's Adam keeps per parameter and mcore's state_dict requires (TE/apex Adam keep it per group)."""
    for opt in _subs(optimizer):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        if getattr(opt, "init_state_fn", None) is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def _is_optimizer_part(node: Any) -> bool:
    """A distributed optimizer's common part: {"optimizer": {"param_groups": [...]}, ...}."""
    return isinstance(node, dict) and isinstance(node.get("optimizer"), dict) and "param_groups" in node["optimizer"]


def _saved_split(state: dict) -> int:
    """How many optimizers the checkpoint's common part holds (0: none of the distributed optimizer's)."""
    return sum(_is_optimizer_part(v) for k, v in state.items() if isinstance(k, int)) or int(_is_optimizer_part(state))


def _saved_step(state: dict) -> float:
    """Adam's step in the checkpoint's param groups (mcore keeps every group's step equal)."""
    parts = [state] if _is_optimizer_part(state) else [v for k, v in state.items() if isinstance(k, int)]
    return next(float(g["step"]) for part in parts if _is_optimizer_part(part)
                for g in part["optimizer"]["param_groups"] if "step" in g)


@torch.no_grad()  # mcore copies into main params (views of leaves) without its own no_grad
def load(optimizer: "MegatronOptimizer", state: Any) -> None:
    """Load what dist_checkpointing.load returned for `sharded_state_dict(..., is_loading=True)`: the checkpoint's
    common part (as saved) merged with the tensors (in this layout's structure)."""
    subs = _subs(optimizer)
    states = [state] if len(subs) == 1 else [state[k] for k in range(len(subs))]
    resplit = isinstance(state, dict) and _saved_split(state) not in (0, len(subs))
    saved_step = _saved_step(state) if resplit else None
    for opt, sub_state in zip(subs, states, strict=True):
        if "param_state" not in sub_state or sub_state.get("param_state_sharding_type",
                                                           "fully_reshardable") != "fully_reshardable":
            opt.load_state_dict(sub_state)
            continue
        param_state = sub_state.pop("param_state")
        sub_state.pop("param_state_sharding_type", None)
        if resplit:  # another MoE ep: this optimizer's own groups, with the checkpoint's step
            sub_state = opt.state_dict()
            for group in sub_state["optimizer"]["param_groups"]:
                group["step"] = saved_step
        opt.load_state_dict(sub_state)  # param groups (lr, wd, step); sets torch's per-parameter step from them
        inner = opt.optimizer.state
        steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
        try:
            opt.load_parameter_state_from_fully_reshardable(param_state)
        finally:
            for p, step in steps.items():
                inner[p]["step"] = step
    _restore_adam_steps(optimizer)


def _restore_adam_steps(optimizer: "MegatronOptimizer") -> None:
    """mcore stores Adam's step once per param group; torch's Adam reads it per parameter (bias correction)."""
    for opt in _subs(optimizer):
        inner = getattr(opt, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            if "step" in group:
                for p in group["params"]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]))
