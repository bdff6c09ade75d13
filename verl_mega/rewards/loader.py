"""Load a reward function by name: a built-in, a dotted path, or a file path, and check its signature.

Accepted specs:

* a built-in name: ``gsm8k``, ``gsm8k_flexible``, ``math``, ``math_dapo``, ``by_data_source``, ``format``,
  ``arithmetic``, ``calculator``
* ``pkg.module:fn`` or ``pkg.module.fn``
* ``path/to/file.py:fn`` (or ``path/to/file.py``, which loads ``compute_score``): a file and a function, as verl's
  ``custom_reward_function.path`` and ``.name`` name them

Two contracts are accepted, each per sample or batched:

* **verl's**, recognised by a parameter named ``solution_str`` (batched: ``solution_strs``):
  ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, called by keyword as verl calls it,
  with the row's ``data_source`` and ``extra_info`` (``{}`` when the row has none); batched:
  ``compute_score(data_sources, solution_strs, ground_truths, extra_infos)`` with lists.
* **ours**: ``fn(response, ground_truth, **extras)``; batched ``fn(responses, ground_truths, **extras)`` with lists,
  when ``batched=True`` is passed, the function carries ``fn.batched = True``, or its first parameter is named
  ``responses``. Extras (the row's other fields: ``data_source``, ``extra_info``, ...) are passed only if the
  function takes them (by name or through ``**kwargs``).

Fixed ``reward_kwargs`` are passed by keyword to either. A function returns a float, or a dict with a ``score`` and
other values: the numeric ones are kept per sample (:meth:`RewardFunction.score_batch_info`), and the trainer logs
their step means as ``reward/<key>``.

A user's file or module is code that runs with the trainer's rights. The trainer never imports it itself: it checks
it with :func:`check_user_code`, in a short-lived process that must import it and check its function within
:data:`IMPORT_TIMEOUT_S`; the reward workers (:mod:`verl_mega.rewards.pool`) and the tool worker import it again,
under the same bound.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import signal
import subprocess
import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

__all__ = ["RewardFunctionError", "RewardFunction", "load_reward_fn", "BUILTIN_REWARDS", "to_score", "score_info",
           "ACCEPTED_FORMS", "IMPORT_TIMEOUT_S", "check_user_code", "import_too_slow"]

BUILTIN_REWARDS = {
    "gsm8k": "verl_mega.rewards.math_reward:compute_score",
    "gsm8k_flexible": "verl_mega.rewards.math_reward:compute_score",
    "math": "verl_mega.rewards.math_equiv:math_score",
    "math_dapo": "verl_mega.rewards.math_equiv:dapo_score",
    "by_data_source": "verl_mega.rewards.math_equiv:score_by_source",
    "format": "verl_mega.rewards.math_reward:format_reward",
    "arithmetic": "verl_mega.rewards.math_reward:arithmetic_score",
    "calculator": "verl_mega.data.calculator:calculator_score",
}
_BUILTIN_KWARGS = {"gsm8k_flexible": {"method": "flexible"}}
_DEFAULT_FN_NAME = "compute_score"
# the function of a run that a reward model alone scores (reward.reward_model_path without reward.function)
NO_REWARD_FUNCTION = "verl_mega.rewards.loader:no_reward"
# verl's reward functions: the names verl passes by keyword (verl/workers/reward_manager/naive.py and batch.py)
VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
VERL_BATCH_PARAMS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
ACCEPTED_FORMS = ("verl's compute_score(data_source, solution_str, ground_truth, extra_info=None) (batched: "
                  "compute_score(data_sources, solution_strs, ground_truths, extra_infos)), called by keyword; or "
                  "fn(response, ground_truth, **extras) (batched: fn(responses, ground_truths, **extras))")
Contract = Literal["ours", "verl"]
#: how long importing a user's reward or tool module (and checking its function) may take, in the trainer's check
#: and in each worker process that loads it
IMPORT_TIMEOUT_S = 60.0


def no_reward(response: str, ground_truth: Any) -> float:
    """0 for every response: the reward model's score is then the whole reward."""
    return 0.0


class RewardFunctionError(ValueError):
    """A reward function spec that cannot be loaded, or a function with an unusable signature."""


def _number(value: Any) -> float | None:
    """``value`` as a float when it is a number (bool, int, float, numpy / 0-d tensor scalar), else None."""
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (bool, int, float)):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # an array of several values
            return None
    return float(value) if isinstance(value, (bool, numbers.Real)) else None


def to_score(value: Any) -> float:
    """A user function's return value as a finite float (bool/int/float/numpy/0-d tensor, or a dict with 'score')."""
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"returned a dict without a 'score' key (keys: {sorted(value)})")
        value = value["score"]
    score = _number(value)
    if score is None:
        raise TypeError(f"returned {type(value).__name__}; a reward function must return a float")
    if not math.isfinite(score):
        raise ValueError(f"returned a non-finite score ({score})")
    return score


def score_info(value: Any) -> dict[str, float]:
    """The other numeric, finite values of a dict return (verl's reward_extra_info), by key; {} for a float."""
    if not isinstance(value, Mapping):
        return {}
    out = {}
    for key, item in value.items():
        number = _number(item) if key != "score" else None
        if number is not None and math.isfinite(number):
            out[str(key)] = number
    return out


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function plus what is needed to call it uniformly and to re-load it in a worker process."""

    fn: Callable[..., Any]
    batched: bool
    name: str
    spec: str | None = None  # re-loadable description (None when given a callable directly)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
    accepted_extras: frozenset[str] | None = None  # None: takes **kwargs, so every extra is passed
    contract: Contract = "ours"

    def _extras(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        merged = {**(extra or {}), **self.reward_kwargs}
        if self.accepted_extras is None:
            return merged
        return {k: v for k, v in merged.items() if k in self.accepted_extras}

    def _verl_kwargs(self, names: Sequence[str], values: Sequence[Any]) -> dict[str, Any]:
        kwargs = {**dict(zip(names, values)), **self.reward_kwargs}
        if self.accepted_extras is None:
            return kwargs
        return {k: v for k, v in kwargs.items() if k in self.accepted_extras}

    def _call_one(self, response: str, ground_truth: Any, extra: Mapping[str, Any] | None) -> Any:
        extra = extra or {}
        if self.contract == "verl":
            return self.fn(**self._verl_kwargs(VERL_PARAMS, (extra.get("data_source"), response, ground_truth,
                                                             _extra_info(extra))))
        return self.fn(response, ground_truth, **self._extras(extra))

    def _call_batch(self, responses: list[str], ground_truths: list[Any],
                    extras: list[Mapping[str, Any]]) -> list[Any]:
        if self.contract == "verl":
            out = self.fn(**self._verl_kwargs(VERL_BATCH_PARAMS, (
                [e.get("data_source") for e in extras], responses, ground_truths, [_extra_info(e) for e in extras])))
        else:  # per-sample extras as lists under the same names
            keys = set().union(*(e.keys() for e in extras)) if extras else set()
            listed = {k: [e.get(k) for e in extras] for k in keys}
            out = self.fn(responses, ground_truths, **self._extras(listed))
        if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
            raise TypeError(f"batched reward function returned {type(out).__name__}; return a list of floats (or "
                            f"of dicts with a 'score')")
        out = list(out.tolist() if hasattr(out, "tolist") else out)
        if len(out) != len(responses):
            raise ValueError(f"batched reward function returned {len(out)} scores for {len(responses)} responses")
        return out

    def score_one(self, response: str, ground_truth: Any, extra: Mapping[str, Any] | None = None) -> float:
        return self.score_batch([response], [ground_truth], [extra or {}])[0]

    def score_batch(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extras: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[float]:
        return self.score_batch_info(responses, ground_truths, extras)[0]

    def score_batch_info(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        extras: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[float], list[dict[str, float]]]:
        """Scores, and each sample's other numeric values of a dict return ({} for a float return)."""
        extras = list(extras) if extras is not None else [{} for _ in responses]
        if self.batched:
            raw = self._call_batch(list(responses), list(ground_truths), extras)
        else:
            raw = [self._call_one(r, g, e) for r, g, e in zip(responses, ground_truths, extras, strict=True)]
        return [to_score(v) for v in raw], [score_info(v) for v in raw]


def _extra_info(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The row's ``extra_info`` as verl passes it: a dict of its own ({} when the row has none)."""
    info = extra.get("extra_info")
    return dict(info) if isinstance(info, Mapping) else ({} if info is None else info)


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


def _params(fn: Callable[..., Any]) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None  # builtins/C functions without a signature


def _contract(fn: Callable[..., Any], params: list[inspect.Parameter] | None,
              batched: bool | None) -> tuple[Contract, bool]:
    """(contract, batched): verl's when a parameter is named solution_str(s), ours otherwise."""
    names = {p.name for p in params or ()}
    if "solution_strs" in names:
        return "verl", True
    if "solution_str" in names:
        return "verl", False
    if batched is None:
        batched = bool(getattr(fn, "batched", False)) or (params[0].name == "responses" if params else False)
    return "ours", batched


def _check_signature(fn: Callable[..., Any], name: str, contract: Contract, batched: bool,
                     params: list[inspect.Parameter] | None, given: frozenset[str]) -> frozenset[str] | None:
    """Whether ``fn`` can be called in its contract, with ``given`` keyword arguments (reward_kwargs) on top; returns
    the keyword names it accepts (None: any, through **kwargs)."""
    if params is None:
        return None  # trust it
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    if contract == "verl":
        passed = set(VERL_BATCH_PARAMS if batched else VERL_PARAMS) | given
        positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY]
        required = [p.name for p in params if p.default is p.empty and p.kind in
                    (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in passed]
        if positional_only or required:
            what = (f"positional-only parameter(s) {', '.join(positional_only)}" if positional_only else
                    f"required parameter(s) {', '.join(required)} that verl's contract does not pass")
            raise RewardFunctionError(f"reward function '{name}' has {what}; give them defaults or pass them via "
                                      f"reward.kwargs. Accepted forms: {ACCEPTED_FORMS}")
        return None if takes_any else frozenset(p.name for p in params if p.kind is not p.VAR_POSITIONAL)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    if len(positional) < 2 and not has_varargs:
        raise RewardFunctionError(
            f"reward function '{name}' takes {len(positional)} positional parameter(s), which fits neither "
            f"accepted form: {ACCEPTED_FORMS}")
    required = [p.name for p in positional[2:] if p.default is p.empty and p.name not in given]
    required += [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name not in given]
    if required:
        raise RewardFunctionError(
            f"reward function '{name}' has required parameter(s) {', '.join(required)} beyond (response, "
            f"ground_truth); give them defaults or pass them via reward.kwargs. Accepted forms: {ACCEPTED_FORMS}")
    if takes_any:
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
    missing or the signature fits neither accepted form.
    """
    kwargs = dict(reward_kwargs or {})
    if callable(spec) and not isinstance(spec, str):
        fn, name, spec_text = spec, getattr(spec, "__qualname__", repr(spec)), None
    elif isinstance(spec, str):
        spec_text = spec.strip()
        if spec_text in BUILTIN_REWARDS:
            kwargs = {**_BUILTIN_KWARGS.get(spec_text, {}), **kwargs}
            fn, _ = _resolve(BUILTIN_REWARDS[spec_text])
        else:
            fn, _ = _resolve(spec_text)
        name = spec_text
    else:
        raise RewardFunctionError(f"reward function spec must be a string or a callable, got {type(spec).__name__}")
    if not callable(fn):
        raise RewardFunctionError(f"reward function '{name}' is a {type(fn).__name__}, not callable")
    params = _params(fn)
    contract, is_batched = _contract(fn, params, batched)
    accepted = _check_signature(fn, name, contract, is_batched, params, frozenset(kwargs))
    if accepted is not None:
        unknown = sorted(set(kwargs) - accepted)
        if unknown:
            raise RewardFunctionError(
                f"reward_kwargs {', '.join(unknown)} are not parameters of reward function '{name}'; "
                f"it accepts: {', '.join(sorted(accepted)) or 'none'}"
            )
    return RewardFunction(fn=fn, batched=is_batched, name=name, spec=spec_text, reward_kwargs=kwargs,
                          accepted_extras=accepted, contract=contract)


# ------------------------------------------------------------------------------------ the bounded check of user code
def _is_user_code(spec: str) -> bool:
    """Whether loading ``spec`` imports code that is not this package's (a file, or another package's module)."""
    text = spec.strip()
    if text in BUILTIN_REWARDS:
        return False
    module_part, sep, _ = text.rpartition(":")
    module_part = module_part if sep else text
    is_file = module_part.endswith(".py") or "/" in module_part or os.sep in module_part
    return is_file or not (module_part == "verl_mega" or module_part.startswith("verl_mega."))


def import_too_slow(what: str, spec: str, limit_s: float, where: str) -> str:
    """The one-line error for a user module whose import (or function check) did not return in time."""
    return (f"{what} '{spec}': importing it did not return within {limit_s:g} s in {where} (a module-level wait, "
            f"download or model load?); make the import quick: do slow set-up inside the function, once, on its "
            f"first call")


def check_user_code(spec: str, *, what: str = "reward function", reward_kwargs: Mapping[str, Any] | None = None,
                    timeout_s: float | None = None) -> None:
    """Load ``spec`` (``file.py:fn``, ``pkg.module:fn``) and check its function as :func:`load_reward_fn` does (or
    as a tool: that it exists), in a short-lived child process ended after ``timeout_s``: a user's module is code
    whose import may never return, and this process must not run it. Raises :class:`RewardFunctionError` with one
    line. This package's own functions are checked here, in-process. ``timeout_s``: default IMPORT_TIMEOUT_S."""
    timeout_s = IMPORT_TIMEOUT_S if timeout_s is None else timeout_s
    if not _is_user_code(spec):
        if what == "reward function":
            load_reward_fn(spec, reward_kwargs=reward_kwargs)
        else:
            load_callable(spec, what=what)
        return
    request = json.dumps({"spec": spec, "what": what, "kwargs": sorted(reward_kwargs or {}), "path": sys.path})
    root = str(Path(__file__).resolve().parents[2])  # this checkout, wherever the interpreter was started
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    # a session of its own: whatever the module starts goes with it; what it prints goes to our stderr
    proc = subprocess.Popen([sys.executable, "-c", "from verl_mega.rewards.loader import _check_child; _check_child()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(request + "\n", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
    if out is None:
        raise RewardFunctionError(import_too_slow(what, spec, timeout_s, "a check process"))
    try:
        error = json.loads(out.strip().splitlines()[-1])["error"]
    except (IndexError, ValueError, KeyError, TypeError):
        code = proc.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        raise RewardFunctionError(f"{what} '{spec}': importing it ended the check process ({how}) before it could "
                                  f"answer (what it printed is above); fix the module so that it imports") from None
    if error:
        raise RewardFunctionError(error)


def die_with_parent() -> None:
    """For a process that runs user code for this one: SIGKILL it when its parent dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG; the parent is the thread that started it), and end it now if the parent is already gone."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        return
    if os.getppid() != parent or parent == 1:  # the parent ended before the signal was armed
        os._exit(1)


def _check_child() -> None:
    """The check process of :func:`check_user_code`: one JSON request on stdin, one JSON answer on stdout."""
    die_with_parent()  # in a session of its own, which the rank's group kill does not reach
    request = json.loads(sys.stdin.readline())
    sys.path[:] = request["path"]
    answer = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the module prints goes to stderr, with the trainer's output
    spec, what = request["spec"], request["what"]
    try:
        if what == "reward function":
            load_reward_fn(spec, reward_kwargs=dict.fromkeys(request["kwargs"]))
        else:
            load_callable(spec, what=what)
        error = ""
    except RewardFunctionError as exc:
        error = " ".join(str(exc).split())
    except BaseException as exc:  # noqa: BLE001 - whatever the user's module raises is reported in one line
        error = f"{what} '{spec}' cannot be loaded: {type(exc).__name__}: {' '.join(str(exc).split())}"
    answer.write(json.dumps({"error": error}) + "\n")
    answer.flush()
    os._exit(0)  # threads the module started are not waited for
