"""Prompt data for RL: read JSONL / JSON / parquet records (:mod:`verl_mega.data.records`, which also recognises
verl's dataset schema), tokenize them (with the chat template when the tokenizer has one), drop overlong prompts, and
serve deterministic, resumable, data-parallel-sharded global batches (:mod:`verl_mega.data.loader`).

A dataset is held compactly, never as Python objects per prompt: the token ids of every prompt in one flat array
(2 bytes a token when the vocabulary fits in 16 bits, else 4) with one offset per prompt, and each prompt's record
(its prompt, ground truth and other fields) pickled into one flat byte buffer with one offset per prompt. Files are
read a row at a time and tokenized a chunk at a time, so loading never holds the file or its records whole either.
A :class:`PromptItem` is made when a batch asks for it (its ``prompt_text`` is rendered again through the same
template then). ``docs/data.md`` gives the figures.
"""

from __future__ import annotations

import array
import logging
import os
import pickle
from typing import Any, Iterable, Iterator, Literal, Sequence

from verl_mega.data.loader import PromptBatch, PromptItem, PromptLoader
from verl_mega.data.records import (
    DEFAULT_ANSWER_KEY,
    DEFAULT_PROMPT_KEY,
    PromptDataError,
    PromptRecord,
    iter_prompt_records,
    load_prompt_records,
)

__all__ = ["PromptDataError", "PromptRecord", "PromptItem", "PromptBatch", "load_prompt_records", "PromptDataset",
           "PromptLoader"]

logger = logging.getLogger("verl_mega.data")

# records rendered and tokenized together (HF fast tokenizers encode a list at once): up to this many, or this many
# characters of prompt text, which bounds what a chunk holds as Python objects while it is tokenized
_CHUNK, _CHUNK_CHARS = 1024, 1 << 18
_ID_TYPES = (("H", 1 << 16), ("i", 1 << 31), ("q", 1 << 63))  # the narrowest array type that holds every id
# A prompt longer than max_prompt_length x this many characters is first tokenized only as far as that prefix (cut
# at its last whitespace): a prefix of more than max_prompt_length + _CUT_MARGIN tokens decides it is overlong
# without tokenizing the rest (a 5 MB row took 2.5 GB and a 50 MB row minutes to tokenize whole). Natural text runs
# at 3-5 characters a token, so every prompt that could fit is shorter than the bound and is tokenized whole, as
# before; a longer one whose prefix still fits (very long tokens: runs of spaces, say) is tokenized whole too.
# The margin covers a prefix cut inside a word, whose last tokens may differ from the whole word's.
_CHARS_PER_TOKEN_BOUND, _CUT_MARGIN = 32, 16

# --------------------------------------------------------------------------------------------------- tokenizing
ChatTemplateMode = Literal["auto"] | bool


def _use_template(tokenizer: Any, apply_chat_template: ChatTemplateMode) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if apply_chat_template == "auto":
        return has
    if apply_chat_template is True and not has:
        raise PromptDataError(
            "data.apply_chat_template=true but the tokenizer has no chat_template; give one with model.chat_template "
            "(inline Jinja or a .jinja file), use a tokenizer that has one, or set data.apply_chat_template to auto "
            "or false"
        )
    if not isinstance(apply_chat_template, bool):
        raise PromptDataError(f"apply_chat_template must be auto, true or false, got {apply_chat_template!r}")
    return apply_chat_template


def _render(prompt: str | list[dict[str, str]], source: str, tokenizer: Any, use_template: bool,
            apply_chat_template: Any) -> tuple[str, bool]:
    """(text to tokenize, whether it came from the chat template)."""
    messages = prompt if isinstance(prompt, list) else None
    if messages is not None and not use_template:
        if apply_chat_template is False:
            reason, fix = "data.apply_chat_template is off", "set data.apply_chat_template to auto or true"
        else:
            reason = "the tokenizer has no chat_template"
            fix = "give one with model.chat_template (inline Jinja or a .jinja file) or use a tokenizer that has one"
        raise PromptDataError(f"{source}: the prompt is a chat message list but {reason}; {fix}, or give "
                              f"plain-string prompts")
    if not use_template:
        return prompt, False  # type: ignore[return-value]
    messages = messages or [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, True


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


def _prefix(text: str, limit: int) -> str:
    """The first `limit` characters of `text`, cut back to its last whitespace when that keeps at least half: words
    before a whitespace tokenize as in the whole text."""
    head = text[:limit]
    cut = max(head.rfind(c) for c in " \n\t")
    return head[:cut] if cut >= limit // 2 else head


def _chunks(records: Iterable[PromptRecord]) -> Iterator[list[PromptRecord]]:
    chunk: list[PromptRecord] = []
    chars = 0
    for record in records:
        chunk.append(record)
        prompt = record.prompt
        chars += len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if len(chunk) >= _CHUNK or chars >= _CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _id_type(tokenizer: Any) -> str:
    try:
        size = len(tokenizer)
    except TypeError:
        return "i"
    return next(code for code, limit in _ID_TYPES if size <= limit)


# ------------------------------------------------------------------------------------------------------ dataset
class PromptDataset(Sequence[PromptItem]):
    """Tokenized prompts with overlong ones removed (the count is logged and kept in ``num_filtered``), or refused
    with an error when ``filter_overlong`` is off. ``apply_chat_template``: ``auto`` uses the tokenizer's chat
    template when it has one, ``True`` requires one, ``False`` never uses it. ``records`` may be any iterable
    (:func:`verl_mega.data.records.iter_prompt_records` streams them); it is consumed once, a chunk at a time."""

    def __init__(
        self,
        records: Iterable[PromptRecord],
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
        self._use_template = _use_template(tokenizer, apply_chat_template)
        self._tokenizer, self._apply_chat_template = tokenizer, apply_chat_template
        self.max_prompt_length = max_prompt_length
        self._ids = array.array(_id_type(tokenizer))  # every kept prompt's token ids, back to back
        self._id_starts = array.array("q", [0])
        self._records = bytearray()  # every kept prompt's (prompt, ground truth, extra), pickled, back to back
        self._record_starts = array.array("q", [0])
        total = 0
        for chunk in _chunks(records):
            total += len(chunk)
            self._add_chunk(chunk, filter_overlong)
        self.num_filtered = total - len(self)
        if self.num_filtered:
            logger.warning(
                "filtered %d of %d prompts longer than max_prompt_length=%d tokens",
                self.num_filtered, total, max_prompt_length,
            )
        if not len(self):
            raise PromptDataError(
                f"all {total} prompts are longer than max_prompt_length={max_prompt_length} tokens; raise it"
            )

    def _add_chunk(self, chunk: list[PromptRecord], filter_overlong: bool) -> None:
        rendered = [_render(r.prompt, r.source, self._tokenizer, self._use_template, self._apply_chat_template)
                    for r in chunk]
        bound = self.max_prompt_length * _CHARS_PER_TOKEN_BOUND
        cut = [(_prefix(text, bound), templated) if len(text) > bound else None for text, templated in rendered]
        encoded = _tokenize(self._tokenizer, [c or r for c, r in zip(cut, rendered)])
        for i, ids in enumerate(encoded):
            if cut[i] is not None and len(ids) <= self.max_prompt_length + _CUT_MARGIN:  # undecided: the whole text
                encoded[i] = _tokenize(self._tokenizer, [rendered[i]])[0]
                cut[i] = None
        for record, (text, _), ids, prefix in zip(chunk, rendered, encoded, cut):
            if not ids:  # the engine refuses an empty prompt, and only when its batch comes up
                raise PromptDataError(f"{record.source}: prompt {text[:40]!r} encodes to no tokens (whitespace only, "
                                      f"or characters outside the tokenizer's vocabulary); remove the record or fix it")
            if len(ids) > self.max_prompt_length:
                if not filter_overlong:
                    tokens = f"{len(ids)} tokens" if prefix is None else \
                        f"{len(ids)} tokens in its first {len(prefix[0])} of {len(text)} characters"
                    raise PromptDataError(
                        f"{record.source}: prompt has {tokens} > max_prompt_length={self.max_prompt_length}; "
                        "raise max_prompt_length or turn on filtering of overlong prompts"
                    )
                continue
            self._add_ids(ids)
            self._records += pickle.dumps((record.prompt, record.ground_truth, record.extra),
                                          protocol=pickle.HIGHEST_PROTOCOL)
            self._record_starts.append(len(self._records))

    def _add_ids(self, ids: list[int]) -> None:
        top = max(ids)
        limit = dict(_ID_TYPES)[self._ids.typecode]
        if top >= limit or min(ids) < 0:  # a tokenizer that reported a smaller vocabulary: widen the array
            if min(ids) < 0:
                raise PromptDataError(f"the tokenizer produced a negative token id ({min(ids)})")
            code = next(c for c, lim in _ID_TYPES if top < lim)
            self._ids = array.array(code, self._ids)
        self._ids.extend(ids)
        self._id_starts.append(len(self._ids))

    @classmethod
    def from_files(
        cls,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        *,
        max_prompt_length: int,
        prompt_key: str = DEFAULT_PROMPT_KEY,
        answer_key: str | None = DEFAULT_ANSWER_KEY,
        apply_chat_template: ChatTemplateMode = "auto",
        filter_overlong: bool = True,
        generated_size: int = 1024,
        generated_seed: int = 0,
    ) -> "PromptDataset":
        """``paths`` are files or ``generated:<task>`` entries; see :func:`load_prompt_records`. The files are read
        a row at a time."""
        records = iter_prompt_records(paths, prompt_key=prompt_key, answer_key=answer_key,
                                      generated_size=generated_size, generated_seed=generated_seed)
        return cls(records, tokenizer, max_prompt_length=max_prompt_length, apply_chat_template=apply_chat_template,
                   filter_overlong=filter_overlong)

    @property
    def nbytes(self) -> int:
        """Bytes held for the prompts (token ids, records and their offsets)."""
        return sum(a.itemsize * len(a) for a in (self._ids, self._id_starts, self._record_starts)) + \
            len(self._records)

    @property
    def items(self) -> list[PromptItem]:
        """Every prompt as a :class:`PromptItem` (made now: a validation set that is generated whole)."""
        return list(self)

    def __len__(self) -> int:
        return len(self._id_starts) - 1

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"prompt index {i} out of range for a dataset of {n}")
        i %= n
        ids = self._ids[self._id_starts[i]:self._id_starts[i + 1]].tolist()
        prompt, truth, extra = pickle.loads(self._records[self._record_starts[i]:self._record_starts[i + 1]])
        text, _ = _render(prompt, f"prompt {i}", self._tokenizer, self._use_template, self._apply_chat_template)
        return PromptItem(i, ids, text, truth, extra)

    def __iter__(self) -> Iterator[PromptItem]:
        for i in range(len(self)):
            yield self[i]
