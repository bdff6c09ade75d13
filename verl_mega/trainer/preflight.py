"""Checks that run before anything heavy is built, each failing with one line that names the problem and the fix,
and the wording of errors the operating system raises while a run writes its outputs."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

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


def check_tokenizer(tokenizer: Any, path: str, *, model_vocab_size: int) -> None:
    """The tokenizer encodes text to tokens, has an end-of-sequence token, and its vocabulary fits the model's:
    no id beyond the embedding, and not less than half of it (a sign of another model family's tokenizer)."""
    if not tokenizer.encode("The answer is 42.", add_special_tokens=False):
        raise ValueError(f"model.tokenizer_path={path!r} has no tokenizer files (tokenizer.json or a vocabulary); "
                         f"point model.tokenizer_path at the model's tokenizer")
    if tokenizer.eos_token_id is None:
        raise ValueError(f"model.tokenizer_path={path!r}: the tokenizer has no end-of-sequence token, so generation "
                         f"could never stop; set eos_token in its tokenizer_config.json")
    size = len(tokenizer)
    if size > model_vocab_size:
        raise ValueError(f"model.tokenizer_path={path!r}: the tokenizer has {size} tokens but the model's vocabulary "
                         f"has {model_vocab_size} (vocab_size in config.json); use the model's own tokenizer")
    if size < model_vocab_size // 2:
        raise ValueError(f"model.tokenizer_path={path!r}: the tokenizer has {size} tokens, less than half of the "
                         f"model's vocabulary of {model_vocab_size}; it belongs to another model: use the model's "
                         f"own tokenizer")


def disk_full_error(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind `exc`, if any: a full disk may surface wrapped, e.g. in torch's
    CheckpointException (per-rank failures) or as the cause of another error."""
    from verl_mega.models.safe_ckpt import exception_chain

    return next((e for e in exception_chain(exc)
                 if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)), None)
