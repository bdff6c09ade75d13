"""The main job's console, as a user sees it (CPU, 3 steps): our lines only by default; everything with
logging.verbose=true."""

import os
import sys
from pathlib import Path

from torchrun_util import run_in_session

ROOT = Path(__file__).resolve().parents[2]

# third-party output a default run must not print (each was seen in the quickstart's console before)
NOISE = ("Params for bucket",  # Megatron's gradient-bucket parameter listing
         "Setting up optimizer with config",  # Megatron's optimizer-config dump
         "Successfully reset prefix cache",  # vLLM INFO between every two steps
         "Tokenizer not available when `skip_tokenizer_init=True`",  # vLLM's handled chat-template warmup
         "Traceback",
         "`torch_dtype` is deprecated",  # transformers
         "Converting a tensor with requires_grad=True to a scalar",
         "Loading weights:", "Writing model shards", "Loading safetensors checkpoint shards")  # progress bars


def _run(tmp_path: Path, name: str, *overrides: str) -> tuple[str, Path]:
    out = tmp_path / name
    env = {**os.environ, "VERL_MEGA_CACHE": str(tmp_path / f"cache-{name}")}  # a fresh tiny model: its warm start
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", str(ROOT / "configs" / "quickstart_cpu.yaml"),
           f"trainer.output_dir={out}", "trainer.total_steps=3", "model.tiny_warmstart_steps=3", *overrides]
    log = tmp_path / f"{name}.log"
    rc = run_in_session(cmd, env=env, log=log, timeout=600, cwd=ROOT)
    text = log.read_text()
    assert rc == 0, text[-5000:]
    return text, out


def test_default_console_is_quiet_and_ends_with_a_summary(tmp_path):
    text, out = _run(tmp_path, "quiet")
    lines = text.splitlines()
    for noise in NOISE:
        assert noise not in text, f"{noise!r} in the console:\n{text[-4000:]}"
    assert not [line for line in lines if " vllm" in line or " megatron" in line], text
    assert sum("warm-started it for 3 steps" in line for line in lines) == 1, text  # the warm start: one line
    assert [line.split(" |")[0] for line in lines if line.startswith("step ")] == ["step 1/3", "step 2/3", "step 3/3"]
    summary = (out / "summary.txt").read_text()
    assert summary in text  # printed and written
    assert "steps       3 (3 logged)" in summary and "reward/mean first " in summary
    assert f"checkpoint  {out / 'checkpoints' / 'step_000003'}" in summary
    assert f"metrics     {out / 'metrics.jsonl'}" in summary and f"curves      {out / 'curves.png'}" in summary


def test_verbose_console_shows_third_party_lines(tmp_path):
    text, _ = _run(tmp_path, "verbose", "logging.verbose=true")
    for line in ("Params for bucket", "Setting up optimizer with config", "Successfully reset prefix cache"):
        assert line in text, f"{line!r} missing with logging.verbose=true"


def test_the_console_is_quiet_from_the_first_import(tmp_path):
    """A process of its own (not the tests' fork server, which has imported Megatron already): the console is set
    before the job's modules are imported, so Megatron's import-time INFO lines do not show. The run stops at its
    output-directory check, after those imports."""
    out = "/proc/verl_mega_console_check"  # not writable: the build stops there
    cmd = [sys.executable, "-m", "verl_mega.train", "--config", str(ROOT / "configs" / "quickstart_cpu.yaml"),
           f"trainer.output_dir={out}"]
    log = tmp_path / "console.log"
    rc = run_in_session(cmd, env=dict(os.environ), log=log, timeout=300, cwd=ROOT, real=True)
    lines = log.read_text().splitlines()
    assert rc == 2 and lines[-1].startswith(f"error: trainer.output_dir='{out}' is not writable"), lines
    assert not [line for line in lines if " megatron" in line or " vllm" in line], lines
