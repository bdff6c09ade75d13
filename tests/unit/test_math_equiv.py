"""MATH boxed-answer equivalence, DAPO's Answer-line reward and the by-data-source choice, on hand-worked cases."""

from __future__ import annotations

import pytest

from verl_mega.rewards import load_reward_fn
from verl_mega.rewards.math_equiv import (dapo_score, last_boxed, math_equal, math_score, normalize_math,
                                          normalize_minerva, score_by_source)


@pytest.mark.parametrize("text, boxed", [
    (r"so \boxed{3} then \boxed{\frac{1}{2}}", r"\frac{1}{2}"),  # the last one, braces balanced
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"x \fbox{a{b}c} y", "a{b}c"),
    (r"$\boxed 5$ done", "5"),
    (r"\boxed{unclosed", None),
    ("no box at all", None),
])
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize("answer, canonical", [
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    (r"\frac12", r"\frac{1}{2}"),
    (r"\tfrac1{72}", r"\frac{1}{72}"),
    ("0.5", r"\frac{1}{2}"),
    (".5", r"\frac{1}{2}"),  # ".5" → "0.5" → 1/2
    ("3/4", r"\frac{3}{4}"),
    ("03/4", "03/4"),  # not two plain integers as written: left alone
    (r"10\text{ cm}", "10"),
    ("x = 5", "5"),
    (r"90^\circ", "90"),
    (r"\left( 3, 4 \right)", "(3,4)"),
    (r"\sqrt3", r"\sqrt{3}"),
    (r"50\%", "50"),
    (r"\$5", "5"),
    ("", ""),
])
def test_normalize_math(answer, canonical):
    assert normalize_math(answer) == canonical


def test_math_equivalence_and_score():
    assert math_equal(r"\dfrac{1}{2}", "0.5") and math_equal("x=3", "3")
    assert not math_equal(r"\frac{2}{4}", r"\frac{1}{2}")  # a string normalisation: no algebra
    assert not math_equal(None, "3") and not math_equal("3", None)
    assert math_score(r"... so the answer is $\boxed{\dfrac{1}{2}}$.", r"\frac12") == 1.0
    assert math_score(r"\boxed{2} no wait \boxed{3}", "3") == 1.0
    assert math_score(r"\boxed{3} no wait \boxed{2}", "3") == 0.0
    assert math_score("the answer is 3", "3") == 0.0  # no box, no score
    # a full solution as ground truth: its boxed answer is the truth
    assert math_score(r"\boxed{12}", r"Adding up, we get $\boxed{12}$.") == 1.0


@pytest.mark.parametrize("answer, canonical", [
    ("$1,000$", "1000"),
    ("x = 12", "12"),
    (r"\boxed{7}", "7"),
    (r"\frac34", r"\frac{3}{4}"),
    ("10 degrees", "10"),
    (r"\sqrt2", r"\sqrt{2}"),
    (r"\text{(B)}", "(B)"),
    ("an apple", "apple"),
])
def test_normalize_minerva(answer, canonical):
    assert normalize_minerva(answer) == canonical


def test_dapo_score():
    assert dapo_score("Work...\nAnswer: $1,000$", "1000") == {"score": 1.0, "acc": 1.0}
    assert dapo_score("answer: 42\nanswer : 41", "41") == {"score": 1.0, "acc": 1.0}  # the last line, any case
    assert dapo_score("Answer: 41", "42") == {"score": -1.0, "acc": 0.0}
    assert dapo_score("I think 42.", "42") == {"score": -1.0, "acc": 0.0}  # no Answer line
    assert dapo_score("Answer: 42\n" + "x" * 300, "42") == {"score": -1.0, "acc": 0.0}  # only the last 300 chars


def test_score_by_source():
    assert score_by_source("so #### 72", "72", data_source="openai/gsm8k") == {"score": 1.0, "acc": 1.0}
    assert score_by_source("so #### 71", "72", data_source="openai/gsm8k") == {"score": 0.0, "acc": 0.0}
    assert score_by_source(r"\boxed{0.5}", r"\frac12", data_source="DigitalLearningGmbH/MATH-lighteval") == \
        {"score": 1.0, "acc": 1.0}
    assert score_by_source("Answer: 7", "7", data_source="math_dapo") == {"score": 1.0, "acc": 1.0}
    assert score_by_source("Answer: 8", "7", data_source="aime2024") == {"score": -1.0, "acc": 0.0}
    with pytest.raises(ValueError, match=r"^by_data_source has no reward for data_source='other' .*; set "
                                         r"reward.function to a function for it$"):
        score_by_source("x", "y", data_source="other")


def test_built_in_names():
    assert load_reward_fn("math").score_one(r"\boxed{\frac{1}{2}}", "0.5") == 1.0
    assert load_reward_fn("math_dapo").score_one("Answer: 3", "4") == -1.0
    by_source = load_reward_fn("by_data_source")
    assert by_source.score_batch(["#### 5", "Answer: 6"], ["5", "6"],
                                 [{"data_source": "openai/gsm8k"}, {"data_source": "math_dapo"}]) == [1.0, 1.0]
