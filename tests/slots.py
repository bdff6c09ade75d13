"""CPU slots shared by every test process on this box, so that tests run side by side (pytest-xdist) without
oversubscribing the cores.

There is one slot per core, plus one (``VERL_MEGA_TEST_SLOTS`` overrides): the ranks of a job wait on each other
part of the time (a 2-rank job keeps 1.3 of 2 cores busy, measured on the 2-core box), so a single-process job fits
beside it, while two multi-rank jobs never run at once. A running test holds one slot for its own process (a test
marked ``alone`` holds them all, so nothing runs beside it); a job it starts needs a slot per rank, up to one per
core (a 4-rank job on 2 cores takes 2), for as long as it runs. A process that must wait for slots gives back the
slots it holds for itself while it waits (its own process is idle then), so two tests never wait on each other.
Slots are ``flock`` locks on files: a process that dies gives its slots back with it. Waiting processes queue,
first come first served.

A test that starts several jobs at once reserves their slots first (``with slots.reserve(n)``); needing more slots
while a job runs is refused, since waiting then could deadlock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

CORES = os.cpu_count() or 1
CAPACITY = int(os.environ.get("VERL_MEGA_TEST_SLOTS", CORES + 1))
DIR = Path(tempfile.gettempdir()) / f"verl_mega-test-slots-{os.getuid()}"


class _Ledger:
    """This process's slots: ``base`` for the test itself, ``reserved`` for a group of jobs, ``jobs`` in use."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._fds: list[int] = []
        self.base = self.reserved = self.jobs = 0

    @property
    def held(self) -> int:
        return len(self._fds)

    def _want(self) -> int:
        return min(CAPACITY, max(self.base, self.reserved, self.jobs))

    def _release(self, keep: int) -> None:
        while self.held > keep:
            fd = self._fds.pop()
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def set(self, *, running: int = 0, **values: int) -> None:
        """Change the wants and hold exactly what they add up to: give back extra slots, or wait for the missing
        ones holding none (``running``: slots of jobs already running, which cannot wait, so that is refused)."""
        with self._lock:
            before = {key: getattr(self, key) for key in values}
            for key, value in values.items():
                setattr(self, key, value)
            want = self._want()
            if self.held >= want:
                self._release(want)
                return
            if running:
                for key, value in before.items():
                    setattr(self, key, value)
                raise RuntimeError("slots: more slots needed while a job runs; reserve them first (slots.reserve)")
            self._release(0)
            self._fds += _acquire(want)


LEDGER = _Ledger()


def _acquire(n: int) -> list[int]:
    """``n`` free slots, taken together. Waiters queue: only the first in line (the holder of the ``queue`` lock)
    may take slots, so a test that needs many (``alone``) is not starved by tests that keep taking one."""
    DIR.mkdir(exist_ok=True)
    queue_fd = os.open(DIR / "queue", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(queue_fd, fcntl.LOCK_EX)
        while True:
            taken = []
            for i in range(CAPACITY):
                fd = os.open(DIR / f"slot{i}", os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                taken.append(fd)
                if len(taken) == n:
                    return taken
            for fd in taken:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
            time.sleep(0.05)
    finally:
        os.close(queue_fd)  # releases the queue lock


@contextlib.contextmanager
def test_slots(alone: bool) -> Iterator[None]:
    """Around one test (setup, call and teardown): its own slot, or every slot."""
    LEDGER.set(base=CAPACITY if alone else 1, reserved=0, jobs=0)
    try:
        yield
    finally:
        LEDGER.set(base=0, reserved=0, jobs=0)


@contextlib.contextmanager
def reserve(n: int) -> Iterator[None]:
    """Slots for several jobs this test runs at once."""
    with LEDGER._lock:
        before = LEDGER.reserved
        LEDGER.set(reserved=max(before, n))
    try:
        yield
    finally:
        LEDGER.set(reserved=before)


def job_started(nproc: int) -> int:
    """Take the slots of a job of ``nproc`` ranks, one per rank up to one per core (waits for them); returns what
    :func:`job_ended` gives back."""
    n = min(CORES, nproc)
    with LEDGER._lock:
        LEDGER.set(running=LEDGER.jobs, jobs=LEDGER.jobs + n)
    return n


def job_ended(n: int) -> None:
    with LEDGER._lock:
        LEDGER.set(jobs=max(0, LEDGER.jobs - n))


@contextlib.contextmanager
def idle() -> Iterator[None]:
    """While this process only waits on another one (a shared run being made elsewhere): its own slots go back."""
    with LEDGER._lock:
        saved = (LEDGER.base, LEDGER.reserved)
        if LEDGER.jobs:
            raise RuntimeError("slots.idle: a job of this process is running")
        LEDGER.set(base=0, reserved=0)
    try:
        yield
    finally:
        LEDGER.set(base=saved[0], reserved=saved[1])
