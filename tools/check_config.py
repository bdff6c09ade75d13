"""Check a recipe without starting a run: print the resolved config, optionally check it for a given world size.

    python tools/check_config.py configs/grpo_qwen2.5_7b.yaml parallel.tp=4 --world-size 1024 --no-check-paths

The layout check needs the model shape: it is read from `model.path`/config.json when that exists, or given as
`--model-shape LAYERS,HEADS,KV_HEADS`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_mega.config import ConfigError, load_config, to_yaml  # noqa: E402


def _model_shape(arg: str | None, model_path: str) -> tuple[int, int, int] | None:
    if arg:
        try:
            layers, heads, kv = (int(x) for x in arg.split(","))
        except ValueError:
            raise ConfigError(f"--model-shape {arg!r} must be LAYERS,HEADS,KV_HEADS, e.g. 32,32,8") from None
        return layers, heads, kv
    config_json = os.path.join(model_path, "config.json")
    if not os.path.isfile(config_json):
        return None
    with open(config_json, encoding="utf-8") as f:
        hf = json.load(f)
    heads = hf["num_attention_heads"]
    return hf["num_hidden_layers"], heads, hf.get("num_key_value_heads") or heads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/check_config.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", help="YAML recipe (omit for the built-in defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6")
    parser.add_argument("--world-size", type=int, help="check the layout and batch sizes for this many ranks")
    parser.add_argument("--model-shape", help="LAYERS,HEADS,KV_HEADS when model.path is not a local HF directory")
    parser.add_argument("--no-check-paths", action="store_true", help="do not require referenced files to exist")
    parser.add_argument("--cpu", action="store_true", help="check CPU-mode requirements (default: GPU)")
    args = parser.parse_args(argv)
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:  # only overrides were given
        recipe, overrides = None, [recipe, *overrides]
    try:
        cfg = load_config(recipe, overrides, check_paths=not args.no_check_paths)
        print(to_yaml(cfg), end="")
        if args.world_size is not None:
            from verl_mega.config.hub import resolve_model_config

            shape = _model_shape(args.model_shape, cfg.model.path if args.model_shape else
                                 resolve_model_config("model.path", cfg.model.path))
            if shape is None:
                raise ConfigError(f"cannot check the layout: model.path={cfg.model.path!r} has no config.json; pass "
                                  f"--model-shape LAYERS,HEADS,KV_HEADS")
            from verl_mega.models.hf_config import check_layout
            from verl_mega.parallel.placement import Placement

            layers, heads, kv = shape
            placement = Placement.from_config(cfg, args.world_size)
            cfg.validate_runtime(placement, cuda_available=not args.cpu)
            check_layout(placement.pool_of("actor"), num_layers=layers, num_heads=heads, num_kv_heads=kv)
            print(f"# layout OK: {placement.describe()}", file=sys.stderr)
            if cfg.parallel.layout == "auto":
                print("# parallel.layout=auto: a run replaces this layout with the planner's best for its GPUs; "
                      "python tools/plan.py --config RECIPE --model CONFIG.json --gpus N shows the ranking",
                      file=sys.stderr)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
