"""The batch container that moves tensors and non-tensor fields between RL stages.

Sequences are stored left-aligned, ``[prompt | response | pad]``: with only right padding, plain causal attention
is exact (no attention mask, no position-id shifts), which lets SDPA use its fused causal kernels. Per-response
quantities (log-probs, values, advantages) live in a ``[B, R]`` "response frame".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist


@dataclass
class Batch:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if len(self) and value.shape[0] != len(self):
            raise ValueError(f"batch: field {key!r} has {value.shape[0]} rows, batch has {len(self)}")
        self.tensors[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def select(self, index: torch.Tensor | Sequence[int]) -> "Batch":
        idx = torch.as_tensor(index, dtype=torch.long)
        return Batch({k: v[idx] for k, v in self.tensors.items()},
                     {k: [v[i] for i in idx.tolist()] for k, v in self.meta.items()})

    def chunks(self, size: int) -> Iterator["Batch"]:
        for start in range(0, len(self), size):
            yield self.select(range(start, min(start + size, len(self))))

    @staticmethod
    def concat(parts: Sequence["Batch"]) -> "Batch":
        parts = [p for p in parts if len(p)]
        if not parts:
            return Batch()
        keys = parts[0].tensors.keys()
        tensors = {}
        for k in keys:
            ts = [p.tensors[k] for p in parts]
            width = max(t.shape[1] for t in ts) if ts[0].dim() > 1 else None
            if width is not None:
                ts = [torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.shape[1] < width else t for t in ts]
            tensors[k] = torch.cat(ts)
        meta = {k: [x for p in parts for x in p.meta[k]] for k in parts[0].meta}
        return Batch(tensors, meta)

    def all_gather(self, group) -> "Batch":
        """Concatenate the batches of every rank in `group` (object collective: for small control batches)."""
        if group is None or dist.get_world_size(group) == 1:
            return self
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, self, group=group)
        return Batch.concat(parts)


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, pad_id: int,
                   max_response_length: int, multiple_of: int = 8, min_width: int = 1) -> dict[str, torch.Tensor]:
    """Build left-aligned [prompt|response|pad] rows and the response-frame mask; rows are at least
    ``min_width`` wide (rounded up to ``multiple_of``), so that every data-parallel rank pads alike."""
    b = len(prompts)
    p_len = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    r_len = torch.tensor([len(r) for r in responses], dtype=torch.long)
    width = max(int((p_len + r_len).max()) if b else 1, min_width)
    width = -(-width // multiple_of) * multiple_of
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    resp = torch.full((b, max_response_length), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):  # lists or tensors (rows received as tensor views)
        ids[i, : len(p)] = torch.as_tensor(p, dtype=torch.long)
        if len(r):
            r = torch.as_tensor(r, dtype=torch.long)
            ids[i, len(p): len(p) + len(r)] = r
            resp[i, : len(r)] = r
    response_mask = (torch.arange(max_response_length)[None, :] < r_len[:, None]).float()
    return {"input_ids": ids, "prompt_len": p_len, "response_len": r_len, "responses": resp,
            "response_mask": response_mask}


def response_positions(prompt_len: torch.Tensor, width: int) -> torch.Tensor:
    """Index into the full-sequence log-prob frame (position t predicts token t+1) for each response token."""
    idx = prompt_len[:, None] - 1 + torch.arange(width, device=prompt_len.device)[None, :]
    return idx.clamp_min(0)
