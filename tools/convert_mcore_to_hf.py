"""Convert a Megatron dist checkpoint written by verl_mega back to HF safetensors + config.json (one CPU process).

    python tools/convert_mcore_to_hf.py --mcore-path DIR --output DIR
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mcore-path", required=True, help="Megatron dist checkpoint directory")
    parser.add_argument("--output", required=True, help="new directory for the HF checkpoint")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.mcore_path):
        print(f"error: --mcore-path {args.mcore_path} is not a directory; give the output of "
              f"tools/convert_hf_to_mcore.py or the actor/ directory of a verl_mega training checkpoint",
              file=sys.stderr)
        return 2
    from verl_mega.models.hf_config import ModelConfigError
    from verl_mega.models.hf_io import CheckpointError
    from verl_mega.checkpoint.mcore import convert_mcore_to_hf

    try:
        out = convert_mcore_to_hf(args.mcore_path, args.output)
    except (ModelConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote HF checkpoint to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
