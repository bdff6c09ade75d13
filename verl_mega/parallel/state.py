"""Process groups, built once from the :class:`~verl_mega.parallel.placement.Placement`, on GPU (NCCL) or CPU (gloo).

Megatron-Core gets them explicitly as a ``ProcessGroupCollection``; its ``parallel_state`` globals are never
initialised, so nothing can silently use a group that the placement did not decide. Groups are created with
``use_local_synchronization``: a rank builds only the groups it belongs to (once per distinct member set), which
keeps start-up at O(groups per rank) instead of O(groups in the job).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from verl_mega.parallel import cpu_mode
from verl_mega.parallel.placement import GROUP_KINDS, ISLAND_KINDS, Placement, Pool


def init_world(timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed from the launcher variables (torchrun/mpirun/Ray set RANK/WORLD_SIZE; a plain
    process is a world of one)."""
    from verl_mega.parallel import launch_env

    cpu_mode.enable_cpu_mode()
    if dist.is_initialized():
        return
    launch_env.discover().export_to_os_environ()  # a plain process is a world of one, on a free port
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = job_store(timeout)
    init_process_group(timeout, store=store, rank=rank, world_size=world)


def job_store(timeout: datetime.timedelta) -> tuple[Any, int, int]:
    """The job's rendezvous (``env://``): its store, this rank and the world size. The store's keys are this attempt's
    alone: torchrun's agent keeps one store across the restarts of its worker group, so a restarted group that used
    the bare store would read the dead attempt's gloo addresses and fail ("connectFullMesh failed … Connection
    refused") or wait on them."""
    from verl_mega.parallel.launch_env import attempt_key

    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    return dist.PrefixStore(f"verl_mega/{attempt_key()}/", store), rank, world


def init_process_group(timeout: datetime.timedelta, **world: Any) -> None:
    """torch.distributed's default group, over gloo in CPU mode and NCCL on GPUs (this rank's GPU chosen first,
    LOCAL_RANK). ``world``: the store, rank and world size of a pool's own world (default: the launcher's)."""
    use_cpu = cpu_mode.enable_cpu_mode()
    if not use_cpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend="gloo" if use_cpu else "nccl", timeout=timeout, **world)


def pool_group() -> Any:
    """This rank's pool, as the group of a collective over it: each pool is a torch.distributed world of its own
    (colocated, the one pool is the job; pools.init_pool_worlds), so it is the default group, named here."""
    return dist.group.WORLD


@dataclass
class RankGroups:
    """This rank's process groups inside its pool: one per kind of ``GROUP_KINDS`` (kinds with the same members
    share one group)."""

    placement: Placement
    rank: int
    groups: dict[str, Any] = field(repr=False)

    @property
    def pool(self) -> Pool:
        return self.placement.pool_of_rank(self.rank)

    @cached_property
    def coords(self) -> dict[str, int]:
        return self.pool.coords(self.rank)

    def ranks(self, kind: str) -> tuple[int, ...]:
        return self.pool.group_of(kind, self.rank)

    def size(self, kind: str) -> int:
        return len(self.ranks(kind))

    def __getitem__(self, kind: str):
        return self.groups[kind]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def last_stage(self) -> bool:
        return self.coords["pp"] == self.pool.pp - 1

    def global_rank(self, kind: str, index: int) -> int:
        return self.ranks(kind)[index]

    @cached_property
    def pg_collection(self):
        """Megatron-Core's ``ProcessGroupCollection`` for models, DDP, the optimizer and the pipeline schedules. With
        data-parallel islands (``pool.dp_islands`` > 1, Megatron's ``num_distributed_optimizer_instances``) the
        distributed optimizer reduces inside an island (intra_dp_cp, intra_expt_dp), all-reduces across islands
        (inter_dist_opt) and reduces gradient norms over its instance (intra_dist_opt)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        g = self.groups
        islands = self.pool.dp_islands > 1
        return ProcessGroupCollection(
            tp=g["tp"], pp=g["pp"], mp=g["mp"], embd=g["embd"], pos_embd=None, cp=g["cp"], tp_cp=g["tp_cp"],
            hcp=None, ep=g["ep"], expt_tp=g["etp"], tp_ep=g["tp_ep"], tp_ep_pp=g["tp_ep_pp"], tp_dp_cp=g["tp_dp_cp"],
            dp=g["dp"], dp_cp=g["dp_cp"], expt_dp=g["edp"], intra_dp_cp=g["intra_dp" if islands else "dp_cp"],
            intra_expt_dp=g["intra_edp" if islands else "edp"], inter_dist_opt=g["inter_dp"] if islands else None,
            intra_dist_opt=g["dist_opt" if islands else "pool"])


@contextlib.contextmanager
def mcore_dp_cp_group(groups: RankGroups) -> Iterator[None]:
    """Megatron-Core 0.16.1 still reads its global data+context-parallel group in one place a pg_collection does
    not reach (the replica id of a tied LM head on the last pipeline stage, in ``sharded_state_dict``): expose this
    rank's group there for the duration of the call only."""
    from megatron.core import parallel_state as mpu

    saved = mpu._DATA_PARALLEL_GROUP_WITH_CP
    mpu._DATA_PARALLEL_GROUP_WITH_CP = groups["dp_cp"]
    try:
        yield
    finally:
        mpu._DATA_PARALLEL_GROUP_WITH_CP = saved


@contextlib.contextmanager
def mcore_tp_dp_cp_group(groups: RankGroups) -> Iterator[None]:
    """Megatron-Core 0.16.1 sums the routers' token counts for the aux-loss-free expert-bias update over its global
    tensor+data+context-parallel group (``get_updated_expert_bias``, called from ``finalize_model_grads``), which no
    pg_collection reaches: expose this rank's group there for the duration of the call only."""
    from megatron.core import parallel_state as mpu

    saved = mpu._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP
    mpu._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = groups["tp_dp_cp"]
    try:
        yield
    finally:
        mpu._TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = saved


def build_groups(placement: Placement, rank: int | None = None, timeout_s: float = 600.0) -> RankGroups:
    """Create this rank's groups (collective over each group's members, in the same kind order everywhere)."""
    rank = dist.get_rank() if rank is None else rank
    pool = placement.pool_of_rank(rank)
    made: dict[tuple[int, ...], Any] = {}
    groups = {}
    timeout = datetime.timedelta(seconds=timeout_s)
    for kind in GROUP_KINDS:
        members = pool.group_of(kind, rank)
        if kind in ISLAND_KINDS and (pool.dp_islands == 1 or kind == "island"):
            members = None  # flat: the dp_cp, edp and pool groups serve; an island is reported, never a group
        if members is None:
            groups[kind] = None
            continue
        if members not in made:
            made[members] = dist.new_group(list(members), timeout=timeout, use_local_synchronization=True)
        groups[kind] = made[members]
    # Megatron's sequence-parallel linears all-gather into its process-wide scratch buffer, which only
    # parallel_state.initialize_model_parallel (never called here) would create; it holds no group
    from megatron.core import parallel_state as mpu

    if mpu._GLOBAL_MEMORY_BUFFER is None:
        mpu._set_global_memory_buffer()
    # mcore's distributed optimizer gathers its state for a checkpoint over a gloo twin of its DP group: the dense
    # optimizer's (dp·cp) and, for Mixture-of-Experts models, the expert optimizer's (expert data parallel); with
    # data-parallel islands, the groups inside an island
    nccl = "nccl" in str(dist.get_backend())
    for kind in ("dp_cp", "edp") + (("intra_dp", "intra_edp") if pool.dp_islands > 1 else ()):
        members = pool.group_of(kind, rank)
        if members is None or not nccl:
            groups[f"{kind}_gloo"] = groups[kind]
            continue
        if ("gloo", *members) not in made:
            made["gloo", *members] = dist.new_group(list(members), timeout=timeout, backend="gloo",
                                                    use_local_synchronization=True)
        groups[f"{kind}_gloo"] = made["gloo", *members]
    return RankGroups(placement, rank, groups)


def init_distributed(placement: Placement | None = None, *, seed: int = 1234, timeout_s: float = 600.0,
                     **single_pool: Any) -> RankGroups:
    """World, groups and seeds in one call: ``placement``, or one pool of every rank with ``single_pool`` dims
    (tp=, pp=, vpp=, cp=, gen_tp=, …). Returns this rank's groups."""
    init_world(timeout_s)
    placement = placement or Placement.single(dist.get_world_size(), **single_pool)
    groups = build_groups(placement, timeout_s=timeout_s)
    seed_everything(seed, groups)
    return groups


def seed_everything(seed: int, groups: RankGroups | None = None) -> None:
    """Seed Python, numpy and torch; with groups also Megatron's model-parallel RNG tracker (TP ranks draw
    different dropout/init streams, data-parallel replicas the same)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if groups is not None:
        from megatron.core import tensor_parallel

        c = groups.coords
        tensor_parallel.model_parallel_cuda_manual_seed(seed, tp_rank=c["tp"], ep_rank=c["ep"], etp_rank=c["etp"])


def set_deterministic(enabled: bool) -> None:
    """Deterministic training kernels (``torch.use_deterministic_algorithms``, warning where an op has no
    deterministic version; cuBLAS's fixed workspace; cuDNN without autotuning), or torch's defaults back. Call before
    the first CUDA kernel: cuBLAS reads its workspace setting when it starts."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    torch.backends.cudnn.deterministic = enabled
    if enabled:
        torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def training_determinism_paused(*, algorithms: bool = True) -> Iterator[None]:
    """torch's defaults inside, for an inference engine: trainer.deterministic governs training kernels only.
    ``torch.use_deterministic_algorithms(True)`` also puts inductor in its deterministic mode, which refuses the
    autotuning benchmarks of vLLM's ``torch.compile`` ("In the deterministic mode of Inductor, we will avoid those
    benchmarkings ..."). ``algorithms=False`` lifts inductor's mode alone (a compile-time setting, and training
    under trainer.deterministic compiles nothing: model.fused_kernels): the process-wide flag of the algorithms
    stays, for a scoring thread that may run training kernels beside the engine."""
    import torch._inductor.config as inductor_config

    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    inductor = inductor_config.deterministic
    if algorithms and was[0]:
        torch.use_deterministic_algorithms(False)
    inductor_config.deterministic = False
    try:
        yield
    finally:
        if algorithms and was[0]:
            torch.use_deterministic_algorithms(True, warn_only=was[1])
        inductor_config.deterministic = inductor


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce(value, group, op: str = "sum") -> torch.Tensor:
    """A float64 scalar/tensor reduced over ``group`` (`sum`, `max` or `mean`), back on the host."""
    value = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    size = dist.get_world_size(group) if group is not None else 1
    if size > 1:
        value = value.to(cpu_mode.comm_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
        if op == "mean":
            value /= size
    return value.cpu()
