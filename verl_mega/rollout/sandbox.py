"""The ``python`` tool's sandbox: model-written code runs in a box that contains everything it starts.

Mechanisms (Linux; standard library only, so that the launcher runs as ``python -I -S`` with nothing imported from
the trainer's environment):

- **Namespaces** (``unshare(2)`` through ctypes): a new user, PID, mount, IPC, UTS and cgroup namespace, and a new
  network namespace unless ``network`` is on. The user namespace maps one id: the code's uid/gid 0 inside is
  ``nobody`` (65534) outside when the trainer is root, else the trainer's own uid. So it holds no capability
  outside, reads host files only through "other" permission bits, and ``RLIMIT_NPROC`` counts only the box's
  processes (the kernel counts it per user namespace and uid, and never applies it to real root).
- **Process containment:** the box's first process is the PID namespace's init. When the code's main process
  ends, or at the time limit, init ends (is SIGKILLed); the kernel then SIGKILLs every process in the namespace,
  ``setsid`` or not, and the call returns only after all of them are gone. The launcher dies with the tool worker
  (``PR_SET_PDEATHSIG``), and the box with the launcher.
- **Files:** the root is a fresh, size-limited tmpfs (``pivot_root``, the old root detached) holding read-only bind
  mounts of the Python installation and the system's program and library directories (``/usr``, ``/bin``,
  ``/lib*``, ``/etc/ld.so.cache``), ``/dev/{null,zero,random,urandom}``, a fresh ``/proc`` of the new PID namespace
  (it shows only the box's processes, so no ``/proc/<ppid>/environ``), and writable ``/scratch`` (the working
  directory), ``/tmp`` and ``/dev/shm``. Nothing else of the host (``/etc``, home directories, ``/root`` beyond the
  Python installation's path, the repository, the trainer's files) is in the box.
- **Network:** a new network namespace has only a loopback interface, down: every connect fails.
- **Privileges:** the code's process has no capabilities (empty bounding, permitted, effective and inheritable
  sets) and ``PR_SET_NO_NEW_PRIVS``; the environment is empty; standard input is the code, read to its end.
- **Limits** (``setrlimit``): processes (``RLIMIT_NPROC``, threads included), address space per process
  (``RLIMIT_AS``), CPU time per process (``RLIMIT_CPU``), open files (``RLIMIT_NOFILE``), output and file size
  (``RLIMIT_FSIZE``), no core files; the scratch tmpfs is capped in bytes and inodes.

What it does not stop: the box shares the host's kernel, so a kernel exploit escapes it; CPU and cache side
channels, and the timing of other tenants, are not isolated; memory is limited per process, so the whole box may
use up to ``max_procs`` times ``memory_mb`` (no cgroup is used); the Python installation and system libraries are
readable (site-packages included); the code may use all CPU cores until the time limit.

Where namespaces are not permitted (user namespaces disabled, a seccomp profile that forbids ``unshare``, a
failed mount) the box degrades, and :func:`probe` says so (the trainer logs it once): the code runs in a session
of its own under the same limits, in a host scratch directory, as ``nobody`` when the trainer is root and the Python
installation is readable by ``nobody`` (else as the trainer's user); the launcher is a child subreaper and kills
every descendant at return and at the time limit, ``setsid`` ones included. It then does **not** hide the host's
files or network, ``RLIMIT_NPROC`` counts every process of that uid (it is set to the current count plus
``max_procs``) and does not apply at all to root, and code running as the trainer's user can read the trainer's
environment through ``/proc``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

NOBODY = 65534
KILL_WAIT_S = 5.0  # how long the launcher waits for the box to end after SIGKILL before giving up on it
_CLONE = {"user": 0x10000000, "pid": 0x20000000, "mount": 0x00020000, "ipc": 0x08000000, "uts": 0x04000000,
          "cgroup": 0x02000000, "net": 0x40000000}
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = \
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18
_ST_TO_MS = {1: _MS_RDONLY, 2: _MS_NOSUID, 4: _MS_NODEV, 8: _MS_NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache",)


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall-clock limit, start-up included; CPU time per process: its whole seconds + 1
    memory_mb: int = 512  # address space of each process
    max_procs: int = 32  # processes and threads of the box, its init included
    max_open_files: int = 64
    output_bytes: int = 16384  # the most stdout (or any one file) may hold
    scratch_mb: int = 64  # the box's writable tmpfs (/scratch, /tmp, /dev/shm)
    network: bool = False  # keep the host's network (no network namespace)
    namespaces: bool = True  # False: the degraded box only (what runs where namespaces are not permitted)


class SandboxResult(NamedTuple):
    returncode: int  # the code's exit status; negative: the signal that ended it
    stdout: bytes
    stderr: bytes
    timed_out: bool
    isolation: str  # "namespaces", or "fallback: <why namespaces were not used>"


def run(code: str, limits: SandboxLimits) -> SandboxResult:
    """Run ``code`` (Python source) in a new box and return what it printed; never leaves a process behind."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        status_r, status_w = os.pipe()
        config = {**asdict(limits), "parent": os.getpid(), "status_fd": status_w}
        _root_layout(config)  # here, where site has set sys.prefix (a virtual environment's), not in the launcher
        # a session of its own: the backstop below kills the launcher's whole group
        proc = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), json.dumps(config)],
                                stdin=subprocess.PIPE, stdout=out, stderr=err, env={}, cwd="/",
                                start_new_session=True, pass_fds=(status_w,))
        os.close(status_w)
        try:
            with os.fdopen(status_r, "rb") as status_file:
                try:  # the launcher enforces timeout_s itself; this bound is for a launcher that is stuck
                    proc.communicate(code.encode(errors="surrogateescape"), timeout=limits.timeout_s + KILL_WAIT_S)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                status = json.loads(status_file.read() or b"{}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(limits.output_bytes + 1), err.read(limits.output_bytes + 1)
    if "error" in status or "returncode" not in status:
        raise RuntimeError(f"python sandbox: {status.get('error', f'launcher ended with code {proc.returncode}')}")
    return SandboxResult(status["returncode"], stdout, stderr, status["timed_out"], status["isolation"])


def probe(*, network: bool = False) -> str:
    """How this machine isolates the ``python`` tool: ``namespaces`` or ``fallback: <why>``."""
    return run("pass", SandboxLimits(timeout_s=10.0, network=network)).isolation


# ---- the launcher (``python -I -S sandbox.py CONFIG``), and the processes it forks ------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), f"prctl({option})")


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent ends (Linux); ``parent``: end now if that pid is no longer it."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)), f"mount {target}")


def _limit(config: dict, nproc: int | None) -> None:
    """The code's rlimits; ``nproc`` None: no process limit (it could not mean anything)."""
    cpu = int(config["timeout_s"]) + 1
    for key, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, config["memory_mb"] << 20),
                       (resource.RLIMIT_FSIZE, config["output_bytes"]), (resource.RLIMIT_CORE, 0),
                       (resource.RLIMIT_NOFILE, config["max_open_files"])):
        resource.setrlimit(key, (value, value))
    if nproc is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


def _drop_capabilities(last_cap: int) -> None:
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    for cap in range(last_cap + 1):
        _libc.prctl(_PR_CAPBSET_DROP, ctypes.c_ulong(cap), 0, 0, 0)  # EINVAL for caps this kernel lacks
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(_libc.capset(header, (ctypes.c_uint32 * 6)()), "capset")  # empty effective, permitted, inheritable


def _exec_code(config: dict) -> None:
    """Become the code's interpreter (never returns), with default signal dispositions as subprocess gives."""
    for sig in (signal.SIGINT, signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    os.execve(config["python"], [config["python"], "-I", "-"], {})


def _wait_pid(pid: int, deadline: float) -> int | None:
    """``pid``'s wait status, or None at the deadline."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if fd is not None:
                select.select([fd], [], [], left)
            else:
                time.sleep(min(left, 0.01))
    finally:
        if fd is not None:
            os.close(fd)


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


# -- the namespaced box: launcher L -> C (unshares) -> I (init, PID 1 of the box) -> P (the code, PID 2) --------
def _lines(fd: int, deadline: float, buffer: list[bytes]) -> list[str] | None:
    """The next complete lines on ``fd`` ([] at its end), or None at the deadline."""
    while b"\n" not in b"".join(buffer):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return []
        buffer.append(chunk)
    text = b"".join(buffer)
    head, _, rest = text.rpartition(b"\n")
    buffer[:] = [rest] if rest else []
    return head.decode().splitlines()


def _namespaced(config: dict, deadline: float) -> dict | str:
    """Run the code in new namespaces: the launcher's status dict, or why the box could not be made."""
    up_r, up_w = os.pipe()  # C and I -> L: "unshared", "exit <status>", "error <why>"
    down_r, down_w = os.pipe()  # L -> C: "go" once the id maps are written
    child = os.fork()
    if child == 0:
        try:
            os.close(up_r), os.close(down_w)
            die_with_parent()
            _unshare_and_start(config, up_w, down_r)
        finally:
            os._exit(70)
    os.close(up_w), os.close(down_r)
    buffer: list[bytes] = []
    exit_status, error, timed_out = None, None, False
    try:
        while error is None:  # an error: no box (the unshare, the id maps or the file system failed)
            lines = _lines(up_r, deadline, buffer)
            if lines is None:  # the time limit
                timed_out = True
                break
            if not lines:
                break
            for line in lines:
                word, _, rest = line.partition(" ")
                if word == "unshared":
                    try:
                        _write_id_maps(child)
                    except OSError as exc:  # the child ends at the closed pipe; the degraded box runs instead
                        error = f"id maps: {exc}"
                        break
                    os.write(down_w, b"go\n")
                elif word == "exit":
                    exit_status = int(rest)
                elif word == "error":
                    error = rest
    finally:
        os.close(up_r), os.close(down_w)
        if timed_out:  # its init gets PR_SET_PDEATHSIG, and the kernel ends the rest of the box with it
            os.kill(child, signal.SIGKILL)
        _kill_descendants(time.monotonic() + KILL_WAIT_S)  # init comes here if its parent went first
    if error is not None:  # no box: the unshare or the file system failed
        return error
    if timed_out:
        return {"returncode": -signal.SIGKILL, "timed_out": True, "isolation": "namespaces"}
    if exit_status is None:
        return {"error": f"the box ended without a result ({error or 'no message'})"}
    return {"returncode": _returncode(exit_status), "timed_out": False, "isolation": "namespaces"}


def _write_id_maps(pid: int) -> None:
    """Inside id 0 is nobody when we are root (any outside id may be mapped), else our own id (the only one)."""
    uid, gid = (NOBODY, NOBODY) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    with open(f"/proc/{pid}/uid_map", "w") as f:
        f.write(f"0 {uid} 1\n")
    with open(f"/proc/{pid}/setgroups", "w") as f:
        f.write("deny\n")
    with open(f"/proc/{pid}/gid_map", "w") as f:
        f.write(f"0 {gid} 1\n")


def _unshare_and_start(config: dict, up: int, down: int) -> None:
    """C: unshare, wait for the id maps, start init and wait for it."""
    flags = 0
    for name, flag in _CLONE.items():
        if name != "net" or not config["network"]:
            flags |= flag
    try:
        if os.geteuid() == 0:
            os.setgroups([])  # root's supplementary groups would stay the code's, unmapped but still checked
        _check(_libc.unshare(ctypes.c_int(flags)), "unshare")
    except OSError as exc:
        os.write(up, f"error {exc.strerror or exc}\n".encode())
        os._exit(0)
    os.write(up, b"unshared\n")
    if os.read(down, 16) != b"go\n":
        os._exit(0)
    lifeline_r, lifeline_w = os.pipe()  # init sees its end once this process is gone
    init = os.fork()
    if init == 0:
        os.close(lifeline_w)
        _init(config, up, lifeline_r)
    os.close(up)
    os.waitpid(init, 0)
    os._exit(0)


def _init(config: dict, up: int, lifeline: int) -> None:
    """I, PID 1 of the box: build its file system, start the code, reap everything until the code ends."""
    _die_with(lifeline)
    try:
        _build_root(config, lifeline)
    except OSError as exc:
        os.write(up, f"error setup: {exc}\n".encode())
        os._exit(0)
    code = os.fork()
    if code == 0:
        try:
            os.setsid()
            _limit(config, config["max_procs"])
            _drop_capabilities(config["last_cap"])
            _exec_code(config)
        finally:
            os._exit(127)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the code may signal its init; only SIGKILL from outside ends it
    with contextlib.suppress(OSError):
        _drop_capabilities(config["last_cap"])
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == code:
            os.write(up, f"exit {status}\n".encode())
            os._exit(0)  # and the kernel SIGKILLs what is left in the box



def _die_with(lifeline: int) -> None:
    """SIGKILL this process when its parent ends, and end now if it already has (``lifeline``: a pipe whose other
    end only the parent holds)."""
    die_with_parent()
    if select.select([lifeline], [], [], 0)[0]:
        os._exit(1)


def _build_root(config: dict, lifeline: int) -> None:
    """A tmpfs root with read-only binds of what the interpreter needs; then pivot_root into it."""
    # Resolve the sources with the creator's own ids first: an owner may traverse its 0700 directories (such as a
    # Python installation under /root), which nobody, the id the box runs as, could not.
    sources = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in config["binds"]}
    devices = {path: os.open(path, os.O_PATH | os.O_CLOEXEC) for path in _DEVICES if os.path.exists(path)}
    os.setresgid(0, 0, 0), os.setresuid(0, 0, 0)  # the mapped id; the namespace's capabilities stay
    _die_with(lifeline)  # a change of ids clears PR_SET_PDEATHSIG
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates to the host
    new = "/tmp"  # any directory: this mount namespace is the box's own
    _mount("tmpfs", new, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={config['scratch_mb']}m,nr_inodes=16384,mode=0755")
    for link, target in config["links"].items():
        os.makedirs(os.path.dirname(new + link), exist_ok=True)
        os.symlink(target, new + link)
    for path, fd in {**sources, **devices}.items():
        target = new + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(target, exist_ok=True)
        else:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        _mount(f"/proc/self/fd/{fd}", target, None, _MS_BIND)
        # a remount may add flags but not clear those the source mount has (the kernel locks them)
        locked = sum(ms for st, ms in _ST_TO_MS.items() if os.statvfs(target).f_flag & st)
        extra = _MS_NOSUID if path in devices else _MS_RDONLY | _MS_NOSUID | _MS_NODEV
        _mount(None, target, None, _MS_BIND | _MS_REMOUNT | locked | extra)
        os.close(fd)
    for path, mode in (("/scratch", 0o755), ("/tmp", 0o1777), ("/dev/shm", 0o1777), ("/proc", 0o555)):
        os.makedirs(new + path, exist_ok=True)
        os.chmod(new + path, mode)
    try:  # a fresh /proc shows the box's processes only
        _mount("proc", new + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    except OSError:
        pass  # a host that forbids it (masked /proc paths): the box then has no /proc at all
    os.chdir(new)
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None and _libc.syscall(ctypes.c_long(number), b".", b".") == 0:
        _check(_libc.umount2(b".", 2), "umount the old root")  # MNT_DETACH: the host's tree is gone
    else:
        os.chroot(".")  # the code has no CAP_SYS_CHROOT to climb out of it
    os.chdir("/scratch")


def _root_layout(config: dict) -> None:
    """What the box's root holds: ``binds`` (host paths bound read-only at the same path, symlinks in them
    followed) and ``links`` (the host's top-level symlinks such as /lib -> usr/lib, recreated)."""
    python = os.path.abspath(sys.executable)  # not resolved: a virtual environment's python finds its pyvenv.cfg
    binds, links = [], {}
    candidates = [*_SYSTEM_DIRS, *_SYSTEM_FILES, sys.prefix, sys.base_prefix, sys.exec_prefix,
                  os.path.dirname(python), os.path.dirname(os.path.realpath(python))]
    for path in map(os.path.abspath, candidates):
        if os.path.islink(path) and os.path.dirname(path) == "/":
            links[path] = os.readlink(path)
        elif os.path.exists(path) and not any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds):
            binds = [b for b in binds if not b.startswith(path.rstrip("/") + "/")] + [path]
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
    except OSError:
        last_cap = 63
    config.update(python=python, binds=sorted(binds), links=links, last_cap=last_cap)


# -- the degraded box: L -> P, L a child subreaper ------------------------------------------------------------
def _children() -> list[int]:
    me, out = os.getpid(), []
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        pass
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == me:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _kill_descendants(deadline: float) -> None:
    """SIGKILL every descendant: orphans come to this subreaper, so each round finds the next generation."""
    while time.monotonic() < deadline:
        for pid in _children():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        time.sleep(0.001)


def _uid_count(uid: int) -> int:
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                continue
    return count


def _usable_by_others(path: str) -> bool:
    """Whether any user may run ``path`` (every directory above it searchable, the file readable by others)."""
    parts = os.path.realpath(path).split("/")
    for i in range(2, len(parts) + 1):
        try:
            if not os.stat("/".join(parts[:i]) or "/").st_mode & 0o005:
                return False
        except OSError:
            return False
    return True


def _fallback(config: dict, deadline: float, why: str) -> dict:
    scratch = tempfile.mkdtemp(prefix="verl_mega-python-tool-")
    as_nobody = os.geteuid() == 0 and all(_usable_by_others(p) for p in (config["python"], sys.prefix))
    if as_nobody:
        os.chown(scratch, NOBODY, NOBODY)
    uid = NOBODY if as_nobody else os.geteuid()
    nproc = None if uid == 0 else _uid_count(uid) + config["max_procs"]  # root is never held by RLIMIT_NPROC
    launcher = os.getpid()
    code = os.fork()
    if code == 0:
        try:
            os.setsid()
            os.chdir(scratch)
            _limit(config, nproc)
            if as_nobody:
                os.setgroups([]), os.setresgid(NOBODY, NOBODY, NOBODY), os.setresuid(NOBODY, NOBODY, NOBODY)
            die_with_parent(launcher)  # armed after the change of ids, which clears it
            _prctl(_PR_SET_NO_NEW_PRIVS, 1)
            _exec_code(config)
        finally:
            os._exit(127)
    status = _wait_pid(code, deadline)
    with contextlib.suppress(OSError):
        os.killpg(code, signal.SIGKILL)
    if status is None:
        os.kill(code, signal.SIGKILL)
    _kill_descendants(time.monotonic() + KILL_WAIT_S)
    shutil.rmtree(scratch, ignore_errors=True)
    isolation = f"fallback: {why}; runs as {'nobody' if as_nobody else f'uid {uid}'}"
    if status is None:
        return {"returncode": -signal.SIGKILL, "timed_out": True, "isolation": isolation}
    return {"returncode": _returncode(status), "timed_out": False, "isolation": isolation}


def _launch(config: dict) -> dict:
    deadline = time.monotonic() + config["timeout_s"]
    # orphans of the box come to the launcher, which reaps every one before it answers: nothing outlives the call
    _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    why = "namespaces switched off"
    if config["namespaces"]:
        result = _namespaced(config, deadline)
        if isinstance(result, dict):
            return result
        why = f"namespaces not permitted here ({result})"
    return _fallback(config, deadline, why)


def main() -> None:
    config = json.loads(sys.argv[1])
    die_with_parent(config["parent"])
    try:
        result = _launch(config)
    except Exception as exc:  # noqa: BLE001 - reported to the caller, which raises it
        result = {"error": f"{type(exc).__name__}: {exc}"}
    with os.fdopen(config["status_fd"], "w") as status:
        status.write(json.dumps(result))
    os._exit(0)


if __name__ == "__main__":
    main()
