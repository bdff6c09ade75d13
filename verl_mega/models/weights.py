"""HF ⇄ Megatron-Core weight mapping for Llama / Mistral / Qwen2 / Qwen3 and the MoE families (Qwen3-MoE, Mixtral,
Qwen2-MoE).

Megatron packs tensors differently from HF:
* ``linear_qkv`` holds, per query group g, ``[q rows of the group's heads; k rows; v rows]`` (interleaved per
  group), and TP rank r owns a contiguous run of groups;
* ``linear_fc1`` holds ``[gate_r; up_r]`` on TP rank r (gate and up slices of that rank stacked);
* embedding / LM head rows are padded to a multiple of ``make_vocab_size_divisible_by · tp`` and split by rows;
* routed experts (:class:`~verl_mega.models.spec.GroupedExperts`): EP rank p holds experts ``p·E/ep … (p+1)·E/ep``,
  stacked and transposed: ``weight1`` is [E/ep, h, 2f/etp] in memory (per expert ``[gate_r | up_r]`` columns of
  expert-TP rank r), ``weight2`` [E/ep, f/etp, h] (down-projection rows of rank r). Their HF names carry ``{e}``,
  the global expert index.

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
# Multi-head latent attention (DeepSeek-V3): the up projections (and a plain query projection) split their output
# rows (heads) over TP ("column"); the latent down projections and norms are whole on every rank (our spec).
_MLA_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_q_proj.weight": ("column", ("model.layers.{i}.self_attn.q_proj.weight",)),
    "self_attention.linear_q_down_proj.weight": ("replicated", ("model.layers.{i}.self_attn.q_a_proj.weight",)),
    "self_attention.linear_q_up_proj.weight": ("column", ("model.layers.{i}.self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": ("replicated",
                                                  ("model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",)),
    "self_attention.linear_kv_up_proj.weight": ("column", ("model.layers.{i}.self_attn.kv_b_proj.weight",)),
    "self_attention.q_layernorm.weight": ("replicated", ("model.layers.{i}.self_attn.q_a_layernorm.weight",)),
    "self_attention.kv_layernorm.weight": ("replicated", ("model.layers.{i}.self_attn.kv_a_layernorm.weight",)),
}
# MoE layers: the router, routed experts and Qwen2-MoE's gated shared expert or DeepSeek's shared experts.
_MOE_BLOCK = {"mixtral": "block_sparse_moe"}
_EXPERT_PROJ = {"mixtral": ("w1", "w3", "w2")}
_SHARED = {"deepseek_v3": "shared_experts"}
#: buffers that are model state (DeepSeek's routing correction bias): mapped, checkpointed and synced like weights
MAPPED_BUFFERS = ("mlp.router.expert_bias",)


def _moe_rules(model_type: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    block = f"model.layers.{{i}}.{_MOE_BLOCK.get(model_type, 'mlp')}"
    gate, up, down = _EXPERT_PROJ.get(model_type, ("gate_proj", "up_proj", "down_proj"))
    expert = f"{block}.experts.{{{{e}}}}"
    shared = f"{block}.{_SHARED.get(model_type, 'shared_expert')}"
    return {
        "mlp.router.weight": ("replicated", (f"{block}.gate.weight",)),
        "mlp.router.expert_bias": ("replicated", (f"{block}.gate.e_score_correction_bias",)),
        "mlp.experts.weight1": ("experts_fc1", (f"{expert}.{gate}.weight", f"{expert}.{up}.weight")),
        "mlp.experts.weight2": ("experts_fc2", (f"{expert}.{down}.weight",)),
        "mlp.shared_experts.linear_fc1.weight": ("gate_up", (f"{shared}.gate_proj.weight",
                                                             f"{shared}.up_proj.weight")),
        "mlp.shared_experts.linear_fc2.weight": ("row", (f"{shared}.down_proj.weight",)),
        "mlp.shared_experts.gate_weight": ("replicated", (f"{block}.shared_expert_gate.weight",)),
    }


def mapped_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's parameters and its mapped buffers (:data:`MAPPED_BUFFERS`), by local name: what the converters,
    checkpoints and the weight sync carry. LoRA adapters are not HF tensors of the model: they are left out
    (:mod:`verl_mega.models.lora` carries them)."""
    for name, param in module.named_parameters():
        if not name.rpartition(".")[2].startswith("lora_"):
            yield name, param
    for name, buf in module.named_buffers():
        if name.endswith(MAPPED_BUFFERS):
            yield name, buf


EXPERT_KINDS = ("experts_fc1", "experts_fc2")
_TOP_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
}
_LAYER_RE = re.compile(r"^(?:module\.)*decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ParamRule:
    """How one mcore parameter is made from HF tensors."""

    kind: str  # replicated | qkv | gate_up | row | column | vocab | experts_fc1 | experts_fc2
    hf_names: tuple[str, ...]  # expert rules: templates with {e}, the global expert index

    @property
    def is_expert(self) -> bool:
        return self.kind in EXPERT_KINDS

    def expert_names(self, e: int) -> tuple[str, ...]:
        return tuple(n.format(e=e) for n in self.hf_names)


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts a rank holds: EP rank ``ep_rank`` of ``ep`` and expert-TP rank ``etp_rank`` of ``etp``."""

    ep_rank: int = 0
    ep: int = 1
    etp_rank: int = 0
    etp: int = 1


def rule_for(mcore_name: str, arch: ModelArch, layer_offset: int = 0) -> ParamRule:
    """The rule for a local mcore parameter name on a stage whose first layer is global layer `layer_offset`."""
    name = mcore_name
    while name.startswith("module."):
        name = name[len("module."):]
    m = _LAYER_RE.match(name)
    if m:
        suffix = m.group(2)
        rules = {**_LAYER_RULES, **(_MLA_RULES if arch.is_mla else {}),
                 **(_moe_rules(arch.model_type) if arch.is_moe else {})}
        if suffix not in rules:
            raise KeyError(f"no HF mapping for mcore parameter {mcore_name!r}")
        kind, templates = rules[suffix]
        i = layer_offset + int(m.group(1))
        return ParamRule(kind, tuple(t.format(i=i) for t in templates))
    if name == "output_layer.weight" and arch.tie_word_embeddings:
        return ParamRule("vocab", ("model.embed_tokens.weight",))
    if name in _TOP_RULES:
        kind, names = _TOP_RULES[name]
        return ParamRule(kind, names)
    raise KeyError(f"no HF mapping for mcore parameter {mcore_name!r}")


Reader = Callable[..., torch.Tensor]  # reader(name, rows=(a, b) | None, cols=(a, b) | None)


def _ffn_width(rule: ParamRule, arch: ModelArch) -> int:
    """Inner width of an MLP projection: the shared expert's, the attention output's input, or the dense MLP's."""
    name = rule.hf_names[0]
    if ".shared_expert" in name:
        return arch.shared_expert_ffn_hidden_size
    if "o_proj" in name:
        return arch.num_heads * (arch.v_head_dim if arch.is_mla else arch.head_dim)
    return arch.ffn_hidden_size


def column_rows(rule: ParamRule, arch: ModelArch) -> int:
    """Output rows of an MLA up projection (``column`` kind): whole heads, which tensor parallelism splits evenly."""
    name, a = rule.hf_names[0], arch.num_heads
    rows = {"kv_b_proj": a * (arch.qk_nope_head_dim + arch.v_head_dim), "q_b_proj": a * arch.head_dim,
            "q_proj": a * arch.head_dim}
    return rows[name.split(".")[-2]]


def hf_to_mcore_shard(rule: ParamRule, read: Reader, arch: ModelArch, tp_rank: int, tp: int, padded_vocab: int,
                      expert: ExpertShard = ExpertShard()) -> torch.Tensor:
    """Build TP rank `tp_rank`'s shard of an mcore parameter (for routed experts: the shard of ``expert``), reading
    only the HF rows/columns it needs."""
    kind = rule.kind
    if kind == "replicated":
        return read(rule.hf_names[0])
    if rule.is_expert:
        return _experts_shard(rule, read, arch, expert)
    if kind == "row":  # RowParallelLinear: split the input (column) dim
        cols = _split(_ffn_width(rule, arch), tp, tp_rank)
        return read(rule.hf_names[0], cols=cols)
    if kind == "column":  # ColumnParallelLinear of one HF tensor: split its output rows
        return read(rule.hf_names[0], rows=_split(column_rows(rule, arch), tp, tp_rank))
    if kind == "gate_up":
        rows = _split(_ffn_width(rule, arch), tp, tp_rank)
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


def _experts_shard(rule: ParamRule, read: Reader, arch: ModelArch, expert: ExpertShard) -> torch.Tensor:
    local = arch.num_experts // expert.ep
    f0, f1 = _split(arch.moe_ffn_hidden_size, expert.etp, expert.etp_rank)
    blocks = []
    for e in range(expert.ep_rank * local, (expert.ep_rank + 1) * local):
        names = rule.expert_names(e)
        if rule.kind == "experts_fc1":  # [gate_r; up_r] rows, transposed: [h, 2f/etp]
            blocks.append(torch.cat([read(names[0], rows=(f0, f1)), read(names[1], rows=(f0, f1))]).t())
        else:  # down-projection columns of rank r, transposed: [f/etp, h]
            blocks.append(read(names[0], cols=(f0, f1)).t())
    stacked = torch.stack(blocks).contiguous()  # [E/ep, ·, ·]: the parameter's memory order
    return stacked.view(arch.hidden_size, -1) if rule.kind == "experts_fc1" else stacked.view(-1, arch.hidden_size)


def experts_to_hf(rule: ParamRule, shards: list[list[torch.Tensor]], arch: ModelArch
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (EP rank, expert-TP rank) shard of one routed-experts parameter (``shards[ep_rank][etp_rank]``) → the
    HF tensors of every expert, in expert order."""
    ep, h = len(shards), arch.hidden_size
    local = arch.num_experts // ep
    for p, row in enumerate(shards):
        if rule.kind == "experts_fc1":
            per_rank = [s.view(local, h, -1) for s in row]
            for e in range(local):
                parts = [t[e].t() for t in per_rank]  # each [2f/etp, h] = [gate_r; up_r]
                halves = [part.chunk(2, dim=0) for part in parts]
                names = rule.expert_names(p * local + e)
                yield names[0], torch.cat([g for g, _ in halves]).contiguous()
                yield names[1], torch.cat([u for _, u in halves]).contiguous()
        else:
            per_rank = [s.view(local, -1, h) for s in row]
            for e in range(local):
                yield rule.expert_names(p * local + e)[0], torch.cat([t[e] for t in per_rank]).t().contiguous()


def mcore_shards_to_hf(rule: ParamRule, shards: list[torch.Tensor],
                       arch: ModelArch) -> Iterator[tuple[str, torch.Tensor]]:
    """Inverse of :func:`hf_to_mcore_shard`: all TP shards of one mcore parameter → its HF tensor(s) (routed experts:
    :func:`experts_to_hf`)."""
    kind = rule.kind
    if rule.is_expert:
        raise ValueError("mcore_shards_to_hf: routed experts are gathered over EP and expert TP; use experts_to_hf")
    if kind == "replicated":
        yield rule.hf_names[0], shards[0]
    elif kind == "row":
        yield rule.hf_names[0], torch.cat(shards, dim=1)
    elif kind == "column":
        yield rule.hf_names[0], torch.cat(shards, dim=0)
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


#: one dimension of an HF tensor: its size and the config.json key(s) it comes from
Dim = tuple[int, str]

_EXPERT_COUNT_KEY = {"mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}
_EXPERT_WIDTH_KEY = {"mixtral": "intermediate_size"}
_SHARED_WIDTH_KEY = {"deepseek_v3": "n_shared_experts·moe_intermediate_size"}


SCORE_HEAD = "score.weight"  # an HF *ForSequenceClassification head; with num_labels=1, a reward model's


def expected_hf_shapes(arch: ModelArch, *, head: str = "lm") -> dict[str, tuple[Dim, ...]]:
    """Every tensor an HF checkpoint of `arch` must contain, with its shape (each dimension with the config key it
    comes from, for error messages). A DeepSeek checkpoint's multi-token-prediction layers, ``model.layers.{L}…``
    and up, are not among them: they are not built (docs/moe.md). ``head``: ``lm`` (a causal LM's ``lm_head``
    unless tied), ``value`` (a critic: no LM head needed) or ``score`` (a reward model: the one-label ``score``
    head of a sequence-classification checkpoint)."""
    h: Dim = (arch.hidden_size, "hidden_size")
    vocab: Dim = (arch.vocab_size, "vocab_size")
    shapes: dict[str, tuple[Dim, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if head == "lm" and not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    if head == "score":
        shapes[SCORE_HEAD] = ((1, "num_labels"), h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update({p + k: v for k, v in (_mla_shapes(arch, h) if arch.is_mla else _attention_shapes(arch, h))})
        if arch.is_moe_layer(i):
            shapes.update(_moe_shapes(arch, i, h))
        else:
            f: Dim = (arch.ffn_hidden_size, "intermediate_size")
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
    return shapes


def _attention_shapes(arch: ModelArch, h: Dim) -> list[tuple[str, tuple[Dim, ...]]]:
    q: Dim = (arch.num_heads * arch.head_dim, "num_attention_heads·head_dim")
    kv: Dim = (arch.num_kv_heads * arch.head_dim, "num_key_value_heads·head_dim")
    out = [("self_attn.q_proj.weight", (q, h)), ("self_attn.k_proj.weight", (kv, h)),
           ("self_attn.v_proj.weight", (kv, h)), ("self_attn.o_proj.weight", (h, q))]
    if arch.qkv_bias:
        out += [("self_attn.q_proj.bias", (q,)), ("self_attn.k_proj.bias", (kv,)), ("self_attn.v_proj.bias", (kv,))]
    if arch.qk_norm:
        d: Dim = (arch.head_dim, "head_dim")
        out += [("self_attn.q_norm.weight", (d,)), ("self_attn.k_norm.weight", (d,))]
    return out


def _mla_shapes(arch: ModelArch, h: Dim) -> list[tuple[str, tuple[Dim, ...]]]:
    a = arch.num_heads
    q: Dim = (a * arch.head_dim, "num_attention_heads·(qk_nope_head_dim+qk_rope_head_dim)")
    latent: Dim = (arch.kv_lora_rank, "kv_lora_rank")
    out = [("self_attn.kv_a_proj_with_mqa.weight",
            ((arch.kv_lora_rank + arch.qk_rope_head_dim, "kv_lora_rank+qk_rope_head_dim"), h)),
           ("self_attn.kv_a_layernorm.weight", (latent,)),
           ("self_attn.kv_b_proj.weight",
            ((a * (arch.qk_nope_head_dim + arch.v_head_dim), "num_attention_heads·(qk_nope_head_dim+v_head_dim)"),
             latent)),
           ("self_attn.o_proj.weight", (h, (a * arch.v_head_dim, "num_attention_heads·v_head_dim")))]
    if arch.q_lora_rank:
        rank: Dim = (arch.q_lora_rank, "q_lora_rank")
        out += [("self_attn.q_a_proj.weight", (rank, h)), ("self_attn.q_a_layernorm.weight", (rank,)),
                ("self_attn.q_b_proj.weight", (q, rank))]
    else:
        out.append(("self_attn.q_proj.weight", (q, h)))
    return out


def _moe_shapes(arch: ModelArch, i: int, h: Dim) -> dict[str, tuple[Dim, ...]]:
    mt = arch.model_type
    experts: Dim = (arch.num_experts, _EXPERT_COUNT_KEY.get(mt, "num_experts"))
    width: Dim = (arch.moe_ffn_hidden_size, _EXPERT_WIDTH_KEY.get(mt, "moe_intermediate_size"))
    shared: Dim = (arch.shared_expert_ffn_hidden_size,
                   _SHARED_WIDTH_KEY.get(mt, "shared_expert_intermediate_size"))
    one: Dim = (1, "a single gate")
    by_suffix = {"mlp.router.weight": (experts, h), "mlp.router.expert_bias": (experts,),
                 "mlp.shared_experts.linear_fc1.weight": (shared, h),
                 "mlp.shared_experts.linear_fc2.weight": (h, shared), "mlp.shared_experts.gate_weight": (one, h)}
    shapes: dict[str, tuple[Dim, ...]] = {}
    for suffix, (kind, templates) in _moe_rules(mt).items():
        if ".shared_expert" in templates[0] and not arch.shared_expert_ffn_hidden_size or \
                "shared_expert_gate" in templates[0] and not arch.shared_expert_gate or \
                "e_score_correction_bias" in templates[0] and not arch.moe_expert_bias:
            continue
        rule = ParamRule(kind, tuple(t.format(i=i) for t in templates))
        if rule.is_expert:
            shape = (width, h) if kind == "experts_fc1" else (h, width)
            shapes.update({n: shape for e in range(arch.num_experts) for n in rule.expert_names(e)})
        else:
            shapes.update({n: by_suffix[suffix] for n in rule.hf_names})
    return shapes
