"""LoRA adapters in one process (world of one, CPU, fp32): merged vs unmerged logits, the PEFT export read back by the
``peft`` library, the merge tool, a float64 reference of W + (alpha/r)·B·A, and the frozen base's missing optimizer
state. The tp=2 / pp=2 parity is a multi-process test (tests/distributed/test_lora_parity.py)."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
from verl_mega.models.hf_io import HFCheckpointReader, write_hf_checkpoint
from verl_mega.models.tiny import make_tiny_hf_model


@pytest.fixture(scope="module")
def world():
    from verl_mega.parallel.state import init_distributed

    return init_distributed(tp=1, pp=1)


def _lora_model(world, path, spec, dtype="float32"):
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.loader import load_hf_weights

    arch = arch_from_hf(load_hf_config(path))
    chunks = build_model_chunks(arch, transformer_config(arch, use_cpu_initialization=True, dtype=dtype), world,
                                use_te="false", lora=spec)
    load_hf_weights(chunks, HFCheckpointReader(path), arch, world)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B starts at zero; a trained adapter has moved it
        for name, p in chunks[0].named_parameters():
            if ".lora_b_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return arch, chunks


def test_merged_unmerged_peft_and_merge_tool_agree(world, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from verl_mega.checkpoint.mcore import merge_lora_adapter
    from verl_mega.models import lora as L
    from verl_mega.models.loader import iter_hf_tensors

    base = make_tiny_hf_model(tmp_path / "base", model_type="qwen2")  # q/k/v biases, untied head
    spec = L.LoRASpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    arch, chunks = _lora_model(world, base, spec)
    model = chunks[0].eval()
    ids = torch.randint(0, arch.vocab_size, (2, 20))
    pos = torch.arange(20).expand(2, 20)
    with torch.no_grad():
        unmerged = model(ids, pos, None)[..., :arch.vocab_size]
        with L.adapters_off([model]):
            off = model(ids, pos, None)[..., :arch.vocab_size]

    merged_dir = tmp_path / "merged"
    merged_dir.mkdir()
    write_hf_checkpoint(merged_dir, iter_hf_tensors(chunks, arch, world))
    shutil.copy(base / "config.json", merged_dir / "config.json")
    adapters = L.adapter_tensors(chunks, world)
    L.write_peft_adapter(tmp_path / "adapter", adapters, spec, str(base))
    assert len(adapters) == 2 * len(spec.targets) * arch.num_layers

    with torch.no_grad():
        hf_merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()(ids).logits
        hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        base_logits = hf_base(ids).logits
        peft_logits = PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()(ids).logits
    assert (unmerged - hf_merged).abs().max().item() < 1e-5  # merged vs unmerged, fp32
    assert (peft_logits - hf_merged).abs().max().item() < 1e-5  # peft's reading of our adapter = our merged export
    assert (off - base_logits).abs().max().item() < 1e-5  # adapters off: the base model (the reference policy)
    assert (unmerged - off).abs().max().item() > 1e-2  # the adapters do change the model

    # the float64 reference: every targeted weight is W + (alpha/r)·B·A, every other one untouched
    reader, merged = HFCheckpointReader(base), HFCheckpointReader(merged_dir)
    for name in reader.keys():
        key = f"base_model.model.{name.removesuffix('.weight')}"
        want = reader.get(name).double()
        if f"{key}.lora_A.weight" in adapters:
            want = want + 2.0 * adapters[f"{key}.lora_B.weight"].double() @ adapters[f"{key}.lora_A.weight"].double()
        assert (merged.get(name).double() - want).abs().max().item() < 1e-6, name

    # tools/merge_lora.py's function: base + PEFT adapter → the same merged model
    tool_out = merge_lora_adapter(base, tmp_path / "adapter", tmp_path / "tool")
    tool = HFCheckpointReader(tool_out)
    for name in reader.keys():
        assert torch.allclose(tool.get(name), merged.get(name), atol=1e-6), name
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    # per-module ranks or alphas (PEFT's rank_pattern / alpha_pattern) scale some modules otherwise: refused, no output
    for pattern in ("rank_pattern", "alpha_pattern"):
        shutil.copytree(tmp_path / "adapter", tmp_path / pattern)
        config = json.loads((tmp_path / pattern / "adapter_config.json").read_text())
        (tmp_path / pattern / "adapter_config.json").write_text(json.dumps({**config, pattern: {"q_proj": 8}}))
        with pytest.raises(ValueError, match="no rsLoRA, DoRA, fan_in_fan_out, rank_pattern or alpha_pattern"):
            merge_lora_adapter(base, tmp_path / pattern, tmp_path / f"{pattern}-merged")
        assert not (tmp_path / f"{pattern}-merged").exists()


def test_frozen_base_has_no_grad_buffer_master_or_optimizer_state(world, tmp_path):
    """bf16 model: only the adapters get DDP gradient buffers, fp32 master copies and Adam state; a step moves them
    and leaves the base bit-identical."""
    from megatron.core.optimizer import OptimizerConfig

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models import lora as L
    from verl_mega.planning.lora import adapter_params_per_rank

    base = make_tiny_hf_model(tmp_path / "base", model_type="qwen2")
    spec = L.LoRASpec(rank=4, alpha=8.0)
    arch, chunks = _lora_model(world, base, spec, dtype="bfloat16")
    tcfg = transformer_config(arch, use_cpu_initialization=True, dtype="bfloat16")
    before = {n: p.detach().clone() for n, p in chunks[0].named_parameters()}
    engine = MegatronEngine(chunks, tcfg, world, optimizer_config=OptimizerConfig(
        optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=False))
    adapter_numel = sum(p.numel() for n, p in chunks[0].named_parameters() if L.is_lora_param(n))
    assert adapter_numel == adapter_params_per_rank(arch, spec, 1, range(arch.num_layers))  # the planner's count
    assert sum(buf.grad_data.numel() for c in engine.chunks for buf in c.buffers) == adapter_numel
    masters = [p for g in engine.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in masters) == adapter_numel and all(p.dtype == torch.float32 for p in masters)

    ids = torch.randint(0, arch.vocab_size, (2, 16))
    mb = {"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16), "attention_mask": None}

    def loss_fn(output, _mb):
        return output.float().logsumexp(-1).mean(), {}

    engine.train_step([{k: v for k, v in mb.items() if v is not None}], loss_fn)
    state = engine.optimizer.optimizer.state
    assert sum(s["exp_avg"].numel() for s in state.values()) == adapter_numel
    after = dict(chunks[0].named_parameters())
    for name, p in before.items():
        if ".lora_a_" in name or ".lora_b_" in name:
            assert not torch.equal(after[name], p), name
        else:
            assert torch.equal(after[name], p), name


def test_lora_config_errors():
    from verl_mega.config import ConfigError
    from verl_mega.config.model import LoRAConfig, ModelConfig
    from verl_mega.models import lora as L

    with pytest.raises(ConfigError, match=r"model.lora.target_modules=\['qkv'\]"):
        LoRAConfig(rank=8, target_modules=("qkv",))
    with pytest.raises(ConfigError, match="model.lora.alpha"):
        LoRAConfig(rank=8, alpha=0.0)
    with pytest.raises(ConfigError, match="set model.use_te=auto or false"):
        ModelConfig(use_te=True, lora=LoRAConfig(rank=8))
    # adapters set up with no rank: refused, not a silent full fine-tuning
    with pytest.raises(ConfigError, match=r"^model.lora.rollout_sync is set but model.lora.rank=0 \(LoRA off: full "
                                          r"fine-tuning\); set model.lora.rank \(e.g. 16\), or remove "
                                          r"model.lora.rollout_sync$"):
        LoRAConfig(rollout_sync="adapter")
    with pytest.raises(ConfigError, match="model.lora.target_modules is set but model.lora.rank=0"):
        LoRAConfig(target_modules=("q_proj",))
    # vLLM's LoRA takes ranks up to 512: refused at the config, before any model is built
    with pytest.raises(ConfigError, match=r"model.lora.rank=600: vLLM's LoRA \(model.lora.rollout_sync=adapter\) "
                                          r"takes ranks up to 512"):
        LoRAConfig(rank=600, rollout_sync="adapter")
    assert LoRAConfig(rank=600).rank == 600  # merged into vLLM's weights: any rank
    assert L.resolve_targets(("all-linear",)) == L.HF_TARGETS
    assert L.resolve_targets(("v_proj", "q_proj")) == ("q_proj", "v_proj")
    assert L.spec_from_config(LoRAConfig(), seed=0) is None
    with pytest.raises(ValueError, match="multi-head latent attention"):
        from verl_mega.models.spec import layer_spec

        layer_spec(qk_layernorm=True, multi_latent_attention=True, lora=L.LoRASpec(rank=2, alpha=2.0))


def test_planner_lora_terms():
    """Llama-2-70B GRPO (no critic) on 8 × 80 GB at tp=8: full fine-tuning does not fit, LoRA r=16 on every projection
    does. The base carries bf16 weights only, the adapters 2 + 4 + 12 bytes each, and the reference holds nothing."""
    from verl_mega.models.lora import LoRASpec
    from verl_mega.planning.lora import adapter_params_per_rank
    from verl_mega.planning.memory import GiB, RolloutSpec, Workload, default_roles, predict_memory, training_pool

    arch = arch_from_hf(json.loads((Path(__file__).parent.parent / "fixtures" / "hf_configs" /
                                    "llama-2-70b.json").read_text()))
    spec = LoRASpec(rank=16, alpha=32.0)
    layout = training_pool(tp=8, pp=1, dp=1, gen_tp=8)
    work = Workload(micro_batch=1, seq_len=4096)
    rollout = RolloutSpec(gpu_memory_utilization=0.5)
    full = predict_memory(arch, layout, work, roles=default_roles(critic=False), rollout=rollout,
                          gpu_mem_bytes=80 * GiB)
    lora = predict_memory(arch, layout, work, roles=default_roles(critic=False, lora=spec), rollout=rollout,
                          gpu_mem_bytes=80 * GiB)
    # per rank: q, k, v, gate, up column-parallel r·(in + out/8); o, down row-parallel r·(in/8 + out)
    h, f, kv = 8192, 28672, 1024
    per_layer = 16 * ((h + h // 8) + 2 * (h + kv // 8) + (h // 8 + h) + 2 * (h + f // 8) + (f // 8 + h))
    assert adapter_params_per_rank(arch, spec, 8, range(80)) == 80 * per_layer
    train = lora.phases["train"].breakdown_gib()
    assert train["actor grads (fp32 main grads)"] == round(4 * 80 * per_layer / GiB, 4)
    assert train["actor optimizer (master, m, v)"] == round(12 * 80 * per_layer / GiB, 4)
    assert not any(name.startswith("ref ") for name in train)  # the reference is the actor's base
    assert full.peak > 80 * GiB > lora.peak
    assert any(name.startswith("ref ") for name in full.phases["train"].breakdown_gib())

    # step time: the frozen base's GEMMs skip their weight gradients (2 × forward instead of 3 ×), core attention's
    # backward is unchanged, the reference pass still runs, and only the adapters are stepped
    from verl_mega.planning.timing import StepShape, predict_time

    step = StepShape(samples=64, prompt_len=2048, response_len=2048, n=8)
    times = {name: {t.name: t for t in predict_time(arch, layout, work, step, pred, roles=roles,
                                                    rollout=rollout).terms}
             for name, pred, roles in (("full", full, default_roles(critic=False)),
                                       ("lora", lora, default_roles(critic=False, lora=spec)))}
    compute = {k: v["actor update compute"].seconds for k, v in times.items()}
    assert 2 / 3 < compute["lora"] / compute["full"] < 1
    assert times["lora"]["ref log-prob compute"].seconds == times["full"]["ref log-prob compute"].seconds
    assert f"P={adapter_params_per_rank(arch, spec, 8, range(80)):,}" in times["lora"]["actor optimizer step"].formula


@pytest.mark.parametrize("batch,tied", [(1, False), (3, True)], ids=["b1", "b3-tied"])
def test_frozen_output_layer_backward_is_one_gemm(world, tmp_path, batch, tied, monkeypatch):
    """The frozen output layer's backward multiplies the logits' gradient by the [V, h] weight as one GEMM: torch's
    matmul made it a batched product of s matrix-vector products (one per token, each reading the whole weight) when
    the gradient's leading strides were those of GPTModel's transposed logits."""
    from torch.profiler import ProfilerActivity, profile

    from verl_mega.models import lora as L

    base = make_tiny_hf_model(tmp_path / "base", model_type="qwen2", vocab_size=320,  # V ≠ every other width
                              tie_word_embeddings=tied)
    arch, chunks = _lora_model(world, base, L.LoRASpec(rank=4, alpha=8.0))
    model = chunks[0]
    assert (model.output_layer.weight is None) == tied  # tied: the embedding's weight is passed in at run time
    weight = list(model.embedding.word_embeddings.weight.shape)  # [V, h], the output layer's either way
    seq = 24
    ids = torch.randint(0, arch.vocab_size, (batch, seq))

    def products_over_vocab() -> tuple[int, int]:
        """(batched products, GEMMs) with the output layer's weight as an operand, in one backward"""
        out = model(input_ids=ids, position_ids=torch.arange(seq).expand(batch, seq), attention_mask=None)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            out.float().logsumexp(-1).mean().backward()
        spans = [e for e in prof.events() if any(list(s[-2:]) == weight for s in e.input_shapes if s)]
        return sum(e.name == "aten::bmm" for e in spans), sum(e.name == "aten::mm" for e in spans)

    assert products_over_vocab() == (0, 1)
    monkeypatch.setattr(L, "_row_major", lambda grad: grad)  # without it, the product the fix replaced
    assert products_over_vocab()[0] == 1


def test_the_reference_of_a_lora_actor_routes_on_its_own_under_routing_replay(world, tmp_path):
    """With R3 the actor replays vLLM's expert routing; the reference (the actor's engine, adapters off) must route
    as a reference engine of its own would, i.e. as the base model alone, whatever routing the batch carries."""
    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models import lora as L
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.loader import load_hf_weights
    from verl_mega.models.tiny import moe_fields
    from verl_mega.trainer.batch import Batch
    from verl_mega.trainer.roles import PolicyRole, ReferencePolicy

    path = make_tiny_hf_model(tmp_path / "moe", model_type="qwen3_moe", extra=moe_fields("qwen3_moe"))
    arch = arch_from_hf(load_hf_config(path))

    def engine(spec):
        tcfg = transformer_config(arch, use_cpu_initialization=True, dtype="float32")
        chunks = build_model_chunks(arch, tcfg, world, use_te="false", lora=spec)
        load_hf_weights(chunks, HFCheckpointReader(path), arch, world)
        return MegatronEngine(chunks, tcfg, world)

    gen = torch.Generator().manual_seed(0)
    rows, length, prompt = 2, 12, 4
    batch = Batch({"input_ids": torch.randint(0, arch.vocab_size, (rows, length), generator=gen),
                   "prompt_len": torch.full((rows,), prompt), "response_len": torch.full((rows,), length - prompt),
                   "response_mask": torch.ones(rows, length - prompt, dtype=torch.bool)})
    experts = [torch.randperm(arch.num_experts, generator=gen)[:2] for _ in range(rows * length * arch.num_layers)]
    batch["rollout_routing"] = torch.stack(experts).view(rows, length, arch.num_layers, 2)  # not the base's
    kw = dict(vocab_size=arch.vocab_size, micro_batch_size=rows, temperature=1.0)
    actor_engine = engine(L.LoRASpec(rank=4, alpha=8.0))
    actor_engine.enable_routing_replay()  # as the build does for actor.routing_replay=r3
    reference = ReferencePolicy(actor_engine, **kw).compute_logprobs(batch)
    base = PolicyRole(engine(None), **kw).compute_logprobs(batch)  # a reference engine of its own: no replay
    torch.testing.assert_close(reference["logprobs"], base["logprobs"], rtol=0, atol=1e-5)
    assert set(reference) == {"logprobs"} and actor_engine.routing is not None  # the actor's replay is left on


def test_a_checkpoint_of_other_adapters_is_refused_naming_the_adapter(world, tmp_path):
    """Resuming with another model.lora: an adapter the checkpoint lacks, one it has that this model does not build,
    or another rank is refused by name before anything loads (a narrower target list would otherwise drop trained
    adapters silently)."""
    from megatron.core import dist_checkpointing

    from verl_mega.checkpoint.mcore import check_adapters_match, model_sharded_state_dict
    from verl_mega.models import lora as L
    from verl_mega.models.hf_io import CheckpointError

    path = make_tiny_hf_model(tmp_path / "base")
    spec = L.LoRASpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    _, saved = _lora_model(world, path, spec)
    (tmp_path / "ckpt").mkdir()
    state = model_sharded_state_dict(saved, world)
    # as a training checkpoint holds them: the adapters' optimizer state, under names of its own
    state["optimizer"] = {f"exp_avg.{key}": dataclasses.replace(t, key=f"optimizer.state.exp_avg.{t.key}")
                          for key, t in state["model"].items()}
    dist_checkpointing.save(state, str(tmp_path / "ckpt"))
    check_adapters_match(model_sharded_state_dict(saved, world), tmp_path / "ckpt")  # the same adapters: fine
    for other, says in ((L.LoRASpec(rank=4, alpha=8.0, targets=("q_proj",)), "holds LoRA adapter "),
                        (L.LoRASpec(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj")), "is missing from"),
                        (L.LoRASpec(rank=8, alpha=8.0, targets=("q_proj", "v_proj")), "has shape [")):
        _, chunks = _lora_model(world, path, other)
        with pytest.raises(CheckpointError, match=r"LoRA adapter .*(the checkpoint was written with another "
                                                  r"model.lora \(rank, target_modules\))") as err:
            check_adapters_match(model_sharded_state_dict(chunks, world), tmp_path / "ckpt")
        assert says in str(err.value) and "\n" not in str(err.value)
