"""Log-probabilities and entropy from vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for a slice [v0, v1) of the (padded) vocabulary. The log-softmax needs only two
scalars per token from the other ranks (the max and the sum of exponentials), so the communication is O(tokens),
not O(tokens · vocab). Vocabulary padding rows are masked out so probabilities match the HF / vLLM model exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int, tp_group, temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log p(target) and (optionally) entropy per token from logits [..., V/tp] sharded over ``tp_group``.

    Differentiable; the cross-rank sums use mcore's all-reduce whose backward is the identity, which is the
    exact gradient of a sum of per-rank terms.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    tp = dist.get_world_size(tp_group)
    v0 = dist.get_group_rank(tp_group, dist.get_rank()) * logits.size(-1) if tp > 1 else 0
    v1 = v0 + logits.size(-1)
    if v1 > vocab_size:  # mask Megatron's vocabulary padding
        pad = torch.arange(v0, v1, device=logits.device) >= vocab_size
        logits = logits.masked_fill(pad, float("-inf"))
    local_max = logits.detach().max(dim=-1).values
    if tp > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - local_max.unsqueeze(-1)
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1), tp_group)
    log_z = sum_exp.log()  # log-sum-exp minus the max
    in_range = (targets >= v0) & (targets < v1)
    local_idx = (targets - v0).clamp(0, logits.size(-1) - 1)
    picked = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tensor_model_parallel_region(torch.where(in_range, picked, torch.zeros_like(picked)),
                                                      tp_group)
    logprobs = picked - log_z
    entropy = None
    if with_entropy:
        probs = (shifted - log_z.unsqueeze(-1)).exp()
        finite = torch.where(torch.isfinite(shifted), shifted, torch.zeros_like(shifted))
        expected = reduce_from_tensor_model_parallel_region((probs * finite).sum(dim=-1), tp_group)
        entropy = log_z - expected
    return logprobs, entropy
