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
  from which training shard, so only the rows vLLM keeps are moved;
* routed experts: Megatron's (ep, etp) shards → vLLM's fused ``w13`` [E, 2f/tg, h] (gate rows then up rows of
  width block j) and ``w2`` [E, h, f/tg] on generation rank j, or with expert-parallel generation the whole
  experts of the rank's EP slice (w13 [E/gen_ep, 2f, h]); :func:`expert_plan` says which expert rows each rank needs
  from which rank of its own expert-data-parallel replica, :func:`expert_source_views` / :func:`expert_dest_views`
  are the views to send from and write into;
* multi-head latent attention: the up projections (heads) as column blocks; the latent down projections whole,
  into vLLM's fused ``fused_qkv_a_proj`` ([q_a; kv_a] rows, :func:`vllm_slot`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verl_mega.models.hf_config import ModelArch
from verl_mega.models.weights import ParamRule

# vLLM's fused modules, named after the first HF projection they absorb.
_FUSED = {"q_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
# vLLM ≥ 0.30 keeps a MoE layer's expert weights in a ``routed_experts`` submodule of its ``experts`` module.
_ROUTED = ".experts.routed_experts."


def vllm_name(rule: ParamRule) -> str:
    """vLLM parameter name for an mcore parameter mapped to HF tensors by ``rule`` (Llama/Qwen/Mixtral/DeepSeek
    naming; routed experts by their canonical name ``….experts.w13_weight`` / ``w2_weight``, see
    :func:`canonical_name`)."""
    name = rule.hf_names[0]
    if rule.is_expert:
        block = name[: name.index(".experts.")]
        return f"{block}.experts.{'w13' if rule.kind == 'experts_fc1' else 'w2'}_weight"
    if rule.kind in ("qkv", "gate_up"):
        for hf_mod, fused in _FUSED.items():
            if f".{hf_mod}." in name:
                return name.replace(f".{hf_mod}.", f".{fused}.")
    return name


def vllm_slot(rule: ParamRule, arch: ModelArch) -> tuple[str, int, int | None]:
    """(vLLM parameter, first row, its rows — None: the whole parameter) that ``rule``'s block is written to. With a
    query bottleneck vLLM fuses MLA's two latent down projections into ``fused_qkv_a_proj`` = [q_a; kv_a]."""
    name = vllm_name(rule)
    if arch.is_mla and arch.q_lora_rank:
        rows = arch.q_lora_rank + arch.kv_lora_rank + arch.qk_rope_head_dim
        for part, first in ((".q_a_proj.", 0), (".kv_a_proj_with_mqa.", arch.q_lora_rank)):
            if part in name:
                return name.replace(part, ".fused_qkv_a_proj."), first, rows
    return name, 0, None


def canonical_name(vllm_param: str) -> str:
    """A vLLM parameter name with the ``routed_experts`` level some vLLM versions add removed, and the
    ``base_layer`` level of a linear that vLLM's LoRA wraps."""
    return vllm_param.replace(_ROUTED, ".experts.").replace(LORA_BASE, ".")


LORA_BASE = ".base_layer."  # vLLM's LoRA wraps each linear; its weight moves one level down


def routed_name(name: str) -> str:
    """The other spelling of a canonical expert name (with the ``routed_experts`` level)."""
    return name.replace(".experts.", _ROUTED) if ".experts.w" in name else name


def expert_block_shape(rule: ParamRule, arch: ModelArch, experts: int, rows: int) -> tuple[int, ...]:
    """vLLM's expert tensor on a generation rank serving ``experts`` experts, ``rows`` of each one's width:
    w13 [E, 2f/tg, h] and w2 [E, h, f/tg] when gen_ep = 1, w13 [E/gen_ep, 2f, h] and w2 [E/gen_ep, h, f] with
    expert-parallel generation."""
    h = arch.hidden_size
    return (experts, 2 * rows, h) if rule.kind == "experts_fc1" else (experts, h, rows)


def block_shape(rule: ParamRule, shard_shape: Sequence[int], m: int) -> tuple[int, ...]:
    """Shape of generation block j built from m training shards of ``shard_shape`` (non-vocab kinds)."""
    shape = list(shard_shape)
    if rule.kind in ("qkv", "gate_up", "column"):
        shape[0] *= m
    elif rule.kind == "row":
        shape[1] *= m
    elif rule.kind != "replicated":
        raise ValueError(f"block_shape: kind {rule.kind!r} is handled by the vocab path")
    return tuple(shape)


def block_copies(rule: ParamRule, dst: torch.Tensor, shards: Sequence[torch.Tensor],
                 arch: ModelArch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (destination view, source view) pairs that write generation block j, made of ``shards`` (training TP
    order), into ``dst`` in vLLM's layout. Views only: nothing is copied here. An FP8 destination
    (:class:`~verl_mega.hybrid.fp8.Fp8Rows`) gives the same slices as destinations that quantize as they copy."""
    if hasattr(dst, "quantized_copies"):
        return dst.quantized_copies(rule, shards, arch)
    m = len(shards)
    kind = rule.kind
    if kind == "replicated":
        return [(dst, shards[0])]
    if kind == "row":
        cols = shards[0].shape[1]
        return [(dst[:, i * cols:(i + 1) * cols], shard) for i, shard in enumerate(shards)]
    if kind == "column":
        rows = shards[0].shape[0]
        return [(dst[i * rows:(i + 1) * rows], shard) for i, shard in enumerate(shards)]
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
    """vLLM's own vocab split (``VocabParallelEmbedding``: pad to ``padding``, equal parts, no added tokens).
    Written out rather than asked of vLLM, whose import costs a training rank that runs no engine seconds; the
    unit test holds it to vLLM's ``_get_indices``, and a colocated sync checks it against the engine's modules."""
    padded = -(-vocab_size // padding) * padding
    per = padded // gen_tp
    return [VocabRows(min(j * per, vocab_size), min((j + 1) * per, vocab_size), per) for j in range(gen_tp)]


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


@dataclass(frozen=True)
class ExpertPiece:
    """Rows ``[lo, hi)`` of expert ``expert``'s FFN width (its gate, up and down projections) go from pool rank
    ``src`` to pool rank ``dst`` (src == dst: a local copy)."""

    src: int
    dst: int
    expert: int
    lo: int
    hi: int


def expert_plan(pool, stage: int, num_experts: int, width: int) -> list[ExpertPiece]:
    """Every routed-expert piece moved inside pipeline stage ``stage`` of a training pool, in one canonical order.

    A generation rank needs its slice of every MoE layer (:meth:`~verl_mega.parallel.placement.Pool.expert_slice`):
    rows ``[j·f/tg, (j+1)·f/tg)`` of every expert, or with expert-parallel generation every row of the experts of its
    EP rank. Megatron's expert grid (etp, ep, edp) lays one full copy of the experts over each expert-data-parallel
    replica (etp·ep ranks); a rank takes each piece from the rank of its own replica that holds it (expert ``e``
    lives on EP rank e·ep/E, rows on the expert-TP ranks whose width slices overlap), so traffic stays inside that
    replica, every needed row comes exactly once and no rank receives experts it does not serve. Pure arithmetic
    over the pool's coordinates."""
    local, fr = num_experts // pool.ep, width // pool.etp
    ranks = [r for r in pool.ranks if pool.coords(r)["pp"] == stage]
    holder = {}
    for r in ranks:
        c = pool.coords(r)
        holder[c["etp"], c["ep"], c["edp"]] = r
    pieces = []
    for dst in ranks:
        c = pool.coords(dst)
        e0, e1, r0, r1 = pool.expert_slice(dst, num_experts, width)
        for e in range(e0, e1):
            for r in range(pool.etp):
                lo, hi = max(r0, r * fr), min(r1, (r + 1) * fr)
                if lo < hi:
                    pieces.append(ExpertPiece(holder[r, e // local, c["edp"]], dst, e, lo, hi))
    return pieces


def expert_source_views(piece: ExpertPiece, weight1: torch.Tensor, weight2: torch.Tensor, *, ep_rank: int,
                        etp_rank: int, num_experts: int, ep: int, etp: int, width: int) -> list[torch.Tensor]:
    """The piece's gate, up and down rows as [n, h] views of the holder's GroupedExperts weights (weight1 is
    [E/ep, h, 2f/etp] in memory, per expert [gate_r | up_r] columns; weight2 is [E/ep, f/etp, h])."""
    local, fr, h = num_experts // ep, width // etp, weight1.shape[0]
    le = piece.expert - ep_rank * local
    a, b = piece.lo - etp_rank * fr, piece.hi - etp_rank * fr
    w1 = weight1.view(local, h, 2 * fr)[le]
    return [w1[:, a:b].t(), w1[:, fr + a:fr + b].t(), weight2.view(local, fr, h)[le, a:b]]


def expert_dest_views(piece: ExpertPiece, w13: torch.Tensor, w2: torch.Tensor, *, first_expert: int, first_row: int,
                      rows: int) -> list[torch.Tensor]:
    """Where the piece's gate, up and down rows land in vLLM's w13 [E_g, 2·rows, h] and w2 [E_g, h, rows] of a
    generation rank whose slice starts at expert ``first_expert`` and row ``first_row`` (down rows as a transposed
    [n, h] view of w2's columns)."""
    e, a, b = piece.expert - first_expert, piece.lo - first_row, piece.hi - first_row
    return [w13[e, a:b], w13[e, rows + a:rows + b], w2[e][:, a:b].t()]
