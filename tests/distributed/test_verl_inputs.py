"""A verl user's files, as they are, on the quickstart: a parquet written the way verl's
examples/data_preprocess/gsm8k.py writes its rows (data_source, prompt as chat messages, ability,
reward_model.ground_truth, extra_info), holding the quickstart's addition prompts, and a reward file with verl's
compute_score(data_source, solution_str, ground_truth, extra_info=None) returning a dict. Only their paths are given
(plus the tiny model's task and a chat template, which the bundled character tokenizer does not ship).

The run must be the quickstart's run: the prompts are the quickstart's token for token (all 1024 of them, so every
batch of all 150 steps is the same), the reward function agrees with the built-in one, and the first 10 steps (the
README bar's first window) log exactly the quickstart's values. The quickstart run itself (quickstart_run) is held
to the bar (first 10 steps < 0.3, last 10 > 0.6) in test_quickstart.py; a 10-step run is what this test adds."""

from __future__ import annotations

import random
import textwrap

import pytest
from runs import CONFIGS, QUIET, metric_rows, train

from verl_mega.data.arithmetic import generate_arithmetic

pytestmark = pytest.mark.slow

STEPS = 10
# the quickstart's tiny model gets the template a base model has: the messages' contents, nothing added
TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
REWARD = textwrap.dedent('''
    import re


    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        """verl's contract: called by keyword; a dict return is logged as reward/<key> beside the score."""
        match = re.search(r"-?\\d+", solution_str)
        correct = match is not None and int(match.group()) == int(ground_truth)
        return {"score": 1.0 if correct else 0.0, "acc": correct,
                "from_train_split": (extra_info or {}).get("split") == "train",
                "arithmetic": data_source == "arithmetic"}
''')


def write_verl_parquet(path, records) -> None:
    """The rows of verl's gsm8k.py (its process_fn), with the quickstart's prompts; written with pyarrow, which is
    what datasets' to_parquet uses."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r["answer"]},
             "extra_info": {"split": "train", "index": idx, "answer": r["answer"], "question": r["prompt"]}}
            for idx, r in enumerate(records)]
    pq.write_table(pa.Table.from_pylist(rows), path)


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/", "overlap/", "weight_sync/seconds"))}


def test_a_verl_parquet_and_reward_file_run_the_quickstart(quickstart_run, tmp_path, monkeypatch):
    from verl_mega.config import load_config
    from verl_mega.data.prompts import PromptDataset
    from verl_mega.rewards import load_reward_fn
    from verl_mega.trainer.setup import load_tokenizer, resolve_model_path

    cfg = load_config(CONFIGS / "quickstart_cpu.yaml", check_paths=False)
    records = generate_arithmetic(1024, seed=cfg.trainer.seed, ops="+", max_operand=4)  # generated:addition_small
    data, reward, template = tmp_path / "train.parquet", tmp_path / "arith_reward.py", tmp_path / "template.jinja"
    write_verl_parquet(data, records)
    reward.write_text(REWARD)
    template.write_text(TEMPLATE)
    overrides = [f"data.train_files=[{data}]", f"reward.function={reward}", "model.tiny_task=addition_small",
                 f"model.chat_template={template}"]

    # the prompts: the quickstart's, token for token, through the chat template (all 1024: every step's batch)
    cache = quickstart_run.parent / "cache"  # the quickstart's tiny model (tests/distributed/runs.py)
    monkeypatch.setenv("VERL_MEGA_CACHE", str(cache))
    model = resolve_model_path(cfg)
    tokenizer = load_tokenizer(model, chat_template=str(template))
    verl_set = PromptDataset.from_files(str(data), tokenizer, max_prompt_length=64)
    ours = PromptDataset.from_files(["generated:addition_small"], load_tokenizer(model), max_prompt_length=64,
                                    generated_seed=cfg.trainer.seed)
    assert [(a.prompt_ids, a.ground_truth) for a in verl_set] == [(b.prompt_ids, b.ground_truth) for b in ours]
    assert verl_set[0].prompt_text == records[0]["prompt"]  # rendered through the template
    # the reward: verl's contract, agreeing with the built-in on edge cases and random responses
    fn, builtin = load_reward_fn(str(reward)), load_reward_fn("arithmetic")
    assert fn.contract == "verl"
    rng = random.Random(0)
    responses = ["7", "07", "-7", "7 8", " 7", "x", "", "12", "3+4=7"] + [
        "".join(rng.choice("0123456789 -+=ab") for _ in range(rng.randint(0, 6))) for _ in range(2000)]
    truths = [rng.choice(["7", "0", "12", "3"]) for _ in responses]
    assert fn.score_batch(responses, truths, [{"data_source": "arithmetic"}] * len(responses)) == \
        builtin.score_batch(responses, truths)

    rows = train(tmp_path / "out", "quickstart_cpu.yaml", [*QUIET, f"trainer.total_steps={STEPS}", *overrides],
                 env={"VERL_MEGA_CACHE": str(cache)}, timeout=600)
    reference = metric_rows(quickstart_run)[:STEPS]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for mine, theirs in zip(rows, reference):
        # the dict's other values, logged as reward/<key> means: data_source and extra_info reached the function
        extra = {k: mine.pop(k) for k in ("reward/acc", "reward/from_train_split", "reward/arithmetic")}
        assert extra == {"reward/acc": mine["reward/mean"], "reward/from_train_split": 1.0, "reward/arithmetic": 1.0}
        compared = _deterministic(mine)
        assert len(compared) > 35 and compared == _deterministic(theirs), mine["step"]
    first = sum(r["reward/mean"] for r in rows) / STEPS
    print(f"verl inputs: mean reward over steps 1-{STEPS} {first:.3f}, the quickstart's exactly")
    assert first < 0.3
