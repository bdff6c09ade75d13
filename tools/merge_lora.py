"""Merge a PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``, as ``checkpoint.export_hf``
writes it) into its HF base model: every targeted weight becomes ``W + (alpha/r)·B·A`` (one CPU process, one tensor at
a time).

    python tools/merge_lora.py --base HF_DIR --adapter ADAPTER_DIR --output DIR

``--base`` takes a local directory or a hub ID ``ORG/NAME[@REVISION]``, fetched into the Hugging Face cache.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="HF base model directory (config.json + *.safetensors) or hub ID")
    parser.add_argument("--adapter", required=True, help="PEFT LoRA adapter directory")
    parser.add_argument("--output", required=True, help="new directory for the merged HF model")
    args = parser.parse_args(argv)
    from verl_mega.config.base import ConfigError
    from verl_mega.config.hub import resolve_model

    try:
        args.base = resolve_model("--base", args.base)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from verl_mega.checkpoint.mcore import merge_lora_adapter
    from verl_mega.models.hf_io import CheckpointError

    try:
        out = merge_lora_adapter(args.base, args.adapter, args.output)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the merged HF model to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
