r"""Rewards for competition-math answers, with verl's conventions.

* ``math_score`` (built-in ``math``): the last ``\boxed{...}`` of the response against the ground truth, both
  normalised as the MATH benchmark's own equivalence check does (Hendrycks et al.; verl's ``math`` reward): 1.0 or 0.
* ``dapo_score`` (built-in ``math_dapo``): the last ``Answer: ...`` line of the response's final 300 characters
  against the ground truth, both normalised as Minerva's answer check does (Lewkowycz et al.; verl's ``math_dapo``,
  used for DAPO-Math-17K and AIME): 1.0 if equal, else -1.0, with ``acc`` (1 or 0) beside it.
* ``score_by_source`` (built-in ``by_data_source``): picks one of those, or the GSM8K reward, from the row's
  ``data_source`` as verl's ``default_compute_score`` does, and always returns ``{"score", "acc"}``.
"""

from __future__ import annotations

import re
from typing import Any

from verl_mega.rewards.math_reward import compute_score as gsm8k_score

__all__ = ["last_boxed", "normalize_math", "math_equal", "math_score", "normalize_minerva", "dapo_score",
           "score_by_source", "GSM8K_SOURCES", "MATH_SOURCES"]

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval")


def last_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), or of ``\boxed X`` up to a ``$``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox")):]
    if rest.startswith(" "):
        return rest[1:].split("$")[0].strip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, char in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(char, 0)
        if depth == 0:
            return rest[1:i]
    return None


def _fix_fracs(text: str) -> str:
    r"""``\frac12`` → ``\frac{1}{2}``, ``\frac1{72}`` → ``\frac{1}{72}`` (arguments given without braces)."""
    head, *parts = text.split("\\frac")
    out = [head]
    for part in parts:
        out.append("\\frac")
        if part.startswith("{") or len(part) < 2:
            if not part.startswith("{"):
                return text  # "\frac" with under two characters after it: leave the text as it was
            out.append(part)
            continue
        a, b, tail = part[0], part[1], part[2:]
        out.append(f"{{{a}}}{b}{tail}" if b == "{" else f"{{{a}}}{{{b}}}{tail}")
    return "".join(out)


def _fix_sqrt(text: str) -> str:
    r"""``\sqrt3`` → ``\sqrt{3}``."""
    return re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", text)


def _fix_slash(text: str) -> str:
    """``3/4`` (two integers) → ``\\frac{3}{4}``."""
    found = re.fullmatch(r"(-?\d+)/(-?\d+)", text)
    if not found or text != f"{int(found[1])}/{int(found[2])}":  # "03/4" is left as written
        return text
    return f"\\frac{{{found[1]}}}{{{found[2]}}}"


def normalize_math(answer: str) -> str:
    """An answer in the MATH benchmark's canonical form: layout commands, units after ``\\text{ ``, degrees, dollar
    and percent signs, spaces and short ``x =`` prefixes dropped; fractions, roots and 0.5 written one way."""
    text = str(answer).replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    text = text.split("\\text{ ")[0]  # "\text{ " only ever starts a unit in MATH answers
    text = text.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text.startswith("."):
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" → "5"
        text = sides[1]
    text = _fix_sqrt(text).replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_slash(text)


def math_equal(predicted: str | None, expected: str | None) -> bool:
    """MATH equivalence: equal after :func:`normalize_math` (None equals nothing)."""
    if predicted is None or expected is None:
        return False
    return normalize_math(predicted) == normalize_math(expected)


def _truth(ground_truth: Any) -> str:
    text = str(ground_truth)
    boxed = last_boxed(text) if "\\boxed" in text or "\\fbox" in text else None
    return boxed if boxed is not None else text  # a full solution as ground truth: its boxed answer


def math_score(response: str, ground_truth: Any, **_: Any) -> float:
    r"""1.0 if the response's last ``\boxed{}`` is MATH-equivalent to the ground truth, else 0.0."""
    return 1.0 if math_equal(last_boxed(response), _truth(ground_truth)) else 0.0


# Minerva's normalisation (Lewkowycz et al. 2022, appendix D.1): substitutions, then words and marks removed
_MINERVA_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                          (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                    "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                    "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}",
                    r"\;", r",\!", "{,}", '"', "\\dots")
_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def normalize_minerva(answer: str) -> str:
    """A final answer in Minerva's canonical form (what follows the last ``=``, units and layout dropped)."""
    text = str(answer).split("=")[-1]
    for old, new in _MINERVA_SUBSTITUTIONS:
        text = text.replace(old, new)
    for word in _MINERVA_REMOVED:
        text = text.replace(word, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", text)  # the first $...$ span alone
    for command in ("text", "textbf", "overline"):
        text = re.sub(rf"(\\{command}\{{)(.*?)(\}})", "\\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", text)
    text = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", text)
    text = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_score(response: str, ground_truth: Any, **_: Any) -> dict[str, float]:
    """DAPO's reward: the last ``Answer:`` line of the response's final 300 characters (MATH-500's longest answer
    has 159) against the ground truth after :func:`normalize_minerva`: score 1.0 / -1.0, acc 1.0 / 0.0."""
    found = _ANSWER_LINE.findall(response[-300:])
    correct = bool(found) and normalize_minerva(found[-1]) == normalize_minerva(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}


def score_by_source(response: str, ground_truth: Any, data_source: str = "", **_: Any) -> dict[str, float]:
    """The reward of the row's ``data_source``, as verl's default_compute_score picks it: GSM8K (openai/gsm8k), MATH
    (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval), DAPO (math_dapo, aime*)."""
    if data_source in GSM8K_SOURCES:
        score = gsm8k_score(response, ground_truth)
        return {"score": score, "acc": float(score == 1.0)}
    if data_source in MATH_SOURCES:
        score = math_score(response, ground_truth)
        return {"score": score, "acc": score}
    if data_source == "math_dapo" or data_source.startswith("aime"):
        return dapo_score(response, ground_truth)
    raise ValueError(f"by_data_source has no reward for data_source={data_source!r} (it knows "
                     f"{', '.join(GSM8K_SOURCES + MATH_SOURCES)}, math_dapo, aime*); set reward.function to a "
                     f"function for it")
