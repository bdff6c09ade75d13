"""The colocated :class:`~verl_mega.rollout.base.Rollout` (HybridFlow's 3D-HybridEngine timeline).

:class:`ColocatedRollout` runs vLLM in-process on the training ranks and owns the switch between training and
generation::

    offload idle training state → wake vLLM → generate this engine's share → gather every engine's samples
    → vLLM sleeps (KV cache freed) → training state returns

``HybridEngine`` is the same class under the name users were promised; ``HybridEngine().is_available()`` answers,
without building anything, whether this process can run it (and :meth:`ColocatedRollout.why_unavailable` says why
not). On a single device the same code runs with every communication step skipped.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Any, Callable, Sequence

import torch

from verl_mega.rollout.base import Generated, Request, RolloutError, Sample, SamplingSpec, prompt_seed
from verl_mega.rollout.vllm_rollout import VLLMRollout

logger = logging.getLogger(__name__)


class ColocatedRollout:
    """vLLM engines inside the training ranks; weights arrive through the 3D-HybridEngine's in-place sync.

    ``weight_sync``: an object whose ``sync()`` writes the actor's weights into ``engine`` (hybrid.WeightSync).
    ``engine_ranks``: the ranks of this rank's engine (its first is the engine's leader). ``offload``:
    called with True before generation and False after, to move idle training state out of the way.
    ``profiler``: records the sub-stages (wake-up, prefill, decode, postprocess, sleep) under ``rollout``.
    ``multi_turn``: a :class:`~verl_mega.rollout.multi_turn.MultiTurn` runner; every spec then runs as episodes
    with tool calls.
    """

    def __init__(self, engine: VLLMRollout | None = None, *, weight_sync: Any = None,
                 engine_ranks: Sequence[int] = (0,), offload: Callable[[bool], None] | None = None,
                 free_cache: bool = True, profiler: Any = None, multi_turn: Any = None) -> None:
        self.engine, self.weight_sync, self.engine_ranks = engine, weight_sync, tuple(engine_ranks)
        self.offload, self.free_cache, self.profiler = offload, free_cache, profiler
        self.multi_turn = multi_turn
        self.stop_requested = ""  # its engines run on the trainer's ranks, whose signals the trainer handles
        self._streaming = None  # a StreamingEngine over ``engine``, made on the first streamed generation

    # ---- availability ------------------------------------------------------------------------------------
    @staticmethod
    def why_unavailable() -> str | None:
        """None when this process can run colocated rollout, else the reason and the fix."""
        import torch.distributed as dist

        try:
            from vllm.platforms import current_platform
        except Exception as exc:  # vLLM import errors vary by build
            return f"vLLM is not importable ({type(exc).__name__}: {exc}); install verl_mega[gpu] or verl_mega[cpu]"
        cuda = torch.cuda.is_available()
        if cuda and current_platform.is_cpu():
            return "CUDA is present but the installed vLLM is the CPU build; install verl_mega[gpu]"
        if not cuda and not current_platform.is_cpu():
            return "no CUDA device and vLLM is not the CPU build; install verl_mega[cpu] for CPU mode"
        if dist.is_initialized():
            backend = str(dist.get_backend())
            if cuda and "nccl" not in backend:
                return f"torch.distributed uses {backend!r} on GPUs; initialise it with NCCL"
        elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "WORLD_SIZE > 1 but torch.distributed is not initialised; call parallel.state.init_distributed()"
        if cuda and not dist.is_nccl_available():
            return "this PyTorch build has no NCCL; GPU weight sync needs it"
        return None

    def is_available(self) -> bool:
        reason = self.why_unavailable()
        if reason is not None:
            logger.warning("HybridEngine unavailable: %s", reason)
        return reason is None

    # ---- the protocol ------------------------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._ready().weight_version

    def generate(self, prompt_ids: Sequence[Sequence[int]], specs: Sequence[SamplingSpec], *,
                 on_finished: Callable[[list[tuple[int, Sample]], int], None] | None = None) -> list[Generated]:
        """Every rank passes the global prompt batch; each engine generates its share under every spec (one wake
        for all of them) and its ranks return it. An explicit ``spec.seed`` is the batch's base seed: prompt i of
        the batch samples with ``prompt_seed(seed, i, n)``, whichever engine runs it. ``on_finished`` (one spec):
        the engine is stepped here; after every engine step in which samples finished, they are passed to it as
        (index of the sample in its prompt's group, sample) with the number of this engine's samples still
        generating, identically on every rank of the engine."""
        import torch.distributed as dist

        engine, prof = self._ready(), self.profiler
        t0 = prof.now()
        if engine.weights_discarded:  # asleep at level 2 since the last sync (a validation or DAPO round came first)
            self.weight_sync.restore()
            prof.record("weight_restore", t0, prof.now(), parent="rollout")
            t0 = prof.now()
        self._offload(True)  # free the accelerator for the KV cache while vLLM generates
        if torch.cuda.is_available():  # training's cached blocks go back to the device before vLLM maps its memory
            torch.cuda.empty_cache()
        engine.wake_up()
        prof.record("wake_up", t0, prof.now(), parent="rollout")  # vLLM re-maps weights and KV cache
        mine = engine.engine_share(list(range(len(prompt_ids))))
        local, counts = [], []
        for spec in specs:
            if spec.seed is not None:
                spec = replace(spec, seed=prompt_seed(spec.seed, mine[0] if mine else 0, spec.n))
            mine_prompts = [prompt_ids[i] for i in mine]
            if self.multi_turn is not None:
                episodes = self.multi_turn.run(engine, mine_prompts, spec)
                local.append([Sample(mine[e.prompt], e.ids, e.logprobs, e.mask) for e in episodes])
                counts.append({"episodes": float(len(episodes)), "turns": float(sum(e.turns for e in episodes)),
                               "tool_calls": float(sum(e.tool_calls for e in episodes)),
                               "tool_errors": float(sum(e.tool_errors for e in episodes)),
                               "tool_failures": float(sum(e.tool_failures for e in episodes))})
                continue
            if on_finished is not None:
                gen = self._stream(engine, mine, mine_prompts, spec, on_finished, len(specs))
            else:
                gen = engine.generate(mine_prompts, spec)
            if gen.phases is not None:  # vLLM's request stats split the call into prefill and the decode loop
                prof.record("prefill", gen.phases["start"], gen.phases["first_tokens"], parent="rollout")
                prof.record("decode", gen.phases["first_tokens"], gen.phases["end"], parent="rollout")
                prof.add_counter("decode_steps", gen.phases["decode_steps"])
            routing = gen.routed_experts if gen.routed_experts is not None else [None] * len(gen.token_ids)
            local.append([Sample(mine[p], ids, lps, None, r) for p, ids, lps, r in zip(
                gen.prompt_index, gen.token_ids, gen.logprobs, routing)])
            counts.append({})
        handoff_from = prof.now()
        if self.free_cache:
            engine.sleep()
        self._offload(False)
        prof.record("sleep", handoff_from, prof.now(), parent="rollout")  # vLLM frees memory, training state returns
        leader = not dist.is_initialized() or dist.get_rank() == self.engine_ranks[0]
        return [Generated(part, engine.weight_version, engine.engine_index, leader, c)
                for part, c in zip(local, counts)]

    def _stream(self, engine: VLLMRollout, mine: list[int], prompts: list, spec: SamplingSpec,
                on_finished: Callable[[list[tuple[int, Sample]], int], None], num_specs: int):
        """Generate by stepping vLLM's scheduler, handing each sample over as soon as it is done."""
        from verl_mega.rollout.streaming import StreamingEngine

        if self.multi_turn is not None or num_specs != 1:
            raise RolloutError("streaming a rollout takes one sampling spec of single-turn requests")
        if self._streaming is None or self._streaming.rollout is not engine:
            self._streaming = StreamingEngine(engine, deltas=False)  # weights cannot change during a rollout
        stream, prof = self._streaming, self.profiler
        start, steps = prof.now(), 0
        stream.add("batch", prompts, spec)
        running = len(prompts) * spec.n
        while stream.busy:
            stream.step()
            steps += 1
            if stream.finished:
                done = [(j, Sample(mine[p], *stream.completion(key, p, j))) for key, p, j in stream.finished]
                running -= len(done)
                on_finished(done, running)
        prof.record("engine_steps", start, prof.now(), parent="rollout")
        prof.add_counter("engine_steps", float(steps))
        return stream.take("batch")

    def prefetch(self, requests: Sequence[Request]) -> None:
        """Nothing to send ahead: the engines run on the trainer's ranks, between its steps."""

    def update_weights(self) -> dict[str, float]:
        """Write the actor's new weights into vLLM (collective over the pool)."""
        self._ready()
        return self.weight_sync.sync()

    def release_memory(self) -> None:
        self._ready().sleep()

    def restore_memory(self) -> None:
        self._ready().wake_up()

    def shutdown(self) -> None:
        if self.multi_turn is not None:
            self.multi_turn.close()
        release = getattr(self.weight_sync, "close", None)
        if release is not None:  # a sync across pools holds vLLM's modules: they go with the engine, not at exit
            release()
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _offload(self, offload: bool) -> None:
        if self.offload is not None:
            self.offload(offload)

    def _ready(self) -> VLLMRollout:
        if self.engine is None or self.weight_sync is None:
            raise RuntimeError("this rollout has no engine; build it with trainer.rollout_setup.build_rollout")
        return self.engine


HybridEngine = ColocatedRollout
