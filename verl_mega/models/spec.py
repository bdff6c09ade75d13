"""Our Megatron-Core layer spec: needs neither transformer-engine nor apex.

* :class:`SDPAttention` — mcore's core-attention interface on top of
  ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU). With context
  parallelism each rank holds two load-balanced chunks of every sequence: it all-gathers the keys and values of the
  whole sequence over the CP group (backward: reduce-scatter of their gradients) and masks causally by global
  position, so logits and gradients are those of the unsplit sequence.
* :class:`RMSNorm` — works with sequence parallelism: the normalisation is per token, so only the weight gradient
  needs the TP all-reduce, which mcore's ``finalize_model_grads`` performs for params tagged ``sequence_parallel``.
  (mcore's local spec falls back to ``torch.nn.RMSNorm``, which refuses sequence parallelism.)

When transformer-engine imports, :func:`layer_spec` returns mcore's TE spec instead (``use_te="auto"``).
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = 0.0 if self.zero_centered_gamma else 1.0
        self.weight = torch.nn.Parameter(torch.full((hidden_size,), init, dtype=config.params_dtype))
        # Tells mcore to all-reduce this weight's grad over TP when activations are sequence-split.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        # Normalise in fp32 as HF does, then cast back before scaling (matches HF Llama/Qwen numerics).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)


class SDPAttention(MegatronModule):
    """Core attention via SDPA. Inputs [s, b, heads, d]; output [s, b, heads·d] like mcore's core attention."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        self.tp_group = pg_collection.tp  # read by mcore's sharded_state_dict
        self.hidden_size_per_partition = config.kv_channels * config.num_attention_heads // pg_collection.tp.size()
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
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
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention does not support packed sequences or attention bias; use the TE spec")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if self.cp_group is not None:
            attention_mask = self._context_parallel_mask(query.size(0), query.device)
            key, value = (_GatherSequence.apply(t, self.cp_group) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        if q.size(1) != k.size(1):
            # Expand KV heads explicitly: SDPA's enable_gqa path is not available for every backend/dtype.
            rep = q.size(1) // k.size(1)
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        p = self.config.attention_dropout if self.training else 0.0
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=mask_type == AttnMaskType.causal, dropout_p=p, scale=self.softmax_scale
            )
        else:
            # mcore convention: True = masked out; SDPA's boolean mask: True = attend.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, dropout_p=p,
                                                 scale=self.softmax_scale)
        s, b = out.size(2), out.size(0)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    def _context_parallel_mask(self, local_len: int, device: torch.device) -> torch.Tensor:
        """mcore's convention (True = masked out): query i may see key j when j's global position ≤ i's; keys come
        gathered rank by rank."""
        from verl_mega.parallel.placement import context_chunks

        cp, rank = self.cp_group.size(), torch.distributed.get_group_rank(self.cp_group, torch.distributed.get_rank())
        seq = local_len * cp
        keys = torch.tensor([p for r in range(cp) for p in context_chunks(seq, cp, r)], device=device)
        queries = torch.tensor(context_chunks(seq, cp, rank), device=device)
        return keys[None, :] > queries[:, None]


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


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def layer_spec(*, qk_layernorm: bool, use_te: str = "auto") -> ModuleSpec:
    """The transformer layer spec: mcore's TE spec when TE is importable (or forced), otherwise ours."""
    if use_te not in ("auto", "true", "false"):
        raise ValueError(f"model.use_te={use_te!r} must be auto|true|false")
    if use_te == "true" or (use_te == "auto" and te_available()):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    attn = sub.self_attention.submodules
    attn.core_attention = SDPAttention
    if qk_layernorm:
        attn.q_layernorm = RMSNorm
        attn.k_layernorm = RMSNorm
    return spec
