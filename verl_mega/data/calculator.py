"""A multi-turn toy task: two-digit multiplication with a calculator tool, for CPU runs of tool rollouts.

The prompt is ``"23*17="``; a tiny model cannot multiply, but it can call the ``calc`` tool and copy its answer::

    (calc:23*17)    the policy's call (tool_call_start "(", tool_call_end ")")
    =391.           the tool's answer (observation_start "=", observation_end "."), masked out of the loss
    391<eos>        the policy's final answer

The reward (built-in ``calculator``) is 1.0 iff the first integer after the last tool answer, or in the whole
response when no tool was called, equals the product. Records carry a ``demonstration`` of segments
``[text, trained]`` for the tiny model's supervised warm start (observations are not trained on, as in RL).
Run it with ``configs/multi_turn_calculator_cpu.yaml``, which sets the markers above.
"""

from __future__ import annotations

import random
from typing import Any

from verl_mega.rewards.math_reward import first_integer

REWARD_SPEC = "calculator"
CALL_START, CALL_END, OBS_START, OBS_END = "(", ")", "=", "."


def generate_calculator(num_examples: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """``num_examples`` products of two numbers in 10..99, same for the same seed."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    rng = random.Random(f"verl_mega-calculator:{seed}")
    records = []
    for _ in range(num_examples):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        answer = str(a * b)
        records.append({"prompt": f"{a}*{b}=", "answer": answer, "data_source": "calculator",
                        "demonstration": [[f"{CALL_START}calc:{a}*{b}{CALL_END}", True],
                                          [f"{OBS_START}{answer}{OBS_END}", False], [answer, True]]})
    return records


def calculator_score(response: str, ground_truth: Any, observation_end: str = OBS_END, **_: Any) -> float:
    """1.0 iff the final answer, the first integer after the last tool answer (or in the whole response when no
    tool answered), equals ``ground_truth``."""
    final = response.rpartition(observation_end)[2] if observation_end in response else response
    value = first_integer(final)
    return float(value is not None and str(value) == str(ground_truth).strip())
