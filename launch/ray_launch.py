"""Start verl_mega (or any Python entry point) as one Ray actor per rank.

    python launch/ray_launch.py [--address ADDR] [--nnodes N] [--nproc-per-node P] [--cpu] [--timeout S]
                                [--wait-for-nodes S] [--max-restarts K] [--stop-grace-s S] [--] [PYTHON_ARGS...]

Connects to the Ray cluster at ADDR (default: RAY_ADDRESS or a running local cluster; if none is running, starts
one on this machine). For each of N nodes it reserves a placement group of P bundles, one per GPU ({"GPU": 1}, or
{"CPU": 1} with --cpu), STRICT_PACK on that node, and starts one actor per bundle. Each actor runs
``python PYTHON_ARGS`` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and MASTER_PORT
set exactly as torchrun would (ranks numbered node by node), so the same SPMD entry point runs unchanged. Output
lines are streamed to this driver prefixed with the rank. If any rank exits non-zero or its actor dies (a node
lost), every other rank is stopped and the job starts again on fresh actors (new placement groups, a new master
port, ``VERL_MEGA_RESTART_COUNT`` set), up to --max-restarts times; then this command exits non-zero. SIGTERM or
SIGINT to this driver is passed on to every rank as SIGTERM (each finishes its step, saves it and exits); ranks
still running --stop-grace-s later, or at a second signal, are killed, and a stopped job is not restarted.
PYTHON_ARGS default to ``-m verl_mega.train``; unless they start with -m, -c or a *.py file they are arguments for it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _python_args(rest: list[str]) -> list[str]:
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        return ["-m", "verl_mega.train"]
    if rest[0] in ("-m", "-c") or rest[0].endswith(".py"):
        return rest
    return ["-m", "verl_mega.train", *rest]


def _import_ray():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # read at import: stream every rank's lines, not "[repeated 3x]"
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError:
        sys.exit("ray_launch: error: ray is not installed: pip install 'ray[default]' (extra verl_mega[ray])")
    return ray, placement_group, remove_placement_group, PlacementGroupSchedulingStrategy


def _connect(ray, address: str | None, node_ip: str | None) -> None:
    kwargs = {"logging_level": "ERROR", "log_to_driver": True}
    if node_ip:
        kwargs["_node_ip_address"] = node_ip
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **kwargs)
        return
    try:
        ray.init(address="auto", **kwargs)
    except ConnectionError:
        print("ray_launch: no running Ray cluster found; starting one on this machine", flush=True)
        ray.init(**kwargs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run one Ray actor per rank with torchrun-style environment.")
    ap.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS / running / new)")
    ap.add_argument("--node-ip-address", default=None, help="this driver's node IP if Ray cannot infer it")
    ap.add_argument("--nnodes", type=int, default=None, help="number of nodes (default: all alive nodes)")
    ap.add_argument("--nproc-per-node", type=int, default=None,
                    help="ranks per node (default: GPUs of the smallest selected node, or 1 with --cpu)")
    ap.add_argument("--cpu", action="store_true", help="one CPU slot per rank instead of one GPU")
    ap.add_argument("--master-port", type=int, default=None, help="default: a free port on rank 0's node")
    ap.add_argument("--timeout", type=float, default=None, help="fail if the job runs longer (seconds)")
    ap.add_argument("--wait-for-nodes", type=float, default=60.0,
                    help="seconds to wait for enough nodes to join the cluster (default 60)")
    ap.add_argument("--max-restarts", type=int, default=3,
                    help="restart the whole job this many times after a rank fails or a node is lost (default 3; "
                         "it resumes from its newest checkpoint); a job past --timeout is not restarted")
    ap.add_argument("--stop-grace-s", type=float, default=300.0,
                    help="after SIGTERM/SIGINT to this driver, seconds the ranks have to save and exit before they "
                         "are killed (default 300)")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="[--] PYTHON_ARGS")
    args = ap.parse_args(argv)
    prog = _python_args(args.rest)

    if args.max_restarts < 0:
        ap.error(f"--max-restarts {args.max_restarts}: give 0 or more")
    if prog[:2] == ["-m", "verl_mega.train"]:  # a recipe that does not load fails every attempt: say so once
        checked = subprocess.run([sys.executable, *prog, "--check"])
        if checked.returncode != 0:
            return checked.returncode
    ray = _import_ray()[0]
    _connect(ray, args.address, args.node_ip_address)
    stop = Stop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, whose SIGTERM handler would SIGKILL every rank
        signal.signal(sig, stop.on_signal)
    restart = 0
    while True:
        rc = _run_once(args, prog, restart, stop)
        if rc in (0, TIMED_OUT, INTERRUPTED) or stop.signum or restart >= args.max_restarts:
            return 1 if rc == TIMED_OUT else rc
        restart += 1
        print(f"ray_launch: restarting the job ({restart} of --max-restarts {args.max_restarts}); it resumes from its "
              f"newest checkpoint", file=sys.stderr, flush=True)


TIMED_OUT = -1  # the job ran past --timeout: a hang is not restarted
INTERRUPTED = 130  # a rank stopped by Ctrl-C (128 + SIGINT) after saving its step: a stop, not a failure
PG_READY_S = 120.0  # how long the placement groups may take to be reserved
POLL_S = 1.0  # the longest a wait on Ray goes without looking at signals


class Stop:
    """SIGTERM/SIGINT to the driver: recorded here (a handler only sets a flag), acted on by the waiting loop."""

    def __init__(self) -> None:
        self.signum, self.count = 0, 0

    def on_signal(self, signum: int, frame) -> None:  # noqa: ARG002
        self.signum, self.count = self.signum or signum, self.count + 1

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _run_once(args: argparse.Namespace, prog: list[str], restart: int, stop: Stop | None = None) -> int:
    """One attempt: reserve the nodes, start every rank, wait; any rank failing stops the others. Returns the exit
    code (TIMED_OUT past --timeout)."""
    ray, placement_group, remove_placement_group, PGStrategy = _import_ray()
    unit = "CPU" if args.cpu else "GPU"
    stop = stop or Stop()

    deadline = time.monotonic() + args.wait_for_nodes
    while True:
        if stop.signum:
            print(f"ray_launch: {stop.name} received before the ranks started; stopping", file=sys.stderr)
            return 128 + stop.signum
        nodes = sorted((n for n in ray.nodes() if n["Alive"] and n["Resources"].get(unit, 0) >= 1),
                       key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))
        nnodes = args.nnodes or len(nodes)
        ppn = args.nproc_per_node or (1 if args.cpu else int(min((n["Resources"][unit] for n in nodes), default=0)))
        fit = [n for n in nodes if n["Resources"].get(unit, 0) >= ppn]
        if ppn >= 1 and len(fit) >= nnodes > 0:
            break
        if time.monotonic() > deadline:
            print(f"ray_launch: error: need {nnodes} node(s) with {ppn} {unit}(s) each, the cluster has "
                  f"{[(n['NodeManagerAddress'], n['Resources'].get(unit, 0)) for n in nodes]}", file=sys.stderr)
            return 2
        time.sleep(1)
    chosen = fit[:nnodes]
    world = nnodes * ppn

    @ray.remote(num_cpus=0, max_concurrency=2)
    class RankProcess:
        """Runs one rank's Python process; a second thread can stop it."""

        def __init__(self) -> None:
            self.proc = None

        def node(self) -> tuple[str, str, list[str]]:
            gpus = [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
            return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id(), gpus

        def free_port(self) -> int:
            import socket

            with socket.socket() as s:
                s.bind(("", 0))
                return s.getsockname()[1]

        def run(self, python_args: list[str], env: dict[str, str], prefix: str) -> int:
            import ctypes

            def die_with_parent() -> None:  # SIGKILL the rank if this actor dies (PR_SET_PDEATHSIG)
                ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
                os.setsid()

            self.proc = subprocess.Popen([sys.executable, "-u", *python_args], env={**os.environ, **env},
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         preexec_fn=die_with_parent)
            for line in self.proc.stdout:
                print(f"{prefix} {line}", end="", flush=True)
            return self.proc.wait()

        def terminate(self) -> None:
            """SIGTERM to the rank (as torchrun and mpirun pass it on): it finishes its step, saves it, exits."""
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)

        def stop(self) -> None:
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)

    groups, actors = [], []
    try:
        for node_rank, node in enumerate(chosen):
            bundles = [{unit: 1}] * ppn
            pg = placement_group(bundles, strategy="STRICT_PACK", name=f"verl_mega_node{node_rank}",
                                 bundle_label_selector=[{"ray.io/node-id": node["NodeID"]}] * ppn)
            groups.append(pg)
        late = _not_ready(ray, {pg.ready(): node["NodeManagerAddress"] for pg, node in zip(groups, chosen)}, stop)
        if stop.signum:
            print(f"ray_launch: {stop.name} received before the ranks started; stopping", file=sys.stderr)
            return 128 + stop.signum
        if late:
            print(f"ray_launch: error: the placement group of {ppn} {unit}(s) on node(s) {late} was not ready after "
                  f"{PG_READY_S:g} s (other jobs or actors hold them? see `ray status`); stopping this attempt",
                  file=sys.stderr)
            return 1
        for pg in groups:
            for local_rank in range(ppn):
                opts = {"scheduling_strategy": PGStrategy(placement_group=pg, placement_group_bundle_index=local_rank)}
                opts["num_gpus" if unit == "GPU" else "num_cpus"] = 1
                actors.append(RankProcess.options(**opts).remote())
        where = ray.get([a.node.remote() for a in actors])
        master_addr = where[0][0]
        master_port = args.master_port or ray.get(actors[0].free_port.remote())
        refs = {}
        for rank, actor in enumerate(actors):
            node_rank, local_rank = divmod(rank, ppn)
            env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                   "LOCAL_WORLD_SIZE": str(ppn), "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank),
                   "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "VERL_MEGA_LAUNCHER": "ray",
                   "VERL_MEGA_RAY_NODE_ID": where[rank][1], "VERL_MEGA_RESTART_COUNT": str(restart)}
            if unit == "CPU":
                env["CUDA_VISIBLE_DEVICES"] = ""
            else:  # like torchrun: every rank of a node sees the node's GPUs, local_rank i drives the i-th
                node_gpus = [g for r in range(node_rank * ppn, (node_rank + 1) * ppn) for g in where[r][2]]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
            refs[actor.run.remote(prog, env, f"[rank{rank}]")] = rank
        print(f"ray_launch: {world} rank(s) on {nnodes} node(s) {[n['NodeManagerAddress'] for n in chosen]}, "
              f"MASTER_ADDR={master_addr}:{master_port}", flush=True)

        return _wait_ranks(ray, refs, actors, args, stop)
    finally:
        for a in actors:
            try:
                ray.get(a.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort: the actor may already be gone
                pass
            ray.kill(a)
        for pg in groups:
            remove_placement_group(pg)


def _not_ready(ray, waiting: dict, stop: Stop) -> list[str]:
    """The nodes (``waiting``: ready ref → node) whose placement group is not ready after PG_READY_S; a signal
    ends the wait early."""
    deadline = time.monotonic() + PG_READY_S
    pending = list(waiting)
    while pending and not stop.signum and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(POLL_S, deadline - time.monotonic()))
    return [waiting[ref] for ref in pending]


def _wait_ranks(ray, refs: dict, actors: list, args: argparse.Namespace, stop: Stop) -> int:
    """Wait for every rank (``refs``: run ref → rank). The first failure ends the attempt. A signal to the driver
    goes on to the ranks as SIGTERM; they get --stop-grace-s to save and exit."""
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    stop_by = None  # once the ranks were told to stop
    pending = list(refs)
    while pending:
        if stop.signum and stop_by is None:
            print(f"ray_launch: {stop.name} received: passing SIGTERM to every rank (each saves its step and exits); "
                  f"ranks still running after --stop-grace-s {args.stop_grace_s:g} are killed", file=sys.stderr,
                  flush=True)
            for a in actors:
                a.terminate.remote()
            stop_by = time.monotonic() + args.stop_grace_s
        if stop_by is not None and (time.monotonic() >= stop_by or stop.count > 1):
            why = "a second signal came" if stop.count > 1 else f"--stop-grace-s {args.stop_grace_s:g} passed"
            print(f"ray_launch: error: rank(s) {sorted(refs[r] for r in pending)} still running after {stop.name} "
                  f"and {why}; killing them", file=sys.stderr)
            return 128 + stop.signum
        if deadline is not None and time.monotonic() >= deadline:
            print(f"ray_launch: error: job exceeded --timeout {args.timeout}s; stopping all ranks", file=sys.stderr)
            return TIMED_OUT
        wait_s = min([POLL_S] + [t - time.monotonic() for t in (deadline, stop_by) if t is not None])
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, wait_s))
        if not done:
            continue
        rank = refs[done[0]]
        try:
            rc = ray.get(done[0])
        except Exception as exc:  # the actor itself died (node lost, OOM kill, ...)
            print(f"ray_launch: error: rank {rank} failed: {exc}; stopping all ranks", file=sys.stderr)
            return 1
        if rc != 0:
            print(f"ray_launch: error: rank {rank} exited with code {rc}; stopping all ranks", file=sys.stderr)
            return rc if 0 < rc < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
