"""Rule-based verifiable rewards for numeric answers (GSM8K style) and the toy arithmetic task.

Every scorer has the user-function shape ``(response: str, ground_truth, **kwargs) -> float`` so the trainer treats
built-ins and user functions alike; unknown keyword arguments (``data_source``, ``extra_info``, ...) are ignored.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = [
    "extract_solution",
    "extract_boxed",
    "parse_number",
    "numbers_match",
    "compute_score",
    "format_reward",
    "first_integer",
    "arithmetic_score",
]

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"  # "1,234.5", "-3", "72" (a trailing "." as in "72." is not part of it)
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_ANY_NUMBER = re.compile(_NUMBER)
_FIRST_INT = re.compile(r"-?\d+")


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None


def extract_solution(text: str, method: str = "strict") -> str | None:
    r"""Final numeric answer as a string, or None.

    ``strict``: the number after the last ``####`` (GSM8K's answer format).
    ``flexible``: the ``####`` answer if present, else the number inside the last ``\boxed{}``, else the last number
    anywhere in the text.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"unknown extraction method '{method}'; use 'strict' or 'flexible'")
    found = _STRICT.findall(text)
    if found:
        return found[-1].replace(",", "")
    if method == "strict":
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        in_box = _ANY_NUMBER.findall(boxed)
        if in_box:
            return in_box[-1].replace(",", "")
    numbers = _ANY_NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def parse_number(value: Any) -> float | None:
    """float from a number or a numeric string ("1,234", "$5", "7.0", GSM8K's full "... #### 72"); None if none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    if "####" in text:
        text = extract_solution(text, "strict") or ""
    text = text.replace(",", "").replace("$", "").strip()
    try:
        return float(text)
    except ValueError:
        return None


def numbers_match(predicted: Any, expected: Any, tolerance: float = 1e-6) -> bool:
    """|a - b| <= tolerance * max(1, |b|) after parsing both; False when either is not a number."""
    a, b = parse_number(predicted), parse_number(expected)
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= tolerance * max(1.0, abs(b))


def compute_score(
    response: str,
    ground_truth: Any,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    tolerance: float = 1e-6,
    **_: Any,
) -> float:
    """GSM8K reward: ``score`` if the extracted answer equals the ground truth numerically, ``format_score`` if an
    answer was found but is wrong, 0 if none was found."""
    answer = extract_solution(response, method)
    if answer is None:
        return 0.0
    return float(score) if numbers_match(answer, ground_truth, tolerance) else float(format_score)


def format_reward(response: str, ground_truth: Any = None, style: str = "any", **_: Any) -> float:
    r"""1.0 if the response states its answer in the expected format, else 0.0 (ground truth unused).

    ``gsm8k``: a ``#### <number>``; ``boxed``: a ``\boxed{...}`` holding a number; ``any``: either.
    """
    if style not in ("gsm8k", "boxed", "any"):
        raise ValueError(f"unknown format style '{style}'; use 'gsm8k', 'boxed' or 'any'")
    has_hash = bool(_STRICT.search(response))
    boxed = extract_boxed(response)
    has_box = boxed is not None and bool(_ANY_NUMBER.search(boxed))
    ok = {"gsm8k": has_hash, "boxed": has_box, "any": has_hash or has_box}[style]
    return 1.0 if ok else 0.0


def first_integer(text: str) -> int | None:
    """The first (optionally negative) integer in ``text``, or None."""
    match = _FIRST_INT.search(text)
    return int(match.group()) if match else None


def arithmetic_score(response: str, ground_truth: Any, **_: Any) -> float:
    """Toy arithmetic task reward: 1.0 iff the first integer in the response equals the ground truth, else 0.0."""
    predicted = first_integer(response)
    expected = parse_number(ground_truth)
    return 1.0 if predicted is not None and expected is not None and predicted == expected else 0.0
