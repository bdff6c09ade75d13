"""The `python` tool's sandbox: what the code starts ends with the call, limits hold, and the code sees neither the
trainer's environment, nor files outside its scratch directory, nor the network."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from verl_mega.rollout import sandbox
from verl_mega.rollout.sandbox import SandboxLimits
from verl_mega.rollout.tools import ToolError, ToolRunner, python

WAIT_S = 5.0  # bound on how long the kernel may take to reap a killed box


def _marked(marker: str) -> list[int]:
    """Live (not zombie) processes whose name (comm) is ``marker``."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if comm == marker and state != "Z":
            out.append(int(pid))
    return out


@pytest.fixture()
def marker():
    """A process name the code gives itself (its forks inherit it); the test fails if any such process outlives
    the call by more than WAIT_S, and kills what is left."""
    name = f"vmsbx{os.getpid() % 100000}"
    yield name
    deadline = time.monotonic() + WAIT_S
    while (left := _marked(name)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the python tool outlived the call: {left}"


def _children(marker: str, n: int, *, setsid: bool, then: str) -> str:
    """Code that names itself ``marker``, starts ``n`` sleeping children (each, with ``setsid``, an orphaned
    grandchild in a session of its own), waits until all run, prints n, then runs ``then``."""
    return f"""
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"{marker}", 0, 0, 0)  # PR_SET_NAME, inherited by forks
r, w = os.pipe()
for _ in range({n}):
    if os.fork() == 0:
        if {setsid}:
            os.setsid()
            if os.fork():
                os._exit(0)
        os.write(w, b"x")
        time.sleep(60)
        os._exit(0)
got = 0
while got < {n}:
    got += len(os.read(r, {n}))
print(got, flush=True)
{then}
"""


def _watch(marker: str) -> tuple[threading.Event, list[int]]:
    """Counts the most marked processes seen at once, until the event is set."""
    stop, most = threading.Event(), [0]

    def run() -> None:
        while not stop.is_set():
            most[0] = max(most[0], len(_marked(marker)))
            time.sleep(0.02)

    threading.Thread(target=run, daemon=True).start()
    return stop, most


def test_a_setsid_grandchild_dies_at_the_time_limit(marker):
    stop, most = _watch(marker)
    try:
        with pytest.raises(ToolError, match="timed out after 2 s"):
            python(_children(marker, 1, setsid=True, then="time.sleep(60)"), timeout_s=2.0)
    finally:
        stop.set()
    assert most[0] >= 2  # the code and its grandchild both ran


def test_a_setsid_grandchild_dies_when_the_code_returns(marker):
    assert python(_children(marker, 1, setsid=True, then=""), timeout_s=10.0) == "1\n"


def test_twenty_children_die_when_the_code_returns(marker):
    assert python(_children(marker, 20, setsid=False, then=""), timeout_s=10.0) == "20\n"


def test_a_fork_bomb_is_held_by_the_process_limit(marker):
    code = f"""
import ctypes, os, time
ctypes.CDLL(None).prctl(15, b"{marker}", 0, 0, 0)
forked = 0
for _ in range(300):
    try:
        pid = os.fork()
    except OSError:
        continue
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    forked += 1
print(forked)
"""
    forked = int(python(code, timeout_s=10.0))
    assert forked < SandboxLimits().max_procs  # the box's init and the code count too


def test_the_code_sees_no_environment_of_the_trainer(monkeypatch):
    secret = "verl-mega-sandbox-test-secret"
    monkeypatch.setenv("VERL_MEGA_TEST_TOKEN", secret)  # in the tool worker's environment from its start
    code = f"""
import os
found = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if b"{secret}" in open(f"/proc/{{pid}}/environ", "rb").read():
            found.append(pid)
    except OSError:
        pass
try:
    parent = open(f"/proc/{{os.getppid()}}/environ", "rb").read()
except OSError:
    parent = b""
print(sorted(os.environ), found, b"VERL_MEGA" in parent)
"""
    runner = ToolRunner(["python"], timeout_s=10.0)
    try:
        ok, text, _ = runner.call("python", code)
    finally:
        runner.close()
    assert ok and text.strip() in ("[] [] False", "['LC_CTYPE'] [] False"), text


def test_files_outside_the_working_directory_cannot_be_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    paths = [str(secret), "/etc/shadow", "/etc/passwd", str(Path(__file__).resolve()),
             str(Path.home() / ".bashrc")]
    code = f"""
import os
readable = []
for path in {paths!r}:
    try:
        open(path, "rb").read(1)
        readable.append(path)
    except OSError:
        pass
open("mine.txt", "w").write("scratch is writable")
print(readable, os.getcwd(), os.listdir("."))
"""
    readable, cwd, rest = python(code).split(" ", 2)
    assert readable == "[]", readable
    assert cwd == "/scratch" and rest == "['mine.txt']\n"


def test_no_network_unless_configured():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)\n" \
               f"print('connected')"
        with pytest.raises(ToolError, match="Network is unreachable"):
            python(code)
        runner = ToolRunner(["python"], timeout_s=10.0, python_network=True)  # rollout.multi_turn.python_network
        try:
            assert runner.call("python", code) == (True, "connected\n", False)
        finally:
            runner.close()


def test_limits_and_privileges():
    status = python("print(open('/proc/self/status').read())")
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    assert int(fields["CapEff"], 16) == int(fields["CapBnd"], 16) == int(fields["CapPrm"], 16) == 0
    assert fields["NoNewPrivs"].strip() == "1"
    limits = python("import resource\nprint([resource.getrlimit(getattr(resource, 'RLIMIT_' + k))[1] for k in "
                    "('NPROC', 'NOFILE', 'AS', 'CPU')])", timeout_s=3.0, memory_mb=256)
    assert limits.strip() == f"[{SandboxLimits().max_procs}, {SandboxLimits().max_open_files}, {256 << 20}, 4]"


def test_the_degraded_box_still_kills_everything_it_started(marker):
    """Without namespaces (a host that forbids them) the launcher, a child subreaper, kills every descendant."""
    code = _children(marker, 3, setsid=True, then="")
    result = sandbox.run(code, SandboxLimits(timeout_s=10.0, namespaces=False))
    assert result.stdout == b"3\n" and result.isolation.startswith("fallback: namespaces switched off")
    stop, most = _watch(marker)
    try:
        result = sandbox.run(_children(marker, 2, setsid=True, then="time.sleep(60)"),
                             SandboxLimits(timeout_s=2.0, namespaces=False))
    finally:
        stop.set()
    assert result.timed_out and most[0] >= 3


def test_a_box_dies_with_a_worker_cut_off_by_a_shorter_call_limit(marker):
    """A call given less time than the tool's own limit (the end of a step's tool budget) kills the tool worker;
    the box, started by it, goes too."""
    runner = ToolRunner(["python"], timeout_s=30.0)
    stop, most = _watch(marker)
    try:
        answer = runner.call("python", _children(marker, 2, setsid=True, then="time.sleep(60)"), timeout_s=1.5)
    finally:
        stop.set()
        runner.close()
    assert answer == (False, "error: python timed out after 1.5 s", True) and most[0] >= 3


def test_where_namespaces_are_not_permitted_the_box_degrades_and_the_run_says_so():
    """Inside a user namespace that may hold no further ones (util-linux's unshare), the tool still answers."""
    script = ("import logging; logging.basicConfig(level=logging.INFO)\n"
              "from verl_mega.rollout.tools import ToolRunner\n"
              "runner = ToolRunner(['python'], timeout_s=10.0)\n"
              "print(runner.call('python', 'print(6 * 7)'))\n"
              "runner.close()\n")
    done = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c",
                           f"echo 0 > /proc/sys/user/max_user_namespaces && exec {sys.executable} -c \"$0\"", script],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert "python tool sandbox degraded (fallback: namespaces not permitted here" in done.stderr
    assert done.stdout.strip() == "Answer(ok=True, text='42\\n', failed=False)"
