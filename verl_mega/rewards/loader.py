"""Load a reward function by name: a built-in, a dotted path, or a file path, and check its signature.

Accepted specs:

* a built-in name: ``gsm8k``, ``gsm8k_flexible``, ``format``, ``arithmetic``, ``calculator``
* ``pkg.module:fn`` or ``pkg.module.fn``
* ``path/to/file.py:fn`` (or ``path/to/file.py``, which loads ``compute_score``)

A per-sample function is called as ``fn(response, ground_truth, **extras)``; a batched one as
``fn(responses, ground_truths, **extras)`` with lists and must return a list of floats. A function is batched when
``batched=True`` is passed, when it carries ``fn.batched = True``, or when its first parameter is named ``responses``.
Extras (``data_source``, ``extra_info``, ... plus fixed ``reward_kwargs``) are passed only if the function takes them
(by name or through ``**kwargs``).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = ["RewardFunctionError", "RewardFunction", "load_reward_fn", "BUILTIN_REWARDS", "to_score"]

BUILTIN_REWARDS = {
    "gsm8k": "verl_mega.rewards.math_reward:compute_score",
    "gsm8k_flexible": "verl_mega.rewards.math_reward:compute_score",
    "format": "verl_mega.rewards.math_reward:format_reward",
    "arithmetic": "verl_mega.rewards.math_reward:arithmetic_score",
    "calculator": "verl_mega.data.calculator:calculator_score",
}
_BUILTIN_KWARGS = {"gsm8k_flexible": {"method": "flexible"}}
_DEFAULT_FN_NAME = "compute_score"


class RewardFunctionError(ValueError):
    """A reward function spec that cannot be loaded, or a function with an unusable signature."""


def to_score(value: Any) -> float:
    """A user function's return value as a finite float (bool/int/float/numpy/0-d tensor, or a dict with 'score')."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"returned a dict without a 'score' key (keys: {sorted(value)})")
        value = value["score"]
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if not isinstance(value, (bool, int, float)):
        raise TypeError(f"returned {type(value).__name__}; a reward function must return a float")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score ({score})")
    return score


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function plus what is needed to call it uniformly and to re-load it in a worker process."""

    fn: Callable[..., Any]
    batched: bool
    name: str
    spec: str | None = None  # re-loadable description (None when given a callable directly)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    accepted_extras: frozenset[str] | None = None  # None: takes **kwargs, so every extra is passed

    def _extras(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        merged = {**(extra or {}), **self.reward_kwargs}
        if self.accepted_extras is None:
            return merged
        return {k: v for k, v in merged.items() if k in self.accepted_extras}

    def score_one(self, response: str, ground_truth: Any, extra: Mapping[str, Any] | None = None) -> float:
        if self.batched:
            return self.score_batch([response], [ground_truth], [extra or {}])[0]
        return to_score(self.fn(response, ground_truth, **self._extras(extra)))

    def score_batch(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extras: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[float]:
        extras = list(extras) if extras is not None else [{} for _ in responses]
        if not self.batched:
            return [self.score_one(r, g, e) for r, g, e in zip(responses, ground_truths, extras, strict=True)]
        # Batched functions get per-sample extras as lists under the same names.
        keys = set().union(*(e.keys() for e in extras)) if extras else set()
        listed = {k: [e.get(k) for e in extras] for k in keys}
        kwargs = self._extras(listed)
        out = self.fn(list(responses), list(ground_truths), **kwargs)
        if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
            raise TypeError(f"batched reward function returned {type(out).__name__}; return a list of floats")
        out = list(out.tolist() if hasattr(out, "tolist") else out)
        if len(out) != len(responses):
            raise ValueError(f"batched reward function returned {len(out)} scores for {len(responses)} responses")
        return [to_score(v) for v in out]


def _import_module_from_file(path: str, spec_text: str, what: str):
    if not os.path.isfile(path):
        raise RewardFunctionError(
            f"{what} file '{path}' not found (from '{spec_text}'); give an existing .py path or a dotted "
            "module path like 'my_pkg.rewards:score'"
        )
    real = os.path.realpath(path)
    mod_name = "verl_mega_user_reward_" + hashlib.sha1(real.encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module_spec = importlib.util.spec_from_file_location(mod_name, real)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module  # registered so functions defined there can be pickled by reference
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise RewardFunctionError(
            f"importing {what} file '{path}' failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _import_module(name: str, spec_text: str, what: str):
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise RewardFunctionError(
            f"could not import module '{name}' for {what} '{spec_text}' ({type(exc).__name__}: {exc}); "
            "check the module is installed or on PYTHONPATH"
        ) from exc


def _resolve(spec_text: str, what: str = "reward function") -> tuple[Callable[..., Any], str]:
    text = spec_text.strip()
    if not text:
        raise RewardFunctionError(f"empty {what} spec; give e.g. 'my_pkg.module:function'")
    module_part, sep, fn_name = text.rpartition(":")
    if not sep:  # no colon: a file path, or pkg.module.fn
        module_part, fn_name = text, ""
    is_file = module_part.endswith(".py") or "/" in module_part or os.sep in module_part
    if is_file:
        module = _import_module_from_file(module_part, text, what)
        fn_name = fn_name or _DEFAULT_FN_NAME
    elif sep:
        module = _import_module(module_part, text, what)
    else:
        module_name, _, fn_name = text.rpartition(".")
        if not module_name:
            choices = ", ".join(sorted(BUILTIN_REWARDS))
            raise RewardFunctionError(
                f"{what} '{text}' is neither a built-in ({choices}) nor 'module:function' / "
                "'module.function' / 'file.py:function'"
            )
        module = _import_module(module_name, text, what)
    fn = getattr(module, fn_name, None)
    if fn is None:
        available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        where = module_part if is_file else module.__name__
        raise RewardFunctionError(
            f"'{where}' has no function '{fn_name}' (from '{text}'); available: {', '.join(available) or 'none'}"
        )
    return fn, fn_name


def load_callable(spec: str, *, what: str) -> Callable[..., Any]:
    """A user function given as ``pkg.module:fn``, ``pkg.module.fn`` or ``file.py:fn`` (tools, reward functions)."""
    return _resolve(spec, what)[0]


def _check_signature(fn: Callable[..., Any], name: str) -> frozenset[str] | None:
    """Needs two positional slots and no other required parameter; returns the extras it accepts by name."""
    if not callable(fn):
        raise RewardFunctionError(f"reward function '{name}' is a {type(fn).__name__}, not callable")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # builtins/C functions without a signature: trust them
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not has_varargs:
        raise RewardFunctionError(
            f"reward function '{name}' takes {len(positional)} positional parameter(s); it must be "
            "fn(response: str, ground_truth, **kwargs) -> float (or the batched form with lists)"
        )
    required = [p.name for p in positional[2:] if p.default is p.empty]
    required += [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if required:
        raise RewardFunctionError(
            f"reward function '{name}' has required parameter(s) {', '.join(required)} beyond (response, "
            "ground_truth); give them defaults or pass them via reward_kwargs"
        )
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params[2:] if p.kind is not p.VAR_POSITIONAL)


def load_reward_fn(
    spec: str | Callable[..., Any],
    *,
    batched: bool | None = None,
    reward_kwargs: Mapping[str, Any] | None = None,
) -> RewardFunction:
    """Resolve ``spec`` (see the module docstring) into a checked :class:`RewardFunction`.

    Raises :class:`RewardFunctionError` (a ``ValueError``) with a one-line message when the module/file/function is
    missing or the signature does not fit.
    """
    kwargs = dict(reward_kwargs or {})
    if callable(spec) and not isinstance(spec, str):
        fn, name, spec_text = spec, getattr(spec, "__qualname__", repr(spec)), None
    elif isinstance(spec, str):
        spec_text = spec.strip()
        if spec_text in BUILTIN_REWARDS:
            kwargs = {**_BUILTIN_KWARGS.get(spec_text, {}), **kwargs}
            fn, _ = _resolve(BUILTIN_REWARDS[spec_text])
            name = spec_text
        else:
            fn, _ = _resolve(spec_text)
            name = spec_text
    else:
        raise RewardFunctionError(f"reward function spec must be a string or a callable, got {type(spec).__name__}")
    accepted = _check_signature(fn, name)
    if batched is None:
        batched = bool(getattr(fn, "batched", False)) or _first_param(fn) == "responses"
    if accepted is not None:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise RewardFunctionError(
                f"reward_kwargs {', '.join(unknown)} are not parameters of reward function '{name}'; "
                f"it accepts: {', '.join(sorted(accepted)) or 'none'}"
            )
    return RewardFunction(
        fn=fn, batched=batched, name=name, spec=spec_text, reward_kwargs=kwargs, accepted_extras=accepted
    )


def _first_param(fn: Callable[..., Any]) -> str:
    try:
        return next(iter(inspect.signature(fn).parameters), "")
    except (TypeError, ValueError):
        return ""
