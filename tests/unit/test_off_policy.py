"""Off-policy corrections against hand-computed values: truncated and masked IS (token and sequence level), the loss
normaliser under masking, decoupled PPO (exactly PPO when the rollout and old log-probs agree) and the rollout/*
metrics, whose sums add up over data-parallel shards."""

import math

import pytest
import torch

from verl_mega.algos import (
    agg_loss_normalizer,
    compute_policy_loss,
    compute_policy_loss_decoupled_ppo,
    off_policy_metrics,
    off_policy_sums,
    rollout_is_weights,
)

D = torch.float64


def t(rows, dtype=D):
    return torch.tensor(rows, dtype=dtype)


def close(actual, expected, atol=1e-12):
    torch.testing.assert_close(actual, expected if isinstance(expected, torch.Tensor) else t(expected),
                               atol=atol, rtol=0)


# token ratios r = pi_old / pi_rollout: row 0 = [3, 1, 0.25, padding], row 1 = [1.5, 1.2, 0.9, 1.0]
OLD = t([[-1.0, -2.0, -0.5, -4.0], [-1.0, -1.0, -1.0, -1.0]])
LOG_R = t([[math.log(3.0), 0.0, math.log(0.25), 100.0], [math.log(1.5), math.log(1.2), math.log(0.9), 0.0]])
ROLLOUT = OLD - LOG_R
MASK = t([[1, 1, 1, 0], [1, 1, 1, 1]])


# ------------------------------------------------------------------------------------------------ IS weights
def test_token_tis_truncates_at_the_upper_bound():
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", mode="tis", upper=2.0)
    close(w.weights, [[2.0, 1.0, 0.25, 0.0], [1.5, 1.2, 0.9, 1.0]])  # 3 -> 2; the padding's 100 never counts
    close(w.mask, MASK)
    assert w.truncated.tolist() == [[True, False, False, False], [False, False, False, False]]
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", mode="tis", upper=1.25)
    close(w.weights, [[1.25, 1.0, 0.25, 0.0], [1.25, 1.2, 0.9, 1.0]])
    assert int(w.truncated.sum()) == 2
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", mode="tis", upper=None)  # untruncated
    close(w.weights, [[3.0, 1.0, 0.25, 0.0], [1.5, 1.2, 0.9, 1.0]])
    assert not w.truncated.any()


def test_sequence_level_is_the_product_of_token_ratios_in_log_space():
    # row 0: 3 * 1 * 0.25 = 0.75; row 1: 1.5 * 1.2 * 0.9 * 1.0 = 1.62
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", mode="tis", upper=5.0)
    close(w.weights, [[0.75, 0.75, 0.75, 0.0], [1.62, 1.62, 1.62, 1.62]])
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", mode="tis", upper=1.5)
    close(w.weights, [[0.75, 0.75, 0.75, 0.0], [1.5, 1.5, 1.5, 1.5]])
    assert w.truncated.tolist() == [[False] * 4, [True] * 4]
    # 200 tokens of ratio 3 then 1/3 (float32): the running product 3^200 overflows float32, the log-space sum does not
    n = 200
    log_r = torch.cat([torch.full((1, n), math.log(3.0)), torch.full((1, n), -math.log(3.0))], dim=1)
    assert torch.isinf(torch.exp(log_r[:, :n]).prod())
    old = torch.zeros(1, 2 * n)
    w = rollout_is_weights(old, old - log_r, torch.ones(1, 2 * n), level="sequence", mode="tis", upper=2.0)
    assert w.weights.dtype == torch.float32
    close(w.weights.double(), torch.ones(1, 2 * n, dtype=D), atol=1e-4)
    # a row whose log-ratio sum is huge is clamped at exp(20) before the truncation: finite, truncated to upper
    w = rollout_is_weights(t([[0.0, 0.0]]), t([[-30.0, -30.0]]), t([[1, 1]]), level="sequence", mode="tis",
                           upper=None)
    close(w.weights, [[math.exp(20.0), math.exp(20.0)]], atol=1e-3)


def test_token_mask_drops_tokens_from_the_loss_and_the_normaliser():
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", mode="mask", upper=2.0)  # lower = 1/2
    close(w.mask, [[0, 1, 0, 0], [1, 1, 1, 1]])  # 3 > 2 and 0.25 < 0.5 leave the mask
    close(w.weights, [[0.0, 1.0, 0.0, 0.0], [1.5, 1.2, 0.9, 1.0]])
    assert not w.truncated.any()
    adv = t([[1.0, 2.0, 3.0, 0.0], [1.0, 1.0, -1.0, 2.0]])
    # on-policy ratio 1: L_t = -A_t w_t over the kept tokens; token-mean divides by the 5 kept tokens, not 7
    loss, _ = compute_policy_loss(log_prob=OLD, old_log_prob=OLD, advantages=adv, response_mask=w.mask,
                                  rollout_is_weights=w.weights)
    assert loss.item() == pytest.approx(-(2.0 * 1.0 + 1.5 + 1.2 - 0.9 + 2.0) / 5, abs=1e-12)
    assert agg_loss_normalizer(w.mask, "token-mean").item() == 5
    # seq-mean-token-mean: each row's mean over its kept tokens, then the mean over the 2 rows
    loss, _ = compute_policy_loss(log_prob=OLD, old_log_prob=OLD, advantages=adv, response_mask=w.mask,
                                  rollout_is_weights=w.weights, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-2.0 / 1 + -(1.5 + 1.2 - 0.9 + 2.0) / 4) / 2, abs=1e-12)


def test_sequence_mask_drops_whole_rows_and_their_share_of_the_denominator():
    # [0.7, 1.5] keeps row 0 (0.75) and drops row 1 (1.62)
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", mode="mask", upper=1.5, lower=0.7)
    close(w.mask, [[1, 1, 1, 0], [0, 0, 0, 0]])
    close(w.weights, [[0.75, 0.75, 0.75, 0.0], [0, 0, 0, 0]])
    for mode, expected in (("token-mean", 3), ("seq-mean-token-mean", 1), ("seq-mean-token-sum", 1)):
        assert agg_loss_normalizer(w.mask, mode).item() == expected, mode  # the dropped row no longer counts
    adv = t([[1.0, 2.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
    loss, _ = compute_policy_loss(log_prob=OLD, old_log_prob=OLD, advantages=adv, response_mask=w.mask,
                                  rollout_is_weights=w.weights, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-0.75 * 6.0, abs=1e-12)


def test_bad_bounds():
    with pytest.raises(ValueError, match="0 < lower < upper"):
        rollout_is_weights(OLD, ROLLOUT, MASK, mode="mask", upper=2.0, lower=3.0)
    with pytest.raises(ValueError, match="needs an upper"):
        rollout_is_weights(OLD, ROLLOUT, MASK, mode="mask", upper=None)


# ---------------------------------------------------------------------------------------------- decoupled PPO
def _ppo_case(dtype=D):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g, dtype=dtype) * 3
    new = old + torch.randn(4, 6, generator=g, dtype=dtype) * 0.4  # many ratios outside [0.8, 1.2]
    adv = torch.randn(4, 6, generator=g, dtype=dtype) * 2  # negative ones reach the dual clip
    mask = t([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0] * 6], dtype=dtype)
    return new, old, adv, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", "token-sum"])
def test_decoupled_ppo_is_ppo_when_rollout_equals_old(dtype, agg):
    new, old, adv, mask = _ppo_case(dtype)
    results = []
    for decoupled in (False, True):
        lp = new.clone().requires_grad_(True)
        kw = dict(log_prob=lp, old_log_prob=old, advantages=adv, response_mask=mask, clip_ratio_c=3.0,
                  loss_agg_mode=agg)
        if decoupled:
            loss, metrics = compute_policy_loss_decoupled_ppo(rollout_log_prob=old.clone(), behaviour_weight_cap=2.0,
                                                              **kw)
        else:
            loss, metrics = compute_policy_loss(**kw)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (ppo, ppo_grad, ppo_m), (dec, dec_grad, dec_m) = results
    assert torch.equal(ppo, dec) and torch.equal(ppo_grad, dec_grad)  # bit for bit, not approximately
    assert all(torch.equal(ppo_m[k], dec_m[k]) for k in ppo_m)


def test_decoupled_ppo_with_a_known_proximal_over_behaviour_ratio():
    # three tokens, u = pi_theta / pi_prox and w = pi_prox / pi_behav; clip 0.2, dual clip 3
    old = t([[-1.0, -1.0, -1.0]])
    log_u = t([[0.1, math.log(1.5), math.log(0.5)]])
    rollout = old - t([[math.log(2.0), math.log(0.5), math.log(4.0)]])  # w = [2, 0.5, 4]
    adv = t([[1.0, 1.0, -1.0]])
    mask = t([[1, 1, 1]])
    lp = (old + log_u).requires_grad_(True)
    loss, _ = compute_policy_loss_decoupled_ppo(log_prob=lp, old_log_prob=old, rollout_log_prob=rollout,
                                                advantages=adv, response_mask=mask)
    # token 0: u = e^0.1 inside the clip: -2 e^0.1; token 1: u = 1.5 clipped to 1.2 (A > 0): -0.5 * 1.2;
    # token 2: A < 0, u = 0.5: max(0.5, 0.8) = 0.8 (< dual bound 3): 4 * 0.8
    per_token = [-2.0 * math.exp(0.1), -0.5 * 1.2, 4.0 * 0.8]
    assert loss.item() == pytest.approx(sum(per_token) / 3, abs=1e-12)
    loss.backward()
    # only the unclipped token has a gradient: d(-A w u)/dlog pi = -A w u, over 3 tokens
    close(lp.grad, [[-2.0 * math.exp(0.1) / 3, 0.0, 0.0]])
    # cap 2.5 truncates token 2's weight 4 -> 2.5 and leaves 2 and 0.5 alone
    capped, _ = compute_policy_loss_decoupled_ppo(log_prob=lp.detach(), old_log_prob=old, rollout_log_prob=rollout,
                                                  advantages=adv, response_mask=mask, behaviour_weight_cap=2.5)
    assert capped.item() == pytest.approx((per_token[0] + per_token[1] + 2.5 * 0.8) / 3, abs=1e-12)


# ------------------------------------------------------------------------------------------------------ metrics
def test_off_policy_metrics_by_hand():
    d = LOG_R * MASK  # log r on the 7 response tokens
    r = torch.exp(d)
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", mode="tis", upper=2.0)
    m = off_policy_metrics(off_policy_sums(OLD, ROLLOUT, MASK, w))
    assert m["rollout/is_weight_mean"] == pytest.approx((2 + 1 + 0.25 + 1.5 + 1.2 + 0.9 + 1.0) / 7, abs=1e-12)
    assert m["rollout/is_clip_frac"] == pytest.approx(1 / 7) and m["rollout/is_mask_frac"] == 0.0
    assert m["rollout/behaviour_kl"] == pytest.approx(-float(d.sum()) / 7, abs=1e-12)
    assert m["rollout/behaviour_kl_k3"] == pytest.approx(float(((r - 1 - d) * MASK).sum()) / 7, abs=1e-12)
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="token", mode="mask", upper=2.0)
    m = off_policy_metrics(off_policy_sums(OLD, ROLLOUT, MASK, w))
    assert m["rollout/is_mask_frac"] == pytest.approx(2 / 7) and m["rollout/is_clip_frac"] == 0.0
    assert m["rollout/is_weight_mean"] == pytest.approx((1 + 1.5 + 1.2 + 0.9 + 1.0) / 5, abs=1e-12)  # kept tokens
    plain = off_policy_metrics(off_policy_sums(OLD, ROLLOUT, MASK), corrected=False)
    assert set(plain) == {"rollout/behaviour_kl", "rollout/behaviour_kl_k3"}
    none = torch.zeros_like(MASK)
    empty = off_policy_metrics(off_policy_sums(OLD, ROLLOUT, none, rollout_is_weights(OLD, ROLLOUT, none)))
    assert all(v == 0.0 for v in empty.values())


def test_off_policy_sums_add_up_over_shards():
    # what the data-parallel all-reduce does: the metrics of the summed shards are the whole batch's token means,
    # not a mean of per-shard means (row 0 has 3 tokens, row 1 has 4)
    w = rollout_is_weights(OLD, ROLLOUT, MASK, level="sequence", mode="mask", upper=1.5, lower=0.7)
    whole = off_policy_sums(OLD, ROLLOUT, MASK, w)
    parts = sum(off_policy_sums(OLD[i:i + 1], ROLLOUT[i:i + 1], MASK[i:i + 1],
                                type(w)(*(x[i:i + 1] for x in w))) for i in range(2))
    close(parts, whole)
    m = off_policy_metrics(parts)
    assert m["rollout/is_mask_frac"] == pytest.approx(4 / 7) and m["rollout/is_weight_mean"] == pytest.approx(0.75)
