"""In-world engines: the rollout pool's ranks run vLLM engines of ``gen_tp`` consecutive ranks each, all inside the
pool's own torch.distributed world (one vLLM world over the pool's ranks), under :class:`~verl_mega.rollout.server.
RolloutServer`. It is the engine set for the cases where one world is best: engines of any ``gen_tp`` and partial
rollouts. One rank's death is the world's, and ends the job's attempt (``docs/fault_tolerance.md``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch.distributed as dist

from verl_mega.rollout.base import Sample, engine_share, prompt_seed
from verl_mega.rollout.server import NONE_OPEN, Lockstep
from verl_mega.rollout.streaming import StreamingEngine
from verl_mega.rollout.vllm_rollout import VLLMRollout


class InWorldEngines:
    """This rank's engine (an :class:`~verl_mega.rollout.server.EngineSet` whose lockstep is the whole pool). Every
    engine steps its contiguous share of every batch (:class:`~verl_mega.rollout.streaming.StreamingEngine`), the
    share and the seeds a colocated engine would have, so a batch's samples do not depend on where it ran.
    ``engine_ranks``: the ranks of this rank's engine (the first holds the samples that go back); ``partial``:
    weights go in between two engine steps while requests run (rollout.partial_rollouts)."""

    def __init__(self, rollout: VLLMRollout, *, engine_ranks: Sequence[int], partial: bool = False) -> None:
        self.rollout, self.partial = rollout, partial
        self.stream = StreamingEngine(rollout)
        self.engine_leader = dist.get_rank() == engine_ranks[0]  # of the rollout pool's own world
        self.lockstep = Lockstep(dist.new_group(backend="gloo"))

    @property
    def busy(self) -> bool:
        return self.stream.busy

    def poll(self) -> None:  # the engine is stepped in advance(): nothing arrives in between
        pass

    def open(self) -> int:
        return min((key[0] for key in self.stream.open()), default=NONE_OPEN)

    def _mine(self, command: dict) -> range:
        return engine_share(range(len(command["prompts"])), self.rollout.engine_index, self.rollout.num_engines)

    def submit(self, command: dict, version: int) -> None:  # noqa: ARG002 - the engine counts its own weights
        """This engine's share of every prompt, under every spec (seeds as when colocated)."""
        mine = self._mine(command)
        for i, spec in enumerate(command["specs"]):
            if spec.seed is not None:
                spec = replace(spec, seed=prompt_seed(spec.seed, mine[0] if mine else 0, spec.n))
            self.stream.add((command["id"], i), [command["prompts"][p] for p in mine], spec)

    def take(self, command: dict) -> list[list[Sample]] | None:
        """Gather a finished batch from the engine leaders (collective over the pool)."""
        mine = self._mine(command)
        parts = []
        for i in range(len(command["specs"])):
            got = self.stream.take((command["id"], i))
            parts.append([Sample(mine[p], ids, lps, None, None, versions) for p, ids, lps, versions in zip(
                got.prompt_index, got.token_ids, got.logprobs, got.versions)] if self.engine_leader else [])
        gathered = self.lockstep.collect(parts)
        if gathered is None:
            return None
        # prompt order; a stable sort keeps an engine's order within a prompt (its n samples)
        return [sorted((s for rank in gathered for s in rank[i]), key=lambda s: s.prompt) for i in range(len(parts))]

    def refit(self, staged: Any, version: int) -> None:  # noqa: ARG002 - weights_changed counts it
        staged.apply()
        self.stream.weights_changed()

    def advance(self) -> None:
        self.stream.step()

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self.rollout.shutdown()


__all__ = ["InWorldEngines"]
