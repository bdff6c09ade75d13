"""LoRA on one GPU: a quick run of benchmarks/bench_lora_gpu.py (Qwen2.5-7B architecture cut to 4 layers, random
bf16): LoRA trains a small fraction of the parameters, peaks lower than full fine-tuning, and the in-place sync of
its merged weights moves the same bytes as full fine-tuning's (the full numbers: the benchmark on all 28 layers, in
BENCHMARKS.md once run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.timeout(1200)
def test_lora_vs_full_quick(tmp_path):
    out = tmp_path / "lora.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lora_gpu.py"), "--layers", "4", "--seq-len",
                    "1024", "--steps", "2", "--sync-repeats", "2", "--out", str(out)], check=True, timeout=1100,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    full, lora = json.loads(out.read_text())["rows"]
    print(json.dumps([full, lora], indent=1))
    assert (full["mode"], lora["mode"]) == ("full", "lora")
    assert lora["trainable_params"] < 0.02 * full["trainable_params"]
    assert lora["train_peak_gib"] < full["train_peak_gib"]
    assert lora["sync_bytes_received"] == full["sync_bytes_received"]
