"""Disaggregated placement: each pool is a torch.distributed world of its own, joined by a bridge.

vLLM builds its groups over ``torch.distributed``'s default world and runs world-wide collectives (its KV-cache
size agreement, for one), so an in-process engine cannot share a world with ranks that never construct it. With
the rollout on a pool of its own, every pool therefore initialises its **own default world** (same rendezvous,
a per-pool key prefix), and the pools talk through a **bridge**: standalone process groups over the whole job
that no library sees — gloo for control messages, and per generation block a group of the block's sender and its
receivers for the weights (NCCL on GPU, gloo on CPU).

The training pool comes first in rank order, so its pool ranks equal the job's ranks and everything built for a
colocated job (Megatron groups, checkpoints, the sample path) runs unchanged on it.

Every rank beats a heartbeat (a counter in the job's store, every ``HEARTBEAT_S``) from a thread of its own. A rank
waiting for another pool's answer checks the sender's counter: a peer whose counter stands still for
``trainer.pool_heartbeat_timeout_s`` is stopped (SIGSTOP, a frozen node), and the job ends with an error instead of
waiting out ``trainer.collective_timeout_s``. The beat comes from its own thread, so a rank whose main thread is stuck
(in a collective, say) keeps beating: heartbeats catch a stopped process or node, not a hung call. The store lives
on job rank 0's node; a store that stops answering is reported as rank 0's silence.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pickle
import sys
import threading
import time
from queue import Empty, Queue
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist

from verl_mega.config.run import POOL_HEARTBEAT_S as HEARTBEAT_S
from verl_mega.parallel import cpu_mode
from verl_mega.parallel.placement import Placement, PlacementError, Pool
from verl_mega.parallel.state import init_process_group, job_store

log = logging.getLogger(__name__)

CLOSED_KEY = "verl_mega/closed"
CLOSE_WAIT_S = 30.0  # how long the store's host waits at the end for its peers to stop using the store

CONTROL_TAG, RESULT_TAG = 1, 2  # trainer → rollout commands; rollout → trainer samples
STORE_HOST = 0  # job rank 0 hosts the job's store (env://; under torchrun its node's agent does)
READ_WAIT_S = 0.2  # how long a heartbeat check waits for a store read it started (a healthy store answers in ms)


class PoolPeerError(RuntimeError):
    """The other pool stopped answering (a rank died or hung): the job ends instead of waiting forever."""


@dataclass
class Bridge:
    """This rank's pool and the job-wide groups between pools. ``rank``/``world``: the job's; the default
    torch.distributed world is this rank's pool."""

    placement: Placement
    rank: int
    world: int
    store: Any = field(repr=False)
    timeout: datetime.timedelta
    control: Any = field(repr=False)  # gloo over every rank of the job
    heartbeat_timeout_s: float = 0.0  # 0: no heartbeat checks
    _subgroups: dict[tuple[int, ...], Any] = field(default_factory=dict, repr=False)
    _stopped: threading.Event = field(default_factory=threading.Event, repr=False)
    _beating: threading.Thread | None = field(default=None, repr=False)

    def start_heartbeat(self) -> None:
        """Beat this rank's heartbeat until :meth:`close` (a daemon thread)."""
        def beat() -> None:
            while not self._stopped.is_set():
                with contextlib.suppress(Exception):  # a store that is gone: the job is ending
                    self.store.add(f"verl_mega/alive/{self.rank}", 1)
                self._stopped.wait(HEARTBEAT_S)

        self._beating = threading.Thread(target=beat, daemon=True, name="heartbeat")
        self._beating.start()

    @property
    def pool(self) -> Pool:
        return self.placement.pool_of_rank(self.rank)

    @property
    def trains(self) -> bool:
        return self.pool.name == self.placement.roles["actor"]

    def subgroup(self, ranks: tuple[int, ...], *, device: bool) -> Any:
        """A standalone group of ``ranks`` (job ranks, ascending; group rank = position), built by its members only;
        ``device``: NCCL on GPU (weights), else gloo."""
        if list(ranks) != sorted(ranks) or self.rank not in ranks:
            raise ValueError(f"subgroup {ranks}: members must be ascending and include this rank {self.rank}")
        key = (*ranks, int(device))
        if key not in self._subgroups:
            prefix = dist.PrefixStore(f"verl_mega/bridge/{'dev' if device else 'cpu'}/{'-'.join(map(str, ranks))}/",
                                      self.store)
            index = ranks.index(self.rank)
            if device and torch.cuda.is_available():
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self._subgroups[key] = dist.ProcessGroupNCCL(prefix, index, len(ranks), opts)
            else:
                self._subgroups[key] = dist.ProcessGroupGloo(prefix, index, len(ranks), self.timeout)
        return self._subgroups[key]

    def broadcast_object(self, obj: Any, src: int) -> Any:
        """``obj`` of job rank ``src`` on every rank of the job (collective over the job)."""
        size = torch.zeros(1, dtype=torch.long)
        payload = None
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size[0] = payload.numel()
        def share() -> torch.Tensor:
            group_broadcast(size, self.control, src, async_op=True).wait(self.timeout)
            data = payload if payload is not None else torch.empty(int(size), dtype=torch.uint8)
            group_broadcast(data, self.control, src, async_op=True).wait(self.timeout)
            return data

        if self.rank == src:  # the root's sends are buffered: a stopped receiver does not hold it
            with self.answering(src, "sharing an object over the job"):
                share()
            return obj
        # a root that is stopped is named after the heartbeat timeout, not after the collective timeout
        return pickle.loads(self.watching((src,), "waiting for an object shared over the job", share).numpy().tobytes())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in job rank order (collective over the job)."""
        return [self.broadcast_object(obj if r == self.rank else None, r) for r in range(self.world)]

    # ---- control messages: pickled objects between two ranks of the job -----------------------------------
    def send(self, obj: Any, dst: int, tag: int, what: str) -> list[Any]:
        """Post ``obj`` to job rank ``dst``; returns the pending works (wait on them before reusing the tag)."""
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.long)
        with self.answering(dst, what):
            return [self.control.send([size], dst, tag), self.control.send([payload], dst, tag)]

    def recv(self, src: int, tag: int, what: str, *, watch: tuple[int, ...] = ()) -> Any:
        """The next object job rank ``src`` sent with ``tag``; a peer that died, stays silent past the collective
        timeout, or whose heartbeat stops raises :class:`PoolPeerError` naming it. ``watch``: the ranks whose
        heartbeats to check (default: ``src``'s)."""
        def receive() -> Any:
            size = torch.zeros(1, dtype=torch.long)
            self.control.recv([size], src, tag).wait(self.timeout)
            payload = torch.empty(int(size), dtype=torch.uint8)
            self.control.recv([payload], src, tag).wait(self.timeout)
            return pickle.loads(payload.numpy().tobytes())

        return self.watching(watch or (src,), what, receive, peer=src)

    def wait(self, works: list[Any], peer: int, what: str, *, watch: tuple[int, ...] = ()) -> None:
        def complete() -> None:
            for work in works:
                work.wait(self.timeout)

        if works:
            self.watching(watch or (peer,), what, complete, peer=peer)

    def watching(self, ranks: tuple[int, ...], what: str, fn, *, peer: int | None = None) -> Any:
        """``fn()``, which waits on other ranks (``peer``: the one named when it fails); with heartbeat checks it
        runs in a thread (on this thread's device) while this one watches the heartbeats of ``ranks``."""
        peer = ranks[0] if peer is None else peer
        if not self.heartbeat_timeout_s:
            with self.answering(peer, what):
                return fn()
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def run() -> None:
            if device is not None:
                torch.cuda.set_device(device)  # the current device is per thread
            box.put(_outcome(fn))

        box: Queue = Queue()
        threading.Thread(target=run, daemon=True, name="waiting-on-pool").start()
        watch = self.heartbeats(ranks)
        while True:
            try:
                ok, value = box.get(timeout=HEARTBEAT_S)
            except Empty:
                watch.check(what)
                continue
            if ok:
                return value
            with self.answering(peer, what):
                raise value

    def heartbeats(self, ranks: tuple[int, ...]) -> "HeartbeatWatch":
        """A watch on the heartbeats of ``ranks`` for a wait this thread polls (see :class:`HeartbeatWatch`)."""
        return HeartbeatWatch(self, tuple(ranks))

    def _beats(self, rank: int) -> int:
        return int(self.store.add(f"verl_mega/alive/{rank}", 0))

    @contextlib.contextmanager
    def answering(self, peer: int, what: str) -> Iterator[None]:
        """Turn a failed post or wait on ``peer`` (its connection closed, or the timeout passed) into
        :class:`PoolPeerError`."""
        try:
            yield
        except RuntimeError as exc:
            raise self.peer_error(peer, what, exc) from None

    def peer_error(self, peer: int, what: str, exc: BaseException) -> PoolPeerError:
        pool = self.placement.pool_of_rank(peer).name
        return PoolPeerError(f"rank {peer} of pool {pool!r} did not answer while {what} "
                             f"({' '.join(str(exc).split())[:200]}); it died or hung (timeout "
                             f"trainer.collective_timeout_s={self.timeout.total_seconds():g})")

    def close(self) -> None:
        """Stop beating, then leave in an order that keeps the store up while a peer still uses it: the store lives
        in job rank 0, and a peer whose beat finds it gone prints c10d's connection-reset trace at every job end.
        So every other rank reports closed, and rank 0 waits (at most ``CLOSE_WAIT_S``) for those reports before it
        leaves; not when closed while an exception propagates (the job's close after an error): its peers may never
        close."""
        self._stopped.set()
        if self._beating is not None:
            self._beating.join(timeout=2 * HEARTBEAT_S)
        with contextlib.suppress(Exception):  # a store that is gone: nothing left to wait for
            if self.rank != 0:
                self.store.add(CLOSED_KEY, 1)
            elif sys.exc_info()[0] is None:  # closed on an error (while it propagates), its peers may never close
                deadline = time.monotonic() + CLOSE_WAIT_S
                while (closed := self.store.add(CLOSED_KEY, 0)) < self.world - 1:
                    if time.monotonic() > deadline:
                        log.warning("%d of the job's other %d ranks did not report closed within %g s; leaving "
                                    "without them", self.world - 1 - closed, self.world - 1, CLOSE_WAIT_S)
                        break
                    time.sleep(0.05)
        self._subgroups.clear()
        self.control = None


class HeartbeatWatch:
    """The heartbeats of some ranks, seen from a rank that waits on them without blocking (a transfer running in a
    thread of its own, polled between engine steps). :meth:`check` raises :class:`PoolPeerError` naming the first
    rank whose counter has stood still for the bridge's heartbeat timeout; it reads the store at most twice per
    ``HEARTBEAT_S``, so calling it every loop costs nothing. Without a heartbeat timeout it never raises.

    The store's host (job rank 0) may itself be stopped, and then a store call never returns (the store's timeout
    does not bound it). So each read runs in a thread of its own, and a read unanswered for the heartbeat timeout is
    rank 0's silence; a store whose connection fails is rank 0's death."""

    def __init__(self, bridge: Bridge, ranks: tuple[int, ...]) -> None:
        self.bridge, self.ranks = bridge, ranks
        now = time.monotonic()
        self._beats: dict[int, int | None] = dict.fromkeys(ranks)  # None: not read yet
        self._since = dict.fromkeys(ranks, now)
        self._asked = now  # when the last read started
        self._reading: Queue | None = None  # the answer of the read in flight
        if bridge.heartbeat_timeout_s and ranks:
            self._ask()

    def _ask(self) -> None:
        """Start a read of every watched counter; :meth:`check` takes its answer."""
        answer: Queue = Queue(maxsize=1)
        ranks, bridge = self.ranks, self.bridge

        def read() -> None:
            answer.put(_outcome(lambda: {rank: bridge._beats(rank) for rank in ranks}))

        self._reading, self._asked = answer, time.monotonic()
        threading.Thread(target=read, daemon=True, name="heartbeat-read").start()

    def check(self, what: str) -> None:
        limit = self.bridge.heartbeat_timeout_s
        if not limit or not self.ranks:
            return
        now = time.monotonic()
        fresh = self._reading is None and now - self._asked >= HEARTBEAT_S / 2
        if fresh:
            self._ask()
        if self._reading is None:
            return
        try:
            ok, value = self._reading.get(timeout=READ_WAIT_S) if fresh else self._reading.get_nowait()
        except Empty:
            silent = time.monotonic() - self._asked
            if silent > limit:
                raise self._silent(STORE_HOST, silent, what, "the job's store on its node did not answer, so it "
                                   "or its node") from None
            return
        self._reading, read_at = None, self._asked
        if not ok:  # the store's connection failed: its host died or its node was lost
            raise self.bridge.peer_error(STORE_HOST, f"{what} (reading heartbeats from the job's store on its node)",
                                         value)
        for rank, beats in value.items():
            if beats != self._beats[rank]:
                if self._beats[rank] is not None:  # the first read sets where the counter starts
                    self._since[rank] = read_at
                self._beats[rank] = beats
            elif read_at - self._since[rank] > limit:
                raise self._silent(rank, read_at - self._since[rank], what, "it")

    def _silent(self, rank: int, seconds: float, what: str, who: str) -> PoolPeerError:
        pool = self.bridge.placement.pool_of_rank(rank).name
        return PoolPeerError(f"rank {rank} of pool {pool!r} sent no heartbeat for {seconds:.0f} s while {what}: {who} "
                             f"is stopped (SIGSTOP, a frozen node) or hung "
                             f"(trainer.pool_heartbeat_timeout_s={self.bridge.heartbeat_timeout_s:g})")


def group_broadcast(tensor: torch.Tensor, group: Any, group_src: int, async_op: bool = False) -> Any:
    """Broadcast straight through the group's backend. The bridge's groups are standalone, unknown to
    torch.distributed's registry, whose wrappers would fail on an error path before reporting the error; a group of
    the default world takes the same call."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = group_src, 0
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    work = group.broadcast([tensor], opts)
    if async_op:
        return work
    work.wait()
    return None


@dataclass(frozen=True)
class TransferPlan:
    """Who sends generation block j (``sources[j]``) and who receives it (``receivers[j]``, one rank per engine)."""

    sources: tuple[int, ...]
    receivers: tuple[tuple[int, ...], ...]

    def block_of(self, rank: int) -> int | None:
        """The block ``rank`` sends or receives; None for a training rank that does neither."""
        for j, (src, dst) in enumerate(zip(self.sources, self.receivers)):
            if rank == src or rank in dst:
                return j
        return None


def transfer_plan(placement: Placement) -> TransferPlan:
    """The sources and receivers of every generation block, for a placement whose rollout has its own pool."""
    if placement.colocated:
        raise PlacementError("the rollout runs on the actor's pool (colocated): weights are synced in place there, "
                             "not across pools; give the rollout its own pool in placement.roles")
    train, gen = placement.pool_of("actor"), placement.pool_of("rollout")
    if gen.trains:
        raise PlacementError(f"placement.pools.{gen.name} both trains and generates for another pool; give the "
                             f"rollout a pool of its own")
    if train.gen_tp != gen.gen_tp:
        raise PlacementError(f"placement.pools.{train.name}.gen_tp={train.gen_tp} differs from the rollout pool's "
                             f"gen_tp={gen.gen_tp}: the trainer builds exactly the rollout engines' slices; set "
                             f"placement.pools.{train.name}.gen_tp={gen.gen_tp}")
    blocks = range(gen.gen_tp)
    sources = tuple(min(r for r in train.ranks if train.coords(r)["gen_tp"] == j) for j in blocks)
    receivers = tuple(tuple(engine[j] for engine in gen.groups("gen_tp")) for j in blocks)
    return TransferPlan(sources, receivers)


def check_disaggregated(placement: Placement) -> None:
    """The shapes the split worlds need, before anything is built: the training pool first, the rollout on a pool of
    its own that trains nothing, no third pool, and the same generation TP on both pools."""
    train = placement.pool_of("actor")
    if train.ranks[0] != 0:
        raise PlacementError(f"placement.pools: the training pool {train.name!r} starts at rank {train.ranks[0]}; "
                             f"list it first in placement.pools")
    if len(placement.pools) != 2:
        raise PlacementError(f"a disaggregated placement has a training pool and a rollout pool, got "
                             f"{[p.name for p in placement.pools]}; map every training role to one pool")
    transfer_plan(placement)  # the rollout's pool only generates, and both pools' generation TP agree


def _outcome(fn) -> tuple[bool, Any]:
    try:
        return True, fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
        return False, exc


def init_pool_worlds(placement: Placement, timeout_s: float, heartbeat_timeout_s: float = 0.0) -> Bridge:
    """One rendezvous for the job; then this rank's pool as the default world and the bridge over the job (beating
    this rank's heartbeat, and checking the peers' while waiting on them when ``heartbeat_timeout_s`` > 0)."""
    cpu_mode.enable_cpu_mode()
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; a disaggregated job initialises its pools")
    check_disaggregated(placement)
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = job_store(timeout)
    if world != placement.world_size:
        raise PlacementError(f"placement covers {placement.world_size} ranks but the job has {world}")
    pool = placement.pool_of_rank(rank)
    init_process_group(timeout, store=dist.PrefixStore(f"verl_mega/pool/{pool.name}/", store),
                       rank=rank - pool.ranks[0], world_size=len(pool.ranks))
    # vLLM's external launcher reads these: on a rollout pool they are the pool's own
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank - pool.ranks[0]), str(len(pool.ranks))
    control = dist.ProcessGroupGloo(dist.PrefixStore("verl_mega/bridge/control/", store), rank, world, timeout)
    bridge = Bridge(placement, rank, world, store, timeout, control, heartbeat_timeout_s)
    bridge.start_heartbeat()
    return bridge
