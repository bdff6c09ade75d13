"""Build Megatron-Core GPT models (policy with LM head, or value-head variant) for this rank's pipeline stage(s)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from verl_mega.models.hf_config import ModelArch, llama3_scaled_inv_freq
from verl_mega.models.spec import SDPAttention, layer_spec, rms_norm_spec
from verl_mega.parallel.state import RankGroups


class ValueHead(torch.nn.Module):
    """H → 1 projection replacing the LM head for critics and reward models.

    Replicated on every TP rank. With sequence parallelism each TP rank sees a slice of the sequence, so the
    weight is tagged ``sequence_parallel`` (mcore then sums its grad over TP) and outputs are gathered.
    """

    def __init__(self, config, hidden_size: int, tp_group=None) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.tp_group = tp_group
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size, dtype=config.params_dtype))
        torch.nn.init.normal_(self.weight, mean=0.0, std=config.init_method_std)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=True, group=self.tp_group
            )
        return torch.nn.functional.linear(hidden_states, self.weight), None


@dataclass(frozen=True)
class StageLayout:
    """Which global layers a model chunk holds and whether it has the embedding / head."""

    layer_offset: int
    num_layers: int
    pre_process: bool
    post_process: bool


def build_model_chunks(
    arch: ModelArch,
    config,
    groups: RankGroups,
    *,
    value_head: bool = False,
    make_vocab_size_divisible_by: int = 128,
    use_te: str = "auto",
    lora=None,
) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage of this rank (a single one without VPP), on the groups of its pool.
    ``lora`` (a :class:`~verl_mega.models.lora.LoRASpec`): the linears carry adapters, initialised, and every other
    parameter is frozen."""
    vpp, pp_rank = groups.pool.vpp, groups.pp_rank
    # mcore's fused SwiGLU (``bias_activation_fusion``) and our compiled norms go together: one switch
    fused = config.bias_activation_fusion
    spec_of = _layer_specs(arch, use_te, fused, lora)
    spec = spec_of(arch.moe_layers[0] if arch.is_moe else 0)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = groups.first_stage and vp_stage == 0
        post = groups.last_stage and vp_stage == (vpp or 1) - 1
        block_spec = spec
        if spec.submodules.self_attention.submodules.core_attention is SDPAttention:
            # Our spec: the final norm must be our SP-capable RMSNorm too (mcore would pick torch's RMSNorm); a
            # layer's own spec where dense and MoE layers mix (DeepSeek's first_k_dense_replace / moe_layer_freq)
            offset = get_transformer_layer_offset(config, vp_stage=stage, pp_rank=pp_rank)
            layers = get_num_layers_to_build(config, vp_stage=stage, pp_rank=pp_rank)
            block_spec = TransformerBlockSubmodules(layer_specs=[spec_of(offset + i) for i in range(layers)],
                                                    layer_norm=rms_norm_spec(fused))
        model = GPTModel(
            config=config,
            transformer_layer_spec=block_spec,
            vocab_size=arch.padded_vocab_size(groups.pool.tp, make_vocab_size_divisible_by),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            vp_stage=stage,
            pg_collection=groups.pg_collection,
        )
        if arch.rope_scaling is not None and not arch.is_mla:  # MLA: YaRN inside each attention layer (mcore's)
            rope = model.rotary_pos_emb
            rope.inv_freq = llama3_scaled_inv_freq(rope.inv_freq.double(), arch.rope_scaling).to(rope.inv_freq.dtype)
        if block_spec is not spec and not arch.is_mla:
            enable_packed_positions(model.rotary_pos_emb)
        if value_head and post:
            model.output_layer = ValueHead(config, arch.hidden_size, groups["tp"])
        model.stage_layout = StageLayout(  # type: ignore[attr-defined]
            layer_offset=get_transformer_layer_offset(config, vp_stage=stage, pp_rank=pp_rank),
            num_layers=len(model.decoder.layers),
            pre_process=pre,
            post_process=post,
        )
        chunks.append(model)
    if lora is not None:
        from verl_mega.models.lora import freeze_base, init_adapters

        init_adapters(chunks, lora)
        freeze_base(chunks)
    return chunks


def _layer_specs(arch: ModelArch, use_te: str, fused: bool, lora=None):
    """Global layer index → its layer spec (MoE or dense MLP; MLA or grouped-query attention)."""
    specs = {moe: layer_spec(qk_layernorm=arch.qk_norm or arch.is_mla, use_te=use_te,
                             num_experts=arch.num_experts if moe else None, fused_norm=fused,
                             multi_latent_attention=arch.is_mla, lora=lora)
             for moe in {arch.is_moe_layer(i) for i in range(arch.num_layers)}}
    return lambda layer: specs[arch.is_moe_layer(layer)]


def enable_packed_positions(rope: torch.nn.Module) -> None:
    """Let packed micro-batches take their rotary embedding per token: with ``rope.packed_positions`` set (the
    position of every token of the pack, restarting with each sequence) the module returns the embedding at those
    positions, which Megatron then applies as for an unpacked sequence. Megatron's own THD path applies it sequence
    by sequence, reading ``cu_seqlens`` on the host in every layer (a device synchronisation each time)."""
    plain = rope.forward

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if rope.packed_positions is None:
            return plain(max_seq_len, offset, packed_seq, cp_group)
        # every position of the longest sequence (no context-parallel slicing: the positions are this rank's own)
        return plain(max_seq_len, offset, True, cp_group)[rope.packed_positions]

    rope.packed_positions = None
    rope.forward = forward


def forward_packed(model, ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, *,
                   rope_owner: torch.nn.Module | None = None, cp_layout: tuple | None = None) -> torch.Tensor:
    """One packed micro-batch (``ids``/``positions`` [1, T], sequences back to back, ``cu_seqlens`` on the device)
    through ``model`` (``rope_owner``: the unwrapped GPTModel when ``model`` is a DDP wrapper). With our spec's
    per-token rotary embedding (:func:`enable_packed_positions`) the layers see an ordinary [T, 1] sequence and
    only the core attention reads ``cu_seqlens``; otherwise (TE spec) Megatron's THD path. ``cp_layout``: with
    context parallelism, this rank's pack positions and the gathered keys' order (our attention spec only)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    rope = getattr(rope_owner or model, "rotary_pos_emb", None)
    per_token = rope is not None and hasattr(rope, "packed_positions")
    if cp_layout is not None and not per_token:
        raise ValueError("engine: packed sequences with context parallelism need our attention spec; "
                         "set model.use_te=false, model.use_remove_padding=false or parallel.cp=1")
    packed = PackedSeqParams(qkv_format="sbhd" if per_token else "thd", cu_seqlens_q=cu_seqlens,
                             cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    if cp_layout is not None:
        packed.cp_layout = cp_layout
    if not per_token:
        return model(ids, positions, None, packed_seq_params=packed)
    rope.packed_positions = positions[0]
    try:
        return model(ids, positions, None, packed_seq_params=packed)
    finally:
        rope.packed_positions = None


def count_parameters(arch: ModelArch, groups: RankGroups, *, value_head: bool = False) -> int:
    """Parameter count of the mcore model for `arch` at tp=pp=1 (``groups`` of a world of one) without vocab
    padding, built on the meta device.

    Used to check our mapping covers the HF model exactly (same count, no extra or missing tensors).
    """
    from verl_mega.models.hf_config import transformer_config

    cfg = transformer_config(arch, use_cpu_initialization=True, perform_initialization=False)
    spec_of = _layer_specs(arch, "false", False)
    with torch.device("meta"):
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=TransformerBlockSubmodules(
                layer_specs=[spec_of(i) for i in range(arch.num_layers)], layer_norm=rms_norm_spec(False)),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            share_embeddings_and_output_weights=arch.tie_word_embeddings and not value_head,
            position_embedding_type="rope",
            rotary_base=int(arch.rope_theta),
            pg_collection=groups.pg_collection,
        )
    if value_head:
        model.output_layer = ValueHead(cfg, arch.hidden_size)
    return sum(p.numel() for p in model.parameters())
