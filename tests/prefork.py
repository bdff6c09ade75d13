"""Start test jobs as real processes without paying for the interpreter and its imports each time.

A *fork server* is a Python process that imported torch, megatron.core, transformers and vLLM once, with nothing
initialised (no process group, no engine, no CUDA, one thread). For each job it forks a *leader*, which starts a
session of its own and forks the job's ranks. The ranks are real processes: kill -9, SIGTERM, exit codes, timeouts
and ``/proc`` keep their meaning. A leader of several ranks behaves like ``torchrun --nproc-per-node N`` (static
rendezvous, the store hosted by the leader, the same environment; a failed rank makes it stop the others and exit
1); a leader of one plain process passes its exit status through unchanged.

What a fresh interpreter would have differently is put right in each rank before the job runs: the environment (the
job's own, plus what the preloaded imports set), ``sys.argv``, ``sys.path`` (what the imports added, the script
directory or cwd, ``PYTHONPATH``), signal dispositions, stdin, and the seeds of ``random`` and numpy's global
generator. At the end a rank does what interpreter shutdown does (join non-daemon threads, run atexit handlers,
flush) and exits without tearing down the modules. Variables read at start-up or at import time (``IMPORT_TIME``:
``PYTHONWARNINGS``, ``OMP_NUM_THREADS``, ...) cannot change after the imports, so jobs that differ in them get a
server each. What cannot be put right: every rank shares its server's string-hash seed, and a warning raised while
a module was imported is raised once, in the server, not in each job. A command that is not ``python [-m] ...`` or
``python -m torch.distributed.run --nproc-per-node N ...`` runs as an ordinary subprocess.

The launchers themselves (torchrun, mpirun, Ray) are tested by starting them for real (``real=True``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# third-party modules a job imports (the heavy part of its start); each is imported if it can be
PRELOAD = (
    "numpy", "torch", "torch.distributed", "torch.distributed.checkpoint", "torch.nn.attention.varlen",
    "torch.utils.tensorboard", "safetensors.torch", "yaml", "tqdm", "matplotlib", "matplotlib.pyplot",
    "transformers", "transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.mixtral.modeling_mixtral", "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "megatron.core", "megatron.core.models.gpt", "megatron.core.transformer", "megatron.core.optimizer",
    "megatron.core.distributed", "megatron.core.pipeline_parallel", "megatron.core.dist_checkpointing",
    "megatron.core.transformer.moe.moe_layer", "megatron.core.extensions.transformer_engine",
    "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
    "vllm.model_executor.models.qwen2", "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.qwen3_moe", "vllm.model_executor.models.mixtral",
    "vllm.model_executor.models.qwen2_moe",
)
# variables read at start-up or by a preloaded module when it is imported: jobs that differ in one of them get a
# server of their own (PER_JOB ones are applied to each job: sys.path, and the server runs unbuffered)
IMPORT_TIME = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "LD_", "MALLOC_", "CUDA", "TRANSFORMERS",
               "HF_", "TOKENIZERS", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING", "VLLM_TARGET_DEVICE", "VLLM_PLUGINS",
               "VLLM_USE_PRECOMPILED", "MPLBACKEND", "MPLCONFIGDIR", "NVTE_", "MEGATRON")
PER_JOB = ("PYTHONPATH", "PYTHONUNBUFFERED")
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_")
TORCHRUN_CLOSE_S = 30  # torchrun's grace period between SIGTERM and SIGKILL for the surviving workers


# ------------------------------------------------------------------------------------------------ the command
@dataclass(frozen=True)
class Command:
    """``python [-m MODULE | SCRIPT] ARGS`` on ``nproc`` ranks; ``torchrun`` gives them torchrun's environment."""

    target: str
    module: bool
    args: tuple[str, ...]
    nproc: int = 1
    torchrun: bool = False
    master_addr: str = "127.0.0.1"
    master_port: int | None = None


def parse(cmd: list[str]) -> Command | None:
    """The command a fork server can run, or None (then it runs as a subprocess)."""
    if not cmd or cmd[0] != sys.executable:
        return None
    rest = list(cmd[1:])
    if rest[:2] == ["-m", "torch.distributed.run"]:
        rest = rest[2:]
        opts = {"nproc-per-node": "1", "master-addr": "127.0.0.1", "master-port": None}
        while rest and rest[0].startswith("--"):
            key, _, value = rest.pop(0)[2:].partition("=")
            key = key.replace("_", "-")
            if key not in opts:
                return None  # a torchrun feature we do not emulate (nnodes, rdzv, restarts, ...)
            opts[key] = value if value else rest.pop(0)
        if not opts["nproc-per-node"].isdigit() or not rest:
            return None
        job = _python_target(rest)
        if job is None:
            return None
        port = int(opts["master-port"]) if opts["master-port"] else None
        return Command(job.target, job.module, job.args, int(opts["nproc-per-node"]), True, opts["master-addr"], port)
    return _python_target(rest)


def _python_target(rest: list[str]) -> Command | None:
    if rest[:1] == ["-m"] and len(rest) >= 2:
        return Command(rest[1], True, tuple(rest[2:]))
    if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
        return Command(str(Path(rest[0]).resolve()), False, tuple(rest[1:]))
    return None


def ranks_of(cmd: list[str]) -> int:
    """How many ranks ``cmd`` starts: torchrun's, mpirun's or ray_launch's count (1 for anything else)."""
    command = parse(cmd)
    if command is not None:
        return command.nproc
    for i, arg in enumerate(cmd):
        for flag in ("-np", "-n", "--nproc-per-node", "--nproc_per_node"):
            if arg == flag and i + 1 < len(cmd) and cmd[i + 1].isdigit():
                return int(cmd[i + 1])
            if arg.startswith(flag + "=") and arg.split("=", 1)[1].isdigit():
                return int(arg.split("=", 1)[1])
    return 1


# ------------------------------------------------------------------------------------------------ the client
class Job:
    """A started job; what a test needs of ``subprocess.Popen``. ``pid`` leads the job's session, ``ranks`` maps
    each rank to its pid."""

    def __init__(self, pid: int, ranks: dict[int, int], conn: socket.socket | None = None,
                 proc: subprocess.Popen | None = None) -> None:
        self.pid, self.ranks, self._conn, self._proc = pid, ranks, conn, proc
        self._buf, self.returncode = b"", None
        self._on_end: list = []

    def on_end(self, callback) -> None:
        """Call ``callback()`` once, when the job is seen to have ended (or its session is killed)."""
        self._on_end.append(callback)

    def _ended(self) -> None:
        callbacks, self._on_end = self._on_end, []
        for callback in callbacks:
            callback()

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(block=False)
        if self.returncode is not None:
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._proc is not None:
            self.returncode = self._proc.wait(timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired("prefork job", timeout)
            self._read(block=True, timeout=left)
        self._ended()
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """To the job's process: the single rank of a plain job, else the leader (which forwards it, as torchrun)."""
        os.kill(self.ranks[0] if self._conn is not None and len(self.ranks) == 1 else self.pid, sig)

    def kill_session(self) -> None:
        """SIGKILL every process of the job's session (helpers the ranks left behind included)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._proc is not None:
            self._proc.wait()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._ended()

    def _read(self, block: bool, timeout: float | None = None) -> None:
        if self._proc is not None:
            self.returncode = self._proc.poll()
            return
        if self._conn is None:
            raise RuntimeError(f"job {self.pid}: its session was killed before its exit status was read")
        self._conn.settimeout(timeout if block else 0.0)
        try:
            chunk = self._conn.recv(4096)
        except (BlockingIOError, socket.timeout):
            return
        if not chunk:
            raise RuntimeError(f"the leader of job {self.pid} ended without reporting an exit status")
        self._buf += chunk
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            msg = json.loads(line)
            if "status" in msg:
                self.returncode = msg["status"]


class ForkServer:
    """One fork server process, for jobs whose import-time environment (``import_key``) is ``key``."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = {k: v for k, v in env.items() if not k.startswith(LAUNCHER_VARS)}
        self._dir = Path(tempfile.mkdtemp(prefix="prefork-"))
        self._sock = self._dir / "server.sock"
        log = open(self._dir / "server.log", "w")
        self._proc = subprocess.Popen([sys.executable, "-u", __file__, "serve", str(self._sock)], env=self.env,
                                      stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        log.close()
        deadline = time.monotonic() + 300
        while not (self._dir / "ready").exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server did not start:\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def log(self) -> str:
        return (self._dir / "server.log").read_text(errors="replace")

    def alive(self) -> bool:
        return self._proc.poll() is None

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def launch(self, command: Command, *, env: dict[str, str], stdout: Path, stderr: Path | None,
               cwd: Path | str | None) -> Job:
        port = command.master_port
        if command.torchrun and port is None:
            port = free_port()
        request = {"target": command.target, "module": command.module, "args": list(command.args),
                   "nproc": command.nproc, "torchrun": command.torchrun, "master_addr": command.master_addr,
                   "master_port": port, "env": env, "cwd": str(Path(cwd or os.getcwd()).resolve()),
                   "stdout": str(stdout), "stderr": str(stderr) if stderr else None}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(self._sock))
        conn.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        conn.settimeout(60)
        while b"\n" not in buf:
            chunk = conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the fork server refused {command}:\n{self.log()[-3000:]}")
            buf += chunk
        line, rest = buf.split(b"\n", 1)
        started = json.loads(line)
        job = Job(started["pid"], {int(k): v for k, v in started["ranks"].items()}, conn=conn)
        job._buf = rest
        return job


def import_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables a preloaded import reads (``IMPORT_TIME``, less ``PER_JOB``): jobs that agree on them share
    a server."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in PER_JOB))


class Launcher:
    """Starts jobs through fork servers, one per import-time environment (at most ``max_servers``; a job that
    would need another one runs as a subprocess)."""

    def __init__(self, max_servers: int = 3) -> None:
        self.max_servers = max_servers
        self._servers: dict[tuple, ForkServer] = {}

    def launch(self, cmd: list[str], *, env: dict[str, str], stdout: Path, stderr: Path | None = None,
               cwd: Path | str | None = None, real: bool = False) -> Job:
        """Start ``cmd`` with output to ``stdout`` (and ``stderr``, else the same file)."""
        command = None if real or not enabled() else parse(cmd)
        server = self._server(env) if command is not None else None
        if server is None:
            return _subprocess(cmd, env=env, stdout=stdout, stderr=stderr, cwd=cwd)
        return server.launch(command, env=env, stdout=stdout, stderr=stderr, cwd=cwd)

    def _server(self, env: dict[str, str]) -> ForkServer | None:
        key = import_key(env)
        server = self._servers.get(key)
        if server is not None and not server.alive():
            del self._servers[key]  # the next job gets a new one
            raise RuntimeError(f"a fork server died:\n{server.log()[-3000:]}")
        if server is None and len(self._servers) < self.max_servers:
            server = self._servers[key] = ForkServer(env)
        return server

    def stop(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


def enabled() -> bool:
    """Off with VERL_MEGA_TEST_PREFORK=0, and on machines with NVIDIA GPUs: a process that touched the driver
    cannot hand CUDA to a forked child, and vLLM's import may touch it."""
    return os.environ.get("VERL_MEGA_TEST_PREFORK", "1") != "0" and not Path("/dev/nvidiactl").exists()


def _subprocess(cmd: list[str], *, env: dict[str, str], stdout: Path, stderr: Path | None, cwd) -> Job:
    out = open(stdout, "w")
    err = open(stderr, "w") if stderr else None
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=err if err else subprocess.STDOUT, cwd=cwd, start_new_session=True)
    out.close()
    if err:
        err.close()
    return Job(proc.pid, {0: proc.pid}, proc=proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ the server
class _Baseline:
    """What a fresh interpreter has that the forked ranks must get back."""

    def __init__(self) -> None:
        self.env_before = dict(os.environ)
        self.path_before = list(sys.path)
        self.path_tail = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD,
                                                         signal.SIGPIPE, signal.SIGHUP, signal.SIGUSR1)}

    def after_imports(self) -> None:
        import warnings

        self.env_set = {k: v for k, v in os.environ.items() if self.env_before.get(k) != v}
        self.filters_after = list(warnings.filters)
        self.path_front, self.path_back = _around(list(sys.path), self.path_before)  # ray adds its own, first


def _around(after: list, before: list) -> tuple[list, list]:
    """What was put in front of and behind ``before`` to make ``after``."""
    n = len(before)
    at = next(i for i in range(len(after) - n + 1) if after[i:i + n] == before)
    return after[:at], after[at + n:]


def _preload() -> list[str]:
    import importlib

    failed = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an optional module (transformer-engine) or a model this vLLM lacks
            failed.append(f"{name}: {type(exc).__name__}")
    return failed


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(sock_path: str) -> None:
    import gc
    import selectors

    # the server ends when its client does: its stdin is a pipe from the client (PR_SET_PDEATHSIG would follow
    # the client's thread that started it, not the client)
    base = _Baseline()
    failed = _preload()
    base.after_imports()
    gc.collect()
    gc.freeze()  # the preloaded objects stay shared with the forked ranks instead of being copied by the GC
    if _threads() != 1:
        raise SystemExit(f"prefork: {_threads()} threads after the imports; forking them is not safe")
    print(f"prefork: preloaded in {time.process_time():.1f} s CPU; not importable: {failed}", flush=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # leaders are reaped by the kernel
    Path(sock_path).with_name("ready").touch()
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in sel.select():
            if key.fileobj is sys.stdin:
                if not sys.stdin.buffer.read1(1):
                    return  # the client is gone
                continue
            conn, _ = listener.accept()
            request = _read_request(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            if os.fork() == 0:
                try:
                    sel.close()
                    listener.close()
                    _lead(conn, request, base)
                finally:
                    os._exit(70)
            conn.close()


def _read_request(conn: socket.socket) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
    return json.loads(buf)


def _lead(conn: socket.socket, req: dict, base: _Baseline) -> None:
    """The job's session leader: fork the ranks, report their pids, wait as torchrun (or a shell) would."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _redirect(req)
    ranks: dict[int, int] = {}
    for rank in range(req["nproc"]):
        pid = os.fork()
        if pid == 0:
            conn.close()
            _run_rank(req, rank, base)  # never returns
        ranks[rank] = pid
    conn.sendall(json.dumps({"pid": os.getpid(), "ranks": ranks}).encode() + b"\n")
    store = None
    if req["torchrun"]:
        from datetime import timedelta

        from torch.distributed import TCPStore

        store = TCPStore(req["master_addr"], req["master_port"], 1, True, timedelta(seconds=900), multi_tenant=True)

    def forward(sig, _frame):  # torchrun passes SIGTERM/SIGINT on to its workers
        for pid in ranks.values():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    status = _wait_ranks(ranks, torchrun=req["torchrun"])
    del store
    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
    conn.close()
    os._exit(0)


def _wait_ranks(ranks: dict[int, int], *, torchrun: bool) -> int:
    alive = dict(ranks)
    exit_codes: dict[int, int] = {}
    while alive:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        rank = next((r for r, p in alive.items() if p == pid), None)
        if rank is None:
            continue
        del alive[rank]
        exit_codes[rank] = os.waitstatus_to_exitcode(status)
        if not torchrun:
            return exit_codes[rank]
        if exit_codes[rank] != 0 and alive:  # as torchrun: a failed worker stops the others
            _close(alive, exit_codes)
            break
    failed = {r: c for r, c in exit_codes.items() if c != 0}
    if not failed:
        return 0
    first = min(failed, key=lambda r: list(exit_codes).index(r))
    print(f"prefork torchrun: ChildFailedError: rank {first} (pid {ranks[first]}) exitcode {failed[first]}; "
          f"failed ranks {sorted(failed)}", file=sys.stderr, flush=True)
    return 1


def _close(alive: dict[int, int], exit_codes: dict[int, int]) -> None:
    for pid in alive.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + TORCHRUN_CLOSE_S
    while alive and time.monotonic() < deadline:
        for rank, pid in list(alive.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                exit_codes.setdefault(rank, os.waitstatus_to_exitcode(status))
                del alive[rank]
        time.sleep(0.05)
    for rank, pid in alive.items():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        exit_codes.setdefault(rank, -signal.SIGKILL)


def _redirect(req: dict) -> None:
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    if req["stderr"]:
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(err, 2)
        os.close(err)
    else:
        os.dup2(out, 2)
    os.close(out)


def _run_rank(req: dict, rank: int, base: _Baseline) -> None:
    import atexit
    import random
    import runpy
    import threading
    import traceback
    import warnings

    for sig, handler in base.signals.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    env = dict(req["env"])
    if req["torchrun"]:
        n = req["nproc"]
        env = {k: v for k, v in env.items() if not k.startswith(LAUNCHER_VARS)}
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_NAME="default",
                   LOCAL_WORLD_SIZE=str(n), WORLD_SIZE=str(n), GROUP_WORLD_SIZE="1", ROLE_WORLD_SIZE=str(n),
                   MASTER_ADDR=req["master_addr"], MASTER_PORT=str(req["master_port"]),
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0", TORCHELASTIC_RUN_ID="none",
                   TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCH_NCCL_ASYNC_ERROR_HANDLING=env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"))
        if n > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
    env.update(base.env_set)  # what the preloaded imports put into the environment, as they would have
    os.environ.clear()
    os.environ.update(env)
    os.chdir(req["cwd"])
    target = req["target"]
    path0 = req["cwd"] if req["module"] else str(Path(target).parent)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [*base.path_front, path0, *extra, *base.path_tail, *base.path_back]
    warnings.filters[:] = base.filters_after  # PYTHONWARNINGS's and the imports' (the server shares both)
    warnings._filters_mutated()
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [target, *req["args"]]
    code = 0
    try:
        if req["module"]:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:  # interpreter shutdown, less the module teardown
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        if code < 0:
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        os._exit(code & 0xFF)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2])
