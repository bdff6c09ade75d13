"""Which checkpoint a run resumes from, and whether it is intact.

Every checkpoint carries ``manifest.json``: each file's size and the SHA-256 of each of its 64 MiB blocks, computed
at save time (the blocks are split over the ranks, and over threads within a rank). Before a resume:

* on every rank, before anything is built (:func:`find_checkpoint`): ``trainer.json`` parses and has the fields of its
  schema; every file of the manifest is present with its size; each role's dist-checkpoint metadata reads through the
  allow-list of :mod:`verl_mega.checkpoint.safe_load`; result-changing config keys and the optimizer type agree;
* once the process group exists (:func:`verify_checkpoint`, collective): every rank takes rank 0's choice, and every
  block's SHA-256 equals the manifest's, each rank hashing its share on its threads
  (``checkpoint.verify_checksums=false`` skips the hashing).

A broken checkpoint (unreadable, missing or truncated file, wrong checksum) is an error naming the file; with
``trainer.resume=auto`` the newest intact checkpoint is used instead, with a warning. A file the allow-list refuses,
or a config that does not fit the checkpoint, is always an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

from verl_mega.config import diff_configs
from verl_mega.models.hf_io import CheckpointError
from verl_mega.parallel.state import pool_group

log = logging.getLogger("verl_mega.checkpoint")

# trainer.json layout; a checkpoint with a newer schema comes from a newer verl_mega. The field and manifest.json
# came in together: a trainer.json without it is of a checkpoint written before manifests, one with it needs its
# manifest (a deleted manifest must not pass for that older format and load unverified).
SCHEMA = 1
MANIFEST = "manifest.json"
COMPLETE = "COMPLETE"
RESUMED_FILE = ".resumed_from.json"  # under output_dir: the trainer.resume=PATH this run resumed from (and its step)
_FIELDS = {"step": int, "loader": dict, "kl_ctrl": dict, "engines": dict, "world_size": int, "layout": dict,
           "config": dict}


class ResumeError(ValueError):
    """A checkpoint that cannot be resumed from; the message says why and what to do."""


class BrokenCheckpointError(ResumeError):
    """A checkpoint with a missing, truncated, unreadable or altered file (named in the message)."""


# ---------------------------------------------------------------------------------------------------- manifest
# SHA-256 is sequential within a stream, so one large shard would be hashed by one core. Each file is hashed as
# fixed 64 MiB blocks instead: the blocks of all files are shared out over the ranks, and over threads within a rank
# (hashlib releases the GIL), so a save is hashed at many cores' speed. Manifests with whole-file digests
# ("sha256" entries, written before blocks) still verify.
BLOCK_BYTES = 64 << 20
_READ_BYTES = 8 << 20  # each thread holds at most this much of a block at a time
BlockItem = tuple[str, int]  # (file name, block index)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_threads() -> int:
    """Hashing threads per rank: this node's cores shared among its ranks."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(32, (os.cpu_count() or 1) // max(1, local_ranks)))


def checkpoint_files(root: Path) -> list[str]:
    """Every file of a checkpoint directory (relative, sorted), except the manifest and the COMPLETE marker."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.relative_to(root).as_posix() not in (MANIFEST, COMPLETE))


def block_items(sizes: dict[str, int], block_bytes: int | None = None) -> list[BlockItem]:
    """Every (file, block) of files of the given sizes, in file order; an empty file has no block."""
    block_bytes = block_bytes or BLOCK_BYTES
    return [(name, i) for name in sorted(sizes) for i in range(-(-sizes[name] // block_bytes))]


def _hash_block(root: Path, item: BlockItem, block_bytes: int) -> str:
    name, index = item
    digest = hashlib.sha256()
    with open(root / name, "rb", buffering=0) as f:
        f.seek(index * block_bytes)
        left = block_bytes
        while left:
            chunk = f.read(min(left, _READ_BYTES))
            if not chunk:
                break
            digest.update(chunk)
            left -= len(chunk)
    return digest.hexdigest()


def hash_blocks(root: Path, items: list[BlockItem], *, block_bytes: int | None = None,
                threads: int | None = None) -> dict[BlockItem, str]:
    """SHA-256 of each (file, block) of `root`, hashed on a thread pool."""
    block_bytes, threads = block_bytes or BLOCK_BYTES, threads or hash_threads()
    if threads == 1 or len(items) <= 1:
        return {item: _hash_block(root, item, block_bytes) for item in items}
    with ThreadPoolExecutor(max_workers=min(threads, len(items)), thread_name_prefix="ckpt-sha256") as pool:
        return dict(zip(items, pool.map(lambda item: _hash_block(root, item, block_bytes), items)))


def manifest_entries(root: Path, sizes: dict[str, int], digests: dict[BlockItem, str]) -> dict[str, dict[str, Any]]:
    """Manifest entries (size and block digests) from the block digests of every file."""
    return {name: {"size": size, "blocks": [digests[(name, i)] for i in range(-(-size // BLOCK_BYTES))]}
            for name, size in sizes.items()}


def digest_files(root: Path, names: list[str], *, threads: int | None = None) -> dict[str, dict[str, Any]]:
    """Manifest entries of `names` under `root`, hashed on this process alone (its threads)."""
    sizes = {n: (root / n).stat().st_size for n in names}
    return manifest_entries(root, sizes, hash_blocks(root, block_items(sizes), threads=threads))


def write_manifest(root: Path, entries: dict[str, dict[str, Any]]) -> None:
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"algorithm": "sha256", "block_bytes": BLOCK_BYTES,
                               "files": dict(sorted(entries.items()))}, indent=1))
    os.replace(tmp, root / MANIFEST)


def _entry_ok(entry: Any, block_bytes: int) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
        return False
    if "blocks" in entry:
        blocks = entry["blocks"]
        return (isinstance(blocks, list) and all(isinstance(b, str) for b in blocks)
                and len(blocks) == -(-entry["size"] // block_bytes))
    return isinstance(entry.get("sha256"), str)


def read_manifest(root: Path) -> dict[str, dict[str, Any]] | None:
    """The manifest's file table; None for checkpoints written before manifests existed."""
    path = root / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        files, block_bytes = manifest["files"], manifest.get("block_bytes", BLOCK_BYTES)
        if block_bytes != BLOCK_BYTES:
            raise ValueError(f"block_bytes {block_bytes} is not this version's {BLOCK_BYTES}")
        if not all(_entry_ok(e, block_bytes) for e in files.values()):
            raise ValueError("an entry lacks its size or its digests")
        return files
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BrokenCheckpointError(f"resume: {path} is unreadable ({type(exc).__name__}: {exc})") from None


def check_sizes(root: Path, manifest: dict[str, dict[str, Any]]) -> None:
    for name, entry in manifest.items():
        path = root / name
        if not path.is_file():
            raise BrokenCheckpointError(f"resume: {path} is missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != entry["size"]:
            raise BrokenCheckpointError(f"resume: {path} has {size} bytes, {MANIFEST} records {entry['size']} "
                                        f"(truncated or overwritten)")


def verify_items(manifest: dict[str, dict[str, Any]]) -> list[BlockItem]:
    """The units of verification: each block of a block-hashed file; a whole-file-hashed file is one unit (-1)."""
    items: list[BlockItem] = []
    for name in sorted(manifest):
        entry = manifest[name]
        items += block_items({name: entry["size"]}) if "blocks" in entry else [(name, -1)]
    return items


def bad_checksums(root: Path, manifest: dict[str, dict[str, Any]], items: list[BlockItem] | None = None, *,
                  threads: int | None = None) -> list[str]:
    """Messages for the files whose content (among `items`, default: all) differs from the manifest."""
    items = verify_items(manifest) if items is None else items

    def check(item: BlockItem) -> str | None:
        name, index = item
        try:
            if index < 0:
                same = sha256_file(root / name) == manifest[name]["sha256"]
            else:
                same = _hash_block(root, item, BLOCK_BYTES) == manifest[name]["blocks"][index]
        except OSError as exc:
            return f"resume: {root / name} is unreadable ({exc})"
        if same:
            return None
        return (f"resume: {root / name} does not match its SHA-256 in {MANIFEST} (the file was altered or "
                f"corrupted after it was written)")

    threads = threads or hash_threads()
    if threads == 1 or len(items) <= 1:
        verdicts = [check(item) for item in items]
    else:
        with ThreadPoolExecutor(max_workers=min(threads, len(items)), thread_name_prefix="ckpt-verify") as pool:
            verdicts = list(pool.map(check, items))
    return sorted({v for v in verdicts if v is not None})


# ------------------------------------------------------------------------------------------- cheap inspection
def read_trainer_state(path: Path) -> dict[str, Any]:
    """trainer.json of a checkpoint, checked against its schema."""
    file = path / "trainer.json"
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise BrokenCheckpointError(f"resume: {file} is unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise BrokenCheckpointError(f"resume: {file} holds a {type(state).__name__}, not a JSON object")
    schema = state.get("schema", SCHEMA)
    if not isinstance(schema, int) or schema > SCHEMA:
        raise ResumeError(f"resume: {file} has schema {schema!r}, this verl_mega reads schema {SCHEMA} and older; "
                          f"resume it with the verl_mega version that wrote it")
    for key, kind in _FIELDS.items():
        if not isinstance(state.get(key), kind):
            problem = "lacks" if key not in state else f"has a {type(state[key]).__name__} as"
            raise BrokenCheckpointError(f"resume: {file} {problem} '{key}' (schema {SCHEMA} needs a "
                                        f"{kind.__name__}); the file is damaged or not a verl_mega checkpoint's")
    return state


def _roles(cfg) -> list[str]:
    return ["actor", "critic"] if cfg.critic.enable else ["actor"]


def inspect_checkpoint(path: Path, cfg) -> dict[str, Any]:
    """The cheap checks of the module docstring; returns trainer.json's content."""
    from verl_mega.checkpoint.safe_load import UnsafeCheckpointError, check_dist_checkpoint, weights_only_load

    state = read_trainer_state(path)
    named = path.name.removeprefix("step_")
    if named.isdigit() and int(named) != state["step"]:  # a directory renamed, or copied in from another run
        raise BrokenCheckpointError(f"resume: {path} is named for step {int(named)} but its trainer.json records step "
                                    f"{state['step']}; rename it step_{state['step']:06d} or remove it")
    manifest = read_manifest(path)
    if manifest is not None:
        check_sizes(path, manifest)
    elif "schema" in state:  # manifests came with the schema field: this checkpoint was written with one
        raise BrokenCheckpointError(f"resume: {path / MANIFEST} is missing (trainer.json's schema {state['schema']} "
                                    f"checkpoints are written with one), so the files cannot be verified; resume "
                                    f"another checkpoint")
    else:  # written before manifests (and the schema field): at least every rank's file must be there
        for rank in range(state["world_size"]):
            if not (path / f"rank_{rank:05d}.pt").is_file():
                raise BrokenCheckpointError(f"resume: {path / f'rank_{rank:05d}.pt'} is missing")
    changes = diff_configs(state["config"], cfg)
    if changes and not cfg.trainer.resume_allow_config_change:
        raise ResumeError(f"resume: config differs from {path.name} in result-changing keys ({'; '.join(changes)}); "
                          "restore them or set trainer.resume_allow_config_change=true")
    if changes:
        log.warning("resume: config differs from %s in result-changing keys (%s); resuming with the new values "
                    "(trainer.resume_allow_config_change=true)", path.name, "; ".join(changes))
    saved_optim = state["config"].get("checkpoint", {}).get("save_optimizer", True)
    saved_dist = state["config"].get("parallel", {}).get("use_distributed_optimizer")
    now_dist = cfg.parallel.use_distributed_optimizer
    if saved_optim and cfg.checkpoint.save_optimizer and saved_dist is not None and saved_dist != now_dist:
        raise ResumeError(f"resume: {path.name} holds the state of the {'distributed' if saved_dist else 'plain'} "
                          f"optimizer, which the {'distributed' if now_dist else 'plain'} one cannot load; set "
                          f"parallel.use_distributed_optimizer={str(saved_dist).lower()} as saved, or "
                          f"checkpoint.save_optimizer=false to restart the optimizer state")
    for role in _roles(cfg):
        if not (path / role).is_dir():
            raise ResumeError(f"resume: {path} has no {role}/ state; it was saved by a run without that role")
        try:
            check_dist_checkpoint(path / role)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            raise BrokenCheckpointError(str(exc).replace("checkpoint: ", "resume: ", 1)) from None
    for rank_file in sorted(path.glob("rank_*.pt")):  # small (RNG states): read them all now, not after the build
        try:
            weights_only_load(rank_file, what=str(rank_file))
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            raise BrokenCheckpointError(str(exc).replace("checkpoint: ", "resume: ", 1)) from None
    return state


def _candidates(cfg) -> list[Path]:
    """The checkpoints trainer.resume may use, newest first."""
    mode = cfg.trainer.resume
    if mode == "off":
        return []
    if mode != "auto":
        path = Path(mode)
        if not (path / COMPLETE).exists():
            raise ResumeError(f"trainer.resume={mode}: not a complete checkpoint (no COMPLETE marker); "
                              "pick a step_* directory or use trainer.resume=auto")
        return _saved_since_resume(cfg, path) + [path]
    root = Path(cfg.trainer.output_dir) / "checkpoints"
    return sorted((p for p in root.glob("step_*") if (p / COMPLETE).exists()), reverse=True)


def record_explicit_resume(output_dir: str | os.PathLike, path: Path, step: int) -> None:
    """Note that this run resumed from ``path`` (``trainer.resume=PATH``, step ``step``), once the checkpoints past it
    were set aside: a launcher that restarts the job runs the same command again, and must not roll it back again."""
    record = Path(output_dir) / RESUMED_FILE
    tmp = record.with_name(record.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"path": str(path.resolve()), "step": step}))
    os.replace(tmp, record)


def _saved_since_resume(cfg, path: Path) -> list[Path]:
    """On a launcher's restart of a job started with ``trainer.resume=PATH`` (the same command, run again), the
    checkpoints this run saved after it resumed from PATH, newest first: the restart continues from them instead of
    rolling back to PATH a second time. A relaunch by hand (no restart counter) resumes PATH as asked."""
    from verl_mega.parallel.launch_env import restart_counters

    counters = {k: v for k, v in restart_counters().items() if v > 0}
    record = Path(cfg.trainer.output_dir) / RESUMED_FILE
    if not counters or not record.is_file():
        return []
    try:
        done = json.loads(record.read_text())
        resumed, step = Path(done["path"]), int(done["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if resumed != path.resolve():  # the record is of another resume: this one has not been carried out yet
        return []
    root = Path(cfg.trainer.output_dir) / "checkpoints"
    since = sorted((p for p in root.glob("step_*") if (p / COMPLETE).exists() and step_number(p) > step),
                   reverse=True)
    if since:
        log.warning("trainer.resume=%s: this is a restart (%s) of a run that already resumed from it; continuing "
                    "from its own newest checkpoint, %s, instead of going back to step %d again", path,
                    ", ".join(f"{k} {v}" for k, v in counters.items()), since[0].name, step)
    return since


def step_number(path: Path) -> int:
    """The step in a ``step_N`` directory's name (-1 for another name)."""
    digits = path.name.removeprefix("step_")
    return int(digits) if digits.isdigit() else -1


def _fall_back(cfg, path: Path, exc: BrokenCheckpointError, older: list[Path]) -> None:
    """Raise `exc` unless there is an older checkpoint to try (trainer.resume=auto, or a restart continuing after
    trainer.resume=PATH, whose last candidate is PATH)."""
    if not older:
        if cfg.trainer.resume != "auto":
            raise exc
        raise BrokenCheckpointError(f"{exc}; no older intact checkpoint under {path.parent}: remove the broken one to "
                                    f"start over, or set trainer.resume=off") from None
    log.warning("%s; resuming from the older %s instead", exc, older[0].name)


def find_checkpoint(cfg, *, after: Path | None = None) -> Path | None:
    """The checkpoint trainer.resume selects, after the cheap checks (no process group needed): the newest that
    passes them, with trainer.resume=auto. ``after``: consider only checkpoints older than this one."""
    candidates = _candidates(cfg)
    if after is not None:
        candidates = [p for p in candidates if p.name < after.name]
    for i, path in enumerate(candidates):
        try:
            inspect_checkpoint(path, cfg)
            return path
        except BrokenCheckpointError as exc:
            _fall_back(cfg, path, exc, candidates[i + 1:])
    return None


def rank0_choice(path: Path | None) -> Path | None:
    """Rank 0's choice of checkpoint, on every rank of the pool (collective). Each rank runs the cheap checks on its
    own, before any process group exists, so a transient read error can make ranks choose differently; all of them
    must load one checkpoint, whose checksums they then verify together."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return path
    box = [None if path is None else str(path)]
    dist.broadcast_object_list(box, src=0, group=pool_group())
    chosen = None if box[0] is None else Path(box[0])
    if chosen != path:
        log.warning("resume: this rank (%d) chose %s on its own, rank 0 chose %s; every rank resumes from rank 0's "
                    "choice", dist.get_rank(), path, chosen)
    return chosen


def verify_checkpoint(cfg, path: Path | None) -> Path | None:
    """Make every rank take rank 0's choice, check `path`'s files against its manifest's SHA-256 (collective: each
    rank hashes its share, all ranks get the same verdict) and fall back like find_checkpoint. Returns the
    checkpoint to load."""
    path = rank0_choice(path)
    while path is not None and cfg.checkpoint.verify_checksums:
        manifest = read_manifest(path)
        if manifest is None:
            log.warning("resume: %s was written without a manifest; its files are not verified", path.name)
            return path
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        bad = bad_checksums(path, manifest, verify_items(manifest)[rank::world])
        if world > 1:
            everyone: list = [None] * world
            dist.all_gather_object(everyone, bad, group=pool_group())
            bad = [m for part in everyone for m in part]
        if not bad:
            return path
        older = [p for p in _candidates(cfg) if p.name < path.name] if cfg.trainer.resume == "auto" else []
        _fall_back(cfg, path, BrokenCheckpointError(sorted(bad)[0]), older)
        path = rank0_choice(find_checkpoint(cfg, after=path))
    return path


def checkpoint_step(path: Path) -> int:
    return int(read_trainer_state(path)["step"])


class RunComplete(Exception):
    """The checkpoint to resume from already holds the run's last step: there is nothing to train."""


def check_steps_left(path: Path, total_steps: int, *, loader=None, complete_ok: bool = False) -> None:
    """Before building: the checkpoint must leave steps to train: its step below the run's last step
    (trainer.total_steps, or the batches of trainer.total_epochs) and, given this run's data `loader`, its data
    position before the loader's end (dynamic sampling draws extra batches, so the data can end first); and its
    loader state must fit `loader`. ``complete_ok``: a checkpoint at the last step passes (its checksums are not
    verified yet, and a broken one would be replaced by an older one)."""
    state = read_trainer_state(path)
    step = int(state["step"])
    if loader is not None:
        try:  # refused here, not after every model is built and the checkpoint loaded
            loader.check_state(state["loader"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ResumeError(f"resume: {path}: {exc}") from None
    if step > total_steps:
        raise ResumeError(f"trainer.total_steps={total_steps} is below step {step} of {path}: that run went further "
                          f"already; set trainer.total_steps above {step} to continue it, or trainer.resume=off (or "
                          f"another trainer.output_dir) to start over")
    if complete_ok:
        return
    if step == total_steps:
        raise RunComplete(f"{path} already holds step {step}, the last of this run; nothing to train (raise "
                          f"trainer.total_steps to continue, or set trainer.resume=off to start over)")
    if loader is not None and loader.ends_at(state["loader"]):
        raise RunComplete(f"{path} already holds step {step}, where the data ran out (the last of its "
                          f"{loader.total_batches} prompt batches; dynamic sampling drew extra ones); nothing to "
                          f"train (raise trainer.total_epochs to continue, or set trainer.resume=off to start over)")
