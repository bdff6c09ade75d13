"""Built-in generated tasks, named in ``data.train_files`` / ``data.val_files`` as ``generated:<task>``.

Each task makes its records in memory (keys ``prompt`` / ``answer``, whatever ``data.prompt_key`` says) and names
its own reward function, which the trainer uses when ``reward.function`` is null.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from verl_mega.config.rl import GENERATED_PREFIX
from verl_mega.data.arithmetic import REWARD_SPEC as _ARITHMETIC_REWARD
from verl_mega.data.arithmetic import generate_arithmetic
from verl_mega.data.calculator import REWARD_SPEC as _CALCULATOR_REWARD
from verl_mega.data.calculator import generate_calculator

__all__ = ["GENERATED_PREFIX", "GeneratedTask", "GENERATED_TASKS", "is_generated", "generated_task"]


@dataclass(frozen=True)
class GeneratedTask:
    name: str
    generate: Callable[..., list[dict[str, Any]]]  # (num_examples, *, seed) -> records
    reward_spec: str  # a spec for verl_mega.rewards.load_reward_fn
    prompt_key: str = "prompt"
    answer_key: str = "answer"


GENERATED_TASKS: dict[str, GeneratedTask] = {
    "arithmetic": GeneratedTask("arithmetic", generate_arithmetic, _ARITHMETIC_REWARD),
    # 25 distinct sums a+b with a, b in 0..4: small enough for a 2-core CPU run to learn by RL alone in minutes
    "addition_small": GeneratedTask("addition_small", partial(generate_arithmetic, ops="+", max_operand=4),
                                    _ARITHMETIC_REWARD),
    # two-digit products, solved by calling the calc tool (multi-turn rollouts; configs/multi_turn_calculator_cpu.yaml)
    "calculator": GeneratedTask("calculator", generate_calculator, _CALCULATOR_REWARD),
}


def is_generated(entry: str) -> bool:
    return isinstance(entry, str) and entry.startswith(GENERATED_PREFIX)


def generated_task(entry: str) -> GeneratedTask:
    """The task for ``generated:<name>`` (or a bare name)."""
    name = entry[len(GENERATED_PREFIX):] if is_generated(entry) else entry
    task = GENERATED_TASKS.get(name)
    if task is None:
        raise ValueError(
            f"unknown generated task '{name}'; available: {', '.join(GENERATED_PREFIX + n for n in GENERATED_TASKS)}"
        )
    return task
