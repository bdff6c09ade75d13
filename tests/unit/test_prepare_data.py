"""tools/prepare_data.py: verl-format parquet from GSM8K, MATH, DAPO-Math-17K and AIME, each given as small files
in its hub dataset's layout (a Hugging Face cache written by tests/hub_cache.py, offline), as a local directory or as
local files; the files load as verl's schema and score with the printed built-in reward."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import hub_cache
from verl_mega.data.prepare import DAPO_TEMPLATE, PrepareError, prepare
from verl_mega.data.records import load_prompt_records
from verl_mega.rewards import load_reward_fn

REPO = Path(__file__).resolve().parents[2]

MATH_CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/train-*
  - split: test
    path: data/test-*
- config_name: algebra
  data_files:
  - split: train
    path: algebra/train-*
---
"""


def _parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    return hub_cache.offline_cache(tmp_path, monkeypatch)


def _gsm8k_repo(cache: Path, src: Path) -> Path:
    files: dict[str, object] = {"README.md": hub_cache.GSM8K_CARD}
    questions = {"train": [("Tom has 3 apples and buys 1,231 more. How many?", "3 + 1231 = <<3+1231=1234>>1234\n"
                                                                                 "#### 1,234"),
                           ("What is 2 - 5?", "2 - 5 = -3\n#### -3")],
                 "test": [("Half of 9?", "9 / 2 = 4.5\n#### 4.5")]}
    for config in ("main", "socratic"):
        for split, pairs in questions.items():
            rel = f"{config}/{split}-00000-of-00001.parquet"
            rows = [{"question": q if config == "main" else "S: " + q, "answer": a} for q, a in pairs]
            files[rel] = _parquet(src / rel, rows)
    return hub_cache.add_repo(cache, "openai/gsm8k", files, repo_type="dataset")


def test_gsm8k_from_the_hub_cache(cache, tmp_path):
    _gsm8k_repo(cache, tmp_path / "src")
    written = prepare("gsm8k", tmp_path / "out")
    assert {name: rows for name, (_, rows) in written.items()} == {"train.parquet": 2, "test.parquet": 1}
    train = _rows(tmp_path / "out" / "train.parquet")
    assert train[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": 'Tom has 3 apples and buys 1,231 more. How many? Let\'s think step by '
                                               'step and output the final answer after "####".'}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "1234"},
        "extra_info": {"split": "train", "index": 0, "answer": "3 + 1231 = <<3+1231=1234>>1234\n#### 1,234",
                       "question": "Tom has 3 apples and buys 1,231 more. How many?"},
    }
    assert [r["reward_model"]["ground_truth"] for r in train] == ["1234", "-3"]
    assert [r["extra_info"]["index"] for r in train] == [0, 1]
    test = _rows(tmp_path / "out" / "test.parquet")
    assert test[0]["reward_model"]["ground_truth"] == "4.5" and test[0]["extra_info"]["split"] == "test"
    # the data loader reads it as verl's schema, and the gsm8k reward scores it
    records = load_prompt_records([tmp_path / "out" / "train.parquet"])
    assert [r.ground_truth for r in records] == ["1234", "-3"] and records[0].extra["data_source"] == "openai/gsm8k"
    assert isinstance(records[0].prompt, list)
    reward = load_reward_fn("gsm8k")
    assert reward.score_one("... so #### 1,234", records[0].ground_truth) == 1.0
    assert reward.score_one("... so #### 1233", records[0].ground_truth) == 0.0
    # another configuration
    prepare("gsm8k", tmp_path / "soc", config="socratic")
    assert _rows(tmp_path / "soc" / "train.parquet")[0]["extra_info"]["question"].startswith("S: ")


def test_math_from_the_hub_cache(cache, tmp_path):
    rows = {"train": [{"problem": "What is $1/2$ as a fraction?", "level": "Level 1", "type": "Algebra",
                       "solution": r"It is $\boxed{\frac{1}{2}}$."},
                      {"problem": "Set?", "level": "Level 2", "type": "Algebra",
                       "solution": r"First \boxed{1}, then $\boxed{\{1, 2\}}$."}],
             "test": [{"problem": "x?", "level": "Level 1", "type": "Algebra", "solution": r"$x=\boxed{3}$"}]}
    files: dict[str, object] = {"README.md": MATH_CARD}
    for split, split_rows in rows.items():
        files[f"data/{split}-00000-of-00001.parquet"] = _parquet(tmp_path / "src" / f"{split}.parquet", split_rows)
    files["algebra/train-00000-of-00001.parquet"] = _parquet(tmp_path / "src" / "alg.parquet", rows["test"])
    hub_cache.add_repo(cache, "DigitalLearningGmbH/MATH-lighteval", files, repo_type="dataset")
    prepare("math", tmp_path / "out")
    train = _rows(tmp_path / "out" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in train] == [r"\frac{1}{2}", r"\{1, 2\}"]
    assert train[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert train[0]["prompt"][0]["content"] == ("What is $1/2$ as a fraction? Let's think step by step and output the "
                                                "final answer within \\boxed{}.")
    assert train[0]["extra_info"] == {"split": "train", "index": 0}
    assert len(_rows(tmp_path / "out" / "test.parquet")) == 1
    records = load_prompt_records([tmp_path / "out" / "train.parquet"])
    assert load_reward_fn("math").score_one(r"so $\boxed{\dfrac12}$", records[0].ground_truth) == 1.0
    assert load_reward_fn("by_data_source").score_one(r"\boxed{0.5}", records[0].ground_truth,
                                                      records[0].extra) == 1.0


def _verl_row(source: str, i: int) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=f"p{i}")}],
            "ability": "MATH", "reward_model": {"ground_truth": str(10 + i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{i}"}}


def test_dapo_and_aime_from_the_hub_cache(cache, tmp_path):
    dapo = [_verl_row("math_dapo", i) for i in range(3)]
    hub_cache.add_repo(cache, "BytedTsinghua-SIA/DAPO-Math-17k",
                       {"data/dapo-math-17k.parquet": _parquet(tmp_path / "d.parquet", dapo)}, repo_type="dataset")
    written = prepare("dapo-math", tmp_path / "dapo")
    assert list(written) == ["train.parquet"]
    out = _rows(tmp_path / "dapo" / "train.parquet")
    assert [r["prompt"] for r in out] == [r["prompt"] for r in dapo]
    assert out[1]["reward_model"] == dapo[1]["reward_model"] and out[1]["data_source"] == "math_dapo"
    assert out[1]["extra_info"] == {"split": "train", "index": "id-1"}  # the row's own extra_info kept

    aime = [_verl_row("math_dapo", i) for i in range(2)]
    hub_cache.add_repo(cache, "BytedTsinghua-SIA/AIME-2024",
                       {"data/aime-2024.parquet": _parquet(tmp_path / "a.parquet", aime)}, repo_type="dataset")
    assert list(prepare("aime2024", tmp_path / "aime")) == ["test.parquet"]  # an evaluation set
    records = load_prompt_records([tmp_path / "aime" / "test.parquet"])
    assert [r.ground_truth for r in records] == ["10", "11"]
    assert load_reward_fn("math_dapo").score_one("...\nAnswer: 11", records[1].ground_truth) == 1.0


def test_local_files_and_directories(cache, tmp_path):
    raw = tmp_path / "aime.jsonl"
    raw.write_text("\n".join(json.dumps({"Problem": f"Find {i}.", "Answer": i}) for i in (7, 8)) + "\n")
    prepare("aime2024", tmp_path / "out", files={"train": [str(raw)]})
    rows = _rows(tmp_path / "out" / "test.parquet")
    assert rows[0]["prompt"][0]["content"] == DAPO_TEMPLATE.format(problem="Find 7.")
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "7"} and rows[0]["data_source"] == "aime"
    assert load_reward_fn("by_data_source").score_one("Answer: 8", rows[1]["reward_model"]["ground_truth"],
                                                      {"data_source": rows[1]["data_source"]}) == 1.0
    # a JSON array file under .json, and a local directory in the hub layout (as `hf download --local-dir` keeps it)
    array = tmp_path / "train.json"
    array.write_text(json.dumps([{"question": "1+1?", "answer": "#### 2"}]))
    prepare("gsm8k", tmp_path / "g", files={"train": [str(array)]})
    assert _rows(tmp_path / "g" / "train.parquet")[0]["reward_model"]["ground_truth"] == "2"
    assert not (tmp_path / "g" / "test.parquet").exists()
    snapshot = _gsm8k_repo(cache, tmp_path / "src")
    local = tmp_path / "gsm8k_local"
    local.mkdir()
    for path in snapshot.rglob("*"):
        if path.is_file():
            target = local / path.relative_to(snapshot)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(path.read_bytes())
    prepare("gsm8k", tmp_path / "from_dir", source=str(local))
    assert len(_rows(tmp_path / "from_dir" / "train.parquet")) == 2


def test_errors_are_one_line(cache, tmp_path):
    def error(*args, **kwargs) -> str:
        with pytest.raises(PrepareError) as info:
            prepare(*args, **kwargs)
        assert "\n" not in str(info.value)
        return str(info.value)

    assert error("gsm8k", tmp_path / "o") == (
        f"--source='openai/gsm8k:main:train': HF_HUB_OFFLINE=1 and the Hugging Face cache {cache} has no copy of the "
        f"dataset openai/gsm8k; set HF_HUB_OFFLINE=0 to download it, give local parquet/JSON/JSONL files instead, or "
        f"check the name")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final answer"}) + "\n")
    assert error("gsm8k", tmp_path / "o", files={"train": [str(bad)]}) == (
        f"{bad}:line 1: field 'answer' has no final '#### <number>'; is this GSM8K?")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"text": "q"}) + "\n")
    assert error("math", tmp_path / "o", files={"train": [str(wrong)]}) == (
        f"{wrong}:line 1: no field 'problem' (fields: text); is this the right dataset?")
    assert error("gsm8k", tmp_path / "o", files={"dev": [str(bad)]}) == \
        "--file dev=...: gsm8k has the splits train, test"
    assert "is neither a directory nor a hub dataset ID" in error("gsm8k", tmp_path / "o", source="not an id")
    assert not (tmp_path / "o").exists()  # nothing written


def _tool():
    spec = importlib.util.spec_from_file_location("prepare_data", REPO / "tools" / "prepare_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_line(cache, tmp_path, capsys, monkeypatch):
    _gsm8k_repo(cache, tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    assert _tool().main(["gsm8k"]) == 0
    assert capsys.readouterr().out == ("wrote 2 rows to data/gsm8k/train.parquet\n"
                                       "wrote 1 rows to data/gsm8k/test.parquet\n"
                                       "score them with reward.function=gsm8k\n")
    assert _tool().main(["math", "--output", "m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --source='DigitalLearningGmbH/MATH-lighteval:train': HF_HUB_OFFLINE=1 ")
    assert err.count("\n") == 1
