"""Rollout on a pool of its own, the training pool's side: :class:`RemoteRollout`, the trainer's
:class:`~verl_mega.rollout.base.Rollout` for engines on another pool.

The rollout pool serves what it sends (``generate``, ``weights``, ``stop``) in the order sent, with
:class:`~verl_mega.rollout.server.RolloutServer`, whose docstring says how the order bounds the staleness.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Sequence

import torch.distributed as dist

from verl_mega.parallel.pools import CONTROL_TAG, RESULT_TAG, Bridge, PoolPeerError
from verl_mega.parallel.state import pool_group
from verl_mega.rollout.base import Generated, Request, RolloutError, SamplingSpec, engine_share

log = logging.getLogger(__name__)


class RemoteRollout:
    """The :class:`~verl_mega.rollout.base.Rollout` protocol on the training pool, for engines on another pool.

    Every training rank calls every method together (the samples are shared over the training pool, the weights
    sent collectively). :meth:`generate` returns, on each rank, the share of the samples that its generation
    engine would hold when colocated (same engines, same split), so the step after it is the colocated one.
    Every sample carries the weight version of each of its tokens."""

    def __init__(self, bridge: Bridge, weight_sync: Any, *, engine_index: int, num_engines: int,
                 engine_leader: bool) -> None:
        self.bridge, self.weight_sync = bridge, weight_sync
        self.engine_index, self.num_engines, self.engine_leader = engine_index, num_engines, engine_leader
        self.leader = bridge.rank == 0
        self.server = bridge.placement.pool_of("rollout").ranks[0]
        self.pool_ranks = tuple(bridge.placement.pool_of("rollout").ranks)  # whose heartbeats a wait checks
        self.weight_version = 0  # updates sent to the pool
        self.stop_requested = ""  # a signal a rank of the pool received (known to the leader)
        self._next_id = 0
        self._pending: OrderedDict[int, tuple] = OrderedDict()  # requests sent, results not received yet
        # received, not collected yet (a batch asked ahead, or passed by): id → (its request, its result)
        self._received: dict[int, tuple[tuple, dict]] = {}
        self._sends: list[Any] = []
        self.closed = False

    # ---- the protocol ------------------------------------------------------------------------------------
    def prefetch(self, requests: Sequence[Request]) -> None:
        """Ask the pool now for every request it has not been asked for yet, in order; a later :meth:`generate`
        of the same batch collects it. Weights sent after a request do not reach it: that is the staleness."""
        keys = [_key(prompt_ids, specs) for prompt_ids, specs in requests]
        for i in [i for i, (k, _) in self._received.items() if k not in keys]:  # left behind (an API caller's own)
            del self._received[i]
        for key in keys:
            self._ask(key)

    def _ask(self, key: tuple) -> int:
        """The id of the request for `key`: one received or pending already (a batch asked for ahead, whose result
        a validation's generation may have taken in passing), else a new request."""
        for asked in ({i: k for i, (k, _) in self._received.items()}, self._pending):
            found = next((i for i, k in asked.items() if k == key), None)
            if found is not None:
                return found
        self._pending[self._next_id] = key
        self._post({"op": "generate", "id": self._next_id, "prompts": key[0], "specs": key[1]})
        self._next_id += 1
        return self._next_id - 1

    def generate(self, prompt_ids: Sequence[Sequence[int]], specs: Sequence[SamplingSpec], *,
                 on_finished=None) -> list[Generated]:
        if on_finished is not None:
            raise RolloutError("a rollout pool of its own returns whole batches: it cannot stream finished samples")
        wanted = self._ask(_key(prompt_ids, specs))  # asked for ahead, or now
        while wanted not in self._received:  # results come back in the order the requests went out
            first = next(iter(self._pending))
            self._received[first] = (self._pending[first], self._receive(first))
            del self._pending[first]
        _, result = self._received.pop(wanted)
        mine = engine_share(range(len(prompt_ids)), self.engine_index, self.num_engines)  # as a colocated engine
        # a fleet's counters (rollout.fleet), counted once: the step sums every engine's counts
        counts = {f"fleet/{k}": v if self.engine_index == 0 else 0.0 for k, v in result.get("fleet", {}).items()}
        return [Generated([s for s in samples if s.prompt in mine], result["version"], self.engine_index,
                          self.engine_leader, dict(counts)) for samples in result["samples"]]

    def update_weights(self) -> dict[str, float]:
        self._post({"op": "weights"})
        try:
            metrics = self.bridge.watching(self.pool_ranks, "sending weights to the rollout pool",
                                           self.weight_sync.sync)
        except PoolPeerError:
            raise
        except RuntimeError as exc:  # a receiver's connection dropped mid-transfer
            raise PoolPeerError(f"the weight transfer to the rollout pool failed ({' '.join(str(exc).split())[:200]});"
                                f" a rollout rank died or hung") from None
        self.weight_version += 1
        return metrics

    def release_memory(self) -> None:  # the engines live on their own devices: nothing to release here
        pass

    def restore_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        """Tell the pool to stop (once); after an error a pool that is gone already is not waited for."""
        if self.closed:
            return
        self.closed = True
        if self.leader:
            try:
                what = "stopping the rollout pool"
                self.bridge.wait(self._sends + self.bridge.send({"op": "stop"}, self.server, CONTROL_TAG, what),
                                 self.server, what)
                # batches that were sent ahead and finished: taken and dropped, so that no send stays pending
                while self.bridge.recv(self.server, RESULT_TAG, what).get("op") != "stopped":
                    pass
            except RuntimeError:
                pass

    # ---- wire ----------------------------------------------------------------------------------------------
    def _post(self, command: dict) -> None:
        if self.leader:
            # one command in flight: the pool reads them in order, so this never waits on work of its own
            what = f"sending {command['op']!r} to the rollout pool"
            self.bridge.wait(self._sends, self.server, what, watch=self.pool_ranks)
            self._sends = self.bridge.send(command, self.server, CONTROL_TAG, what)

    def _stop(self, reason: str) -> None:
        if reason != self.stop_requested:
            log.warning("the rollout pool received %s: the job stops after this step", reason)
            self.stop_requested = reason

    def _receive(self, request: int) -> dict:
        box = [None]
        if self.leader:
            what = f"generating batch request {request}"
            box[0] = self.bridge.recv(self.server, RESULT_TAG, what, watch=self.pool_ranks)
            while box[0].get("op") == "signal":  # a preempted rollout node: the job stops after this step
                self._stop(box[0]["name"])
                box[0] = self.bridge.recv(self.server, RESULT_TAG, what, watch=self.pool_ranks)
            if box[0].get("signal"):  # the same, on a batch sent after it (the signal itself is queued behind)
                self._stop(box[0]["signal"])
            if box[0]["id"] != request:
                raise RuntimeError(f"the rollout pool answered request {box[0]['id']}, expected {request}")
        dist.broadcast_object_list(box, src=0, group=pool_group())  # over the training pool
        return box[0]


def _key(prompt_ids: Sequence[Sequence[int]], specs: Sequence[SamplingSpec]) -> tuple:
    return [list(p) for p in prompt_ids], list(specs)


__all__ = ["RemoteRollout"]
