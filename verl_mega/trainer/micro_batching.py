"""Splitting a role's batch into the micro-batches the engine runs, and reading per-row results back.

Two layouts (see docs/performance.md):

* **padded** — ``[rows, width]`` micro-batches of left-aligned rows ``[prompt | response | pad]``: a fixed number of
  rows, or (``token_budget``) as many consecutive rows as fit ``rows × longest row``;
* **packed** (``model.use_remove_padding``) — the rows of a micro-batch back to back in one ``[1, T]`` row (THD):
  ``cu_seqlens`` marks where each sequence starts, attention stays inside a sequence and rotary positions restart
  with it. A micro-batch holds ``rows_per_micro_batch`` rows, or (``token_budget``) rows placed first-fit-decreasing
  into micro-batches of at most ``token_budget`` tokens; ``T`` is rounded up to the engine's sequence multiple with a
  padding segment of its own. No token is spent on padding between rows.

Either way a micro-batch carries the per-row tensors of its rows (``prompt_len``, ``response_mask`` and the rest of
the response frame), and :class:`MicroBatches` maps the engine's per-micro-batch outputs back to the batch's row order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from verl_mega.trainer.batch import Batch, response_positions

MicroBatch = dict[str, torch.Tensor]
PACKED_KEY = "cu_seqlens"  # a micro-batch carrying it is packed


@dataclass
class MicroBatches:
    batches: list[MicroBatch]
    rows: torch.Tensor  # the batch row of every micro-batch row, in order; -1 for filler rows

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)

    def restore(self, per_micro_batch: list[torch.Tensor]) -> torch.Tensor:
        """Per-row outputs of every micro-batch (concatenated in order) → one row per batch row, in batch order;
        outputs narrower than the widest are right-padded with zeros."""
        width = max(t.shape[1] for t in per_micro_batch) if per_micro_batch[0].dim() > 1 else None
        if width is not None:
            per_micro_batch = [_pad_to(t, width) for t in per_micro_batch]
        flat = torch.cat(per_micro_batch)
        real = self.rows >= 0
        out = flat.new_zeros((int(real.sum()), *flat.shape[1:]))
        out[self.rows[real]] = flat[real]
        return out


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1])) if t.shape[1] < width else t


def make_micro_batches(batch: Batch, keys: tuple[str, ...], *, rows_per_micro_batch: int,
                       token_budget: int | None = None, multiple: int = 8, packed: bool = False,
                       sequence_multiple: int = 1, same_shape: bool = False,
                       agree_count: Callable[[int], int] | None = None) -> MicroBatches:
    """The micro-batches of ``batch`` (the fields ``keys``). ``same_shape``: every micro-batch gets one shape (the
    pipeline schedule needs it with pp>1). ``agree_count(n)`` → the largest n over the ranks that must run the same
    number of micro-batches (expert-parallel ranks, whose token dispatch is a collective); the missing ones are
    filled with a copy of row 0 whose response mask is zero. Packed, every sequence takes a multiple of
    ``sequence_multiple`` tokens (2·cp with context parallelism, which splits each sequence into 2·cp chunks)."""
    real = (batch["prompt_len"] + batch["response_len"]).tolist() if "response_len" in batch \
        else [batch["input_ids"].shape[1]] * len(batch)
    lengths = [_round_up(n, sequence_multiple) for n in real] if packed else real
    if token_budget is not None and packed:
        groups = first_fit_decreasing(lengths, token_budget)
    elif token_budget is not None:
        groups = _consecutive_within_budget(lengths, token_budget)
    else:
        groups = [list(range(s, min(s + rows_per_micro_batch, len(batch))))
                  for s in range(0, len(batch), rows_per_micro_batch)]
        if not packed and len(groups[-1]) < rows_per_micro_batch:  # padded micro-batches share one shape
            groups[-1] += [-1] * (rows_per_micro_batch - len(groups[-1]))
    if agree_count is not None:
        groups += [[-1]] * (agree_count(len(groups)) - len(groups))
    if packed:
        used = [sum(lengths[max(r, 0)] for r in g) for g in groups]
        widths = [_round_up(u, multiple) for u in used]
        if same_shape:
            widths = [max(widths)] * len(widths)
        out = [_packed(batch, keys, g, real, lengths, w) for g, w in zip(groups, widths)]
    else:
        full = batch["input_ids"].shape[1]
        widths = [full if token_budget is None else min(full, _round_up(max(lengths[max(r, 0)] for r in g), multiple))
                  for g in groups]
        if same_shape:
            widths = [max(widths)] * len(widths)
        out = [_padded(batch, keys, g, w) for g, w in zip(groups, widths)]
    return MicroBatches(out, torch.tensor([r for g in groups for r in g], dtype=torch.long))


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _consecutive_within_budget(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive rows while rows × longest row stays within the budget (padded rows cost the longest)."""
    groups, current, longest = [], [], 0
    for i, length in enumerate(lengths):
        if current and (len(current) + 1) * max(longest, length) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    return groups + ([current] if current else [])


def first_fit_decreasing(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows into as few micro-batches of at most ``budget`` tokens as first-fit-decreasing finds; a row longer than the
    budget gets a micro-batch of its own. Rows keep their batch order inside a micro-batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


def _rows(batch: Batch, keys: tuple[str, ...], group: list[int]) -> MicroBatch:
    """The per-row fields of ``group``; filler rows (-1) are copies of row 0 that no loss term or metric counts."""
    idx = torch.tensor([max(r, 0) for r in group])
    mb = {k: batch[k][idx] for k in keys if k in batch.tensors}
    if "response_mask" in mb:
        real = torch.tensor([r >= 0 for r in group], dtype=mb["response_mask"].dtype)
        mb["response_mask"] = mb["response_mask"] * real[:, None]
    return mb


def _padded(batch: Batch, keys: tuple[str, ...], group: list[int], width: int) -> MicroBatch:
    mb = _rows(batch, keys, group)
    mb["input_ids"] = mb["input_ids"][:, :width]
    mb["position_ids"] = torch.arange(width).expand(len(group), width)
    return mb


def _packed(batch: Batch, keys: tuple[str, ...], group: list[int], real: list[int], lengths: list[int],
            width: int) -> MicroBatch:
    """Rows back to back; a row's tokens fill the start of its sequence slot (``lengths``, ≥ its ``real`` length)."""
    mb = _rows(batch, keys, group)
    seq = [lengths[max(r, 0)] for r in group]
    starts = torch.tensor([0] + seq).cumsum(0)
    ids = torch.zeros(width, dtype=batch["input_ids"].dtype)
    positions = torch.zeros(width, dtype=torch.long)
    for row, start, slot, length in zip(mb["input_ids"], starts.tolist(), seq, [real[max(r, 0)] for r in group]):
        ids[start:start + length] = row[:length]
        positions[start:start + slot] = torch.arange(slot)
    cu = starts if int(starts[-1]) == width else torch.cat([starts, torch.tensor([width])])  # + the padding segment
    mb["input_ids"] = ids[None]
    mb["position_ids"] = positions[None]
    mb[PACKED_KEY] = cu.to(torch.int32)
    mb["max_seqlen"] = (cu[1:] - cu[:-1]).max().reshape(())
    mb["row_start"] = starts[:-1]
    return mb


def response_frame(per_token: torch.Tensor, mb: MicroBatch, width: int) -> torch.Tensor:
    """Per-position values of a micro-batch (position t predicts token t+1): padded ``[rows, s]`` or packed
    ``[1, T]`` → the response frame ``[rows, width]``."""
    if PACKED_KEY in mb:
        idx = mb["row_start"][:, None] + response_positions(mb["prompt_len"], width)
        return per_token[0][idx.clamp(max=per_token.shape[1] - 1)]
    idx = response_positions(mb["prompt_len"], width).clamp(max=per_token.shape[1] - 2)
    return per_token.gather(1, idx)


def last_token(per_token: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """The value at each row's last token (prompt + response) → [rows]."""
    last = (mb["prompt_len"] + mb["response_len"] - 1).clamp_min(0)
    if PACKED_KEY in mb:
        return per_token[0][mb["row_start"] + last]
    return per_token.gather(1, last[:, None])[:, 0]


def next_tokens(ids: torch.Tensor) -> torch.Tensor:
    """The token each position predicts, ``ids`` shifted left by one (the last position's target wraps around and
    is never read): log-probs come from the whole output, without a sliced copy of the logits."""
    return torch.roll(ids, -1, dims=-1)
