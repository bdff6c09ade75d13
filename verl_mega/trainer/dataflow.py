"""The RL step as a small dataflow graph: the :class:`DataflowBuilder` façade (``RLTrainer.dataflow()`` declares
the stages its step runs, each depending on the stages whose results it reads). Device stages (Megatron / vLLM
work with collectives) run in the main thread in declaration order: every SPMD rank must issue collectives in the
same order. Host stages (reward functions, sandboxes, anything CPU-only) start in a thread as soon as their inputs
exist and overlap the device stages that follow; a stage that needs a host stage's output waits for it. Each
stage's wall interval goes to the profiler, which turns the intervals into overlap figures.

    flow = (DataflowBuilder(profiler)
            .add_rollout(actor=rollout_fn, env=prompts_fn)
            .add_stage("reward", reward_fn, deps=("rollout",), host=True)
            .add_stage("old_logprob", ..., deps=("rollout",))
            .add_critic_update(critic=critic_fn, data="advantage")
            .add_policy_update(actor=actor_fn, data="advantage")
            .build())
    outputs = flow.run()
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

StageFn = Callable[[dict[str, Any]], Any]
log = logging.getLogger("verl_mega.dataflow")


@dataclass(frozen=True)
class Stage:
    name: str
    fn: StageFn
    deps: tuple[str, ...] = ()
    host: bool = False


@dataclass
class Dataflow:
    stages: list[Stage]
    profiler: Any = None
    max_host_workers: int = 4

    def run(self, inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run every stage once; returns {stage name: its result} (plus `inputs`)."""
        results: dict[str, Any] = dict(inputs or {})
        futures: dict[str, Future] = {}
        with ThreadPoolExecutor(self.max_host_workers, thread_name_prefix="host-stage") as pool:
            for stage in self.stages:
                for dep in stage.deps:
                    if dep in futures:
                        results[dep] = futures.pop(dep).result()  # re-raises a host stage's error here
                if stage.host:
                    futures[stage.name] = pool.submit(run_stage, self.profiler, stage.name, stage.fn, dict(results),
                                                      host=True)
                else:
                    results[stage.name] = run_stage(self.profiler, stage.name, stage.fn, results)
            results.update({name: future.result() for name, future in futures.items()})
        return results


def run_stage(profiler: Any, name: str, fn: Callable, *args: Any, host: bool = False) -> Any:
    """``fn(*args)`` as stage ``name`` of the step: its wall interval goes to ``profiler`` (a host stage's without
    a device synchronize, which in a thread would only inflate its time), and an error says which stage it came
    from (a timed-out collective surfaces here)."""
    try:
        if profiler is None:
            return fn(*args)
        with profiler.stage(name, sync=not host):
            return fn(*args)
    except Exception as exc:
        exc.add_note(f"(in RL stage '{name}')")
        log.error("RL stage '%s' failed: %s: %s", name, type(exc).__name__, str(exc).splitlines()[0][:300]
                  if str(exc) else "")
        raise


class DataflowBuilder:
    """Declares the stages of one RL step; `build()` validates names and dependency order."""

    def __init__(self, profiler: Any = None) -> None:
        self._stages: list[Stage] = []
        self._profiler = profiler

    def add_stage(self, name: str, fn: StageFn, *, deps: tuple[str, ...] | list[str] = (), host: bool = False
                  ) -> "DataflowBuilder":
        self._stages.append(Stage(name, fn, tuple(deps), host))
        return self

    # Façades named after the RL roles, so a step reads like the algorithm.
    def add_rollout(self, *, actor: StageFn, env: StageFn | None = None) -> "DataflowBuilder":
        """`env` produces the prompts (stage "prompts"); `actor` generates from them in inference mode."""
        if env is not None:
            self.add_stage("prompts", env, host=False)
        return self.add_stage("rollout", actor, deps=("prompts",) if env is not None else ())

    def add_critic_update(self, *, critic: StageFn, data: str | tuple[str, ...]) -> "DataflowBuilder":
        """`data`: the stage (or stages) whose results the update reads."""
        return self.add_stage("critic_update", critic, deps=(data,) if isinstance(data, str) else data)

    def add_policy_update(self, *, actor: StageFn, data: str | tuple[str, ...]) -> "DataflowBuilder":
        """`data`: the stage (or stages) whose results the update reads."""
        return self.add_stage("actor_update", actor, deps=(data,) if isinstance(data, str) else data)

    def build(self, *, max_host_workers: int = 4) -> Dataflow:
        seen: set[str] = set()
        for stage in self._stages:
            if stage.name in seen:
                raise ValueError(f"dataflow: stage {stage.name!r} is declared twice")
            missing = [d for d in stage.deps if d not in seen]
            if missing:
                raise ValueError(
                    f"dataflow: stage {stage.name!r} depends on {missing}, which are not declared before it; "
                    "declare stages in dependency order"
                )
            seen.add(stage.name)
        return Dataflow(list(self._stages), self._profiler, max_host_workers)
