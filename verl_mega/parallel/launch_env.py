"""Launcher-neutral rank discovery: torchrun, Open MPI, MPICH/Intel MPI (PMI), PMIx, Slurm and Ray.

Every launcher describes the same facts (rank, world size, local rank, ...) with its own environment variables.
``discover()`` reads whichever set is present and returns one frozen ``DistEnv``; ``export_to_os_environ()`` writes
it back as the variables ``torch.distributed.init_process_group(init_method="env://")`` reads. Under MPI without
MASTER_ADDR, rank 0 broadcasts its address (and a free port) with mpi4py.

Also usable as a shim that exports the variables and then execs the real entry point:

    mpirun -np 8 python -m verl_mega.parallel.launch_env -- -m verl_mega.train --config cfg.yaml
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import socket
import struct
import sys
from dataclasses import asdict, dataclass
from typing import Mapping, MutableMapping

__all__ = ["DistEnv", "LaunchEnvError", "RESTART_COUNTERS", "attempt_key", "discover", "main", "restart_counters"]

# the launchers' restart counters: torchrun's, Slurm's requeue count, and the launch/ scripts' own loops
RESTART_COUNTERS = {"torchrun": "TORCHELASTIC_RESTART_COUNT", "slurm": "SLURM_RESTART_COUNT",
                    "launcher": "VERL_MEGA_RESTART_COUNT"}


def restart_counters() -> dict[str, int]:
    """The launchers' restart counters present in this process's environment (name → count)."""
    out = {}
    for name, var in RESTART_COUNTERS.items():
        value = os.environ.get(var, "")
        if value.isdigit():
            out[name] = int(value)
    return out


def attempt_key() -> str:
    """This attempt's name among the launchers' restarts (``attempt`` + the counters present, e.g.
    ``attempt-torchrun1``): the same on every rank of one attempt, and new at each restart."""
    counters = restart_counters()
    return "attempt" + "".join(f"-{name}{count}" for name, count in sorted(counters.items()))


class LaunchEnvError(ValueError):
    """The launcher environment is incomplete or contradicts itself."""


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun, env, mpirun, pmi, pmix, slurm, ray, single

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise LaunchEnvError(f"world size must be >= 1, got {self.world_size} ({self.launcher})")
        if not 0 <= self.rank < self.world_size:
            raise LaunchEnvError(f"rank {self.rank} is outside [0, {self.world_size}) ({self.launcher}): "
                                 f"check the launcher's rank and size variables")
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchEnvError(f"local rank {self.local_rank} is outside [0, {self.local_world_size}) "
                                 f"({self.launcher}): check the local rank/size variables")
        if self.world_size % self.local_world_size:
            raise LaunchEnvError(f"world size {self.world_size} is not a multiple of the local world size "
                                 f"{self.local_world_size} ({self.launcher}): every node must run the same number "
                                 f"of ranks")
        if not 0 <= self.node_rank < self.num_nodes:
            raise LaunchEnvError(f"node rank {self.node_rank} is outside [0, {self.num_nodes}) ({self.launcher})")
        if not 0 < self.master_port < 65536:
            raise LaunchEnvError(f"MASTER_PORT {self.master_port} is not a valid TCP port")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def as_env(self) -> dict[str, str]:
        """The variables torch.distributed's env:// init (and torchrun-style code) expect."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "NODE_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "VERL_MEGA_LAUNCHER": self.launcher,
        }

    def export_to_os_environ(self, environ: MutableMapping[str, str] | None = None) -> None:
        (os.environ if environ is None else environ).update(self.as_env())


def _int(env: Mapping[str, str], key: str, launcher: str) -> int:
    if key not in env:
        raise LaunchEnvError(f"{key} is not set but other {launcher} variables are: the launcher environment is "
                             f"incomplete (start the job with the launcher, or export {key})")
    try:
        return int(env[key])
    except ValueError:
        raise LaunchEnvError(f"{key}={env[key]!r} is not an integer ({launcher})") from None


def _check_ranges(rank: int, world: int, local_rank: int, local_world: int, launcher: str) -> None:
    """Range errors first: they explain more than the cross-checks that would fail because of them."""
    if world < 1 or not 0 <= rank < world:
        raise LaunchEnvError(f"rank {rank} is outside [0, {world}) ({launcher}): check the launcher's rank and "
                             f"size variables")
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise LaunchEnvError(f"local rank {local_rank} is outside [0, {local_world}) ({launcher}): check the local "
                             f"rank/size variables")


def _slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    """The step's SLURM_STEP_TASKS_PER_NODE ("4(x2)"), else the job's SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE.
    The step's comes first: `srun -N2 -n8` in a --ntasks-per-node=8 job runs 4 per node but inherits the job's 8."""
    for key in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(key):
            counts = {int(m.group(1)) for m in re.finditer(r"(\d+)(?:\(x\d+\))?", env[key])}
            if len(counts) != 1:
                raise LaunchEnvError(f"{key}={env[key]!r}: nodes run different numbers of tasks; use the same "
                                     f"--ntasks-per-node on every node")
            return counts.pop()
    return None


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list: "gpu[003-010,020],cpu1" -> "gpu003"."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise LaunchEnvError(f"cannot parse Slurm node list {nodelist!r}; export MASTER_ADDR")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _iface_ipv4(name: str) -> str | None:
    """IPv4 address of a network interface (Linux SIOCGIFADDR), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None


def _ifname_matches(spec: str, name: str, *, exact: bool) -> bool:
    """Whether interface ``name`` is selected by a socket-ifname list, as NCCL reads NCCL_SOCKET_IFNAME: a leading
    ``^`` excludes the listed names, ``=`` matches whole names, otherwise names match by prefix (``eth`` is eth0)."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = exact or spec.startswith("=")
    names = [n for n in spec.lstrip("=").split(",") if n]
    hit = any(name == n if exact else name.startswith(n) for n in names)
    return hit != exclude


def local_address(environ: Mapping[str, str] | None = None, *, multi_node: bool = False) -> str:
    """This host's address for peers: the first interface GLOO_SOCKET_IFNAME (exact names) or NCCL_SOCKET_IFNAME
    (NCCL's syntax) selects, else the resolved hostname, else the first non-loopback IPv4 interface, else the
    hostname. ``multi_node``: never a loopback address, which the other nodes would take for themselves."""
    env = os.environ if environ is None else environ

    def usable(ip: str | None) -> bool:
        return bool(ip) and not (multi_node and ipaddress.ip_address(ip).is_loopback)

    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        spec = env.get(key, "")
        if spec:  # the user chose the interfaces: an address outside them would be the wrong network
            for _, name in socket.if_nameindex():
                ip = _iface_ipv4(name)
                if _ifname_matches(spec, name, exact=key == "GLOO_SOCKET_IFNAME") and usable(ip):
                    return ip
            raise LaunchEnvError(f"{key}={spec!r} selects no interface with a{' non-loopback' if multi_node else 'n'} "
                                 f"IPv4 address on {socket.gethostname()}: fix it (ip -4 addr lists them) or export "
                                 f"MASTER_ADDR")
    host = socket.gethostname()
    try:
        ip = socket.gethostbyname(host)
        if not ipaddress.ip_address(ip).is_loopback:
            return ip
    except OSError:
        pass
    for _, name in socket.if_nameindex():
        ip = _iface_ipv4(name)
        if ip and not ipaddress.ip_address(ip).is_loopback:
            return ip
    if multi_node:
        raise LaunchEnvError(f"{host} has no non-loopback IPv4 address for the other nodes to reach rank 0: export "
                             f"MASTER_ADDR")
    return host


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _mpi_rendezvous(env: Mapping[str, str], need_addr: bool, need_port: bool,
                    multi_node: bool) -> tuple[str | None, int | None]:
    """Rank 0 broadcasts its address/port to all ranks over MPI."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchEnvError(
            "MASTER_ADDR/MASTER_PORT are not set and mpi4py is not installed, so rank 0 cannot broadcast its "
            "address: pip install mpi4py (extra verl_mega[mpi]) or pass them to every rank (mpirun -x MASTER_ADDR=.. "
            "-x MASTER_PORT=..)"
        ) from None
    comm = MPI.COMM_WORLD
    payload = None
    if comm.Get_rank() == 0:
        try:
            payload = (local_address(env, multi_node=multi_node) if need_addr else None,
                       _free_port() if need_port else None, "")
        except LaunchEnvError as exc:  # broadcast too: the other ranks would otherwise wait in bcast for ever
            payload = (None, None, str(exc))
    addr, port, error = comm.bcast(payload, root=0)
    if error:
        raise LaunchEnvError(f"rank 0: {error}")
    return addr, port


def _mpi_world() -> tuple[int, int, int, int]:
    """(rank, size, local rank, local size) from MPI itself, for PMI/PMIx launches that export too little."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchEnvError("the MPI launcher exports only a rank (PMI_RANK/PMIX_RANK) and mpi4py is not "
                             "installed to ask MPI for the rest: pip install mpi4py") from None
    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return comm.Get_rank(), comm.Get_size(), local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def _check_node_by_node(rank: int, local_rank: int, local_world: int, names: tuple[str, str, str], fix: str) -> None:
    """Ranks must be numbered node by node (node_rank = rank // local_world); ``names``: the rank, local rank and
    local size variables, ``fix``: how to get such a numbering from this launcher."""
    if rank % local_world != local_rank:
        raise LaunchEnvError(f"{names[1]}={local_rank} contradicts {names[0]}={rank} % {names[2]}={local_world} = "
                             f"{rank % local_world}: ranks must be numbered node by node{fix}")


def _srun_started(env: Mapping[str, str], rank_key: str) -> bool:
    """Whether srun started this process (its PMI/PMIx plugin exports the MPI rank too). Ranks that an MPI launcher
    (Hydra's mpiexec, prterun) starts inside an allocation inherit the SLURM_* values of the batch script or of the
    launcher's daemon instead: those disagree with the MPI rank or size, and Hydra exports MPI_LOCALRANKID."""
    if "SLURM_PROCID" not in env or "MPI_LOCALRANKID" in env or env["SLURM_PROCID"] != env[rank_key]:
        return False
    size = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    return "PMI_SIZE" not in env or env["PMI_SIZE"] == size


def discover(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's environment. Precedence: RANK/WORLD_SIZE (torchrun, Ray, manual), Open MPI, PMI
    (MPICH/Intel MPI) and PMIx, Slurm; with none of them, a single process. Slurm's variables win over PMI/PMIx only
    when srun started the processes itself (they agree with the MPI rank)."""
    env = dict(os.environ if environ is None else environ)
    master_addr = env.get("MASTER_ADDR") or None
    master_port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT", "").isdigit() else None
    if "MASTER_PORT" in env and master_port is None:
        raise LaunchEnvError(f"MASTER_PORT={env['MASTER_PORT']!r} is not an integer")
    mpi_like = False
    pmi_key = next((k for k in ("PMI_RANK", "PMIX_RANK") if k in env), None)

    if "RANK" in env or "WORLD_SIZE" in env:
        launcher = env.get("VERL_MEGA_LAUNCHER") or ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "env")
        rank, world = _int(env, "RANK", launcher), _int(env, "WORLD_SIZE", launcher)
        local_rank, local_world = _int(env, "LOCAL_RANK", launcher), _int(env, "LOCAL_WORLD_SIZE", launcher)
        _check_ranges(rank, world, local_rank, local_world, launcher)
        node_rank = rank // local_world
        # torchelastic numbers the nodes itself (GROUP_RANK); a NODE_RANK its workers inherit from the user's shell
        # (torchrun.sh reads it) is not theirs under the c10d rendezvous, which numbers nodes in arrival order
        elastic = "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env
        for key in ("GROUP_RANK",) if elastic else ("GROUP_RANK", "NODE_RANK"):
            if key in env and _int(env, key, launcher) != node_rank:
                raise LaunchEnvError(f"{key}={env[key]} contradicts RANK={rank} // LOCAL_WORLD_SIZE={local_world} "
                                     f"= {node_rank}: ranks must be numbered node by node")
        _check_node_by_node(rank, local_rank, local_world, ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"), "")
        if master_addr is None or master_port is None:
            raise LaunchEnvError(f"RANK/WORLD_SIZE are set ({launcher}) but MASTER_ADDR or MASTER_PORT is not: "
                                 f"export both (torchrun sets them)")
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher, mpi_like = "mpirun", True
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK", launcher), _int(env, "OMPI_COMM_WORLD_SIZE", launcher)
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", launcher)
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", launcher)
        _check_ranges(rank, world, local_rank, local_world, launcher)
        _check_node_by_node(rank, local_rank, local_world, ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                            "OMPI_COMM_WORLD_LOCAL_SIZE"), " (mpirun --map-by ppr:N:node, as launch/mpirun.sh does)")
        node_rank = rank // local_world
    elif "SLURM_PROCID" in env and (pmi_key is None or _srun_started(env, pmi_key)):
        launcher = "slurm"
        rank = _int(env, "SLURM_PROCID", launcher)
        world = _int(env, "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS", launcher)
        local_rank = _int(env, "SLURM_LOCALID", launcher)
        local_world = _slurm_tasks_per_node(env) or world
        _check_ranges(rank, world, local_rank, local_world, launcher)
        node_rank = int(env["SLURM_NODEID"]) if env.get("SLURM_NODEID", "").isdigit() else rank // local_world
        if node_rank != rank // local_world:
            raise LaunchEnvError(f"SLURM_NODEID={node_rank} contradicts SLURM_PROCID={rank} // tasks per node "
                                 f"{local_world}: use --distribution=block so tasks are numbered node by node")
        _check_node_by_node(rank, local_rank, local_world, ("SLURM_PROCID", "SLURM_LOCALID", "tasks per node"),
                            " (srun --distribution=block)")
        if master_addr is None:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise LaunchEnvError("Slurm job without SLURM_JOB_NODELIST: export MASTER_ADDR")
            master_addr = first_slurm_host(nodelist)
        if master_port is None:  # distinct per job so two jobs sharing a node do not collide
            master_port = 20000 + int(env.get("SLURM_JOB_ID", "9500")) % 20000
    elif pmi_key:
        launcher, mpi_like = ("pmi" if pmi_key == "PMI_RANK" else "pmix"), True
        if "PMI_RANK" in env and "PMI_SIZE" in env and ("MPI_LOCALRANKID" in env or "PMI_LOCAL_RANK" in env):
            rank, world = _int(env, "PMI_RANK", launcher), _int(env, "PMI_SIZE", launcher)
            lr_key = "MPI_LOCALRANKID" if "MPI_LOCALRANKID" in env else "PMI_LOCAL_RANK"
            ls_key = "MPI_LOCALNRANKS" if lr_key == "MPI_LOCALRANKID" else "PMI_LOCAL_SIZE"
            local_rank, local_world = _int(env, lr_key, launcher), _int(env, ls_key, launcher)
            names = ("PMI_RANK", lr_key, ls_key)
        else:
            rank, world, local_rank, local_world = _mpi_world()
            names = ("MPI rank", "node-local rank", "ranks on the node")
        _check_ranges(rank, world, local_rank, local_world, launcher)
        _check_node_by_node(rank, local_rank, local_world, names, " (mpiexec -ppn N, which fills nodes in turn)")
        node_rank = rank // local_world
    else:
        launcher = "single"
        rank, world, local_rank, local_world, node_rank = 0, 1, 0, 1, 0
        master_addr = master_addr or "127.0.0.1"
        # a single process is a private world: a free port keeps two such jobs on one box from colliding
        master_port = master_port or _free_port()

    if mpi_like and (master_addr is None or master_port is None):
        addr, port = _mpi_rendezvous(env, master_addr is None, master_port is None, world > local_world)
        master_addr = master_addr or addr
        master_port = master_port or port
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                   node_rank=node_rank, master_addr=str(master_addr), master_port=int(master_port), launcher=launcher)


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_mega.parallel.launch_env [--print] [--] PYTHON_ARGS...``: export the env, exec Python."""
    args = list(sys.argv[1:] if argv is None else argv)
    show = bool(args) and args[0] == "--print"
    if show:
        args = args[1:]
    if args and args[0] == "--":
        args = args[1:]
    try:
        dist_env = discover()
    except LaunchEnvError as exc:
        print(f"launch_env: error: {exc}", file=sys.stderr)
        return 2
    if show or not args:
        print(json.dumps(asdict(dist_env)), flush=True)
        if not args:
            return 0
    dist_env.export_to_os_environ()
    if "mpi4py.MPI" in sys.modules:  # finalize before exec so the MPI runtime sees a clean exit of this image
        sys.modules["mpi4py.MPI"].Finalize()
    sys.stdout.flush()
    os.execvp(sys.executable, [sys.executable, *args])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
