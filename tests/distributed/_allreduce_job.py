"""Tiny multi-node job used by test_multinode_launch.py under torchrun, mpirun and Ray.

It initialises gloo through ``verl_mega.parallel.launch_env`` (whatever launcher started it), checks an all_reduce,
checks that node_rank/local_rank agree with where the ranks actually run, then trains a 4->1 linear model for two
SGD steps with data-parallel gradient averaging and writes the losses (rank 0) to ``--out``. ``--backend nccl``
runs the same on one GPU per rank.
Any failed check raises, so the launcher sees a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_mega.parallel.launch_env import discover

ROWS_PER_RANK = 4
FEATURES = 4
LR = 0.1
STEPS = 2


def global_batch(world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(world_size * ROWS_PER_RANK, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randn(world_size * ROWS_PER_RANK, 1, generator=g, dtype=torch.float64)
    return x, y


def initial_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return (torch.randn(1, FEATURES, generator=g, dtype=torch.float64),
            torch.randn(1, generator=g, dtype=torch.float64))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    args = ap.parse_args()

    env = discover()
    env.export_to_os_environ()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", env.local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=90))
    world = dist.get_world_size()
    assert dist.get_rank() == env.rank and world == env.world_size

    t = torch.tensor([float(env.rank + 1)], device=device)
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, f"all_reduce gave {t.item()}"

    # Where this rank really runs: the test gives each simulated node an id (or the hostname differs per node).
    where = os.environ.get("TEST_NODE_ID") or os.environ.get("VERL_MEGA_RAY_NODE_ID") or socket.gethostname()
    info = {"rank": env.rank, "node_rank": env.node_rank, "local_rank": env.local_rank,
            "local_world_size": env.local_world_size, "launcher": env.launcher, "where": where,
            "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device)}
    infos: list = [None] * world
    dist.all_gather_object(infos, info)
    by_where: dict[str, list[dict]] = {}
    for i in infos:
        by_where.setdefault(i["where"], []).append(i)
    assert len(by_where) == env.num_nodes, f"{len(by_where)} physical groups for {env.num_nodes} nodes: {infos}"
    for members in by_where.values():
        assert len({m["node_rank"] for m in members}) == 1, f"one node, several node ranks: {members}"
        assert sorted(m["local_rank"] for m in members) == list(range(env.local_world_size)), members
    assert sorted({m["node_rank"] for m in infos}) == list(range(env.num_nodes)), infos

    x, y = global_batch(world)
    lo = env.rank * ROWS_PER_RANK
    xs, ys = x[lo:lo + ROWS_PER_RANK].to(device), y[lo:lo + ROWS_PER_RANK].to(device)
    w0, b0 = (t.to(device) for t in initial_weights())
    w, b = w0.clone().requires_grad_(True), b0.clone().requires_grad_(True)
    losses = []
    for _ in range(STEPS):
        loss = ((xs @ w.T + b - ys) ** 2).mean()
        w.grad = b.grad = None
        loss.backward()
        for p in (w, b):
            dist.all_reduce(p.grad)
            p.grad /= world
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        with torch.no_grad():
            w -= LR * w.grad
            b -= LR * b.grad

    if env.rank == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "losses": losses, "ranks": infos}, f)
    dist.barrier()
    dist.destroy_process_group()
    print(f"JOB OK rank={env.rank} node_rank={env.node_rank} local_rank={env.local_rank} launcher={env.launcher}",
          flush=True)


if __name__ == "__main__":
    main()
