"""The architecture facts of a decoder (:class:`ModelArch`) and the parameter and byte counts derived from them:
pure arithmetic, read from an HF config by :mod:`verl_mega.models.hf_config` and used by every converter, the
3D-HybridEngine's predictions and the planner."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any


class ModelConfigError(ValueError):
    """A model config that verl_mega cannot build; the message names the field and the fix."""


def stage_layer_indices(num_layers: int, pp: int, vpp: int | None, stage: int) -> list[int]:
    """Global layer indices pipeline stage ``stage`` holds (Megatron's even split; with ``vpp`` virtual stages the
    chunks ``c·pp + stage`` of L/(pp·vpp) layers each)."""
    v = vpp or 1
    per = num_layers // (pp * v)
    return [i for c in range(v) for i in range((c * pp + stage) * per, (c * pp + stage + 1) * per)]


def expert_sync_bytes_per_rank(pool, rank: int, *, num_layers: int, own_layers: int, num_experts: int, width: int,
                               row_bytes: float) -> float:
    """Routed-expert bytes ``rank`` of ``pool`` (a :class:`~verl_mega.parallel.placement.Pool`) receives at the
    train → generate switch (docs/moe.md): its generation slice (``Pool.expert_slice``) of the gate, up and down
    projections of every one of the ``num_layers`` MoE layers (rows of ``row_bytes`` = h·element size), less what its
    own (ep, etp) training shard holds of it in the ``own_layers`` MoE layers of its own stage."""
    c = pool.coords(rank)
    e0, e1, r0, r1 = pool.expert_slice_at(c, num_experts, width)
    local, fr = num_experts // pool.ep, width // pool.etp
    held_e = max(0, min(e1, (c["ep"] + 1) * local) - max(e0, c["ep"] * local))
    held_r = max(0, min(r1, (c["etp"] + 1) * fr) - max(r0, c["etp"] * fr))
    need = num_layers * (e1 - e0) * 3 * (r1 - r0) * row_bytes
    return need - own_layers * held_e * 3 * held_r * row_bytes


@dataclass(frozen=True, kw_only=True)
class ModelArch:
    """The architecture facts of a decoder, read from an HF config (one place, used by every converter).

    Mixture of experts (``num_experts > 0``): an MoE layer's MLP is ``num_experts`` gated-SiLU experts of width
    ``moe_ffn_hidden_size``, of which a router picks ``moe_topk`` per token: a softmax (``moe_renormalize``
    rescales the picked weights to sum to one: Mixtral, Qwen ``norm_topk_prob``) or DeepSeek's sigmoid, with
    group-limited selection (``moe_num_groups``, ``moe_group_topk``), the aux-loss-free correction bias
    (``moe_expert_bias``) and ``moe_routed_scaling_factor``. ``shared_expert_ffn_hidden_size`` > 0 adds a shared
    expert every token passes through (Qwen2-MoE scales it by a sigmoid gate: ``shared_expert_gate``). The first
    ``first_k_dense`` layers, and with ``moe_layer_freq`` > 1 every layer not a multiple of it, are dense MLPs of
    width ``ffn_hidden_size`` (DeepSeek's ``first_k_dense_replace`` / ``moe_layer_freq``).

    Multi-head latent attention (``kv_lora_rank > 0``, DeepSeek-V2/V3): queries through a rank-``q_lora_rank``
    bottleneck (or a plain projection when it is None), keys and values through a shared rank-``kv_lora_rank``
    latent plus one ``qk_rope_head_dim`` rotary key; a head's query/key dim is ``qk_nope_head_dim +
    qk_rope_head_dim`` (``head_dim``), its value dim ``v_head_dim``."""

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
    shared_expert_gate: bool = False
    router_aux_loss_coef: float = 0.0
    moe_score_function: str = "softmax"
    moe_num_groups: int = 1
    moe_group_topk: int = 1
    moe_routed_scaling_factor: float = 1.0
    moe_expert_bias: bool = False
    moe_seq_aux_loss: bool = False
    first_k_dense: int = 0
    moe_layer_freq: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_mtp_layers: int = 0  # multi-token-prediction layers of the checkpoint (not built: see docs/moe.md)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def q_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has routed experts (DeepSeek's rule, which vLLM follows)."""
        return self.is_moe and layer >= self.first_k_dense and layer % self.moe_layer_freq == 0

    @functools.cached_property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def all_layers_moe(self) -> bool:
        return self.is_moe and len(self.moe_layers) == self.num_layers

    def padded_vocab_size(self, tp: int, divisible_by: int = 128) -> int:
        """Megatron pads the vocabulary so each TP rank holds an equal slice that is a multiple of `divisible_by`."""
        multiple = divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    # ---- parameter counts (HF's modules, which Megatron's equal) ---------------------------------------------
    def num_parameters(self) -> int:
        """Parameter count of the HF model (embeddings counted once when tied; the routers' correction biases are
        buffers, not parameters)."""
        return self._count(active=False)

    def num_active_parameters(self) -> int:
        """Parameters one token passes through: the routed experts count ``moe_topk`` times, not
        ``num_experts`` (equals :meth:`num_parameters` for a dense model)."""
        return self._count(active=True)

    def attention_weights(self) -> dict[str, int]:
        """One layer's attention weights (without the input norm) by how the TP ranks hold them: ``sharded`` (split
        by the training and the generation TP alike) and ``replicated`` (q/k norms; MLA's latent down projections
        and norms, whole on every training and vLLM rank)."""
        h = self.hidden_size
        if not self.is_mla:
            d = self.head_dim
            sharded = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
            if self.qkv_bias:
                sharded += self.num_heads * d + 2 * self.num_kv_heads * d
            return {"sharded": sharded, "replicated": 2 * d if self.qk_norm else 0}
        a, qd, r, q = self.num_heads, self.head_dim, self.kv_lora_rank, self.q_lora_rank
        sharded = (q or h) * a * qd + r * a * (self.qk_nope_head_dim + self.v_head_dim) + a * self.v_head_dim * h
        down = (h * q + q if q else 0) + h * (r + self.qk_rope_head_dim) + r
        return {"sharded": sharded, "replicated": down}

    def attention_parameters(self) -> int:
        """One layer's attention block, with its input norm."""
        return sum(self.attention_weights().values()) + self.hidden_size

    def expert_parameters(self) -> int:
        """One routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.moe_ffn_hidden_size

    def mlp_weights(self, layer: int, *, active: bool = False) -> dict[str, int]:
        """One layer's MLP weights (without its norm) by how they are held: ``sharded`` over TP (a dense MLP, the
        shared expert), ``replicated`` (router, shared-expert gate) and ``experts`` (routed; ``active``: the k a
        token visits)."""
        h = self.hidden_size
        if not self.is_moe_layer(layer):
            return {"sharded": 3 * h * self.ffn_hidden_size, "replicated": 0, "experts": 0}
        shared = 3 * h * self.shared_expert_ffn_hidden_size
        replicated = self.num_experts * h + (h if self.shared_expert_gate else 0)
        experts = (self.moe_topk if active else self.num_experts) * self.expert_parameters()
        return {"sharded": shared, "replicated": replicated, "experts": experts}

    def mlp_parameters(self, layer: int | None = None, *, active: bool = False) -> int:
        """One layer's MLP block with its input norm (``layer``: default the first MoE layer, or layer 0)."""
        if layer is None:
            layer = self.moe_layers[0] if self.is_moe else 0
        return sum(self.mlp_weights(layer, active=active).values()) + self.hidden_size

    def layer_parameters(self, layer: int, *, active: bool = False) -> int:
        return self.attention_parameters() + self.mlp_parameters(layer, active=active)

    def replicated_layer_parameters(self, layer: int | None = None) -> int:
        """One layer's tensors every training and generation TP rank holds whole: the norms (MLA's latent norms
        too), and for MoE layers the router (E·h) and the shared expert's gate."""
        layer = (self.moe_layers[0] if self.is_moe else 0) if layer is None else layer
        return 2 * self.hidden_size + self.attention_weights()["replicated"] + self.mlp_weights(layer)["replicated"]

    def _count(self, *, active: bool) -> int:
        h = self.hidden_size
        layers = sum(self.layer_parameters(i, active=active) for i in range(self.num_layers))
        return layers + self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h

    # ---- the 3D-HybridEngine's bytes ----------------------------------------------------------------------------
    def hybrid_sync_bytes(self, pool, rank: int, element_size: int) -> float:
        """Bytes ``rank`` of a training pool receives at the 3D-HybridEngine's train → generate switch, per kind of
        tensor (exact when Megatron's and vLLM's vocabulary paddings align; docs/moe.md):

        * TP-sharded tensors: generation block j of every one (S/tg) less the rank's own shard of its own stage
          (S_stage/t) — HybridFlow Table 2, (t·p − tg)/(tg·t·p)·M, when the stages are alike;
        * replicated tensors of the other stages (routers' correction biases in fp32: vLLM keeps them so);
        * routed experts: :func:`expert_sync_bytes_per_rank`."""
        stage = pool.coords(rank)["pp"]
        sharded, sharded_own, replicated_other, bias_other, moe_own = _stage_sums(self, pool.pp, pool.vpp, stage)
        out = (sharded / pool.gen_tp - sharded_own / pool.tp + replicated_other) * element_size + 4 * bias_other
        if self.is_moe:
            out += expert_sync_bytes_per_rank(
                pool, rank, num_layers=len(self.moe_layers), own_layers=moe_own, num_experts=self.num_experts,
                width=self.moe_ffn_hidden_size, row_bytes=self.hidden_size * element_size)
        return out

    def generation_weight_bytes(self, gen_tp: int, gen_ep: int, element_size: int) -> float:
        """Bytes of vLLM's weights on one generation rank: the routed experts over gen_ep ranks (or sliced over
        gen_tp when gen_ep = 1), MLA's latent down projections whole, the rest over gen_tp (the few replicated norms
        and routers counted as split: the paper's M/tg)."""
        experts = sum(self.mlp_weights(i)["experts"] for i in range(self.num_layers))
        gathered = self.num_layers * self.attention_weights()["replicated"] if self.is_mla else 0
        rest = self.num_parameters() - experts - gathered
        # MLA: vLLM also keeps W_UK_T and W_UV, split out of kv_b_proj after loading (another kv_b_proj per rank)
        derived = self.num_layers * self.kv_lora_rank * self.num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return ((rest + derived) / gen_tp + experts / (gen_ep if gen_ep > 1 else gen_tp) + gathered) * element_size


@functools.lru_cache(maxsize=4096)
def _stage_sums(arch: ModelArch, pp: int, vpp: int | None, stage: int) -> tuple[int, int, int, int, int]:
    """Element counts behind :meth:`ModelArch.hybrid_sync_bytes` for pipeline stage ``stage``: TP-sharded elements
    of the whole model and of the stage, replicated elements and fp32 correction-bias entries of the other stages,
    and the stage's MoE layers."""
    own = set(stage_layer_indices(arch.num_layers, pp, vpp, stage))
    h, last = arch.hidden_size, pp - 1
    attn = arch.attention_weights()
    vocab = arch.vocab_size * h
    sharded = sharded_own = replicated_other = bias_other = moe_own = 0
    for i in range(arch.num_layers):
        s = attn["sharded"] + arch.mlp_weights(i)["sharded"]
        sharded += s
        if i in own:
            sharded_own += s
            moe_own += arch.is_moe_layer(i)
        else:
            replicated_other += arch.replicated_layer_parameters(i)
            bias_other += arch.num_experts if arch.moe_expert_bias and arch.is_moe_layer(i) else 0
    sharded += vocab * (1 if arch.tie_word_embeddings else 2)
    sharded_own += vocab * ((stage == 0) + (stage == last and not arch.tie_word_embeddings))
    replicated_other += h if stage != last else 0  # the final norm
    return sharded, sharded_own, replicated_other, bias_other, moe_own
