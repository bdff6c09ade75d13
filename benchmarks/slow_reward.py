"""A rule reward that takes a fixed time per sample, a stand-in for a sandboxed test run or a remote verifier: the
arithmetic reward, after ``VERL_MEGA_REWARD_DELAY_MS`` milliseconds (default 20) of waiting.

    reward.function=benchmarks/slow_reward.py:score
"""

import os
import time

from verl_mega.rewards.math_reward import arithmetic_score


def score(response: str, ground_truth, **kwargs) -> float:
    time.sleep(float(os.environ.get("VERL_MEGA_REWARD_DELAY_MS", "20")) / 1000)
    return arithmetic_score(response, ground_truth, **kwargs)
