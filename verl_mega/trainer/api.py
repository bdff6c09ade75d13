"""Python entry point to the trainer, in the shape ``RLTrainer.create(actor=…, actor_backend=vLLMBackend(…))``.

A thin façade over the recipe machinery: the arguments become dotted config overrides of a recipe, and
:func:`verl_mega.trainer.setup.build_job` builds exactly what ``python -m verl_mega.train`` builds. The façade owns
that job (:class:`TrainingRun`) and steps it as :func:`verl_mega.train.run` does, through the same functions
(:mod:`verl_mega.trainer.loop`: non-finite guard, validation, stop agreement, checkpoints)::

    from verl_mega import RLTrainer, vLLMBackend

    run = RLTrainer.create(actor="tiny", actor_backend=vLLMBackend(gen_tp=1, kv_cache_memory_bytes=256 << 20),
                           overrides={"trainer.total_steps": 20, "trainer.output_dir": "outputs/api"})
    run.enable_profiling()
    for _ in range(3):
        metrics = run.step()             # next prompt batch from the recipe's data
    run.close()
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_mega.trainer.rl_trainer import RLTrainer as _Step

if TYPE_CHECKING:
    from verl_mega.trainer.setup import Job

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml"


class vLLMBackend:  # noqa: N801 — the name users were promised
    """Rollout on in-process vLLM through the 3D-HybridEngine: ``vLLMBackend(model_name=None, **settings)``. The
    settings are vLLM's engine settings of the config (:class:`~verl_mega.config.rl.VLLMConfig`: gen_tp, gen_ep,
    gpu_memory_utilization, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens, enforce_eager,
    enable_prefix_caching, sleep_level), checked as the config checks them; a setting left out (or None) keeps the
    recipe's value.

    ``model_name`` may only name the actor's own model: vLLM generates with the actor's weights, synced after every
    update, so a different model would be a different policy.
    """

    def __init__(self, *, model_name: str | None = None, **settings: Any) -> None:
        from verl_mega.config import ConfigError
        from verl_mega.config.rl import VLLMConfig

        self.model_name, self.settings = model_name, {k: v for k, v in settings.items() if v is not None}
        try:
            VLLMConfig(**self.settings)  # an unknown setting is a TypeError naming it
        except ConfigError as exc:
            raise ValueError(f"vLLMBackend({', '.join(f'{k}={v!r}' for k, v in self.settings.items())}): {exc}") \
                from None

    def __getattr__(self, name: str) -> Any:  # a setting reads None when not given (the recipe's value stands)
        from verl_mega.config.rl import VLLMConfig

        if name not in VLLMConfig.__dataclass_fields__:
            raise AttributeError(name)
        return self.__dict__.get("settings", {}).get(name)

    def overrides(self) -> dict[str, Any]:
        """The given settings as `rollout.<setting>` config keys."""
        return {f"rollout.{name}": value for name, value in self.settings.items()}


class RLTrainer(_Step):
    """The RL step (:class:`verl_mega.trainer.rl_trainer.RLTrainer`) with the entry point users were promised:
    :meth:`create` builds a whole job from a recipe. Subclass it to change a stage; ``MyTrainer.create(...)`` then
    runs the job with it."""

    @classmethod
    def create(cls, *, actor: str | Path, actor_backend: vLLMBackend | None = None, recipe: str | Path | None = None,
               overrides: dict[str, Any] | None = None) -> "TrainingRun":
        """Build the full job for ``actor`` (an HF model directory, or ``"tiny"``), ready to step, with this class
        as its trainer. ``recipe`` defaults to configs/quickstart_cpu.yaml; ``overrides`` are dotted keys as on the
        command line."""
        from verl_mega.config import load_config
        from verl_mega.trainer.loop import before_build

        if actor_backend is not None and not isinstance(actor_backend, vLLMBackend):
            raise TypeError(f"actor_backend must be a vLLMBackend, got {type(actor_backend).__name__}")
        actor = str(actor)
        if actor_backend is not None and actor_backend.model_name not in (None, actor):
            raise ValueError(f"vLLMBackend(model_name={actor_backend.model_name!r}) differs from actor={actor!r}; "
                             "the rollout generates with the actor's synced weights, so leave model_name unset or "
                             "equal")
        values: dict[str, Any] = {"model.path": actor}
        values.update(actor_backend.overrides() if actor_backend is not None else {})
        values.update(overrides or {})
        # JSON is YAML: every value keeps its type through the override parser (strings stay quoted)
        texts = [f"{key}={json.dumps(str(v) if isinstance(v, Path) else v)}" for key, v in values.items()]
        cfg = load_config(recipe or DEFAULT_RECIPE, texts)
        before_build(cfg)  # the console and the trackers' checks, as python -m verl_mega.train does
        from verl_mega.trainer.setup import build_job  # after the console: Megatron logs as it is imported

        return TrainingRun(build_job(cfg, trainer_cls=cls))


class TrainingRun:
    """A built job driven from Python (what :meth:`RLTrainer.create` returns): it owns the job (data loader,
    checkpoints, vLLM, reward pool) and steps its trainer on the job's data, the look-ahead first.

    The steps drawn from the job's data are the run's numbered steps and end as ``python -m verl_mega.train``'s do
    (:func:`verl_mega.trainer.loop.run_step`): the non-finite guard, validation every trainer.val_every, a checkpoint
    every trainer.save_every and at the last step, and the stop agreement: SIGTERM or SIGINT during a step, or
    trainer.time_limit_s, saves that step and the next :meth:`step` raises StopIteration. A step on a batch of the
    caller's own is not numbered: only the non-finite guard follows it.

    Its outputs are the command line's: the numbered steps go to metrics.jsonl, TensorBoard, the trackers and the
    console line, and :meth:`close` writes curves.png and summary.txt (and prints the summary)."""

    def __init__(self, job: Job) -> None:
        from verl_mega.trainer.loop import start_logging
        from verl_mega.trainer.stop import StopRequest

        self.job, self.trainer = job, job.trainer
        self.steps_done = job.start_step  # a resumed job starts after its checkpoint
        self.stopped = ""  # why the run stopped (a signal, the time limit), once it has
        self._stop = StopRequest(job.cfg.trainer.time_limit_s, started=job.started)
        self._closed = False
        self._logger = start_logging(job)

    def step(self, prompt_batch=None) -> dict[str, float]:
        """One RL step on ``prompt_batch`` (by default the next batch of the job's data loader)."""
        from verl_mega.trainer.loop import next_prompts, run_step

        if self.stopped:
            raise StopIteration(f"the run stopped after step {self.steps_done} ({self.stopped}), with a checkpoint")
        if prompt_batch is not None:
            self.job.rollout.prefetch(self.job.lookahead(prompt_batch))  # the asynchronous window, as run_step's
            metrics = self.trainer.step(prompt_batch)
            self.job.ckpt.guard_nonfinite(metrics, self.steps_done)
            return metrics
        if self.steps_done < self.job.total_steps:
            prompt_batch = next_prompts(self.job, self.steps_done + 1)
        if prompt_batch is None:
            raise StopIteration(f"trainer.total_steps={self.job.total_steps} (or the data) is exhausted")
        self.steps_done += 1
        # signals are the run's during a step only: between steps the caller's code keeps Python's handling
        with self._stop if threading.current_thread() is threading.main_thread() else contextlib.nullcontext():
            metrics, self.stopped = run_step(self.job, self.steps_done, prompt_batch, stop=self._stop,
                                             logger=self._logger)
        return metrics

    def __getattr__(self, name: str) -> Any:  # validate(), enable_profiling(), the profiler: the trainer's
        return getattr(self.__dict__.get("trainer"), name)

    def close(self) -> None:
        """Finish pending checkpoint writes, write curves.png and summary.txt, then release vLLM, the reward pool and
        torch.distributed."""
        from verl_mega.trainer.loop import finish_logging

        if self._closed:
            return
        self._closed = True
        try:
            self.job.ckpt.close()  # a background save becomes complete, so that the summary names it
            finish_logging(self.job, self._logger)
        except BaseException:
            self.job.close(after_error=True)
            raise
        self.job.close()
