"""A fixed list of (destination, source) copies that the colocated weight sync replays at every sync while both sides
keep their storage, and on CUDA replays as one CUDA graph.

Why a graph: at t = tg, p = 1 a sync is a few hundred slice copies (196 linears at Qwen2.5-7B), each a kernel launch.
The quantizing copies of an FP8 rollout are Triton launches that cost ~40 µs of host time each, so without a graph
the host, not the GPU, sets the sync's time. A graph replays every launch for the price of one.

The first run is eager (it compiles the Triton kernels: a capture must not, and a plan whose storage moves between
syncs, e.g. offloaded parameters, never gets a second run). The second captures and replays. Destinations that record
their writes (:class:`~verl_mega.hybrid.fp8.Fp8Rows`, whose records prove the sync wrote every FP8 linear whole) have
them counted at capture and re-added at every replay: a graph performs exactly the writes it captured.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

log = logging.getLogger(__name__)

Pair = tuple[Any, torch.Tensor]  # (a tensor or a recording destination such as Fp8Rows, its source)


class CopyPlan:
    """``pairs`` copied in order by :meth:`run`; ``key`` identifies the storage they were built on (the caller
    rebuilds the plan when it changes). ``graph``: replay a captured graph from the second run on; ``capture`` makes
    it (default: a ``torch.cuda.CUDAGraph``, used only when every tensor is on a CUDA device)."""

    def __init__(self, key: tuple[int, ...], pairs: Sequence[Pair], *, graph: bool = True,
                 capture: Callable[[Callable[[], None]], Any] | None = None) -> None:
        self.key, self.pairs = key, list(pairs)
        self.runs = 0
        if capture is None and _all_cuda(self.pairs):
            capture = _cuda_graph
        self._capture = capture if graph else None
        self._graph: Any = None
        self._writes: list[tuple[dict[str, int], str, int]] = []  # (record dict, name, elements) per replay

    @property
    def graphed(self) -> bool:
        """Whether runs now replay a captured graph."""
        return self._graph is not None

    def run(self) -> None:
        if self._graph is None and self._capture is not None and self.runs >= 1:
            self._graph = self._captured()
        if self._graph is None:
            self._copies()
        else:
            self._graph.replay()
            for counts, name, n in self._writes:
                counts[name] = counts.get(name, 0) + n
        self.runs += 1

    def _copies(self) -> None:
        for dst, src in self.pairs:
            dst.copy_(src)

    def _captured(self) -> Any:
        """The pairs' copies captured once; the recording destinations' counts are what one replay writes. A capture
        that fails leaves the plan eager (the copies still run, at their launch cost), with a warning."""
        records = {id(r[0]): r[0] for dst, _ in self.pairs if (r := getattr(dst, "record", None)) is not None}
        before = {key: dict(counts) for key, counts in records.items()}
        try:
            graph = self._capture(self._copies)
        except Exception as exc:  # noqa: BLE001 - a graph is an optimisation; the eager copies are always right
            log.warning("weight sync: capturing its %d copies in a CUDA graph failed (%s); they run one by one",
                        len(self.pairs), exc)
            graph = None
        self._capture = None
        for key, counts in records.items():  # capture ran no kernel: undo the counts it made, keep them per replay
            old = before[key]
            self._writes += [(counts, name, n - old.get(name, 0)) for name, n in counts.items()
                             if n != old.get(name, 0)]
            counts.clear()
            counts.update(old)
        if graph is None:
            self._writes = []
        return graph


def _all_cuda(pairs: Sequence[Pair]) -> bool:
    def cuda(t: Any) -> bool:
        t = getattr(t, "weight", t)  # a recording destination's storage
        return isinstance(t, torch.Tensor) and t.is_cuda

    return bool(pairs) and all(cuda(dst) and cuda(src) for dst, src in pairs)


def _cuda_graph(copies: Callable[[], None]) -> Any:
    graph = torch.cuda.CUDAGraph()
    # thread-local: a background thread's CUDA calls during the capture (an asynchronous checkpoint's copies) are
    # neither refused nor captured
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        copies()
    return graph
