"""The output directory of a run: one job at a time, and one run's records in it.

* **One job at a time.** Rank 0 holds an exclusive ``flock`` on ``<output_dir>/.lock`` from before anything is built
  until the job ends, and removes the file when it ends; a second job in the same directory is refused with the
  holder's pid and host. The kernel drops the lock when the process dies, so a killed job holds none (its file stays
  until the next job's end); processes it forked (a background checkpoint writer) do not hold it.
* **One run's records.** A run that starts fresh (``trainer.resume=off``, or ``auto`` with no checkpoint to resume)
  in a directory that holds an earlier run's records first moves them into ``<output_dir>/earlier_runs/<time>/``:
  its checkpoints would otherwise outrank the new ones (pruning and ``resume=auto`` keep the highest step numbers)
  and its metrics would mix with the new run's. Nothing is deleted.
* **One timeline.** A run that resumes from step K while newer ``step_N`` (N > K) are there (a rollback with
  ``trainer.resume=PATH``, or ``auto`` falling back past a broken newest checkpoint) moves those into
  ``<output_dir>/earlier_runs/<time>/checkpoints/`` the same way: pruning and ``resume=auto`` would keep them, the
  abandoned run's, over the resumed run's own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from verl_mega.checkpoint.integrity import RESUMED_FILE, step_number
from verl_mega.trainer.failures import ATTEMPTS_DIR

log = logging.getLogger("verl_mega.checkpoint")

__all__ = ["LOCK_FILE", "EARLIER_RUNS", "RUN_RECORDS", "lock_output_dir", "set_aside_earlier_run",
           "set_aside_later_checkpoints"]

LOCK_FILE = ".lock"
# flock belongs to the open file, which a forked child shares (mcore's background checkpoint writer is one): a child
# that outlived a killed trainer would hold the directory. Forked children close their copy at once.
_HELD: set[int] = set()


def _close_held_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)
EARLIER_RUNS = "earlier_runs"
# everything a run writes into its output_dir (metrics.METRICS_FILE, TENSORBOARD_DIR, CURVES_FILE, SUMMARY_FILE)
RUN_RECORDS = ("checkpoints", "metrics.jsonl", "tensorboard", "curves.png", "summary.txt", "placement.json",
               RESUMED_FILE)


def lock_output_dir(output_dir: str, resources: contextlib.ExitStack) -> None:
    """Take the directory's lock for the life of `resources` (rank 0 only). The lock file goes with the lock, and a
    directory made here that holds nothing else then is removed too, so a job refused later leaves nothing behind."""
    path = Path(output_dir)
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    lock = path / LOCK_FILE
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(f"trainer.output_dir={output_dir!r}: cannot lock {lock} ({exc.strerror}); use a "
                                 f"directory on a file system with file locks") from None
            raise ValueError(f"trainer.output_dir={output_dir!r} is in use by another job ({holder}); wait for it "
                             f"to end or choose another trainer.output_dir") from None
        try:  # the holder before us may have removed the file between our open and our lock: lock the new one
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _HELD.add(fd)

    def release() -> None:
        lock.unlink(missing_ok=True)  # while holding it (see above)
        _HELD.discard(fd)
        os.close(fd)
        # this job's own attempt records (trainer/failures.py) are all a refused job leaves in a directory it made
        if made and {p.name for p in path.iterdir()} <= {ATTEMPTS_DIR}:
            with contextlib.suppress(OSError):
                shutil.rmtree(path / ATTEMPTS_DIR, ignore_errors=True)
                path.rmdir()

    resources.callback(release)


def set_aside_earlier_run(output_dir: str) -> Path | None:
    """Move an earlier run's records out of the way of a fresh run (rank 0, under the lock); returns where they went,
    or None when there were none."""
    root = Path(output_dir)
    found = [root / name for name in RUN_RECORDS if (root / name).exists()]
    if not found:
        return None
    dest = _new_earlier_run(root)
    for item in found:
        os.replace(item, dest / item.name)
    steps = sorted(p.name for p in (dest / "checkpoints").glob("step_*")) if (dest / "checkpoints").is_dir() else []
    held = ", ".join(([f"checkpoints {steps[0]}..{steps[-1]}"] if steps else [])
                     + [p.name for p in found if p.name != "checkpoints"])
    log.warning("trainer.output_dir=%s held an earlier run (%s); this run starts fresh, so it was moved to %s",
                output_dir, held or "an empty checkpoints/", dest)
    return dest


def set_aside_later_checkpoints(output_dir: str, step: int) -> Path | None:
    """Move the checkpoints past `step`, the one this run resumed from, out of its way (rank 0, under the lock): an
    abandoned timeline's (a rollback) or a broken one that resume=auto passed over. Returns where they went, or None
    when there were none."""
    root = Path(output_dir) / "checkpoints"
    later = sorted(p for p in root.glob("step_*") if step_number(p) > step) if root.is_dir() else []
    if not later:
        return None
    dest = _new_earlier_run(Path(output_dir)) / "checkpoints"
    dest.mkdir()
    for path in later:
        os.replace(path, dest / path.name)
    latest = root / "latest"
    if latest.exists() and not (root / latest.read_text().strip()).exists():  # it named a checkpoint moved away
        from verl_mega.checkpoint.manager import write_latest

        resumed = root / f"step_{step:06d}"
        if resumed.is_dir():
            write_latest(root, resumed.name)
        else:  # resumed from another directory: this one has no checkpoint of the run yet
            latest.unlink()
    log.warning("resumed from step %d, but checkpoints/ held later ones (%s..%s) of an abandoned or broken run: "
                "moved to %s, so that pruning and trainer.resume=auto see this run's own", step, later[0].name,
                later[-1].name, dest)
    return dest.parent


def _new_earlier_run(root: Path) -> Path:
    """A new, empty ``<root>/earlier_runs/<time>/``."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    dest = root / EARLIER_RUNS / stamp
    n = 1
    while dest.exists():
        n += 1
        dest = root / EARLIER_RUNS / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    return dest
