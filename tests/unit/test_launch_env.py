"""Rank discovery from each launcher's environment variables (values as the launchers document them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mega.parallel import launch_env
from verl_mega.parallel.launch_env import DistEnv, LaunchEnvError, discover, first_slurm_host, local_address

REPO = Path(__file__).resolve().parents[2]

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job"}


def test_torchrun():
    env = discover(TORCHRUN)
    assert env == DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1,
                          master_addr="10.0.0.1", master_port=29400, launcher="torchrun")
    assert env.num_nodes == 2


def test_open_mpi_with_master_addr():
    env = discover({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PMIX_RANK": "6", "MASTER_ADDR": "node0",
                    "MASTER_PORT": "1234", "SLURM_PROCID": "0"})  # Open MPI wins over the enclosing Slurm job
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (6, 8, 2, 4, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("node0", 1234, "mpirun")


def test_slurm_srun():
    env = discover({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
                    "SLURM_NTASKS_PER_NODE": "4", "SLURM_JOB_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "12345",
                    "PMIX_RANK": "5"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 4, 1)
    assert (env.master_addr, env.master_port, env.launcher) == ("gpu003", 20000 + 12345 % 20000, "slurm")
    env = discover({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                    "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_NODELIST": "a1,a2", "MASTER_PORT": "5000"})
    assert (env.node_rank, env.local_world_size, env.master_addr, env.master_port) == (1, 2, "a1", 5000)


def test_mpich_pmi():
    env = discover({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
                    "MASTER_ADDR": "h", "MASTER_PORT": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.node_rank, env.launcher) == (3, 4, 1, 1, "pmi")


def test_mpi_launcher_inside_slurm_wins_over_the_inherited_slurm_variables():
    """mpiexec (Hydra: MPICH, Intel MPI) in a batch script starts its ranks through one srun-launched proxy per node,
    so every rank inherits that proxy's SLURM_PROCID/SLURM_LOCALID; its PMI variables are the real ones."""
    proxy = {"SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
             "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_JOB_NODELIST": "n[1-2]",
             "MASTER_ADDR": "h", "MASTER_PORT": "2"}
    env = discover({**proxy, "PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "4"})
    assert (env.rank, env.world_size, env.local_rank, env.node_rank, env.launcher) == (5, 8, 1, 1, "pmi")
    env = discover({**proxy, "PMI_RANK": "4", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "0", "PMI_LOCAL_SIZE": "4"})
    assert (env.rank, env.local_rank, env.node_rank, env.launcher) == (4, 0, 1, "pmi")
    # srun --mpi=pmi2 starting the ranks itself: both describe the same world, and Slurm's needs no mpi4py
    env = discover({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "8",
                    "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "3",
                    "PMI_RANK": "5", "PMI_SIZE": "8"})
    assert (env.rank, env.node_rank, env.master_addr, env.launcher) == (5, 1, "n1", "slurm")


def test_slurm_step_tasks_per_node_wins_over_the_jobs():
    """`srun -N2 -n8` inside a --ntasks-per-node=8 job: the step runs 4 per node, the job's 8 is inherited."""
    env = discover({"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "16",
                    "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_TASKS_PER_NODE": "8(x2)",
                    "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 4, 1)


def test_torchelastic_ignores_an_inherited_node_rank():
    """launch/torchrun.sh reads an exported NODE_RANK, its workers inherit it, and the c10d rendezvous may number
    this node differently (GROUP_RANK): torchelastic's numbering is the one that holds."""
    env = discover({**TORCHRUN, "NODE_RANK": "0"})
    assert env.node_rank == 1 and env.as_env()["NODE_RANK"] == "1"
    manual = {k: v for k, v in TORCHRUN.items() if k not in ("GROUP_RANK", "TORCHELASTIC_RUN_ID")}
    with pytest.raises(LaunchEnvError, match="NODE_RANK=0 contradicts"):  # without torchelastic it is the user's
        discover({**manual, "NODE_RANK": "0"})


IFACES = {"lo": "127.0.0.1", "docker0": "172.17.0.1", "eth0": "10.0.0.5", "ib0": None}  # ib0: no IPv4


@pytest.fixture
def fake_interfaces(monkeypatch):
    monkeypatch.setattr(launch_env.socket, "if_nameindex", lambda: list(enumerate(IFACES, 1)))
    monkeypatch.setattr(launch_env, "_iface_ipv4", IFACES.get)
    monkeypatch.setattr(launch_env.socket, "gethostname", lambda: "box")
    monkeypatch.setattr(launch_env.socket, "gethostbyname", lambda host: "127.0.1.1")  # Debian's /etc/hosts


@pytest.mark.parametrize("env,want", [
    ({"NCCL_SOCKET_IFNAME": "^lo"}, "172.17.0.1"),  # ^ excludes
    ({"NCCL_SOCKET_IFNAME": "^docker0,lo"}, "10.0.0.5"),
    ({"NCCL_SOCKET_IFNAME": "^=docker,lo"}, "172.17.0.1"),  # ^= excludes whole names only
    ({"NCCL_SOCKET_IFNAME": "eth"}, "10.0.0.5"),  # names match by prefix, as NCCL's do
    ({"NCCL_SOCKET_IFNAME": "ib,eth"}, "10.0.0.5"),  # interfaces without an IPv4 address are passed over
    ({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "docker0"}, "10.0.0.5"),  # gloo's own wins
    ({}, "172.17.0.1"),  # hostname resolves to loopback: the first other interface
])
def test_socket_ifname_selects_the_address(fake_interfaces, env, want):
    assert local_address(env, multi_node=True) == want


@pytest.mark.parametrize("env,needle,one_node", [
    ({"NCCL_SOCKET_IFNAME": "=eth"}, "NCCL_SOCKET_IFNAME='=eth' selects no interface", None),
    ({"GLOO_SOCKET_IFNAME": "eth"}, "GLOO_SOCKET_IFNAME='eth' selects no interface", None),  # gloo: whole names
    ({"NCCL_SOCKET_IFNAME": "lo"}, "selects no interface with a non-loopback IPv4", "127.0.0.1"),
])
def test_socket_ifname_never_gives_a_multi_node_job_loopback(fake_interfaces, env, needle, one_node):
    with pytest.raises(LaunchEnvError) as exc:
        local_address(env, multi_node=True)
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    if one_node:  # on one node loopback is fine
        assert local_address(env) == one_node


def test_no_address_but_loopback_is_an_error_for_several_nodes(monkeypatch):
    monkeypatch.setattr(launch_env.socket, "if_nameindex", lambda: [(1, "lo")])
    monkeypatch.setattr(launch_env, "_iface_ipv4", {"lo": "127.0.0.1"}.get)
    monkeypatch.setattr(launch_env.socket, "gethostname", lambda: "box")
    monkeypatch.setattr(launch_env.socket, "gethostbyname", lambda host: "127.0.1.1")
    assert local_address({}) == "box"
    with pytest.raises(LaunchEnvError, match="box has no non-loopback IPv4 address"):
        local_address({}, multi_node=True)


def test_single_process_default():
    env = discover({})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (0, 1, 0, 1, 0)
    assert env.launcher == "single" and env.master_addr == "127.0.0.1"


def test_export_round_trips():
    env = discover({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "4242"})
    target: dict[str, str] = {}
    env.export_to_os_environ(target)
    assert target["RANK"] == "3" and target["LOCAL_RANK"] == "1" and target["GROUP_RANK"] == "1"
    assert discover(target) == env  # the exported variables describe the same process, launcher included


@pytest.mark.parametrize("env,needle", [
    ({**TORCHRUN, "RANK": "9"}, "rank 9 is outside [0, 8)"),
    ({**TORCHRUN, "LOCAL_RANK": "2"}, "LOCAL_RANK=2 contradicts RANK=5 % LOCAL_WORLD_SIZE=4 = 1"),
    ({**TORCHRUN, "GROUP_RANK": "0"}, "GROUP_RANK=0 contradicts"),
    ({**TORCHRUN, "WORLD_SIZE": "6", "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0"},
     "world size 6 is not a multiple of the local world size 4"),
    ({k: v for k, v in TORCHRUN.items() if k != "LOCAL_WORLD_SIZE"}, "LOCAL_WORLD_SIZE is not set"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT='http' is not an integer"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR or MASTER_PORT is not"),
    ({**TORCHRUN, "WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "4,3",
      "SLURM_JOB_NODELIST": "n1"}, "nodes run different numbers of tasks"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4",
      "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n1"}, "--distribution=block"),
    # mpirun --map-by node: ranks 0 and 1 would both be node 0's local rank 0
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "2"},
     "OMPI_COMM_WORLD_LOCAL_RANK=0 contradicts OMPI_COMM_WORLD_RANK=1 % OMPI_COMM_WORLD_LOCAL_SIZE=2 = 1: ranks "
     "must be numbered node by node (mpirun --map-by ppr:N:node"),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "2"}, "local rank 2 is outside [0, 2)"),
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "2"}, "MPI_LOCALRANKID=0 contradicts PMI_RANK=1 % MPI_LOCALNRANKS=2 = 1: ranks must be numbered "
                           "node by node (mpiexec -ppn N"),
])
def test_inconsistent_env_is_one_clear_line(env, needle):
    with pytest.raises(LaunchEnvError) as exc:
        discover(env)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_missing_mpi4py_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now raises ImportError
    with pytest.raises(LaunchEnvError, match="pip install mpi4py"):
        discover({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                  "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


def test_first_slurm_host():
    assert first_slurm_host("gpu[003-010,020],cpu1") == "gpu003"
    assert first_slurm_host("node7") == "node7"
    assert first_slurm_host("a-b[1,2]") == "a-b1"


def _run_shim(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "OMPI_", "PMI", "SLURM_", "GROUP_RANK"))}
    return subprocess.run([sys.executable, "-m", "verl_mega.parallel.launch_env", *args], capture_output=True,
                          text=True, timeout=60, env={**clean, "PYTHONPATH": str(REPO), **env})


def test_shim_exports_and_execs():
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2",
             "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_ID": "7"}
    r = _run_shim(["--print"], slurm)
    assert r.returncode == 0 and json.loads(r.stdout)["node_rank"] == 1
    code = "import os; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], " \
           "os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'])"
    r = _run_shim(["--", "-c", code], slurm)
    assert r.returncode == 0 and r.stdout.split() == ["3", "4", "1", "n1", "20007"]
    r = _run_shim(["--", "-c", "pass"], {"RANK": "1", "WORLD_SIZE": "1"})
    assert r.returncode == 2 and "launch_env: error: rank 1" not in r.stderr and "LOCAL_RANK is not set" in r.stderr


def test_launch_scripts_parse_and_explain_themselves():
    for script in ("torchrun.sh", "mpirun.sh", "slurm_example.sbatch"):
        r = subprocess.run(["bash", "-n", str(REPO / "launch" / script)], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
    for script in ("torchrun.sh", "mpirun.sh"):
        r = subprocess.run(["bash", str(REPO / "launch" / script), "--help"], capture_output=True, text=True,
                           timeout=30)
        assert r.returncode == 0 and "PYTHON_ARGS" in r.stdout and "set -e" not in r.stdout
    r = subprocess.run(["bash", str(REPO / "launch" / "mpirun.sh"), "--", "-c", "pass"], capture_output=True,
                       text=True, timeout=30, env={**os.environ, "MPIRUN": "no-such-mpirun"})
    assert r.returncode == 2 and "'no-such-mpirun' not found" in r.stderr


def test_single_node_mpirun_needs_no_remote_shell(tmp_path):
    """Open MPI 4.x refuses to start without ssh/rsh unless told otherwise; one node never needs them (checked by
    hand with Open MPI 4.1.4 and 5.0.11 on a machine without ssh). Here: the arguments mpirun.sh passes."""
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)

    def args(*extra: str, **env: str) -> list[str]:
        r = subprocess.run(["bash", str(REPO / "launch" / "mpirun.sh"), "-np", "2", *extra, "--", "-c", "pass"],
                           capture_output=True, text=True, timeout=30,
                           env={**os.environ, "MPIRUN": str(fake), **env})
        assert r.returncode == 0, r.stderr
        return r.stdout.split("\n")

    single = args()
    i = single.index("plm_rsh_agent")
    assert single[i - 1:i + 2] == ["--mca", "plm_rsh_agent", "false"]
    assert "plm_rsh_agent" not in args("--hosts", "a:1,b:1")  # several hosts: mpirun's own ssh launch
    assert "false" not in args(OMPI_MCA_plm_rsh_agent="rsh")  # the user's choice wins
    assert args(MPIRUN_EXTRA_ARGS="--mca plm_rsh_agent /usr/bin/ssh").count("plm_rsh_agent") == 1


def test_mpirun_sh_spreads_ranks_over_the_hosts_given(tmp_path):
    """Without --nproc-per-node the ranks split evenly over --hosts or the hostfile's hosts (every rank used to land
    on the first host of a hostfile), and no host gets more ranks than its slots unless --oversubscribe."""
    fake = tmp_path / "mpirun"
    fake.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    fake.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts\nnodea slots=2\n\nnodeb slots=2  # the second\n")

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(REPO / "launch" / "mpirun.sh"), *extra, "--max-restarts", "0", "--", "-c",
                               "pass"], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "MPIRUN": str(fake)})

    def arg(r: subprocess.CompletedProcess, name: str) -> str:
        assert r.returncode == 0, r.stderr
        out = r.stdout.split("\n")
        return out[out.index(name) + 1]

    assert arg(run("-np", "4", "--hostfile", str(hostfile)), "--map-by") == "ppr:2:node"
    assert arg(run("-np", "4", "--hosts", "nodea,nodeb"), "--host") == "nodea:2,nodeb:2"  # bare: 1 slot to Open MPI
    assert arg(run("-np", "4", "--hosts", "nodea:4,nodeb"), "--host") == "nodea:4,nodeb:2"
    assert arg(run("-np", "4"), "--map-by") == "ppr:4:node"
    assert arg(run("-np", "4", "--oversubscribe"), "--map-by") == "ppr:4:node:OVERSUBSCRIBE"
    r = run("-np", "3", "--hostfile", str(hostfile))
    assert r.returncode == 2 and "-np 3 does not split evenly over the 2 hosts given: give --nproc-per-node" in r.stderr
    r = run("-np", "4", "--hostfile", str(tmp_path / "missing"))
    assert r.returncode == 2 and "cannot be read" in r.stderr


def test_each_restart_gets_store_keys_of_its_own(monkeypatch):
    """torchrun's agent keeps its store across worker-group restarts: the job's keys carry the attempt, so a
    restarted group never reads the dead attempt's gloo addresses (its restart then failed: connectFullMesh)."""
    for var in launch_env.RESTART_COUNTERS.values():
        monkeypatch.delenv(var, raising=False)
    assert launch_env.attempt_key() == "attempt"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = launch_env.attempt_key()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert launch_env.attempt_key() != first
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert launch_env.attempt_key() == "attempt-slurm2-torchrun1"
