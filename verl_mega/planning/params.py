"""Parameter counts per rank, as Megatron-Core and vLLM lay the model out: one pipeline stage's training shard
(:func:`stage_params`), one transformer layer on a TP rank, and vLLM's model on one GPU of a generation TP group.
The memory and time models (:mod:`verl_mega.planning.memory`, :mod:`verl_mega.planning.timing`) and the dry run
build on them. Symbols as in docs/planning.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from verl_mega.models.arch import ModelArch, stage_layer_indices
from verl_mega.parallel.placement import Pool

VLLM_VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of 64


class PlanningError(ValueError):
    """An impossible planning request; the message names the flag or field and the fix."""


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of pipeline stage `stage` (all its virtual chunks)."""

    layers: int  # transformer layers on this rank
    layer_params: int  # of all of them, of which ``experts`` are routed-expert weights
    embedding: int
    output: int
    final_norm: int
    largest: int  # the biggest single parameter tensor
    experts: int = 0  # routed-expert parameters (reduced and optimizer-sharded over D_e, not D)
    adapters: int | None = None  # LoRA adapter parameters (the rest frozen); None: every parameter trains

    @property
    def total(self) -> int:
        return self.layer_params + self.embedding + self.output + self.final_norm


def expert_layer_params(arch: ModelArch, *, ep: int = 1, etp: int = 1, layer: int | None = None) -> int:
    """Routed-expert parameters of one MoE layer on one rank: E/ep experts of 3·h·f_e/etp (0 for a dense layer)."""
    if not arch.is_moe or (layer is not None and not arch.is_moe_layer(layer)):
        return 0
    return arch.num_experts // ep * arch.expert_parameters() // etp


def layer_params(arch: ModelArch, tp: int, *, ep: int = 1, etp: int | None = None, layer: int | None = None) -> int:
    """Parameters of one transformer layer on one TP rank (``layer``: default the first MoE layer, or layer 0): the
    TP-split tensors over tp, the norms (and MLA's latent down projections and norms) whole. MoE layers: the router
    (E·h) and the shared expert's gate (h) are replicated, the shared expert is split over tp, the routed experts
    over ep and etp (default: tp, as vLLM splits them)."""
    if layer is None:
        layer = arch.moe_layers[0] if arch.is_moe else 0
    return dense_layer_params(arch, tp, layer) + expert_layer_params(arch, ep=ep, etp=etp or tp, layer=layer)


def dense_layer_params(arch: ModelArch, tp: int, layer: int) -> int:
    """One layer on one TP rank without its routed experts."""
    attn, mlp = arch.attention_weights(), arch.mlp_weights(layer)
    return (attn["sharded"] + mlp["sharded"]) // tp + attn["replicated"] + mlp["replicated"] + 2 * arch.hidden_size


def stage_params(arch: ModelArch, layout: Pool, stage: int, *, value_head: bool = False,
                 divisible_by: int = 128) -> StageParams:
    """Parameters of a rank of pipeline stage `stage` as Megatron-Core builds them (layers split evenly; a stage's
    own layers, dense or MoE)."""
    if not 0 <= stage < layout.pp:
        raise PlanningError(f"stage {stage} is outside pp={layout.pp}")
    if arch.num_layers % layout.chunks:
        raise PlanningError(f"pp·vpp={layout.chunks} must divide num_layers={arch.num_layers}")
    return _stage_params(arch, layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp, stage, value_head,
                         divisible_by)


@functools.lru_cache(maxsize=65536)
def _stage_params(arch: ModelArch, t: int, p: int, vpp: int | None, ep: int, etp: int, stage: int, value_head: bool,
                  divisible_by: int) -> StageParams:
    vocab_rows = arch.padded_vocab_size(t, divisible_by) * arch.hidden_size // t
    first, last = stage == 0, stage == p - 1
    embedding = vocab_rows if first else 0
    if value_head:
        output = arch.hidden_size if last else 0
    else:
        # Tied embeddings: mcore keeps a synchronised copy of the embedding as the last stage's output layer.
        output = vocab_rows if last and (not arch.tie_word_embeddings or p > 1) else 0
    layers = stage_layer_indices(arch.num_layers, p, vpp, stage)
    h, f = arch.hidden_size, arch.ffn_hidden_size
    qkv = h * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim // t if not arch.is_mla else \
        (arch.q_lora_rank or h) * arch.num_heads * arch.head_dim // t
    mlp = max((arch.num_experts // ep * 2 * arch.moe_ffn_hidden_size * h // etp) if arch.is_moe_layer(i) else
              2 * f * h // t for i in layers)
    largest = max(mlp, qkv, embedding, output)
    return StageParams(layers=len(layers), layer_params=sum(layer_params(arch, t, ep=ep, etp=etp, layer=i)
                                                           for i in layers),
                       embedding=embedding, output=output, final_norm=arch.hidden_size if last else 0,
                       largest=largest, experts=sum(expert_layer_params(arch, ep=ep, etp=etp, layer=i)
                                                    for i in layers))


def generation_params(arch: ModelArch, tg: int, gen_ep: int = 1) -> int:
    """Parameters of the vLLM model on one GPU of a generation TP group of size tg (routed experts over gen_ep
    ranks with expert-parallel generation; MLA's absorbed W_UK_T / W_UV, which vLLM derives from kv_b_proj,
    counted too)."""
    h = arch.hidden_size
    vocab_rows = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING * h // tg
    heads = 1 if arch.tie_word_embeddings else 2
    layers = sum(generation_layer_params(arch, tg, gen_ep, i) for i in range(arch.num_layers))
    derived = arch.num_layers * arch.kv_lora_rank * arch.num_heads * (arch.qk_nope_head_dim + arch.v_head_dim) // tg
    return layers + derived + heads * vocab_rows + h


def generation_layer_params(arch: ModelArch, tg: int, gen_ep: int, layer: int) -> int:
    """One layer of the vLLM model on one generation GPU: its TP share, and the routed experts whole over gen_ep
    ranks (expert-parallel generation) or sliced over tg."""
    experts = expert_layer_params(arch, ep=gen_ep, etp=1, layer=layer) if gen_ep > 1 else \
        expert_layer_params(arch, ep=1, etp=tg, layer=layer)
    return dense_layer_params(arch, tg, layer) + experts
