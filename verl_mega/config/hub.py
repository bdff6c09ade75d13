"""Hugging Face hub IDs where a config names a model or a dataset: parse them, check them, resolve them to files.

* Models (``model.path``, ``model.tokenizer_path``, ``critic.model_path``, ``reward.reward_model_path``, the
  converters' ``--hf-path``): a local directory, or a hub ID ``ORG/NAME`` with an optional revision
  ``ORG/NAME@REVISION`` (a branch, tag or commit).
* Datasets (``data.train_files``, ``data.val_files``): local files, or a hub dataset ID ``ORG/NAME[@REVISION]``
  with an optional split, ``ORG/NAME:SPLIT``, or configuration and split, ``ORG/NAME:CONFIG:SPLIT``.

A value that exists on disk, starts with ``/``, ``.`` or ``~``, or (for data) ends in ``.parquet``, ``.jsonl`` or
``.json`` is a local path. IDs resolve through huggingface_hub's own cache (``HF_HOME``, ``HF_HUB_CACHE``);
``HF_HUB_OFFLINE=1`` resolves them from that cache alone. The processes of a node resolve one at a time under a
file lock in the cache: the first downloads, the others then find the files there. A process waits for the lock at
most ``VERL_MEGA_HUB_WAIT_S`` seconds (default 7200) and then fails naming the process that holds it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import fnmatch
import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from verl_mega.config.base import ConfigError

__all__ = ["HubRef", "expand_home", "parse_model", "parse_dataset", "offline", "cache_dir", "check_model",
           "check_dataset", "resolve_model", "resolve_model_config", "resolve_dataset", "resolve_config",
           "local_dataset_files", "MODEL_PATTERNS", "DATA_SUFFIXES"]

#: the files of a model repository that loading it needs: config, safetensors weights, tokenizer, chat template,
#: remote code. PyTorch .bin / .pth copies (often as large again) are left on the hub.
MODEL_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py")
TOKENIZER_PATTERNS = tuple(p for p in MODEL_PATTERNS if p != "*.safetensors")
DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
WAIT_ENV = "VERL_MEGA_HUB_WAIT_S"
DEFAULT_WAIT_S = 7200.0
# the split names `datasets` recognises in file and folder names when a card declares no configurations
SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
               "test": ("test", "testing", "eval", "evaluation")}
_REPO = r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*"
_REV = r"(?:@(?P<rev>[^\s@:]+))?"
_MODEL_ID = re.compile(rf"(?P<repo>{_REPO}){_REV}")
_DATA_ID = re.compile(rf"(?P<repo>{_REPO}){_REV}(?::(?P<a>[\w.-]+))?(?::(?P<b>[\w.-]+))?")


@dataclass(frozen=True)
class HubRef:
    """A parsed hub ID: ``repo_type`` is "model" or "dataset"; ``config``/``split`` only for datasets."""

    text: str
    repo_id: str
    revision: str | None
    repo_type: str
    config: str | None = None
    split: str | None = None


def expand_home(value: Any) -> Any:
    """``~/x`` (or each such entry of a tuple) as a path under the home directory: verl's configs write paths so,
    and neither YAML nor a ``key=[~/x]`` argument expands them."""
    if isinstance(value, tuple):
        return tuple(expand_home(v) for v in value)
    return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value


def _local(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or os.path.exists(value)


def _valid_repo_id(repo_id: str) -> bool:
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        return False
    return True


def parse_model(value: str | None) -> HubRef | None:
    """The hub model ID ``value`` names, or None when it is a local path (or not an ID)."""
    if not value or _local(value):
        return None
    found = _MODEL_ID.fullmatch(value)
    if found is None or not _valid_repo_id(found["repo"]):
        return None
    return HubRef(value, found["repo"], found["rev"], "model")


def parse_dataset(value: str | None) -> HubRef | None:
    """The hub dataset ID ``value`` names (with its configuration and split when given), or None for a local file."""
    if not value or _local(value) or value.lower().endswith(DATA_SUFFIXES):
        return None
    found = _DATA_ID.fullmatch(value)
    if found is None or not _valid_repo_id(found["repo"]):
        return None
    config, split = (found["a"], found["b"]) if found["b"] else (None, found["a"])
    return HubRef(value, found["repo"], found["rev"], "dataset", config, split)


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub reads it, read now rather than at its import."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> str:
    """The hub cache directory, from HF_HUB_CACHE or HF_HOME as set now (huggingface_hub reads them at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _wait_bound() -> float:
    raw = os.environ.get(WAIT_ENV, "")
    try:
        bound = float(raw) if raw.strip() else DEFAULT_WAIT_S
    except ValueError:
        raise ConfigError(f"{WAIT_ENV}={raw!r} is not a number of seconds; set it to e.g. 7200 or unset it") from None
    if not bound > 0:
        raise ConfigError(f"{WAIT_ENV}={raw!r} must be a positive number of seconds; set it to e.g. 7200")
    return bound


def _snapshot(ref: HubRef, key: str, patterns: tuple[str, ...] | list[str], revision: str | None = None) -> str:
    """huggingface_hub.snapshot_download of the files matching ``patterns``, its errors as one ConfigError line."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError)

    where = f"{key}={ref.text!r}"
    cache = cache_dir()
    kind = f"{ref.repo_type} {ref.repo_id}" + (f" at revision {ref.revision!r}" if ref.revision else "")
    local = "give a local path instead" if ref.repo_type == "model" else "give local parquet/JSON/JSONL files instead"
    try:
        return snapshot_download(ref.repo_id, repo_type=ref.repo_type, revision=revision or ref.revision,
                                 cache_dir=cache, allow_patterns=list(patterns), local_files_only=offline(),
                                 endpoint=os.environ.get("HF_ENDPOINT") or None)
    except GatedRepoError:
        raise ConfigError(f"{where}: the {kind} is gated; accept its terms on the hub page and log in "
                          f"(`hf auth login`, or set HF_TOKEN), or {local}") from None
    except RevisionNotFoundError:
        raise ConfigError(f"{where}: the {ref.repo_type} {ref.repo_id} has no revision {ref.revision!r}; give a "
                          f"branch, tag or commit it has (ID@REVISION), or drop @{ref.revision}") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{where}: the hub has no {ref.repo_type} {ref.repo_id} (or it is private: log in with "
                          f"`hf auth login` or set HF_TOKEN); check the name, or {local}") from None
    except IncompleteSnapshotError:
        raise ConfigError(f"{where}: the copy in the Hugging Face cache {cache} is incomplete and the hub cannot be "
                          f"reached to finish it; set HF_HUB_OFFLINE=0 with a connection, or {local}") from None
    except LocalEntryNotFoundError:
        if offline():
            raise ConfigError(f"{where}: HF_HUB_OFFLINE=1 and the Hugging Face cache {cache} has no copy of the "
                              f"{kind}; set HF_HUB_OFFLINE=0 to download it, {local}, or check the "
                              f"name") from None
        raise ConfigError(f"{where}: the Hugging Face hub cannot be reached and the cache {cache} has no copy of the "
                          f"{kind}; check the connection (and HF_ENDPOINT), {local}, or check the "
                          f"name") from None
    except (HfHubHTTPError, OSError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ConfigError(f"{where}: fetching the {kind} failed ({type(exc).__name__}: {reason}); "
                          f"retry, or {local}") from None


def _holder() -> str:
    rank, local_rank = os.environ.get("RANK"), os.environ.get("LOCAL_RANK")
    who = f"rank {rank}" + (f" (local rank {local_rank})" if local_rank is not None else "") if rank else "process"
    return f"{who}, pid {os.getpid()} on {socket.gethostname()}"


def _started() -> float:
    """When this process started: a fetch recorded after it is this launch's."""
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - without psutil, the import of this module is the nearest start
        return _IMPORTED


_IMPORTED = time.time()


def _once(ref: HubRef, key: str, what: str, fetch: Callable[[], Any]) -> Any:
    """``fetch()`` under the node's lock of the repository. The lock file names its holder while it fetches (the
    waiters' error names it), then records the result: a process of the same launch that takes the lock later reuses
    it without asking the hub again (the same key, ID and ``what``). A waiter gives up after VERL_MEGA_HUB_WAIT_S
    seconds."""
    from huggingface_hub.file_download import repo_folder_name

    bound = _wait_bound()
    spec = [key.split("[")[0], ref.text, what]  # a dataset's default split depends on the key
    folder = Path(cache_dir()) / ".locks" / repo_folder_name(repo_id=ref.repo_id, repo_type=ref.repo_type)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(folder / "verl_mega.lock", "a+")
    except OSError as exc:
        if offline():  # a read-only cache (e.g. one shared, filled beforehand): reading it needs no lock
            return fetch()
        raise ConfigError(f"{key}={ref.text!r}: the Hugging Face cache {cache_dir()} is not writable "
                          f"({exc.strerror}); point HF_HOME or HF_HUB_CACHE at a writable directory, or set "
                          f"HF_HUB_OFFLINE=1 to read it as it is") from None
    with handle:
        deadline = time.monotonic() + bound
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    handle.seek(0)
                    holder = handle.read().strip() or "another process"
                    raise ConfigError(f"{key}={ref.text!r}: waited {bound:g} s for {holder}, which is fetching "
                                      f"{ref.repo_id} into {cache_dir()}; check that process (or the connection), "
                                      f"download it first with `hf download {ref.repo_id}"
                                      f"{' --repo-type dataset' if ref.repo_type == 'dataset' else ''}`, or raise "
                                      f"{WAIT_ENV}") from None
                time.sleep(0.2)
        try:
            handle.seek(0)
            try:
                record = json.loads(handle.read() or "{}")
            except ValueError:  # a holder's name: it died while fetching
                record = {}
            paths = record.get("result") if isinstance(record, dict) else None
            paths = [paths] if isinstance(paths, str) else paths
            if (record.get("spec") == spec and record.get("at", 0) >= _started()
                    and isinstance(paths, list) and all(os.path.exists(p) for p in paths)):
                return record["result"]
            handle.seek(0)
            handle.truncate()
            handle.write(_holder())
            handle.flush()
            try:
                result = fetch()
            except BaseException:
                handle.seek(0)
                handle.truncate()  # no holder any more, and no result
                raise
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps({"spec": spec, "result": result, "at": time.time()}))
            handle.flush()
            return result
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_model(key: str, value: str) -> None:
    """Config-time check of a model ID: offline, it must be in the cache (no download happens here)."""
    ref = parse_model(value)
    if ref is not None and offline():
        _snapshot(ref, key, MODEL_PATTERNS)


def check_dataset(key: str, value: str) -> None:
    """Config-time check of a dataset ID: offline, it must be in the cache (no download happens here)."""
    ref = parse_dataset(value)
    if ref is not None and offline():
        _snapshot(ref, key, ("README.md", ".gitattributes"))


def resolve_model(key: str, value: str) -> str:
    """The local directory of model ``value``: itself when local, else the hub snapshot (downloaded when needed)."""
    ref = parse_model(value)
    if ref is None:
        return value
    if key == "model.tokenizer_path":  # a tokenizer of another model: its tokenizer files, not its weights
        return _once(ref, key, "tokenizer", lambda: _snapshot(ref, key, TOKENIZER_PATTERNS))
    path = _once(ref, key, "model", lambda: _snapshot(ref, key, MODEL_PATTERNS))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}={value!r}: the hub repository has no config.json at its top level; give the ID of a "
                          f"Hugging Face transformers model, or a local model directory")
    if not any(Path(path).glob("*.safetensors")):
        if offline():
            raise ConfigError(f"{key}={value!r}: the cached copy {path} holds no *.safetensors weights (a partial "
                              f"copy); set HF_HUB_OFFLINE=0 to fetch the rest, or give a local model directory")
        raise ConfigError(f"{key}={value!r}: the hub repository holds no *.safetensors weights (safetensors "
                          f"checkpoints are what loads); give another model or a local model directory")
    return path


def resolve_model_config(key: str, value: str) -> str:
    """The local directory holding model ``value``'s config.json: itself when local, else a hub snapshot with
    config.json alone fetched (what the planner and the layout check read)."""
    ref = parse_model(value)
    if ref is None:
        return value
    path = _once(ref, key, "config", lambda: _snapshot(ref, key, ("config.json",)))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{key}={value!r}: the hub repository has no config.json at its top level; give the ID of a "
                          f"Hugging Face transformers model, or a local model directory")
    return path


# ------------------------------------------------------------------------------------------------------- datasets
def _card_configs(root: str) -> list[dict[str, Any]]:
    """The ``configs`` of a dataset card's YAML header (the `datasets` library's data-files declaration)."""
    readme = Path(root) / "README.md"
    if not readme.is_file():
        return []
    from huggingface_hub.repocard import metadata_load

    try:
        meta = metadata_load(readme) or {}
    except Exception:  # noqa: BLE001 - an unparsable card declares nothing; the files decide
        return []
    configs = meta.get("configs")
    return [c for c in configs if isinstance(c, dict) and "config_name" in c] if isinstance(configs, list) else []


def _split_patterns(config: dict[str, Any]) -> dict[str, list[str]]:
    """{split: path patterns} of one card configuration (a plain string or list of files is the train split)."""
    files = config.get("data_files")
    if files is None:
        data_dir = str(config.get("data_dir", "")).strip("/")
        return {"*": [f"{data_dir}/*" if data_dir else "*"]}
    if isinstance(files, str):
        return {"train": [files]}
    out: dict[str, list[str]] = {}
    for item in files if isinstance(files, list) else [files]:
        if isinstance(item, str):
            out.setdefault("train", []).append(item)
        elif isinstance(item, dict) and "split" in item:
            paths = item.get("path", [])
            out.setdefault(str(item["split"]), []).extend([paths] if isinstance(paths, str) else list(paths))
    return out


def _pick_config(ref: HubRef, key: str, configs: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not configs:
        if ref.config is not None:
            raise ConfigError(f"{key}={ref.text!r}: the dataset {ref.repo_id} declares no configurations; write "
                              f"{ref.repo_id}:{ref.split} without {ref.config!r}")
        return None
    names = [str(c["config_name"]) for c in configs]
    if ref.config is not None:
        if ref.config not in names:
            raise ConfigError(f"{key}={ref.text!r}: the dataset {ref.repo_id} has no configuration {ref.config!r} "
                              f"(it has {', '.join(names)}); name one of them")
        return configs[names.index(ref.config)]
    chosen = [c for c in configs if c.get("default")] or [c for c in configs if c["config_name"] == "default"]
    if chosen or len(configs) == 1:
        return (chosen or configs)[0]
    raise ConfigError(f"{key}={ref.text!r}: the dataset {ref.repo_id} has configurations {', '.join(names)}; name one, "
                      f"e.g. {ref.repo_id}:{names[0]}:{ref.split or 'train'}")


def _words(relpath: str) -> set[str]:
    return {w for w in re.split(r"[^A-Za-z0-9]+", relpath.lower()) if w}


def _files_by_split(files: list[str]) -> dict[str, list[str]]:
    """Split → files by the split names in their paths, as `datasets` infers it; no split name anywhere → all train."""
    out: dict[str, list[str]] = {}
    for rel in files:
        words = _words(rel.rsplit(".", 1)[0])
        for split, names in SPLIT_WORDS.items():
            if words & set(names):
                out.setdefault(split, []).append(rel)
    return out or {"train": list(files)}


def _default_split(key: str, splits: list[str]) -> str:
    if key.startswith("data.val_files"):
        return next((s for s in ("validation", "test") if s in splits), "test")
    return "train"


def resolve_dataset(key: str, value: str) -> list[str]:
    """The local data files of ``value``: ``[value]`` when local, else the split's parquet/JSON/JSONL files of the
    hub dataset's snapshot (downloaded when needed), in name order."""
    ref = parse_dataset(value)
    if ref is None:
        return [value]
    return _once(ref, key, "data", lambda: _dataset_files(ref, key))


def _dataset_files(ref: HubRef, key: str) -> list[str]:
    root = _snapshot(ref, key, ("README.md", ".gitattributes"))  # every repository has the latter
    commit = os.path.basename(root)  # the snapshot's commit: the second fetch reads the same revision
    ref, config, patterns = _plan(ref, key, _card_configs(root))
    wanted = sorted({p for ps in patterns.values() for p in ps}) or [f"*{s}" for s in DATA_SUFFIXES]
    if config is not None and "*" not in patterns:  # the card names the split's files: fetch those alone
        wanted = patterns.get(ref.split or _default_split(key, sorted(patterns)), wanted)
    root = _snapshot(ref, key, wanted, revision=commit if re.fullmatch(r"[0-9a-f]{40}", commit) else None)
    return _choose(root, ref, key, config, patterns)


def local_dataset_files(key: str, directory: str, *, config: str | None = None, split: str | None = None) -> list[str]:
    """The split's data files of a dataset kept in a local directory in its hub layout (e.g. ``hf download ID
    --repo-type dataset --local-dir DIR``): the same choice of configuration and split as for a hub ID."""
    text = ":".join(x for x in (directory, config, split) if x)
    ref = HubRef(text, directory, None, "dataset", config, split)
    ref, chosen, patterns = _plan(ref, key, _card_configs(directory))
    return _choose(directory, ref, key, chosen, patterns)


def _plan(ref: HubRef, key: str, configs: list[dict[str, Any]]) -> tuple[HubRef, dict[str, Any] | None,
                                                                          dict[str, list[str]]]:
    """(the reference with ORG/NAME:CONFIG read as a configuration, the card's configuration, its split patterns)."""
    if ref.config is None and ref.split in {str(c["config_name"]) for c in configs}:  # ORG/NAME:CONFIG
        ref = dataclasses.replace(ref, config=ref.split, split=None)
    config = _pick_config(ref, key, configs)
    return ref, config, (_split_patterns(config) if config is not None else {})


def _choose(root: str, ref: HubRef, key: str, config: dict[str, Any] | None, patterns: dict[str, list[str]]
            ) -> list[str]:
    files = sorted(str(p.relative_to(root)).replace(os.sep, "/") for p in Path(root).rglob("*")
                   if p.is_file() and p.name.lower().endswith(DATA_SUFFIXES) and ".cache" not in p.parts)
    if "*" in patterns:  # a configuration given as a data_dir: its files, splits by name
        files = [f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns["*"])]
    if config is not None and "*" not in patterns:
        by_split = {s: [f for f in files if any(fnmatch.fnmatch(f, p) for p in ps)] for s, ps in patterns.items()}
    else:
        by_split = _files_by_split(files)
        if ref.split is not None and ref.split not in by_split:  # a split of another name, in the file names
            by_split[ref.split] = [f for f in files if ref.split.lower() in _words(f.rsplit(".", 1)[0])]
    known = sorted(s for s, f in by_split.items() if f)
    split = ref.split or _default_split(key, known)
    chosen = by_split.get(split, [])
    if not chosen:
        where = f" (configuration {config['config_name']})" if config is not None else ""
        raise ConfigError(f"{key}={ref.text!r}: the dataset {ref.repo_id}{where} has no parquet/JSON/JSONL files for "
                          f"the split {split!r} (its splits: {', '.join(known) or 'none'}); name a split "
                          f"({ref.repo_id}:SPLIT) or give local files")
    return [os.path.join(root, f) for f in chosen]


# ------------------------------------------------------------------------------------------------------- configs
def resolve_config(cfg: Any) -> Any:
    """``cfg`` (a TrainConfig) with every hub ID replaced by its local files: call once per process before anything
    heavy is built. Unchanged (the same object) when it names no hub ID."""
    done: dict[str, str] = {}

    def model(key: str, value: str | None) -> str | None:
        if value is None or parse_model(value) is None:
            return value
        if value not in done:
            done[value] = resolve_model(key, value)
        return done[value]

    def data(key: str, entries: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f for i, e in enumerate(entries) for f in resolve_dataset(f"{key}[{i}]", e))

    changes = {
        "model": {"path": model("model.path", cfg.model.path),
                  "tokenizer_path": model("model.tokenizer_path", cfg.model.tokenizer_path)},
        # a disabled critic's model_path (model.path by default) is never loaded: nothing to fetch
        "critic": {"model_path": model("critic.model_path", cfg.critic.model_path) if cfg.critic.enable
                   else cfg.critic.model_path},
        "reward": {"reward_model_path": model("reward.reward_model_path", cfg.reward.reward_model_path)},
        "data": {"train_files": data("data.train_files", tuple(cfg.data.train_files)),
                 "val_files": data("data.val_files", tuple(cfg.data.val_files))},
    }
    sections = {}
    for name, values in changes.items():
        section = getattr(cfg, name)
        new = {k: v for k, v in values.items() if v != getattr(section, k)}
        if new:
            sections[name] = dataclasses.replace(section, **new)
    return dataclasses.replace(cfg, **sections) if sections else cfg
