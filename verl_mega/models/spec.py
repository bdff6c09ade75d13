"""Our Megatron-Core layer spec: needs neither transformer-engine nor apex.

* :class:`SDPAttention` — mcore's ``DotProductAttention`` interface on top of
  ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU, GQA native).
* :class:`RMSNorm` — works with sequence parallelism: the normalisation is per token, so only the weight gradient
  needs the TP all-reduce, which mcore's ``finalize_model_grads`` performs for params tagged ``sequence_parallel``.
  (mcore's local spec falls back to ``torch.nn.RMSNorm``, which refuses sequence parallelism.)

When transformer-engine imports, :func:`layer_spec` returns mcore's TE spec instead (``use_te="auto"``).
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
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
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        # Normalise in fp32 as HF does, then cast back before scaling (matches HF Llama/Qwen numerics).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)


class SDPAttention(DotProductAttention):
    """Core attention via SDPA. Inputs [s, b, heads, d]; output [s, b, heads·d] like mcore's core attention."""

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
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        if q.size(1) != k.size(1):
            # Expand KV heads explicitly: SDPA's enable_gqa path is not available for every backend/dtype.
            rep = q.size(1) // k.size(1)
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
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
