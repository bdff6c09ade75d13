"""Load a :class:`TrainConfig` from a YAML recipe plus dotted CLI overrides; save and compare resolved configs.

YAML is read with a safe loader that follows YAML 1.2 for scalars: only `true`/`false` are booleans (so
`trainer.resume: off` stays the string "off") and `1e-6` is a float (YAML 1.1 would read it as a string).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from verl_mega.config.base import (ConfigError, build_section, check_known_keys, field_types, fmt, is_mapping_type,
                                   is_section_type, join_key, thaw, unknown_key_error)
from verl_mega.config.parallel import ParallelConfig
from verl_mega.config.train import TrainConfig

DEFAULTS_KEY = "defaults"  # a recipe key listing recipes it extends: `defaults: base.yaml` or `defaults: [a.yaml]`

_BOOL_TAG, _FLOAT_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:float"
_BOOL_12 = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
# Exponent floats without a dot (`1e-6`, `4E9`), which YAML 1.1's resolver leaves as strings.
_EXP_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class _RecipeLoader(yaml.SafeLoader):
    """yaml.SafeLoader with YAML 1.2 booleans and exponent floats, refusing duplicate keys (YAML forbids them;
    PyYAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice (lines {seen[key] + 1} and "
                                    f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class _RecipeDumper(yaml.SafeDumper):
    """yaml.SafeDumper that also quotes strings our loader would read as floats, e.g. '1e5'."""


_RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_RecipeLoader.add_implicit_resolver(_BOOL_TAG, _BOOL_12, list("tTfF"))
for _cls in (_RecipeLoader, _RecipeDumper):
    _cls.add_implicit_resolver(_FLOAT_TAG, _EXP_FLOAT, list("-+0123456789."))


def _parse_yaml(text: str, source: str, fix: str = "fix the YAML syntax") -> Any:
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        if "appears twice" in problem:  # our duplicate-key check: its own fix
            raise ConfigError(f"{source}{where}: {problem}") from None
        raise ConfigError(f"cannot parse {source}{where}: {problem}; {fix}") from None


def _missing_file_error(path: str, included_from: str | None) -> ConfigError:
    where = f" (included from {included_from})" if included_from else ""
    folder = os.path.dirname(path) or "."
    siblings = sorted(f for f in os.listdir(folder) if f.endswith((".yaml", ".yml"))) if os.path.isdir(folder) else []
    close = difflib.get_close_matches(os.path.basename(path), siblings, n=1)
    fix = f"did you mean {os.path.join(os.path.dirname(path), close[0])}?" if close else \
        "pass the path of a YAML recipe, e.g. configs/quickstart_cpu.yaml"
    return ConfigError(f"config file '{path}' does not exist{where}; {fix}")


def _read_text(path: str, where: str) -> str:
    """The recipe's text; a one-line error naming the file when it cannot be read or is not UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise ConfigError(f"config file '{path}'{where} cannot be read ({exc.strerror or exc}); check its "
                          f"permissions or give another recipe") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise ConfigError(f"config file '{path}'{where} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line}, "
                          f"column {column}); save it as UTF-8") from None


def _check_is_recipe(data: Mapping, path: str, where: str) -> None:
    """A mapping whose top-level keys include no config section (or `defaults:`), or whose keys are not names at all,
    is some other file (``defaults: /etc/passwd`` parses as one): refused naming the file only, never echoing its
    keys, which would print its content. A recipe with a mistyped section among real ones gets the usual unknown-key
    error instead, with a suggestion."""
    sections = set(field_types(TrainConfig))
    keys = list(data)
    names = all(isinstance(k, str) and _NAME.fullmatch(k) for k in keys)
    if names and any(k in sections or k == DEFAULTS_KEY for k in keys):
        return
    raise ConfigError(f"config file '{path}'{where} is not a verl_mega recipe: its top-level keys are not config "
                      f"sections ({', '.join(sorted(sections))}); give a YAML recipe, e.g. configs/quickstart_cpu.yaml")


def deep_merge(base: dict, override: Mapping) -> dict:
    """Return ``base`` updated by ``override``; nested mappings merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def load_recipe(path: str | os.PathLike, _chain: tuple[str, ...] = ()) -> dict:
    """Read a YAML recipe into a plain dict, applying its `defaults:` includes (paths relative to the recipe)."""
    path = os.fspath(path)
    real = os.path.realpath(path)
    if real in _chain:
        cycle = " -> ".join(os.path.basename(p) for p in (*_chain, real))
        raise ConfigError(f"recipe include cycle {cycle}; remove one of these `defaults:` entries")
    where = f" (included from {_chain[-1]})" if _chain else ""
    if os.path.isdir(path):
        raise ConfigError(f"config file '{path}'{where} is a directory; give a YAML recipe file, e.g. "
                          f"configs/quickstart_cpu.yaml")
    if not os.path.isfile(path):
        raise _missing_file_error(path, _chain[-1] if _chain else None)
    data = _parse_yaml(_read_text(path, where), path)
    if data is None or data == {}:
        raise ConfigError(f"config file '{path}' is empty; write the sections to change (e.g. `actor: {{lr: 1e-6}}`) "
                          f"or start from a recipe in configs/, e.g. configs/quickstart_cpu.yaml")
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}{where} must hold a mapping of config sections, got {type(data).__name__}; "
                          f"write it as `section: {{key: value}}`")
    _check_is_recipe(data, path, where)
    data = dict(data)
    includes = data.pop(DEFAULTS_KEY, None) or []
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError(f"{path}: `{DEFAULTS_KEY}:` must be a recipe path or a list of paths, got {fmt(includes)}")
    merged: dict = {}
    for include in includes:
        include_path = os.path.join(os.path.dirname(path), include)
        merged = deep_merge(merged, load_recipe(include_path, (*_chain, real)))
    return deep_merge(merged, data)


_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NAME = re.compile(r"[A-Za-z_]\w*")


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value`` and parse the value as YAML (ints, floats, bools, null, lists, mappings)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like key=value, e.g. actor.lr=1e-6")
    if not _KEY.fullmatch(key):
        raise ConfigError(f"override key {key!r} is not a dotted config key; write it like actor.lr=1e-6")
    return key, _parse_yaml(raw, f"the value of override {text!r}",
                            fix=f"quote values containing YAML syntax, e.g. {key}='a: b'")


def _override_target(key: str) -> tuple[bool, Any]:
    """Check ``key`` against the schema; (whether it names a whole section, its declared type: None for a key of a
    free-form mapping)."""
    cls, prefix = TrainConfig, ""
    parts = key.split(".")
    tp: Any = TrainConfig
    for i, part in enumerate(parts):
        dotted = join_key(prefix, part)
        types_ = field_types(cls)
        if part not in types_:
            raise unknown_key_error(dotted, cls, TrainConfig)
        tp = types_[part]
        if is_section_type(tp):
            cls, prefix = tp, dotted
            continue
        if is_mapping_type(tp):  # free-form mapping (e.g. reward.kwargs.scale): any sub-key is allowed
            return False, tp if i == len(parts) - 1 else None
        if i != len(parts) - 1:
            raise ConfigError(f"override key '{key}': {dotted} is a value, not a section; use {dotted}=<value>")
        return False, tp
    return True, tp


def _takes_null(tp: Any) -> bool:
    return tp is None or tp is Any or tp is type(None) or (
        typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp))


def apply_override(data: dict, text: str) -> dict:
    """Apply one ``key=value`` override to recipe data (in place) and return it. ``key=null`` sets null where the key
    takes it (e.g. parallel.vpp=null); elsewhere it unsets the key, whose default then applies (parallel.tp=null
    undoes a recipe's parallel.tp: 4)."""
    key, value = parse_override(text)
    is_section, tp = _override_target(key)
    *parents, leaf = key.split(".")
    if value is None and not _takes_null(tp):
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
        return data
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if is_section and isinstance(value, Mapping) and isinstance(node.get(leaf), Mapping):
        node[leaf] = deep_merge(dict(node[leaf]), value)
    else:
        node[leaf] = value
    return data


def _layout(data: Mapping) -> Any:
    parallel = data.get("parallel")
    return parallel.get("layout") if isinstance(parallel, Mapping) else None


def _auto_replaces_recipe_layout(recipe: dict, overrides: Sequence[str]) -> dict:
    """``parallel.layout=auto`` given as an override takes the layout from the planner in place of the recipe's:
    the recipe's pinned dims (parallel.tp, pp, …, sequence_parallel, and rollout.gen_tp) are dropped, as an override
    replaces what the recipe says. Dims the overrides set themselves still conflict with auto (ParallelConfig says
    so)."""
    if _layout(recipe) == "auto":
        return recipe  # the recipe's own contradiction, if any, is the recipe's to fix
    probe: dict = {}
    for text in overrides:
        apply_override(probe, text)
    if _layout(probe) != "auto" or not isinstance(recipe.get("parallel"), Mapping):
        return recipe
    recipe = {**recipe, "parallel": {k: v for k, v in recipe["parallel"].items() if k not in ParallelConfig.PLANNED}}
    if isinstance(recipe.get("rollout"), Mapping):  # the planner picks the generation TP with the training layout
        recipe["rollout"] = {k: v for k, v in recipe["rollout"].items() if k != "gen_tp"}
    return recipe


def config_from_dict(data: Mapping) -> TrainConfig:
    """Build and validate a TrainConfig from plain nested data (a recipe or a saved config)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a config must be a mapping of sections, got {type(data).__name__}")
    check_known_keys(data, TrainConfig, "")
    return build_section(TrainConfig, data, "")


def load_config(path: str | os.PathLike | None, overrides: Sequence[str] = (), *,
                check_paths: bool = True) -> TrainConfig:
    """Recipe (or all defaults when ``path`` is None) + dotted overrides → validated, resolved TrainConfig.

    ``check_paths`` also checks that referenced files exist (turn it off to inspect a recipe for another machine).
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not a single string")
    data = load_recipe(path) if path is not None else {}
    data = _auto_replaces_recipe_layout(data, overrides)
    for text in overrides:
        apply_override(data, text)
    cfg = config_from_dict(data)
    if check_paths:
        cfg.check_paths()
    return cfg


def to_dict(cfg: TrainConfig) -> dict:
    """Plain nested dict of a (resolved) config: lists for tuples, dicts for mappings."""
    return thaw(cfg)


def to_yaml(cfg: TrainConfig) -> str:
    """YAML text of the resolved config; `load_config` of it gives an equal config."""
    return yaml.dump(to_dict(cfg), Dumper=_RecipeDumper, sort_keys=False, default_flow_style=False)


def _flatten(data: Mapping, cls: type | None, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    types_ = field_types(cls) if cls is not None else {}
    for name, value in data.items():
        key = join_key(prefix, str(name))
        tp = types_.get(name)
        if isinstance(value, Mapping) and value and (cls is None or tp is None or is_section_type(tp)
                                                     or is_mapping_type(tp)):
            flat.update(_flatten(value, tp if is_section_type(tp) else None, key))
        else:
            flat[key] = list(value) if isinstance(value, tuple) else value
    return flat


def _affects_results(key: str) -> bool:
    """Whether ``key`` is result-changing; keys unknown to this version count as result-changing."""
    cls: Any = TrainConfig
    for part in key.split("."):
        if not is_section_type(cls):
            return True
        field = next((f for f in cls.__dataclass_fields__.values() if f.name == part), None)
        if field is None:
            return True
        tp = field_types(cls)[part]
        if not is_section_type(tp):
            flag = field.metadata.get("affects_results")
            return cls.AFFECTS_RESULTS if flag is None else flag
        cls = tp
    return True


def _default_of(key: str, missing: Any) -> Any:
    """The declared default of ``key``, or ``missing`` for keys unknown to this version or without a plain default."""
    cls: Any = TrainConfig
    for part in key.split("."):
        if not is_section_type(cls):
            return missing
        field = cls.__dataclass_fields__.get(part)
        if field is None:
            return missing
        tp = field_types(cls)[part]
        if not is_section_type(tp):
            if field.default is dataclasses.MISSING:
                return missing
            return list(field.default) if isinstance(field.default, tuple) else field.default  # as flattened
        cls = tp
    return missing


# The run length sets the LR schedule when a role decays over it (lr_decay_steps null).
_RUN_LENGTH_KEYS = ("trainer.total_steps", "trainer.total_epochs")


def _run_length_sets_schedule(flat: Mapping[str, Any]) -> bool:
    for role in ("actor", "critic"):
        if role == "critic" and not flat.get("critic.enable"):
            continue
        if flat.get(f"{role}.lr_decay_style", "constant") != "constant" and flat.get(f"{role}.lr_decay_steps") is None:
            return True
    return False


#: keys earlier versions accepted and never read, with their one value: a saved config holding it is compatible
_RETIRED = {"rollout.backend": "vllm"}


def diff_configs(a: TrainConfig | Mapping, b: TrainConfig | Mapping) -> list[str]:
    """Result-changing differences between two configs, as `key: old -> new` lines (empty when compatible).

    Not result-changing (ignored): `parallel.*` and `rollout.gen_tp` (a layout change reshards on load), `logging.*`,
    `checkpoint.*`, the trainer's run-control keys (output_dir, total_steps, total_epochs, save_every, resume*,
    log_every, val_every, profile, max_consecutive_nonfinite, collective_timeout_s), and performance-only keys
    (micro-batch sizes, dynamic batching, offload, recompute, use_te, vLLM memory and scheduling knobs,
    weight_sync, reward.num_workers). Exception: total_steps / total_epochs count when an LR schedule decays
    over the run length (`lr_decay_style` not constant and `lr_decay_steps` null); keys of a critic or reference
    that is disabled in both configs are ignored. A key the older config lacks (it predates the key) counts only
    when the newer config moves it off its default, which keeps the earlier behaviour. Everything else counts —
    see the "result-changing" column of docs/configuration.md.
    """
    flat_a = _flatten(to_dict(a) if isinstance(a, TrainConfig) else a, TrainConfig)
    flat_b = _flatten(to_dict(b) if isinstance(b, TrainConfig) else b, TrainConfig)
    length_matters = _run_length_sets_schedule(flat_a) or _run_length_sets_schedule(flat_b)
    unused_roles = {role for role in ("critic", "ref")
                    if flat_a.get(f"{role}.enable") is False and flat_b.get(f"{role}.enable") is False}
    missing = object()
    lines = []
    for key in list(flat_a) + [k for k in flat_b if k not in flat_a]:
        old, new = flat_a.get(key, missing), flat_b.get(key, missing)
        if old == new or key.partition(".")[0] in unused_roles:
            continue
        if old is missing and new == _default_of(key, missing) or new is missing and _RETIRED.get(key) == old:
            continue
        if not (_affects_results(key) or (key in _RUN_LENGTH_KEYS and length_matters)):
            continue
        old_text, new_text = ("<absent>" if v is missing else fmt(v) for v in (old, new))
        lines.append(f"{key}: {old_text} -> {new_text}")
    return lines
