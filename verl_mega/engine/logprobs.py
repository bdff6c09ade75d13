"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary and without an fp32
copy of the logits.

Each TP rank holds logits for a slice [v0, v1) of the (padded) vocabulary. The log-softmax needs only a few scalars
per token from the other ranks (the max, the sum of exponentials, the target's logit, the probability-weighted logit
for the entropy), so the communication is O(tokens), not O(tokens · vocab). Vocabulary padding rows are masked out
so probabilities match the HF / vLLM model exactly.

The work runs over chunks of tokens with PyTorch's fused softmax kernels, which read the logits in their own dtype
and write fp32: the forward keeps per token only the local and global log-sum-exp and the entropy, the backward
recomputes each chunk's softmax. Peak extra memory is one chunk of fp32 logits (about ``CHUNK_BYTES``), where
upcasting the whole [tokens, V/tp] tensor took 4 bytes per logit, several times over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CHUNK_BYTES = 1 << 28  # fp32 bytes of one chunk of logits: 256 MiB


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, tp_group, temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log p(target) and (optionally) entropy per token from logits [..., V/tp] sharded over ``tp_group``.

    Differentiable (in both outputs). As with Megatron's vocab-parallel cross-entropy, the gradient of each rank's
    logits is computed from the (TP-replicated) gradients of the outputs, with no communication in the backward.
    """
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    tp = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    v0 = dist.get_group_rank(tp_group, dist.get_rank()) * logits.shape[-1] if tp > 1 else 0
    logprobs, entropy = _LogProbEntropy.apply(flat, targets.reshape(-1), v0, vocab_size, tp_group if tp > 1 else None,
                                              float(temperature), with_entropy)
    return logprobs.view(lead), (entropy.view(lead) if with_entropy else None)


def _chunk_rows(vocab_local: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab_local))


def _scaled(chunk: torch.Tensor, temperature: float, pad: torch.Tensor | None) -> torch.Tensor:
    """One chunk of logits divided by the temperature (in fp32 then), Megatron's vocabulary padding at -inf."""
    z = chunk
    if temperature != 1.0:
        z = z.float() / temperature
    if pad is not None:
        z = z.masked_fill(pad, float("-inf"))
    return z


def _padding(v0: int, width: int, vocab_size: int, device) -> torch.Tensor | None:
    return torch.arange(v0, v0 + width, device=device) >= vocab_size if v0 + width > vocab_size else None


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, v0: int, vocab_size: int, group, temperature: float, with_entropy: bool):
        n, width = logits.shape
        pad = _padding(v0, width, vocab_size, logits.device)
        all_pad = v0 >= vocab_size  # a TP rank whose slice is padding only (tiny vocabularies): contributes nothing
        in_range = (targets >= v0) & (targets < v0 + width)
        local_idx = (targets - v0).clamp(0, width - 1)
        # per token, over this rank's slice: log-sum-exp L, Σexp(z−L) (1 here), Σ p·z (p normalised over the
        # slice), and the target's logit (0 on the ranks without it)
        stats = torch.zeros(4, n, dtype=torch.float32, device=logits.device)
        if all_pad:
            stats[0] = float("-inf")
        step = _chunk_rows(width)
        for a in range(0 if not all_pad else n, n, step):
            z = _scaled(logits[a:a + step], temperature, pad)
            top, arg = z.max(dim=-1)
            logp = torch.log_softmax(z, dim=-1, dtype=torch.float32)
            lse = top.float() - logp.gather(-1, arg[:, None]).squeeze(-1)  # exact: logp at the max is in [−log V, 0]
            stats[0, a:a + step] = lse
            stats[1, a:a + step] = 1.0
            if with_entropy:  # Σ p·z = Σ p·log p + L
                p = logp.exp()
                stats[2, a:a + step] = torch.special.xlogy(p, p).sum(-1) + lse
            picked = z.gather(-1, local_idx[a:a + step, None]).squeeze(-1).float()
            stats[3, a:a + step] = torch.where(in_range[a:a + step], picked, torch.zeros_like(picked))
        local_lse = stats[0].clone()
        if group is not None:  # rescale every rank's sums to the largest log-sum-exp, then sum them
            m_global = stats[0].clone()
            dist.all_reduce(m_global, op=dist.ReduceOp.MAX, group=group)
            factor = (stats[0] - m_global).exp()
            stats[1] *= factor
            stats[2] *= factor
            stats[0] = m_global
            dist.all_reduce(stats[1:], group=group)
        lse = stats[0] + stats[1].log()
        logprobs = stats[3] - lse
        entropy = lse - stats[2] / stats[1] if with_entropy else torch.zeros_like(lse)
        ctx.save_for_backward(logits, local_idx, in_range, lse, local_lse, entropy)
        ctx.meta = (v0, vocab_size, temperature, step, all_pad)
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)  # an output the loss does not use (entropy) gets no backward work
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_idx, in_range, lse, local_lse, entropy = ctx.saved_tensors
        v0, vocab_size, temperature, step, all_pad = ctx.meta
        if all_pad:
            return torch.zeros_like(logits), None, None, None, None, None, None
        n, width = logits.shape
        pad = _padding(v0, width, vocab_size, logits.device)
        with_entropy = ctx.with_entropy and grad_entropy is not None
        grad = torch.empty_like(logits)
        for a in range(0, n, step):
            rows = slice(a, a + step)
            # p over the whole vocabulary = this slice's softmax · exp(L_local − L)
            p = torch.softmax(_scaled(logits[rows], temperature, pad), dim=-1, dtype=torch.float32)
            p.mul_((local_lse[rows] - lse[rows]).exp()[:, None])
            g_lp = grad_logprobs[rows].float() if grad_logprobs is not None else torch.zeros_like(lse[rows])
            if with_entropy:  # dH/dz_j = −p_j (log p_j + H);  d log p_t / dz_j = [j = t] − p_j
                g_h = grad_entropy[rows].float()
                g = torch.special.xlogy(p, p).mul_(-g_h[:, None])
                g.sub_(p * (g_lp + g_h * entropy[rows])[:, None])
            else:
                g = p.mul_(-g_lp[:, None])
            g.scatter_add_(-1, local_idx[rows, None], (g_lp * in_range[rows])[:, None])
            if temperature != 1.0:
                g.div_(temperature)
            grad[rows] = g
        return grad, None, None, None, None, None, None
