"""The chunked log-prob / entropy kernel against float64 log-softmax (values and gradients), with Megatron's
vocabulary padding, a temperature and chunks smaller than the batch."""

from __future__ import annotations

import pytest
import torch

from verl_mega.engine import logprobs as lp_mod


def _reference(logits: torch.Tensor, targets: torch.Tensor, vocab: int, temperature: float):
    z = logits.double()[..., :vocab] / temperature
    lsm = torch.log_softmax(z, -1)
    return lsm.gather(-1, targets[..., None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_float64_log_softmax(monkeypatch, dtype, temperature):
    monkeypatch.setattr(lp_mod, "CHUNK_BYTES", 4 * 48 * 5)  # 5 tokens per chunk: 7 chunks for 33 tokens
    g = torch.Generator().manual_seed(0)
    vocab, padded = 41, 48
    logits = (torch.randn(3, 11, padded, generator=g) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, (3, 11), generator=g)
    w_lp, w_ent = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)

    lp, ent = lp_mod.vocab_parallel_logprobs_entropy(logits, targets, vocab_size=vocab, tp_group=None,
                                                     temperature=temperature, with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()

    ref_in = logits.detach().double().requires_grad_()
    ref_lp, ref_ent = _reference(ref_in, targets, vocab, temperature)
    ((ref_lp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()

    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the gradient is rounded to bf16 on the way out
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert (lp.double() - ref_lp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5
    assert (logits.grad.double() - ref_in.grad).abs().max() < tol
    assert logits.grad[..., vocab:].abs().max() == 0  # padding logits get no gradient


def test_logprob_gradient_alone_and_without_entropy():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 16, generator=g, dtype=torch.float64).float().requires_grad_()
    targets = torch.randint(0, 16, (2, 5), generator=g)
    lp, ent = lp_mod.vocab_parallel_logprobs_entropy(logits, targets, vocab_size=16, tp_group=None)
    assert ent is None
    lp.sum().backward()
    ref = torch.nn.functional.one_hot(targets, 16).double() - torch.softmax(logits.detach().double(), -1)
    assert (logits.grad.double() - ref).abs().max() < 1e-6
