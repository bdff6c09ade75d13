"""Rank discovery from each launcher's environment variables (values as the launchers document them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mega.parallel.launch_env import DistEnv, LaunchEnvError, discover, first_slurm_host

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
