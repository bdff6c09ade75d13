"""Megatron dist checkpoints of model weights (layout-free: load at any tp/pp/ep) and the HF⇄mcore converters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from verl_mega.models.hf_config import ModelArch, arch_from_hf, load_hf_config, transformer_config
from verl_mega.models.hf_io import AtomicDir, CheckpointError, HFCheckpointReader, write_hf_checkpoint

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
    """Load a (dist-checkpoint) state dict into one model chunk: all of it, or with LoRA adapters exactly the
    adapters (the frozen base was loaded from the HF model it was built from)."""
    from verl_mega.models.lora import has_adapters, is_lora_param

    if not has_adapters([module]):
        module.load_state_dict(state)
        return
    missing = module.load_state_dict(state, strict=False).missing_keys
    adapters = [k for k in missing if is_lora_param(k)]
    if adapters:
        raise CheckpointError(f"checkpoint: LoRA adapter {adapters[0]} is missing (and {len(adapters) - 1} more); "
                              f"the checkpoint was written with another model.lora (rank, target_modules)")


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


def read_model_meta(ckpt_dir: str | Path) -> dict[str, Any]:
    meta = Path(ckpt_dir) / META_FILE
    if not meta.exists():
        raise CheckpointError(
            f"checkpoint: {meta} is missing; only checkpoints written by verl_mega carry the HF config needed here"
        )
    return json.loads(meta.read_text())


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def _single_process_model(arch: ModelArch, dtype: str):
    from verl_mega.models.build import build_model_chunks
    from verl_mega.parallel.state import init_distributed

    groups = init_distributed()
    cfg = transformer_config(arch, dtype=dtype, use_cpu_initialization=True, perform_initialization=False)
    return build_model_chunks(arch, cfg, groups, use_te="false"), groups


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
        meta = {"hf_config": hf_cfg, "dtype": dtype, "layout_hint": {"tp": tp, "pp": pp, "ep": ep, "etp": etp or tp},
                "format": "mcore_dist"}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))
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
    check_dist_checkpoint(mcore_path)  # a refused or broken file fails here, before the model is built
    with target as tmp:
        chunks, groups = _single_process_model(arch, meta["dtype"])
        load_model_dist(chunks, mcore_path, groups)
        write_hf_checkpoint(tmp, iter_hf_tensors(chunks, arch, groups))
        (tmp / "config.json").write_text(json.dumps(meta["hf_config"], indent=2))
        _copy_tokenizer(mcore_path, tmp)
    return Path(out_dir)


def _dtype_name(st_dtype: str) -> str:
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(st_dtype, "float32")


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
