"""Which commands the test launcher (tests/prefork.py) forks, and which it leaves to a subprocess."""

import sys

import pytest

import prefork


@pytest.mark.parametrize("cmd,nproc", [
    (["-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=1234", "-m", "verl_mega.train"], 2),
    (["-m", "verl_mega.train", "--config", "x.yaml"], 1),
    (["script.py", "--nproc-per-node", "4"], 1),
])
def test_commands_the_server_runs(cmd, nproc):
    parsed = prefork.parse([sys.executable, *cmd])
    assert parsed is not None and parsed.nproc == nproc
    assert prefork.parse(["bash", "launch/mpirun.sh", "-np", "2"]) is None
    assert prefork.ranks_of(["bash", "launch/mpirun.sh", "-np", "2", "--"]) == 2
    assert prefork.parse([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "x.py"]) is None
    # a server per import-time environment; our own variables and PYTHONPATH are applied per job
    assert prefork.import_key({"OMP_NUM_THREADS": "2", "VERL_MEGA_X": "1", "PYTHONPATH": "/x", "PYTHONWARNINGS": "i"}) \
        == (("OMP_NUM_THREADS", "2"), ("PYTHONWARNINGS", "i"))
