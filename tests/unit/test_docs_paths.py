"""The docs name only what exists, and the commands they show load.

Scanned: README.md, BENCHMARKS.md, docs/*.md, launch/* and configs/*.yaml.

What counts as a repo path (the rule; everything else is prose, a placeholder or a path on the user's machine):

* a token that starts with a top-level entry of the repository (``configs/``, ``docs/``, ``launch/``, ``tools/``,
  ``tests/``, ``verl_mega/``, ``benchmarks/``, ``.ci/``) or is a top-level file (README.md, BENCHMARKS.md,
  setup.py, ruff.toml), and ends in a letter or digit. It must not follow a path character (``/``, ``~``, ``$``,
  ``.``, ``-`` or a letter), so ``/models/...``, ``~/.cache/verl_mega``, ``<output_dir>/placement.json`` and
  ``outputs/...`` are not repo paths;
* not a placeholder: a match directly followed by ``*``, ``{``, ``<`` or ``...`` is a glob or a template
  (``results/grpo_*.json``, ``lora_{a,b}.json``), and a last component whose stem is written in capitals is a
  name to fill in (``RECIPE.yaml``, ``MODEL.json``, ``test_X.py``), except the top-level files above;
* a bare ``name.md`` in docs/*.md is a page beside it (docs/name.md) or a top-level one;
* a dotted ``verl_mega.a.b`` names a module or package, optionally followed by one name that module defines or
  mentions (``verl_mega.parallel.launch_env.discover``).

Commands: every ``--config configs/R.yaml`` (and ``tools/check_config.py configs/R.yaml``) shown, with the dotted
``key=value`` overrides on the same command line (``\\``-continued lines joined), passes the config check that
``tools/check_config.py --no-check-paths`` makes: files outside the repository (model and data paths) are the
user's.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import check_config  # noqa: E402

TOP_DIRS = ("configs", "docs", "launch", "tools", "tests", "verl_mega", "benchmarks", ".ci")
TOP_FILES = ("README.md", "BENCHMARKS.md", "setup.py", "ruff.toml")
PATH = re.compile(r"(?<![\w./~$-])((?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[\w./-]*\w|"
                  + "|".join(re.escape(f) for f in TOP_FILES) + r")")
SIBLING_MD = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")
MODULE = re.compile(r"(?<![\w./-])(verl_mega(?:\.\w+)+)")
COMMAND = re.compile(r"(?:--config[ =]|check_config\.py )(configs/[\w.-]+\.yaml)"
                     r"((?:[ \t]+(?:\\\n[ \t]*)?[^\s`#;|&]+)*)")
OVERRIDE = re.compile(r"^[a-z_]\w*(?:\.\w+)+=\S+$")


def scanned_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "BENCHMARKS.md", *sorted((REPO / "docs").glob("*.md")),
             *sorted(p for p in (REPO / "launch").iterdir() if p.is_file()), *sorted((REPO / "configs").glob("*.yaml"))]
    return [f for f in files if f.is_file()]


def _placeholder(path: str, after: str) -> bool:
    if after.startswith(("*", "{", "<", "...")):
        return True
    stem = path.rsplit("/", 1)[-1].split(".", 1)[0]
    return path not in TOP_FILES and bool(re.fullmatch(r"(\w*_)?[A-Z][A-Z0-9]*", stem))


def repo_paths(text: str) -> list[str]:
    """The repo-relative paths `text` names (see the module docstring)."""
    return [m.group(1) for m in PATH.finditer(text) if not _placeholder(m.group(1), text[m.end():m.end() + 3])]


def _module_file(parts: list[str]) -> Path | None:
    base = REPO.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def missing_names(text: str, *, docs_page: bool) -> list[str]:
    """What `text` (of a page under docs/ when `docs_page`) names that does not exist."""
    missing = [p for p in repo_paths(text) if not (REPO / p).exists()]
    if docs_page:
        missing += [n for n in SIBLING_MD.findall(text) if not ((REPO / "docs" / n).exists() or (REPO / n).exists())]
    for dotted in MODULE.findall(text):
        parts = dotted.split(".")
        i = len(parts)
        while i > 0 and _module_file(parts[:i]) is None:
            i -= 1
        module = _module_file(parts[:i]) if i else None
        rest = parts[i:]
        if module is None or len(rest) > 1 or (rest and not re.search(rf"\b{rest[0]}\b", module.read_text())):
            missing.append(dotted)
    return missing


def shown_commands(text: str) -> list[tuple[str, list[str]]]:
    """(recipe, overrides) of every config command in `text`."""
    out = []
    for m in COMMAND.finditer(text):
        tokens = m.group(2).replace("\\\n", " ").split()
        out.append((m.group(1), [t for t in tokens if OVERRIDE.match(t)]))
    return out


def test_the_rule_flags_missing_paths_and_skips_placeholders():
    text = ("run `configs/ppo.yaml` or configs/quickstart_cpu.yaml; see docs/nowhere.md and README.md.\n"
            "files: /models/Qwen2.5-7B, ~/.cache/verl_mega/x, <output_dir>/placement.json, outputs/quickstart_cpu,\n"
            "benchmarks/results/grpo_*.json, benchmarks/results/lora_{a,b}.json, configs/RECIPE.yaml,\n"
            "tests/fixtures/hf_configs/MODEL.json, tests/unit/test_X.py, configs/<recipe>.yaml, docs/...")
    assert repo_paths(text) == ["configs/ppo.yaml", "configs/quickstart_cpu.yaml", "docs/nowhere.md", "README.md"]
    assert shown_commands("torchrun -m verl_mega.train --config configs/quickstart_cpu.yaml \\\n"
                          "    parallel.tp=2 actor.lr=1e-6  # two ranks`") == \
        [("configs/quickstart_cpu.yaml", ["parallel.tp=2", "actor.lr=1e-6"])]


def test_the_rule_checks_modules_and_sibling_pages():
    text = ("`verl_mega.trainer.api.RLTrainer`, `verl_mega.parallel.launch_env.discover()`, `verl_mega.RLTrainer`, "
            "`verl_mega.nothing_here`, `verl_mega.trainer.api.no_such_name`, `concepts.md`, `nowhere.md`")
    assert missing_names(text, docs_page=True) == ["nowhere.md", "verl_mega.nothing_here",
                                                   "verl_mega.trainer.api.no_such_name"]
    assert missing_names(text, docs_page=False) == ["verl_mega.nothing_here", "verl_mega.trainer.api.no_such_name"]


@pytest.mark.parametrize("doc", scanned_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_named_path_exists(doc):
    assert missing_names(doc.read_text(encoding="utf-8"), docs_page=doc.parent == REPO / "docs") == []


@pytest.mark.parametrize("doc", scanned_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_shown_config_command_passes_the_config_check(doc, capsys):
    for recipe, overrides in shown_commands(doc.read_text(encoding="utf-8")):
        rc = check_config.main([str(REPO / recipe), *overrides, "--no-check-paths"])
        err = capsys.readouterr().err
        assert rc == 0, f"{doc.name}: --config {recipe} {' '.join(overrides)}: {err.strip()}"


def test_the_docs_show_config_commands():
    """The command check has something to check: the launch docs and the README show recipes."""
    shown = {recipe for doc in scanned_files() for recipe, _ in shown_commands(doc.read_text(encoding="utf-8"))}
    assert {"configs/quickstart_cpu.yaml", "configs/ppo_llama2_7b.yaml"} <= shown


# measured memory is written in GiB; "80 GB" is a GPU's size, not a measurement
MEASUREMENT = re.compile(r"\d[\d,.]*\s?(?:s|ms|min|minutes|seconds|h|GiB|×|%|TFLOP/s|tests|steps/s|tokens/s)"
                         r"(?![\w/])")


def test_the_readme_prose_states_no_measurements():
    """Times, speed-ups, memory and test counts drift; they live in BENCHMARKS.md and docs/ beside the command that
    measured them (the README says where). Code blocks are not prose."""
    prose = re.sub(r"```.*?```", "", (REPO / "README.md").read_text(encoding="utf-8"), flags=re.S)
    assert MEASUREMENT.findall(prose) == []
    assert MEASUREMENT.findall("took 77 s (median 0.44 s a step), 1.25× faster, 24.5 GiB, 858 tests") == \
        ["77 s", "0.44 s", "1.25×", "24.5 GiB", "858 tests"]
