"""Tiny random HF models and a character-level tokenizer, built locally (nothing is downloaded).

Used by the CPU quickstart (``model.path: tiny``) and by tests. Sizes respect vLLM's constraints (head_dim ≥ 32).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

# Characters of the built-in arithmetic task plus a few letters so prompts/answers can be templated.
_CHARS = list("0123456789+-*=?# ") + list("abcdefghijklmnopqrstuvwxyz") + list(".,:()ABQ")
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def build_char_tokenizer(out_dir: str | Path, *, fill_to: int | None = None) -> Path:
    """A character-level `tokenizers` tokenizer saved as an HF fast tokenizer (tokenizer.json + config). ``fill_to``
    pads the vocabulary with reserved tokens (never produced from text) up to that size, for a random model of a
    real vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out_dir = Path(out_dir)
    tokens = SPECIAL_TOKENS + _CHARS
    tokens += [f"<|reserved_{i}|>" for i in range(max(0, (fill_to or 0) - len(tokens)))]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(str(out_dir))
    return out_dir


def tokenizer_vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(_CHARS)


def make_tiny_hf_model(
    out_dir: str | Path,
    *,
    model_type: str = "qwen2",
    vocab_size: int | None = None,
    hidden_size: int = 128,
    intermediate_size: int = 256,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    seed: int = 0,
    init_std: float = 0.02,
    with_tokenizer: bool = True,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Create a random HF causal LM of `model_type` and save it (safetensors + config [+ tokenizer]) to `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = vocab_size or tokenizer_vocab_size()
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    if model_type in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = hidden_size // num_heads
    kwargs.update(extra or {})
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random (non-unit) norm weights and biases so the parity tests exercise every tensor; DeepSeek's routing
    # correction bias (a buffer) too, large enough to change which experts win
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if with_tokenizer:
        build_char_tokenizer(out_dir)
    gen = out_dir / "generation_config.json"
    if gen.exists():
        cfg = json.loads(gen.read_text())
        cfg.pop("transformers_version", None)
        gen.write_text(json.dumps(cfg, indent=2))
    return out_dir


def make_tiny_reward_model(out_dir: str | Path, *, seed: int = 0, score_std: float = 0.5, **model: Any) -> Path:
    """A random HF reward model: :func:`make_tiny_hf_model`'s causal LM (``model``: its arguments) as HF's
    one-label sequence classifier, whose ``score`` head (drawn with ``score_std``) rates the last token."""
    from transformers import AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    body = make_tiny_hf_model(out_dir / "causal_lm", seed=seed, **model)
    torch.manual_seed(seed)
    classifier = AutoModelForSequenceClassification.from_pretrained(body, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        classifier.score.weight.normal_(0.0, score_std)
    classifier.save_pretrained(str(out_dir), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (body / name).exists():
            (out_dir / name).write_bytes((body / name).read_bytes())
    shutil.rmtree(body)
    return out_dir


def moe_fields(model_type: str, *, num_experts: int = 8, topk: int = 2, expert_width: int = 64,
               shared_width: int = 0) -> dict[str, Any]:
    """config.json fields of a tiny MoE of ``model_type`` (qwen3_moe, mixtral, qwen2_moe, deepseek_v3), for ``extra``
    of :func:`make_tiny_hf_model` (for Mixtral they set ``intermediate_size``, its experts' width). vLLM-CPU's
    fused-MoE kernel wants widths that are multiples of 32."""
    if model_type == "deepseek_v3":
        return deepseek_fields(num_experts=num_experts, expert_width=expert_width)
    if model_type == "mixtral":
        return dict(num_local_experts=num_experts, num_experts_per_tok=topk, intermediate_size=expert_width)
    fields: dict[str, Any] = dict(num_experts=num_experts, num_experts_per_tok=topk,
                                  moe_intermediate_size=expert_width, norm_topk_prob=model_type == "qwen3_moe")
    if model_type == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = shared_width or 2 * expert_width
    return fields


def deepseek_fields(*, num_experts: int = 8, topk: int = 4, expert_width: int = 64, q_lora_rank: int | None = 64,
                    first_k_dense: int = 1, num_groups: int = 4, group_topk: int = 2) -> dict[str, Any]:
    """config.json fields of a tiny DeepSeek-V3 (MLA + sigmoid group-limited routing with its correction bias, one
    shared expert, ``first_k_dense`` dense layers first, YaRN rope), for ``extra`` of :func:`make_tiny_hf_model`
    with ``num_kv_heads`` = ``num_heads``. vLLM-CPU runs MLA only at kv_lora_rank 512 and a rope dim of 64 (and in
    bf16), so those are fixed; the query and value head dims are 32 + 64 and 32."""
    return dict(kv_lora_rank=512, q_lora_rank=q_lora_rank, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                n_routed_experts=num_experts, num_experts_per_tok=topk, n_group=num_groups, topk_group=group_topk,
                moe_intermediate_size=expert_width, n_shared_experts=1, first_k_dense_replace=first_k_dense,
                routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc", scoring_func="sigmoid",
                num_nextn_predict_layers=0,
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8,
                                 "rope_theta": 10000.0})
