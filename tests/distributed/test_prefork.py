"""The test launcher (tests/prefork.py) against the real thing: a rank forked by the fork server sees what a fresh
interpreter sees, and its exit status, signals and torchrun's failure handling keep their meaning."""

import json
import os
import signal
import sys
from pathlib import Path

from torchrun_util import run_in_session, start

import prefork

PROBE = '''
import json, os, signal, sys, warnings
import prefork
for name in prefork.PRELOAD:
    try:
        __import__(name)
    except Exception:
        pass
state = {
    "argv": sys.argv, "path": sys.path[:3], "cwd": os.getcwd(), "main": __name__,
    "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "PROBE_VAR", "PYTHONWARNINGS")},
    "filters": [[f[0], getattr(f[1], "pattern", f[1]), f[2].__name__, getattr(f[3], "pattern", f[3])]
                for f in warnings.filters],
    "signals": {s.name: str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE,
                                                         signal.SIGCHLD)},
    "stdin": sys.stdin.read(),
}
print("PROBE " + json.dumps(state))
'''


def _probe(tmp_path: Path, name: str, real: bool) -> dict:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "PROBE_VAR": "x", "PYTHONWARNINGS": "ignore::DeprecationWarning",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(prefork.__file__).parent),
                                                       os.environ.get("PYTHONPATH")]))}
    log = tmp_path / f"{name}.log"
    rc = run_in_session([sys.executable, str(script), "a", "b"], env=env, log=log, timeout=300, cwd=tmp_path,
                        real=real)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    return json.loads(next(line[6:] for line in text.splitlines() if line.startswith("PROBE ")))


def test_a_forked_rank_sees_what_a_fresh_interpreter_sees(tmp_path):
    fresh, forked = _probe(tmp_path, "fresh", real=True), _probe(tmp_path, "forked", real=False)
    assert forked == fresh
    assert fresh["argv"][1:] == ["a", "b"] and fresh["env"]["PROBE_VAR"] == "x" and fresh["main"] == "__main__"


def test_exit_status_signals_and_torchrun_failures(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\n"
                      "rank = int(os.environ.get('RANK', '0'))\n"
                      "if sys.argv[1] == 'exit': sys.exit(int(sys.argv[2]))\n"
                      "if sys.argv[1] == 'raise': raise ValueError('on purpose')\n"
                      "if sys.argv[1] == 'kill' and rank == 1: os.kill(os.getpid(), 9)\n"
                      "time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 300)\n")
    env = dict(os.environ)
    log = tmp_path / "log"

    def run(*args: str, torchrun: int = 0) -> int:
        launcher = [sys.executable] if not torchrun else [sys.executable, "-m", "torch.distributed.run",
                                                          f"--nproc-per-node={torchrun}"]
        return run_in_session([*launcher, str(script), *args], env=env, log=log, timeout=120)

    assert run("exit", "3") == 3
    assert run("raise") == 1 and "ValueError: on purpose" in log.read_text()
    assert run("exit", "0", torchrun=2) == 0
    # one rank killed: torchrun stops the other (which would sleep 300 s) and exits 1
    assert run("kill", torchrun=2) == 1 and "exitcode -9" in log.read_text()
    job = start([sys.executable, str(script), "sleep"], env=env, log=log)
    try:
        assert job.poll() is None and len(job.ranks) == 1
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=60) == -signal.SIGTERM
    finally:
        job.kill_session()
