"""Checks that run before anything heavy is built, each failing with one line that names the problem and the fix,
and the wording of errors the operating system raises while a run writes its outputs."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

_PROBE_BYTES = 1 << 20  # a full disk fails on a write of this size even when a few blocks are left


def probe_output_dir(output_dir: str) -> None:
    """trainer.output_dir can be created and written: a 1 MiB probe, in the directory or, while it does not exist
    yet, in a fresh directory beside where it would be made; every rank probes in its own unique files, and the
    probe leaves nothing behind."""
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"trainer.output_dir={output_dir!r} is a file, not a directory; point trainer.output_dir at "
                         f"a directory (it is created if missing)")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"trainer.output_dir={output_dir!r}: {parent} is a file, not a directory; choose another "
                         f"trainer.output_dir")
    scratch = None
    try:
        if parent != path:  # making the missing directories is what the run will do: try it, privately
            scratch = Path(tempfile.mkdtemp(dir=parent, prefix=".write-probe-"))
        with tempfile.NamedTemporaryFile(dir=scratch or path, prefix=".write-probe-") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise ValueError(f"trainer.output_dir={output_dir!r} is not writable: {describe_os_error(exc)}; free space "
                         f"there or choose another trainer.output_dir") from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def describe_os_error(exc: OSError) -> str:
    """What went wrong, in one line, for an OSError raised while writing outputs; a full disk is named as such."""
    where = f" writing {exc.filename}" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device{where}"
    if exc.errno == errno.EDQUOT:
        return f"disk quota exceeded{where}"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"permission denied{where} ({exc.strerror})"
    return f"{exc.strerror or type(exc).__name__}{where}"
