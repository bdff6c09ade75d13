"""verl custom reward for the arithmetic prompts (reward.custom_reward_function.path=<this file>): the same rule as
verl_mega's ``arithmetic`` reward -- 1.0 iff the first integer in the response equals the answer."""

import re

_INT = re.compile(r"-?\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    m = _INT.search(solution_str or "")
    return 1.0 if m is not None and m.group(0) == str(ground_truth).strip() else 0.0
