"""A reward pool's worker process: ``python -m verl_mega.rewards.worker FD``, started by
:class:`verl_mega.rewards.pool.RewardPool`.

Its main module is this one, never the trainer's: multiprocessing's spawn would re-run the main script of the
process that starts the pool (a user's script that calls ``RLTrainer.create`` at top level, without an
``if __name__ == "__main__"`` guard, would build a second job in every worker). FD is this end of a socket pair to the
pool; the first message on it is the pool's ``sys.path`` (so that the same modules import here) and the worker's
arguments.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    conn = Connection(int(argv[0]))
    try:
        path, initargs = conn.recv()
    except (EOFError, OSError):  # the pool is gone before it sent anything
        return
    sys.path[:] = path
    from verl_mega.rewards.pool import _worker_main

    _worker_main(conn, *initargs)


if __name__ == "__main__":
    main()
