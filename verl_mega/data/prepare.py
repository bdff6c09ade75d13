"""Prompt files in verl's format, made from the math datasets RL recipes train and test on.

Each row is what verl's ``examples/data_preprocess`` scripts write: ``data_source``, ``prompt`` (chat messages),
``ability``, ``reward_model`` (``style``, ``ground_truth``) and ``extra_info``, so the files load here
(docs/data.md) and in verl alike. The datasets, their hub IDs and the built-in reward that scores them:

* ``gsm8k``: openai/gsm8k (configuration main), train and test; ground truth the number after ``####``; ``gsm8k``.
* ``math``: DigitalLearningGmbH/MATH-lighteval, train and test; ground truth the solution's last ``\\boxed{}``;
  ``math``.
* ``dapo-math``: BytedTsinghua-SIA/DAPO-Math-17k, train (already in verl's format); ``math_dapo``.
* ``aime2024``: BytedTsinghua-SIA/AIME-2024, written as test (verl's format, or plain problem/answer rows);
  ``math_dapo``.

The source is the hub ID (fetched into the Hugging Face cache, see :mod:`verl_mega.config.hub`), a local directory
holding the dataset in its hub layout, or local parquet/JSON/JSONL files per split.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from verl_mega.config.base import ConfigError
from verl_mega.config.hub import DATA_SUFFIXES, local_dataset_files, parse_dataset, resolve_dataset
from verl_mega.rewards.math_equiv import last_boxed
from verl_mega.rewards.math_reward import extract_solution

__all__ = ["PrepareError", "Dataset", "DATASETS", "prepare", "read_rows"]

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
DAPO_TEMPLATE = ("Solve the following math problem step by step. The last line of your response should be of the form "
                 "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
                 "Remember to put your answer on its own line after \"Answer:\".")


class PrepareError(ValueError):
    """A source that cannot be read or a row that cannot be converted (one line naming the file and row)."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


Row = dict[str, Any]


@dataclass(frozen=True)
class Dataset:
    """How one dataset becomes verl-format files: ``splits`` maps each split read to the file written."""

    name: str
    hub_id: str
    config: str | None
    splits: tuple[tuple[str, str], ...]
    reward: str
    convert: Callable[[Row, str, int, str], Row]


def _field(row: Mapping[str, Any], where: str, *names: str) -> Any:
    """The first of ``names`` the row has (case-insensitive), else a one-line error."""
    lowered = {str(k).lower(): v for k, v in row.items()}
    for name in names:
        if lowered.get(name.lower()) is not None:
            return lowered[name.lower()]
    raise PrepareError(f"{where}: no field {' or '.join(repr(n) for n in names)} (fields: "
                       f"{', '.join(sorted(map(str, row))) or 'none'}); is this the right dataset?")


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _gsm8k(row: Row, split: str, index: int, where: str) -> Row:
    question, answer = str(_field(row, where, "question")), str(_field(row, where, "answer"))
    truth = extract_solution(answer, "strict")
    if truth is None:
        raise PrepareError(f"{where}: field 'answer' has no final '#### <number>'; is this GSM8K?")
    return {"data_source": "openai/gsm8k", "prompt": _messages(f"{question} {GSM8K_INSTRUCTION}"), "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index, "answer": answer, "question": question}}


def _math(row: Row, split: str, index: int, where: str) -> Row:
    problem, solution = str(_field(row, where, "problem")), str(_field(row, where, "solution"))
    truth = last_boxed(solution)
    if truth is None:
        raise PrepareError(f"{where}: field 'solution' has no \\boxed{{...}} answer; is this the MATH dataset?")
    return {"data_source": "DigitalLearningGmbH/MATH-lighteval", "prompt": _messages(f"{problem} {MATH_INSTRUCTION}"),
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": index}}


def _verl(row: Row, split: str, index: int, where: str) -> Row:
    """A row already in verl's format, checked and kept."""
    prompt, reward_model = _field(row, where, "prompt"), _field(row, where, "reward_model")
    if not isinstance(prompt, list) or not all(isinstance(m, Mapping) and "content" in m for m in prompt):
        raise PrepareError(f"{where}: field 'prompt' is not a list of chat messages; is this a verl-format dataset?")
    if not isinstance(reward_model, Mapping) or reward_model.get("ground_truth") is None:
        raise PrepareError(f"{where}: field 'reward_model' has no ground_truth; is this a verl-format dataset?")
    extra = dict(row.get("extra_info") or {})
    return {"data_source": str(_field(row, where, "data_source")),
            "prompt": [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in prompt],
            "ability": str(row.get("ability") or "math"),
            "reward_model": {"style": str(reward_model.get("style") or "rule"),
                             "ground_truth": str(reward_model["ground_truth"])},
            "extra_info": {"split": split, "index": index, **extra}}


def _aime(row: Row, split: str, index: int, where: str) -> Row:
    """verl-format AIME rows as they are; plain problem/answer rows get DAPO's prompt (scored by ``math_dapo``)."""
    if "reward_model" in row:
        return _verl(row, split, index, where)
    problem, answer = _field(row, where, "problem", "question"), _field(row, where, "answer")
    return {"data_source": "aime", "prompt": _messages(DAPO_TEMPLATE.format(problem=problem)), "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": index}}


DATASETS: dict[str, Dataset] = {d.name: d for d in (
    Dataset("gsm8k", "openai/gsm8k", "main", (("train", "train"), ("test", "test")), "gsm8k", _gsm8k),
    Dataset("math", "DigitalLearningGmbH/MATH-lighteval", None, (("train", "train"), ("test", "test")), "math", _math),
    Dataset("dapo-math", "BytedTsinghua-SIA/DAPO-Math-17k", None, (("train", "train"),), "math_dapo", _verl),
    Dataset("aime2024", "BytedTsinghua-SIA/AIME-2024", None, (("train", "test"),), "math_dapo", _aime),
)}


def read_rows(path: str) -> Iterator[tuple[str, Row]]:
    """(where, row) of a parquet, JSONL or JSON file (a JSON array, or JSON lines under a .json name)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in DATA_SUFFIXES:
        raise PrepareError(f"{path}: extension {ext!r}; give .parquet, .jsonl or .json files")
    try:
        if ext == ".parquet":
            import pyarrow.parquet as pq

            row = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                for record in batch.to_pylist():
                    row += 1
                    yield f"{path}:row {row}", record
            return
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise PrepareError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:  # noqa: BLE001 - pyarrow's own errors
        raise PrepareError(f"{path}: not a readable parquet file ({type(exc).__name__}: {exc})") from None
    if ext == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as exc:
            raise PrepareError(f"{path}: invalid JSON ({exc})") from None
        yield from ((f"{path}:item {i + 1}", r) for i, r in enumerate(rows))
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                yield f"{path}:line {lineno}", json.loads(line)
            except ValueError as exc:
                raise PrepareError(f"{path}:line {lineno}: invalid JSON ({exc})") from None


def _sources(data: Dataset, source: str | None, config: str | None) -> dict[str, list[str]]:
    """Split read → its files, from a hub ID (default: the dataset's) or a local directory."""
    source = source or data.hub_id
    config = config if config is not None else data.config
    try:
        if os.path.isdir(source):
            return {s: local_dataset_files("--source", source, config=config, split=s) for s, _ in data.splits}
        if parse_dataset(source) is None or ":" in source:
            raise PrepareError(f"--source={source!r} is neither a directory nor a hub dataset ID (ORG/NAME[@REVISION]; "
                               f"a configuration goes in --config); give one of them, or --file SPLIT=PATH")
        return {s: resolve_dataset("--source", f"{source}{f':{config}' if config else ''}:{s}") for s, _ in data.splits}
    except ConfigError as exc:
        raise PrepareError(str(exc)) from None


def _write(rows: list[Row], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)  # a reader never sees a half-written file
    finally:
        tmp.unlink(missing_ok=True)


def prepare(name: str, output: str | os.PathLike, *, source: str | None = None, config: str | None = None,
            files: Mapping[str, Sequence[str]] | None = None) -> dict[str, tuple[Path, int]]:
    """Write the verl-format parquet files of dataset ``name`` under ``output``: {file name: (path, rows)}.
    ``files`` ({split: [paths]}) takes local files instead of ``source`` (a hub ID or a local directory)."""
    if name not in DATASETS:
        raise PrepareError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    data = DATASETS[name]
    if files:
        unknown = sorted(set(files) - {s for s, _ in data.splits})
        if unknown:
            raise PrepareError(f"--file {unknown[0]}=...: {name} has the splits "
                               f"{', '.join(s for s, _ in data.splits)}")
        inputs = {s: list(files.get(s, ())) for s, _ in data.splits if files.get(s)}
    else:
        inputs = _sources(data, source, config)
    converted: dict[str, list[Row]] = {}
    for split, out in data.splits:
        if split not in inputs:
            continue
        rows = converted.setdefault(out, [])
        for path in inputs[split]:
            for where, row in read_rows(path):
                if not isinstance(row, Mapping):
                    raise PrepareError(f"{where}: a {type(row).__name__}, not an object")
                rows.append(data.convert(dict(row), out, len(rows), where))
        if not rows:
            raise PrepareError(f"the {split} split of {name} ({', '.join(inputs[split])}) has no rows")
    written = {}
    for out, rows in converted.items():
        path = Path(output) / f"{out}.parquet"
        _write(rows, path)
        written[f"{out}.parquet"] = (path, len(rows))
    return written
