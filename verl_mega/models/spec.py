"""Our Megatron-Core layer spec: needs neither transformer-engine nor apex.

* :class:`SDPAttention` — mcore's core-attention interface on top of
  ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU). With context
  parallelism each rank holds two load-balanced chunks of every sequence: it all-gathers the keys and values of the
  whole sequence over the CP group (backward: reduce-scatter of their gradients) and masks causally by global
  position, so logits and gradients are those of the unsplit sequence.
* :class:`RMSNorm` — works with sequence parallelism: the normalisation is per token, so only the weight gradient
  needs the TP all-reduce, which mcore's ``finalize_model_grads`` performs for params tagged ``sequence_parallel``.
  (mcore's local spec falls back to ``torch.nn.RMSNorm``, which refuses sequence parallelism.)
* Mixture of experts: mcore's own ``MoELayer`` (``TopKRouter``, its allgather / alltoall token dispatcher over the
  expert-parallel groups, ``SharedExpertMLP``) with :class:`GroupedExperts` for the routed experts: a grouped GEMM
  (``torch._grouped_mm``) on GPU, a loop over experts on CPU, one weight layout for both.

When transformer-engine imports, :func:`layer_spec` returns mcore's TE spec instead (``use_te="auto"``); its MoE
layers keep :class:`GroupedExperts`, so the expert weight layout (and every converter) is the same with or without TE.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    """``fused``: the normalisation runs as one compiled kernel forward and backward (``torch.compile``) instead of
    seven element-wise passes over the activations; same operations, same order, same roundings."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, *, fused: bool = False,
                 **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = 0.0 if self.zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init, dtype=config.params_dtype))
        # Tells mcore to all-reduce this weight's grad over TP when activations are sequence-split.
        self.weight.sequence_parallel = config.sequence_parallel
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        offset = 1.0 if self.zero_centered_gamma else 0.0
        norm = _compiled_rms_norm() if self.fused else _rms_norm
        return norm(x, self.weight, self.eps, offset)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    # Normalise in fp32 as HF does, then cast back before scaling (matches HF Llama/Qwen numerics).
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight + offset) * xf.to(x.dtype)


@functools.cache
def _compiled_rms_norm():
    return torch.compile(_rms_norm)


class SDPAttention(MegatronModule):
    """Core attention via SDPA. Inputs [s, b, heads, d]; output [s, b, heads·d] like mcore's core attention."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, cp_comm_type: str | None = None,
                 pg_collection=None) -> None:
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.tp_group = pg_collection.tp  # read by mcore's sharded_state_dict
        # MLA hands its own head dims: queries/keys of k_channels, values of v_channels (the output's)
        k_channels, v_channels = k_channels or config.kv_channels, v_channels or config.kv_channels
        self.hidden_size_per_partition = v_channels * config.num_attention_heads // pg_collection.tp.size()
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(k_channels)
        self.cp_group = pg_collection.cp if pg_collection.cp.size() > 1 else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support an attention bias; use the TE spec")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if self.cp_group is not None:
            attention_mask = self._context_parallel_mask(query.size(0), query.device)
            key, value = (_GatherSequence.apply(t, self.cp_group) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        p = self.config.attention_dropout if self.training else 0.0
        # SDPA's fused CUDA kernels read shared KV heads themselves; elsewhere the heads are repeated
        gqa = {"enable_gqa": True} if attention_mask is None and _fused_gqa(q, k, p) else {}
        if not gqa:
            k, v = _expand_kv(q, k, v)
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=mask_type == AttnMaskType.causal, dropout_p=p, scale=self.softmax_scale, **gqa
            )
        else:
            # mcore convention: True = masked out; SDPA's boolean mask: True = attend.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=p,
                                                 scale=self.softmax_scale)
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """Causal attention inside each sequence of a pack ([t, heads, d], or [t, 1, heads, d] when Megatron kept the
        batch dimension; ``cu_seqlens`` marks the sequences): varlen flash attention on CUDA, a block-diagonal causal
        mask elsewhere. With context parallelism the queries are this rank's chunks of every sequence (pack
        positions ``local``) and the keys and values are gathered from every rank (pack positions ``gathered``)."""
        if query.dim() == 4:
            query, key, value = (x.squeeze(1) for x in (query, key, value))
        cu = params.cu_seqlens_q
        p = self.config.attention_dropout if self.training else 0.0
        if self.cp_group is not None:
            local, gathered = params.cp_layout
            key, value = (_GatherSequence.apply(x, self.cp_group) for x in (key, value))
        elif query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and p == 0.0 and _VARLEN_CAUSAL:
            gqa = {"enable_gqa": True} if "enable_gqa" in _VARLEN_CAUSAL and query.size(1) != key.size(1) else {}
            if not gqa:
                key, value = _expand_kv(query, key, value)
            dv = value.size(-1)  # MLA: values narrower than queries/keys; the flash kernel wants one head dim
            if dv != query.size(-1):
                value = F.pad(value, (0, query.size(-1) - dv))
            out = _varlen_attn(query, key, value, cu, cu, params.max_seqlen_q, params.max_seqlen_kv,
                               scale=self.softmax_scale, **_VARLEN_CAUSAL["causal"], **gqa)
            return out[..., :dv].reshape(query.size(0), 1, self.hidden_size_per_partition)
        else:
            local = gathered = torch.arange(query.size(0), device=query.device)
        # a key is visible when it lies in the query's sequence, at or before it
        segment = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=cu.device), (cu[1:] - cu[:-1]).long())
        allow = (segment[gathered][None, :] == segment[local][:, None]) & (gathered[None, :] <= local[:, None])
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # -> [1, heads, t, d]
        k, v = _expand_kv(q, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allow, dropout_p=p, scale=self.softmax_scale)
        return out[0].transpose(0, 1).reshape(query.size(0), 1, self.hidden_size_per_partition)

    def _context_parallel_mask(self, local_len: int, device: torch.device) -> torch.Tensor:
        """mcore's convention (True = masked out): query i may see key j when j's global position ≤ i's; keys come
        gathered rank by rank."""
        from verl_mega.parallel.context import context_chunks

        cp, rank = self.cp_group.size(), torch.distributed.get_group_rank(self.cp_group, torch.distributed.get_rank())
        seq = local_len * cp
        keys = torch.tensor([p for r in range(cp) for p in context_chunks(seq, cp, r)], device=device)
        queries = torch.tensor(context_chunks(seq, cp, rank), device=device)
        return keys[None, :] > queries[:, None]


def _expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value heads (dim 1) repeated up to the query's heads (GQA), explicitly: SDPA's and varlen attention's
    ``enable_gqa`` are not available for every backend, dtype and torch release."""
    if query.size(1) == key.size(1):
        return key, value
    rep = query.size(1) // key.size(1)
    return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)


def _fused_gqa(query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
    """Whether SDPA takes this GQA call with shared KV heads as is: CUDA, half precision, no dropout, flash enabled
    (on H200 with torch 2.11 it then ran cuDNN's fused attention)."""
    return (query.is_cuda and query.size(1) != key.size(1) and query.dtype in (torch.bfloat16, torch.float16)
            and dropout == 0.0 and torch.backends.cuda.flash_sdp_enabled())


def _varlen_causal() -> dict:
    """How this torch's ``varlen_attn`` is asked for a causal mask (``is_causal`` in some releases, a (-1, 0) window in
    others), and whether it takes ``enable_gqa``; empty when torch has no varlen attention."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return {"causal": causal, **({"enable_gqa": True} if "enable_gqa" in params else {})}


_VARLEN_CAUSAL = _varlen_causal()
if _VARLEN_CAUSAL:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (the sequence) over a group; backward: reduce-scatter of the gradient (every rank's
    queries read every key). Allocates on the input's device, so it needs no CUDA device in CPU mode."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = x.new_empty((x.shape[0] * group.size(), *x.shape[1:]))
        torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // ctx.group.size(), *grad.shape[1:]))
        torch.distributed.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


class GroupedExperts(GroupedMLP):
    """The routed experts of one MoE layer, stacked as mcore's ``GroupedMLP`` holds them: ``weight1``
    [h, E·2f/etp] viewed as [E, h, 2f/etp] (per expert the columns [gate_r | up_r] of expert-TP rank r) and
    ``weight2`` [E·f/etp, h] viewed as [E, f/etp, h], for the E experts local to this EP rank. GroupedMLP's
    ``sharded_state_dict`` applies unchanged, so dist checkpoints are layout-free over ep and etp.

    Forward: on GPU one grouped GEMM per projection (``torch._grouped_mm``, no transformer-engine or grouped_gemm
    package); elsewhere a loop over the local experts. Router probabilities scale the activation before the down
    projection, as in mcore."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, pg_collection=None) -> None:
        # GroupedMLP.__init__ insists on the external grouped_gemm package and bf16; build the same state here.
        from megatron.core.tensor_parallel.layers import _initialize_affine_weight_gpu, \
            set_tensor_model_parallel_attributes

        MegatronModule.__init__(self, config=config)
        if config.add_bias_linear or not config.gated_linear_unit:
            raise ValueError("GroupedExperts: experts must be gated (SwiGLU) and bias-free")
        self.num_local_experts = num_local_experts
        self.expert_parallel = config.expert_model_parallel_size > 1
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        etp = self.tp_group.size()
        ffn = config.moe_ffn_hidden_size * num_local_experts // etp
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight1 = torch.nn.Parameter(torch.empty(config.hidden_size, 2 * ffn, device=device,
                                                      dtype=config.params_dtype))
        self.weight2 = torch.nn.Parameter(torch.empty(ffn, config.hidden_size, device=device,
                                                      dtype=config.params_dtype))
        for weight, dim, init in ((self.weight1, 1, config.init_method), (self.weight2, 0,
                                                                         config.output_layer_init_method)):
            if config.perform_initialization and not config.use_cpu_initialization:
                _initialize_affine_weight_gpu(weight, init, partition_dim=dim, is_expert=True)
            else:
                set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)
                if config.perform_initialization:  # on the host: the process's generator, as mcore's CPU init
                    init(weight.data)
            # expert params are reduced over the expert-data-parallel group, not the dense one
            weight.allreduce = not self.expert_parallel
        self.activation_recompute = False
        self.register_load_state_dict_post_hook(_drop_extra_state_keys)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        h = self.config.hidden_size
        w1 = self.weight1.view(self.num_local_experts, h, -1)
        w2 = self.weight2.view(self.num_local_experts, -1, h)
        if tokens.is_cuda and tokens.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
            offsets = torch.cumsum(tokens_per_expert.to(tokens.device), 0, dtype=torch.int32)
            fc1 = torch._grouped_mm(tokens, w1, offs=offsets)
            # mcore's compiled SwiGLU (one kernel each way) when the config asks for fused activations
            inner = weighted_bias_swiglu_impl(fc1, None, probs.unsqueeze(-1)) \
                if self.config.bias_activation_fusion else _swiglu(fc1, probs)
            return torch._grouped_mm(inner, w2, offs=offsets), None
        outputs = []
        counts = [int(c) for c in tokens_per_expert.tolist()]
        for e, (x, p) in enumerate(zip(tokens.split(counts), probs.split(counts))):
            outputs.append(_swiglu(x @ w1[e], p) @ w2[e])
        return torch.cat(outputs), None

    def backward_dw(self) -> None:
        pass


def _swiglu(fc1: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    gate, up = fc1.chunk(2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(fc1.dtype)


def _mcore_moe_without_te() -> None:
    """megatron-core 0.16.1's router gating reads ``te_general_gemm`` even when transformer-engine is absent (it is
    only bound inside the TE import): bind it to None, which selects mcore's own torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_mcore_moe_without_te()


def _mcore_mla_without_te() -> None:
    """megatron-core 0.16.1's MLA module imports its TE names from a module that, without transformer-engine, hands
    out mock objects, so it believes TE is present and its ``isinstance(linear_proj, TELinear)`` check raises: tell
    it the truth when TE does not import. Its accepted replicated linear is the one our spec uses for the latent
    down projections (:func:`layer_spec`); make sure it knows it whichever way that import went."""
    from megatron.core.transformer import multi_latent_attention

    if importlib.util.find_spec("transformer_engine") is None:
        multi_latent_attention.HAVE_TE = False
    if multi_latent_attention.Linear is None:
        multi_latent_attention.Linear = ReplicatedLinear


_mcore_mla_without_te()


def _drop_extra_state_keys(module, incompatible_keys) -> None:
    """GroupedMLP's checkpoints carry SequentialMLP-compatible ``_extra_state`` entries that no parameter owns."""
    for key in list(incompatible_keys.unexpected_keys):
        if "_extra_state" in key:
            incompatible_keys.unexpected_keys.remove(key)


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def layer_spec(*, qk_layernorm: bool, use_te: str = "auto", num_experts: int | None = None,
               fused_norm: bool = False, multi_latent_attention: bool = False, lora=None) -> ModuleSpec:
    """The transformer layer spec: mcore's TE spec when TE is importable (or forced), otherwise ours (its norms
    compiled with ``fused_norm``). With ``num_experts`` the MLP is mcore's MoE layer with :class:`GroupedExperts`.
    ``multi_latent_attention``: mcore's own MLA (``MLASelfAttention``) on our core attention and norms (its latent
    norms are the q/k norms); always our spec, whose down projections the converters and the weight sync map.
    ``lora`` (a :class:`~verl_mega.models.lora.LoRASpec`): our spec, its attention and dense-MLP linears carrying
    adapters (routed experts carry none)."""
    if use_te not in ("auto", "true", "false"):
        raise ValueError(f"model.use_te={use_te!r} must be auto|true|false")
    if lora is not None:
        if use_te == "true":
            raise ValueError("model.use_te=true: LoRA adapters run on our layer spec only (TE fuses the norm into "
                             "the projections the adapters read); set model.use_te=auto or false")
        if multi_latent_attention:
            raise ValueError("model.lora: multi-head latent attention models are not supported; train them without "
                             "model.lora")
        use_te = "false"
    if multi_latent_attention and use_te == "true":
        raise ValueError("model.use_te=true: multi-head latent attention runs on our layer spec only; set "
                         "model.use_te=auto or false")
    num_experts = num_experts or None
    if not multi_latent_attention and (use_te == "true" or (use_te == "auto" and te_available())):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_layernorm)
        if num_experts:
            spec.submodules.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
        return spec

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_layernorm, normalization="RMSNorm",
                                    multi_latent_attention=multi_latent_attention)
    sub = spec.submodules
    if num_experts:
        sub.mlp.submodules.experts = ModuleSpec(module=GroupedExperts)
    norm = rms_norm_spec(fused_norm)
    sub.input_layernorm = norm
    sub.pre_mlp_layernorm = norm
    attn = sub.self_attention.submodules
    attn.core_attention = SDPAttention
    if multi_latent_attention:
        # The latent down projections whole on every TP rank (as vLLM holds them, and as mcore's TE spec does with
        # its duplicated linears): with sequence parallelism they see the rank's own tokens and their gradients are
        # summed over TP (``sequence_parallel``); mcore's column-parallel variant gathers over its global TP group
        attn.linear_q_down_proj = ReplicatedLinear
        attn.linear_kv_down_proj = ReplicatedLinear
    if lora is not None:
        from verl_mega.models.lora import LoRAColumnParallelLinear, LoRARowParallelLinear

        attn.linear_qkv = ModuleSpec(module=LoRAColumnParallelLinear, params={"lora": lora, "fused": "qkv"})
        attn.linear_proj = ModuleSpec(module=LoRARowParallelLinear, params={"lora": lora, "part": "o_proj"})
        if not num_experts:
            mlp = sub.mlp.submodules
            mlp.linear_fc1 = ModuleSpec(module=LoRAColumnParallelLinear, params={"lora": lora, "fused": "fc1"})
            mlp.linear_fc2 = ModuleSpec(module=LoRARowParallelLinear, params={"lora": lora, "part": "down_proj"})
    if qk_layernorm:
        attn.q_layernorm = norm
        if multi_latent_attention:
            attn.kv_layernorm = norm
        else:
            attn.k_layernorm = norm
    return spec


def rms_norm_spec(fused: bool) -> ModuleSpec:
    return ModuleSpec(module=RMSNorm, params={"fused": fused})
