"""Packed (THD) micro-batches equal padded ones (log-probs, entropy, critic values, update gradients; float32,
within 1e-5) at tp ∈ {1, 2} (with and without sequence parallelism), pp ∈ {1, 2} and cp = 2 (each sequence of a pack
split into load-balanced chunks), over gloo on 2 ranks. Each layout's comparison (jobs/packing_parity.py) runs inside
the model-parity job of the same layout, which test_model_parity.py reads too."""

import pytest
from test_model_parity import PACKING_LAYOUTS, parity_run
from torchrun_util import tagged_report


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp", "pp2", "cp2"])
def test_packed_equals_padded(parity_models, layout, tmp_path_factory):
    report = tagged_report(parity_run(tmp_path_factory, parity_models, 2, *PACKING_LAYOUTS[layout]), "PACKING")
    assert report["grad_scale"] > 1e-3
    assert max(v for k, v in report.items() if k != "grad_scale") < 1e-5, report
