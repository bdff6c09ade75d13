"""HF ⇄ Megatron-Core weight mapping for Llama / Mistral / Qwen2 / Qwen3.

Megatron packs tensors differently from HF:
* ``linear_qkv`` holds, per query group g, ``[q rows of the group's heads; k rows; v rows]`` (interleaved per
  group), and TP rank r owns a contiguous run of groups;
* ``linear_fc1`` holds ``[gate_r; up_r]`` on TP rank r (gate and up slices of that rank stacked);
* embedding / LM head rows are padded to a multiple of ``make_vocab_size_divisible_by · tp`` and split by rows.

Everything here works per tensor and per TP rank, so loading and exporting stream: a rank reads only its own
rows/columns of each HF tensor (memory-mapped safetensors), and export produces one HF tensor at a time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from verl_mega.models.hf_config import ModelArch

# mcore local-name suffix → (kind, HF name template)
_LAYER_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("model.layers.{i}.input_layernorm.weight",)),
    "self_attention.linear_qkv.layer_norm_weight": ("replicated", ("model.layers.{i}.input_layernorm.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("model.layers.{i}.post_attention_layernorm.weight",)),
    "mlp.linear_fc1.layer_norm_weight": ("replicated", ("model.layers.{i}.post_attention_layernorm.weight",)),
    "self_attention.q_layernorm.weight": ("replicated", ("model.layers.{i}.self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("model.layers.{i}.self_attn.k_norm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"),
    ),
    "self_attention.linear_qkv.bias": ("qkv", tuple(f"model.layers.{{i}}.self_attn.{p}_proj.bias" for p in "qkv")),
    "self_attention.linear_proj.weight": ("row", ("model.layers.{i}.self_attn.o_proj.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("model.layers.{i}.mlp.gate_proj.weight",
                                          "model.layers.{i}.mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("model.layers.{i}.mlp.down_proj.weight",)),
}
_TOP_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
}
_LAYER_RE = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ParamRule:
    """How one mcore parameter is made from HF tensors."""

    kind: str  # replicated | qkv | gate_up | row | vocab | value_head
    hf_names: tuple[str, ...]


def rule_for(mcore_name: str, arch: ModelArch, layer_offset: int = 0) -> ParamRule:
    """The rule for a local mcore parameter name on a stage whose first layer is global layer `layer_offset`."""
    name = mcore_name
    while name.startswith("module."):
        name = name[len("module."):]
    m = _LAYER_RE.match(name)
    if m:
        suffix = m.group(2)
        if suffix not in _LAYER_RULES:
            raise KeyError(f"no HF mapping for mcore parameter {mcore_name!r}")
        kind, templates = _LAYER_RULES[suffix]
        i = layer_offset + int(m.group(1))
        return ParamRule(kind, tuple(t.format(i=i) for t in templates))
    if name == "output_layer.weight" and arch.tie_word_embeddings:
        return ParamRule("vocab", ("model.embed_tokens.weight",))
    if name in _TOP_RULES:
        kind, names = _TOP_RULES[name]
        return ParamRule(kind, names)
    raise KeyError(f"no HF mapping for mcore parameter {mcore_name!r}")


Reader = Callable[..., torch.Tensor]  # reader(name, rows=(a, b) | None, cols=(a, b) | None)


def hf_to_mcore_shard(rule: ParamRule, read: Reader, arch: ModelArch, tp_rank: int, tp: int,
                      padded_vocab: int) -> torch.Tensor:
    """Build TP rank `tp_rank`'s shard of an mcore parameter, reading only the HF rows/columns it needs."""
    kind = rule.kind
    if kind == "replicated":
        return read(rule.hf_names[0])
    if kind == "row":  # RowParallelLinear: split the input (column) dim
        in_dim = arch.num_heads * arch.head_dim if "o_proj" in rule.hf_names[0] else arch.ffn_hidden_size
        cols = _split(in_dim, tp, tp_rank)
        return read(rule.hf_names[0], cols=cols)
    if kind == "gate_up":
        rows = _split(arch.ffn_hidden_size, tp, tp_rank)
        return torch.cat([read(rule.hf_names[0], rows=rows), read(rule.hf_names[1], rows=rows)], dim=0)
    if kind == "qkv":
        d, qpg = arch.head_dim, arch.q_per_group
        g0, g1 = _split(arch.num_kv_heads, tp, tp_rank)
        q = read(rule.hf_names[0], rows=(g0 * qpg * d, g1 * qpg * d))
        k = read(rule.hf_names[1], rows=(g0 * d, g1 * d))
        v = read(rule.hf_names[2], rows=(g0 * d, g1 * d))
        n = g1 - g0
        tail = q.shape[1:]
        packed = torch.cat(
            [q.reshape(n, qpg * d, *tail), k.reshape(n, d, *tail), v.reshape(n, d, *tail)], dim=1
        )
        return packed.reshape(n * (qpg + 2) * d, *tail)
    if kind == "vocab":
        r0, r1 = _split(padded_vocab, tp, tp_rank)
        real = read(rule.hf_names[0], rows=(min(r0, arch.vocab_size), min(r1, arch.vocab_size)))
        if real.shape[0] == r1 - r0:
            return real
        pad = torch.zeros(r1 - r0 - real.shape[0], *real.shape[1:], dtype=real.dtype)
        return torch.cat([real, pad], dim=0)
    raise ValueError(f"unknown mapping kind {kind!r}")


def mcore_shards_to_hf(rule: ParamRule, shards: list[torch.Tensor],
                       arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of :func:`hf_to_mcore_shard`: all TP shards of one mcore parameter → its HF tensor(s)."""
    kind = rule.kind
    if kind == "replicated":
        yield rule.hf_names[0], shards[0]
    elif kind == "row":
        yield rule.hf_names[0], torch.cat(shards, dim=1)
    elif kind == "gate_up":
        gates, ups = zip(*(s.chunk(2, dim=0) for s in shards))
        yield rule.hf_names[0], torch.cat(gates, dim=0)
        yield rule.hf_names[1], torch.cat(ups, dim=0)
    elif kind == "qkv":
        d, qpg = arch.head_dim, arch.q_per_group
        full = torch.cat(shards, dim=0)
        tail = full.shape[1:]
        grouped = full.reshape(arch.num_kv_heads, (qpg + 2) * d, *tail)
        q, k, v = grouped.split([qpg * d, d, d], dim=1)
        yield rule.hf_names[0], q.reshape(arch.num_heads * d, *tail)
        yield rule.hf_names[1], k.reshape(arch.num_kv_heads * d, *tail)
        yield rule.hf_names[2], v.reshape(arch.num_kv_heads * d, *tail)
    elif kind == "vocab":
        yield rule.hf_names[0], torch.cat(shards, dim=0)[: arch.vocab_size]
    else:
        raise ValueError(f"unknown mapping kind {kind!r}")


def _split(n: int, parts: int, idx: int) -> tuple[int, int]:
    size = n // parts
    return idx * size, (idx + 1) * size


def expected_hf_names(arch: ModelArch) -> set[str]:
    """Every tensor an HF checkpoint of `arch` must contain."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not arch.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if arch.qkv_bias:
            names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        if arch.qk_norm:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    return names
