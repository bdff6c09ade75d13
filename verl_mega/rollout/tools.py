"""Tools a policy can call in a multi-turn episode: a registry of Python functions, and a sandboxed interpreter.

A tool is a function ``fn(arguments) -> str`` (``arguments`` is the call's text, or keyword arguments when the call
is JSON). Built-ins: ``calc`` (exact arithmetic on an expression, no ``eval``) and ``python`` (runs the code in a
fresh interpreter in a sandbox, and returns what it printed). Any other tool is
given as ``pkg.module:fn`` or ``file.py:fn``.

Every call runs in a worker process (:class:`ToolRunner`): a call that hangs past the time limit, crashes the worker
or prints megabytes is cut off, reported as an error string the policy sees as the tool's answer (and counted), and
the episode goes on. A tool answers an error by raising :class:`ToolError` (bad arguments: the policy's mistake, as
are JSON argument names the function does not take);
a call that times out, crashes its worker or raises anything else has *failed* (the tool's fault), which
``rollout.multi_turn.max_tool_failure_frac`` bounds.

The ``python`` tool runs the code in a sandbox (:mod:`verl_mega.rollout.sandbox`): new user, PID, mount and network
namespaces, a minimal read-only file tree with an empty scratch directory, no capabilities, and limits on processes,
memory, CPU time, open files and output; every process the code starts is killed when the call returns or times
out. Where namespaces are not permitted it degrades (no file or network isolation), and the run says so. Tools given
as ``pkg.module:fn`` or ``file.py:fn`` are not sandboxed: they run in the worker with this process's user and rights.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import logging
import operator
import os
import select
import signal
import subprocess
import sys
from typing import Any, Callable, NamedTuple

from verl_mega.rollout import sandbox
from verl_mega.rollout.sandbox import SandboxLimits

log = logging.getLogger("verl_mega.rollout")
PYTHON_TOOL_RISK = ("rollout.multi_turn.tools lists `python`: model-written code runs on this machine, in a sandbox "
                    "(namespaces, rlimits, no capabilities) that shares its kernel: a kernel exploit escapes it, and "
                    "CPU side channels are not closed. Run such jobs in a container or VM that holds nothing else")
MAX_OUTPUT_CHARS = 4096  # a tool's answer is cut here (and again to the token limit of the episode)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


def calc(expression: str) -> str:
    """Exact arithmetic: numbers, + - * / // % ** and parentheses (exponents up to 64)."""
    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    try:
        result = value(ast.parse(expression.strip(), mode="eval").body)
    except (ValueError, SyntaxError, ArithmeticError, TypeError) as exc:  # the expression's fault, not the tool's
        raise ToolError(f"{type(exc).__name__}: {exc}") from None
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


class ToolError(Exception):
    """An error the tool answers (for example to arguments it cannot use), shown to the policy as
    ``error: <message>``; any other exception is a failure of the tool."""


class ToolsFailed(RuntimeError):
    """More than rollout.multi_turn.max_tool_failure_frac of a step's tool calls failed."""


class Answer(NamedTuple):
    ok: bool  # the tool answered, without an error
    text: str  # what the policy reads
    failed: bool = False  # the call failed: it timed out, crashed its worker, raised, or was not run


def python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, network: bool = False) -> str:
    """Run ``code`` in a new interpreter in a sandbox (:mod:`verl_mega.rollout.sandbox`: its own namespaces, an empty
    environment and scratch directory, limits on processes, CPU time, memory, open files and output; no network
    unless ``network``) and return what it printed; raises :class:`ToolError` with stderr's last line, or the limit
    it hit."""
    limits = SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, network=network,
                           output_bytes=MAX_OUTPUT_CHARS * 4)  # a print past this is stopped (EFBIG, SIGXFSZ)
    result = sandbox.run(code, limits)
    if result.timed_out:
        raise ToolError(f"timed out after {timeout_s:g} s")
    if result.returncode == -signal.SIGXFSZ or len(result.stdout) >= limits.output_bytes:
        raise ToolError(f"output exceeded {limits.output_bytes} bytes")
    if result.returncode != 0:
        stderr = result.stderr.decode(errors="replace")
        raise ToolError((stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1])
    return result.stdout.decode(errors="replace")


BUILTIN_TOOLS: dict[str, Callable[..., str]] = {"calc": calc, "python": python}


def load_tool(spec: str) -> Callable[..., str]:
    """A built-in tool name, ``pkg.module:fn`` or ``file.py:fn`` (imported here: in the tool worker)."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    from verl_mega.rewards.loader import load_callable

    _check_form(spec)
    return load_callable(spec, what="tool")


def check_tool(spec: str) -> None:
    """Whether ``spec`` loads, checked without importing a user's module here: in a short-lived process, bounded by
    ``IMPORT_TIMEOUT_S`` (:func:`verl_mega.rewards.loader.check_user_code`)."""
    if spec in BUILTIN_TOOLS:
        return
    from verl_mega.rewards.loader import check_user_code

    _check_form(spec)
    check_user_code(spec, what="tool")


def _check_form(spec: str) -> None:
    if ":" not in spec and "." not in spec:
        raise ValueError(f"rollout.multi_turn.tools: {spec!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor "
                         f"'pkg.module:fn' / 'file.py:fn'")


def tool_name(spec: str) -> str:
    """The name the policy calls a tool by: the built-in name, or the function's name."""
    return spec if spec in BUILTIN_TOOLS else spec.rpartition(":")[2] or spec.rpartition(".")[2]


def _unbound(fn: Callable[..., str], arguments: dict[str, Any]) -> str:
    """Why ``fn`` cannot take these keyword arguments ('' when it can, or when it has no signature to check)."""
    try:
        inspect.signature(fn).bind(**arguments)
    except TypeError as exc:
        return str(exc)
    except ValueError:  # a callable without an inspectable signature
        pass
    return ""


def _answer(tools: dict[str, Callable[..., str]], name: str, arguments: Any) -> Answer:
    try:
        fn = tools[name]
        if isinstance(arguments, dict) and (wrong := _unbound(fn, arguments)):
            return Answer(False, f"error: {name}: {wrong}"[:MAX_OUTPUT_CHARS])  # the policy's mistake, not a failure
        out = str(fn(**arguments) if isinstance(arguments, dict) else fn(arguments))
    except ToolError as exc:
        return Answer(False, f"error: {exc}"[:MAX_OUTPUT_CHARS])
    except Exception as exc:  # noqa: BLE001 - the policy sees the error as the tool's answer
        return Answer(False, f"error: {type(exc).__name__}: {exc}"[:MAX_OUTPUT_CHARS], failed=True)
    if len(out) > MAX_OUTPUT_CHARS:
        return Answer(False, f"{out[:MAX_OUTPUT_CHARS]} ... error: answer cut at {MAX_OUTPUT_CHARS} of {len(out)} "
                             f"characters")
    return Answer(True, out)


def _serve(setup: str) -> None:
    """The worker (``python -m verl_mega.rollout.tools SETUP``): one JSON call per line on stdin, one JSON answer
    per line on the original stdout; whatever the tools themselves print goes to /dev/null."""
    config = json.loads(setup)
    sandbox.die_with_parent(config["parent"])  # a trainer killed outright takes its tools (and their boxes) along
    replies = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1), os.dup2(devnull, 2)
    tools = {tool_name(spec): load_tool(spec) for spec in config["specs"]}
    if "python" in tools:
        tools["python"] = functools.partial(python, **config["python_limits"])
    for line in sys.stdin:
        name, arguments = json.loads(line)
        replies.write(json.dumps(_answer(tools, name, arguments)) + "\n")
        replies.flush()


class ToolRunner:
    """Runs tool calls in one worker process, each with a time limit; a stuck or crashed worker is replaced.
    The ``python`` tool gets ``timeout_s``, ``python_memory_mb`` and ``python_network`` as its own limits.

    The worker is a fresh interpreter (not a fork of a process holding vLLM's and torch's threads), and dies with
    this process."""

    def __init__(self, specs: list[str] | tuple[str, ...], timeout_s: float, *, python_memory_mb: int = 512,
                 python_network: bool = False) -> None:
        self.specs, self.timeout_s = list(specs), timeout_s
        self.python_limits = {"timeout_s": timeout_s, "memory_mb": python_memory_mb, "network": python_network}
        self.names = {tool_name(s) for s in specs}
        for spec in self.specs:  # fail at start-up on a bad spec (a user's module is imported by the worker only)
            check_tool(spec)
        if "python" in self.specs:
            log.warning(PYTHON_TOOL_RISK)
            isolation = sandbox.probe(network=python_network)  # once, here: the worker's own log goes nowhere
            if isolation == "namespaces":
                log.info("python tool sandbox: user, PID, mount, IPC, UTS and cgroup namespaces%s, a minimal "
                         "read-only root, no capabilities, rlimits", "" if python_network else ", no network")
            else:
                log.warning("python tool sandbox degraded (%s): the code is contained in time, processes and "
                            "memory, but it can read the host's files that its user can, and use the network",
                            isolation)
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        setup = json.dumps({"specs": self.specs, "python_limits": self.python_limits, "parent": os.getpid()})
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
        return subprocess.Popen([sys.executable, "-m", "verl_mega.rollout.tools", setup], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)

    def call(self, name: str, arguments: Any, *, timeout_s: float | None = None) -> Answer:
        """The answer to one call, cut off after ``timeout_s`` (default: the runner's); never raises for what the
        tool does."""
        if name not in self.names:
            return Answer(False, f"error: unknown tool {name!r}; tools: {', '.join(sorted(self.names))}")
        if not isinstance(arguments, (str, dict)):
            return Answer(False, "error: arguments must be text or a JSON object")
        timeout_s = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        proc = self._proc
        try:
            proc.stdin.write(json.dumps([name, arguments]) + "\n")
            proc.stdin.flush()
            # the worker's start-up counts too; the python tool stops itself at timeout_s, the margin lets its own,
            # clearer message arrive first
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s + 1.0)
            line = proc.stdout.readline() if ready else None
        except (BrokenPipeError, OSError):
            line = ""
        if line is None:
            self.close()
            return Answer(False, f"error: {name} timed out after {timeout_s:g} s", failed=True)
        if not line:
            code = proc.wait(5)
            self._proc = None
            return Answer(False, f"error: {name} crashed (exit code {code})", failed=True)
        ok, text, failed = json.loads(line)
        return Answer(bool(ok), text, bool(failed))

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None


def parse_call(body: str) -> tuple[str, Any]:
    """``{"name": ..., "arguments": {...}}`` (Hermes / Qwen JSON) or ``name: argument text``."""
    body = body.strip()
    if body.startswith("{"):  # a JSON call, or nothing the runner will accept (an unknown tool '')
        try:
            obj = json.loads(body)
            return str(obj["name"]), obj.get("arguments", {})
        except (json.JSONDecodeError, KeyError, TypeError):
            return "", body
    name, sep, rest = body.partition(":")
    return (name.strip(), rest.strip()) if sep else ("", body)



if __name__ == "__main__":  # the module a tool imports ToolError from, not this __main__ copy of it
    from verl_mega.rollout import tools as _module

    _module._serve(sys.argv[1])
