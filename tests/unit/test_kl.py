"""KL estimators, KL-in-reward, KL loss and the KL-coefficient controllers against hand-computed values."""

import math

import pytest
import torch

from verl_mega.algos import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_kl_loss,
    kl_penalty,
    make_kl_controller,
)

D = torch.float64
LOGP = torch.tensor([-1.0, -2.0], dtype=D)
REF = torch.tensor([-1.5, -1.0], dtype=D)  # d = logp - ref = [0.5, -1.0]


@pytest.mark.parametrize("kinds,expected", [
    (("kl", "k1"), [0.5, -1.0]),
    (("abs",), [0.5, 1.0]),
    (("mse", "k2"), [0.125, 0.5]),
    (("low_var_kl", "k3"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]),
])
def test_estimators(kinds, expected):
    for kind in kinds:
        torch.testing.assert_close(kl_penalty(LOGP, REF, kind), torch.tensor(expected, dtype=D))


def test_k3_is_clamped():
    d = torch.tensor([-30.0, 30.0, 0.0], dtype=D)
    out = kl_penalty(d, torch.zeros_like(d), "low_var_kl")
    # d=-30: exp(20) - 20 - 1 -> clamp 10; d=30: exp(-20) + 20 - 1 = 19.000000002 -> clamp 10; d=0: 0
    torch.testing.assert_close(out, torch.tensor([10.0, 10.0, 0.0], dtype=D))


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator 'full'"):
        kl_penalty(LOGP, REF, "full")


def test_apply_kl_penalty():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)
    d = torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.2, 5.0]], dtype=D)
    ref = torch.full_like(d, -2.0)
    out, metrics = apply_kl_penalty(rewards, ref + d, ref, mask, coef=0.5, kind="kl")
    torch.testing.assert_close(out, torch.tensor([[-0.05, -0.1, 0.85], [-0.2, 1.1, 0.0]], dtype=D))
    # per-sequence masked mean KL: 0.2 and 0.1 -> batch mean 0.15
    assert metrics["kl"] == pytest.approx(0.15)
    assert metrics["kl_coef"] == 0.5


def test_kl_loss_term():
    mask = torch.tensor([1.0, 0.0], dtype=D)
    # token-mean over the first token only: 0.5 * 0.5^2 = 0.125
    assert compute_kl_loss(LOGP, REF, mask, kind="mse").item() == pytest.approx(0.125)
    assert compute_kl_loss(LOGP.view(1, 2), REF.view(1, 2), torch.ones(1, 2), kind="abs",
                           loss_agg_mode="seq-mean-token-sum").item() == pytest.approx(1.5)


def test_fixed_controller():
    ctrl = FixedKLController(0.05)
    ctrl.update(current_kl=100.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_controller_updates_and_round_trips():
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctrl.update(current_kl=9.0, n_steps=256)  # error 0.5 clipped to 0.2: 0.2 * (1 + 0.2 * 256 / 10000)
    assert ctrl.value == pytest.approx(0.2 * 1.00512)
    ctrl.update(current_kl=5.4, n_steps=1000)  # error -0.1: * (1 - 0.1 * 0.1)
    assert ctrl.value == pytest.approx(0.2 * 1.00512 * 0.99)
    ctrl.update(current_kl=float("nan"), n_steps=1000)
    assert ctrl.value == pytest.approx(0.2 * 1.00512 * 0.99)
    state = ctrl.state_dict()
    restored = make_kl_controller("adaptive", kl_coef=1.0, target_kl=1.0, horizon=1)
    restored.load_state_dict(state)
    assert (restored.value, restored.target, restored.horizon) == (ctrl.value, 6.0, 10000)


def test_controller_validation():
    with pytest.raises(ValueError, match="kl_ctrl.type 'pid'"):
        make_kl_controller("pid")
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.0)
    assert isinstance(make_kl_controller("fixed", kl_coef=0.1), FixedKLController)
