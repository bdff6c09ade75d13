"""torchrun job (2 ranks): a weight transfer across pools whose other end stops (SIGSTOP) or dies (SIGKILL) midway.

Rank 0 is the training pool ``train``, rank 1 the rollout pool ``gen``; they share the job's store and a bridge with
heartbeats (trainer.pool_heartbeat_timeout_s = 4 s). Rank 0 sends three 16 MB buckets (the trainer's
:class:`BucketSender` under :meth:`Bridge.watching`, as ``RemoteRollout.update_weights``); rank 1 receives them in
a thread and polls a :class:`HeartbeatWatch` of the sender, as the rollout server's loop does.

Modes (the failing end harms itself at a fixed point, so nothing races the test):
- ``stop-receiver``: rank 1 stops itself on its second slice; rank 0 must name it;
- ``kill-receiver``: rank 1 SIGKILLs itself on its second slice; rank 0 must name it;
- ``stop-sender``: rank 0 stops itself after its first bucket; rank 1 must name it.
- ``stop-sender-node``: the same with rank 0's node frozen: rank 0 first stops torchrun's agent, which hosts the
  job's store, so every store call blocks; rank 1 must still name rank 0.
The survivor prints ``WATCH {"error": ..., "seconds": ...}`` (seconds from the start of the transfer).
"""

import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from verl_mega.hybrid.transport import BucketSender, RolloutLayout, receive_buckets
from verl_mega.parallel.placement import Placement, Pool
from verl_mega.parallel.pools import Bridge, PoolPeerError

N = 4 * 2**20  # float32 elements per parameter: one 16 MB bucket each, far more than a socket buffers
LAYOUT = RolloutLayout(("a", "b", "c"), "float32")


class HarmOnSecondSlice:
    """The receiving end's sink: writes nothing anywhere, and harms its own process on the second slice."""

    def __init__(self, sig: int | None) -> None:
        self.sig, self.slices = sig, 0

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        self.slices += 1
        if self.slices == 2 and self.sig is not None:
            os.kill(os.getpid(), self.sig)
        return torch.empty(shape)

    def commit(self) -> None:
        pass


def main() -> None:
    mode = sys.argv[1]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's stop of the survivor must not pre-empt its report
    timeout = datetime.timedelta(seconds=120)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    placement = Placement(2, (Pool(name="train", ranks=(0,)), Pool(name="gen", ranks=(1,), trains=False)),
                          {"actor": "train", "rollout": "gen"})
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world, timeout)
    bridge = Bridge(placement, rank, world, store, timeout, control, heartbeat_timeout_s=4.0)
    bridge.start_heartbeat()
    group = bridge.subgroup((0, 1), device=True)
    bridge.broadcast_object("ready", 0)  # both ends are up and beating
    began = time.monotonic()
    try:
        if rank == 0:
            def send() -> None:
                sink = BucketSender(LAYOUT, dtype=torch.float32, device=torch.device("cpu"), bucket_bytes=4 * N,
                                    group=group, group_src=0)
                for i, name in enumerate(LAYOUT.names):
                    sink.buffer(name, (N,)).fill_(i)
                    sink.commit()
                    if i == 0 and mode.startswith("stop-sender"):
                        time.sleep(0.5)  # the first bucket is on its way
                        if mode == "stop-sender-node":
                            os.kill(os.getppid(), signal.SIGSTOP)  # the store's host
                        os.kill(os.getpid(), signal.SIGSTOP)
                sink.finish()

            bridge.watching((1,), "sending weights to the rollout pool", send)
            report = {"error": None}
        else:
            sig = {"stop-receiver": signal.SIGSTOP, "kill-receiver": signal.SIGKILL}.get(mode)
            outcome: list = []

            def receive() -> None:
                try:
                    outcome.append(receive_buckets(HarmOnSecondSlice(sig), LAYOUT, group=group, group_src=0,
                                                   device=torch.device("cpu")))
                except BaseException as exc:  # noqa: BLE001 - reported by the polling loop
                    outcome.append(exc)

            thread = threading.Thread(target=receive, daemon=True)
            thread.start()
            watch = bridge.heartbeats((0,))
            while thread.is_alive():
                watch.check("receiving weights from the training pool")
                thread.join(0.2)
            report = {"error": None, "received": repr(outcome)}
    except PoolPeerError as exc:
        report = {"error": str(exc)}
    report["seconds"] = round(time.monotonic() - began, 1)
    print("WATCH " + json.dumps(report), flush=True)
    os._exit(0)  # the peer is stopped or dead: nothing to tear down with it


if __name__ == "__main__":
    main()
