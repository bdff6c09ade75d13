"""The Python surface: RLTrainer.create(actor=..., actor_backend=vLLMBackend(...)) builds the same job as the CLI."""

import json
import os

import pytest

from torchrun_util import run_torchrun


def test_create_and_step(tmp_path):
    out = tmp_path / "run"
    log = run_torchrun("api_job.py", 1, str(out), timeout=400,
                       env={"VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))})
    res = json.loads((out / "api_metrics.json").read_text())
    rows = res["rows"]
    assert len(rows) == 3 and res["exhausted"]  # total_steps=3 bounds the loader
    for i, r in enumerate(rows, start=1):
        assert r["rollout/weight_version"] == i  # each rollout ran on the weights synced after the last update
        assert r["rollout/logprob_diff_max"] < 1e-4
        assert r["timing/step_s"] > 0 and r["count/flops"] > 0 and r["perf/tflops_per_device"] > 0
        assert "perf/mfu" not in r  # no known peak on CPU: MFU is omitted, not guessed
        # rollout sub-stages from vLLM's request stats, inside the rollout stage
        parts = [r[f"timing/rollout/{p}_s"] for p in ("wake_up", "prefill", "decode", "postprocess", "sleep")]
        assert all(t >= 0 for t in parts) and r["timing/rollout/decode_s"] > 0
        assert sum(parts) <= r["timing/rollout_s"] + 1e-6
        assert r["count/decode_steps"] >= r["rollout/response_length"] - 1  # longest sample − 1 ≥ mean − 1
        assert r["timing/decode_step_ms"] > 0
    assert "overlap efficiency" in log.lower()  # enable_profiling printed the stage tree
    # checkpoints as train.run saves them (trainer.save_every=2, and the last step), complete once close() returned
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (ckpts / "latest").read_text() == "step_000003\n" and (ckpts / "step_000003" / "COMPLETE").exists()
    assert json.loads((ckpts / "step_000003" / "trainer.json").read_text())["step"] == 3


def test_backend_validation():
    from verl_mega import RLTrainer, vLLMBackend

    with pytest.raises(ValueError, match="gen_tp=0"):
        vLLMBackend(gen_tp=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        vLLMBackend(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="differs from actor"):
        RLTrainer.create(actor="tiny", actor_backend=vLLMBackend(model_name="some/other/model"))
    with pytest.raises(TypeError, match="vLLMBackend"):
        RLTrainer.create(actor="tiny", actor_backend="vllm")
