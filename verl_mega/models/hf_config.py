"""Hugging Face ``config.json`` → Megatron-Core ``TransformerConfig`` for the decoder families we support: dense
(Llama, Mistral, Qwen2, Qwen3) and Mixture-of-Experts (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert, and
DeepSeek-V3 — multi-head latent attention, sigmoid group-limited routing — which Kimi-K2 shares)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from verl_mega.models.arch import ModelArch, ModelConfigError  # noqa: F401  (their home is models/arch.py)
from verl_mega.models.deepseek import deepseek_fields, mla_kwargs, router_kwargs
from verl_mega.parallel.placement import divisors

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
# the HF class vLLM instantiates for each supported model_type (vLLM picks its model class by `architectures`)
CAUSAL_LM_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                           "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                           "deepseek_v3": "DeepseekV3ForCausalLM"}

MODEL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF's `attention_bias` means a bias on q, k, v *and* o_proj for these; Megatron's add_bias_linear would also bias
# the MLP, so only Qwen2's QKV-only bias (add_qkv_bias) is built, and these biases are refused rather than dropped
_O_PROJ_BIAS = ("llama", "qwen3", "qwen3_moe")
_MLP_BIAS = ("llama",)  # `mlp_bias`: gate, up and down projections


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
    _check_unsupported_weights(hf, model_type)
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
    mla = model_type == "deepseek_v3"
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type"))
        allowed = ("yarn", "default") if mla else ("llama3", "default")
        if rope_type not in allowed:
            raise ModelConfigError(f"model: rope_scaling type {rope_type!r} is not supported for {model_type}; "
                                   f"supported: {allowed[0]!r} (or none)")
        if rope_type == "default":
            rope_scaling = None
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", model_type in ("mistral", "mixtral")) else None
    if mla:
        extra = deepseek_fields(hf, rope_scaling)
        head_dim = extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]
    elif model_type in MOE_MODEL_TYPES:
        extra = _moe_fields(hf, model_type)
    else:
        extra = {}
    return ModelArch(
        model_type=model_type,
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf["intermediate_size"],
        num_heads=heads,
        num_kv_heads=heads if mla else kv_heads,
        head_dim=head_dim,
        vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(hf.get("qkv_bias", True))),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        init_std=float(hf.get("initializer_range", 0.02)),
        rope_scaling=rope_scaling,
        sliding_window=sliding,
        **extra,
    )


def _check_unsupported_weights(hf: dict[str, Any], model_type: str) -> None:
    """Refuse configs whose weights the model would silently drop or misread: quantized checkpoints and linear
    biases other than Qwen2's on q, k and v (Mistral and Mixtral ignore `attention_bias`, as HF does)."""
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ModelConfigError(f"model: config.json has a quantization_config (quant_method={method!r}); weights "
                               f"must be float32, bfloat16 or float16: dequantize the checkpoint to bf16 first")
    for key, types, where in (("attention_bias", _O_PROJ_BIAS, "q_proj, k_proj, v_proj and o_proj"),
                              ("mlp_bias", _MLP_BIAS, "gate_proj, up_proj and down_proj")):
        if model_type in types and hf.get(key):
            raise ModelConfigError(f"model: {key}=true gives {model_type}'s {where} a bias, which the Megatron model "
                                   f"does not have (it would be dropped); only {key}=false is supported")


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


def _moe_fields(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The experts of a Qwen3-MoE / Mixtral / Qwen2-MoE config. Hub configs name the expert count
    ``num_experts`` (Qwen) or ``num_local_experts`` (Mixtral; transformers ≥ 5 writes it for Qwen too)."""
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    topk = hf.get("num_experts_per_tok")
    width = hf["intermediate_size"] if model_type == "mixtral" else hf.get("moe_intermediate_size")
    for key, value in (("num_experts", experts), ("num_experts_per_tok", topk), ("moe_intermediate_size", width)):
        if not isinstance(value, int) or value <= 0:
            raise ModelConfigError(f"model: config.json field {key!r} must be a positive int for {model_type}, "
                                   f"got {value!r}")
    if topk > experts:
        raise ModelConfigError(f"model: num_experts_per_tok={topk} exceeds the {experts} experts; fix config.json")
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise ModelConfigError("model: dense layers between MoE layers (mlp_only_layers / decoder_sparse_step != 1) "
                               "are not supported; every layer must be MoE")
    shared = hf.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    return dict(num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=width,
                moe_renormalize=model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
                shared_expert_ffn_hidden_size=int(shared or 0), shared_expert_gate=bool(shared),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))


def _divisors(n: int) -> str:
    return ", ".join(map(str, divisors(n)))


def check_layout(pool, *, num_layers: int, num_heads: int, num_kv_heads: int, ffn_hidden_size: int | None = None,
                 num_experts: int = 0, moe_ffn_hidden_size: int = 0) -> None:
    """One-line errors, before any allocation, when a pool's layout cannot split the model: tp | heads, tp | key/value
    heads (the 3D-HybridEngine converts query groups shard by shard, so they are never replicated), tp | FFN width,
    pp·vpp | layers, and gen_tp | heads and key/value heads for vLLM. With experts: ep | experts, etp and gen_tp |
    expert width (vLLM's TP slices every expert), and sequence parallelism when tp > 1 (Megatron's MoE layer trains
    only with it)."""
    tp, gen_tp, stages = pool.tp, pool.gen_tp, pool.pp * (pool.vpp or 1)
    if num_experts:
        _check_moe_layout(pool, num_experts, moe_ffn_hidden_size)
    elif getattr(pool, "gen_ep", 1) > 1:
        raise ModelConfigError("rollout.gen_ep > 1 shards routed experts in generation; this model is dense: set "
                               "rollout.gen_ep=1")
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


def _check_moe_layout(pool, num_experts: int, width: int) -> None:
    key = pool._key if hasattr(pool, "_key") else (lambda k: "rollout.gen_tp" if k == "gen_tp" else f"parallel.{k}")
    ep, etp = getattr(pool, "ep", 1), getattr(pool, "etp", None) or pool.tp
    if num_experts % ep:
        raise ModelConfigError(f"{key('ep')}={ep} does not divide the model's {num_experts} experts; choose "
                               f"{key('ep')} among {_divisors(num_experts)}")
    if width % etp:
        raise ModelConfigError(f"{key('etp')}={etp} does not divide the experts' FFN width {width}; choose "
                               f"{key('etp')} among {_divisors(width)}")
    gen_ep = getattr(pool, "gen_ep", 1)
    if gen_ep > 1 and num_experts % gen_ep:
        raise ModelConfigError(f"{key('gen_ep')}={gen_ep} does not divide the model's {num_experts} experts (vLLM's "
                               f"expert parallelism gives each rank E/gen_ep whole experts); choose among "
                               f"{_divisors(num_experts)}")
    if gen_ep == 1 and width % pool.gen_tp:
        raise ModelConfigError(f"{key('gen_tp')}={pool.gen_tp} does not divide the experts' FFN width {width} (vLLM "
                               f"splits every expert over its TP ranks); choose among {_divisors(width)}")
    if pool.tp > 1 and getattr(pool, "trains", True) and not pool.sequence_parallel:
        raise ModelConfigError(f"{key('tp')}={pool.tp} with experts needs sequence parallelism (Megatron's MoE layer "
                               f"trains only with it); set parallel.sequence_parallel=true")


def check_arch_layout(pool, arch: ModelArch) -> None:
    """:func:`check_layout` with every width of ``arch`` (for MoE: the experts' and the shared expert's; the dense
    layers' between MoE layers; MLA's latent projections, which Megatron's local spec splits over tp)."""
    ffn = (arch.shared_expert_ffn_hidden_size or None) if arch.is_moe else arch.ffn_hidden_size
    check_layout(pool, num_layers=arch.num_layers, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                 ffn_hidden_size=ffn, num_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size)
    widths = [("dense FFN width", arch.ffn_hidden_size)] if arch.is_moe and not arch.all_layers_moe else []
    if arch.is_mla:
        widths += [("q_lora_rank", arch.q_lora_rank)] if arch.q_lora_rank else []
        widths.append(("kv_lora_rank + qk_rope_head_dim", arch.kv_lora_rank + arch.qk_rope_head_dim))
    if arch.is_mla and getattr(pool, "cp", 1) > 1:
        raise ModelConfigError(f"parallel.cp={pool.cp}: context parallelism with multi-head latent attention is not "
                               f"supported (our attention spec has no MLA context-parallel path); set parallel.cp=1")
    for name, value in widths:
        if value % pool.tp:
            raise ModelConfigError(f"parallel.tp={pool.tp} does not divide the model's {name} {value}; choose "
                                   f"parallel.tp among {_divisors(math.gcd(value, arch.num_heads))}")


def torch_dtype(name: str) -> torch.dtype:
    if name not in MODEL_DTYPES:
        raise ModelConfigError(f"model.dtype={name!r} is not supported; use one of {sorted(MODEL_DTYPES)}")
    return MODEL_DTYPES[name]


def transformer_config(
    arch: ModelArch,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    sequence_parallel: bool = False,
    dtype: str = "float32",
    recompute: str = "none",
    fused_kernels: bool = False,
    **overrides: Any,
):
    """Build mcore's own TransformerConfig (passed through, never re-declared); ``fused_kernels`` turns on mcore's
    compiled SwiGLU (``bias_activation_fusion``, which also compiles our spec's norms); `overrides` go straight into it
    (for experts, mcore's own ``moe_*`` names: ``moe_aux_loss_coeff``, ``moe_z_loss_coeff``,
    ``moe_token_dispatcher_type``, ``moe_enable_routing_replay``)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

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
        bias_activation_fusion=fused_kernels,
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
    if arch.is_moe:
        kwargs.update(moe_kwargs(arch, ep=ep, etp=etp or tp))
    elif ep != 1 or etp not in (None, tp):
        key = f"parallel.ep={ep}" if ep != 1 else f"parallel.etp={etp}"
        raise ModelConfigError(f"{key} needs a Mixture-of-Experts model; {arch.model_type} is dense")
    if arch.is_mla:
        kwargs.update(mla_kwargs(arch))
    kwargs.update(overrides)
    return (MLATransformerConfig if arch.is_mla else TransformerConfig)(**kwargs)


def moe_kwargs(arch: ModelArch, *, ep: int = 1, etp: int = 1) -> dict[str, Any]:
    """mcore's MoE fields for ``arch``. HF routers take a softmax over every expert, then the top k; renormalising
    those k weights equals mcore's softmax over the top-k logits (``moe_router_pre_softmax=False``), keeping them
    as they are is ``moe_router_pre_softmax=True``. Router logits in fp32; dropless (no capacity factor)."""
    if arch.num_experts % ep:
        raise ModelConfigError(f"parallel.ep={ep} does not divide the model's {arch.num_experts} experts; choose "
                               f"parallel.ep among {_divisors(arch.num_experts)}")
    if arch.moe_ffn_hidden_size % etp:
        raise ModelConfigError(f"parallel.etp={etp} does not divide the experts' FFN width {arch.moe_ffn_hidden_size}")
    shared = arch.shared_expert_ffn_hidden_size
    out = dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_topk=arch.moe_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.moe_renormalize,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=arch.router_aux_loss_coef,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_shared_expert_intermediate_size=shared or None,
        moe_shared_expert_gate=arch.shared_expert_gate,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    if arch.moe_score_function == "sigmoid":  # DeepSeek's router
        out.update(router_kwargs(arch))
    return out


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
