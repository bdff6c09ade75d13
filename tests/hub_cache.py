"""A Hugging Face hub cache written on disk in the hub's own layout, for offline tests.

``<cache>/<models|datasets>--ORG--NAME/`` holds ``blobs/<hash>`` (the file contents), ``snapshots/<commit>/<path>``
(relative symlinks to the blobs) and ``refs/<revision>`` (the commit a branch or tag points at), as huggingface_hub's
cache documents it. :func:`add_repo` checks its work with huggingface_hub's own readers: ``snapshot_download(...,
local_files_only=True)`` must return the snapshot, and ``scan_cache_dir`` must list the files.
"""

from __future__ import annotations

import hashlib
import json
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


class StandInHub:
    """A local HTTP server answering the part of the hub's API that ``snapshot_download`` uses, for one repository
    at one commit: its revision, its file tree, and its files (HEAD and GET). ``requests`` lists what was asked, as
    (method, path) pairs. Use it as a context manager and point HF_ENDPOINT at ``endpoint``."""

    def __init__(self, repo_id: str, files: dict[str, bytes], *, repo_type: str = "model", commit: str = "c" * 40):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.requests: list[tuple[str, str]] = []
        api = f"/api/{repo_type}s/{repo_id}/"
        resolve = f"/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}/resolve/{commit}/"
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, head: bool) -> None:
                hub.requests.append((self.command, self.path))
                path, body, headers = self.path.split("?")[0], None, {}
                if path.startswith(api + "revision/"):
                    body = json.dumps({"id": repo_id, "sha": commit,
                                       "siblings": [{"rfilename": name} for name in files]}).encode()
                elif path.startswith(api + "tree/"):
                    tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                            for name, data in files.items()]
                    body = json.dumps(tree).encode()
                elif path.startswith(resolve) and path[len(resolve):] in files:
                    body = files[path[len(resolve):]]
                    headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(body).hexdigest()}"'}
                if body is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if path.startswith(resolve) else "RepoNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                for name, value in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(name, value)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def do_GET(self):  # noqa: N802 - http.server's names
                self._answer(head=False)

            def do_HEAD(self):  # noqa: N802
                self._answer(head=True)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def fetched(self) -> list[str]:
        """The files downloaded (GET of their content), in order."""
        return [path.rsplit("/resolve/", 1)[1].split("/", 1)[1] for method, path in self.requests
                if method == "GET" and "/resolve/" in path]

    def __enter__(self) -> "StandInHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)


# openai/gsm8k's dataset card: its configurations and their splits, as the hub serves it
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
# gsm8k
"""


def offline_cache(tmp_path, monkeypatch):
    """An empty hub cache of the test's own, offline (HF_HUB_CACHE under tmp_path, HF_HUB_OFFLINE=1)."""
    root = tmp_path / "hf" / "hub"
    root.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("VERL_MEGA_HUB_WAIT_S", raising=False)
    return root
