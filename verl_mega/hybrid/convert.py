"""Megatron-Core TP shards → the exact tensors vLLM holds on one generation TP rank.

Pure tensor functions. The input is the list of m consecutive training TP shards that make up generation block j
(a rank's own shard plus what its micro-DP all-gather brought); the output is written straight into the
destination tensor (vLLM's own parameter on GPU), through strided views, so no full tensor is ever formed:

* ``linear_qkv`` (rows interleaved per query group: q of the group's heads, then k, then v) → vLLM's fused
  ``qkv_proj`` block ``[q_j; k_j; v_j]``; the same for its bias;
* ``linear_fc1`` (``[gate_i; up_i]`` per shard) → ``gate_up_proj`` block ``[gate_j; up_j]``;
* ``linear_proj`` / ``linear_fc2`` (row-parallel: split columns) → ``o_proj`` / ``down_proj`` column block;
* norms (replicated) → copied;
* vocab rows (embedding / LM head): vLLM pads the vocabulary its own way (multiple of 64, split by tg) while
  Megatron pads to ``make_vocab_size_divisible_by·t``; :func:`vocab_row_plan` says which rows each rank needs
  from which training shard, so only the rows vLLM keeps are moved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verl_mega.models.hf_config import ModelArch
from verl_mega.models.weights import ParamRule

# vLLM's fused modules, named after the first HF projection they absorb.
_FUSED = {"q_proj": "qkv_proj", "gate_proj": "gate_up_proj"}


def vllm_name(rule: ParamRule) -> str:
    """vLLM parameter name for an mcore parameter mapped to HF tensors by ``rule`` (Llama/Qwen naming)."""
    name = rule.hf_names[0]
    for hf_mod, fused in _FUSED.items():
        if f".{hf_mod}." in name:
            return name.replace(f".{hf_mod}.", f".{fused}.")
    return name


def block_shape(rule: ParamRule, shard_shape: Sequence[int], m: int) -> tuple[int, ...]:
    """Shape of generation block j built from m training shards of ``shard_shape`` (non-vocab kinds)."""
    shape = list(shard_shape)
    if rule.kind in ("qkv", "gate_up"):
        shape[0] *= m
    elif rule.kind == "row":
        shape[1] *= m
    elif rule.kind != "replicated":
        raise ValueError(f"block_shape: kind {rule.kind!r} is handled by the vocab path")
    return tuple(shape)


def block_copies(rule: ParamRule, dst: torch.Tensor, shards: Sequence[torch.Tensor],
                 arch: ModelArch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (destination view, source view) pairs that write generation block j, made of ``shards`` (training TP
    order), into ``dst`` in vLLM's layout. Views only: nothing is copied here."""
    m = len(shards)
    kind = rule.kind
    if kind == "replicated":
        return [(dst, shards[0])]
    if kind == "row":
        cols = shards[0].shape[1]
        return [(dst[:, i * cols:(i + 1) * cols], shard) for i, shard in enumerate(shards)]
    if kind == "gate_up":
        half = shards[0].shape[0] // 2
        gate, up = dst[: m * half], dst[m * half:]
        pairs = [(gate[i * half:(i + 1) * half], shard[:half]) for i, shard in enumerate(shards)]
        return pairs + [(up[i * half:(i + 1) * half], shard[half:]) for i, shard in enumerate(shards)]
    if kind == "qkv":
        d, qpg = arch.head_dim, arch.q_per_group
        tail = tuple(shards[0].shape[1:])
        groups = shards[0].shape[0] // ((qpg + 2) * d)  # query groups per training shard
        total = groups * m
        q_rows, kv_rows = total * qpg * d, total * d
        q = dst[:q_rows].view(total, qpg, d, *tail)
        k = dst[q_rows:q_rows + kv_rows].view(total, d, *tail)
        v = dst[q_rows + kv_rows:].view(total, d, *tail)
        pairs = []
        for i, shard in enumerate(shards):
            packed = shard.view(groups, qpg + 2, d, *tail)
            sl = slice(i * groups, (i + 1) * groups)
            pairs += [(q[sl], packed[:, :qpg]), (k[sl], packed[:, qpg]), (v[sl], packed[:, qpg + 1])]
        return pairs
    raise ValueError(f"block_copies: kind {kind!r} is handled by the vocab path")


@torch.no_grad()
def write_block(rule: ParamRule, dst: torch.Tensor, shards: Sequence[torch.Tensor], arch: ModelArch) -> None:
    """Write generation block j, made of ``shards`` (training TP order), into ``dst`` in vLLM's layout."""
    for to, src in block_copies(rule, dst, shards, arch):
        to.copy_(src)


@dataclass(frozen=True)
class VocabRows:
    """Rows of the original vocabulary one generation rank keeps, and the size of its padded partition."""

    start: int  # first original-vocab row
    end: int  # one past the last original-vocab row (rows past it in the partition are zero padding)
    partition_rows: int


def vllm_vocab_rows(vocab_size: int, gen_tp: int, padding: int = 64) -> list[VocabRows]:
    """vLLM's own vocab split (``VocabParallelEmbedding``: pad to ``padding``, equal parts, no added tokens)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    padded = pad_vocab_size(vocab_size, padding)
    rows = []
    for j in range(gen_tp):
        idx = VocabParallelEmbedding._get_indices(padded, padded, vocab_size, vocab_size, j, gen_tp)
        rows.append(VocabRows(idx.org_vocab_start_index, idx.org_vocab_end_index, padded // gen_tp))
    return rows


@dataclass(frozen=True)
class RowTransfer:
    """Rows ``[start, end)`` of the vocabulary go from training TP rank ``src`` to training TP rank ``dst``."""

    src: int
    dst: int
    start: int
    end: int


def vocab_row_plan(padded_vocab: int, t: int, micro_dp: int, gen_rows: Sequence[VocabRows]) -> list[RowTransfer]:
    """Every row transfer inside one training TP group (self-transfers are local copies).

    Training TP rank i owns rows ``[i·V/t, (i+1)·V/t)`` of Megatron's padded vocab ``V``; it serves generation
    block ``i // micro_dp`` and needs that block's original-vocab rows. Each needed row comes exactly once from
    its owner.
    """
    per = padded_vocab // t
    plan = []
    for dst in range(t):
        need = gen_rows[dst // micro_dp]
        for src in range(t):
            lo, hi = max(need.start, src * per), min(need.end, (src + 1) * per)
            if lo < hi:
                plan.append(RowTransfer(src, dst, lo, hi))
    return plan
