"""Model FLOPs of a decoder-only transformer (dense and Mixture-of-Experts), and the peak FLOP/s of the GPUs they run
on: one model for the profiler's MFU, the step's FLOP count and the planner's step-time model.

The convention is PaLM's and Megatron's *model* FLOPs: every matmul a token takes part in, one multiply-add = 2 FLOPs,
a backward pass = 2 forwards; recomputation is not counted (MFU does not reward recomputing activations), and
norms, biases, softmax and activations are left out (≪1 %). The weights a token multiplies by, per layer:

    Q, K, V and the attention output       h·(a + 2·k)·d + a·d·h          (GQA when k < a; MLA: its projections)
    MLP, dense (SwiGLU)                    3·h·f
    MLP, MoE                               E·h (router) + 3·h·f_s (shared expert) + k_e·3·h·f_e (routed experts)

plus the head: V·h for a language model, h for a value head (critic, reward model); the input embedding is a lookup.
Attention scores and the weighted sum add 2·2·L·a·d per token per token of context (QKᵀ and A·V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def attention_weights(arch: Any) -> int:
    """Weights one token multiplies by in one layer's attention (MLA: its down and up projections; the latent keys
    and values are projected per token, not absorbed)."""
    if arch.is_mla:  # its weights without the latent norms (not matmuls)
        w = arch.attention_weights()
        return w["sharded"] + w["replicated"] - (arch.q_lora_rank or 0) - arch.kv_lora_rank
    return _gqa_weights(arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim)


def _gqa_weights(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    return hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden


def matmul_weights(arch: Any, *, value_head: bool = False) -> tuple[int, int]:
    """(dense, routed-expert) weights one token of ``arch`` (a :class:`~verl_mega.models.arch.ModelArch`)
    multiplies by, as tabled above; dense layers (DeepSeek's first ones) and MoE layers each count their own MLP."""
    h, attn = arch.hidden_size, attention_weights(arch)
    dense = experts = 0
    for i in range(arch.num_layers):
        if arch.is_moe_layer(i):
            dense += attn + arch.num_experts * h + 3 * h * arch.shared_expert_ffn_hidden_size
            experts += arch.moe_topk * 3 * h * arch.moe_ffn_hidden_size
        else:
            dense += attn + 3 * h * arch.ffn_hidden_size
    head = h if value_head else arch.vocab_size * h
    return dense + head, experts


def attention_flops(arch: Any, context: float) -> float:
    """Forward FLOPs per token of QKᵀ and A·V against `context` earlier tokens: 2 · 2·L·a·d·context (one
    multiply-add = 2 FLOPs; MLA: 2·L·a·(d_qk + d_v)·context). Training over causal sequences of length s averages
    context s/2: 2·L·a·d·s."""
    dims = arch.head_dim + arch.v_head_dim if arch.is_mla else 2 * arch.head_dim
    return 2.0 * arch.num_layers * arch.num_heads * dims * context


def model_flops_per_token(arch: Any, *, context: float, training: bool, value_head: bool = False,
                          frozen_base: bool = False) -> float:
    """Model FLOPs of one token against `context` tokens of attention: forward 2·N + attention, training (forward +
    backward) three times that. MFU takes the whole sequence as the context (causal masking not discounted, as in
    PaLM's 6N + 12·L·a·d·s); generation with a KV cache takes the mean context. ``frozen_base`` (LoRA): the weights
    get no gradient, so their backward is the input gradient alone (training: 2 · 2N + 3 · attention); the adapters'
    r-wide GEMMs are left out, as in the planner's step-time model (under 1 % of a 7B layer's at r = 16)."""
    dense, experts = matmul_weights(arch, value_head=value_head)
    return _per_token(dense + experts, attention_flops(arch, context), training, frozen_base)


def transformer_flops_per_token(num_layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
                                vocab: int, seq_len: int, training: bool, *, gated_mlp: bool = True,
                                frozen_base: bool = False) -> float:
    """:func:`model_flops_per_token` of a dense model given by its sizes (no :class:`ModelArch` needed), with a
    plain up/down MLP (2·h·f) when ``gated_mlp`` is false:

    * training (forward + backward = 3× forward): ``6·N + 12·L·heads·head_dim·seq_len``
    * inference (forward only):                    ``2·N +  4·L·heads·head_dim·seq_len``
    * training a frozen base (LoRA):               ``4·N + 12·L·heads·head_dim·seq_len``
    """
    for name, value in (("num_layers", num_layers), ("hidden", hidden), ("ffn", ffn), ("heads", heads),
                        ("kv_heads", kv_heads), ("head_dim", head_dim), ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"transformer_flops_per_token: {name}={value} must be >= 1")
    if seq_len < 0:
        raise ValueError(f"transformer_flops_per_token: seq_len={seq_len} must be >= 0")
    if heads % kv_heads:
        raise ValueError(f"transformer_flops_per_token: heads={heads} is not a multiple of kv_heads={kv_heads}")
    mlp = (3 if gated_mlp else 2) * hidden * ffn
    weights = num_layers * (_gqa_weights(hidden, heads, kv_heads, head_dim) + mlp) + hidden * vocab
    return _per_token(weights, num_layers * heads * head_dim * seq_len * 4, training, frozen_base)


def _per_token(weights: int, attention: float, training: bool, frozen_base: bool = False) -> float:
    if not training:
        return float(2 * weights + attention)
    # backward: the input gradient (1 forward) and, for trained weights, the weight gradient (1 more); core
    # attention has no weights, so its backward is 2 forwards either way
    return float((2 if frozen_base else 3) * 2 * weights + 3 * attention)


# ---------------------------------------------------------------------------------------------------------------------
# Peak FLOP/s
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuPeak:
    """One GPU's 16-bit matmul peak, TFLOP/s: the datasheet's dense bf16/fp16 figure (MFU's), and an 8192³ bf16
    matmul as measured where we ran one (BENCHMARKS.md; the planner's efficiencies are fractions of it)."""

    dense_bf16_tflops: float
    matmul_tflops: float | None = None


#: by the substring of the device name that identifies the GPU (checked in this order)
GPU_PEAKS: dict[str, GpuPeak] = {
    # measured 787.6 and 784.8 TFLOP/s on the lent 2×H200 machine (BENCHMARKS.md "Step-time model calibration";
    # 786.5 in the MoE run)
    "H200": GpuPeak(989.0, matmul_tflops=786.0),
    "H100": GpuPeak(989.0), "H800": GpuPeak(989.0), "B200": GpuPeak(2250.0), "A100": GpuPeak(312.0),
    "A800": GpuPeak(312.0), "L40S": GpuPeak(362.0),
}


def detect_peak_flops(device_name: str | None, dtype: str) -> float | None:
    """The datasheet peak FLOP/s of a known GPU for 16-bit training (``bfloat16``/``float16``); None when unknown or
    fp32 (MFU is then left out rather than guessed)."""
    if not device_name or dtype not in ("bfloat16", "float16"):
        return None
    return next((peak.dense_bf16_tflops * 1e12 for key, peak in GPU_PEAKS.items() if key in device_name.upper()),
                None)
