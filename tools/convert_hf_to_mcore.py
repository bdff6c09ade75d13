"""Convert an HF safetensors checkpoint into a Megatron dist checkpoint (one CPU process, no torchrun).

    python tools/convert_hf_to_mcore.py --hf-path DIR|ORG/NAME[@REVISION] --output DIR [--tp N] [--pp M] [--ep E]
                                        [--etp T] [--dtype bfloat16]

``--hf-path`` takes a local directory or a hub ID, fetched into the Hugging Face cache (``HF_HUB_OFFLINE=1``: from the
cache alone).

The checkpoint is layout-free: it loads at any tp/pp (and, for Mixture-of-Experts models, any ep/etp); the layout
given here is only validated against the model.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-path", required=True, help="HF model directory (config.json + *.safetensors) or hub ID")
    parser.add_argument("--output", required=True, help="new directory for the Megatron dist checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="training tensor-parallel size to validate against")
    parser.add_argument("--pp", type=int, default=1, help="training pipeline-parallel size to validate against")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size to validate against (MoE models)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor-parallel size to validate against "
                                                              "(default: --tp)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="parameter dtype (default: the checkpoint's)")
    args = parser.parse_args(argv)
    if min(args.tp, args.pp, args.ep, 1 if args.etp is None else args.etp) < 1:
        parser.error("--tp, --pp, --ep and --etp must be ≥ 1")
    from verl_mega.config.base import ConfigError
    from verl_mega.config.hub import resolve_model

    try:  # a hub ID: fetched (or found in the cache) before anything is built
        args.hf_path = resolve_model("--hf-path", args.hf_path)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(args.hf_path, "config.json")):  # this flag's name, not a config key's
        what = "is not a directory" if not os.path.isdir(args.hf_path) else "has no config.json"
        print(f"error: --hf-path {args.hf_path} {what}; give an HF model directory (config.json + *.safetensors) "
              f"or a hub ID ORG/NAME", file=sys.stderr)
        return 2
    from verl_mega.models.hf_config import ModelConfigError, arch_from_hf, load_hf_config
    from verl_mega.models.hf_io import CheckpointError
    from verl_mega.checkpoint.mcore import convert_hf_to_mcore, mtp_note

    try:
        out = convert_hf_to_mcore(args.hf_path, args.output, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                                  dtype=args.dtype)
        note = mtp_note(arch_from_hf(load_hf_config(args.hf_path)))
    except (ModelConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if note:
        print(note)
    print(f"wrote Megatron dist checkpoint to {out} (loads at any layout; validated for tp={args.tp}, pp={args.pp}, "
          f"ep={args.ep})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
