"""Memory terms of LoRA training (``model.lora``): the base model frozen in the training dtype carries its
parameters only; the adapters carry parameters, fp32 main gradients and the optimizer's fp32 master copy and Adam
moments; the reference policy is the same base with the adapters off, so it costs nothing (docs/lora.md).

Per rank, a targeted projection of fan-in ``i`` and fan-out ``o`` holds ``r·(i + o/t)`` adapter parameters when its
base is column-parallel (``A`` whole, ``B``'s rows split) and ``r·(i/t + o)`` when it is row-parallel."""

from __future__ import annotations

from verl_mega.config.model import LORA_ATTENTION
from verl_mega.models.arch import stage_layer_indices
from verl_mega.models.hf_config import ModelArch

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def adapter_params_per_rank(arch: ModelArch, lora, tp: int, layers) -> int:
    """Adapter parameters one TP rank holds over ``layers`` (global layer indices; routed experts carry none)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    dims = {"q_proj": (h, arch.num_heads * d), "k_proj": (h, arch.num_kv_heads * d),
            "v_proj": (h, arch.num_kv_heads * d), "o_proj": (arch.num_heads * d, h), "gate_proj": (h, f),
            "up_proj": (h, f), "down_proj": (f, h)}
    total = 0
    for i in layers:
        for part in lora.targets:
            if part not in LORA_ATTENTION and arch.is_moe_layer(i):
                continue
            fan_in, fan_out = dims[part]
            total += lora.rank * ((fan_in + fan_out // tp) if part in _COLUMN else (fan_in // tp + fan_out))
    return total


def stage_adapter_params(arch: ModelArch, layout, lora, stage: int) -> int:
    """Adapter parameters of one rank of pipeline stage ``stage``."""
    return adapter_params_per_rank(arch, lora, layout.tp,
                                   stage_layer_indices(arch.num_layers, layout.pp, layout.vpp, stage))
