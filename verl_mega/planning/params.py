"""Parameter counts per rank, as Megatron-Core and vLLM lay the model out: one pipeline stage's training shard
(:func:`stage_params`), one transformer layer on a TP rank, and vLLM's model on one GPU of a generation TP group.
The memory and time models (:mod:`verl_mega.planning.memory`, :mod:`verl_mega.planning.timing`) and the dry run
build on them. Symbols as in docs/planning.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_mega.models.hf_config import ModelArch
from verl_mega.parallel.placement import Pool

VLLM_VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of 64


class PlanningError(ValueError):
    """An impossible planning request; the message names the flag or field and the fix."""


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of pipeline stage `stage` (all its virtual chunks)."""

    layers: int  # transformer layers on this rank
    per_layer: int  # of which expert_per_layer are routed-expert weights
    embedding: int
    output: int
    final_norm: int
    largest: int  # the biggest single parameter tensor
    expert_per_layer: int = 0

    @property
    def total(self) -> int:
        return self.layers * self.per_layer + self.embedding + self.output + self.final_norm

    @property
    def experts(self) -> int:
        """Routed-expert parameters on this rank (reduced and optimizer-sharded over D_e, not D)."""
        return self.layers * self.expert_per_layer


def expert_layer_params(arch: ModelArch, *, ep: int = 1, etp: int = 1) -> int:
    """Routed-expert parameters of one layer on one rank: E/ep experts of 3·h·f_e/etp."""
    return arch.num_experts // ep * arch.expert_parameters() // etp if arch.is_moe else 0


def layer_params(arch: ModelArch, tp: int, *, ep: int = 1, etp: int | None = None) -> int:
    """Parameters of one transformer layer on one TP rank (norm weights replicated). MoE layers: the router
    (E·h) and the shared expert's gate (h) are replicated, the shared expert is split over tp, the routed experts
    over ep and etp (default: tp, as vLLM splits them)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    qkv_out = (arch.num_heads + 2 * arch.num_kv_heads) * d
    n = h * qkv_out // tp + arch.num_heads * d * h // tp + 2 * h
    if arch.is_moe:
        fs = arch.shared_expert_ffn_hidden_size
        n += arch.num_experts * h + expert_layer_params(arch, ep=ep, etp=etp or tp) + (3 * h * fs // tp + h
                                                                                          if fs else 0)
    else:
        n += 3 * h * f // tp
    if arch.qkv_bias:
        n += qkv_out // tp
    if arch.qk_norm:
        n += 2 * d
    return n


def stage_params(arch: ModelArch, layout: Pool, stage: int, *, value_head: bool = False,
                 divisible_by: int = 128) -> StageParams:
    """Parameters of a rank of pipeline stage `stage` as Megatron-Core builds them (layers split evenly)."""
    t, p = layout.tp, layout.pp
    if not 0 <= stage < p:
        raise PlanningError(f"stage {stage} is outside pp={p}")
    if arch.num_layers % layout.chunks:
        raise PlanningError(f"pp·vpp={layout.chunks} must divide num_layers={arch.num_layers}")
    vocab_rows = arch.padded_vocab_size(t, divisible_by) * arch.hidden_size // t
    first, last = stage == 0, stage == p - 1
    embedding = vocab_rows if first else 0
    if value_head:
        output = arch.hidden_size if last else 0
    else:
        # Tied embeddings: mcore keeps a synchronised copy of the embedding as the last stage's output layer.
        output = vocab_rows if last and (not arch.tie_word_embeddings or p > 1) else 0
    ep, etp = layout.ep, layout.etp
    per_layer = layer_params(arch, t, ep=ep, etp=etp)
    h, f = arch.hidden_size, arch.ffn_hidden_size
    qkv = h * (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim // t
    mlp = (arch.num_experts // ep * 2 * arch.moe_ffn_hidden_size * h // etp) if arch.is_moe else 2 * f * h // t
    largest = max(mlp, qkv, embedding, output)
    return StageParams(layers=arch.num_layers // p, per_layer=per_layer, embedding=embedding, output=output,
                       final_norm=arch.hidden_size if last else 0, largest=largest,
                       expert_per_layer=expert_layer_params(arch, ep=ep, etp=etp))


def generation_params(arch: ModelArch, tg: int) -> int:
    """Parameters of the vLLM model on one GPU of a generation TP group of size tg."""
    h = arch.hidden_size
    vocab_rows = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING * h // tg
    heads = 1 if arch.tie_word_embeddings else 2
    return arch.num_layers * layer_params(arch, tg) + heads * vocab_rows + h
