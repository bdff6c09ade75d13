"""torchrun job: an async save of CPU tensors is a snapshot of the moment it was requested, even though training
(here: in-place updates) continues before and while the background writer runs.

Args: CHECKPOINT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    from verl_mega.parallel.state import init_distributed
    from verl_mega.checkpoint.manager import async_save_request

    init_distributed(tp=1, pp=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = Path(sys.argv[1])
    if rank == 0:
        ckpt.mkdir(parents=True)
    dist.barrier()

    live = torch.arange(64, dtype=torch.float32).reshape(8, 8) + 1000 * rank  # stands in for a parameter
    want = live.clone()
    request = async_save_request({"w": ShardedTensor.from_rank_offsets("w", live, (0, rank, world))}, ckpt)
    # what mcore hands the background writer must not alias the live tensor
    staged = [t for _, _, (_, tensors) in request.preload_fn() for _, t in tensors]
    assert staged, "nothing staged for writing"
    live.add_(1.0)
    for t in staged:
        assert t.untyped_storage().data_ptr() != live.untyped_storage().data_ptr(), "staged tensor aliases live one"
        assert torch.equal(t, want), "staged tensor changed with the live one"

    queue = AsyncCallsQueue(persistent=False)
    queue.schedule_async_request(request)
    live.mul_(3.0)  # training goes on while the shards are written
    queue.close()  # blocks until every rank has written, then runs mcore's finalisation
    template = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(8, 8), (0, rank, world))}
    loaded = dist_checkpointing.load(template, str(ckpt))["w"]
    assert torch.equal(loaded, want), (loaded - want).abs().max()
    whole = ShardedTensor.from_rank_offsets("w", torch.zeros(8 * world, 8), replica_id=rank)
    full = dist_checkpointing.load({"w": whole}, str(ckpt))["w"]
    assert torch.equal(full, torch.cat([torch.arange(64.0).reshape(8, 8) + 1000 * r for r in range(world)]))
    dist.barrier()
    if rank == 0:
        print("ASYNC_SNAPSHOT_OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
