"""Turn a verl trainer config into a verl_mega recipe, key by key.

    python tools/from_verl.py [VERL_YAML] [key=value ...] [-o recipe.yaml] [--report report.txt]

``VERL_YAML`` is verl's trainer config: ``ppo_trainer.yaml`` / ``ppo_megatron_trainer.yaml`` from a verl checkout
(its hydra ``defaults`` lists are composed from the files beside it), a flattened one (``_generated_*.yaml``, or
what ``main_ppo --cfg job`` prints), or your own. Without it, the installed ``verl`` package's ``ppo_trainer.yaml``
is used when it imports; otherwise only the overrides are converted (verl's defaults for the other keys are then
unknown, and verl_mega's apply). The overrides are the dotted ``key=value`` arguments you gave ``verl.trainer.main_ppo``
(``+key=value`` adds a key, ``~key`` removes one).

Every key is reported: mapped (the verl_mega key and value), the same (nothing to set: verl_mega behaves so, or the
feature is off in this config) or unsupported (with the reason). The recipe is checked by loading it as verl_mega
does; the report goes to stderr (and ``--report``), the recipe to ``-o`` (default stdout). ``docs/from_verl.md``
lists the keys, metrics and checkpoint layouts side by side.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verl_keys import Ctx, Map, Same, Unsupported, classify  # noqa: E402


class VerlConfigError(ValueError):
    """A verl config that cannot be read (a missing defaults file, a bad override, an interpolation loop)."""


# ------------------------------------------------------------------------------------------------- composing
def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else \
            copy.deepcopy(value)
    return out


def _place(tree: dict, package: str, content: dict) -> dict:
    if not package:
        return _merge(tree, content)
    for part in reversed(package.split(".")):
        content = {part: content}
    return _merge(tree, content)


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise VerlConfigError(f"cannot read verl config {path}: {exc}") from None
    if not isinstance(data, dict):
        raise VerlConfigError(f"verl config {path} holds a {type(data).__name__}, not a mapping")
    return data


def _package_directive(path: Path) -> str | None:
    """A ``# @package X`` header line (``_global_``: the root)."""
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        found = re.match(r"#\s*@package\s+(\S+)", line)
        if found:
            return found.group(1)
    return None


def compose(path: Path, package: str = "", choices: dict[str, str] | None = None, _seen: tuple = ()) -> dict:
    """A config file with its hydra ``defaults`` list composed in, as verl's configs use it: ``group@package: option``
    (paths relative to the file's directory; ``${group}`` in an option is that group's choice), ``name`` (another
    config, merged in place), ``override group: option``, ``_self_`` and ``# @package _global_`` headers.
    ``choices`` are group choices made by an including config or the command line (``model_engine=megatron``);
    they win over this file's."""
    path = path.resolve()
    if path in _seen:
        raise VerlConfigError(f"verl config defaults loop through {path}")
    directive = _package_directive(path)
    if directive is not None:
        package = "" if directive == "_global_" else directive
    data = _read_yaml(path)
    defaults = data.pop("defaults", []) or []
    choices = dict(choices or {})
    for entry in defaults:  # this file's overrides of group choices, below those made above it
        if isinstance(entry, dict):
            (spec, option), = entry.items()
            if str(spec).startswith("override "):
                choices.setdefault(str(spec)[len("override "):].strip(), option)
    tree: dict = {}
    entries = list(defaults) if "_self_" in defaults else [*defaults, "_self_"]
    for entry in entries:
        if entry == "_self_":
            tree = _place(tree, package, data)
            continue
        if isinstance(entry, dict):
            (spec, option), = entry.items()
            if str(spec).startswith("override "):
                continue
            group, _, pkg = str(spec).partition("@")
            option = choices.setdefault(group, option)
            if option is None:
                continue
            option = re.sub(r"\$\{(\w+)\}", lambda m: str(choices.get(m.group(1), m.group(0))), str(option))
            file = path.parent / group / f"{option}.yaml"
            target = pkg if pkg else group.split("/")[-1].strip(".")
            inner: dict[str, str] = {}
        else:
            name, _, pkg = str(entry).partition("@")
            file = path.parent / f"{name}.yaml"
            target, inner = pkg, choices
        if target.startswith("_global_"):
            sub_package = target[len("_global_"):].lstrip(".")
        else:
            sub_package = ".".join(p for p in (package, target) if p)
        if not file.exists():
            raise VerlConfigError(f"{path}: its defaults list names {file}, which does not exist; give the file from "
                                  f"a full verl checkout (verl/trainer/config/) or a flattened config")
        tree = _merge(tree, compose(file, sub_package, inner, (*_seen, path)))
    return tree


# ------------------------------------------------------------------------------------------------- overrides
def _split(key: str) -> list[str]:
    return [part for part in key.split(".") if part]


def apply_override(tree: dict, text: str) -> str:
    """Apply one hydra-style override (``key=value``, ``+key=value``, ``++key=value``, ``~key``); returns its key."""
    if text.startswith("~"):
        key = text[1:].split("=", 1)[0]
        *parents, last = _split(key)
        node = tree
        for part in parents:
            node = node.get(part, {})
        if isinstance(node, dict):
            node.pop(last, None)
        return key
    key, sep, raw = text.lstrip("+").partition("=")
    if not sep or not key:
        raise VerlConfigError(f"override {text!r} is not key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    *parents, last = _split(key)
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value
    return key


# ------------------------------------------------------------------------------------------------- interpolation
_INTERP = re.compile(r"\$\{([^${}]*)\}")


def _lookup(tree: dict, parts: list[str]) -> Any:
    node: Any = tree
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            raise KeyError(".".join(parts))
        node = node[part]
    return node


def _target(expr: str, here: list[str]) -> list[str]:
    if expr.startswith("."):  # one dot: a sibling; each further dot goes up one level
        up = len(expr) - len(expr.lstrip(".")) - 1
        return here[: len(here) - up] + _split(expr.lstrip("."))
    return _split(expr)


def resolve(tree: dict) -> dict:
    """Resolve ``${a.b}``, relative ``${.x}`` / ``${..x}``, ``${oc.select:key,default}`` and ``${oc.env:VAR,default}``
    (omegaconf's forms that verl's configs use) through the whole tree."""

    def value_of(expr: str, container: list[str], depth: int) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.env:"):
            name, _, default = expr[len("oc.env:"):].partition(",")
            return os.environ.get(name.strip(), yaml.safe_load(default) if default.strip() else None)
        select = expr.startswith("oc.select:")
        key, _, default = expr[len("oc.select:"):].partition(",") if select else (expr, "", "")
        target = _target(key.strip(), container)
        try:
            found = _lookup(tree, target)
        except KeyError:
            if select:
                return yaml.safe_load(default) if default.strip() else None
            raise VerlConfigError(f"{'.'.join(container)}: interpolation ${{{expr}}} names no key of the "
                                  f"config") from None
        return resolved(found, target, depth + 1)  # relative keys inside it are relative to where it is

    def resolved(value: Any, path: list[str], depth: int = 0) -> Any:
        if depth > 32:
            raise VerlConfigError(f"{'.'.join(path)}: interpolations loop")
        if isinstance(value, dict):
            return {k: resolved(v, [*path, str(k)], depth) for k, v in value.items()}
        if isinstance(value, list):
            return [resolved(v, path, depth) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _INTERP.fullmatch(value.strip())
        if whole:
            return value_of(whole.group(1), path[:-1], depth)
        return _INTERP.sub(lambda m: str(value_of(m.group(1), path[:-1], depth)), value)

    return resolved(tree, [])


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


# ------------------------------------------------------------------------------------------------- converting
def installed_verl_config() -> Path | None:
    try:
        import verl  # noqa: F401
    except ImportError:
        return None
    path = Path(sys.modules["verl"].__file__).parent / "trainer" / "config" / "ppo_trainer.yaml"
    return path if path.exists() else None


def convert(flat: dict[str, Any], overridden: set[str]) -> tuple[dict[str, Any], list[tuple[str, Any, Any]], list[str]]:
    """(verl_mega keys → values, every verl key with its outcome, notes). Keys given as overrides are applied last,
    so they win over the YAML's where two verl keys set one verl_mega key."""
    ctx = Ctx(flat)
    ours: dict[str, Any] = {}
    source: dict[str, str] = {}
    rows = []
    for key in sorted(flat, key=lambda k: (k in overridden, k)):
        outcome = classify(key, flat[key], ctx)
        rows.append((key, flat[key], outcome))
        if isinstance(outcome, Map):
            for target, value in outcome.items.items():
                if target in ours and ours[target] != value:
                    ctx.notes.append(f"{target}: {source[target]}={ours[target]!r} and {key}={value!r} both set it; "
                                     f"kept {value!r}")
                ours[target], source[target] = value, key
    return ours, sorted(rows, key=lambda r: r[0]), list(dict.fromkeys(ctx.notes))


def nest(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for key, value in sorted(flat.items()):
        *parents, last = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def hub_notes(ours: dict[str, Any]) -> list[str]:
    """A note for each model path that is a hub ID: verl_mega takes it as verl does, through the hub's cache."""
    from verl_mega.config.hub import parse_model

    keys = ("model.path", "model.tokenizer_path", "critic.model_path", "reward.reward_model_path")
    return [f"{key}={ours[key]!r} is a Hugging Face hub ID: fetched into the Hugging Face cache when the job starts "
            f"(one process per node; HF_HUB_OFFLINE=1 uses the cache alone; pin a revision with "
            f"{ours[key]}@REVISION)" for key in keys if isinstance(ours.get(key), str) and parse_model(ours[key])]


def report(rows: list[tuple[str, Any, Any]], notes: list[str], problem: str | None) -> str:
    mapped = [r for r in rows if isinstance(r[2], Map)]
    same = [r for r in rows if isinstance(r[2], Same)]
    bad = [r for r in rows if isinstance(r[2], Unsupported)]
    lines = [f"{len(rows)} verl keys: {len(mapped)} mapped, {len(same)} the same in verl_mega (nothing to set), "
             f"{len(bad)} unsupported", "", "mapped:"]
    for key, value, outcome in mapped:
        targets = ", ".join(f"{k}={v!r}" for k, v in outcome.items.items())
        lines.append(f"  {key}={value!r} -> {targets}" + (f"  ({outcome.note})" if outcome.note else ""))
    for title, group in (("unsupported", bad), ("the same (nothing to set)", same)):
        lines += ["", f"{title}:"]
        by_reason: dict[str, list[str]] = {}
        for key, value, outcome in group:
            by_reason.setdefault(outcome.reason, []).append(f"{key}={value!r}" if title == "unsupported" else key)
        for reason, keys in by_reason.items():
            lines.append(f"  {reason}: {', '.join(keys)}")
    if notes:
        lines += ["", "notes:"] + [f"  {n}" for n in notes]
    if problem:
        lines += ["", f"the recipe does not load in verl_mega: {problem}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/from_verl.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("args", nargs="*", help="a verl trainer YAML (optional, first) and key=value overrides")
    ap.add_argument("-o", "--output", help="write the recipe here (default: stdout)")
    ap.add_argument("--report", help="also write the key-by-key report here")
    opts = ap.parse_args(argv)
    configs = [a for a in opts.args if a.endswith((".yaml", ".yml")) and "=" not in a]
    overrides = [a for a in opts.args if a not in configs]
    try:
        if len(configs) > 1:
            raise VerlConfigError(f"give one verl config, got {', '.join(configs)}")
        base = Path(configs[0]) if configs else installed_verl_config()
        if base is not None and not base.exists():
            raise VerlConfigError(f"verl config {base} not found")
        # `group=option` (no dot, e.g. model_engine=megatron) picks a config group's option, as on verl's command line
        choices = {t.split("=", 1)[0]: t.split("=", 1)[1] for t in overrides
                   if "=" in t and "." not in t.split("=", 1)[0] and not t.startswith(("+", "~"))}
        tree = compose(base, choices=choices) if base is not None else {}
        overridden = {apply_override(tree, text) for text in overrides}
        flat = flatten(resolve(tree))
    except VerlConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not flat:
        print("error: nothing to convert; give verl's trainer YAML and/or key=value overrides", file=sys.stderr)
        return 2
    ours, rows, notes = convert(flat, {k for k in flat if any(k == o or k.startswith(o + ".") for o in overridden)})
    notes += hub_notes(ours)
    if base is None:
        notes.insert(0, "no verl trainer YAML given and verl is not installed: only the overrides were converted; "
                        "verl's defaults for the other keys are not carried over (verl_mega's apply)")
    problem = None
    from verl_mega.config.loader import config_from_dict

    try:
        config_from_dict(nest(ours))
    except Exception as exc:  # noqa: BLE001 - reported, with the recipe still written for editing
        problem = " ".join(str(exc).split())
    header = [f"# verl_mega recipe converted by tools/from_verl.py from {base or 'overrides only'}"
              + (f" + {len(overrides)} override(s)" if overrides else ""),
              f"# {sum(isinstance(r[2], Map) for r in rows)} verl keys mapped, "
              f"{sum(isinstance(r[2], Unsupported) for r in rows)} unsupported (see the report); keys not listed keep "
              f"verl_mega's defaults (docs/configuration.md)"]
    header += [f"# {n}" for n in notes if n.startswith("launch")]
    text = "\n".join(header) + "\n" + yaml.safe_dump(nest(ours), sort_keys=False, default_flow_style=False)
    if opts.output:
        Path(opts.output).write_text(text)
    else:
        sys.stdout.write(text)
    full = report(rows, notes, problem)
    if opts.report:
        Path(opts.report).write_text(full)
    sys.stderr.write(full)
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
