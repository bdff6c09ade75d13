"""Per-step stage profiler: wall-clock intervals of named stages (including concurrent ones), overlap, throughput, MFU.

Usage inside one RL step::

    prof.reset_step()
    with prof.stage("rollout"):
        with prof.stage("prefill", parent="rollout"): ...      # recorded as "rollout/prefill"
        with prof.stage("rollout/decode"): ...                  # same convention, spelled out
    future.add_done_callback(lambda f: prof.record("reward", t0, prof.now()))   # measured elsewhere
    prof.add_counter("tokens", n_tokens)
    metrics.update(prof.step_summary())
    print(prof.format_tree(step=k))

A stage is identified by its full name; ``a/b`` is a sub-stage of ``a``. A stage may be entered many times and from
many threads in one step; its wall time is the length of the *union* of its intervals, so eight reward threads
busy over the same second count one second. Definitions of every number are in :meth:`StageProfiler.step_summary`
and docs/profiling.md.

Timestamps come from ``clock`` (``time.perf_counter`` by default); intervals given to :meth:`StageProfiler.record`
must use the same clock (:meth:`StageProfiler.now`). GPU work is asynchronous: pass ``synchronize`` (e.g.
``torch.cuda.synchronize``) so a stage's end is taken after its kernels finished.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

__all__ = [
    "StageProfiler",
    "union",
    "total_length",
    "intersect",
    "subtract",
    "ROLLOUT", "WAKE_UP", "PREFILL", "DECODE", "POSTPROCESS", "SLEEP", "OLD_LOGPROB", "REF_LOGPROB", "VALUES",
    "REWARD_MODEL", "REWARD", "ADVANTAGE", "CRITIC_UPDATE", "ACTOR_UPDATE", "WEIGHT_SYNC", "SCORING_STAGES",
    "TOKENS", "DECODE_STEPS", "FLOPS",
]

Interval = tuple[float, float]

# Canonical stage names used by the trainer; the tree and docs know these. Any other name works too.
ROLLOUT = "rollout"
WAKE_UP = "rollout/wake_up"
PREFILL = "rollout/prefill"
DECODE = "rollout/decode"
POSTPROCESS = "rollout/postprocess"
SLEEP = "rollout/sleep"
OLD_LOGPROB = "old_logprob"
REF_LOGPROB = "ref_logprob"
VALUES = "values"
REWARD_MODEL = "rm_score"
REWARD = "reward"
ADVANTAGE = "advantage"
CRITIC_UPDATE = "critic_update"
ACTOR_UPDATE = "actor_update"
WEIGHT_SYNC = "weight_sync"
# The SCORE group of the RL step: their time can hide behind rollout and behind each other.
SCORING_STAGES = (REWARD, REWARD_MODEL, REF_LOGPROB, VALUES, OLD_LOGPROB)

# Counter names with a meaning in step_summary(); other counters are reported as `count/<name>`.
TOKENS = "tokens"
DECODE_STEPS = "decode_steps"
FLOPS = "flops"

# Tree layout: (stage, label, always shown). The promised sections are always printed, "not run" when absent.
_TREE = (
    (ROLLOUT, "Rollout Generation", True),
    (OLD_LOGPROB, "Old Log-Prob", False),
    (REF_LOGPROB, "Reference Log-Prob", False),
    (VALUES, "Critic Scoring", True),
    (REWARD_MODEL, "RM Evaluation", True),
    (REWARD, "Reward Function", False),
    (ADVANTAGE, "Advantage ({estimator}) Computation", True),
    (CRITIC_UPDATE, "Critic Update", True),
    (ACTOR_UPDATE, "Actor Update", True),
    (WEIGHT_SYNC, "Weight Sync", True),
)
# algorithm.adv_estimator -> its name in the tree's advantage line
ESTIMATOR_NAMES = {"gae": "GAE", "grpo": "GRPO", "dr_grpo": "Dr. GRPO", "rloo": "RLOO",
                   "reinforce_plus_plus": "REINFORCE++", "reinforce_plus_plus_baseline": "REINFORCE++ baseline",
                   "remax": "ReMax"}
_SUB_LABELS = {WAKE_UP: "Wake Up (weights, KV cache)", PREFILL: "Prefill", DECODE: "Decode Loop",
               POSTPROCESS: "Postprocess", SLEEP: "Sleep (free memory)"}


def _child_order(parent: str, child: str) -> tuple[int, str]:
    """Sort key for a descendant of ``parent``: the promised rollout sub-stages in pipeline order, then by name;
    a grandchild sorts right after its own ancestor."""
    first = parent + "/" + child[len(parent) + 1:].split("/")[0]
    order = list(_SUB_LABELS)
    return (order.index(first) if first in order else len(order), child)


# ---------------------------------------------------------------------------------------------------------------------
# Interval arithmetic on half-open [start, end) intervals; a "set" is a sorted list of disjoint intervals.
# ---------------------------------------------------------------------------------------------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the points covered by ``intervals`` (touching ones merge)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total_length(intervals: Iterable[Interval]) -> float:
    """Measure of the union of ``intervals`` (overlaps counted once)."""
    return sum((e - s for s, e in union(intervals)), 0.0)


def intersect(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Points covered by both ``a`` and ``b``, as a sorted disjoint list."""
    ua, ub = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(ua) and j < len(ub):
        start, end = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if start < end:
            out.append((start, end))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Points covered by ``a`` but not by ``b``, as a sorted disjoint list."""
    out: list[Interval] = []
    ub = union(b)
    for start, end in union(a):
        cursor = start
        for bs, be in ub:
            if be <= cursor:
                continue
            if bs >= end:
                break
            if bs > cursor:
                out.append((cursor, bs))
            cursor = max(cursor, be)
            if cursor >= end:
                break
        if cursor < end:
            out.append((cursor, end))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The profiler
# ---------------------------------------------------------------------------------------------------------------------
class StageProfiler:
    """Thread-safe recorder of stage intervals and counters for the current RL step.

    ``peak_flops`` is one device's peak FLOP/s for the dtype in use (e.g. 989e12 for H200 bf16 dense) and
    ``n_devices`` the devices whose work the ``tokens`` / ``flops`` counters describe (world size when the counters
    are global, 1 when they are this rank's). ``flops_per_token`` turns the ``tokens`` counter into achieved FLOPs
    unless the caller counts ``flops`` directly (more exact when stages differ: 2N per generated token, 6N per
    trained token). ``scoring_stages`` are the stages whose hiding defines the overlap efficiency.
    ``advantage_estimator`` (algorithm.adv_estimator) names the tree's advantage line: "Advantage (GRPO) ...".
    """

    def __init__(self, *, synchronize: Callable[[], None] | None = None, peak_flops: float | None = None,
                 n_devices: int = 1, flops_per_token: float | None = None,
                 scoring_stages: Iterable[str] = SCORING_STAGES, clock: Callable[[], float] = time.perf_counter,
                 advantage_estimator: str = "gae"):
        if n_devices < 1:
            raise ValueError(f"StageProfiler: n_devices={n_devices} must be >= 1")
        if peak_flops is not None and peak_flops <= 0:
            raise ValueError(f"StageProfiler: peak_flops={peak_flops} must be > 0 (FLOP/s of one device)")
        if flops_per_token is not None and flops_per_token <= 0:
            raise ValueError(f"StageProfiler: flops_per_token={flops_per_token} must be > 0")
        self.synchronize = synchronize
        self.peak_flops = peak_flops
        self.n_devices = n_devices
        self.flops_per_token = flops_per_token
        self.scoring_stages = tuple(scoring_stages)
        self.advantage_estimator = advantage_estimator  # algorithm.adv_estimator: names the advantage line
        self._clock = clock
        self._lock = threading.Lock()
        self._intervals: dict[str, list[Interval]] = {}
        self._counters: dict[str, float] = {}

    # -- recording --------------------------------------------------------------------------------------------------
    def now(self) -> float:
        """The profiler's clock; use it for timestamps passed to :meth:`record`."""
        return self._clock()

    @staticmethod
    def _full_name(name: str, parent: str | None) -> str:
        if not name or name.startswith("/") or name.endswith("/"):
            raise ValueError(f"stage name {name!r} is invalid; use a non-empty name like 'rollout' or 'rollout/decode'")
        return f"{parent}/{name}" if parent else name

    @contextmanager
    def stage(self, name: str, parent: str | None = None, *, sync: bool = True) -> Iterator[None]:
        """Time the enclosed block as stage ``parent/name`` (or ``name``). Safe to use from any thread.

        With ``sync`` (default) the ``synchronize`` hook runs on entry and exit so queued device work is attributed
        to the right stage; pass ``sync=False`` for host-only work such as reward functions in a thread pool.
        """
        full = self._full_name(name, parent)
        if sync and self.synchronize is not None:
            self.synchronize()
        start = self._clock()
        try:
            yield
        finally:
            if sync and self.synchronize is not None:
                self.synchronize()
            self.record(full, start, self._clock())

    def record(self, name: str, start: float, end: float, parent: str | None = None) -> None:
        """Add an interval measured elsewhere (e.g. in a future's callback), in :meth:`now`'s clock."""
        if not end >= start:
            raise ValueError(f"record({name!r}): end={end} is before start={start}; pass (start, end) from now()")
        full = self._full_name(name, parent)
        with self._lock:
            self._intervals.setdefault(full, []).append((float(start), float(end)))

    def add_counter(self, name: str, value: float) -> None:
        """Add ``value`` to this step's counter ``name`` (``tokens``, ``decode_steps``, ``flops`` have meanings)."""
        with self._lock:
            self._counters[name] = self._counters.get(name, 0.0) + float(value)

    def reset_step(self) -> None:
        """Forget this step's intervals and counters. A stage still open is recorded into the next step."""
        with self._lock:
            self._intervals = {}
            self._counters = {}

    def intervals(self) -> dict[str, list[Interval]]:
        """A copy of this step's raw intervals by full stage name."""
        with self._lock:
            return {k: list(v) for k, v in self._intervals.items()}

    def counters(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counters)

    # -- analysis ---------------------------------------------------------------------------------------------------
    def overlap(self, a: str, b: str) -> float:
        """Seconds during which stages ``a`` and ``b`` both ran in this step."""
        iv = self.intervals()
        return total_length(intersect(iv.get(a, []), iv.get(b, [])))

    def step_summary(self) -> dict[str, float]:
        """This step's numbers as a flat ``{key: value}`` dict (keys absent when their inputs are):

        * ``timing/<stage>_s`` — wall time of every stage and sub-stage: length of the union of its intervals.
        * ``timing/step_s`` — from the earliest start to the latest end of any interval in the step.
        * ``timing/untracked_s`` — part of the step inside no top-level stage.
        * ``timing/decode_step_ms`` — ``rollout/decode`` time / ``decode_steps`` counter (or its interval count
          when it was recorded once per decode step).
        * ``overlap/<stage>_s`` — for each top-level stage: seconds it ran while any *other* top-level stage ran.
        * ``overlap/<stage>_with_rollout_s`` — for each scoring stage: seconds it overlapped ``rollout``.
        * ``overlap/scoring_serial_s`` = Σ_i len(S_i) over scoring stages i (their cost if run one after another);
          ``overlap/scoring_exposed_s`` = len(∪_i S_i \\ O) where O is the union of all non-scoring top-level stages
          (time in which only scoring ran: what scoring added to the step); ``overlap/scoring_hidden_s`` = their
          difference; ``overlap/efficiency`` = hidden / serial ∈ [0, 1]: the share of scoring time hidden behind
          other stages, including behind other scoring stages.
        * ``perf/tokens_per_s`` = ``tokens`` / step_s, ``perf/tokens_per_s_per_device`` = that / n_devices.
        * ``perf/tflops_per_device`` and ``perf/mfu`` = achieved FLOP/s / (peak_flops · n_devices), where achieved
          FLOPs = the ``flops`` counter, or ``flops_per_token`` · ``tokens``.
        * ``count/<name>`` — every counter's value.
        """
        iv, counters = self.intervals(), self.counters()
        out: dict[str, float] = {}
        if not iv:
            return out
        sets = {name: union(spans) for name, spans in iv.items()}
        for name in sorted(sets):
            out[f"timing/{name}_s"] = total_length(sets[name])
        all_spans = [span for spans in sets.values() for span in spans]
        step_s = max(e for _, e in all_spans) - min(s for s, _ in all_spans)
        out["timing/step_s"] = step_s
        top = [name for name in sets if "/" not in name]
        out["timing/untracked_s"] = max(0.0, step_s - total_length(s for name in top for s in sets[name]))
        # Per-decode-step time needs a step count: the counter, else one interval per decode step.
        decode_steps = counters.get(DECODE_STEPS) or (len(iv[DECODE]) if len(iv.get(DECODE, ())) > 1 else 0)
        if DECODE in sets and decode_steps:
            out["timing/decode_step_ms"] = 1e3 * out[f"timing/{DECODE}_s"] / decode_steps

        for name in top:
            others = [s for other in top if other != name for s in sets[other]]
            out[f"overlap/{name}_s"] = total_length(intersect(sets[name], others))
        scoring = [name for name in top if name in self.scoring_stages]
        if scoring:
            if ROLLOUT in sets:
                for name in scoring:
                    out[f"overlap/{name}_with_rollout_s"] = total_length(intersect(sets[name], sets[ROLLOUT]))
            serial = sum(out[f"timing/{name}_s"] for name in scoring)
            non_scoring = [s for name in top if name not in self.scoring_stages for s in sets[name]]
            exposed = total_length(subtract([s for name in scoring for s in sets[name]], non_scoring))
            out["overlap/scoring_serial_s"] = serial
            out["overlap/scoring_exposed_s"] = exposed
            out["overlap/scoring_hidden_s"] = serial - exposed
            if serial > 0:
                out["overlap/efficiency"] = (serial - exposed) / serial

        for name, value in sorted(counters.items()):
            out[f"count/{name}"] = value
        if step_s > 0:
            if TOKENS in counters:
                out["perf/tokens_per_s"] = counters[TOKENS] / step_s
                out["perf/tokens_per_s_per_device"] = out["perf/tokens_per_s"] / self.n_devices
            flops = counters.get(FLOPS)
            if flops is None and self.flops_per_token is not None and TOKENS in counters:
                flops = self.flops_per_token * counters[TOKENS]
            if flops is not None:
                out["perf/tflops_per_device"] = flops / step_s / self.n_devices / 1e12
                if self.peak_flops is not None:
                    out["perf/mfu"] = flops / step_s / (self.peak_flops * self.n_devices)
        return out

    def format_tree(self, step: int | None = None) -> str:
        """The step's profile as a text tree (sections per docs/profiling.md)."""
        s = self.step_summary()
        n_calls = {name: len(spans) for name, spans in self.intervals().items()}
        step_s = s.get("timing/step_s", 0.0)
        width = 34

        def pct(x: float, of: float) -> str:
            return f"{100.0 * x / of:5.1f}%" if of > 0 else "    -"

        def line(prefix: str, label: str, stage: str) -> str:
            key = f"timing/{stage}_s"
            if key not in s:
                return f"{prefix}{label:<{width - len(prefix)}} {'not run':>10}"
            t = s[key]
            text = f"{prefix}{label:<{width - len(prefix)}} {t:9.3f}s  {pct(t, step_s)}"
            if stage == DECODE and "timing/decode_step_ms" in s:
                steps = int(s.get(f"count/{DECODE_STEPS}", n_calls[stage]))
                text += f"  (avg {s['timing/decode_step_ms']:.2f} ms/step over {steps} steps)"
            elif n_calls.get(stage, 0) > 1:
                text += f"  ({n_calls[stage]} calls)"
            if stage in self.scoring_stages and "/" not in stage:
                if ROLLOUT in n_calls:
                    ov = s.get(f"overlap/{stage}_with_rollout_s", 0.0)
                    text += f"  overlap with rollout {ov:.3f}s ({pct(ov, t).strip()})"
                hidden = s.get(f"overlap/{stage}_s", 0.0)
                text += f", with any stage {hidden:.3f}s ({pct(hidden, t).strip()})"
            elif s.get(f"overlap/{stage}_s", 0.0) > 0:
                text += f"  overlaps other stages {s[f'overlap/{stage}_s']:.3f}s"
            return text

        known = {stage for stage, _, _ in _TREE}
        stages = sorted(n_calls)
        estimator = ESTIMATOR_NAMES.get(self.advantage_estimator, self.advantage_estimator)
        rows: list[tuple[str, str, bool]] = [(st, label.format(estimator=estimator), always)
                                             for st, label, always in _TREE]
        rows += [(st, st.replace("_", " ").title(), False) for st in stages if "/" not in st and st not in known]
        rows = [r for r in rows if r[2] or f"timing/{r[0]}_s" in s]

        title = "Step profile" + (f" (step {step})" if step is not None else "")
        lines = [title]
        for i, (stage, label, _) in enumerate(rows):
            last = i == len(rows) - 1
            lines.append(line("└─ " if last else "├─ ", label, stage))
            children = sorted((c for c in stages if c.startswith(stage + "/")), key=lambda c: _child_order(stage, c))
            for j, child in enumerate(children):
                bar = "   " if last else "│  "
                branch = "└─ " if j == len(children) - 1 else "├─ "
                depth = child.count("/") - stage.count("/") - 1
                label_c = _SUB_LABELS.get(child, child[len(stage) + 1:])
                lines.append(line(bar + "   " * depth + branch, label_c, child))
        lines.append(f"{'Untracked (in no stage)':<{width}} {s.get('timing/untracked_s', 0.0):9.3f}s  "
                     f"{pct(s.get('timing/untracked_s', 0.0), step_s)}")
        lines.append(f"{'Total Wall Time':<{width}} {step_s:9.3f}s")
        if "overlap/efficiency" in s:
            lines.append(f"{'Overlap Efficiency':<{width}} {100 * s['overlap/efficiency']:8.1f}%   "
                         f"({s['overlap/scoring_hidden_s']:.3f}s of {s['overlap/scoring_serial_s']:.3f}s scoring "
                         f"hidden; {s['overlap/scoring_exposed_s']:.3f}s exposed)")
        else:
            lines.append(f"{'Overlap Efficiency':<{width}} {'n/a (no scoring stage ran)':>10}")
        perf = []
        if "perf/tokens_per_s" in s:
            perf.append(f"{s['perf/tokens_per_s']:.1f} tokens/s ({s['perf/tokens_per_s_per_device']:.1f}/device)")
        if "perf/tflops_per_device" in s:
            perf.append(f"{s['perf/tflops_per_device']:.2f} TFLOP/s/device")
        if "perf/mfu" in s:
            perf.append(f"MFU {100 * s['perf/mfu']:.1f}%")
        if perf:
            lines.append(f"{'Throughput':<{width}} " + ", ".join(perf))
        return "\n".join(lines)
