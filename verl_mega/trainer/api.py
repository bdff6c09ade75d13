"""Python entry point to the trainer, in the shape ``RLTrainer.create(actor=…, actor_backend=vLLMBackend(…))``.

A thin façade over the recipe machinery: the arguments become dotted config overrides of a recipe, and
:func:`verl_mega.train.build_job` builds exactly what ``python -m verl_mega.train`` builds::

    from verl_mega import RLTrainer, vLLMBackend

    trainer = RLTrainer.create(actor="tiny", actor_backend=vLLMBackend(gen_tp=1, kv_cache_memory_bytes=256 << 20),
                               overrides={"trainer.total_steps": 20, "trainer.output_dir": "outputs/api"})
    trainer.enable_profiling()
    for _ in range(3):
        metrics = trainer.step()         # next prompt batch from the recipe's data
    trainer.close()
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DEFAULT_RECIPE = Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml"


@dataclass(frozen=True, kw_only=True)
class vLLMBackend:  # noqa: N801 — the name users were promised
    """Rollout on in-process vLLM through the 3D-HybridEngine. Every field left None keeps the recipe's value.

    ``model_name`` may only name the actor's own model: vLLM generates with the actor's weights, synced after every
    update, so a different model would be a different policy.
    """

    model_name: str | None = None
    gen_tp: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int | None = None
    enforce_eager: bool | None = None

    def __post_init__(self) -> None:
        if self.gen_tp is not None and self.gen_tp < 1:
            raise ValueError(f"vLLMBackend(gen_tp={self.gen_tp}): the generation TP size must be >= 1")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"vLLMBackend(gpu_memory_utilization={self.gpu_memory_utilization}) must be in (0, 1]")
        for name in ("kv_cache_memory_bytes", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"vLLMBackend({name}={value}) must be positive")

    def overrides(self) -> dict[str, Any]:
        """The set fields as `rollout.<field>` config keys (every field but model_name has that name there)."""
        return {f"rollout.{f.name}": getattr(self, f.name) for f in fields(self)
                if f.name != "model_name" and getattr(self, f.name) is not None}


def create_trainer(cls: type, *, actor: str | Path, actor_backend: vLLMBackend | None = None,
                   recipe: str | Path | None = None, overrides: dict[str, Any] | None = None):
    """Build the full job for ``actor`` (an HF model directory, or ``"tiny"``) and return its trainer, ready to
    step. ``recipe`` defaults to configs/quickstart_cpu.yaml; ``overrides`` are dotted keys as on the command line."""
    from verl_mega.config import load_config
    from verl_mega.trainer.setup import build_job

    if actor_backend is not None and not isinstance(actor_backend, vLLMBackend):
        raise TypeError(f"actor_backend must be a vLLMBackend, got {type(actor_backend).__name__}")
    actor = str(actor)
    if actor_backend is not None and actor_backend.model_name not in (None, actor):
        raise ValueError(f"vLLMBackend(model_name={actor_backend.model_name!r}) differs from actor={actor!r}; the "
                         "rollout generates with the actor's synced weights, so leave model_name unset or equal")
    values: dict[str, Any] = {"model.path": actor}
    values.update(actor_backend.overrides() if actor_backend is not None else {})
    values.update(overrides or {})
    # JSON is YAML: every value keeps its type through the override parser (strings stay quoted)
    texts = [f"{key}={json.dumps(str(v) if isinstance(v, Path) else v)}" for key, v in values.items()]
    job = build_job(load_config(recipe or DEFAULT_RECIPE, texts), trainer_cls=cls)
    job.trainer.job = job
    job.trainer.job_step = job.start_step  # steps done so far (a resumed job starts after its checkpoint)
    return job.trainer
