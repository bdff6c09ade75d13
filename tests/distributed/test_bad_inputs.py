"""Bad input through the user-facing CLIs: each case exits non-zero with a one-line `error: …` naming the problem
(and the fix), before anything heavy is built, and leaves no output directory behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_mega.models.tiny import make_tiny_hf_model

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "configs" / "quickstart_cpu.yaml")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    good = make_tiny_hf_model(root / "good", model_type="qwen2")
    # checkpoint variants
    nosafe = root / "no_weights"
    nosafe.mkdir()
    (nosafe / "config.json").write_text((good / "config.json").read_text())
    trunc = root / "truncated"
    trunc.mkdir()
    for f in good.iterdir():
        (trunc / f.name).write_bytes(f.read_bytes())
    data = (good / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 3])
    wrong = root / "wrong_model"
    wrong.mkdir()
    for f in good.iterdir():
        (wrong / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((good / "config.json").read_text())
    cfg_wrong = {k: v for k, v in cfg.items() if k != "layer_types"}
    (wrong / "config.json").write_text(json.dumps({**cfg_wrong, "num_hidden_layers": 4}))
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    # datasets
    (root / "empty.jsonl").write_text("")
    (root / "nofield.jsonl").write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    (root / "wrongtype.jsonl").write_text(json.dumps({"prompt": 5, "answer": "2"}) + "\n")
    (root / "badjson.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n')
    (root / "reward_sig.py").write_text("def score():\n    return 1.0\n")
    (root / "notckpt").mkdir()
    return root


def cases(a: Path) -> list[tuple[list[str], str]]:
    return [
        (["actor.lrr=1e-5"], "did you mean"),
        (["actor.lr"], "actor.lr"),
        (["actor.lr=abc"], "actor.lr"),
        (["actor.lr=-1"], "actor.lr"),
        (["algorithm.adv_estimator=foo"], "algorithm.adv_estimator"),
        (["algorithm.adv_estimator=gae", "critic.enable=false"], "critic"),
        (["algorithm.kl_ctrl.type=adaptive", "algorithm.use_kl_in_reward=true"], "target_kl"),
        (["parallel.tp=2"], "world size"),
        (["rollout.n=0"], "rollout.n"),
        (["data.train_batch_size=7", "actor.ppo_mini_batch_size=2"], "batch"),
        ([f"model.path={a / 'missing'}"], "model.path"),
        ([f"model.path={a / 'no_weights'}"], "safetensors"),
        ([f"model.path={a / 'truncated'}"], "truncated"),
        ([f"model.path={a / 'wrong_model'}"], "do not match"),
        ([f"model.path={a / 'gpt2'}"], "model_type='gpt2' is not supported"),
        ([f"data.train_files=[{a / 'missing.jsonl'}]"], "missing.jsonl"),
        ([f"data.train_files=[{a / 'empty.jsonl'}]"], "empty.jsonl"),
        ([f"data.train_files=[{a / 'nofield.jsonl'}]"], "prompt"),
        ([f"data.train_files=[{a / 'wrongtype.jsonl'}]"], "prompt"),
        ([f"data.train_files=[{a / 'badjson.jsonl'}]"], "badjson.jsonl"),
        (["reward.function=no_such_module.fn"], "no_such_module"),
        ([f"reward.function={a / 'reward_sig.py'}:score"], "score"),
        ([f"trainer.resume={a / 'notckpt'}"], "trainer.resume"),
    ]


def test_bad_inputs_fail_fast_with_one_line(assets, tmp_path):
    env = {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache")),
           "PYTHONWARNINGS": "ignore"}
    failures = []
    all_cases = cases(assets)
    assert len(all_cases) >= 20
    for i, (overrides, needle) in enumerate(all_cases):
        out = tmp_path / f"out{i}"
        proc = subprocess.run([sys.executable, "-m", "verl_mega.train", "--config", RECIPE,
                               f"trainer.output_dir={out}", *overrides],
                              capture_output=True, text=True, env=env, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        ok = (proc.returncode == 2 and len(errors) == 1 and needle.lower() in errors[0].lower()
              and not out.exists())
        if not ok:
            failures.append(f"{overrides}: rc={proc.returncode} errors={errors} exists={out.exists()} "
                            f"tail={proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else ''}")
    assert not failures, "\n".join(failures)
