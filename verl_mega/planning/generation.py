"""What generation holds and moves per GPU: vLLM's KV cache per token, and the bytes the worst GPU receives at the
train → generate switch (the 3D-HybridEngine's resharding)."""

from __future__ import annotations

import math

from verl_mega.models.hf_config import ModelArch
from verl_mega.parallel.placement import Pool


def kv_cache_bytes_per_token(arch: ModelArch, gen_tp: int) -> float:
    """vLLM's KV cache per token on one GPU, bf16: K and V of the rank's key/value heads, 2·L·(k/tg)·d·2; MLA caches
    the latent and the rotary key instead, whole on every TP rank: L·(kv_lora_rank + rope)·2."""
    if arch.is_mla:
        return arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * 2
    return 2 * arch.num_layers * (arch.num_kv_heads // gen_tp) * arch.head_dim * 2


def reshard_bytes(arch: ModelArch, layout: Pool, element_size: int = 2) -> float:
    """Bytes the worst GPU receives at the train → generate switch. Dense: HybridFlow Table 2 on the whole model
    (the paper's formula; it counts the few replicated norms as sharded). MoE and MLA: the exact per-rank arithmetic
    of :meth:`ModelArch.hybrid_sync_bytes`, maximised over the ranks whose (tp, etp, ep, generation) coordinates
    differ — the first lcm(tp·D, etp·ep) ranks of the first and last pipeline stages (D = gen_ep/gen_tp)."""
    if not arch.is_moe and not arch.is_mla:
        return layout.sync_bytes_per_rank(element_size * arch.num_parameters())
    gen = layout.tp * layout.gen_dp
    period = math.lcm(gen, layout.etp * layout.ep)
    stage_size = layout.size // layout.pp
    ranks = [layout.ranks[i] for i in range(min(period, stage_size))]
    ranks += [layout.ranks[(layout.pp - 1) * stage_size + i] for i in range(min(period, stage_size))]
    return max(arch.hybrid_sync_bytes(layout, r, element_size) for r in ranks)
