"""mcore vs HF logits over gloo at (tp,pp) ∈ {(1,1),(2,1),(1,2)}, with and without sequence parallelism, context
parallelism (cp=2) with its gradients, Mixture-of-Experts models at (tp,pp,ep) ∈ {(1,1,1),(1,1,2),(2,1,1),(1,2,2)}
with their gradients (DeepSeek-V3 at (1,1,1), (1,2,2) and (2,1,2)), and the HF → mcore dist checkpoint (converted
for tp=2,pp=2) → HF round trip, reloaded at other layouts."""

import os
import sys
from pathlib import Path

import pytest
import torch

from torchrun_util import run_captured, run_torchrun, tagged_report

from shared_runs import shared_dir
from verl_mega.models.hf_io import HFCheckpointReader

ROOT = Path(__file__).resolve().parents[2]
MOE = ("qwen3_moe", "mixtral", "qwen2_moe")


def _parity(out: str) -> dict:
    return tagged_report(out, "PARITY")


def parity_run(factory, parity_models: Path, nproc: int, *args: str, timeout: float = 600) -> str:
    """The output of ``jobs/model_parity.py ARGS --workdir MODELS``, run once per session: a run with
    ``--packing`` serves both this file's logits checks and test_packing_parity.py's."""
    def make(d: Path) -> None:
        (d / "out.txt").write_text(run_torchrun("model_parity.py", nproc, *args, "--workdir", str(parity_models),
                                                timeout=timeout))

    return (shared_dir(factory, "parity" + "".join(args).replace("-", "_"), make) / "out.txt").read_text()


# the layouts test_packing_parity.py checks packed micro-batches at: these runs check both (and LoRA, but at cp=2)
PACKING_LAYOUTS = {"tp2": ["--tp", "2", "--pp", "1", "--packing", "--lora"],
                   "tp2-sp": ["--tp", "2", "--pp", "1", "--sp", "--packing", "--lora"],
                   "pp2": ["--tp", "1", "--pp", "2", "--packing", "--lora"],
                   "cp2": ["--cp", "2", "--tp", "1", "--pp", "1", "--grads", "--packing"]}
TP1_ARGS = ["--tp", "1", "--pp", "1", "--lora"]


@pytest.mark.parametrize("layout", [("1", "1", False), ("2", "1", False), ("2", "1", True), ("1", "2", False)],
                         ids=["tp1pp1", "tp2pp1", "tp2pp1-sp", "tp1pp2"])
def test_logits_match_hf(parity_models, layout, tmp_path_factory):
    tp, pp, sp = layout
    packing = {("2", "1", False): "tp2", ("2", "1", True): "tp2-sp", ("1", "2", False): "pp2"}.get(layout)
    args = PACKING_LAYOUTS[packing] if packing else TP1_ARGS
    report = _parity(parity_run(tmp_path_factory, parity_models, 2, *args))
    for mt in ("qwen2", "llama", "qwen3"):
        assert report[mt]["logits_max_abs"] < 1e-5
        print(mt, layout, report[mt])


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "pp2"])
def test_lora_layouts_equal_tp1(parity_models, layout, tmp_path_factory):
    """LoRA adapters (all seven projections, rank 4, on qwen2 and on llama with tied embeddings), inside the logits
    runs above: at tp=2 (with and without sequence parallelism) and pp=2 the logits and every adapter's gradient
    equal tp=1's within 1e-5, and each run equals HF transformers + peft (fp32) within 1e-5 (jobs/lora_parity.py)."""
    runs = {"tp1": TP1_ARGS, layout: PACKING_LAYOUTS[layout]}
    for name, args in runs.items():
        report = tagged_report(parity_run(tmp_path_factory, parity_models, 2, *args), "LORA")
        for mt in ("qwen2", "llama"):
            assert report[mt]["logits_max_abs"] < 1e-5 and report[mt]["grad_max_abs"] < 1e-5, (name, mt, report[mt])
    tag = {"tp2": "tp2-pp1", "tp2-sp": "tp2-pp1-sp", "pp2": "tp1-pp2"}[layout]
    ref, got = (torch.load(parity_models / f"lora-{t}.pt") for t in ("tp1-pp1", tag))
    for mt in ("qwen2", "llama"):
        assert (got[mt]["logits"] - ref[mt]["logits"]).abs().max().item() < 1e-5, mt
        assert set(got[mt]["grads"]) == set(ref[mt]["grads"]) and len(ref[mt]["grads"]) == 28
        for key, grad in ref[mt]["grads"].items():
            assert (got[mt]["grads"][key] - grad).abs().max().item() < 1e-5, (mt, key)


@pytest.fixture(scope="session")
def cp1_reference(parity_models, tmp_path_factory) -> dict:
    """The same checks at cp=1 (qwen2, with gradients), once for the three context-parallel layouts."""
    return _parity(parity_run(tmp_path_factory, parity_models, 2, "--grads", "--models", "qwen2"))


@pytest.mark.parametrize("layout", [("1", "1"), ("2", "1"), ("1", "2")], ids=["cp2", "cp2-tp2", "cp2-pp2"])
def test_context_parallel_logits_and_gradients(parity_models, layout, tmp_path_factory, cp1_reference):
    """Sequences split over 2 context-parallel ranks in load-balanced chunks: logits, the actor's log-probs and
    every parameter's gradient equal HF's (one unsplit sequence, fp32) within 1e-5; cp=1 passes the same checks."""
    tp, pp = layout
    nproc = 2 * int(tp) * int(pp)
    args = PACKING_LAYOUTS["cp2"] if layout == ("1", "1") else ["--cp", "2", "--tp", tp, "--pp", pp, "--grads"]
    report = _parity(parity_run(tmp_path_factory, parity_models, nproc, *args))
    assert report["cp"] == 2
    for mt in ("qwen2", "llama", "qwen3"):
        assert report[mt]["logits_max_abs"] < 1e-5 and report[mt]["grad_max_abs"] < 1e-5, (mt, report[mt])
    assert cp1_reference["qwen2"]["grad_max_abs"] < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("layout", [(1, 1, 1, False, 1, None, MOE + ("deepseek_v3",)), (1, 1, 2, False, 1, None, MOE),
                                    (2, 1, 1, True, 1, None, MOE), (1, 2, 2, False, 1, None, MOE + ("deepseek_v3",)),
                                    (1, 1, 2, False, 2, None, MOE), (2, 1, 2, True, 1, 1, ("deepseek_v3",))],
                         ids=["tp1pp1ep1", "tp1pp1ep2", "tp2pp1ep1-sp", "tp1pp2ep2", "cp2ep2", "tp2pp1ep2etp1-sp"])
def test_moe_logits_and_gradients_match_hf(parity_models, layout):
    """Qwen3-MoE, Mixtral, Qwen2-MoE (shared expert) and DeepSeek-V3 (multi-head latent attention with YaRN, a dense
    first layer, sigmoid group-limited routing with the correction bias, a shared expert): logits, log-probs and
    every parameter's gradient (routed experts on their EP rank, through Megatron's alltoall token dispatcher over
    gloo) equal HF's within 1e-5; routing replay records HF's routing and, replaying other experts, gives HF's logits
    with its routers forced to them. DeepSeek-V3 at (tp, pp, ep) = (1,1,1), (1,2,2) and (2,1,2)."""
    tp, pp, ep, sp, cp, etp, models = layout
    nproc = max(2, tp * pp * max(ep, cp) // (tp // (etp or tp)))  # ep ranks come out of tp·cp·dp (etp·ep of them)
    args = ["--tp", str(tp), "--pp", str(pp), "--ep", str(ep), "--cp", str(cp), "--grads", "--replay",
            "--models", ",".join(models),
            "--workdir", str(parity_models)] + (["--sp"] if sp else []) + (["--etp", str(etp)] if etp else [])
    report = _parity(run_torchrun("model_parity.py", nproc, *args, timeout=600))
    assert report["ep"] == ep
    for mt in models:
        assert report[mt]["logits_max_abs"] < 1e-5 and report[mt]["grad_max_abs"] < 1e-5, (mt, report[mt])
        assert report[mt]["replay_logits_max_abs"] < 1e-5, (mt, report[mt])
        print(mt, layout, report[mt])


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_moe_convert_roundtrip_and_reshard(parity_models, tmp_path, model_type):
    """HF → mcore (one CPU process, validated for tp=2, ep=2) → HF is bit-exact; for DeepSeek-V3 (MLA, a dense
    first stage, the routers' fp32 correction bias) the layout-free checkpoint also loads at (tp, pp, ep) =
    (1, 2, 2) with HF's logits, is saved again there (experts sharded over 2 EP ranks, layers over 2 stages) and
    converts back to the same HF tensors bit for bit."""
    src, mcore, back = parity_models / model_type, tmp_path / "mcore", tmp_path / "hf"
    tools = ROOT / "tools"
    if model_type == "deepseek_v3":
        src = _with_mtp_layer(src, tmp_path / "with_mtp")
    converted = run_captured([sys.executable, str(tools / "convert_hf_to_mcore.py"), "--hf-path", str(src),
                              "--output", str(mcore), "--tp", "2", "--ep", "2"], env=dict(os.environ), timeout=300,
                             check=True)
    if model_type == "deepseek_v3":  # the multi-token-prediction layer is left out, with one line
        notes = [line for line in converted.stdout.splitlines() if line.startswith("note:")]
        assert notes == ["note: dropped the checkpoint's 1 multi-token-prediction layer(s) (model.layers.2.* and "
                         "up): RL trains and generates with the main model; the output's config has "
                         "num_nextn_predict_layers=0"], converted.stdout
    run_captured([sys.executable, str(tools / "convert_mcore_to_hf.py"), "--mcore-path", str(mcore),
                 "--output", str(back)], env=dict(os.environ), timeout=300, check=True)
    outputs = [back]
    if model_type == "deepseek_v3":  # the 4-rank reshard costs a minute on 2 cores: one model family is enough
        outputs.append(_reshard_through_ep2(parity_models, model_type, mcore, tmp_path))
    a = HFCheckpointReader(src)
    main = {k for k in a.keys() if not k.startswith("model.layers.2.")}  # without the MTP layer (2-layer models)
    for out in outputs:
        b = HFCheckpointReader(out)
        assert main == set(b.keys()) and any(".experts.7." in k for k in main)
        for name in main:
            assert torch.equal(a.get(name), b.get(name)), name  # bit-exact


def _with_mtp_layer(src: Path, out: Path) -> Path:
    """A copy of a tiny DeepSeek-V3 checkpoint with a multi-token-prediction layer, as DeepSeek publishes them: its
    tensors under model.layers.{num_hidden_layers} and num_nextn_predict_layers=1."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    tensors = load_file(out / "model.safetensors")
    h = cfg["hidden_size"]
    tensors.update({"model.layers.2.enorm.weight": torch.ones(h), "model.layers.2.hnorm.weight": torch.ones(h),
                    "model.layers.2.eh_proj.weight": torch.ones(h, 2 * h)})
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _reshard_through_ep2(parity_models, model_type, mcore, tmp_path):
    resaved, back2 = tmp_path / "mcore_ep2", tmp_path / "hf2"
    report = _parity(run_torchrun("model_parity.py", 4, "--tp", "1", "--pp", "2", "--ep", "2", "--workdir",
                                  str(parity_models), "--models", model_type, "--mcore-ckpt", str(mcore),
                                  "--save-ckpt", str(resaved), timeout=600))
    assert report[model_type]["logits_max_abs"] < 1e-5
    run_captured([sys.executable, str(ROOT / "tools" / "convert_mcore_to_hf.py"), "--mcore-path", str(resaved),
                 "--output", str(back2)], env=dict(os.environ), timeout=300, check=True)
    return back2


def test_convert_roundtrip_and_reshard(parity_models, tmp_path):
    src = parity_models / "qwen2"
    mcore = tmp_path / "mcore"
    back = tmp_path / "hf"
    tools = ROOT / "tools"
    run_captured([sys.executable, str(tools / "convert_hf_to_mcore.py"), "--hf-path", str(src), "--output",
                 str(mcore), "--tp", "2", "--pp", "2"], env=dict(os.environ), timeout=300, check=True)
    run_captured([sys.executable, str(tools / "convert_mcore_to_hf.py"), "--mcore-path", str(mcore),
                 "--output", str(back)], env=dict(os.environ), timeout=300, check=True)
    a, b = HFCheckpointReader(src), HFCheckpointReader(back)
    assert a.keys() == b.keys()
    for name in a.keys():
        assert torch.equal(a.get(name), b.get(name)), name  # bit-exact
    # the converted checkpoint loads at other layouts and gives HF's logits
    for tp, pp in (("1", "1"), ("2", "1"), ("1", "2")):
        report = _parity(run_torchrun("model_parity.py", 2, "--tp", tp, "--pp", pp, "--workdir", str(parity_models),
                                      "--models", "qwen2", "--mcore-ckpt", str(mcore), timeout=300))
        assert report["qwen2"]["logits_max_abs"] < 1e-5


def test_converter_errors_leave_no_output(parity_models, tmp_path):
    out = tmp_path / "out"
    r = run_captured([sys.executable, str(ROOT / "tools" / "convert_hf_to_mcore.py"), "--hf-path",
                     str(parity_models / "qwen2"), "--output", str(out), "--tp", "3"], env=dict(os.environ),
                     timeout=300)
    assert r.returncode == 2
    assert "parallel.tp=3 must divide num_attention_heads=4" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))
    r = run_captured([sys.executable, str(ROOT / "tools" / "convert_hf_to_mcore.py"), "--hf-path",
                     str(parity_models / "qwen3_moe"), "--output", str(out), "--ep", "3"], env=dict(os.environ),
                     timeout=300)
    assert r.returncode == 2 and "parallel.ep=3 does not divide the model's 8 experts" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()
    r = run_captured([sys.executable, str(ROOT / "tools" / "convert_mcore_to_hf.py"), "--mcore-path",
                     str(parity_models / "qwen2"), "--output", str(out)], env=dict(os.environ), timeout=300)
    assert r.returncode == 2 and "verl_mega_model.json is missing" in r.stderr
    assert not out.exists()
