"""GSPO, CISPO, Clip-Cov, KL-Cov, rollout IS weights and DAPO's pieces against hand-computed values."""

import math

import pytest
import torch

from verl_mega.algos.off_policy import off_policy_metrics, off_policy_sums, rollout_is_weights
from verl_mega.algos import (
    POLICY_LOSSES,
    compute_policy_loss,
    compute_policy_loss_cispo,
    compute_policy_loss_clip_cov,
    compute_policy_loss_gspo,
    compute_policy_loss_kl_cov,
    dynamic_sampling_keep,
    get_policy_loss_fn,
    overlong_buffer_penalty,
)

D = torch.float64


def t(rows):
    return torch.tensor(rows, dtype=D)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, expected if isinstance(expected, torch.Tensor) else t(expected),
                               atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------------------- GSPO
def _gspo_case():
    old = t([[-1.0, -2.0, -0.5], [-1.5, -0.7, -2.2]])
    log_ratio = t([[0.1, 0.3, 5.0], [-0.3, 0.0, 0.0]])  # row 0's last token is padding (its 5.0 must not count)
    new = (old + log_ratio).requires_grad_(True)
    adv = t([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    return new, old, adv, mask


def test_gspo_sequence_ratio_clip_and_gradient():
    new, old, adv, mask = _gspo_case()
    loss, m = compute_policy_loss_gspo(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask,
                                       clip_ratio_low=0.2, clip_ratio_high=0.1)
    # row 0: s = exp((0.1 + 0.3) / 2) = exp(0.2) = 1.2214028 > 1.1 and A > 0 -> clipped: max(-1.2214, -1.1) = -1.1
    # row 1: s = exp(-0.3 / 3) = exp(-0.1) = 0.9048374, inside [0.8, 1.1]: -2 * 0.9048374 = -1.8096748
    # seq-mean-token-mean: (-1.1 + -1.8096748) / 2
    assert loss.item() == pytest.approx((-1.1 - 2 * math.exp(-0.1)) / 2)
    assert m["clipfrac"].item() == pytest.approx(2 / 5)  # both tokens of row 0
    assert m["approx_kl"].item() == pytest.approx(-(0.1 + 0.3 - 0.3) / 5)
    loss.backward()
    # row 0 clipped: no gradient; row 1: d/dlogpi_t of (1/2)(1/3) sum_t (-2 s_t) with ds_t/dlogpi_t = s
    g = -(1 / 2) * (1 / 3) * 2 * math.exp(-0.1)
    close(new.grad, [[0, 0, 0], [g, g, g]])


def test_gspo_gradient_equals_the_sequence_level_objective():
    # independent float64 check: differentiate the paper's sequence objective directly (no stop-gradient trick)
    new, old, adv, mask = _gspo_case()
    loss, _ = compute_policy_loss_gspo(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask,
                                       clip_ratio_low=0.5, clip_ratio_high=0.5)  # wide: nothing clipped
    loss.backward()
    lp = new.detach().clone().requires_grad_(True)
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    direct = (-adv[:, 0] * s).mean()
    direct.backward()
    assert loss.item() == pytest.approx(direct.item())
    close(new.grad, lp.grad * mask)


# --------------------------------------------------------------------------------------------------------- CISPO
def test_cispo_clipped_weight_times_log_prob():
    lp = t([[-1.0, -2.0, -0.5, -3.0]])
    ratio = t([[1.5, 0.5, 1.0, 7.0]])
    old = lp - ratio.log()
    new = lp.clone().requires_grad_(True)
    adv = t([[1.0, -1.0, 2.0, 5.0]])
    mask = t([[1, 1, 1, 0]])
    loss, m = compute_policy_loss_cispo(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask,
                                        clip_ratio_low=0.2, clip_ratio_high=0.28)
    # weights clip(r, 0.8, 1.28) = [1.28, 0.8, 1.0]; L = -w A log pi:
    # -(1.28)(1)(-1.0) = 1.28; -(0.8)(-1)(-2.0) = -1.6; -(1.0)(2)(-0.5) = 1.0; mean (1.28 - 1.6 + 1.0) / 3
    assert loss.item() == pytest.approx(0.68 / 3)
    assert m["clipfrac"].item() == pytest.approx(2 / 3)
    assert m["approx_kl"].item() == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3)
    loss.backward()
    # gradient -w A / 3 on every token, clipped ones included (PPO would give token 0 none)
    close(new.grad, [[-1.28 / 3, 0.8 / 3, -2.0 / 3, 0.0]])


# ------------------------------------------------------------------------------------------- Clip-Cov and KL-Cov
# masked-in: A = [3, -1, -1, -1] (mean 0), log pi = [-0.5, -2.5, -1.5, -1.5] (mean -1.5)
# covariance terms (A - 0)(log pi + 1.5) = [3, 1, 0, 0]; the masked-out fifth token (A = 100, log pi = 50) would have
# the largest covariance if it counted
COV_ADV = t([[3.0, -1.0, -1.0, -1.0, 100.0]])
COV_LP = t([[-0.5, -2.5, -1.5, -1.5, 50.0]])
COV_MASK = t([[1, 1, 1, 1, 0]])


def test_clip_cov_drops_the_high_covariance_token():
    new = COV_LP.clone().requires_grad_(True)
    loss, m = compute_policy_loss_clip_cov(log_prob=new, old_log_prob=COV_LP, advantages=COV_ADV,
                                           response_mask=COV_MASK, clip_cov_ratio=0.25, clip_cov_lb=1.0,
                                           clip_cov_ub=5.0)
    # on-policy (r = 1): per-token -A = [-3, 1, 1, 1]; budget max(int(0.25 * 4), 1) = 1; eligible: cov in (1, 5) ->
    # token 0 only (cov 1 is not > 1) -> dropped: (0 + 1 + 1 + 1) / 4
    assert loss.item() == pytest.approx(0.75)
    assert m["covfrac"].item() == pytest.approx(0.25) and m["clipfrac"].item() == 0.0
    loss.backward()
    close(new.grad, [[0.0, 0.25, 0.25, 0.25, 0.0]])  # d(-A r)/dlog pi = -A r, / 4 tokens


def test_clip_cov_leaves_ppo_clipped_tokens_to_the_clip():
    new = COV_LP.clone().requires_grad_(True)
    old = COV_LP - t([[math.log(1.5), 0, 0, 0, 0]])  # token 0: r = 1.5 with A = 3 > 0 -> PPO-clipped at 1.2
    loss, m = compute_policy_loss_clip_cov(log_prob=new, old_log_prob=old, advantages=COV_ADV,
                                           response_mask=COV_MASK, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                           clip_cov_ratio=0.25)
    # token 0 not eligible (already clipped), no other token has cov in (1, 5): nothing dropped
    # token 0: max(-3 * 1.5, -3 * 1.2) = -3.6; others 1: (-3.6 + 3) / 4
    assert loss.item() == pytest.approx(-0.15)
    assert m["covfrac"].item() == 0.0 and m["clipfrac"].item() == pytest.approx(0.25)
    loss.backward()
    close(new.grad, [[0.0, 0.25, 0.25, 0.25, 0.0]])


def test_clip_cov_random_choice_respects_the_budget():
    # A = [2]*4 + [-2]*4 (mean 0), log pi = [-1]*4 + [-3]*4 (mean -2): every covariance term is 2, all eligible
    adv = t([[2.0] * 4 + [-2.0] * 4])
    lp = t([[-1.0] * 4 + [-3.0] * 4])
    grads = []
    for seed in (0, 0, 1):
        new = lp.clone().requires_grad_(True)
        loss, m = compute_policy_loss_clip_cov(log_prob=new, old_log_prob=lp, advantages=adv,
                                               response_mask=torch.ones_like(lp), clip_cov_ratio=0.25,
                                               generator=torch.Generator().manual_seed(seed))
        loss.backward()
        assert m["covfrac"].item() == pytest.approx(2 / 8)  # budget int(0.25 * 8) = 2
        assert int((new.grad == 0).sum()) == 2
        grads.append(new.grad)
    torch.testing.assert_close(grads[0], grads[1])  # same generator seed, same choice


def test_kl_cov_penalises_the_top_covariance_token():
    new = COV_LP.clone().requires_grad_(True)
    old = COV_LP - t([[0.1, 0, 0, 0, 0]])  # token 0: log r = 0.1
    loss, m = compute_policy_loss_kl_cov(log_prob=new, old_log_prob=old, advantages=COV_ADV,
                                         response_mask=COV_MASK, kl_cov_ratio=0.25, ppo_kl_coef=2.0)
    # k = max(1, int(4 * 0.25)) = 1 -> token 0 (cov 3; the masked-out token never counts)
    # token 0: -3 e^0.1 + 2 * |0.1| = -3.3155128 + 0.2; others: -A r = 1; no clipping
    assert loss.item() == pytest.approx((-3 * math.exp(0.1) + 0.2 + 3) / 4)
    assert m["covfrac"].item() == pytest.approx(0.25)
    assert m["abs_kl"].item() == pytest.approx(0.1 / 4) and m["approx_kl"].item() == pytest.approx(-0.1 / 4)
    loss.backward()
    close(new.grad, [[(-3 * math.exp(0.1) + 2.0) / 4, 0.25, 0.25, 0.25, 0.0]])


def test_cov_losses_accept_an_empty_mask():
    for fn in (compute_policy_loss_clip_cov, compute_policy_loss_kl_cov):
        loss, _ = fn(log_prob=COV_LP, old_log_prob=COV_LP, advantages=COV_ADV, response_mask=torch.zeros_like(COV_LP))
        assert loss.item() == 0.0


def test_policy_loss_registry_and_rollout_is_weights():
    assert POLICY_LOSSES == ("vanilla", "gspo", "cispo", "clip_cov", "kl_cov", "decoupled_ppo")
    assert get_policy_loss_fn("vanilla") is compute_policy_loss
    with pytest.raises(ValueError, match="unknown actor.policy_loss 'ppo'"):
        get_policy_loss_fn("ppo")
    # every loss multiplies its per-token loss by the (detached) IS weights: a weight of 2 everywhere doubles it
    new, old, adv, mask = _gspo_case()
    for name in POLICY_LOSSES:
        fn = get_policy_loss_fn(name)
        extra = {"rollout_log_prob": old - 0.1} if name == "decoupled_ppo" else {}
        base, _ = fn(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask, **extra)
        doubled, _ = fn(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask,
                        rollout_is_weights=torch.full_like(mask, 2.0), **extra)
        assert doubled.item() == pytest.approx(2 * base.item()), name


# ----------------------------------------------------------------------------------------------- rollout IS
# token ratios pi_train / pi_rollout: row 0 = [3, 1, 0.25, padding], row 1 = [1.5, 1.2, 0.9, 1.0]
IS_OLD = t([[-1.0, -2.0, -0.5, -4.0], [-1.0, -1.0, -1.0, -1.0]])
IS_ROLLOUT = IS_OLD - t([[math.log(3.0), 0.0, math.log(0.25), 100.0],
                         [math.log(1.5), math.log(1.2), math.log(0.9), 0.0]])
IS_MASK = t([[1, 1, 1, 0], [1, 1, 1, 1]])


def compute_rollout_is_weights(old, rollout, mask, *, level="token", mode="tis", threshold=2.0, threshold_lower=None):
    """The weights, the kept mask and the step's rollout/* metrics, as the actor computes them."""
    w = rollout_is_weights(old, rollout, mask, level=level, mode=mode, upper=threshold, lower=threshold_lower)
    return w.weights, w.mask, off_policy_metrics(off_policy_sums(old, rollout, mask, w))


def test_rollout_is_token_tis():
    w, mask, m = compute_rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, level="token", mode="tis", threshold=2.0)
    close(w, [[2.0, 1.0, 0.25, 0.0], [1.5, 1.2, 0.9, 1.0]])  # 3 truncated to 2; padding 0
    close(mask, IS_MASK)
    assert m["rollout/is_clip_frac"] == pytest.approx(1 / 7)
    assert m["rollout/is_weight_mean"] == pytest.approx((2 + 1 + 0.25 + 1.5 + 1.2 + 0.9 + 1.0) / 7)


def test_rollout_is_token_mask():
    w, mask, m = compute_rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, level="token", mode="mask", threshold=2.0)
    # lower bound 1/2: 3 (> 2) and 0.25 (< 0.5) are dropped from the mask; the rest keep their ratio
    close(mask, [[0, 1, 0, 0], [1, 1, 1, 1]])
    close(w, [[0.0, 1.0, 0.0, 0.0], [1.5, 1.2, 0.9, 1.0]])
    assert m["rollout/is_mask_frac"] == pytest.approx(2 / 7)
    assert m["rollout/is_weight_mean"] == pytest.approx((1 + 1.5 + 1.2 + 0.9 + 1.0) / 5)


def test_rollout_is_sequence_levels():
    # sequence ratios: row 0: 3 * 1 * 0.25 = 0.75; row 1: 1.5 * 1.2 * 0.9 * 1.0 = 1.62
    w, mask, m = compute_rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, level="sequence", mode="tis",
                                            threshold=2.0)
    close(w, [[0.75, 0.75, 0.75, 0.0], [1.62, 1.62, 1.62, 1.62]])
    assert m["rollout/is_clip_frac"] == 0.0
    assert m["rollout/is_weight_mean"] == pytest.approx((3 * 0.75 + 4 * 1.62) / 7)
    w, _, m = compute_rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, level="sequence", mode="tis", threshold=1.5)
    close(w, [[0.75, 0.75, 0.75, 0.0], [1.5, 1.5, 1.5, 1.5]])
    assert m["rollout/is_clip_frac"] == pytest.approx(4 / 7)
    # mask mode keeps or drops whole rows: [0.7, 1.5] keeps row 0 (0.75) and drops row 1 (1.62)
    w, mask, m = compute_rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, level="sequence", mode="mask",
                                            threshold=1.5, threshold_lower=0.7)
    close(mask, [[1, 1, 1, 0], [0, 0, 0, 0]])
    close(w, [[0.75, 0.75, 0.75, 0.0], [0, 0, 0, 0]])
    assert m["rollout/is_mask_frac"] == pytest.approx(4 / 7)
    assert m["rollout/is_weight_mean"] == pytest.approx(0.75)


def test_rollout_is_bad_arguments():
    with pytest.raises(ValueError, match="0 < lower < upper"):
        compute_rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, mode="mask", threshold=2.0, threshold_lower=2.0)
    with pytest.raises(ValueError, match="unknown actor.rollout_is 'geometric'"):
        compute_rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, level="geometric")
    with pytest.raises(ValueError, match="unknown actor.rollout_is_mode 'clip'"):
        compute_rollout_is_weights(IS_OLD, IS_ROLLOUT, IS_MASK, mode="clip")


# ---------------------------------------------------------------------------------------------------------- DAPO
def test_overlong_buffer_penalty():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # L = 20, buffer 4: free up to 16, then -(|y| - 16) / 4, -1 at 20 and beyond
    close(overlong_buffer_penalty(lengths, 20, 4).double(), [0, 0, -0.25, -0.5, -1.0, -1.0])
    close(overlong_buffer_penalty(lengths, 20, 4, penalty_factor=0.5).double(), [0, 0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_buffer_penalty(lengths, 20, 21)


@pytest.mark.parametrize("index, kept", [
    (["a", "a", "b", "b", "c", "c", "d"], ["b"]),
    (torch.tensor([5, 5, 3, 3, 9, 9, 1]), [3]),
])
def test_dynamic_sampling_keeps_groups_with_different_scores(index, kept):
    # a: [1, 1] all equal; b: [0, 1] kept; c: [0.5, 0.5] all equal; d: a single sample
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    rows, groups, stats = dynamic_sampling_keep(scores, index)
    assert rows.tolist() == [False, False, True, True, False, False, False]
    assert groups == kept
    assert stats == {"num_groups": 4.0, "kept_groups": 1.0, "kept_group_frac": 0.25, "kept_rows": 2.0}


def test_dynamic_sampling_tolerance():
    scores = torch.tensor([0.0, 1e-9, 0.0, 1.0])
    assert dynamic_sampling_keep(scores, [0, 0, 1, 1]).rows.tolist() == [True, True, True, True]
    assert dynamic_sampling_keep(scores, [0, 0, 1, 1], atol=1e-6).rows.tolist() == [False, False, True, True]
