"""Runs made once per test session and read by every test that needs them, whichever pytest-xdist worker asks first.

``shared_dir(factory, key, make)`` returns a directory that ``make(directory)`` filled. The first process to ask
makes it, under a file lock; the others wait for the lock (giving back their CPU slots while they wait, see
tests/slots.py) and reuse the result. A ``make`` that failed fails every test that asks, with the first error.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import traceback
from pathlib import Path
from typing import Callable

import slots


def session_root(factory) -> Path:
    """A directory shared by every worker of this test session (pytest's base temp directory; under xdist each
    worker has one of its own below it)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_dir(factory, key: str, make: Callable[[Path], None]) -> Path:
    root = session_root(factory) / "shared"
    root.mkdir(exist_ok=True)
    target, done, failed = root / key, root / f"{key}.done", root / f"{key}.failed"
    fd = os.open(root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with slots.idle():
            fcntl.flock(fd, fcntl.LOCK_EX)
        if failed.exists():
            raise RuntimeError(f"shared run {key!r} failed in another test:\n{failed.read_text()[-6000:]}")
        if not done.exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            try:
                make(target)
            except BaseException:
                failed.write_text(traceback.format_exc())
                raise
            done.touch()
        return target
    finally:
        os.close(fd)
