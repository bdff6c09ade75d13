"""Reading prompt records from JSONL / JSON / parquet files and generated tasks, one at a time.

A record holds the prompt under ``prompt_key`` (a string or a chat message list ``[{"role", "content"}, ...]``) and
the ground truth under ``answer_key`` (dotted keys reach nested fields). Every other field is kept in ``extra`` and
passed on to the reward function.

verl's dataset schema is recognised as it is: a file whose first row has no ``answer`` field but a ``reward_model``
mapping (what verl's ``examples/data_preprocess/*.py`` write: ``data_source``, ``prompt`` as chat messages,
``ability``, ``reward_model: {style, ground_truth}``, ``extra_info``) takes its ground truth from
``reward_model.ground_truth``, and each of its rows must carry ``prompt``, ``reward_model.ground_truth`` and
``data_source`` (verl's reward functions are called with it).

Rows are read one at a time (parquet a record batch at a time), so that a large file is never held whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

from verl_mega.data.tasks import GeneratedTask, generated_task, is_generated

__all__ = ["PromptDataError", "PromptRecord", "DEFAULT_PROMPT_KEY", "DEFAULT_ANSWER_KEY", "VERL_ANSWER_KEY",
           "iter_prompt_records", "load_prompt_records"]

DEFAULT_PROMPT_KEY, DEFAULT_ANSWER_KEY = "prompt", "answer"
VERL_ANSWER_KEY = "reward_model.ground_truth"  # where verl's datasets keep the ground truth
VERL_SOURCE_KEY = "data_source"  # verl's reward_fn_key: every verl reward function is called with it
_PARQUET_BATCH_ROWS = 1024
_MISSING = object()


class PromptDataError(ValueError):
    """Unusable prompt data; the message names the file, line/row and field."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: str | list[dict[str, str]]
    ground_truth: Any
    extra: dict[str, Any]
    source: str  # "file:line N" / "file:row N", for error messages


def _lookup(record: Mapping[str, Any], key: str) -> Any:
    if key in record:
        return record[key]
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def check_prompt(prompt: Any, where: str, prompt_key: str) -> str | list[dict[str, str]]:
    """The prompt as a string or a list of {role, content} messages; an error naming ``where`` otherwise."""
    if isinstance(prompt, str):
        if not prompt:
            raise PromptDataError(f"{where}: field '{prompt_key}' is an empty string; remove the record or fill it")
        return prompt
    if hasattr(prompt, "tolist"):  # numpy arrays from parquet readers
        prompt = prompt.tolist()
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    ):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise PromptDataError(
        f"{where}: field '{prompt_key}' must be a string or a non-empty list of {{'role': str, 'content': str}} "
        f"messages, got {type(prompt).__name__}"
    )


# ------------------------------------------------------------------------------------------------- file rows
def _rows(path: str) -> Iterator[tuple[str, Any]]:
    """(location, raw row) pairs from one file, read incrementally."""
    if not os.path.exists(path):
        raise PromptDataError(f"prompt file '{path}' not found; check the data path")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        yield from _parquet_rows(path)
    elif ext == ".json":
        yield from _json_array_rows(path)
    elif ext == ".jsonl":
        yield from _jsonl_rows(path)
    else:
        raise PromptDataError(f"prompt file '{path}' has extension '{ext}'; use .jsonl, .json or .parquet")


def _parquet_rows(path: str) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise PromptDataError(f"reading '{path}' needs pyarrow; install it with `pip install pyarrow`") from None
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS)
        row = 0
        for batch in batches:  # one record batch of Python rows at a time
            for record in batch.to_pylist():
                row += 1
                yield f"{path}:row {row}", record
    except PromptDataError:
        raise
    except Exception as exc:
        raise PromptDataError(f"'{path}' is not a readable parquet file ({type(exc).__name__}: {exc})") from exc


def _decode_line(raw: bytes, path: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PromptDataError(f"{path}:line {lineno}: byte 0x{raw[exc.start]:02x} at column {exc.start + 1} is not "
                              f"UTF-8; re-save the file as UTF-8") from None


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            line = _decode_line(raw, path, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptDataError(
                    f"{path}:line {lineno}: invalid JSON ({exc.msg}); each line must be one JSON object"
                ) from None
            yield f"{path}:line {lineno}", row


def _json_array_rows(path: str) -> Iterator[tuple[str, Any]]:
    """The items of a JSON array, decoded one at a time from the file's text (never the whole list at once)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise PromptDataError(f"{path}:line {line}: byte 0x{raw[exc.start]:02x} at column {column} is not UTF-8; "
                              f"re-save the file as UTF-8") from None
    del raw
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)

    def invalid(at: int, msg: str) -> PromptDataError:
        return PromptDataError(f"{path}:line {text.count(chr(10), 0, at) + 1}: invalid JSON ({msg}); expected a "
                               f"list of objects")

    if pos >= len(text) or text[pos] != "[":
        try:  # a JSON value that is not a list: name what it is
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise invalid(exc.pos, exc.msg) from None
        raise PromptDataError(f"'{path}' holds a JSON {type(value).__name__}; expected a list of objects (or use "
                              f".jsonl)")
    pos = _skip_space(text, pos + 1)
    item = 0
    if pos < len(text) and text[pos] == "]":
        pos += 1
    else:
        while True:
            try:
                row, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise invalid(exc.pos, exc.msg) from None
            item += 1
            yield f"{path}:item {item}", row
            pos = _skip_space(text, pos)
            if pos < len(text) and text[pos] == ",":
                pos = _skip_space(text, pos + 1)
                continue
            if pos < len(text) and text[pos] == "]":
                pos += 1
                break
            raise invalid(pos, "Expecting ',' delimiter")
    if _skip_space(text, pos) != len(text):
        raise invalid(pos, "Extra data")


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _generated_rows(task: GeneratedTask, entry: str, num_examples: int, seed: int) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(task.generate(num_examples, seed=seed), start=1):
        yield f"{entry}:item {i}", row


# ------------------------------------------------------------------------------------------------- records
def _fields(row: Mapping[str, Any]) -> str:
    return ", ".join(sorted(row)) or "none"


def _is_verl_row(row: Any, answer_key: str | None) -> bool:
    """A row in verl's schema: no field under our default answer key, a ``reward_model`` mapping instead."""
    return (answer_key == DEFAULT_ANSWER_KEY and isinstance(row, Mapping) and DEFAULT_ANSWER_KEY not in row
            and isinstance(row.get("reward_model"), Mapping))


def _record(row: Any, where: str, prompt_key: str, answer_key: str | None, verl: bool) -> PromptRecord:
    if not isinstance(row, Mapping):
        raise PromptDataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    prompt = _lookup(row, prompt_key)
    if verl:  # verl's schema, recognised from the file's first row: every row must fit it
        for key in (prompt_key, VERL_ANSWER_KEY, VERL_SOURCE_KEY):
            if _lookup(row, key) is _MISSING:
                raise PromptDataError(
                    f"{where}: missing field '{key}' of verl's dataset schema (data_source, prompt, "
                    f"reward_model.ground_truth; fields here: {_fields(row)}); fix the row or remove it")
        if _lookup(row, VERL_SOURCE_KEY) is None:  # verl's reward dispatch picks the scorer by it
            raise PromptDataError(f"{where}: field '{VERL_SOURCE_KEY}' is null; give the row its data source (it "
                                  "picks verl's reward function) or remove it")
        answer_key = VERL_ANSWER_KEY
    if prompt is _MISSING:
        raise PromptDataError(
            f"{where}: missing field '{prompt_key}' (fields: {_fields(row)}); set prompt_key to the field holding "
            "the prompt"
        )
    truth = None
    if answer_key is not None:
        truth = _lookup(row, answer_key)
        if truth is _MISSING:
            raise PromptDataError(
                f"{where}: missing field '{answer_key}' (fields: {_fields(row)}); set answer_key to the field "
                "holding the ground truth, or null if there is none"
            )
        if truth is None:  # it would score 0 silently, whatever the response
            raise PromptDataError(
                f"{where}: field '{answer_key}' is null, so every response would score 0; give the ground truth or "
                "remove the record"
            )
    extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
    return PromptRecord(check_prompt(prompt, where, prompt_key), truth, extra, where)


def iter_prompt_records(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    prompt_key: str = DEFAULT_PROMPT_KEY,
    answer_key: str | None = DEFAULT_ANSWER_KEY,
    generated_size: int = 1024,
    generated_seed: int = 0,
) -> Iterator[PromptRecord]:
    """Validated records from one or more files, in order, read one at a time (see :func:`load_prompt_records`)."""
    path_list = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if not path_list:
        raise PromptDataError("no prompt files given; pass at least one .jsonl/.json/.parquet path")
    for path in path_list:
        file_prompt_key, file_answer_key = prompt_key, answer_key
        if is_generated(path):
            try:
                task = generated_task(path)
            except ValueError as exc:
                raise PromptDataError(str(exc)) from None
            rows: Iterable[tuple[str, Any]] = _generated_rows(task, path, generated_size, generated_seed)
            file_prompt_key, file_answer_key = task.prompt_key, task.answer_key
        else:
            rows = _rows(path)
        count, verl = 0, None
        for where, row in rows:
            if verl is None:
                verl = _is_verl_row(row, file_answer_key)
            count += 1
            yield _record(row, where, file_prompt_key, file_answer_key, verl)
        if not count:
            raise PromptDataError(f"prompt file '{path}' is empty (no records); add prompts or remove it from the list")


def load_prompt_records(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    prompt_key: str = DEFAULT_PROMPT_KEY,
    answer_key: str | None = DEFAULT_ANSWER_KEY,
    generated_size: int = 1024,
    generated_seed: int = 0,
) -> list[PromptRecord]:
    """Read and validate every record of one or more files (in order) into a list. ``answer_key=None``: no ground
    truth. A large dataset is better built with :meth:`PromptDataset.from_files`, which never holds the records.

    An entry ``generated:<task>`` (see :mod:`verl_mega.data.tasks`) yields ``generated_size`` records of that task made
    with ``generated_seed`` (use another seed for a validation set); its own prompt/answer keys are used.
    """
    return list(iter_prompt_records(paths, prompt_key=prompt_key, answer_key=answer_key,
                                    generated_size=generated_size, generated_seed=generated_seed))
