"""The package's imports point one way: the one-way rules between its packages hold and no two files import each
other, directly or through others. Every import is counted, also those inside functions, read from the source."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: what each package of verl_mega uses; it may import these and, transitively, what they use. The top-level
#: modules (verl_mega/train.py, verl_mega/__init__.py) may import anything.
USES: dict[str, set[str]] = {
    "trainer": {"hybrid", "rollout", "engine", "algos", "rewards", "data", "checkpoint", "planning"},
    "hybrid": {"rollout", "models", "parallel"},
    "engine": {"models", "parallel"},
    "checkpoint": {"models", "parallel"},  # Megatron dist checkpoints of models, resharded over the placement
    "planning": {"parallel", "models"},
    "rollout": {"models", "parallel", "rewards"},  # tools are user callables, loaded as reward functions are
    "data": {"rewards"},  # a generated task names its reward function; the warm start scores with it
    "models": {"parallel", "config"},
    "rewards": {"config"},
    "parallel": {"config"},
    "algos": set(),
    "config": set(),
}
#: the rules as ARCHITECTURE.md states them, checked on their own too
NEVER = {"rollout": {"hybrid", "trainer"}, "models": {"rewards"}}


def allowed(package: str) -> set[str]:
    seen, todo = set(), [package]
    while todo:
        for used in USES[todo.pop()]:
            if used not in seen:
                seen.add(used)
                todo.append(used)
    return seen


def import_edges(root: Path, top: str = "verl_mega") -> dict[str, dict[str, int]]:
    """{module: {imported module of the package: line}} for every file under ``root`` (``root`` is ``top``)."""
    files = {}
    for path in root.rglob("*.py"):
        name = ".".join((top, *path.relative_to(root).with_suffix("").parts))
        files[name.removesuffix(".__init__")] = path

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, dict[str, int]] = {}
    for me, path in files.items():
        package = me if path.name == "__init__.py" else me.rpartition(".")[0]
        out: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package this file is in, up level - 1 packages
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name == top or name.startswith(top + ".") else None
                if target not in (None, me, top):
                    out.setdefault(target, node.lineno)
        edges[me] = out
    return edges


def rule_violations(root: Path, edges: dict[str, dict[str, int]]) -> list[str]:
    """Imports from one package of ``root`` into another that its rules do not allow."""
    packages = {p.name for p in root.iterdir() if (p / "__init__.py").exists()}

    def package(module: str) -> str:
        part = (module.split(".") + [""])[1]
        return part if part in packages else "top"

    found = []
    for me, targets in sorted(edges.items()):
        mine = package(me)
        for target, line in sorted(targets.items()):
            theirs = package(target)
            if mine in ("top", theirs):
                continue
            if theirs not in allowed(mine) or theirs in NEVER.get(mine, ()) or theirs == "trainer":
                found.append(f"{me.replace('.', '/')}.py:{line} imports {target} ({mine} -> {theirs})")
    return found


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_rules_are_one_way():
    for package in USES:
        assert package not in allowed(package), f"{package} would use itself through {sorted(allowed(package))}"
        for never in NEVER.get(package, ()):
            assert never not in allowed(package), (package, never)
    assert set(USES) == {p.name for p in (REPO / "verl_mega").iterdir() if (p / "__init__.py").exists()}


@functools.cache
def package_edges() -> dict[str, dict[str, int]]:
    return import_edges(REPO / "verl_mega")


def test_no_file_imports_across_a_rule():
    assert rule_violations(REPO / "verl_mega", package_edges()) == []


def test_no_import_cycle_between_files():
    assert cycles(package_edges()) == []


def test_the_checks_find_what_they_look_for(tmp_path):
    """A cycle through an import inside a function, and imports across the rules, are reported."""
    root = tmp_path / "verl_mega"
    for package in ("rollout", "hybrid", "models", "trainer", "parallel"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "train.py").write_text("from verl_mega.trainer import step\n")  # the top may import the trainer
    (root / "rollout" / "a.py").write_text("from verl_mega.rollout import b\n")
    (root / "rollout" / "b.py").write_text("def f():\n    from . import a\n    from verl_mega.hybrid import sync\n")
    (root / "hybrid" / "sync.py").write_text("import verl_mega.parallel.groups\n")
    (root / "parallel" / "groups.py").write_text("")
    (root / "models" / "m.py").write_text("from verl_mega.trainer.step import run\n")
    (root / "trainer" / "step.py").write_text("from ..models import m\n")
    edges = import_edges(root)
    assert cycles(edges) == [["verl_mega.models.m", "verl_mega.trainer.step"],
                             ["verl_mega.rollout.a", "verl_mega.rollout.b"]]
    assert rule_violations(root, edges) == [
        "verl_mega/models/m.py:1 imports verl_mega.trainer.step (models -> trainer)",
        "verl_mega/rollout/b.py:3 imports verl_mega.hybrid (rollout -> hybrid)",  # the package's __init__
        "verl_mega/rollout/b.py:3 imports verl_mega.hybrid.sync (rollout -> hybrid)"]
