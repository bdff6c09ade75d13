"""The algorithm menu on the README's bar, as users run it (slow: whole training runs).

- GRPO + DAPO (clip-higher, dynamic sampling, overlong penalty, no KL loss) and GSPO runs of the quickstart: mean
  reward over the first 10 steps < 0.3 and over the last 10 > 0.6, like the plain quickstart. GSPO's run generates
  with FP8 weights (rollout.quantization=fp8), so the bar also holds FP8 rollouts to the quickstart's. For DAPO the
  bar is read on the reward of every generated sample (`dapo/generated_reward_mean`): `reward/mean` is the filtered
  batch's, which drops the all-wrong groups.
- The multi-turn calculator task (configs/multi_turn_calculator_cpu.yaml): the policy calls the calc tool and
  copies its answer; mean reward over the first 10 steps < 0.4, last 10 > 0.45 and at least 0.2 above the first.

The runs are the session's whole runs (conftest.py); each is made once, side by side with the others.
"""

import pytest
from runs import metric_rows, recipe_steps, train

pytestmark = pytest.mark.slow


def _first_last(rows: list[dict], key: str) -> tuple[float, float]:
    return sum(r[key] for r in rows[:10]) / 10, sum(r[key] for r in rows[-10:]) / 10


def test_dapo_meets_the_quickstart_bar(dapo_run):
    dapo = metric_rows(dapo_run)
    assert len(dapo) == recipe_steps("quickstart_cpu.yaml")
    first, last = _first_last(dapo, "dapo/generated_reward_mean")
    print(f"DAPO generated reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.3 and last > 0.6, (first, last)
    assert all(r["dapo/gen_batches"] >= 1 for r in dapo) and max(r["dapo/gen_batches"] for r in dapo) > 1
    assert sum(r["dapo/kept_group_frac"] for r in dapo) / len(dapo) < 1  # groups were dropped and refilled


def test_gspo_meets_the_quickstart_bar(gspo_run):
    gspo = metric_rows(gspo_run)
    assert len(gspo) == recipe_steps("quickstart_cpu.yaml")
    first, last = _first_last(gspo, "reward/mean")
    print(f"GSPO reward with FP8 rollouts: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    assert first < 0.3 and last > 0.6, (first, last)
    assert all(r["weight_sync/quantized_params"] == 8 for r in gspo)  # every linear of the 2 layers, every step


def test_multi_turn_calculator_reward_rises(calculator_run, tmp_path):
    rows = metric_rows(calculator_run)
    # the same episodes when one engine spans two ranks (tp=2: its first rank calls the tools and broadcasts them)
    two = train(tmp_path / "calculator_tp2", "multi_turn_calculator_cpu.yaml",
                ["trainer.save_every=0", "logging.progress_bar=false", "trainer.total_steps=1", "parallel.tp=2"],
                nproc=2)
    for key in ("reward/mean", "rollout/tool_calls", "rollout/turns", "rollout/response_length"):
        assert two[0][key] == rows[0][key], (key, two[0][key], rows[0][key])
    assert len(rows) == 80
    first, last = _first_last(rows, "reward/mean")
    print(f"multi-turn calculator reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
    # the warm start leaves the tool call and the copy half learnt; RL must make them reliable
    assert first < 0.4 and last > 0.45 and last - first > 0.2, (first, last)
    calls = sum(r["rollout/tool_calls"] for r in rows[-10:]) / 10
    assert calls > 0.9, calls  # the policy calls the tool in nearly every episode
    assert all(r["rollout/turns"] >= 1 and 0 <= r["rollout/tool_error_frac"] <= 1 for r in rows)
    # the tools' answers are masked out of the loss: the policy's own tokens still match vLLM's log-probs
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
