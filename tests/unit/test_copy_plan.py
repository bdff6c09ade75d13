"""The weight sync's copy plan: eager first, then one captured graph replayed; recording destinations count exactly one
run's writes per sync whichever way it ran. CUDA graphs themselves run in tests/gpu (jobs/fp8_sync_job.py); here a
capture stands in that has their semantics: capturing runs the Python but no kernel, a replay runs the kernels only."""

import logging

import torch

from verl_mega.hybrid.copy_plan import CopyPlan


class Graph:
    def __init__(self) -> None:
        self.kernels: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for dst, src in self.kernels:
            dst.copy_(src)


_capturing: list[Graph] = []


def _kernel(dst: torch.Tensor, src: torch.Tensor) -> None:
    if _capturing:
        _capturing[-1].kernels.append((dst, src))
    else:
        dst.copy_(src)


class Recording:
    """A destination that records its writes, as Fp8Rows does."""

    def __init__(self, tensor: torch.Tensor, counts: dict[str, int], name: str) -> None:
        self.weight, self.record = tensor, (counts, name)

    def copy_(self, src: torch.Tensor) -> "Recording":
        _kernel(self.weight, src)
        counts, name = self.record
        counts[name] = counts.get(name, 0) + self.weight.numel()
        return self


class Plain:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def copy_(self, src: torch.Tensor) -> None:
        _kernel(self.tensor, src)


def capture(copies):
    graph = Graph()
    _capturing.append(graph)
    try:
        copies()
    finally:
        _capturing.pop()
    return graph


def _setup():
    counts: dict[str, int] = {}
    srcs = [torch.randn(4, 3), torch.randn(2, 3), torch.randn(5)]
    dsts = [torch.zeros(4, 3), torch.zeros(2, 3), torch.zeros(5)]
    pairs = [(Recording(dsts[0], counts, "a"), srcs[0]), (Recording(dsts[1], counts, "a"), srcs[1]),
             (Plain(dsts[2]), srcs[2])]
    return counts, srcs, dsts, pairs


def test_second_run_captures_and_later_runs_replay_with_one_runs_records():
    counts, srcs, dsts, pairs = _setup()
    graphs = []
    plan = CopyPlan((1,), pairs, capture=lambda copies: graphs.append(capture(copies)) or graphs[-1])
    for run in range(4):
        counts.clear()  # the transport clears its records at every sync
        for s in srcs:
            s.add_(1.0)  # new training weights, in place
        plan.run()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs)), f"run {run} did not write the new weights"
        assert counts == {"a": 18}, f"run {run} recorded {counts}"
        assert plan.graphed == (run >= 1)
    assert len(graphs) == 1 and graphs[0].replays == 3 and len(graphs[0].kernels) == 3


def test_a_failed_capture_stays_eager_and_warns(caplog):
    counts, srcs, dsts, pairs = _setup()

    def broken(copies):
        copies()  # the Python ran (records counted) before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing")

    plan = CopyPlan((1,), pairs, capture=broken)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            counts.clear()
            srcs[0].add_(1.0)
            plan.run()
            assert counts == {"a": 18} and torch.equal(dsts[0], srcs[0])
    assert not plan.graphed
    assert sum("CUDA graph failed" in r.message for r in caplog.records) == 1


def test_no_graph_when_turned_off_or_off_cuda():
    counts, srcs, dsts, pairs = _setup()
    calls = []
    plan = CopyPlan((1,), pairs, graph=False, capture=lambda copies: calls.append(1))
    for _ in range(3):
        plan.run()
    assert calls == [] and not plan.graphed
    cpu = CopyPlan((1,), [(torch.zeros(3), torch.ones(3))])  # CPU tensors: the default capture is never made
    for _ in range(3):
        cpu.run()
    assert not cpu.graphed and torch.equal(cpu.pairs[0][0], torch.ones(3))
