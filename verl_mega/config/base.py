"""Building blocks shared by every config section.

A section is a keyword-only frozen dataclass deriving from :class:`ConfigSection`. Its ``__post_init__`` first
checks and normalises every field against its type annotation (so YAML, CLI overrides and Python construction
get the same one-line errors), then runs the section's own ``validate()``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal, Union

_NONE_TYPE = type(None)


class ConfigError(ValueError):
    """A bad configuration; the message is a single line naming the key and the fix."""

    def __init__(self, message: str) -> None:
        # Messages are printed as one line by the CLI, so fold any accidental line breaks.
        super().__init__(" ".join(str(message).split()))


class FrozenDict(Mapping):
    """Read-only, hashable, picklable mapping used for free-form config mappings (e.g. ``reward.kwargs``)."""

    __slots__ = ("_data",)

    def __init__(self, data: Mapping | None = None) -> None:
        object.__setattr__(self, "_data", dict(data or {}))

    def __getitem__(self, key: Any) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __hash__(self) -> int:
        return hash(frozenset(self._data.items()))

    def __repr__(self) -> str:
        return f"FrozenDict({self._data!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenDict is immutable")

    def __reduce__(self) -> tuple:
        return (FrozenDict, (self._data,))


def freeze(value: Any) -> Any:
    """Deep-freeze plain YAML data: mappings become FrozenDict, lists become tuples."""
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of :func:`freeze`: plain dicts and lists, ready for ``yaml.safe_dump``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: thaw(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def option(default: Any = dataclasses.MISSING, *, help: str, factory: Any = None,
           affects_results: bool | None = None) -> Any:
    """A documented config field.

    ``help`` is shown in docs/configuration.md. ``affects_results`` says whether changing the value changes
    training results (checked on resume); None inherits the section's ``AFFECTS_RESULTS``.
    """
    metadata = {"help": help, "affects_results": affects_results}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def fmt(value: Any) -> str:
    """Render a value the way a user would type it in YAML or an override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}"
    return repr(value)


def describe_type(tp: Any) -> str:
    """Human-readable type used in errors and in the generated reference."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " | ".join(describe_type(a) for a in typing.get_args(tp))
    if origin is Literal:
        return " | ".join(fmt(c).strip("'") for c in typing.get_args(tp))
    if tp is _NONE_TYPE:
        return "null"
    if origin is tuple:
        return f"list[{describe_type(typing.get_args(tp)[0])}]"
    if origin is Mapping or tp is Mapping:
        return "mapping"
    if isinstance(tp, type) and issubclass(tp, ConfigSection):
        return "section"
    return getattr(tp, "__name__", str(tp))


_HINTS: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a section's init fields, in declaration order."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    return _HINTS[cls]


def is_section_type(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, ConfigSection)


def is_mapping_type(tp: Any) -> bool:
    return tp is Mapping or typing.get_origin(tp) is Mapping


def _type_error(key: str, tp: Any, value: Any) -> ConfigError:
    return ConfigError(f"{key} expects {describe_type(tp)}, got {fmt(value)} ({type(value).__name__}); "
                       f"set {key} to a value of that type")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it normalised (int→float, list→tuple, dict→FrozenDict)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and _NONE_TYPE in args:
            return None
        for arg in args:
            if arg is _NONE_TYPE:
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        raise _type_error(key, tp, value)
    if origin is Literal:
        choices = typing.get_args(tp)
        if any(value == c and type(value) is type(c) for c in choices):
            return value
        hint = ""
        if isinstance(value, str):
            close = difflib.get_close_matches(value, [str(c) for c in choices], n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{key} must be one of {describe_type(tp)}, got {fmt(value)}{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        # `kv_cache_memory_bytes=4e9` parses as a float; accept integral floats for int keys.
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _type_error(key, tp, value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"{key} must be a finite number, got {fmt(value)}; set {key} to a finite value")
            return float(value)
        raise _type_error(key, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(key, tp, value)
    if origin is tuple:
        item_tp = typing.get_args(tp)[0]
        if isinstance(value, str) and item_tp is str:
            value = [value]  # a single path where a list is expected: `data.train_files=a.jsonl`
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, tp, value)
        return tuple(coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value))
    if is_mapping_type(tp):
        if not isinstance(value, Mapping):
            raise _type_error(key, tp, value)
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{key} keys must be strings, got {fmt(k)}; quote the key in YAML")
        return freeze(value)
    if is_section_type(tp):
        return build_section(tp, value, key)
    raise TypeError(f"unsupported config annotation {tp!r} for {key}")  # programming error, not user input


def build_section(cls: type, data: Any, prefix: str) -> Any:
    """Construct section ``cls`` from a mapping (or return it if it already is one)."""
    if isinstance(data, cls):
        return data
    where = prefix or "the config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of keys, got {fmt(data)}; write it as `{prefix}: {{key: value}}`")
    check_known_keys(data, cls, prefix, root=cls)
    return cls(**data)


def join_key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def iter_keys(cls: type, prefix: str = "") -> Iterator[str]:
    """All dotted keys of a section tree (sections and leaves)."""
    for name, tp in field_types(cls).items():
        key = join_key(prefix, name)
        yield key
        if is_section_type(tp):
            yield from iter_keys(tp, key)


def suggest_key(dotted: str, root: type, prefix: str = "") -> str | None:
    """Closest valid key to an unknown ``dotted`` key: a near sibling, the same name in another section (so
    `actor.tp` suggests `parallel.tp`), or a near name in another section."""
    keys = [join_key(prefix, k) for k in iter_keys(root)]
    parent, _, leaf = dotted.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return join_key(parent, close[0])
    same_name = [k for k in keys if k.rpartition(".")[2] == leaf]
    if same_name:
        return same_name[0]
    leaves = {k.rpartition(".")[2]: k for k in reversed(keys)}  # first key wins for a repeated name
    close = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return leaves[close[0]] if close else None


def unknown_key_error(dotted: str, section: type, root: type, root_prefix: str = "") -> ConfigError:
    """Error for a key that ``section`` (a part of the ``root`` tree) does not have."""
    suggestion = suggest_key(dotted, root, root_prefix)
    if suggestion:
        return ConfigError(f"unknown config key '{dotted}'; did you mean '{suggestion}'?")
    parent = dotted.rpartition(".")[0] or "the top level"
    valid = ", ".join(field_types(section))
    return ConfigError(f"unknown config key '{dotted}'; valid keys under {parent} are: {valid}")


def check_known_keys(data: Mapping, cls: type, prefix: str, *, root: type | None = None,
                     root_prefix: str | None = None) -> None:
    """Reject keys that are not fields of ``cls`` (recursively into sub-sections), with a suggestion."""
    root = root or cls
    root_prefix = prefix if root_prefix is None else root_prefix
    types_ = field_types(cls)
    for name, value in data.items():
        key = join_key(prefix, str(name))
        if name not in types_:
            raise unknown_key_error(key, cls, root, root_prefix)
        if is_section_type(types_[name]) and isinstance(value, Mapping):
            check_known_keys(value, types_[name], key, root=root, root_prefix=root_prefix)


class ConfigSection:
    """Base of every config section: type checks/normalises fields, then calls ``validate()``."""

    SECTION: ClassVar[str] = ""  # dotted prefix used in error messages, e.g. "actor" or "algorithm.kl_ctrl"
    AFFECTS_RESULTS: ClassVar[bool] = True  # default for fields whose option() leaves affects_results unset

    def __post_init__(self) -> None:
        for name, tp in field_types(type(self)).items():
            value = getattr(self, name)
            coerced = coerce(value, tp, self.key(name))
            if coerced is not value:
                object.__setattr__(self, name, coerced)
        self.validate()

    def validate(self) -> None:
        """Section-specific checks; override in subclasses."""

    @classmethod
    def key(cls, name: str) -> str:
        return join_key(cls.SECTION, name)

    def _set(self, name: str, value: Any) -> None:
        """Fill an auto (None) value during validation; sections are frozen afterwards."""
        object.__setattr__(self, name, value)

    def _require(self, ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    def changed(self, *names: str) -> list[str]:
        """Of ``names`` (default: every field), those set away from their declared default, in that order."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return [name for name in names or defaults if getattr(self, name) != defaults[name]]

    def said(self, name: str) -> str:
        """``section.name=value``, the value as a user would type it."""
        value = getattr(self, name)
        return f"{self.key(name)}={value:g}" if isinstance(value, float) else f"{self.key(name)}={fmt(value)}"

    def _check_range(self, name: str, *, ge: float | None = None, gt: float | None = None,
                     le: float | None = None, lt: float | None = None, example: Any = None) -> None:
        """Bound check on a numeric field (None values are skipped: they mean "auto")."""
        value = getattr(self, name)
        if value is None:
            return
        bounds = [(ge, ">=", value >= ge if ge is not None else True),
                  (gt, ">", value > gt if gt is not None else True),
                  (le, "<=", value <= le if le is not None else True),
                  (lt, "<", value < lt if lt is not None else True)]
        for bound, op, ok in bounds:
            if bound is not None and not ok:
                key = self.key(name)
                fix = f", e.g. {key}={fmt(example)}" if example is not None else ""
                raise ConfigError(f"{key} must be {op} {fmt(bound)}, got {fmt(value)}; set {key} to a value "
                                  f"{op} {fmt(bound)}{fix}")
