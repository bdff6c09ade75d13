"""Process-group set-up: torch.distributed + Megatron-Core's parallel_state, on GPU (NCCL) or CPU (gloo)."""

from __future__ import annotations

import datetime
import os
import random
import numpy as np
import torch
import torch.distributed as dist

from verl_mega.parallel import cpu_mode


def init_distributed(
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    cp: int = 1,
    seed: int = 1234,
    timeout_s: float = 600.0,
) -> dict[str, int]:
    """Initialise torch.distributed from the launcher env (torchrun/mpirun/ray set RANK/WORLD_SIZE) and mcore groups.

    Single-process runs without launcher variables get a world of one. Returns rank facts.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    use_cpu = cpu_mode.enable_cpu_mode()
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()) if os.environ["WORLD_SIZE"] == "1" else "29500")
        if not use_cpu:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(
            backend="gloo" if use_cpu else "nccl", timeout=datetime.timedelta(seconds=timeout_s)
        )
    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(
            f"parallel: world size {world} is not divisible by tp·pp·cp={tp * pp * cp}; "
            "change parallel.tp/pp/cp or the number of processes"
        )
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=cp,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
        )
    seed_everything(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dict(
        rank=dist.get_rank(),
        world=world,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        dp=mpu.get_data_parallel_world_size(),
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def destroy_distributed() -> None:
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dp_all_reduce(value, op: str = "sum") -> torch.Tensor:
    """A float64 scalar/tensor reduced over the data-parallel group (`sum`, `max` or `mean`), back on the host."""
    from megatron.core import parallel_state as mpu

    value = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    dp = mpu.get_data_parallel_world_size()
    if dp > 1:
        value = value.to(cpu_mode.comm_device())
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        dist.all_reduce(value, op=reduce_op, group=mpu.get_data_parallel_group())
        if op == "mean":
            value /= dp
    return value.cpu()


def new_groups(groups: list[tuple[int, ...]], mine: tuple[int, ...]):
    """Create every group in the same order on every rank (`new_group` is collective over the world) and return
    the one this rank belongs to (None if it is in none)."""
    found = None
    for ranks in groups:
        group = dist.new_group(list(ranks))
        if ranks == mine:
            found = group
    return found
