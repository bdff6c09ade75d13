"""Model building and HF⇄mcore mapping in one process (world of one, CPU)."""

import json
from pathlib import Path

import pytest
import torch

from verl_mega.models.hf_config import ModelConfigError, arch_from_hf, load_hf_config, transformer_config
from verl_mega.models.hf_io import CheckpointError, HFCheckpointReader
from verl_mega.models.tiny import make_tiny_hf_model

FIXTURES = Path(__file__).parent.parent / "fixtures" / "hf_configs"


@pytest.fixture(scope="module")
def world():
    from verl_mega.parallel.state import init_distributed

    return init_distributed(tp=1, pp=1)


@pytest.mark.parametrize("name", ["llama-2-7b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "llama-3.1-8b"])
def test_param_count_matches_hf_on_meta(world, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_mega.models.build import count_parameters

    hf_cfg = json.loads((FIXTURES / f"{name}.json").read_text())
    arch = arch_from_hf(hf_cfg)
    cfg = AutoConfig.for_model(**hf_cfg)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(cfg)
    hf_count = sum(p.numel() for p in hf_model.parameters())
    assert count_parameters(arch, world) == hf_count
    assert arch.num_parameters() == hf_count


# Published totals: Qwen3-30B-A3B "30.5B total, 3.3B activated"; Mixtral-8x7B "46.7B total, 12.9B active".
MOE_COUNTS = {"qwen3-30b-a3b": (30_532_122_624, 3_353_032_704), "mixtral-8x7b": (46_702_792_704, 12_879_925_248),
              "qwen1.5-moe-a2.7b": (14_315_784_192, 2_689_173_504), "qwen3-235b-a22b": (235_093_634_560,
                                                                                      22_190_763_520)}


@pytest.mark.parametrize("name", sorted(MOE_COUNTS))
def test_moe_param_counts_exact(world, name):
    """Total and active parameters of real MoE configs: the exact totals of HF's own model (built on the meta
    device) and of our mcore model; active = total less the experts a token does not visit, per HF's modules."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_mega.models.build import count_parameters

    hf_cfg = json.loads((FIXTURES / f"{name}.json").read_text())
    arch = arch_from_hf(hf_cfg)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_cfg))
    hf_total = sum(p.numel() for p in hf_model.parameters())
    experts = [m for n, m in hf_model.named_modules() if n.endswith(".experts")]
    per_expert = sum(p[0].numel() for p in experts[0].parameters())  # fused [E, …] tensors: one expert's slice
    hf_active = hf_total - len(experts) * (arch.num_experts - arch.moe_topk) * per_expert
    total, active = MOE_COUNTS[name]
    assert (arch.num_parameters(), arch.num_active_parameters()) == (hf_total, hf_active) == (total, active)
    if name != "qwen3-235b-a22b":  # the largest takes long to lay out even on the meta device
        assert count_parameters(arch, world) == total


def test_moe_config_fields():
    qwen = arch_from_hf(json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text()))
    assert (qwen.num_experts, qwen.moe_topk, qwen.moe_ffn_hidden_size, qwen.moe_renormalize, qwen.qk_norm) == \
        (128, 8, 768, True, True)
    mixtral = arch_from_hf(json.loads((FIXTURES / "mixtral-8x7b.json").read_text()))
    assert (mixtral.num_experts, mixtral.moe_topk, mixtral.moe_ffn_hidden_size, mixtral.moe_renormalize) == \
        (8, 2, 14336, True)
    qwen2 = arch_from_hf(json.loads((FIXTURES / "qwen1.5-moe-a2.7b.json").read_text()))
    assert (qwen2.moe_renormalize, qwen2.shared_expert_ffn_hidden_size, qwen2.qkv_bias) == (False, 5632, True)
    cfg = transformer_config(qwen, ep=8, etp=1, tp=4, use_cpu_initialization=True, perform_initialization=False)
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_router_pre_softmax, cfg.expert_model_parallel_size,
            cfg.expert_tensor_parallel_size, cfg.moe_aux_loss_coeff) == (128, 8, False, 8, 1, 0.001)
    assert transformer_config(qwen2).moe_router_pre_softmax  # no renormalisation: softmax over all experts first
    for bad, message in ((dict(ep=3), "parallel.ep=3 does not divide the model's 128 experts"),
                         (dict(etp=5), "parallel.etp=5 does not divide the experts' FFN width 768")):
        with pytest.raises(ModelConfigError, match=message):
            transformer_config(qwen, **bad)
    with pytest.raises(ModelConfigError, match="every layer must be MoE"):
        arch_from_hf({**json.loads((FIXTURES / "qwen3-30b-a3b.json").read_text()), "mlp_only_layers": [3]})
    with pytest.raises(ModelConfigError, match="needs a Mixture-of-Experts model"):
        transformer_config(arch_from_hf(json.loads((FIXTURES / "qwen3-8b.json").read_text())), ep=2)


@pytest.mark.parametrize("model_type,tied", [("qwen2", False), ("llama", True), ("qwen3", False), ("mistral", False)])
def test_logits_match_hf_tp1(world, tmp_path, model_type, tied):
    from transformers import AutoModelForCausalLM

    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.loader import iter_hf_tensors, load_hf_weights

    path = make_tiny_hf_model(tmp_path / model_type, model_type=model_type, tie_word_embeddings=tied)
    arch = arch_from_hf(load_hf_config(path))
    chunks = build_model_chunks(arch, transformer_config(arch, use_cpu_initialization=True), world, use_te="false")
    reader = HFCheckpointReader(path)
    load_hf_weights(chunks, reader, arch, world)
    ids = torch.randint(0, arch.vocab_size, (2, 20))
    with torch.no_grad():
        out = chunks[0].eval()(ids, torch.arange(20).expand(2, 20), None)[..., : arch.vocab_size]
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
    assert (out - ref).abs().max().item() < 1e-5
    exported = dict(iter_hf_tensors(chunks, arch, world))
    assert set(exported) == set(reader.keys())
    for name, tensor in exported.items():
        assert torch.equal(tensor, reader.get(name)), name


def test_fused_kernels_match_hf_logits_and_grads(world, tmp_path):
    """model.fused_kernels: Megatron's compiled SwiGLU and our compiled RMSNorm (q/k norms too, on Qwen3) give HF's
    logits and HF's weight gradients (fp32, CPU inductor)."""
    from transformers import AutoModelForCausalLM

    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.loader import load_hf_weights

    path = make_tiny_hf_model(tmp_path / "q3", model_type="qwen3")
    arch = arch_from_hf(load_hf_config(path))
    cfg = transformer_config(arch, use_cpu_initialization=True, fused_kernels=True)
    assert cfg.bias_activation_fusion
    model = build_model_chunks(arch, cfg, world, use_te="false")[0]
    assert model.decoder.layers[0].input_layernorm.fused and model.decoder.final_layernorm.fused
    load_hf_weights([model], HFCheckpointReader(path), arch, world)
    ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, arch.vocab_size, (2, 24))
    out = model(ids, torch.arange(24).expand(2, 24), None)[..., : arch.vocab_size]
    ref = ref_model(ids).logits
    assert (out - ref).abs().max().item() < 1e-5
    weights = torch.randn_like(ref)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    pairs = {"decoder.final_layernorm.weight": "model.norm.weight",
             "decoder.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
             "decoder.layers.1.self_attention.q_layernorm.weight": "model.layers.1.self_attn.q_norm.weight",
             "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight"}
    ours, theirs = dict(model.named_parameters()), dict(ref_model.named_parameters())
    for mine, hf in pairs.items():
        torch.testing.assert_close(ours[mine].grad, theirs[hf].grad, rtol=1e-4, atol=1e-5, msg=mine)


def test_llama3_rope_scaling_matches_hf(world, tmp_path):
    from transformers import AutoModelForCausalLM

    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.loader import load_hf_weights

    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_type": "llama3"}
    path = make_tiny_hf_model(tmp_path / "l3", model_type="llama", extra={"rope_scaling": scaling,
                                                                          "rope_theta": 500000.0})
    arch = arch_from_hf(load_hf_config(path))
    assert arch.rope_scaling is not None
    chunks = build_model_chunks(arch, transformer_config(arch, use_cpu_initialization=True), world, use_te="false")
    load_hf_weights(chunks, HFCheckpointReader(path), arch, world)
    ids = torch.randint(0, arch.vocab_size, (1, 200))
    with torch.no_grad():
        out = chunks[0].eval()(ids, torch.arange(200)[None], None)[..., : arch.vocab_size]
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
    assert (out - ref).abs().max().item() < 1e-4


def test_vocab_padding_and_value_head(world, tmp_path):
    from verl_mega.models.build import build_model_chunks

    path = make_tiny_hf_model(tmp_path / "m", model_type="qwen2")
    arch = arch_from_hf(load_hf_config(path))
    assert arch.padded_vocab_size(1) % 128 == 0 and arch.padded_vocab_size(2) % 256 == 0
    chunks = build_model_chunks(arch, transformer_config(arch, use_cpu_initialization=True), world, value_head=True,
                                use_te="false")
    with torch.no_grad():
        values = chunks[0](torch.zeros(2, 5, dtype=torch.long), torch.arange(5).expand(2, 5), None)
    assert values.shape == (2, 5, 1)


BAD_CONFIGS = [
    ({"model_type": "gpt2"}, "model_type='gpt2' is not supported"),
    ({"hidden_size": 0}, "'hidden_size' must be a positive int"),
    ({"num_key_value_heads": 3}, "is not a multiple of num_key_value_heads=3"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
]


@pytest.mark.parametrize("patch,message", BAD_CONFIGS)
def test_bad_model_configs(patch, message):
    base = json.loads((FIXTURES / "qwen2.5-7b.json").read_text())
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        arch_from_hf({**base, **patch})


def test_bad_layouts():
    arch = arch_from_hf(json.loads((FIXTURES / "qwen2.5-7b.json").read_text()))
    with pytest.raises(ModelConfigError, match=r"parallel.tp=8 must divide num_attention_heads=28"):
        transformer_config(arch, tp=8)
    with pytest.raises(ModelConfigError, match=r"parallel.pp·vpp=3 must divide num_hidden_layers=28"):
        transformer_config(arch, pp=3)
    with pytest.raises(ModelConfigError, match=r"model.dtype='fp8' is not supported"):
        transformer_config(arch, dtype="fp8")


def test_corrupt_and_mismatched_checkpoints(tmp_path):
    path = make_tiny_hf_model(tmp_path / "m", model_type="qwen2", with_tokenizer=False)
    data = (path / "model.safetensors").read_bytes()
    trunc = tmp_path / "trunc"
    trunc.mkdir()
    (trunc / "config.json").write_text((path / "config.json").read_text())
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        HFCheckpointReader(trunc)
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        HFCheckpointReader(garbage)
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        HFCheckpointReader(tmp_path)
    from verl_mega.models.loader import check_checkpoint_matches

    other = arch_from_hf({**load_hf_config(path), "num_hidden_layers": 3})
    with pytest.raises(CheckpointError, match="tensors the config needs are missing"):
        check_checkpoint_matches(HFCheckpointReader(path), other)
    wider = arch_from_hf({**load_hf_config(path), "vocab_size": 999})
    with pytest.raises(CheckpointError, match="belong to another model"):
        check_checkpoint_matches(HFCheckpointReader(path), wider)
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_hf_config(tmp_path / "nowhere")


@pytest.mark.parametrize("where", ["file", "under_a_file"])
def test_converter_output_in_a_file_is_one_line(tmp_path, capsys, where):
    """--output naming a file (or a path below one) is refused before any model is built, and nothing is written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("to_mcore", Path(__file__).resolve().parents[2] / "tools" /
                                                  "convert_hf_to_mcore.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    hf = make_tiny_hf_model(tmp_path / "m", model_type="qwen2")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    out = blocker if where == "file" else blocker / "ckpt"
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()  # the model's own save progress
    assert tool.main(["--hf-path", str(hf), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: output: {blocker} is a file, not a directory; choose a new --output directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == before and blocker.read_text() == "x"


def test_expert_tensor_parallelism_needs_experts():
    dense = arch_from_hf(json.loads((FIXTURES / "qwen3-8b.json").read_text()))
    with pytest.raises(ModelConfigError, match="parallel.etp=2 needs a Mixture-of-Experts model; qwen3 is dense"):
        transformer_config(dense, tp=4, etp=2)
    transformer_config(dense, tp=4, etp=4)  # what the placement fills in when etp is unset
