"""Prompt data for RL: read JSONL / JSON / parquet records, tokenize (with the chat template when the tokenizer has
one), drop overlong prompts, and serve deterministic, resumable, data-parallel-sharded global batches.

A record holds the prompt under ``prompt_key`` — a string or a chat message list ``[{"role", "content"}, ...]`` —
and the ground truth under ``answer_key`` (dotted keys reach nested fields, e.g. ``reward_model.ground_truth`` for
verl-style parquet). Every other field is kept in ``extra`` and passed on to the reward function. A path
``generated:<task>`` stands for a built-in generated task (:mod:`verl_mega.data.tasks`).

Order: epoch ``e`` visits the prompts in a permutation seeded by ``(seed, e)``; each global batch of
``global_batch_size`` prompts is split into ``dp_size`` contiguous shards, rank ``r`` taking shard ``r``. The
incomplete last batch of an epoch is dropped. ``state_dict()`` = (epoch, index of the next batch), so a resumed run
sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Literal, Sequence

from verl_mega.data.tasks import GeneratedTask, generated_task, is_generated

__all__ = ["PromptDataError", "PromptRecord", "PromptItem", "PromptBatch", "load_prompt_records", "PromptDataset",
           "PromptLoader"]

logger = logging.getLogger("verl_mega.data")

_MISSING = object()


class PromptDataError(ValueError):
    """Unusable prompt data; the message names the file, line/row and field."""


@dataclass(frozen=True)
class PromptRecord:
    prompt: str | list[dict[str, str]]
    ground_truth: Any
    extra: dict[str, Any]
    source: str  # "file:line N" / "file:row N", for error messages


@dataclass(frozen=True)
class PromptItem:
    index: int  # position in the (filtered) dataset
    prompt_ids: list[int]
    prompt_text: str  # the exact text that was tokenized (after the chat template)
    ground_truth: Any
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PromptBatch:
    """This rank's shard of one global batch."""

    items: list[PromptItem]
    epoch: int
    batch_index: int  # index of the global batch within the epoch

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [it.prompt_ids for it in self.items]

    @property
    def ground_truths(self) -> list[Any]:
        return [it.ground_truth for it in self.items]

    @property
    def extras(self) -> list[dict[str, Any]]:
        return [it.extra for it in self.items]

    def __len__(self) -> int:
        return len(self.items)


# ------------------------------------------------------------------------------------------------------ reading
def _lookup(record: dict[str, Any], key: str) -> Any:
    if key in record:
        return record[key]
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _check_prompt(prompt: Any, where: str, prompt_key: str) -> str | list[dict[str, str]]:
    if isinstance(prompt, str):
        if not prompt:
            raise PromptDataError(f"{where}: field '{prompt_key}' is an empty string; remove the record or fill it")
        return prompt
    if hasattr(prompt, "tolist"):  # numpy arrays from parquet readers
        prompt = prompt.tolist()
    if isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt
    ):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    raise PromptDataError(
        f"{where}: field '{prompt_key}' must be a string or a non-empty list of {{'role': str, 'content': str}} "
        f"messages, got {type(prompt).__name__}"
    )


def _rows(path: str) -> Iterator[tuple[str, Any]]:
    """(location, raw row) pairs from one file."""
    if not os.path.exists(path):
        raise PromptDataError(f"prompt file '{path}' not found; check the data path")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise PromptDataError(f"reading '{path}' needs pyarrow; install it with `pip install pyarrow`") from None
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:
            raise PromptDataError(f"'{path}' is not a readable parquet file ({type(exc).__name__}: {exc})") from exc
        for i, row in enumerate(rows, start=1):
            yield f"{path}:row {i}", row
    elif ext == ".json":
        text = _read_utf8(path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PromptDataError(
                f"{path}:line {exc.lineno}: invalid JSON ({exc.msg}); expected a list of objects"
            ) from None
        if not isinstance(data, list):
            raise PromptDataError(
                f"'{path}' holds a JSON {type(data).__name__}; expected a list of objects (or use .jsonl)"
            )
        for i, row in enumerate(data, start=1):
            yield f"{path}:item {i}", row
    elif ext == ".jsonl":
        for lineno, line in enumerate(_read_utf8(path).splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptDataError(
                    f"{path}:line {lineno}: invalid JSON ({exc.msg}); each line must be one JSON object"
                ) from None
            yield f"{path}:line {lineno}", row
    else:
        raise PromptDataError(f"prompt file '{path}' has extension '{ext}'; use .jsonl, .json or .parquet")


def _read_utf8(path: str) -> str:
    """The file's text; a byte that is not UTF-8 is an error naming the line and column."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise PromptDataError(f"{path}:line {line}: byte 0x{raw[exc.start]:02x} at column {column} is not UTF-8; "
                              f"re-save the file as UTF-8") from None


def _generated_rows(task: GeneratedTask, entry: str, num_examples: int, seed: int) -> Iterator[tuple[str, Any]]:
    for i, row in enumerate(task.generate(num_examples, seed=seed), start=1):
        yield f"{entry}:item {i}", row


def load_prompt_records(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    generated_size: int = 1024,
    generated_seed: int = 0,
) -> list[PromptRecord]:
    """Read and validate records from one or more files (in order). ``answer_key=None``: no ground truth.

    An entry ``generated:<task>`` (see :mod:`verl_mega.data.tasks`) yields ``generated_size`` records of that task made
    with ``generated_seed`` (use another seed for a validation set); its own prompt/answer keys are used.
    """
    path_list = [os.fspath(paths)] if isinstance(paths, (str, os.PathLike)) else [os.fspath(p) for p in paths]
    if not path_list:
        raise PromptDataError("no prompt files given; pass at least one .jsonl/.json/.parquet path")
    records: list[PromptRecord] = []
    for path in path_list:
        before = len(records)
        file_prompt_key, file_answer_key = prompt_key, answer_key
        if is_generated(path):
            try:
                task = generated_task(path)
            except ValueError as exc:
                raise PromptDataError(str(exc)) from None
            rows = _generated_rows(task, path, generated_size, generated_seed)
            file_prompt_key, file_answer_key = task.prompt_key, task.answer_key
        else:
            rows = _rows(path)
        for where, row in rows:
            if not isinstance(row, dict):
                raise PromptDataError(f"{where}: expected a JSON object, got {type(row).__name__}")
            prompt = _lookup(row, file_prompt_key)
            if prompt is _MISSING:
                raise PromptDataError(
                    f"{where}: missing field '{file_prompt_key}' (fields: {', '.join(sorted(row)) or 'none'}); set "
                    "prompt_key to the field holding the prompt"
                )
            truth = None
            if file_answer_key is not None:
                truth = _lookup(row, file_answer_key)
                if truth is _MISSING:
                    raise PromptDataError(
                        f"{where}: missing field '{file_answer_key}' (fields: {', '.join(sorted(row)) or 'none'}); "
                        "set answer_key to the field holding the ground truth, or null if there is none"
                    )
                if truth is None:  # it would score 0 silently, whatever the response
                    raise PromptDataError(
                        f"{where}: field '{file_answer_key}' is null, so every response would score 0; give the "
                        "ground truth or remove the record"
                    )
            extra = {k: v for k, v in row.items() if k not in (file_prompt_key, file_answer_key)}
            records.append(PromptRecord(_check_prompt(prompt, where, file_prompt_key), truth, extra, where))
        if len(records) == before:
            raise PromptDataError(f"prompt file '{path}' is empty (no records); add prompts or remove it from the list")
    return records


# --------------------------------------------------------------------------------------------------- tokenizing
ChatTemplateMode = Literal["auto"] | bool


def _use_template(tokenizer: Any, apply_chat_template: ChatTemplateMode) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template == "auto":
        return has
    if apply_chat_template is True and not has:
        raise PromptDataError(
            "apply_chat_template=true but the tokenizer has no chat_template; set it to auto or false, or use a "
            "tokenizer with a template"
        )
    if not isinstance(apply_chat_template, bool):
        raise PromptDataError(f"apply_chat_template must be auto, true or false, got {apply_chat_template!r}")
    return apply_chat_template


def _render(record: PromptRecord, tokenizer: Any, use_template: bool, apply_chat_template: Any) -> tuple[str, bool]:
    """(text to tokenize, whether it came from the chat template)."""
    has_template = use_template
    messages = record.prompt if isinstance(record.prompt, list) else None
    if messages is not None and not has_template:
        reason = "apply_chat_template is off" if apply_chat_template is False else "the tokenizer has no chat_template"
        raise PromptDataError(
            f"{record.source}: the prompt is a chat message list but {reason}; give plain-string prompts or use a "
            "tokenizer with a chat template"
        )
    if not has_template:
        return record.prompt, False
    messages = messages or [{"role": "user", "content": record.prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, True


class PromptDataset(Sequence[PromptItem]):
    """Tokenized prompts with overlong ones removed (the count is logged and kept in ``num_filtered``), or refused
    with an error when ``filter_overlong`` is off. ``apply_chat_template``: ``auto`` uses the tokenizer's chat
    template when it has one, ``True`` requires one, ``False`` never uses it."""

    def __init__(
        self,
        records: Sequence[PromptRecord],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        apply_chat_template: ChatTemplateMode = "auto",
        filter_overlong: bool = True,
    ):
        if max_prompt_length < 1:
            raise PromptDataError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if tokenizer is None or not hasattr(tokenizer, "encode"):
            raise PromptDataError("a tokenizer with .encode() is needed to build the prompt dataset")
        use_template = _use_template(tokenizer, apply_chat_template)
        rendered = [_render(r, tokenizer, use_template, apply_chat_template) for r in records]
        ids_list = self._tokenize(tokenizer, rendered)
        self.items: list[PromptItem] = []
        for record, (text, _), ids in zip(records, rendered, ids_list):
            if not ids:  # the engine refuses an empty prompt, and only when its batch comes up
                raise PromptDataError(f"{record.source}: prompt {text[:40]!r} encodes to no tokens (whitespace only, "
                                      f"or characters outside the tokenizer's vocabulary); remove the record or fix it")
            if len(ids) > max_prompt_length:
                if not filter_overlong:
                    raise PromptDataError(
                        f"{record.source}: prompt has {len(ids)} tokens > max_prompt_length={max_prompt_length}; "
                        "raise max_prompt_length or turn on filtering of overlong prompts"
                    )
                continue
            self.items.append(PromptItem(len(self.items), list(ids), text, record.ground_truth, record.extra))
        self.num_filtered = len(records) - len(self.items)
        self.max_prompt_length = max_prompt_length
        if self.num_filtered:
            logger.warning(
                "filtered %d of %d prompts longer than max_prompt_length=%d tokens",
                self.num_filtered, len(records), max_prompt_length,
            )
        if not self.items:
            raise PromptDataError(
                f"all {len(records)} prompts are longer than max_prompt_length={max_prompt_length} tokens; raise it"
            )

    @staticmethod
    def _tokenize(tokenizer: Any, rendered: list[tuple[str, bool]]) -> list[list[int]]:
        # Templated text already carries its special tokens; plain prompts get the tokenizer's defaults (e.g. BOS).
        out: list[list[int] | None] = [None] * len(rendered)
        for templated in (True, False):
            idx = [i for i, (_, t) in enumerate(rendered) if t is templated]
            if not idx:
                continue
            texts = [rendered[i][0] for i in idx]
            if callable(tokenizer):  # HF fast tokenizers encode a whole list at once, much faster than a loop
                encoded = tokenizer(texts, add_special_tokens=not templated)["input_ids"]
            else:
                encoded = [tokenizer.encode(t, add_special_tokens=not templated) for t in texts]
            for i, ids in zip(idx, encoded):
                out[i] = list(ids)
        return out  # type: ignore[return-value]

    @classmethod
    def from_files(
        cls,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        apply_chat_template: ChatTemplateMode = "auto",
        filter_overlong: bool = True,
        generated_size: int = 1024,
        generated_seed: int = 0,
    ) -> "PromptDataset":
        """``paths`` are files or ``generated:<task>`` entries; see :func:`load_prompt_records`."""
        records = load_prompt_records(paths, prompt_key=prompt_key, answer_key=answer_key,
                                      generated_size=generated_size, generated_seed=generated_seed)
        return cls(records, tokenizer, max_prompt_length=max_prompt_length, apply_chat_template=apply_chat_template,
                   filter_overlong=filter_overlong)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):  # type: ignore[override]
        return self.items[i]


# ------------------------------------------------------------------------------------------------------ batching
class PromptLoader:
    """Deterministic, resumable iteration over global batches; yields this rank's :class:`PromptBatch` shard."""

    def __init__(
        self,
        dataset: Sequence[PromptItem],
        *,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int = 1,
    ):
        if global_batch_size < 1:
            raise PromptDataError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise PromptDataError(f"dp_rank {dp_rank} is outside 0..dp_size-1 (dp_size={dp_size})")
        if global_batch_size % dp_size:
            raise PromptDataError(
                f"global_batch_size={global_batch_size} is not divisible by the data-parallel size {dp_size}; "
                "make the prompt batch size a multiple of it"
            )
        if len(dataset) < global_batch_size:
            raise PromptDataError(
                f"only {len(dataset)} prompts (after filtering) for a global batch of {global_batch_size}; lower the "
                "batch size or add prompts"
            )
        if num_epochs < 1:
            raise PromptDataError(f"num_epochs must be >= 1, got {num_epochs}")
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.num_epochs = num_epochs
        self.batches_per_epoch = len(dataset) // global_batch_size
        self.epoch, self.index = 0, 0  # the next batch to serve
        self._order_epoch: int | None = None
        self._order: list[int] = []

    @property
    def total_batches(self) -> int:
        return self.batches_per_epoch * self.num_epochs

    @property
    def done(self) -> bool:
        return self.epoch >= self.num_epochs

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order_epoch != epoch:
            order = list(range(len(self.dataset)))
            if self.shuffle:
                # A string seed is hashed with SHA-512 by `random`, so the order is stable across Python versions.
                random.Random(f"verl_mega-prompts:{self.seed}:{epoch}").shuffle(order)
            self._order_epoch, self._order = epoch, order
        return self._order

    def next_batch(self) -> PromptBatch | None:
        """This rank's shard of the next global batch, or None when all epochs are done."""
        if self.done:
            return None
        order = self._epoch_order(self.epoch)
        start = self.index * self.global_batch_size
        global_ids = order[start : start + self.global_batch_size]
        per_rank = self.global_batch_size // self.dp_size
        mine = global_ids[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        batch = PromptBatch([self.dataset[i] for i in mine], self.epoch, self.index)
        self.index += 1
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        return batch

    def peek(self, ahead: int = 1) -> PromptBatch | None:
        """The batch ``ahead`` calls of :meth:`next_batch` from now would return, without moving (None past the
        end): what an asynchronous rollout may generate early."""
        probe = copy.copy(self)
        batch = None
        for _ in range(ahead):
            batch = probe.next_batch()
        return batch

    def __iter__(self) -> Iterator[PromptBatch]:
        while (batch := self.next_batch()) is not None:
            yield batch

    def __len__(self) -> int:
        """Batches left to serve."""
        return max(0, self.total_batches - (self.epoch * self.batches_per_epoch + self.index))

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "dataset_size": len(self.dataset),
            "global_batch_size": self.global_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position; refuses a state from a different dataset size / batch size / seed, since
        the same position would then mean different prompts."""
        for key, mine in (("dataset_size", len(self.dataset)), ("global_batch_size", self.global_batch_size),
                          ("seed", self.seed)):
            if key in state and state[key] != mine:
                raise PromptDataError(
                    f"data loader state has {key}={state[key]} but this run has {mine}; resume with the same data, "
                    "batch size and seed"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if not 0 <= index < max(1, self.batches_per_epoch) or epoch < 0:
            raise PromptDataError(f"data loader state has an invalid position (epoch {epoch}, index {index})")
        self.epoch, self.index = epoch, index
