"""Advantage estimators against values worked out by hand (arithmetic written out below each case)."""

import math

import numpy as np
import pytest
import torch

from verl_mega.algos import (
    AdvantageEstimator,
    compute_advantage,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_advantage,
    compute_reinforce_plus_plus_baseline_advantage,
    compute_remax_advantage,
    compute_rloo_outcome_advantage,
    masked_whiten,
    outcome_to_token_rewards,
)

D = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=D)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, t(expected) if not isinstance(expected, torch.Tensor) else expected,
                               atol=atol, rtol=0)


# ----------------------------------------------------------------------------------------------------------- GAE
def test_gae_gamma_lam_one_gives_reward_to_go_minus_value():
    # delta2 = 1 - 0.7 = 0.3; delta1 = 0.7 - 0.6 = 0.1; delta0 = 0.6 - 0.5 = 0.1
    # A = [0.5, 0.4, 0.3]; returns = A + V = [1, 1, 1]
    adv, ret = compute_gae_advantage_return(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 1.0, 1.0,
                                            whiten=False)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_discounted_with_padding_and_gap():
    rewards = t([[0, 0, 1], [0, 2, 0], [0, 0, 1]])
    values = t([[0.5, 0.6, 0.7], [1, 1, 9], [0.5, 5.0, 0.7]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8, whiten=False)
    # row 0: A2 = 0.3; A1 = (0.9*0.7 - 0.6) + 0.72*0.3 = 0.246; A0 = (0.9*0.6 - 0.5) + 0.72*0.246 = 0.21712
    # row 1 (last token is padding): A1 = 2 - 1 = 1; A0 = (0.9*1 - 1) + 0.72*1 = 0.62
    # row 2 (token 1 masked out, skipped): A2 = 0.3; A0 = (0.9*0.7 - 0.5) + 0.72*0.3 = 0.346
    close(adv, [[0.21712, 0.246, 0.3], [0.62, 1.0, 0.0], [0.346, 0.0, 0.3]])
    close(ret, [[0.71712, 0.846, 1.0], [1.62, 2.0, 0.0], [0.846, 0.0, 1.0]])


def test_gae_whitened_over_masked_tokens():
    # raw A = [0.5, 0.4, 0.3]: mean 0.4, unbiased var (0.01 + 0 + 0.01) / 2 = 0.01 -> [1, 0, -1]
    adv, ret = compute_gae_advantage_return(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 1.0, 1.0)
    close(adv, [[1.0, 0.0, -1.0]], atol=1e-5)
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_zero_length_and_all_masked_rows_are_zero_and_finite():
    rewards = t([[0, 1], [3, 3]])
    values = t([[0.2, 0.4], [7, 7]])
    adv, ret = compute_gae_advantage_return(rewards, values, t([[1, 1], [0, 0]]), 1.0, 1.0, whiten=False)
    close(adv, [[0.8, 0.6], [0, 0]])  # A1 = 1 - 0.4; A0 = 0.4 - 0.2 + 0.6
    close(ret, [[1.0, 1.0], [0, 0]])
    adv, ret = compute_gae_advantage_return(rewards, values, t([[0, 0], [0, 0]]), 1.0, 1.0)
    assert torch.all(adv == 0) and torch.all(ret == 0)


def test_masked_whiten_matches_float64_loop():
    values = t([[1.0, 2.0, 100.0], [4.0, -5.0, 6.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    picked = [1.0, 2.0, 4.0, -5.0, 6.0]
    mean = sum(picked) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in picked) / 4)
    expected = [[(1 - mean) / std, (2 - mean) / std, 0.0], [(4 - mean) / std, (-5 - mean) / std, (6 - mean) / std]]
    close(masked_whiten(values, mask), expected, atol=1e-6)


# ---------------------------------------------------------------------------------------------- outcome methods
# six rows, outcome reward on the last response token; groups: a = rows 0-2, b = rows 3-4, c = row 5
OUT_REWARDS = t([[0, 1.0, 0], [0, 0, 0.0], [0.5, 0, 0], [0, 2.0, 0], [0, 0, 2.0], [3.0, 0, 0]])
OUT_MASK = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])
GROUPS = ["a", "a", "a", "b", "b", "c"]


def test_grpo_normalised_by_std():
    # group a: scores [1, 0, 0.5], mean 0.5, unbiased std sqrt((0.25 + 0.25 + 0) / 2) = 0.5
    # group b: all equal -> 0; group c: a single sample -> 0
    eps = 1e-6
    adv, ret = compute_grpo_outcome_advantage(OUT_REWARDS, OUT_MASK, GROUPS, True, epsilon=eps)
    a = 0.5 / (0.5 + eps)
    close(adv, [[a, a, 0], [-a, -a, -a], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    close(ret, adv)


def test_grpo_without_std_is_dr_grpo():
    adv, _ = compute_grpo_outcome_advantage(OUT_REWARDS, OUT_MASK, GROUPS, norm_adv_by_std_in_grpo=False)
    close(adv, [[0.5, 0.5, 0], [-0.5, -0.5, -0.5], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])


def test_dr_grpo_estimator_never_divides_by_std():
    # the dr_grpo estimator ignores norm_adv_by_std_in_grpo: A = s - mean_g, as hand-computed above
    adv, _ = compute_advantage("dr_grpo", token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK, group_index=GROUPS,
                               norm_adv_by_std_in_grpo=True)
    close(adv, [[0.5, 0.5, 0], [-0.5, -0.5, -0.5], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize("index", [
    [7, 7, 7, 3, 3, 9],
    np.array(["p1", "p1", "p1", "p2", "p2", "p3"]),
    torch.tensor([5, 5, 5, 0, 0, 2]),
])
def test_grpo_group_index_types(index):
    adv, _ = compute_grpo_outcome_advantage(OUT_REWARDS, OUT_MASK, index, norm_adv_by_std_in_grpo=False)
    assert adv[0, 0].item() == pytest.approx(0.5) and adv[1, 2].item() == pytest.approx(-0.5)
    assert torch.all(adv[3:] == 0)


def test_grpo_zero_length_response_counts_in_group_but_gets_no_tokens():
    # scores [1, 0]: mean 0.5, std sqrt(0.5); the reward placed on the masked-out row is ignored
    rewards = t([[0, 1.0], [0, 4.0]])
    mask = t([[1, 1], [0, 0]])
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, [0, 0], epsilon=0.0)
    a = 0.5 / math.sqrt(0.5)
    close(adv, [[a, a], [0, 0]])


def test_grpo_bad_group_index_length():
    with pytest.raises(ValueError, match="group_index has 2 entries"):
        compute_grpo_outcome_advantage(OUT_REWARDS, OUT_MASK, [0, 1])


def test_rloo_leave_one_out():
    # group a: 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0; b: 2 - 2 = 0; c: single -> 0
    adv, ret = compute_rloo_outcome_advantage(OUT_REWARDS, OUT_MASK, GROUPS)
    close(adv, [[0.75, 0.75, 0], [-0.75, -0.75, -0.75], [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    close(ret, adv)


def test_reinforce_plus_plus_return_to_go_and_whitening():
    rewards = t([[0, 0, 1], [0, 2, 0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    # row 0: G = [0.25, 0.5, 1]; row 1: G = [0 + 0.5 * 2, 2, pad] = [1, 2, 0]
    close(ret, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    # masked G: 0.25 0.5 1 1 2 -> mean 0.95, sum of squared deviations 1.8, unbiased var 0.45
    s = math.sqrt(0.45)
    close(adv, [[(0.25 - 0.95) / s, (0.5 - 0.95) / s, (1 - 0.95) / s], [(1 - 0.95) / s, (2 - 0.95) / s, 0]],
          atol=1e-6)


def test_reinforce_plus_plus_baseline():
    rewards = t([[0, 1.0], [0.0, 0], [0, 5.0]])
    mask = t([[1, 1], [1, 0], [1, 1]])
    adv, _ = compute_reinforce_plus_plus_baseline_advantage(rewards, mask, [0, 0, 1])
    # scores [1, 0, 5]; group 0 mean 0.5 -> [0.5, -0.5]; group 1 single -> 0
    # tokens: 0.5 0.5 -0.5 0 0 -> mean 0.1; squared deviations .16 .16 .36 .01 .01 = 0.7; var 0.7 / 4 = 0.175
    s = math.sqrt(0.175)
    close(adv, [[0.4 / s, 0.4 / s], [-0.6 / s, 0], [-0.1 / s, -0.1 / s]], atol=1e-6)


def test_remax():
    rewards = t([[0, 0, 1], [0, 2, 0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_remax_advantage(rewards, mask, t([0.5, 3.0]))
    close(ret, [[1, 1, 1], [2, 2, 0]])
    close(adv, [[0.5, 0.5, 0.5], [-1, -1, 0]])


def test_all_equal_rewards_give_zero_for_group_methods():
    rewards = t([[0, 1.0], [0, 1.0], [0, 1.0], [0, 1.0]])
    mask = torch.ones(4, 2, dtype=D)
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        adv, _ = compute_advantage(name, token_level_rewards=rewards, response_mask=mask, group_index=[0, 0, 1, 1])
        assert torch.all(adv == 0), name


def test_registry_dispatch_and_errors():
    assert [e.value for e in AdvantageEstimator] == [
        "gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
    adv, _ = compute_advantage("rloo", token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK, group_index=GROUPS,
                               values=torch.zeros_like(OUT_MASK))
    assert adv[0, 0].item() == pytest.approx(0.75)
    adv, _ = compute_advantage(AdvantageEstimator.REMAX, token_level_rewards=t([[0, 1.0]]),
                               response_mask=t([[1, 1]]), reward_baselines=t([0.25]))
    close(adv, [[0.75, 0.75]])
    with pytest.raises(ValueError, match="needs `values`"):
        compute_advantage("gae", token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK)
    with pytest.raises(ValueError, match="needs `group_index`"):
        compute_advantage("grpo", token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK)
    with pytest.raises(ValueError, match="unknown algorithm.adv_estimator 'ppo'"):
        compute_advantage("ppo", token_level_rewards=OUT_REWARDS, response_mask=OUT_MASK)
    with pytest.raises(ValueError, match="shape"):
        compute_advantage("remax", token_level_rewards=t([[1.0]]), response_mask=OUT_MASK,
                          reward_baselines=t([0.0]))


def test_outputs_are_zero_outside_mask_for_every_estimator():
    torch.manual_seed(0)
    rewards = torch.randn(6, 5, dtype=D)
    mask = (torch.rand(6, 5) > 0.4).to(D)
    mask[2] = 0
    kw = dict(token_level_rewards=rewards, response_mask=mask, values=torch.randn(6, 5, dtype=D),
              group_index=[0, 0, 1, 1, 2, 2], reward_baselines=torch.randn(6, dtype=D), gamma=0.9, lam=0.95)
    for e in AdvantageEstimator:
        adv, ret = compute_advantage(e, **kw)
        assert adv.shape == ret.shape == (6, 5)
        assert torch.isfinite(adv).all() and torch.isfinite(ret).all(), e
        assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0), e


def test_outcome_to_token_rewards_places_score_on_last_response_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
    out = outcome_to_token_rewards(torch.tensor([0.5, 1.0, 7.0, -2.0]), mask)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([[0, 0, 0.5, 0], [1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0, -2.0, 0]]))


def test_low_precision_inputs_are_computed_in_float32():
    # 200 tokens of reward 0.01 with gamma = lam = 1: A_0 = 2.0 - V_0 exactly; a bf16 recursion would drift
    rewards = torch.full((1, 200), 0.01, dtype=torch.bfloat16)
    values = torch.zeros(1, 200, dtype=torch.bfloat16)
    mask = torch.ones(1, 200)
    _, ret = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0, whiten=False)
    expected_r0 = 200 * float(torch.tensor(0.01, dtype=torch.bfloat16))
    assert ret.dtype == torch.bfloat16 and abs(float(ret[0, 0]) - expected_r0) < 0.02
    _, ret = compute_reinforce_plus_plus_advantage(rewards, mask, gamma=1.0)
    assert ret.dtype == torch.bfloat16 and abs(float(ret[0, 0]) - expected_r0) < 0.02


# ------------------------------------------------------------------------------------- masks with holes (multi-turn)
# Positions masked out *inside* a response (tool output, observations) must be skipped, never treated as the end of
# the response. Rewards sitting on a hole (the 7.0 and 3.0 below) are ignored by every estimator.
HOLE_MASK = t([[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0]])
HOLE_REWARDS = t([[0, 0, 7.0, 0, 0, 1.0], [0, 3.0, 0, 0, 0, 0], [0, 0, 0, 0, 0.5, 0]])  # scores 1, 0, 0.5


def test_reinforce_plus_plus_carries_the_return_across_holes():
    # the example from the bug report: gamma = 1, outcome reward 1 on the last token -> every response token gets 1
    _, ret = compute_reinforce_plus_plus_advantage(t([[0, 0, 0, 0, 0, 1.0]]), t([[1, 1, 0, 0, 1, 1]]), gamma=1.0)
    close(ret, [[1, 1, 0, 0, 1, 1]])


def test_reinforce_plus_plus_discounts_only_masked_in_tokens():
    rewards = t([[0, 0, 7.0, 0, 0, 1.0], [0, 3.0, 0, 2.0, 0, 9.0]])
    mask = t([[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 0, 0]])
    adv, ret = compute_reinforce_plus_plus_advantage(rewards, mask, gamma=0.5)
    # row 0: G5 = 1; G4 = 0.5 * 1 = 0.5; holes 3, 2 skipped (their 7 ignored); G1 = 0.5 * 0.5 = 0.25; G0 = 0.125
    # row 1: tail padding 5, 4 ignored (the 9 too); G3 = 2; G2 = 0.5 * 2 = 1; hole 1 skipped (its 3 ignored);
    #        G0 = 0.5 * 1 = 0.5
    close(ret, [[0.125, 0.25, 0, 0, 0.5, 1.0], [0.5, 0, 1.0, 2.0, 0, 0]])
    picked = [0.125, 0.25, 0.5, 1.0, 0.5, 1.0, 2.0]
    mean = sum(picked) / 7
    std = math.sqrt(sum((x - mean) ** 2 for x in picked) / 6)
    expected = [[(0.125 - mean) / std, (0.25 - mean) / std, 0, 0, (0.5 - mean) / std, (1.0 - mean) / std],
                [(0.5 - mean) / std, 0, (1.0 - mean) / std, (2.0 - mean) / std, 0, 0]]
    close(adv, expected, atol=1e-6)


def test_gae_skips_holes():
    rewards = t([[0, 0, 5.0, 0, 0, 1.0]])
    values = t([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]])
    adv, ret = compute_gae_advantage_return(rewards, values, t([[1, 1, 0, 0, 1, 1]]), gamma=0.9, lam=0.8,
                                            whiten=False)
    # A5 = 1 - 0.4 = 0.6; A4 = (0.9*0.4 - 0.3) + 0.72*0.6 = 0.06 + 0.432 = 0.492
    # holes 3, 2 skipped (V = 9 and r = 5 never used): V_next of token 1 is V4 = 0.3, A_next is A4
    # A1 = (0.9*0.3 - 0.2) + 0.72*0.492 = 0.07 + 0.35424 = 0.42424
    # A0 = (0.9*0.2 - 0.1) + 0.72*0.42424 = 0.08 + 0.3054528 = 0.3854528
    close(adv, [[0.3854528, 0.42424, 0, 0, 0.492, 0.6]])
    close(ret, [[0.4854528, 0.62424, 0, 0, 0.792, 1.0]])


def test_grpo_with_holes():
    eps = 1e-6
    adv, ret = compute_grpo_outcome_advantage(HOLE_REWARDS, HOLE_MASK, [0, 0, 0], epsilon=eps)
    # scores [1, 0, 0.5]: mean 0.5, unbiased std 0.5 -> [1, -1, 0] * 0.5 / (0.5 + eps), on masked-in tokens only
    a = 0.5 / (0.5 + eps)
    close(adv, [[a, a, 0, 0, a, a], [-a, 0, -a, -a, 0, 0], [0, 0, 0, 0, 0, 0]])
    close(ret, adv)
    adv, _ = compute_grpo_outcome_advantage(HOLE_REWARDS, HOLE_MASK, [0, 0, 0], norm_adv_by_std_in_grpo=False)
    close(adv, [[0.5, 0.5, 0, 0, 0.5, 0.5], [-0.5, 0, -0.5, -0.5, 0, 0], [0, 0, 0, 0, 0, 0]])


def test_rloo_with_holes():
    adv, _ = compute_rloo_outcome_advantage(HOLE_REWARDS, HOLE_MASK, [0, 0, 0])
    # 1 - (0 + 0.5)/2 = 0.75; 0 - (1 + 0.5)/2 = -0.75; 0.5 - (1 + 0)/2 = 0
    close(adv, [[0.75, 0.75, 0, 0, 0.75, 0.75], [-0.75, 0, -0.75, -0.75, 0, 0], [0, 0, 0, 0, 0, 0]])


def test_reinforce_plus_plus_baseline_with_holes():
    adv, _ = compute_reinforce_plus_plus_baseline_advantage(HOLE_REWARDS, HOLE_MASK, [0, 0, 0])
    # centred scores [0.5, -0.5, 0] on 4 + 3 + 3 = 10 tokens: mean (2 - 1.5 + 0) / 10 = 0.05
    # deviations 0.45 (x4), -0.55 (x3), -0.05 (x3): squares 0.81 + 0.9075 + 0.0075 = 1.725, unbiased var 1.725 / 9
    s = math.sqrt(1.725 / 9 + 1e-8)
    hi, lo, mid = 0.45 / s, -0.55 / s, -0.05 / s
    close(adv, [[hi, hi, 0, 0, hi, hi], [lo, 0, lo, lo, 0, 0], [mid, 0, 0, mid, mid, 0]], atol=1e-6)


def test_remax_with_holes():
    rewards = t([[0, 0, 7.0, 0, 0, 1.0], [0.5, 3.0, 0, 2.0, 0, 9.0]])
    mask = t([[1, 1, 0, 0, 1, 1], [1, 0, 1, 1, 0, 0]])
    adv, ret = compute_remax_advantage(rewards, mask, t([0.25, 1.0]))
    # row 0: reward-to-go 1 everywhere in the response; row 1: masked rewards [0.5, _, 0, 2] -> G = [2.5, _, 2, 2]
    close(ret, [[1, 1, 0, 0, 1, 1], [2.5, 0, 2, 2, 0, 0]])
    close(adv, [[0.75, 0.75, 0, 0, 0.75, 0.75], [1.5, 0, 1, 1, 0, 0]])
