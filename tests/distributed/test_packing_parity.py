"""Packed (THD) micro-batches equal padded ones (log-probs, entropy, critic values, update gradients; float32,
within 1e-5) at tp ∈ {1, 2} (with and without sequence parallelism), pp ∈ {1, 2} and cp = 2 (each sequence of a pack
split into load-balanced chunks), over gloo on 2 ranks."""

import pytest

from torchrun_util import run_torchrun, tagged_report
from verl_mega.models.tiny import make_tiny_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("packing") / "qwen2", model_type="qwen2")


@pytest.mark.parametrize("layout", [("2", "1", "1", False), ("2", "1", "1", True), ("1", "2", "1", False),
                                    ("1", "1", "2", False)], ids=["tp2", "tp2-sp", "pp2", "cp2"])
def test_packed_equals_padded(model, layout):
    tp, pp, cp, sp = layout
    args = ["--tp", tp, "--pp", pp, "--cp", cp, "--model", str(model)] + (["--sp"] if sp else [])
    report = tagged_report(run_torchrun("packing_parity.py", 2, *args, timeout=300), "PACKING")
    assert report["grad_scale"] > 1e-3
    assert max(v for k, v in report.items() if k != "grad_scale") < 1e-5, report
