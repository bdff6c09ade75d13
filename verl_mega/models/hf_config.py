"""Hugging Face ``config.json`` → Megatron-Core ``TransformerConfig`` for the decoder families we support: dense
(Llama, Mistral, Qwen2, Qwen3) and Mixture-of-Experts (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from verl_mega.parallel.placement import divisors

MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_MODEL_TYPES)
# the HF class vLLM instantiates for each supported model_type (vLLM picks its model class by `architectures`)
CAUSAL_LM_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                           "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelConfigError(ValueError):
    """A model config that verl_mega cannot build; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    """The architecture facts of a decoder, read from an HF config (one place, used by every converter).

    Mixture of experts (``num_experts > 0``): every layer's MLP is ``num_experts`` gated-SiLU experts of width
    ``moe_ffn_hidden_size``, of which a softmax router picks ``moe_topk`` per token; ``moe_renormalize`` rescales
    the picked weights to sum to one (Mixtral, Qwen ``norm_topk_prob``). ``shared_expert_ffn_hidden_size`` > 0 adds
    Qwen2-MoE's shared expert, scaled by a sigmoid gate, to every token. ``ffn_hidden_size`` is the dense MLP width
    (unused when every layer is MoE)."""

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
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_renormalize: bool = False
    shared_expert_ffn_hidden_size: int = 0
    router_aux_loss_coef: float = 0.0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron pads the vocabulary so each TP rank holds an equal slice that is a multiple of `divisible_by`."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameter count of the HF model (embeddings counted once when tied)."""
        return self._count(active=False)

    def num_active_parameters(self) -> int:
        """Parameters one token passes through: the routed experts count ``moe_topk`` times, not
        ``num_experts`` (equals :meth:`num_parameters` for a dense model)."""
        return self._count(active=True)

    def attention_parameters(self) -> int:
        """One layer's attention block, with its input norm."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_heads * d) + 2 * h * (self.num_kv_heads * d) + (self.num_heads * d) * h
        if self.qkv_bias:
            attn += self.num_heads * d + 2 * self.num_kv_heads * d
        if self.qk_norm:
            attn += 2 * d
        return attn + h

    def expert_parameters(self) -> int:
        """One routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def mlp_parameters(self, *, active: bool = False) -> int:
        """One layer's MLP block with its input norm: the dense MLP, or router + experts (+ shared expert)."""
        h = self.hidden_size
        if not self.is_moe:
            return 3 * h * self.ffn_hidden_size + h
        experts = (self.moe_topk if active else self.num_experts) * self.expert_parameters()
        shared = 3 * h * self.shared_expert_ffn_hidden_size + h if self.shared_expert_ffn_hidden_size else 0
        return self.num_experts * h + experts + shared + h

    def replicated_layer_parameters(self) -> int:
        """One layer's tensors every training and generation TP rank holds whole: the norms, and for MoE the
        router (E·h) and the shared expert's gate."""
        n = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)
        if self.is_moe:
            n += self.num_experts * self.hidden_size + (self.hidden_size if self.shared_expert_ffn_hidden_size else 0)
        return n

    def hybrid_sync_bytes(self, pool, rank: int, element_size: int) -> float:
        """Bytes ``rank`` of a training pool receives at the 3D-HybridEngine's train → generate switch: HybridFlow
        Table 2, (t·p − tg)/(tg·t·p)·M, on the TP-sharded tensors; the replicated ones of the other pipeline
        stages; and the routed experts' own count (:meth:`~verl_mega.parallel.placement.Pool.
        expert_sync_bytes_per_rank`). Exact when Megatron's and vLLM's vocabulary paddings align (docs/moe.md)."""
        h, L, p = self.hidden_size, self.num_layers, pool.pp
        stage = pool.coords(rank)["pp"]
        replicated = (L * self.replicated_layer_parameters() + h) * element_size
        experts = L * self.num_experts * self.expert_parameters() * element_size
        sharded = self.num_parameters() * element_size - replicated - experts
        other_stages = ((L - L // p) * self.replicated_layer_parameters() + (h if stage != p - 1 else 0))
        out = pool.sync_bytes_per_rank(sharded) + other_stages * element_size
        if self.is_moe:
            out += pool.expert_sync_bytes_per_rank(rank, num_layers=L, num_experts=self.num_experts,
                                                   width=self.moe_ffn_hidden_size, row_bytes=h * element_size)
        return out

    def _count(self, *, active: bool) -> int:
        h = self.hidden_size
        layer = self.attention_parameters() + self.mlp_parameters(active=active)
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
    sliding = hf.get("sliding_window") if hf.get("use_sliding_window", model_type in ("mistral", "mixtral")) else None
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
        qkv_bias=model_type in ("qwen2", "qwen2_moe") or bool(hf.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        init_std=float(hf.get("initializer_range", 0.02)),
        rope_scaling=rope_scaling,
        sliding_window=sliding,
        **(_moe_fields(hf, model_type) if model_type in MOE_MODEL_TYPES else {}),
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
                shared_expert_ffn_hidden_size=int(shared or 0),
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
    if width % pool.gen_tp:
        raise ModelConfigError(f"{key('gen_tp')}={pool.gen_tp} does not divide the experts' FFN width {width} (vLLM "
                               f"splits every expert over its TP ranks); choose among {_divisors(width)}")
    if pool.tp > 1 and getattr(pool, "trains", True) and not pool.sequence_parallel:
        raise ModelConfigError(f"{key('tp')}={pool.tp} with experts needs sequence parallelism (Megatron's MoE layer "
                               f"trains only with it); set parallel.sequence_parallel=true")


def check_arch_layout(pool, arch: ModelArch) -> None:
    """:func:`check_layout` with every width of ``arch`` (for MoE: the experts' and the shared expert's)."""
    ffn = (arch.shared_expert_ffn_hidden_size or None) if arch.is_moe else arch.ffn_hidden_size
    check_layout(pool, num_layers=arch.num_layers, num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                 ffn_hidden_size=ffn, num_experts=arch.num_experts, moe_ffn_hidden_size=arch.moe_ffn_hidden_size)


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
    elif ep != 1:
        raise ModelConfigError(f"parallel.ep={ep} needs a Mixture-of-Experts model; {arch.model_type} is dense")
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


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
    return dict(
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
        moe_shared_expert_gate=bool(shared),
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


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
