"""DeepSeek-V3's ``config.json`` (``model_type: deepseek_v3``; Kimi-K2 uses the same architecture) → the facts of
:class:`~verl_mega.models.arch.ModelArch` and Megatron-Core's own MLA and router options.

Everything is Megatron's: ``MLATransformerConfig`` (multi-head latent attention with YaRN), the sigmoid router with
group-limited top-k (``moe_router_num_groups`` / ``moe_router_group_topk``), ``moe_router_topk_scaling_factor``,
the aux-loss-free correction bias (``moe_router_enable_expert_bias``, updated from the step's token counts by
``moe_router_bias_update_rate``), the shared experts and the dense-layer pattern (``moe_layer_freq``). A config
whose semantics Megatron's router cannot reproduce exactly (HF's transformers is the reference) is refused with one
line naming the field.
"""

from __future__ import annotations

from typing import Any

from verl_mega.models.arch import ModelArch, ModelConfigError

# transformers' DeepseekV3Config defaults, used when config.json leaves a field out (vLLM reads the same class)
_DEFAULTS = {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
             "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
             "norm_topk_prob": True, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
             "qk_nope_head_dim": 128, "v_head_dim": 128}
# DeepSeek-V3 trained its correction bias at γ = 0.001 (arXiv 2412.19437 §2.1.2); Megatron's default too
DEFAULT_BIAS_UPDATE_RATE = 1e-3


def _get(hf: dict[str, Any], key: str) -> Any:
    return hf[key] if key in hf else _DEFAULTS.get(key)


def _positive(hf: dict[str, Any], *keys: str) -> list[int]:
    out = []
    for key in keys:
        value = _get(hf, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"model: config.json field {key!r} must be a positive int for deepseek_v3, got "
                                   f"{value!r}")
        out.append(value)
    return out


def deepseek_fields(hf: dict[str, Any], rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
    """:class:`ModelArch` fields of a DeepSeek-V3 config: MLA dims, the router and the dense/MoE layer pattern."""
    kv_lora, nope, rope, v = _positive(hf, "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    q_lora = _get(hf, "q_lora_rank")
    if q_lora is not None:
        _positive(hf, "q_lora_rank")
    if hf.get("attention_bias"):
        raise ModelConfigError("model: attention_bias=true is not supported for deepseek_v3 (Megatron's MLA "
                               "projections have no bias); fix config.json")
    if hf.get("rope_interleave") is False:
        raise ModelConfigError("model: rope_interleave=false is not supported for deepseek_v3 (Megatron's MLA and "
                               "vLLM rotate interleaved pairs, as DeepSeek's checkpoints are laid out)")
    if rope % 2:
        raise ModelConfigError(f"model: qk_rope_head_dim={rope} must be even")
    if rope_scaling is not None:
        if rope_scaling.get("factor") is None or rope_scaling.get("attention_factor") is not None \
                or rope_scaling.get("truncate") is False:
            raise ModelConfigError("model: yarn rope_scaling needs a 'factor' and no 'attention_factor' or "
                                   "'truncate: false' for deepseek_v3 (Megatron's YaRN derives both); fix config.json")
        if bool(rope_scaling.get("mscale")) != bool(rope_scaling.get("mscale_all_dim")) \
                and rope_scaling.get("mscale_all_dim"):
            raise ModelConfigError("model: yarn rope_scaling with 'mscale_all_dim' but no 'mscale' is not "
                                   "supported; set both (DeepSeek-V3: 1.0 and 1.0)")
    experts, topk, width = _positive(hf, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size")
    groups, group_topk = _positive(hf, "n_group", "topk_group")
    shared = _get(hf, "n_shared_experts") or 0
    first_k = _get(hf, "first_k_dense_replace") or 0
    freq = hf.get("moe_layer_freq", 1)
    if topk > experts or experts % groups or group_topk > groups or experts // groups < 2:
        raise ModelConfigError(f"model: n_routed_experts={experts}, num_experts_per_tok={topk}, n_group={groups}, "
                               f"topk_group={group_topk} do not form a router: n_group must divide the experts into "
                               f"groups of at least 2 and topk_group ≤ n_group, top-k ≤ experts")
    if group_topk < groups and topk // group_topk != 2:
        # HF and vLLM score a group by its 2 best experts; Megatron by its top-k/topk_group best
        raise ModelConfigError(f"model: num_experts_per_tok / topk_group = {topk}/{group_topk} must be 2 with "
                               f"group-limited routing (n_group={groups}): groups are scored by their 2 best "
                               f"experts; fix config.json")
    if _get(hf, "norm_topk_prob") is not True or topk < 2:
        raise ModelConfigError("model: deepseek_v3 needs norm_topk_prob=true and num_experts_per_tok ≥ 2 (Megatron's "
                               "sigmoid router renormalises the chosen experts' scores)")
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, want) != want:
            raise ModelConfigError(f"model: {key}={hf[key]!r} is not supported for deepseek_v3 (transformers' model "
                                   f"routes with {key}={want!r}); fix config.json")
    if not isinstance(freq, int) or freq < 1 or not isinstance(first_k, int) or first_k < 0:
        raise ModelConfigError(f"model: moe_layer_freq={freq!r} and first_k_dense_replace={first_k!r} must be a "
                               f"positive and a non-negative int")
    if not any(i >= first_k and i % freq == 0 for i in range(hf["num_hidden_layers"])):
        raise ModelConfigError(f"model: first_k_dense_replace={first_k} leaves no MoE layer among the "
                               f"{hf['num_hidden_layers']} layers; fix config.json")
    mtp = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    return dict(q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                v_head_dim=v, num_experts=experts, moe_topk=topk, moe_ffn_hidden_size=width, moe_renormalize=True,
                shared_expert_ffn_hidden_size=shared * width, moe_score_function="sigmoid", moe_num_groups=groups,
                moe_group_topk=group_topk, moe_routed_scaling_factor=float(_get(hf, "routed_scaling_factor")),
                moe_expert_bias=True, first_k_dense=first_k, moe_layer_freq=freq,
                router_aux_loss_coef=float(hf.get("aux_loss_alpha", 0.0)), moe_seq_aux_loss=bool(hf.get("seq_aux")),
                num_mtp_layers=int(mtp))


def mla_kwargs(arch: ModelArch) -> dict[str, Any]:
    """``MLATransformerConfig`` fields of an MLA model. The query/key norms are MLA's latent norms (q_a_layernorm,
    kv_a_layernorm); Megatron's MLA de-interleaves the rotary dims itself (DeepSeek's layout)."""
    kw: dict[str, Any] = dict(multi_latent_attention=True, q_lora_rank=arch.q_lora_rank,
                              kv_lora_rank=arch.kv_lora_rank, qk_head_dim=arch.qk_nope_head_dim,
                              qk_pos_emb_head_dim=arch.qk_rope_head_dim, v_head_dim=arch.v_head_dim,
                              rotary_base=arch.rope_theta, qk_layernorm=True, rope_type="rope")
    rs = arch.rope_scaling
    if rs is not None:
        kw.update(rope_type="yarn", rotary_scaling_factor=float(rs["factor"]),
                  original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 4096)),
                  beta_fast=float(rs.get("beta_fast") or 32), beta_slow=float(rs.get("beta_slow") or 1),
                  mscale=float(rs.get("mscale") or 1.0), mscale_all_dim=float(rs.get("mscale_all_dim") or 0.0))
    return kw


def router_kwargs(arch: ModelArch) -> dict[str, Any]:
    """Megatron's router and layer-pattern fields for DeepSeek's sigmoid router with its correction bias."""
    grouped = arch.moe_group_topk < arch.moe_num_groups  # else every group is chosen: plain top-k
    return dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=False,
                moe_router_num_groups=arch.moe_num_groups if grouped else None,
                moe_router_group_topk=arch.moe_group_topk if grouped else None,
                moe_router_topk_scaling_factor=arch.moe_routed_scaling_factor,
                moe_router_enable_expert_bias=True, moe_router_bias_update_rate=DEFAULT_BIAS_UPDATE_RATE,
                moe_router_load_balancing_type="seq_aux_loss" if arch.moe_seq_aux_loss else "aux_loss",
                moe_shared_expert_gate=False,
                moe_layer_freq=[int(arch.is_moe_layer(i)) for i in range(arch.num_layers)])
