"""Every CPU recipe in configs/ runs on a GPU box as it does on CPU: two RL steps each, on one GPU, as written
(float32, trainer.deterministic, model.fused_kernels=auto), and PPO once more with a Qwen2.5-1.5B-architecture model
in bfloat16 (random weights), the case that once crashed in torch inductor's deterministic mode and then asked vLLM
for more memory than the training engines had left. The one-GPU recipe runs with that model and its paths alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (REPO / "configs").glob("*_cpu.yaml"))
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12, num_kv_heads=2,
                 tie_word_embeddings=True, max_position_embeddings=4096)

pytestmark = pytest.mark.gpu


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _processes(recipe: str) -> int:
    """The process count of the recipe's own launch line (its header comment)."""
    header = (REPO / "configs" / recipe).read_text().split("\n\n", 1)[0]
    found = re.search(r"torchrun --nproc-per-node (\d+) -m verl_mega\.train --config configs/" + re.escape(recipe)
                      + r"\s*$", header, re.MULTILINE)
    return int(found.group(1)) if found else 1


def _train(recipe: str, out: Path, *overrides: str, timeout: float = 420) -> list[dict]:
    nproc = _processes(recipe)
    launch = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1
              else [sys.executable])
    cmd = [*launch, "-m", "verl_mega.train", "--config", f"configs/{recipe}", "trainer.total_steps=2",
           f"trainer.output_dir={out}", "trainer.val_every=0", "trainer.save_every=0", *overrides]
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{recipe} {overrides} failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if "step" in r and "actor/pg_loss" in r]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_two_steps_on_a_gpu(recipe, tmp_path):
    need = _processes(recipe)
    if _gpus() < need:
        pytest.skip(f"{recipe} runs {need} processes, one GPU each; this machine has {_gpus()}")
    steps = _train(recipe, tmp_path / "out")
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["actor/pg_loss"] == r["actor/pg_loss"] for r in steps)  # finite, not NaN


@pytest.fixture(scope="module")
def qwen_1_5b(tmp_path_factory) -> Path:
    """A Qwen2.5-1.5B-architecture model with random weights (and the character tokenizer)."""
    if _gpus() < 1:
        pytest.skip("needs a GPU")
    model = tmp_path_factory.mktemp("model") / "qwen2.5-1.5b"
    # built in a process of its own: this one must not keep the model builder's threads alive at exit
    subprocess.run([sys.executable, "-c", "import sys; from verl_mega.models.tiny import make_tiny_hf_model; "
                    f"make_tiny_hf_model(sys.argv[1], **{QWEN_1_5B!r})", str(model)], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
                   timeout=300)
    return model


def test_ppo_recipe_with_a_1_5b_bf16_model(qwen_1_5b, tmp_path):
    steps = _train("ppo_cpu.yaml", tmp_path / "out", f"model.path={qwen_1_5b}", f"model.tokenizer_path={qwen_1_5b}",
                   "model.dtype=bfloat16")
    assert [r["step"] for r in steps] == [1, 2]


def test_the_one_gpu_recipe_runs_with_its_paths_alone(qwen_1_5b, tmp_path):
    """configs/grpo_1gpu.yaml as a user runs it first: GSM8K-format parquet files and a model directory given, nothing
    else (bf16, CUDA graphs, packed sequences, dynamic batching, trainer.deterministic off)."""
    from verl_mega.data.prepare import prepare

    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(3, 19) for b in (2, 5, 7, 11)]
    raw = tmp_path / "gsm8k.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prepare("gsm8k", tmp_path / "data", files={"train": [str(raw)], "test": [str(raw)]})
    steps = _train("grpo_1gpu.yaml", tmp_path / "out", f"model.path={qwen_1_5b}",
                   f"data.train_files=[{tmp_path / 'data' / 'train.parquet'}]",
                   f"data.val_files=[{tmp_path / 'data' / 'test.parquet'}]", timeout=540)
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["actor/ppo_kl"] == 0.0 for r in steps)  # the old log-probs came from the update itself
