"""A Hugging Face hub cache written on disk in the hub's own layout, for offline tests.

``<cache>/<models|datasets>--ORG--NAME/`` holds ``blobs/<hash>`` (the file contents), ``snapshots/<commit>/<path>``
(relative symlinks to the blobs) and ``refs/<revision>`` (the commit a branch or tag points at), as huggingface_hub's
cache documents it. :func:`add_repo` checks its work with huggingface_hub's own readers: ``snapshot_download(...,
local_files_only=True)`` must return the snapshot, and ``scan_cache_dir`` must list the files.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from huggingface_hub import scan_cache_dir, snapshot_download
from huggingface_hub.file_download import repo_folder_name


def add_repo(cache: Path, repo_id: str, files: dict[str, bytes | str | Path], *, repo_type: str = "model",
             refs: tuple[str, ...] = ("main",)) -> Path:
    """Write ``files`` ({path in the repository: contents, or a local file to copy}) as one commit of ``repo_id``
    that ``refs`` point at; returns the snapshot directory."""
    blobs = {}
    for rel, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else \
            content.encode() if isinstance(content, str) else content
        blobs[rel] = data
    commit = hashlib.sha1(repr(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in blobs.items())).encode()
                          + repo_id.encode()).hexdigest()
    storage = cache / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
    snapshot = storage / "snapshots" / commit
    for rel, data in blobs.items():
        digest = hashlib.sha256(data).hexdigest()
        blob = storage / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (storage / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    found = snapshot_download(repo_id, repo_type=repo_type, revision=refs[0], cache_dir=cache, local_files_only=True)
    assert Path(found) == snapshot, (found, snapshot)
    listed = {r.repo_id: r for r in scan_cache_dir(cache).repos if r.repo_type == repo_type}
    assert {f.file_name for rev in listed[repo_id].revisions for f in rev.files} >= {Path(r).name for r in files}
    return snapshot


def add_dir(cache: Path, repo_id: str, directory: Path, *, repo_type: str = "model",
            refs: tuple[str, ...] = ("main",)) -> Path:
    """Every file under ``directory`` as one commit of ``repo_id``."""
    files = {str(p.relative_to(directory)): p for p in sorted(directory.rglob("*")) if p.is_file()}
    return add_repo(cache, repo_id, files, repo_type=repo_type, refs=refs)
