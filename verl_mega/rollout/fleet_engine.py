"""One engine of a rollout fleet: a process of its own, started by the rollout pool's rank
(:class:`EngineProcess`), running one vLLM engine (gen_tp=1) in a world of one.

It is an ordinary child process, not a launcher worker: its death is the supervisor's to handle, never the
launcher's. It talks to the supervisor over one socket pair (pickled tuples, see
:class:`~verl_mega.rollout.fleet.EngineHandle`): it announces its weight layout once its engine is built, beats a
heartbeat from its main loop (every engine step, and while idle; from a thread while it refits), generates prompt
groups as they come (:class:`~verl_mega.rollout.streaming.StreamingEngine`, batches across groups) and reads new
weights from a file the supervisor wrote. A stopped (SIGSTOP) or stuck engine stops beating; one whose supervisor
is gone dies with it (PR_SET_PDEATHSIG) or ends at the closed socket. The torch.distributed world of one that vLLM
starts in it listens on the loopback interface only (:func:`private_world`).

``VERL_MEGA_FLEET_FAULT`` (tests): ``<engine>:<kill|stop>@<request>[,...]``, read by the supervisor, makes an
engine's first incarnation SIGKILL or SIGSTOP itself one engine step after it was given a group of that request.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from queue import Empty, Queue
from typing import Any, Iterator

from verl_mega.config.rl import FLEET_BEAT_S as BEAT_S  # the supervisor's bound (hang_timeout_s) is several

log = logging.getLogger(__name__)

LOOPBACK = "lo"  # Linux's loopback interface
KILL_WAIT_S = 10.0  # how long a SIGKILLed engine may take to end before the supervisor goes on without it
FAULT_ENV = "VERL_MEGA_FLEET_FAULT"
# launcher variables a child must not inherit: it is a world of one, not a rank of the job
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "VLLM_DIST_IDENT")
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "TORCHELASTIC_", "MPI_LOCAL")


def faults(text: str | None) -> dict[int, tuple[str, int]]:
    """``VERL_MEGA_FLEET_FAULT`` parsed: engine → (kill|stop, request)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        try:
            engine, rest = item.split(":")
            action, request = rest.split("@")
            if action not in ("kill", "stop"):
                raise ValueError
            out[int(engine)] = (action, int(request))
        except ValueError:
            raise ValueError(f"{FAULT_ENV}={text!r}: each item is <engine>:<kill|stop>@<request>, e.g. "
                             f"0:kill@2") from None
    return out


class EngineProcess:
    """The supervisor's handle on one incarnation of an engine (a :class:`~verl_mega.rollout.fleet.EngineHandle`).
    :meth:`spawn` starts one. Threads of its own read what the engine sends and write what it is sent, so that an
    engine stopped halfway through a message, or one that stopped reading with the socket's buffer full (a hung
    engine handed long prompts), never blocks the supervisor, whose hang check must go on; ``arrived`` is set
    whenever a message (or the end) comes."""

    def __init__(self, index: int, proc: Any, conn: Connection, arrived: threading.Event) -> None:
        self.index, self.proc, self.conn, self.arrived = index, proc, conn, arrived
        self.closed = False  # the connection ended (read by the supervisor's thread)
        self._heard: float | None = None  # time.monotonic() of the newest message's arrival (the reader's clock)
        self._drained = False  # everything sent before the process ended was read
        self._inbox: Queue = Queue()
        self._outbox: Queue = Queue()  # None ends the writer
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"engine-{index}-reader")
        self._writer = threading.Thread(target=self._write, daemon=True, name=f"engine-{index}-writer")
        self._reader.start()
        self._writer.start()

    @classmethod
    def spawn(cls, index: int, setup: dict[str, Any], arrived: threading.Event) -> "EngineProcess":
        """A new engine process; ``setup``: what it needs (its vLLM config and the weight hooks), its first
        message."""
        import multiprocessing

        ours, theirs = multiprocessing.Pipe(duplex=True)
        env = {k: v for k, v in os.environ.items()
               if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
        root = str(Path(__file__).resolve().parents[2])  # this checkout, wherever the interpreter was started
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        proc = subprocess.Popen([sys.executable, "-m", "verl_mega.rollout.fleet_engine", "--fd",
                                 str(theirs.fileno()), "--index", str(index)],
                                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        engine = cls(index, proc, ours, arrived)
        engine.send(("setup", setup))
        return engine

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        try:
            while True:
                message = self.conn.recv()
                self._heard = time.monotonic()
                self._inbox.put(message)
                self.arrived.set()
        except Exception:  # noqa: BLE001 - it ended, kill() shut the socket, or it sent garbage: its end either way
            self.closed = True
            self.arrived.set()

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self.conn.send(message)
            except OSError:  # it died, or kill() shut the socket: exit_reason says how, its groups go elsewhere
                self.closed = True
                return

    def send(self, message: tuple) -> None:
        """Queued for the writer thread, in order; never waits on the engine."""
        if not self.closed:
            self._outbox.put(message)

    def receive(self) -> list[tuple]:
        if not self._drained and self.proc.poll() is not None:
            # it ended: what it sent first is still in the socket, and is read to the end before its exit is seen
            self._reader.join(KILL_WAIT_S)
            self._drained = True
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except Empty:
                return out

    def last_heard(self) -> float | None:
        """When its newest message arrived, on time.monotonic (the dispatcher's clock in a fleet)."""
        return self._heard

    def exit_reason(self) -> str | None:
        code = self.proc.poll()
        if code is None:
            return None
        if code < 0:
            return f"pid {self.pid} was killed by {signal.Signals(-code).name}"
        return f"pid {self.pid} exited with code {code}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # SIGKILL ends a stopped process too
            try:
                self.proc.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # stuck in the kernel (a driver call, a dead mount): not ours to wait
                log.warning("rollout engine %d: pid %d did not end within %g s of SIGKILL; left behind",
                            self.index, self.pid, KILL_WAIT_S)
        self.closed = True
        # wake the reader (closing the fd under a blocked read would not) before closing the connection
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)  # also ends a send blocked on a full buffer
        self._outbox.put(None)
        self._reader.join(KILL_WAIT_S)
        self._writer.join(KILL_WAIT_S)
        self.conn.close()


# ---- the engine process --------------------------------------------------------------------------------------
def private_world() -> tuple[Any, dict[str, str]]:
    """The rendezvous of an engine's world of one, reachable from this host only: (what must stay alive while the
    world lives, the environment variables that make vLLM's env:// init use it).

    Left to itself, torch.distributed's rank-0 store listens on every interface, and gloo on the hostname's
    address. Here the store serves a socket bound to 127.0.0.1 before torch sees it (the env:// rendezvous then
    connects to it as a client, as workers do to torchrun's agent store), and gloo is held to the loopback
    interface. Nothing outside this process ever joins the world, so no configured interface is needed."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, master_listen_fd=listener.fileno(),
                          wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": LOOPBACK}
    return (listener, store), env


def _die_with_parent() -> None:
    """SIGKILL this process when its supervisor dies (Linux); elsewhere the closed socket ends it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def beating(conn: Connection) -> Iterator[None]:
    """Beat from a thread while the main loop is held up in one long call (a refit), which is no hang. A stopped
    process stops this thread too; a refit stuck for good is bounded by rollout.fleet.start_timeout_s instead. The
    main loop sends nothing meanwhile, so the connection has one writer at a time."""
    done = threading.Event()

    def beat() -> None:
        with contextlib.suppress(OSError):  # the supervisor is gone: the main loop finds out
            while not done.wait(BEAT_S):
                conn.send(("beat",))

    thread = threading.Thread(target=beat, daemon=True, name="refit-heartbeat")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def serve(conn: Connection, index: int) -> None:
    from verl_mega.rollout.streaming import StreamingEngine
    from verl_mega.rollout.vllm_rollout import VLLMRollout

    _, setup = conn.recv()
    layout_of, write = setup["hooks"]
    rollout = VLLMRollout(setup["config"])  # a world of one, on a free port
    stream = StreamingEngine(rollout, deltas=False)  # weights change between groups only
    conn.send(("ready", layout_of(rollout.model)))
    fault, armed = setup.get("fault"), False
    beat = time.monotonic()
    while True:
        if time.monotonic() - beat >= BEAT_S:
            conn.send(("beat",))
            beat = time.monotonic()
        while conn.poll(0 if stream.busy else BEAT_S / 2):
            message = conn.recv()
            if message[0] == "stop":
                rollout.shutdown()
                return
            if message[0] == "weights":
                import torch

                with beating(conn):  # loading a whole model can outlast rollout.fleet.hang_timeout_s
                    write(rollout.model, rollout.is_cpu, torch.load(message[1], weights_only=True, mmap=True))
                rollout.weight_version = message[2] - 1
                stream.weights_changed()
                conn.send(("refitted", message[2]))
            elif message[0] == "generate":
                _, key, prompt_ids, spec = message
                stream.add(key, [prompt_ids], spec)
                armed = armed or (fault is not None and key[0] >= fault[1])
        if stream.busy:
            for key in stream.step():
                got = stream.take(key)
                conn.send(("done", key, (got.token_ids, got.logprobs, got.versions)))
            if armed:  # a test's fault, one engine step into the request
                os.kill(os.getpid(), signal.SIGKILL if fault[0] == "kill" else signal.SIGSTOP)
                armed, fault = False, None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one engine of a rollout fleet (started by its supervisor)")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent()
    for sig in (signal.SIGINT, signal.SIGTERM):  # a preemption is the supervisor's to pass on, not an engine's
        signal.signal(sig, signal.SIG_IGN)
    conn = Connection(args.fd)
    try:
        world, env = private_world()  # kept alive (the store's server) until the process ends
        os.environ.update(env)
        serve(conn, args.index)
    except (EOFError, OSError):  # the supervisor is gone
        os._exit(1)
    except BaseException as exc:  # noqa: BLE001 - reported, then the supervisor restarts this engine
        try:
            conn.send(("error", f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"))
        except OSError:
            pass
        raise
    os._exit(0)  # the engine's modules go with the process


if __name__ == "__main__":
    main()
