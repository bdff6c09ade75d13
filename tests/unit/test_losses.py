"""PPO policy/value losses, entropy and loss aggregation against hand-computed values."""

import math

import pytest
import torch

from verl_mega.algos import (
    LOSS_AGG_MODES,
    agg_loss,
    agg_loss_normalizer,
    compute_policy_loss,
    compute_value_loss,
    entropy_bonus,
    entropy_from_logits,
)

D = torch.float64
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], dtype=D)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=D)  # third row: zero-length / padding row


@pytest.mark.parametrize("mode,expected", [
    ("token-mean", (1 + 2 + 4) / 3),
    ("seq-mean-token-sum", (3 + 4) / 2),
    ("seq-mean-token-mean", (1.5 + 4) / 2),
    ("seq-mean-token-sum-norm", (3 / 3 + 4 / 3) / 2),
    ("token-sum", 1 + 2 + 4),
])
def test_agg_modes(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_sum_norm_uses_constant_horizon():
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10).item() == pytest.approx(0.35)


def test_all_masked_is_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        out = agg_loss(LOSS, torch.zeros_like(MASK), mode)
        assert out.item() == 0.0, mode


def test_nan_in_padding_does_not_leak():
    loss = LOSS.clone()
    loss[2, 2] = float("nan")
    for mode in LOSS_AGG_MODES:
        assert torch.isfinite(agg_loss(loss, MASK, mode)), mode


def test_bad_mode_and_shape():
    with pytest.raises(ValueError, match="unknown actor.loss_agg_mode 'mean'"):
        agg_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="shape"):
        agg_loss(LOSS, MASK[:2], "token-mean")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_global_normaliser_makes_micro_batches_equal_one_batch(mode):
    """Four rows split 1 + 3 (uneven token counts); sum of micro-batch shares == big-batch loss, and the same grad."""
    loss_rows = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0],
                              [2.0, 2.0, 2.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=D)
    # hand values for the whole batch (horizon 4): token sums 10, 11, 7, 6; token counts 4, 2, 1, 3
    expected = {
        "token-mean": (10 + 11 + 7 + 6) / 10,
        "seq-mean-token-sum": (10 + 11 + 7 + 6) / 4,
        "seq-mean-token-mean": (10 / 4 + 11 / 2 + 7 / 1 + 6 / 3) / 4,
        "seq-mean-token-sum-norm": (10 + 11 + 7 + 6) / 4 / 4,
        "token-sum": 10 + 11 + 7 + 6,
    }[mode]
    w_big = torch.ones(4, 4, dtype=D, requires_grad=True)
    big = agg_loss(loss_rows * w_big, mask, mode, loss_scale_factor=4)
    big.backward()
    assert big.item() == pytest.approx(expected)

    w = torch.ones(4, 4, dtype=D, requires_grad=True)
    chunks = [(slice(0, 1)), (slice(1, 4))]
    n_global = sum(agg_loss_normalizer(mask[c], mode) for c in chunks)
    total = 0.0
    for c in chunks:
        share = agg_loss(loss_rows[c] * w[c], mask[c], mode, normalizer=n_global, loss_scale_factor=4)
        share.backward()
        total += share.item()
    assert total == pytest.approx(expected)
    torch.testing.assert_close(w.grad, w_big.grad)
    # without the global normaliser, averaging per-micro-batch means is wrong for token-mean (1 + 3 rows differ)
    if mode == "token-mean":
        naive = sum(agg_loss(loss_rows[c], mask[c], mode).item() for c in chunks) / 2
        assert naive != pytest.approx(expected)


def test_token_sum_normaliser_is_the_constant_one():
    # each micro-batch contributes 0, so the all-reduced normaliser of a mini-batch is 0 whatever its size, and
    # agg_loss ignores it: the shares are plain token sums, which add up to the mini-batch's plain sum
    assert agg_loss_normalizer(MASK, "token-sum").item() == 0.0
    assert agg_loss(LOSS, MASK, "token-sum", normalizer=123.0).item() == pytest.approx(7.0)
    assert agg_loss(LOSS, MASK, "token-sum", normalizer=0.0).item() == pytest.approx(7.0)


# --------------------------------------------------------------------------------------------------- policy loss
def _policy_case():
    ratio = torch.tensor([[1.5, 0.5, 0.5, 4.0, 1.1, 2.0]], dtype=D)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, -2.0, 0.5]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]], dtype=D)
    old = torch.full_like(ratio, -1.0)
    new = (old + ratio.log()).requires_grad_(True)
    return new, old, adv, mask, ratio


def test_policy_loss_clip_and_dual_clip():
    new, old, adv, mask, ratio = _policy_case()
    loss, m = compute_policy_loss(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask,
                                  clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0)
    # per token: A=1,r=1.5: max(-1.5, -1.3) = -1.3 (clipped)   A=1,r=0.5: max(-0.5, -0.8) = -0.5
    #            A=-1,r=0.5: max(0.5, 0.8) = 0.8 (clipped)      A=-1,r=4: max(4, 1.3) = 4 -> dual min(4, 3) = 3
    #            A=-2,r=1.1: 2.2 (dual bound 6 inactive)        last token masked out
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 3.0 + 2.2) / 5)
    assert m["clipfrac"].item() == pytest.approx(2 / 5)
    assert m["clipfrac_lower"].item() == pytest.approx(1 / 5)
    approx_kl = -(math.log(1.5) + 2 * math.log(0.5) + math.log(4.0) + math.log(1.1)) / 5
    assert m["approx_kl"].item() == pytest.approx(approx_kl)
    loss.backward()
    # d(-A r)/d log r = -A r on unclipped tokens (/5 for the mean); clipped / dual-clipped / masked tokens: 0
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.5 / 5, 0.0, 0.0, 2.2 / 5, 0.0]], dtype=D))


def test_policy_loss_without_dual_clip_and_validation():
    new, old, adv, mask, _ = _policy_case()
    loss, m = compute_policy_loss(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask,
                                  clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=None)
    assert loss.item() == pytest.approx((-1.3 - 0.5 + 0.8 + 4.0 + 2.2) / 5)
    assert m["clipfrac_lower"].item() == 0.0
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
        compute_policy_loss(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask, clip_ratio_c=0.5)


def test_policy_loss_seq_mean_token_sum():
    new, old, adv, mask, _ = _policy_case()
    loss, _ = compute_policy_loss(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask,
                                  clip_ratio_low=0.2, clip_ratio_high=0.3, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(-1.3 - 0.5 + 0.8 + 3.0 + 2.2)


def test_policy_loss_rollout_is_weights_scale_tokens():
    new, old, adv, mask, _ = _policy_case()
    weights = torch.tensor([[2.0, 1.0, 0.5, 1.0, 1.0, 9.0]], dtype=D, requires_grad=True)
    loss, _ = compute_policy_loss(log_prob=new, old_log_prob=old, advantages=adv, response_mask=mask,
                                  clip_ratio_low=0.2, clip_ratio_high=0.3, clip_ratio_c=3.0,
                                  rollout_is_weights=weights)
    # per-token losses of test_policy_loss_clip_and_dual_clip, times the weights: -2.6, -0.5, 0.4, 3.0, 2.2
    assert loss.item() == pytest.approx((-2.6 - 0.5 + 0.4 + 3.0 + 2.2) / 5)
    loss.backward()
    assert weights.grad is None  # the weights are detached
    # the unclipped tokens' gradients (-0.5/5 and 2.2/5) times their weights (1 and 1)
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -0.5 / 5, 0.0, 0.0, 2.2 / 5, 0.0]], dtype=D))


def test_policy_loss_on_policy_is_minus_mean_advantage():
    lp = torch.tensor([[-0.3, -2.0, -1.0]], dtype=D)
    adv = torch.tensor([[1.0, -3.0, 0.5]], dtype=D)
    loss, m = compute_policy_loss(log_prob=lp, old_log_prob=lp.clone(), advantages=adv,
                                  response_mask=torch.ones_like(lp))
    assert loss.item() == pytest.approx(-(1.0 - 3.0 + 0.5) / 3)
    assert m["clipfrac"].item() == 0.0 and m["approx_kl"].item() == 0.0


# ---------------------------------------------------------------------------------------------------- value loss
def test_value_loss_clipped():
    values = torch.tensor([[1.0, 1.0, -1.0, 50.0]], dtype=D)
    old = torch.tensor([[0.0, 0.8, 0.0, 0.0]], dtype=D)
    returns = torch.tensor([[2.0, 0.0, -1.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1, 0]], dtype=D)
    loss, m = compute_value_loss(values=values, old_values=old, returns=returns, response_mask=mask,
                                 cliprange_value=0.5)
    # token 0: (1-2)^2 = 1 vs (0.5-2)^2 = 2.25 -> 2.25; token 1: 1 vs 1 -> 1; token 2: 0 vs (-0.5+1)^2 = 0.25
    assert loss.item() == pytest.approx(0.5 * (2.25 + 1.0 + 0.25) / 3)
    assert m["vf_clipfrac"].item() == pytest.approx(2 / 3)
    plain, _ = compute_value_loss(values=values, old_values=old, returns=returns, response_mask=mask,
                                  cliprange_value=None)
    assert plain.item() == pytest.approx(0.5 * (1.0 + 1.0 + 0.0) / 3)


# ------------------------------------------------------------------------------------------------------- entropy
def test_entropy_from_logits():
    logits = torch.tensor([[0.0, 0.0, -1e9, -1e9], [0.0, math.log(3.0), -1e9, -1e9], [1.0, 1.0, 1.0, 1.0],
                           [1000.0, 0.0, 0.0, 0.0]], dtype=torch.float32)
    h = entropy_from_logits(logits)
    h_3 = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(h, torch.tensor([math.log(2), h_3, math.log(4), 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy_from_logits(logits.reshape(2, 2, 4), chunk_size=1), h.reshape(2, 2))
    assert entropy_from_logits(torch.randn(3, 5).bfloat16()).dtype == torch.float32


def test_entropy_bonus_sign_and_scale():
    ent = torch.tensor([[1.0, 2.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]], dtype=D)
    assert entropy_bonus(ent, mask, 0.01).item() == pytest.approx(-0.01 * 1.5)
    assert entropy_bonus(ent, mask, 0.0).item() == 0.0
