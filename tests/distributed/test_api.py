"""The Python surface: RLTrainer.create(actor=..., actor_backend=vLLMBackend(...)) builds the same job as the CLI."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

from torchrun_util import run_in_session, run_torchrun

ROOT = Path(__file__).resolve().parents[2]


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


def test_the_docs_example_runs_as_a_script(tmp_path):
    """docs/quickstart.md's Python block, pasted into a script as it is (no ``__main__`` guard) and run with python:
    it runs once (the reward workers do not run it again), writes what the command line writes (metrics.jsonl,
    TensorBoard, curves.png, summary.txt, printed too) and its console is the command line's: no vLLM or Megatron
    INFO lines, no tracebacks, also none at exit."""
    doc = (ROOT / "docs" / "quickstart.md").read_text()
    block = re.search(r"## From Python\n.*?```python\n(.*?)```", doc, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text("import os\nwith open('runs.log', 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n" + block)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}
    env.pop("PYTHONWARNINGS", None)
    log = tmp_path / "console.log"
    rc = run_in_session([sys.executable, str(script)], env=env, log=log, timeout=600, cwd=tmp_path, real=True)
    text = log.read_text(errors="replace")
    assert rc == 0, text[-5000:]
    assert len((tmp_path / "runs.log").read_text().splitlines()) == 1, text[-5000:]
    out = tmp_path / "outputs" / "py"  # the example's trainer.output_dir, relative to where it runs
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and "reward/mean" in rows[0]
    assert (out / "curves.png").stat().st_size > 0 and any((out / "tensorboard").iterdir())
    summary = (out / "summary.txt").read_text()
    assert "steps       1 (1 logged)" in summary and summary in text
    assert "Advantage (GRPO) Computation" in text  # the profile names the recipe's estimator
    assert "Traceback" not in text and "Exception ignored" not in text, text[-5000:]
    assert not [line for line in text.splitlines() if " vllm" in line or " megatron" in line], text[-5000:]
