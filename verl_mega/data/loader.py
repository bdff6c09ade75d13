"""Deterministic, resumable, data-parallel-sharded global batches of prompts.

Order: epoch ``e`` visits the prompts in a permutation seeded by ``(seed, e)``; each global batch of
``global_batch_size`` prompts is split into ``dp_size`` contiguous shards, rank ``r`` taking shard ``r``. The
incomplete last batch of an epoch is dropped. ``state_dict()`` = (epoch, index of the next batch), so a resumed run
sees exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import array
import copy
import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from verl_mega.data.records import PromptDataError

__all__ = ["PromptItem", "PromptBatch", "PromptLoader"]


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
        self._order: Sequence[int] = ()

    @property
    def total_batches(self) -> int:
        return self.batches_per_epoch * self.num_epochs

    @property
    def done(self) -> bool:
        return self.epoch >= self.num_epochs

    def _epoch_order(self, epoch: int) -> Sequence[int]:
        if self._order_epoch != epoch:
            # 8 bytes per prompt (a list of ints would take ~36); Random.shuffle only swaps items, so the
            # permutation is the one a list would get
            order = array.array("q", range(len(self.dataset)))
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

    def check_state(self, state: dict[str, Any]) -> None:
        """Refuse a saved state from a different dataset size / batch size / seed, since the same position would then
        mean different prompts, and an impossible position."""
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

    def ends_at(self, state: dict[str, Any]) -> bool:
        """Whether a saved position is at this loader's end: it has no batch left to serve from there."""
        return int(state["epoch"]) * self.batches_per_epoch + int(state["index"]) >= self.total_batches

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position (checked first: :meth:`check_state`)."""
        self.check_state(state)
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
