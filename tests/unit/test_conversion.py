"""The HF ⇄ Megatron converters in one process: what they refuse up front (tensors of another shape, quantized
weights, biases the model does not have, broken meta files, unusable output paths), what they leave behind (nothing,
even on SIGTERM), and the way back from a training checkpoint."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl_mega.checkpoint.atomic_dir import AtomicDir
from verl_mega.checkpoint.mcore import META_FILE, _dtype_name, convert_hf_to_mcore, convert_mcore_to_hf
from verl_mega.models.hf_config import ModelConfigError, arch_from_hf, load_hf_config
from verl_mega.models.hf_io import CheckpointError, HFCheckpointReader
from verl_mega.models.tiny import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "hf_configs"


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """An untied Qwen2 (vocab 55, hidden 128, FFN 256, 4 heads of 32, 2 KV heads)."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("hf") / "qwen2", model_type="qwen2")


def _edited(src: Path, dst: Path, edit, config: dict | None = None) -> Path:
    """A copy of the HF model `src` whose tensors went through ``edit(dict)`` (and whose config is updated)."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps({**load_hf_config(src), **(config or {})}))
    return dst


def _nothing_written(parent: Path, name: str = "out") -> bool:
    return not (parent / name).exists() and not list(parent.glob(f".{name}.tmp-*"))


GROWN = [("model.layers.1.mlp.up_proj.weight", 44, "[300, 128] but config.json implies [256, 128] "
                                                 "(dimension 0: intermediate_size=256)"),
         ("model.layers.0.self_attn.k_proj.weight", 44, "[108, 128] but config.json implies [64, 128] "
                                                       "(dimension 0: num_key_value_heads·head_dim=64)"),
         ("lm_head.weight", -10, "[45, 128] but config.json implies [55, 128] (dimension 0: vocab_size=55)"),
         ("model.norm.weight", 8, "[136] but config.json implies [128] (dimension 0: hidden_size=128)")]


@pytest.mark.parametrize("name,extra_rows,message", GROWN, ids=["up_proj", "k_proj", "lm_head", "norm"])
def test_a_tensor_of_another_shape_is_refused_before_anything_is_built(tiny, tmp_path, name, extra_rows, message):
    """Larger tensors were cut to the config's size and a short LM head padded with zeros; now every tensor's full
    shape is compared with config.json's, from the file headers."""
    def grow(tensors):
        t = tensors[name]
        tensors[name] = torch.cat([t, torch.randn(extra_rows, *t.shape[1:])]) if extra_rows > 0 else t[:extra_rows]

    bad = _edited(tiny, tmp_path / "bad", grow)
    with pytest.raises(CheckpointError) as info:
        convert_hf_to_mcore(bad, tmp_path / "out")
    assert str(info.value) == (f"checkpoint: {name} in {bad} has shape {message}; the weights belong to another "
                               f"model or config.json is wrong")
    assert _nothing_written(tmp_path)


def test_quantized_checkpoints_are_refused_up_front(tiny, tmp_path):
    """FP8 checkpoints (a quantization_config, or F8_E4M3 weights with their *_scale_inv) crashed after the model
    was built; an unknown safetensors dtype was read as float32."""
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    quantized = _edited(tiny, tmp_path / "q", lambda t: None, {"quantization_config": fp8})
    with pytest.raises(ModelConfigError, match=r"^model: config.json has a quantization_config \(quant_method='fp8'"
                                               r"\); .*dequantize the checkpoint to bf16 first$"):
        convert_hf_to_mcore(quantized, tmp_path / "out")

    def to_fp8(tensors):
        name = "model.layers.0.self_attn.q_proj.weight"
        tensors[name] = tensors[name].to(torch.float8_e4m3fn)
        tensors[name + "_scale_inv"] = torch.ones(1, 1)

    fp8_weights = _edited(tiny, tmp_path / "f8", to_fp8)
    with pytest.raises(CheckpointError, match=r"^checkpoint: tensor model.layers.0.self_attn.q_proj.weight in .* is "
                                              r"F8_E4M3, a quantized format; .*dequantize the checkpoint to bf16"):
        convert_hf_to_mcore(fp8_weights, tmp_path / "out")
    assert _nothing_written(tmp_path)
    with pytest.raises(CheckpointError, match="weights of dtype F8_E4M3 cannot be loaded"):
        _dtype_name("F8_E4M3")
    assert _dtype_name("BF16") == "bfloat16"


@pytest.mark.parametrize("model_type,key,where", [("llama", "attention_bias", "q_proj, k_proj, v_proj and o_proj"),
                                                  ("qwen3", "attention_bias", "q_proj, k_proj, v_proj and o_proj"),
                                                  ("llama", "mlp_bias", "gate_proj, up_proj and down_proj")])
def test_biases_the_model_does_not_have_are_refused(tmp_path, model_type, key, where):
    """HF puts these biases on o_proj (attention_bias) or on the MLP (mlp_bias); Megatron's model had only a QKV
    bias, so they were dropped and the logits changed."""
    path = make_tiny_hf_model(tmp_path / "m", model_type=model_type, extra={key: True}, with_tokenizer=False)
    assert any(k.endswith(("o_proj.bias", "down_proj.bias")) for k in HFCheckpointReader(path).keys())
    with pytest.raises(ModelConfigError) as info:
        arch_from_hf(load_hf_config(path))
    assert str(info.value) == (f"model: {key}=true gives {model_type}'s {where} a bias, which the Megatron model "
                               f"does not have (it would be dropped); only {key}=false is supported")


def test_biases_follow_what_hf_builds(tmp_path):
    """Mistral ignores attention_bias (no bias tensors); Qwen2-MoE's q/k/v bias follows its qkv_bias."""
    path = make_tiny_hf_model(tmp_path / "m", model_type="mistral", extra={"attention_bias": True},
                              with_tokenizer=False)
    arch = arch_from_hf(load_hf_config(path))
    assert not arch.qkv_bias
    from verl_mega.models.loader import check_checkpoint_matches

    check_checkpoint_matches(HFCheckpointReader(path), arch)
    qwen2_moe = json.loads((FIXTURES / "qwen1.5-moe-a2.7b.json").read_text())
    assert arch_from_hf(qwen2_moe).qkv_bias and not arch_from_hf({**qwen2_moe, "qkv_bias": False}).qkv_bias


def test_bf16_round_trip_says_bf16_and_outputs_are_plain_directories(tiny, tmp_path):
    """--dtype bfloat16: the way back writes bf16 weights, and its config.json says so (it kept the source's
    float32); both outputs get the usual directory mode, not mkdtemp's 0700."""
    mcore = convert_hf_to_mcore(tiny, tmp_path / "mc", dtype="bfloat16")
    back = convert_mcore_to_hf(mcore, tmp_path / "back")
    assert load_hf_config(tiny)["dtype"] == "float32"
    assert load_hf_config(back)["dtype"] == "bfloat16"
    assert HFCheckpointReader(back).dtype("model.embed_tokens.weight") == "BF16"
    umask = os.umask(0)
    os.umask(umask)
    for out in (mcore, back):
        assert out.stat().st_mode & 0o777 == 0o777 & ~umask


def _meta_of(tmp_path: Path, text: str) -> Path:
    ckpt = tmp_path / "mc"
    ckpt.mkdir()
    (ckpt / META_FILE).write_text(text)
    return ckpt


@pytest.mark.parametrize("text,problem", [
    ('{"hf_config": {', "is not valid JSON"),
    ('{"dtype": "float32"}', "has no 'hf_config' object"),
    ('{"hf_config": {}, "dtype": "fp8"}', "has dtype='fp8', not one of float32, bfloat16, float16"),
    ('{"hf_config": {}, "dtype": "float32", "adapters_only": true}', "holds a run's LoRA adapters only"),
])
def test_a_broken_meta_file_is_one_line(tmp_path, capsys, text, problem):
    ckpt = _meta_of(tmp_path, text)
    assert _tool("convert_mcore_to_hf").main(["--mcore-path", str(ckpt), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint: ") and problem in err and len(err.strip().splitlines()) == 1
    assert _nothing_written(tmp_path)


def test_an_unusable_output_is_one_line_before_any_work(tiny, tmp_path, capsys, monkeypatch):
    tool = _tool("convert_hf_to_mcore")
    assert tool.main(["--hf-path", str(tiny), "--output", "/proc/verl_mega_out"]) == 2
    assert capsys.readouterr().err.strip() == ("error: output: cannot write /proc/verl_mega_out under /proc (No "
                                               "such file or directory); choose another --output directory")
    locked = tmp_path / "locked"
    locked.mkdir()
    mkdir = Path.mkdir

    def refuse(self, *args, **kwargs):  # what a directory without write permission does (root bypasses chmod)
        if self.parent == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refuse)
    assert tool.main(["--hf-path", str(tiny), "--output", str(locked / "out")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: output: {locked} is not writable (Permission denied); "
                                               f"choose another --output directory")
    assert list(locked.iterdir()) == []


def test_a_missing_input_names_the_flag(tmp_path, capsys):
    """The converters' errors name their own flags (not model.path, a config key they do not read)."""
    (tmp_path / "empty").mkdir()
    for path, what in ((tmp_path / "nowhere", "is not a directory"), (tmp_path / "empty", "has no config.json")):
        assert _tool("convert_hf_to_mcore").main(["--hf-path", str(path), "--output", str(tmp_path / "o")]) == 2
        assert capsys.readouterr().err == (f"error: --hf-path {path} {what}; give an HF model directory (config.json "
                                           f"+ *.safetensors) or a hub ID ORG/NAME\n")
    assert _tool("convert_mcore_to_hf").main(["--mcore-path", str(tmp_path / "nowhere"), "--output",
                                              str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --mcore-path {tmp_path / 'nowhere'} is not a directory; ")
    assert not (tmp_path / "o").exists()


def test_etp_below_one_is_refused(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        _tool("convert_hf_to_mcore").main(["--hf-path", str(tiny), "--output", str(tmp_path / "o"), "--etp", "0"])
    assert info.value.code == 2 and "--etp must be ≥ 1" in capsys.readouterr().err


def test_a_failure_removes_the_parent_directories_it_created(tmp_path):
    with pytest.raises(RuntimeError):
        with AtomicDir(tmp_path / "a" / "b" / "out") as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("failed midway")
    assert list(tmp_path.iterdir()) == []


_CHILD = """
import sys, time
from verl_mega.checkpoint.atomic_dir import AtomicDir
with AtomicDir(sys.argv[1]) as tmp:
    (tmp / "half").write_text("x")
    print(tmp, flush=True)
    time.sleep(120)
"""


def test_sigterm_during_a_conversion_leaves_nothing(tmp_path):
    """SIGTERM becomes a clean exit (143) that removes the temporary directory and the parents it created."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / "new" / "out")], stdout=subprocess.PIPE,
                             text=True, env=env)
    tmp = Path(child.stdout.readline().strip())
    assert (tmp / "half").exists() and tmp.parent == tmp_path / "new"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == 143
    assert list(tmp_path.iterdir()) == []


def test_the_previous_sigterm_handler_comes_back(tmp_path):
    def mine(signum, frame):
        pass

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        with AtomicDir(tmp_path / "out"):
            assert signal.getsignal(signal.SIGTERM) is not mine
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_leftovers_of_dead_conversions_are_removed_and_live_ones_kept(tmp_path):
    """A conversion killed outright (SIGKILL) leaves its temporary directory; the next one to the same output
    removes it, unless its process still runs (another conversion) or it is another host's."""
    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = [f".out.tmp-{host}-{dead.pid}", f".out.tmp-{host}-{live.pid}", f".out.tmp-otherhost-{dead.pid}",
                 ".out.tmp-abcd1234"]
        for name in names:
            (tmp_path / name).mkdir()
        with AtomicDir(tmp_path / "out") as tmp:
            (tmp / "x").write_text("done")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *names[1:]])
    finally:
        live.kill()
        live.wait()


def test_a_training_checkpoint_converts_to_what_export_hf_writes(tiny, tmp_path):
    """`<run>/checkpoints/step_N/actor` converts back to HF: the same tensors and config as the checkpoint's hf/
    export, with HF transformers' logits of the trained weights. The model is padded for a vocabulary split over
    two TP ranks (256 rows), as a tp=2 run's checkpoint is, which the converter must rebuild."""
    from transformers import AutoModelForCausalLM

    from test_ckpt_integrity import _cfg
    from verl_mega.checkpoint.manager import CheckpointManager
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import transformer_config
    from verl_mega.models.loader import load_hf_weights
    from verl_mega.parallel.state import init_distributed

    world = init_distributed(tp=1, pp=1)
    arch = arch_from_hf(load_hf_config(tiny))
    chunks = build_model_chunks(arch, transformer_config(arch, use_cpu_initialization=True), world, use_te="false",
                                make_vocab_size_divisible_by=256)
    load_hf_weights(chunks, HFCheckpointReader(tiny), arch, world)
    with torch.no_grad():  # stands for training: the weights are no longer the source's
        for p in chunks[0].parameters():
            p.add_(0.01 * torch.randn_like(p))
    cfg = _cfg(tmp_path / "run", "checkpoint.export_hf=true", "checkpoint.save_optimizer=false")
    mgr = CheckpointManager(cfg, engines={"actor": SimpleNamespace(chunks=chunks, modules=chunks, groups=world)},
                            loader=None, kl_ctrl=None, hf_source=tiny, arch=arch)
    mgr._trainer_state = lambda step: {"step": step}
    step = mgr.save(1)
    back = convert_mcore_to_hf(step / "actor", tmp_path / "back")
    exported, converted, source = (HFCheckpointReader(p) for p in (step / "hf", back, tiny))
    assert converted.keys() == exported.keys() == source.keys()
    for name in exported.keys():
        assert torch.equal(converted.get(name), exported.get(name)), name
    assert not torch.equal(converted.get("lm_head.weight"), source.get("lm_head.weight"))
    assert load_hf_config(back) == load_hf_config(step / "hf")
    ids = torch.randint(0, arch.vocab_size, (2, 12))
    with torch.no_grad():
        ours = chunks[0].eval()(ids, torch.arange(12).expand(2, 12), None)[..., : arch.vocab_size]
        ref = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32)(ids).logits
    assert (ours - ref).abs().max().item() < 1e-5
