"""Hugging Face ``config.json`` → Megatron-Core ``TransformerConfig`` for the dense decoder families we support."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# the HF class vLLM instantiates for each supported model_type (vLLM picks its model class by `architectures`)
CAUSAL_LM_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelConfigError(ValueError):
    """A model config that verl_mega cannot build; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    """The architecture facts of a dense decoder, read from an HF config (one place, used by every converter)."""

    model_type: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    init_std: float = 0.02
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    sliding_window: int | None = None

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron pads the vocabulary so each TP rank holds an equal slice that is a multiple of `divisible_by`."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameter count of the HF model (embeddings counted once when tied)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        attn = h * (self.num_heads * d) + 2 * h * (self.num_kv_heads * d) + (self.num_heads * d) * h
        if self.qkv_bias:
            attn += self.num_heads * d + 2 * self.num_kv_heads * d
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * h * f + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + h


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """Read ``config.json`` from an HF model directory (or the file itself) with clear errors."""
    path = Path(path)
    cfg_file = path / "config.json" if path.is_dir() else path
    if not cfg_file.exists():
        raise ModelConfigError(f"model: no config.json at {cfg_file}; point model.path at an HF model directory")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"model: {cfg_file} is not valid JSON ({exc}); re-export the HF config") from None


def arch_from_hf(hf: dict[str, Any]) -> ModelArch:
    """Extract and validate the architecture of a supported HF decoder config."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"model: model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(hf.get(key), int) or hf[key] <= 0:
            raise ModelConfigError(f"model: config.json field {key!r} must be a positive int, got {hf.get(key)!r}")
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ModelConfigError(
            f"model: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}; fix config.json"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ModelConfigError(f"model: hidden_act={act!r} is not supported (only 'silu' gated MLPs)")
    # transformers ≥5 writes `rope_parameters` (theta + scaling together); older configs `rope_theta`/`rope_scaling`.
    rope_params = hf.get("rope_parameters") or {}
    rope_theta = hf.get("rope_theta", rope_params.get("rope_theta", 10000.0))
    rope_scaling = hf.get("rope_scaling") or (rope_params if "rope_type" in rope_params else None)
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        if rope_type not in ("llama3", "default"):
            raise ModelConfigError(
                f"model: rope_scaling type {rope_type!r} is not supported; supported: 'llama3' (or none)"
            )
        if rope_type == "default":
            rope_scaling = None
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") else None
    return ModelArch(
        model_type=model_type,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        init_std=float(hf.get("initializer_range", 0.02)),
        rope_scaling=rope_scaling,
        sliding_window=sliding,
    )


def check_rollout_architecture(hf: dict[str, Any], path: str | Path) -> None:
    """The `architectures` of the policy's config.json must name the causal-LM class of its model_type: vLLM chooses
    its model implementation by that name (and fails late, with a long message, on one it does not know)."""
    want = CAUSAL_LM_ARCHITECTURES.get(hf.get("model_type"))
    archs = hf.get("architectures")
    if want is None:
        return  # arch_from_hf reports the unsupported model_type
    if not isinstance(archs, list) or archs != [want]:
        shown = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "nothing"
        raise ModelConfigError(f"model: {Path(path) / 'config.json'} names architectures {shown}; the rollout engine "
                               f"(vLLM) runs model_type={hf['model_type']!r} as {want}: set \"architectures\": "
                               f"[\"{want}\"] in config.json")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_layout(pool, *, num_layers: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int | None = None
                 ) -> None:
    """One-line errors, before any allocation, when a pool's layout cannot split the model: tp | heads, tp | key/value
    heads (the 3D-HybridEngine converts query groups shard by shard, so they are never replicated), tp | FFN width,
    pp·vpp | layers, and gen_tp | heads and key/value heads for vLLM."""
    tp, gen_tp, stages = pool.tp, pool.gen_tp, pool.pp * (pool.vpp or 1)
    if num_heads % tp:
        raise ModelConfigError(f"parallel.tp={tp} does not divide the model's {num_heads} attention heads; set "
                               f"parallel.tp to one of {_divisors(num_heads)}")
    if num_kv_heads % tp:
        raise ModelConfigError(f"parallel.tp={tp} does not divide the model's {num_kv_heads} key/value heads; set "
                               f"parallel.tp to one of {_divisors(num_kv_heads)}")
    if ffn_hidden_size is not None and ffn_hidden_size % tp:
        raise ModelConfigError(f"parallel.tp={tp} does not divide the model's FFN width {ffn_hidden_size}; "
                               f"choose another parallel.tp")
    if num_layers % stages:
        what = f"parallel.pp·vpp = {pool.pp}·{pool.vpp} = {stages}" if pool.vpp else f"parallel.pp={pool.pp}"
        raise ModelConfigError(f"the model's {num_layers} layers are not divisible by {what}; choose "
                               f"{'pp·vpp' if pool.vpp else 'parallel.pp'} among {_divisors(num_layers)}")
    for name, value in (("attention heads", num_heads), ("key/value heads", num_kv_heads)):
        if value % gen_tp:
            raise ModelConfigError(f"rollout.gen_tp={gen_tp} does not divide the model's {value} {name}; choose "
                                   f"rollout.gen_tp among {_divisors(value)}")


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ModelConfigError(f"model.dtype={name!r} is not supported; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def transformer_config(
    arch: ModelArch,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    sequence_parallel: bool = False,
    dtype: str = "float32",
    recompute: str = "none",
    **overrides: Any,
):
    """Build mcore's own TransformerConfig (passed through, never re-declared); `overrides` go straight into it."""
    from megatron.core.transformer import TransformerConfig

    if arch.num_heads % tp or arch.num_kv_heads % tp:
        raise ModelConfigError(
            f"parallel.tp={tp} must divide num_attention_heads={arch.num_heads} and "
            f"num_key_value_heads={arch.num_kv_heads}; choose a tp that divides both"
        )
    chunks = pp * (vpp or 1)
    if arch.num_layers % chunks:
        raise ModelConfigError(
            f"parallel.pp·vpp={chunks} must divide num_hidden_layers={arch.num_layers}; change parallel.pp/vpp"
        )
    params_dtype = torch_dtype(dtype)
    recompute_kw: dict[str, Any] = {}
    if recompute == "full":
        recompute_kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute == "selective":
        recompute_kw = dict(recompute_granularity="selective")
    elif recompute != "none":
        raise ModelConfigError(f"model.recompute={recompute!r} is not one of none|selective|full")
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_std,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=cp,
        sequence_parallel=sequence_parallel,
        **recompute_kw,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama-3 frequency-dependent RoPE scaling with the config's own factors (mcore fixes 1/4/8192)."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(medium, smoothed, scaled)
