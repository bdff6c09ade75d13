"""Metric sinks of a run (rank 0 only): metrics.jsonl, TensorBoard, wandb and MLflow (trainer/trackers.py), console /
progress bar, and a curve PNG at the end.

``metrics.jsonl`` is the record of the run: one JSON object per step with ``step`` and free-form ``a/b`` keys,
flushed and fsync'ed line by line so a killed job loses nothing already logged. Non-finite numbers are written as
``null`` (strict JSON). A resumed run passes ``resume_step=k``: lines with step > k (written after the checkpoint
it resumes from) are dropped first, so the file never holds a step twice; a fresh run (``resume_step=None``)
starts the file empty. TensorBoard events go to ``<output_dir>/tensorboard`` with the same purge point.

The console shows a tqdm bar with a short postfix when stderr is a terminal, otherwise one compact line per
``log_every`` steps on stdout. At :meth:`MetricsLogger.close` the reward / KL / entropy curves are read back from
metrics.jsonl (so a resumed run plots its whole history) into ``<output_dir>/curves.png``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_mega.trainer.trackers import check_trackers, finite_numbers, open_trackers

__all__ = ["MetricsLogger", "plot_curves", "read_metrics", "write_summary", "METRICS_FILE", "CURVES_FILE",
           "TENSORBOARD_DIR", "SUMMARY_FILE"]

logger = logging.getLogger("verl_mega.metrics")

METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
TENSORBOARD_DIR = "tensorboard"
SUMMARY_FILE = "summary.txt"

# (panel title, preferred keys in order, fallback name): the first preferred key present wins, else the first key
# (sorted) whose last `/` segment is `<name>` or `<name>_mean`, else one under `<name>/` that is not a coefficient.
_PANELS = (
    ("reward/mean", ("reward/mean",), "reward"),
    ("KL", ("kl/actor_ref", "kl/reward_kl", "actor/kl", "kl/mean", "actor/ppo_kl", "kl"), "kl"),
    ("entropy", ("actor/entropy", "actor/entropy_rollout", "entropy/mean", "entropy"), "entropy"),
)
_NOT_A_CURVE = ("coef", "coeff", "target", "horizon")
_STEP_TIME_KEY = "timing/step_s"


def _find_key(keys: Sequence[str], preferred: Sequence[str], name: str) -> str | None:
    present = set(keys)
    for key in preferred:
        if key in present:
            return key
    lowered = sorted((key.lower().split("/"), key) for key in present)
    for parts, key in lowered:
        if parts[-1] in (name, f"{name}_mean"):
            return key
    for parts, key in lowered:
        if parts[0] == name and len(parts) > 1 and parts[-1] not in _NOT_A_CURVE:
            return key
    return None


def _json_value(key: str, value: Any) -> Any:
    """A JSON-ready value: numbers (incl. numpy / 0-d torch scalars) as int/float with non-finite -> None."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            value = value.item()
        except (ValueError, RuntimeError) as exc:
            raise TypeError(f"metric {key!r} is not a scalar ({exc}); log a number, e.g. t.mean().item()") from None
    if isinstance(value, int):  # bool included
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    raise TypeError(f"metric {key!r} has type {type(value).__name__}; log numbers, strings or booleans only")


def _fmt(value: float) -> str:
    if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
        return f"{value:.2e}"
    return f"{value:.4g}"


def _read_lines(path: str | os.PathLike) -> list[tuple[str, dict[str, Any]]]:
    """(raw line, record) pairs of a metrics.jsonl file; a torn or foreign line (no integer ``step``) is skipped
    with a warning."""
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d is not valid JSON (torn write?); skipped", path, lineno)
                continue
            if not isinstance(record, dict) or isinstance(record.get("step"), bool) \
                    or not isinstance(record.get("step"), int):
                logger.warning("%s:%d has no integer 'step'; skipped", path, lineno)
                continue
            out.append((line if line.endswith("\n") else line + "\n", record))
    return out


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in file order (torn or foreign lines skipped with a warning)."""
    return [record for _, record in _read_lines(path)]


def plot_curves(jsonl_path: str | os.PathLike, png_path: str | os.PathLike) -> bool:
    """Plot reward/mean, KL and entropy against step from ``jsonl_path`` into ``png_path`` (panels whose key never
    appears are skipped). Returns False, writing nothing, when none of the three is present."""
    records = read_metrics(jsonl_path)
    keys = sorted({k for r in records for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    panels = []
    for title, preferred, name in _PANELS:
        key = _find_key(keys, preferred, name)
        if key is None:
            continue
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        panels.append((title, key, points))
    if not panels:
        return False
    try:  # the object API with the Agg canvas: no pyplot global state, no display needed
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ImportError(f"logging.plot=true needs matplotlib ({exc}); pip install matplotlib or set "
                          "logging.plot=false") from None
    fig = Figure(figsize=(4.5 * len(panels), 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    for i, (title, key, points) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="." if len(points) < 50 else None, linewidth=1.5)
        ax.set_title(title if title == key else f"{title} ({key})", fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    png_path = Path(png_path)
    tmp = png_path.with_name(png_path.name + ".tmp")
    fig.savefig(tmp, format="png")
    os.replace(tmp, png_path)
    return True


def write_summary(output_dir: str | os.PathLike, *, wall_s: float, checkpoint: Path | None) -> str:
    """The end-of-run summary: steps, the mean reward over the first and the last (up to) 10 logged steps, wall time
    of this run, and where the metrics, curves, TensorBoard events and last checkpoint are. Written to
    ``<output_dir>/summary.txt`` (atomically) and returned for printing."""
    out = Path(output_dir)
    metrics = out / METRICS_FILE
    rows = read_metrics(metrics) if metrics.exists() else []
    lines = [f"run summary: {out}"]
    if rows:
        lines.append(f"  steps       {rows[-1]['step']} ({len(rows)} logged)")
        key = _find_key(sorted({k for r in rows for k in r}), *_PANELS[0][1:])
        values = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))] if key else []
        if values:
            k = min(10, max(1, len(values) // 2))
            first, last = values[:k], values[-k:]
            lines.append(f"  {key:<11} first {sum(v for _, v in first) / k:.3f} (steps {first[0][0]}-{first[-1][0]}), "
                         f"last {sum(v for _, v in last) / k:.3f} (steps {last[0][0]}-{last[-1][0]})")
    minutes, seconds = divmod(int(round(wall_s)), 60)
    lines.append(f"  wall time   {minutes // 60}h {minutes % 60:02d}m {seconds:02d}s" if minutes >= 60 else
                 f"  wall time   {minutes}m {seconds:02d}s")
    for label, path in (("metrics", metrics), ("curves", out / CURVES_FILE), ("tensorboard", out / TENSORBOARD_DIR)):
        if path.exists():
            lines.append(f"  {label:<11} {path}")
    lines.append(f"  checkpoint  {checkpoint if checkpoint is not None else 'none saved'}")
    text = "\n".join(lines) + "\n"
    tmp = out / (SUMMARY_FILE + ".tmp")
    out.mkdir(parents=True, exist_ok=True)
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out / SUMMARY_FILE)
    return text


class MetricsLogger:
    """Write each step's metrics to the enabled sinks; on ranks other than 0 every method does nothing.

    ``total_steps`` sizes the progress bar; ``resume_step`` is the last step of the checkpoint a resumed run
    starts from (``None`` for a fresh run); ``log_every`` thins the console lines only.
    """

    def __init__(self, output_dir: str | os.PathLike, *, console: bool = True, progress_bar: bool = True,
                 jsonl: bool = True, tensorboard: bool = True, plot: bool = True, total_steps: int | None = None,
                 rank: int = 0, resume_step: int | None = None, log_every: int = 1, wandb: bool = False,
                 mlflow: bool = False, project: str = "verl_mega", run_name: str | None = None,
                 config: Mapping[str, Any] | None = None):
        if plot and not jsonl:
            raise ValueError("logging.plot=true reads the curves back from metrics.jsonl; set logging.jsonl=true or "
                             "logging.plot=false")
        if resume_step is not None and resume_step < 0:
            raise ValueError(f"resume_step={resume_step} must be >= 0 (the last step of the resumed checkpoint)")
        if log_every < 1:
            raise ValueError(f"log_every={log_every} must be >= 1")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"total_steps={total_steps} must be >= 1 or None")
        self.output_dir = Path(output_dir)
        self.active = rank == 0
        self.console, self.plot, self.log_every, self.total_steps = console, plot, log_every, total_steps
        self.jsonl_path = self.output_dir / METRICS_FILE if jsonl else None
        self._file = None
        self._writer = None
        self._bar = None
        self._trackers: list = []
        self._closed = False
        self._last_step: int | None = None
        if not self.active:
            return
        wanted = {"wandb": wandb, "mlflow": mlflow}
        check_trackers(wanted)  # before anything is written
        self.output_dir.mkdir(parents=True, exist_ok=True)
        kept = 0
        if self.jsonl_path is not None:
            kept = self._truncate_jsonl(resume_step)
            self._file = open(self.jsonl_path, "a", encoding="utf-8")
        if resume_step is not None:  # steps up to the checkpoint belong to the earlier run, logged or not
            self._last_step = resume_step
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise ImportError(f"logging.tensorboard=true needs the tensorboard package ({exc}); pip install "
                                  "tensorboard or set logging.tensorboard=false") from None
            # purge_step makes TensorBoard drop events a killed run wrote after the checkpoint we resume from.
            self._writer = SummaryWriter(log_dir=str(self.output_dir / TENSORBOARD_DIR),
                                         purge_step=0 if resume_step is None else resume_step + 1)
        self._trackers = open_trackers(self.output_dir, wanted=wanted, project=project, run_name=run_name,
                                       config=config, resume=bool(resume_step))
        if progress_bar and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=kept, desc="RL steps", unit="step", dynamic_ncols=True)

    def _truncate_jsonl(self, resume_step: int | None) -> int:
        """Keep only lines with step <= resume_step (none for a fresh run); return how many were kept."""
        if not self.jsonl_path.exists():
            return 0
        records = _read_lines(self.jsonl_path)
        keep = [] if resume_step is None else [(line, r) for line, r in records if r["step"] <= resume_step]
        if resume_step is None and records:
            logger.warning("%s: fresh run (no resume_step), dropping %d old lines", self.jsonl_path, len(records))
        elif len(keep) < len(records):
            logger.info("%s: resuming after step %d, dropping %d later lines", self.jsonl_path, resume_step,
                        len(records) - len(keep))
        tmp = self.jsonl_path.with_name(self.jsonl_path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(line for line, _ in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.jsonl_path)
        return len(keep)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record one step's metrics (numbers, strings or booleans; tensors/numpy scalars are converted)."""
        if not self.active:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log() after close(); create a new logger")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        if "step" in metrics and metrics["step"] != step:
            raise ValueError(f"metrics['step']={metrics['step']!r} disagrees with step={step}; drop the key")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"step {step} is not after the last logged step {self._last_step}; log each step once "
                             "(merge extra metrics, e.g. validation, into that step's dict)")
        record: dict[str, Any] = {"step": step}
        record.update((str(k), _json_value(str(k), v)) for k, v in metrics.items() if k != "step")
        self._last_step = step
        if self._file is not None:
            self._file.write(json.dumps(record, allow_nan=False) + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())  # a kill after this line returns cannot lose the step
        numbers = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._writer is not None:
            for key, value in numbers.items():
                self._writer.add_scalar(key, value, step)
            self._writer.flush()
        if self._trackers:
            finite = finite_numbers(numbers)
            for tracker in self._trackers:
                tracker.log(finite, step)
        self._to_console(numbers, step)

    def _to_console(self, numbers: Mapping[str, float], step: int) -> None:
        keys = list(numbers)
        shown = [(label, _find_key(keys, preferred, name)) for label, preferred, name in _PANELS]
        shown = [(label, key) for label, key in shown if key is not None]
        step_s = numbers.get(_STEP_TIME_KEY)
        if self._bar is not None:
            short = {"reward/mean": "reward", "KL": "kl", "entropy": "ent"}
            parts = [f"{short[label]} {_fmt(numbers[key])}" for label, key in shown]
            if step_s is not None:
                parts.append(f"{step_s:.2f}s/step")
            self._bar.set_postfix_str(" ".join(parts), refresh=False)
            self._bar.update(1)
        elif self.console and (step % self.log_every == 0 or step == self.total_steps):
            total = f"/{self.total_steps}" if self.total_steps else ""
            parts = [f"step {step}{total}"] + [f"{key} {_fmt(numbers[key])}" for _, key in shown]
            if step_s is not None:
                parts.append(f"step_s {step_s:.2f}")
            print(" | ".join(parts), flush=True)

    def close(self) -> None:
        """Flush and close every sink, then write curves.png (plot errors are raised after the sinks are closed)."""
        if not self.active or self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
        if self._writer is not None:
            self._writer.close()
        if self._file is not None:
            self._file.close()
        for tracker in self._trackers:
            tracker.close()
        if self.plot and self.jsonl_path is not None and self.jsonl_path.exists():
            if not plot_curves(self.jsonl_path, self.output_dir / CURVES_FILE):
                logger.info("no reward/KL/entropy keys in %s; %s not written", self.jsonl_path, CURVES_FILE)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # do not let a plotting problem mask the exception that is already propagating
            self.close()
        except Exception:  # noqa: BLE001
            logger.exception("closing the metric sinks failed while handling another error")
