"""Load HF weights into this rank's mcore model chunks, and gather mcore shards back into HF tensors."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from verl_mega.models.hf_config import ModelArch
from verl_mega.models.hf_io import CheckpointError, HFCheckpointReader
from verl_mega.models.weights import (SCORE_HEAD, ExpertShard, experts_to_hf, expected_hf_shapes, hf_to_mcore_shard,
                                      mapped_tensors, mcore_shards_to_hf, rule_for)
from verl_mega.parallel.state import RankGroups


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


#: safetensors dtypes the model is built from; anything else (FP8 with its *_scale_inv, int8, …) is quantized
LOADABLE_DTYPES = ("F32", "BF16", "F16")


def check_checkpoint_matches(reader: HFCheckpointReader, arch: ModelArch, *, head: str = "lm") -> None:
    """Fail fast, before any model allocation, when a checkpoint does not match its config: every tensor the model
    needs must be there, in a float dtype, with exactly the shape config.json implies (from the file headers; no
    tensor is read). A larger tensor would otherwise be cut to size and a shorter LM head padded with zeros.
    ``head``: see :func:`~verl_mega.models.weights.expected_hf_shapes`; a critic's checkpoint may carry a score head,
    which must then have one label."""
    present = set(reader.keys())
    if head == "score" and SCORE_HEAD not in present:
        raise CheckpointError(f"checkpoint: {reader.path} has no {SCORE_HEAD}: a reward model is an HF "
                              f"sequence-classification checkpoint with num_labels=1 (e.g. "
                              f"Qwen2ForSequenceClassification), whose score head rates the last token; a causal LM "
                              f"has none")
    shapes = expected_hf_shapes(arch, head="score" if head == "value" and SCORE_HEAD in present else head)
    missing = sorted(set(shapes) - present)
    if missing:
        raise CheckpointError(
            f"checkpoint: {len(missing)} tensors the config needs are missing from {reader.path} (first: "
            f"{missing[0]}); the weights do not match config.json or the export is incomplete"
        )
    for name in sorted(shapes):
        dtype = reader.dtype(name)
        if dtype not in LOADABLE_DTYPES:
            raise CheckpointError(f"checkpoint: tensor {name} in {reader.path} is {dtype}, a quantized format; "
                                  f"weights must be F32, BF16 or F16: dequantize the checkpoint to bf16 first")
        dims, shape = shapes[name], reader.shape(name)
        want = [size for size, _ in dims]
        if shape != want:
            bad = next((f"dimension {d}: {key}={size}" for d, (size, key) in enumerate(dims)
                        if d >= len(shape) or shape[d] != size), f"it has {len(shape)} dimensions")
            raise CheckpointError(f"checkpoint: {name} in {reader.path} has shape {shape} but config.json implies "
                                  f"{want} ({bad}); the weights belong to another model or config.json is wrong")


@torch.no_grad()
def load_hf_weights(chunks: list[torch.nn.Module], reader: HFCheckpointReader, arch: ModelArch, groups: RankGroups,
                    *, value_head: bool = False) -> int:
    """Copy this rank's slices of an HF checkpoint into the mcore chunks. Returns the number of params loaded.
    Non-finite values (NaN/Inf) in any rank's slices are an error on every rank (collective when distributed).
    ``value_head``: the chunks end in a value head, loaded from the checkpoint's one-label score head when it has
    one (a reward model, a critic saved as one), else left as initialised (a critic starting from a causal LM)."""
    tp, tp_rank = groups.size("tp"), groups.tp_rank
    expert = expert_shard(groups)
    loaded = 0
    nonfinite: str | None = None
    for chunk in chunks:
        model = unwrap(chunk)
        offset = model.stage_layout.layer_offset
        padded_vocab = model.vocab_size
        for name, param in mapped_tensors(model):
            if value_head and name.startswith("output_layer."):
                if SCORE_HEAD not in reader:
                    continue  # a causal LM's checkpoint: the value head starts as initialised
                hf_name, shard = SCORE_HEAD, reader.get(SCORE_HEAD)  # replicated on every TP rank, as the head is
            else:
                rule = rule_for(name, arch, offset)
                hf_name, shard = rule.hf_names[0], hf_to_mcore_shard(rule, reader.get, arch, tp_rank, tp,
                                                                     padded_vocab, expert)
            if tuple(shard.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"checkpoint: {hf_name} gives shape {tuple(shard.shape)} for {name} but the model "
                    f"expects {tuple(param.shape)}; the weights do not match config.json"
                )
            if nonfinite is None and shard.is_floating_point() and not bool(torch.isfinite(shard).all()):
                nonfinite = hf_name
            param.data.copy_(shard.to(param.dtype))
            loaded += 1
    found = [nonfinite]
    pool = groups["pool"] if dist.is_initialized() else None
    if pool is not None and dist.get_world_size(pool) > 1:  # every rank fails, not only the one holding the slice
        found = [None] * dist.get_world_size(pool)
        dist.all_gather_object(found, nonfinite, group=pool)
    bad = next((name for name in found if name), None)
    if bad is not None:
        raise CheckpointError(f"checkpoint: tensor {bad} in {reader.path} holds NaN or Inf values; the weights are "
                              f"damaged (or were saved after training diverged): use an intact checkpoint")
    return loaded


def expert_shard(groups: RankGroups) -> ExpertShard:
    """The routed experts this rank holds (its place on the expert grid)."""
    c = groups.coords
    return ExpertShard(ep_rank=c["ep"], ep=groups.pool.ep, etp_rank=c["etp"], etp=groups.pool.etp)


def _gather(t: torch.Tensor, groups: RankGroups, kind: str) -> list[torch.Tensor]:
    n = groups.size(kind)
    if n == 1:
        return [t]
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous(), group=groups[kind])
    return out


def _tp_gather(t: torch.Tensor, groups: RankGroups) -> list[torch.Tensor]:
    return _gather(t, groups, "tp")


def _hf_tensors_of(rule, param: torch.Tensor, arch: ModelArch, groups: RankGroups):
    """The full HF tensors of one local parameter: gathered over TP, or for routed experts over expert TP and EP."""
    if not rule.is_expert:
        return mcore_shards_to_hf(rule, _tp_gather(param, groups), arch)
    by_etp = _gather(param, groups, "etp")
    shards = [list(s.chunk(len(by_etp))) for s in _gather(torch.cat(by_etp), groups, "ep")]
    return experts_to_hf(rule, shards, arch)


@torch.no_grad()
def iter_hf_tensors(chunks: list[torch.nn.Module], arch: ModelArch, groups: RankGroups, *,
                    include_value_head: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the full HF tensors of the model, one parameter at a time, on every rank of every stage.

    Each mcore parameter is all-gathered over TP, converted, then broadcast over the pipeline group from the
    stage that owns it, so peak extra memory is one full parameter (not the model). Collective: all model-parallel
    ranks must iterate together. A linear with LoRA adapters gives its merged weight ``W + s·B·A``.
    """
    from verl_mega.models.lora import effective_weight

    pp_group = groups["pp"]
    pp, pp_rank = groups.size("pp"), groups.pp_rank
    local = []
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in mapped_tensors(model):
            if name.startswith("output_layer.") and not include_value_head and arch.tie_word_embeddings:
                continue
            local.append((name, model.stage_layout.layer_offset, tuple(param.shape), (model, param)))
    meta = [(n, off, shape) for n, off, shape, _ in local]
    all_meta: list = [None] * pp
    if pp > 1:
        dist.all_gather_object(all_meta, meta, group=pp_group)
    else:
        all_meta = [meta]
    device = local[0][3][1].device
    for stage, stage_meta in enumerate(all_meta):
        src = groups.global_rank("pp", stage)
        for idx, (name, offset, _) in enumerate(stage_meta):
            rule = rule_for(name, arch, offset)
            if stage == pp_rank:
                owner, param = local[idx][3]
                for hf_name, tensor in _hf_tensors_of(rule, effective_weight(owner, name, param), arch, groups):
                    if pp > 1:  # the dtype too: a router's correction bias stays fp32 in a bf16 model
                        dist.broadcast_object_list([(tuple(tensor.shape), tensor.dtype)], src=src, group=pp_group)
                        dist.broadcast(tensor.contiguous(), src=src, group=pp_group)
                    yield hf_name, tensor
            else:
                names = [n for e in range(arch.num_experts) for n in rule.expert_names(e)] if rule.is_expert \
                    else rule.hf_names
                for hf_name in names:
                    shape_box = [None]
                    dist.broadcast_object_list(shape_box, src=src, group=pp_group)
                    tensor = torch.empty(shape_box[0][0], dtype=shape_box[0][1], device=device)
                    dist.broadcast(tensor, src=src, group=pp_group)
                    yield hf_name, tensor

