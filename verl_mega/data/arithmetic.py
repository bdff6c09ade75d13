"""A verifiable toy task for CPU runs: single-digit addition/subtraction such as ``"3+4="`` -> ``"7"``.

Operands are 0..``max_operand``; subtraction orders its operands so answers are never negative (0..18 with the
defaults). Prompts are at most 4 characters, so a char-level tokenizer keeps them within ~8 tokens. The reward is the
built-in ``arithmetic`` reward: 1.0 iff the first integer in the response equals the answer
(:func:`verl_mega.rewards.math_reward.arithmetic_score`).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from verl_mega.rewards.math_reward import arithmetic_score

__all__ = ["REWARD_SPEC", "arithmetic_score", "generate_arithmetic", "write_arithmetic_jsonl"]

REWARD_SPEC = "arithmetic"  # pass as the reward function spec (see verl_mega.rewards.loader)


def generate_arithmetic(
    num_examples: int, *, seed: int = 0, ops: str = "+-", max_operand: int = 9
) -> list[dict[str, Any]]:
    """``num_examples`` records ``{"prompt": "a+b=", "answer": "c", "data_source": "arithmetic"}``, same for the same
    seed."""
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    if not ops or any(op not in "+-" for op in ops):
        raise ValueError(f"ops must be made of '+' and '-', got '{ops}'")
    if not 0 <= max_operand <= 9:
        raise ValueError(f"max_operand must be in 0..9 (single digits keep prompts short), got {max_operand}")
    rng = random.Random(f"verl_mega-arithmetic:{seed}")
    records = []
    for _ in range(num_examples):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        if op == "-" and a < b:
            a, b = b, a
        answer = a + b if op == "+" else a - b
        records.append({"prompt": f"{a}{op}{b}=", "answer": str(answer), "data_source": "arithmetic"})
    return records


def write_arithmetic_jsonl(
    path: str | os.PathLike, num_examples: int, *, seed: int = 0, ops: str = "+-", max_operand: int = 9
) -> str:
    """Write :func:`generate_arithmetic` records as JSONL (atomically: temp file, then rename); returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in generate_arithmetic(num_examples, seed=seed, ops=ops, max_operand=max_operand):
            f.write(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path
