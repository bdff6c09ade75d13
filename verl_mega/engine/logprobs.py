"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary and without an fp32
copy of the logits.

Each TP rank holds logits for a slice [v0, v1) of the (padded) vocabulary. The log-softmax needs only a few scalars
per token from the other ranks (the max, the sum of exponentials, the target's logit, the probability-weighted logit
for the entropy), so the communication is O(tokens), not O(tokens · vocab). Vocabulary padding rows are masked out
so probabilities match the HF / vLLM model exactly.

The work runs over chunks of tokens: the forward keeps per token only the log-sum-exp and the entropy, and the
backward recomputes each chunk's softmax in fp32. Peak extra memory is one chunk of fp32 logits (about
``CHUNK_BYTES``), where upcasting the whole [tokens, V/tp] tensor took 4 bytes per logit, several times over.
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
    """fp32 logits of one chunk, divided by the temperature, Megatron's vocabulary padding at -inf."""
    z = chunk.float()
    if temperature != 1.0:
        z = z / temperature
    if pad is not None:
        z = z.masked_fill(pad, float("-inf"))
    return z


class _LogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, v0: int, vocab_size: int, group, temperature: float, with_entropy: bool):
        n, width = logits.shape
        v1 = v0 + width
        pad = torch.arange(v0, v1, device=logits.device) >= vocab_size if v1 > vocab_size else None
        in_range = (targets >= v0) & (targets < v1)
        local_idx = (targets - v0).clamp(0, width - 1)
        # per token: local max m, Σexp(z−m), Σexp(z−m)·z, and the target's logit (0 on the ranks without it)
        stats = torch.zeros(4, n, dtype=torch.float32, device=logits.device)
        step = _chunk_rows(width)
        for a in range(0, n, step):
            z = _scaled(logits[a:a + step], temperature, pad)
            m = z.max(dim=-1).values
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a slice of padding only has nothing to add
            e = (z - m[:, None]).exp()
            stats[0, a:a + step] = m
            stats[1, a:a + step] = e.sum(-1)
            if with_entropy:
                stats[2, a:a + step] = (e * torch.where(e > 0, z, torch.zeros_like(z))).sum(-1)
            picked = z.gather(-1, local_idx[a:a + step, None]).squeeze(-1)
            stats[3, a:a + step] = torch.where(in_range[a:a + step], picked, torch.zeros_like(picked))
        if group is not None:  # rescale every rank's sums to the global max, then sum them
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
        ctx.save_for_backward(logits, local_idx, in_range, lse, entropy)
        ctx.meta = (v0, vocab_size, temperature, step)
        ctx.with_entropy = with_entropy
        ctx.set_materialize_grads(False)  # an output the loss does not use (entropy) gets no backward work
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, local_idx, in_range, lse, entropy = ctx.saved_tensors
        v0, vocab_size, temperature, step = ctx.meta
        with_entropy = ctx.with_entropy
        n, width = logits.shape
        v1 = v0 + width
        pad = torch.arange(v0, v1, device=logits.device) >= vocab_size if v1 > vocab_size else None
        grad = torch.empty_like(logits)
        for a in range(0, n, step):
            z = _scaled(logits[a:a + step], temperature, pad)
            logp = z - lse[a:a + step, None]
            p = logp.exp()
            g = torch.zeros_like(z)
            if grad_logprobs is not None:  # d log p_t / dz_j = [j = t] − p_j
                g_lp = grad_logprobs[a:a + step].float()
                g -= p * g_lp[:, None]
                g.scatter_add_(-1, local_idx[a:a + step, None], (g_lp * in_range[a:a + step])[:, None])
            if grad_entropy is not None and with_entropy:  # dH/dz_j = −p_j (log p_j + H)
                term = torch.where(p > 0, p * (logp + entropy[a:a + step, None]), torch.zeros_like(p))
                g -= term * grad_entropy[a:a + step].float()[:, None]
            if temperature != 1.0:
                g = g / temperature
            grad[a:a + step] = g.to(grad.dtype)
        return grad, None, None, None, None, None, None
