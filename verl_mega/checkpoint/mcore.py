"""Megatron dist checkpoints of model weights (layout-free: load at any tp/pp/ep) and the HF⇄mcore converters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from verl_mega.checkpoint.atomic_dir import AtomicDir
from verl_mega.models.hf_config import MODEL_DTYPES, ModelArch, arch_from_hf, load_hf_config, transformer_config
from verl_mega.models.hf_io import CheckpointError, HFCheckpointReader, config_with_dtype, write_hf_checkpoint

META_FILE = "verl_mega_model.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")


def model_sharded_state_dict(chunks: list[torch.nn.Module], groups) -> dict[str, Any]:
    """mcore's sharded state dict, keyed like Megatron-LM (`model`, or `model0`, `model1`, … with VPP); replicas
    are told apart over the data(+context)-parallel group of ``groups`` (a RankGroups). A model with LoRA adapters
    gives its adapters only: the frozen base is the HF model it was built from (``model.path``), not state."""
    from verl_mega.models.lora import has_adapters, is_lora_param
    from verl_mega.models.loader import unwrap
    from verl_mega.parallel.state import mcore_dp_cp_group

    modules = [unwrap(c) for c in chunks]
    adapters_only = has_adapters(modules)
    with mcore_dp_cp_group(groups):
        sds = [m.sharded_state_dict(metadata={"dp_cp_group": groups["dp_cp"]}) for m in modules]
    if adapters_only:
        sds = [{k: v for k, v in sd.items() if is_lora_param(k)} for sd in sds]
    return {"model": sds[0]} if len(sds) == 1 else {f"model{i}": sd for i, sd in enumerate(sds)}


def load_model_state(module: torch.nn.Module, state: dict[str, Any]) -> None:
    """Load a (dist-checkpoint) state dict into one model chunk: all of it, or with LoRA adapters the adapters alone
    (the frozen base was loaded from the HF model it was built from; :func:`check_adapters_match` made sure before
    the load that the checkpoint's adapters are this model's)."""
    from verl_mega.models.lora import has_adapters

    module.load_state_dict(state, strict=not has_adapters([module]))


def check_adapters_match(model_sd: dict, ckpt_dir: str | Path) -> None:
    """With LoRA adapters (``model_sd``: :func:`model_sharded_state_dict`'s, which then holds the adapters only), the
    checkpoint's adapters must be these, by name and shape, before anything loads: with another model.lora an
    adapter left out of this one would be dropped silently, and one it adds would fail inside the load with no
    name. Read from the checkpoint's metadata alone."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from verl_mega.checkpoint.safe_load import read_dist_metadata
    from verl_mega.models.lora import is_lora_param

    ours = {t.key: tuple(t.global_shape) for t in nested_values(model_sd)
            if isinstance(t, ShardedTensor) and is_lora_param(t.key)}
    if not ours:
        return
    model_prefixes = {key.split(".")[0] for key in ours}  # the optimizer's state is saved under names of its own
    saved = {key: tuple(meta.size) for key, meta in read_dist_metadata(Path(ckpt_dir) / ".metadata")
             .state_dict_metadata.items()
             if is_lora_param(key) and key.split(".")[0] in model_prefixes and hasattr(meta, "size")}
    fix = "the checkpoint was written with another model.lora (rank, target_modules); resume with that one"
    missing, extra = sorted(set(ours) - set(saved)), sorted(set(saved) - set(ours))
    if missing:
        raise CheckpointError(f"checkpoint: LoRA adapter {missing[0]} is missing from {ckpt_dir} (and "
                              f"{len(missing) - 1} more); {fix}")
    if extra:
        raise CheckpointError(f"checkpoint: {ckpt_dir} holds LoRA adapter {extra[0]} (and {len(extra) - 1} more) "
                              f"that this model.lora does not build; {fix}")
    other = next((key for key in sorted(ours) if ours[key] != saved[key]), None)
    if other is not None:
        raise CheckpointError(f"checkpoint: LoRA adapter {other} has shape {list(saved[other])} in {ckpt_dir}, "
                              f"{list(ours[other])} here; {fix}")


def save_model_dist(chunks: list[torch.nn.Module], out_dir: str | Path, groups) -> None:
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model_sharded_state_dict(chunks, groups), str(out_dir))


def load_model_dist(chunks: list[torch.nn.Module], ckpt_dir: str | Path, groups) -> None:
    """Load weights saved at any tp/pp into this rank's chunks (mcore reshards on load). Metadata and objects are read
    without running code from the checkpoint (see safe_load)."""
    from verl_mega.models.loader import unwrap
    from verl_mega.checkpoint.safe_load import load_dist

    ckpt_dir = Path(ckpt_dir)
    state = load_dist(model_sharded_state_dict(chunks, groups), ckpt_dir)
    if len(chunks) == 1:
        unwrap(chunks[0]).load_state_dict(state["model"], strict=False)
    else:
        for i, c in enumerate(chunks):
            unwrap(c).load_state_dict(state[f"model{i}"], strict=False)


def write_model_meta(ckpt_dir: str | Path, hf_config: dict[str, Any], dtype: str, *, padded_vocab_size: int,
                     layout: dict[str, int], adapters_only: bool = False) -> None:
    """``verl_mega_model.json`` of a model checkpoint: what :func:`convert_mcore_to_hf` needs to rebuild the model
    (its HF config, the dtype and the padded vocabulary it was saved with, which fix the tensors' global shapes).
    Written by :func:`convert_hf_to_mcore` and into the actor directory of every training checkpoint."""
    meta = {"hf_config": hf_config, "dtype": dtype, "padded_vocab_size": padded_vocab_size, "layout_hint": layout,
            "format": "mcore_dist", "adapters_only": adapters_only}
    (Path(ckpt_dir) / META_FILE).write_text(json.dumps(meta, indent=2))


def read_model_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    """The validated meta file of a model checkpoint; every problem is a one-line CheckpointError."""
    meta_file = Path(ckpt_dir) / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"checkpoint: {meta_file} is missing; only the output of tools/convert_hf_to_mcore.py "
                              f"and the actor/ directory of a verl_mega training checkpoint carry the HF config "
                              f"needed here")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint: {meta_file} is not valid JSON ({exc}); the checkpoint is damaged: "
                              f"convert it again from the HF model") from None
    problem = None
    if not isinstance(meta, dict) or not isinstance(meta.get("hf_config"), dict):
        problem = "has no 'hf_config' object"
    elif meta.get("dtype") not in MODEL_DTYPES:
        problem = f"has dtype={meta.get('dtype')!r}, not one of {', '.join(MODEL_DTYPES)}"
    elif not isinstance(meta.get("padded_vocab_size", 0), int) or isinstance(meta.get("padded_vocab_size"), bool):
        problem = f"has padded_vocab_size={meta['padded_vocab_size']!r}, not an int"
    if problem:
        raise CheckpointError(f"checkpoint: {meta_file} {problem}; the checkpoint is damaged: convert it again from "
                              f"the HF model")
    if meta.get("adapters_only"):
        raise CheckpointError(f"checkpoint: {Path(ckpt_dir)} holds a run's LoRA adapters only (the base is its "
                              f"model.path); use the checkpoint's hf/ export (checkpoint.export_hf=true) or merge "
                              f"the adapter into the base with tools/merge_lora.py")
    return meta


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def _single_process_model(arch: ModelArch, dtype: str, padded_vocab_size: int | None = None):
    """The model at tp=pp=1; ``padded_vocab_size``: the embedding rows of the checkpoint to load (a training
    checkpoint's vocabulary is padded for its own tp), by default Megatron's padding at tp=1."""
    from verl_mega.models.build import build_model_chunks
    from verl_mega.parallel.state import init_distributed

    groups = init_distributed()
    cfg = transformer_config(arch, dtype=dtype, use_cpu_initialization=True, perform_initialization=False)
    # at tp=1 Megatron pads to a multiple of make_vocab_size_divisible_by: the checkpoint's row count is one
    divisible_by = padded_vocab_size or arch.padded_vocab_size(1)
    return build_model_chunks(arch, cfg, groups, use_te="false", make_vocab_size_divisible_by=divisible_by), groups


def convert_hf_to_mcore(hf_path: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                        etp: int | None = None, dtype: str | None = None) -> Path:
    """HF safetensors → Megatron dist checkpoint, in one CPU process. Validates that (tp, pp, ep, etp) is a legal
    layout for the model; the checkpoint itself is layout-free and loads at any tp/pp/ep/etp (Megatron reshards
    routed experts on load). A DeepSeek checkpoint's multi-token-prediction layers are left out (see
    :func:`mtp_note`)."""
    from verl_mega.models.loader import check_checkpoint_matches, load_hf_weights

    target = AtomicDir(out_dir)  # a bad --output fails first
    hf_path = Path(hf_path)
    hf_cfg = load_hf_config(hf_path)
    arch = arch_from_hf(hf_cfg)
    transformer_config(arch, tp=tp, pp=pp, ep=ep, etp=etp)  # layout check up front (one-line error), before any
    # allocation
    reader = HFCheckpointReader(hf_path)
    check_checkpoint_matches(reader, arch)
    dtype = dtype or _dtype_name(reader.dtype("model.embed_tokens.weight"))
    with target as tmp:
        chunks, groups = _single_process_model(arch, dtype)
        load_hf_weights(chunks, reader, arch, groups)
        save_model_dist(chunks, tmp, groups)
        if arch.num_mtp_layers:  # not built (docs/moe.md): the checkpoint describes the model it holds
            hf_cfg = {**hf_cfg, "num_nextn_predict_layers": 0}
        write_model_meta(tmp, hf_cfg, dtype, padded_vocab_size=chunks[0].vocab_size,
                         layout={"tp": tp, "pp": pp, "ep": ep, "etp": etp or tp})
        _copy_tokenizer(hf_path, tmp)
    return Path(out_dir)


def mtp_note(arch: ModelArch) -> str | None:
    """The one line the converter prints when it leaves a checkpoint's multi-token-prediction layers out."""
    if not arch.num_mtp_layers:
        return None
    first = arch.num_layers
    return (f"note: dropped the checkpoint's {arch.num_mtp_layers} multi-token-prediction layer(s) "
            f"(model.layers.{first}.* and up): RL trains and generates with the main model; the output's config has "
            f"num_nextn_predict_layers=0")


def convert_mcore_to_hf(mcore_path: str | Path, out_dir: str | Path) -> Path:
    """Megatron dist checkpoint (written by verl_mega) → HF safetensors + config.json, in one CPU process."""
    from verl_mega.models.loader import iter_hf_tensors

    from verl_mega.checkpoint.safe_load import check_dist_checkpoint

    target = AtomicDir(out_dir)  # a bad --output fails first
    mcore_path = Path(mcore_path)
    meta = read_model_meta(mcore_path)
    arch = arch_from_hf(meta["hf_config"])
    padded = meta.get("padded_vocab_size")  # absent from files written before it was recorded: tp=1's padding
    if padded is not None and padded < arch.vocab_size:
        raise CheckpointError(f"checkpoint: {mcore_path / META_FILE} has padded_vocab_size={padded} below the "
                              f"config's vocab_size={arch.vocab_size}; the checkpoint is damaged")
    check_dist_checkpoint(mcore_path)  # a refused or broken file fails here, before the model is built
    with target as tmp:
        chunks, groups = _single_process_model(arch, meta["dtype"], padded)
        load_model_dist(chunks, mcore_path, groups)
        written = write_hf_checkpoint(tmp, iter_hf_tensors(chunks, arch, groups))
        (tmp / "config.json").write_text(json.dumps(config_with_dtype(meta["hf_config"], written), indent=2))
        _copy_tokenizer(mcore_path, tmp)
    return Path(out_dir)


def _dtype_name(st_dtype: str) -> str:
    """The model dtype of a safetensors dtype; a quantized one is refused, never read as another."""
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    if st_dtype not in names:
        raise CheckpointError(f"checkpoint: weights of dtype {st_dtype} cannot be loaded; weights must be F32, BF16 "
                              f"or F16: dequantize the checkpoint to bf16 first")
    return names[st_dtype]


def merge_lora_adapter(base_path: str | Path, adapter_path: str | Path, out_dir: str | Path) -> Path:
    """HF base model + PEFT LoRA adapter → the merged HF model (``W + (alpha/r)·B·A``), streamed one tensor at a
    time in one CPU process; config and tokenizer files are copied from the base."""
    from verl_mega.models.lora import merge_into_hf, read_peft_adapter

    target = AtomicDir(out_dir)  # a bad --output fails first
    base_path = Path(base_path)
    spec, adapter = read_peft_adapter(adapter_path)
    reader = HFCheckpointReader(base_path)
    with target as tmp:
        write_hf_checkpoint(tmp, merge_into_hf(((k, reader.get(k)) for k in reader.keys()), adapter, spec))
        shutil.copy2(base_path / "config.json", tmp / "config.json")
        _copy_tokenizer(base_path, tmp)
    return Path(out_dir)
