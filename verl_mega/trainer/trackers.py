"""Experiment trackers as metric sinks beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

Each is an optional package (``pip install wandb``, ``pip install mlflow-skinny``; the ``wandb`` / ``mlflow``
extras of setup.py). :func:`check_trackers` refuses a run that asks for one that cannot log, with one line, before
anything is built: the package is not installed; wandb has no credentials (no ``WANDB_API_KEY``, no ``~/.netrc``
entry from ``wandb login``, not ``WANDB_MODE=offline``); ``MLFLOW_TRACKING_URI`` names a server that does not
answer.

* **wandb**: ``wandb.init(project=logging.project, name=logging.run_name, dir=<output_dir>)``; ``WANDB_MODE=offline``
  writes the run under ``<output_dir>/wandb/`` with no network (``wandb sync`` uploads it later).
* **mlflow**: the experiment ``logging.project``, a run named ``logging.run_name``; the tracking URI is
  ``MLFLOW_TRACKING_URI`` when set, else a local file store in ``<output_dir>/mlruns`` (MLflow keeps that backend
  behind ``MLFLOW_ALLOW_FILE_STORE``, which is set for it).

Both get the run's config once and every step's numeric metrics at that step. A resumed run continues the tracker
run it started (the ids are kept in ``<output_dir>/trackers.json``); a fresh run starts new ones. A tracker keeps the
steps it already has: after a resume, steps that a killed run logged past its checkpoint are logged again (MLflow
keeps both values, wandb ignores the repeats).
"""

from __future__ import annotations

import abc
import importlib.util
import json
import logging
import math
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TRACKERS", "TRACKERS_FILE", "TrackerNotInstalled", "TrackerNotConfigured", "check_trackers",
           "open_trackers", "Tracker"]

logger = logging.getLogger("verl_mega.metrics")

TRACKERS_FILE = "trackers.json"
# tracker -> (module to import, what to install)
TRACKERS = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}


class TrackerNotInstalled(ValueError):
    """A tracker is asked for (logging.wandb / logging.mlflow) but its package is not installed."""


class TrackerNotConfigured(ValueError):
    """A tracker is asked for but could not log: wandb without credentials, an MLflow server that does not answer."""


#: how long the MLflow tracking server may take to accept a connection at start-up
MLFLOW_CONNECT_TIMEOUT_S = 10.0


def check_trackers(wanted: Mapping[str, bool]) -> None:
    """One line naming the package to install, the credentials or server to provide, or the key to turn off, for a
    tracker that is asked for and could not log (see the module docstring). Reads no more than local files and
    the environment, and, for an MLflow server, opens one connection to it."""
    for name, on in wanted.items():
        if not on:
            continue
        module, package = TRACKERS[name]
        if importlib.util.find_spec(module) is None:
            raise TrackerNotInstalled(f"logging.{name}=true needs the {module} package, which is not installed; "
                                      f"pip install {package} (or verl_mega[{name}]) or set logging.{name}=false")
        problem = _wandb_problem() if name == "wandb" else _mlflow_problem()
        if problem:
            raise TrackerNotConfigured(f"logging.{name}=true, but {problem}; or set logging.{name}=false")


def _wandb_problem() -> str | None:
    """Why wandb.init would fail for want of credentials, as wandb looks for them: its mode (WANDB_MODE, `wandb
    offline`), WANDB_API_KEY / WANDB_IDENTITY_TOKEN_FILE, its settings' api_key, then the .netrc entry that `wandb
    login` writes for its server. None when it would start (or when this wandb version's settings are not where
    this check reads them: then wandb.init decides)."""
    try:  # the settings wandb.init would load (a fresh copy: wandb's process-wide one is cached at first use)
        from wandb.sdk.lib import wbauth
        from wandb.sdk.wandb_settings import Settings

        settings = Settings()
        config_dir = os.environ.get("WANDB_CONFIG_DIR") or os.path.join("~", ".config", "wandb")
        settings.settings_system = os.path.join(os.path.expanduser(config_dir), "settings")
        settings.update_from_system_settings()
        settings.update_from_env_vars(dict(os.environ))
        mode, host, api_key = settings.mode, settings.base_url, settings.api_key
    except (ImportError, AttributeError, TypeError):
        return None
    if mode in ("offline", "dryrun", "disabled") or api_key:
        return None
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    try:
        if wbauth.read_netrc_auth(host=host):
            return None
    except Exception as exc:  # noqa: BLE001 - wandb's own refusal of what it found, e.g. a malformed key
        return f"the W&B credentials for {host} are unusable ({' '.join(str(exc).split())}); run `wandb login` again"
    netrc = os.environ.get("NETRC") or "~/.netrc"
    return (f"there are no W&B credentials for {host} (no WANDB_API_KEY, no entry in {netrc}); set WANDB_API_KEY, "
            f"run `wandb login`, or set WANDB_MODE=offline to log under <output_dir>/wandb (`wandb sync` uploads it "
            f"later)")


def _mlflow_problem() -> str | None:
    """Why the MLflow client could not log: MLFLOW_TRACKING_URI names an HTTP(S) server that does not accept a
    connection. None otherwise (unset: a local file store under the output directory; other schemes: MLflow
    decides)."""
    from urllib.parse import urlsplit

    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((parts.hostname or "", port), timeout=MLFLOW_CONNECT_TIMEOUT_S):
            return None
    except (OSError, ValueError) as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        return (f"the MLflow tracking server MLFLOW_TRACKING_URI={uri} does not answer ({why}); start it, fix the "
                f"URI, or unset MLFLOW_TRACKING_URI to log to <output_dir>/mlruns")


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


class Tracker(abc.ABC):
    """One tracker run: :meth:`log` a step's numbers, :meth:`close` at the end."""

    name = ""

    @abc.abstractmethod
    def log(self, numbers: Mapping[str, float], step: int) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...


class _Wandb(Tracker):
    name = "wandb"

    def __init__(self, output_dir: Path, project: str, run_name: str, config: Mapping[str, Any],
                 run_id: str | None) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run_name, dir=str(output_dir), config=dict(config),
                               id=run_id, resume="allow" if run_id else None)
        self.run_id = self._run.id

    def log(self, numbers: Mapping[str, float], step: int) -> None:
        self._run.log(dict(numbers), step=step)

    def close(self) -> None:
        self._run.finish()


class _Mlflow(Tracker):
    name = "mlflow"

    def __init__(self, output_dir: Path, project: str, run_name: str, config: Mapping[str, Any],
                 run_id: str | None) -> None:
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # our default: a file store beside the run's other records
            uri = (output_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = mlflow.MlflowClient(tracking_uri=uri)
        self.uri = uri
        if run_id is None:
            experiment = self._client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
            run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
            params = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self._client.log_batch(run_id, params=params[start:start + 100])
        self.run_id = run_id
        self._entities = mlflow.entities

    def log(self, numbers: Mapping[str, float], step: int) -> None:
        import time

        now = int(time.time() * 1000)
        metrics = [self._entities.Metric(k, float(v), now, step) for k, v in numbers.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def open_trackers(output_dir: str | os.PathLike, *, wanted: Mapping[str, bool], project: str, run_name: str | None,
                  config: Mapping[str, Any] | None, resume: bool) -> list[Tracker]:
    """Start (or, resuming, continue) the tracker runs that ``wanted`` turns on; their ids go to trackers.json."""
    check_trackers(wanted)
    out = Path(output_dir)
    ids_file = out / TRACKERS_FILE
    known: dict[str, str] = {}
    if resume and ids_file.exists():
        try:
            known = json.loads(ids_file.read_text())
        except (OSError, ValueError):
            logger.warning("%s is unreadable; the trackers start new runs", ids_file)
    name = run_name or out.resolve().name
    trackers: list[Tracker] = []
    try:
        for kind, cls in (("wandb", _Wandb), ("mlflow", _Mlflow)):
            if wanted.get(kind):
                trackers.append(cls(out, project, name, config or {}, known.get(kind)))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    if trackers:
        tmp = ids_file.with_name(ids_file.name + ".tmp")
        tmp.write_text(json.dumps({t.name: t.run_id for t in trackers}))  # type: ignore[attr-defined]
        os.replace(tmp, ids_file)
    return trackers


def finite_numbers(numbers: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a step's record (trackers refuse or mis-plot NaN / inf)."""
    return {k: float(v) for k, v in numbers.items() if math.isfinite(float(v))}
