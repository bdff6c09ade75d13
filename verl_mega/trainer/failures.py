"""Why the job restarted: ``<output_dir>/failures.jsonl``, one line per restart after a failure.

The launchers restart a failed job as a whole (torchrun ``--max-restarts``, Slurm's requeue, ``launch/ray_launch.py``
and ``launch/mpirun.sh`` with ``--max-restarts``), and ``trainer.resume=auto`` continues it from its newest complete
checkpoint. What the launcher knows of the failure (an exit code, a signal) stays in its own log; this module keeps
the cause next to the run:

- Each rank keeps a record of its attempt, ``<output_dir>/.attempts/rank_<r>.json``: ``running`` from the moment
  every rank of the job has joined, then how it ended (``ok``, or the error it stopped with). A rank that was
  SIGKILLed, killed by the OOM killer, crashed in native code or lost with its node never writes its end.
- When a job starts, each rank moves its predecessor's record aside (``.attempts/previous/``) before writing its
  own; once every rank has done so, rank 0 reads them. If any did not end ``ok`` the job is a restart after a
  failure, and rank 0 appends one line: when, the launcher and its restart counters, the step the job resumes
  from, a one-line ``cause`` (ranks that ended without a word first: the others usually failed because of them),
  and each failed rank's record.

Records belong to the directory, not to one run: a fresh run's set-aside of an earlier run's records
(``trainer/run_dir.py``) leaves ``failures.jsonl`` in place, so restarts before the first checkpoint are kept too.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from verl_mega.parallel.launch_env import restart_counters

FAILURES_FILE = "failures.jsonl"
ATTEMPTS_DIR = ".attempts"
RUNNING = "running"
OK = "ok"
SILENT = ("ended without a word: killed (SIGKILL, the OOM killer), crashed in native code, or its node was "
          "lost")

__all__ = ["FAILURES_FILE", "ATTEMPTS_DIR", "start_attempt", "end_attempt", "record_restart", "restart_counters"]

_record: Path | None = None  # this process's attempt record, once written


def _write(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)  # a reader never sees half a record


def start_attempt(output_dir: str | os.PathLike, rank: int) -> None:
    """Move this rank's predecessor's record aside and write this attempt's (``running``). Call on every rank of
    the job once all have joined (the rendezvous), so no rank of another job in the directory interleaves."""
    global _record
    attempts = Path(output_dir) / ATTEMPTS_DIR
    (attempts / "previous").mkdir(parents=True, exist_ok=True)
    path = attempts / f"rank_{rank:05d}.json"
    if path.exists():
        os.replace(path, attempts / "previous" / path.name)
    _write(path, {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                  "end": RUNNING, "restarts": restart_counters()})
    _record = path


def end_attempt(end: str) -> None:
    """Record how this process's attempt ended (``ok`` or a one-line error); nothing before :func:`start_attempt`."""
    global _record
    if _record is None:
        return
    with contextlib.suppress(OSError, ValueError):  # a full or vanished disk must not mask the job's own error
        record = json.loads(_record.read_text())
        record.update(end=" ".join(end.split())[:1000], ended=time.time())
        _write(_record, record)
    _record = None


def record_restart(output_dir: str | os.PathLike, *, world_size: int, resume_step: int,
                   launcher: str = "") -> dict[str, Any] | None:
    """Rank 0, after every rank's :func:`start_attempt`: read the previous attempt's records and, when any did not
    end ``ok``, append its line to failures.jsonl (returned). Records of ranks beyond this job's world (a job
    restarted smaller) are read too."""
    attempts = Path(output_dir) / ATTEMPTS_DIR
    previous = attempts / "previous"
    records = []
    stale = [p for p in attempts.glob("rank_*.json") if int(p.stem.split("_")[1]) >= world_size]
    for path in sorted(previous.glob("rank_*.json")) + sorted(stale):
        with contextlib.suppress(OSError, ValueError):
            records.append(json.loads(path.read_text()))
        path.unlink(missing_ok=True)
    failed = [r for r in records if r.get("end") != OK]
    if not failed:
        return None
    silent = [r for r in failed if r.get("end") == RUNNING]
    raised = [r for r in failed if r.get("end") != RUNNING]
    cause = "; ".join([f"rank {r['rank']} (pid {r['pid']} on {r['host']}) {SILENT}" for r in silent]
                      + [f"rank {r['rank']} (pid {r['pid']} on {r['host']}): {r['end']}" for r in raised])
    line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "launcher": launcher, "restarts": restart_counters(),
            "resumed_from_step": resume_step, "cause": cause,
            "ranks": [{k: r.get(k) for k in ("rank", "host", "pid", "started", "ended", "end")} for r in failed]}
    with open(Path(output_dir) / FAILURES_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return line
