"""The output directory of a converter, written atomically: built in a hidden sibling, renamed into place on success.

A failure, Ctrl-C or SIGTERM leaves nothing behind (no temporary directory, no parent directory it created); a
temporary directory whose process was killed outright (SIGKILL, a lost host) is removed by the next conversion to the
same output. Its name says which process owns it: ``.<name>.tmp-<host>-<pid>``.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from verl_mega.checkpoint.safe_load import disk_full_error
from verl_mega.models.hf_io import CheckpointError


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class AtomicDir:
    """``with AtomicDir(final) as tmp:`` write into ``tmp``; on success it becomes ``final`` (mode 0777 less the
    umask, like any new directory). Bad output paths are refused at construction, before any heavy work."""

    def __init__(self, final: str | Path, overwrite: bool = False) -> None:
        self.final = Path(final).absolute()
        self.overwrite = overwrite
        self.tmp = self.final.with_name(f".{self.final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        self._created: list[Path] = []  # parent directories this conversion made, deepest last
        self._previous: Any = None
        self._installed = False
        parent = self.final
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise CheckpointError(f"output: {parent} is a file, not a directory; choose a new --output directory")
        if self.final.exists() and any(self.final.iterdir()) and not overwrite:
            raise CheckpointError(f"output: {self.final} exists and is not empty; choose a new --output directory")
        if parent == self.final:
            parent = self.final.parent
        probe = parent / self.tmp.name  # can a directory be made there (permissions, read-only or virtual fs)?
        try:
            probe.mkdir()
            probe.rmdir()
        except FileExistsError:
            pass  # a leftover of a killed process that had our pid: removed on entry
        except OSError as exc:
            raise self._error(exc, parent) from None

    def _error(self, exc: OSError, where: Path) -> CheckpointError:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return CheckpointError(f"output: no space left on the device of {where} for {self.final}; free space "
                                   f"or choose another --output directory")
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return CheckpointError(f"output: {where} is not writable ({exc.strerror}); choose another --output "
                                   f"directory")
        return CheckpointError(f"output: cannot write {self.final} under {where} ({exc.strerror}); choose another "
                               f"--output directory")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # unwinds through __exit__, which removes the partial output

    def remove_stale(self) -> list[str]:
        """Remove this output's temporary siblings whose process (on this host) is gone; returns their names. Those
        of a live process, of another host, or named otherwise are left alone."""
        parent, prefix = self.final.parent, f".{self.final.name}.tmp-"
        host = socket.gethostname()
        removed = []
        for path in parent.glob(f"{prefix}*") if parent.is_dir() else ():
            owner, _, pid = path.name[len(prefix):].rpartition("-")
            if owner == host and pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed

    def __enter__(self) -> Path:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        try:
            missing = []
            parent = self.final.parent
            while not parent.exists():
                missing.append(parent)
                parent = parent.parent
            for path in reversed(missing):
                path.mkdir()
                self._created.append(path)
            self.remove_stale()
            self.tmp.mkdir()
        except BaseException as exc:
            self._cleanup()
            if isinstance(exc, OSError):
                raise self._error(exc, self.final.parent) from None
            raise
        return self.tmp

    def _cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        for path in reversed(self._created):
            try:
                path.rmdir()  # only while empty: another process may have written there since
            except OSError:
                break
        self._created = []
        self._restore()

    def _restore(self) -> None:
        if self._installed:  # the previous handler may be None (set outside Python): restored all the same
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                if self.final.exists():
                    shutil.rmtree(self.final)
                os.replace(self.tmp, self.final)
                self._restore()
                return
            except BaseException as failure:  # SIGTERM or a full disk while renaming: nothing partial stays
                self._cleanup()
                mapped = self._mapped(failure)
                if mapped is failure:
                    raise
                raise mapped from failure
        self._cleanup()
        mapped = self._mapped(exc)
        if mapped is not exc:
            raise mapped from exc

    def _mapped(self, exc: BaseException) -> BaseException:
        """A full disk, or an OSError on the temporary directory, as the one-line CheckpointError; others as is."""
        full = disk_full_error(exc)
        if full is not None:
            return self._error(full, self.final.parent)
        if isinstance(exc, OSError) and str(self.tmp) in str(exc.filename or ""):
            return self._error(exc, self.final.parent)
        return exc
