"""LoRA on one GPU: a quick run of benchmarks/bench_lora_gpu.py (Qwen2.5-7B architecture cut to 4 layers, random
bf16): LoRA trains a small fraction of the parameters and peaks lower than full fine-tuning; the in-place sync of its
merged weights moves the same bytes as full fine-tuning's, and vLLM's own LoRA (model.lora.rollout_sync=adapter) is
fed the adapters' bytes alone (the full numbers: the benchmark on all 28 layers, in BENCHMARKS.md once run)."""

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
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(
                       p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    print(json.dumps(rows, indent=1))
    full, lora, adapter = rows["full"], rows["lora"], rows["adapter"]
    for mode in (lora, adapter):
        assert mode["trainable_params"] < 0.02 * full["trainable_params"]
        assert mode["train_peak_gib"] < full["train_peak_gib"]
        assert mode["generate_tokens_per_s"] > 0
    assert lora["sync_bytes_received"] == full["sync_bytes_received"]  # the merge moves what full FT moves
    assert adapter["sync_bytes_received"] == adapter["sync_adapter_bytes"] < full["model_bytes"] / 50
