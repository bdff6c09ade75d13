"""DeepSeek-V3 (multi-head latent attention, sigmoid group-limited routing with its correction bias, shared experts,
dense first layers) in one process (world of one, CPU), against HF transformers' DeepseekV3ForCausalLM."""

import json
from pathlib import Path

import pytest
import torch

from verl_mega.models.hf_config import ModelConfigError, arch_from_hf, load_hf_config, transformer_config
from verl_mega.models.hf_io import HFCheckpointReader
from verl_mega.models.tiny import deepseek_fields, make_tiny_hf_model

FIXTURES = Path(__file__).parent.parent / "fixtures" / "hf_configs"


@pytest.fixture(scope="module")
def world():
    from verl_mega.parallel.state import init_distributed

    return init_distributed(tp=1, pp=1)


def _tiny(path, **fields):
    return make_tiny_hf_model(path, model_type="deepseek_v3", init_std=0.1, num_kv_heads=4, num_layers=3,
                              extra=deepseek_fields(**fields))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("ds") / "deepseek_v3")


def test_deepseek_v3_parameter_count_equals_hf():
    """The published DeepSeek-V3 config: our count equals HF's own model (built on the meta device), total and
    active (DeepSeek: "671B total, 37B activated")."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = json.loads((FIXTURES / "deepseek-v3.json").read_text())
    arch = arch_from_hf(hf_cfg)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg))
    total = sum(p.numel() for p in hf_model.parameters())
    experts = [m for n, m in hf_model.named_modules() if n.endswith(".experts")]
    per_expert = sum(p[0].numel() for p in experts[0].parameters())
    active = total - len(experts) * (arch.num_experts - arch.moe_topk) * per_expert
    assert (arch.num_parameters(), arch.num_active_parameters()) == (total, active) == (671_026_404_352,
                                                                                        37_552_282_624)
    assert (arch.first_k_dense, len(arch.moe_layers), arch.num_mtp_layers, arch.head_dim) == (3, 58, 1, 192)


@pytest.mark.parametrize("q_lora", [64, None], ids=["q_lora", "no_q_lora"])
def test_tiny_parameter_count_equals_hf_and_mcore(world, tmp_path, q_lora):
    from transformers import AutoModelForCausalLM

    from verl_mega.models.build import count_parameters

    path = _tiny(tmp_path / "m", q_lora_rank=q_lora)
    arch = arch_from_hf(load_hf_config(path))
    hf = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters())
    assert arch.num_parameters() == count_parameters(arch, world) == hf


def test_config_maps_onto_megatrons_mla_and_router():
    arch = arch_from_hf(json.loads((FIXTURES / "deepseek-v3.json").read_text()))
    cfg = transformer_config(arch, tp=8, ep=64, etp=1, sequence_parallel=True, use_cpu_initialization=True,
                             perform_initialization=False)
    assert type(cfg).__name__ == "MLATransformerConfig"
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim) == \
        (1536, 512, 128, 64, 128)
    assert (cfg.rope_type, cfg.rotary_scaling_factor, cfg.mscale, cfg.mscale_all_dim,
            cfg.original_max_position_embeddings) == ("yarn", 40.0, 1.0, 1.0, 4096)
    assert (cfg.moe_router_score_function, cfg.moe_router_num_groups, cfg.moe_router_group_topk,
            cfg.moe_router_topk_scaling_factor, cfg.moe_router_enable_expert_bias,
            cfg.moe_shared_expert_intermediate_size, cfg.moe_shared_expert_gate) == \
        ("sigmoid", 8, 4, 2.5, True, 2048, False)
    assert cfg.moe_layer_freq == [0, 0, 0] + [1] * 58 and cfg.moe_router_load_balancing_type == "seq_aux_loss"


BAD = [({"norm_topk_prob": False}, "needs norm_topk_prob=true"),
       ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
       ({"topk_method": "greedy"}, "topk_method='greedy' is not supported"),
       ({"topk_group": 2}, "num_experts_per_tok / topk_group = 8/2 must be 2"),
       ({"n_group": 3}, "do not form a router"),
       ({"attention_bias": True}, "attention_bias=true is not supported"),
       ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_scaling type 'llama3' is not supported"),
       ({"first_k_dense_replace": 61}, "leaves no MoE layer")]


@pytest.mark.parametrize("patch,message", BAD, ids=[next(iter(p)) for p, _ in BAD])
def test_unsupported_configs_are_one_line_errors(patch, message):
    base = json.loads((FIXTURES / "deepseek-v3.json").read_text())
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        arch_from_hf({**base, **patch})
    assert "\n" not in str(err.value)


def test_layout_checks_mla_and_dense_widths():
    from verl_mega.models.hf_config import check_arch_layout
    from verl_mega.parallel.placement import Pool

    arch = arch_from_hf({**json.loads((FIXTURES / "deepseek-v3.json").read_text()), "intermediate_size": 18436})
    with pytest.raises(ModelConfigError, match="parallel.tp=8 does not divide the model's dense FFN width 18436"):
        check_arch_layout(Pool(name="main", ranks=tuple(range(8)), tp=8, sequence_parallel=True), arch)


def _hf_routing(path, ids) -> dict:
    """HF's chosen experts per MoE layer on ``ids``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen = {}
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[2]))
    with torch.no_grad():
        logits = hf(ids).logits
    return logits, seen


def test_logits_gradients_and_export_match_hf(world, tiny):
    """Logits equal HF's (fp32, a dense first layer and two MoE layers) and the exported HF tensors are the
    checkpoint's bit for bit, the correction bias included (gradients: tests/distributed/test_model_parity.py)."""
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.loader import iter_hf_tensors, load_hf_weights

    arch = arch_from_hf(load_hf_config(tiny))
    assert arch.moe_layers == (1, 2)
    model = build_model_chunks(arch, transformer_config(arch, use_cpu_initialization=True, moe_aux_loss_coeff=0.0),
                               world, use_te="false")[0]
    reader = HFCheckpointReader(tiny)
    load_hf_weights([model], reader, arch, world)
    ids = torch.randint(1, arch.vocab_size, (2, 20), generator=torch.Generator().manual_seed(3))
    ref, _ = _hf_routing(tiny, ids)
    out = model(ids, torch.arange(20).expand(2, 20), None)[..., :arch.vocab_size]
    assert (out - ref).abs().max().item() < 1e-5
    exported = dict(iter_hf_tensors([model], arch, world))
    assert set(exported) == set(reader.keys()) and "model.layers.1.mlp.gate.e_score_correction_bias" in exported
    for name, tensor in exported.items():
        assert torch.equal(tensor, reader.get(name)), name
    assert not torch.equal(reader.get("model.layers.2.mlp.gate.e_score_correction_bias"), torch.zeros(8))


def test_correction_bias_moves_against_the_token_counts(world, tiny):
    """DeepSeek's aux-loss-free balancing, as Megatron updates it after every optimizer step: each router's bias moves
    by the update rate towards the experts that got fewer than the mean number of tokens (counts from HF's own
    routing of the same tokens); the exported checkpoint carries the new bias exactly."""
    from megatron.core.optimizer import OptimizerConfig

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.loader import iter_hf_tensors, load_hf_weights

    arch = arch_from_hf(load_hf_config(tiny))
    rate = 0.01
    cfg = transformer_config(arch, use_cpu_initialization=True, moe_aux_loss_coeff=0.0,
                             moe_router_bias_update_rate=rate)
    chunks = build_model_chunks(arch, cfg, world, use_te="false")
    load_hf_weights(chunks, HFCheckpointReader(tiny), arch, world)
    optim = OptimizerConfig(optimizer="adam", lr=0.0, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False,
                            params_dtype=torch.float32)
    engine = MegatronEngine(chunks, cfg, world, optimizer_config=optim)
    ids = torch.randint(1, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    _, routing = _hf_routing(tiny, ids)
    reader = HFCheckpointReader(tiny)
    engine.train_step([{"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16)}],
                      lambda out, mb: (out.float().mean() * 0.0, {}))
    exported = dict(iter_hf_tensors(engine.modules, arch, world))
    for layer in arch.moe_layers:
        counts = torch.bincount(routing[layer].reshape(-1), minlength=arch.num_experts).double()
        before = reader.get(f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
        want = before + rate * torch.sign(counts.mean() - counts).float()
        got = exported[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert got.dtype == torch.float32 and torch.equal(got, want), layer



def test_packed_sequences_equal_one_at_a_time(world, tiny):
    """model.use_remove_padding with MLA: sequences packed back to back (Megatron's THD path applies each
    sequence's own rotary positions inside MLA) give each sequence's logits as computed on its own."""
    from verl_mega.models.build import build_model_chunks, forward_packed
    from verl_mega.models.loader import load_hf_weights

    arch = arch_from_hf(load_hf_config(tiny))
    model = build_model_chunks(arch, transformer_config(arch, use_cpu_initialization=True, moe_aux_loss_coeff=0.0),
                               world, use_te="false")[0].eval()
    load_hf_weights([model], HFCheckpointReader(tiny), arch, world)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, arch.vocab_size, (n,), generator=g) for n in (7, 12, 5)]
    cu = torch.tensor([0, 7, 19, 24], dtype=torch.int32)
    with torch.no_grad():
        alone = [model(s[None], torch.arange(len(s))[None], None)[0] for s in seqs]
        packed = forward_packed(model, torch.cat(seqs)[None], torch.cat([torch.arange(len(s)) for s in seqs])[None],
                                cu, 12, rope_owner=model).reshape(24, -1)
    for (a, b), ref in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), alone):
        assert (packed[a:b] - ref).abs().max().item() < 1e-5


def test_bias_update_rate_key_reaches_megatron():
    """model.moe_router_bias_update_rate: DeepSeek's 0.001 by default, the key's value (0 freezes the bias) when
    set; models without the bias ignore it."""
    from verl_mega.config import load_config
    from verl_mega.trainer.setup import moe_options

    recipe = Path(__file__).parents[2] / "configs" / "quickstart_moe_cpu.yaml"
    deepseek = arch_from_hf(json.loads((FIXTURES / "deepseek-v3.json").read_text()))
    qwen = arch_from_hf(json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text()))
    frozen = load_config(recipe, ["model.moe_router_bias_update_rate=0"], check_paths=False)
    default = load_config(recipe, [], check_paths=False)
    assert transformer_config(deepseek, **moe_options(frozen, deepseek)).moe_router_bias_update_rate == 0.0
    assert transformer_config(deepseek, **moe_options(default, deepseek)).moe_router_bias_update_rate == 1e-3
    assert "moe_router_bias_update_rate" not in moe_options(frozen, qwen)
