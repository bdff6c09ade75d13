"""Prompt loading, tokenization with chat templates, filtering, deterministic/resumable DP-sharded batches, and the
arithmetic task generator."""

import json
import logging
import sys

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from verl_mega.data import (
    PromptDataError,
    PromptDataset,
    PromptLoader,
    generate_arithmetic,
    generated_task,
    load_prompt_records,
    write_arithmetic_jsonl,
)
from verl_mega.rewards import load_reward_fn

VOCAB = {"<pad>": 0, "<eos>": 1, "<|user|>": 2, "<|assistant|>": 3, "<|system|>": 4}
for _c in "0123456789+-= abcdefghijklmnopqrstuvwxyz?":
    VOCAB[_c] = len(VOCAB)
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(chat_template: bool) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"])
    if chat_template:
        tok.chat_template = TEMPLATE
    return tok


def char_ids(text):
    return [VOCAB[c] for c in text]


def write_jsonl(path, rows, raw_lines=()):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
        for line in raw_lines:
            f.write(line + "\n")
    return str(path)


# ---------------------------------------------------------------------------------------------------- reading
def test_jsonl_custom_keys_nested_answer_and_extras(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"question": "1+1=", "reward_model": {"ground_truth": "2"}, "data_source": "toy"},
        {"question": "2+2=", "reward_model": {"ground_truth": "4"}, "data_source": "toy"},
    ], raw_lines=["", "   "])
    recs = load_prompt_records(path, prompt_key="question", answer_key="reward_model.ground_truth")
    assert [(r.prompt, r.ground_truth) for r in recs] == [("1+1=", "2"), ("2+2=", "4")]
    assert recs[0].extra == {"reward_model": {"ground_truth": "2"}, "data_source": "toy"}
    assert recs[1].source.endswith("d.jsonl:line 2")


def test_plain_prompts_without_template(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "3+4=", "answer": "7"}])
    ds = PromptDataset.from_files(path, make_tokenizer(False), max_prompt_length=8)
    assert ds[0].prompt_ids == char_ids("3+4=") and ds[0].prompt_text == "3+4=" and ds[0].ground_truth == "7"


def test_chat_template_applied_to_strings_and_message_lists(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "3+4=", "answer": "7"},
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "5-2="}], "answer": 3},
    ])
    ds = PromptDataset.from_files(path, make_tokenizer(True), max_prompt_length=64)
    assert ds[0].prompt_ids == [VOCAB["<|user|>"]] + char_ids("3+4=") + [VOCAB["<|assistant|>"]]
    assert ds[1].prompt_text == "<|system|>be brief<|user|>5-2=<|assistant|>"
    assert ds[1].prompt_ids == ([VOCAB["<|system|>"]] + char_ids("be brief") + [VOCAB["<|user|>"]] + char_ids("5-2=")
                                + [VOCAB["<|assistant|>"]])
    # with the template switched off, plain strings are tokenized as they are
    plain = PromptDataset(load_prompt_records(path)[:1], make_tokenizer(True), max_prompt_length=64,
                          apply_chat_template=False)
    assert plain[0].prompt_ids == char_ids("3+4=")


def test_parquet_and_json_array(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"prompt": [{"role": "user", "content": "1+2="}], "answer": "3", "data_source": "p"},
            {"prompt": [{"role": "user", "content": "9-9="}], "answer": "0", "data_source": "p"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    ds = PromptDataset.from_files(str(tmp_path / "d.parquet"), make_tokenizer(True), max_prompt_length=16)
    assert [it.ground_truth for it in ds] == ["3", "0"]
    assert ds[1].prompt_ids == [VOCAB["<|user|>"]] + char_ids("9-9=") + [VOCAB["<|assistant|>"]]
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "4+4=", "answer": "8"}]))
    recs = load_prompt_records([str(tmp_path / "d.json"), str(tmp_path / "d.parquet")])
    assert [r.ground_truth for r in recs] == ["8", "3", "0"]


def test_overlong_prompts_filtered_and_logged(tmp_path, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12+34=", "answer": "46"},
                                              {"prompt": "1+1=", "answer": "2"}])
    with caplog.at_level(logging.WARNING, logger="verl_mega.data"):
        ds = PromptDataset.from_files(path, make_tokenizer(False), max_prompt_length=4)
    assert [it.prompt_text for it in ds] == ["3+4=", "1+1="] and [it.index for it in ds] == [0, 1]
    assert ds.num_filtered == 1
    assert "filtered 1 of 3 prompts longer than max_prompt_length=4" in caplog.text
    with pytest.raises(PromptDataError, match="all 3 prompts are longer"):
        PromptDataset.from_files(path, make_tokenizer(False), max_prompt_length=3)


def _err(tmp_path, name, content, **kw):
    p = tmp_path / name
    p.write_text(content)
    with pytest.raises(PromptDataError) as info:
        load_prompt_records(str(p), **kw)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_bad_input_errors_name_file_line_field_and_fix(tmp_path):
    assert "not found" in str(pytest.raises(PromptDataError, load_prompt_records, str(tmp_path / "nope.jsonl")).value)
    assert "is empty" in _err(tmp_path, "e.jsonl", "\n\n")
    msg = _err(tmp_path, "j.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": oops}\n')
    assert "j.jsonl:line 2: invalid JSON" in msg
    assert "j.jsonl:line 1: expected a JSON object, got list" in _err(tmp_path, "j.jsonl", "[1, 2]\n")
    msg = _err(tmp_path, "m.jsonl", '{"question": "a", "answer": "1"}\n')
    assert "m.jsonl:line 1: missing field 'prompt' (fields: answer, question); set prompt_key" in msg
    msg = _err(tmp_path, "t.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": 5, "answer": "1"}\n')
    assert "t.jsonl:line 2: field 'prompt' must be a string or" in msg and "got int" in msg
    assert "must be a string" in _err(tmp_path, "t.jsonl", '{"prompt": [{"role": "user"}], "answer": "1"}\n')
    assert "missing field 'solution'" in _err(tmp_path, "a.jsonl", '{"prompt": "a", "answer": "1"}\n',
                                              answer_key="solution")
    assert "extension '.csv'" in _err(tmp_path, "x.csv", "prompt,answer\n")
    assert "expected a list of objects" in _err(tmp_path, "x.json", '{"prompt": "a"}')
    msg = _err(tmp_path, "n.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": null}\n')
    assert "n.jsonl:line 2: field 'answer' is null, so every response would score 0" in msg


def test_bytes_that_are_not_utf8_name_file_line_and_column(tmp_path):
    for name in ("u.jsonl", "u.json"):
        path = tmp_path / name
        body = b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "3"}\n'
        path.write_bytes(b"[" + body.replace(b"}\n{", b"},\n{") + b"]" if name.endswith(".json") else body)
        with pytest.raises(PromptDataError) as info:
            load_prompt_records(str(path))
        assert str(info.value) == f"{path}:line 2: byte 0xe9 at column 16 is not UTF-8; re-save the file as UTF-8"


def test_no_answer_key_and_message_list_needs_template(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}]}])
    recs = load_prompt_records(path, answer_key=None)
    assert recs[0].ground_truth is None
    with pytest.raises(PromptDataError, match="d.jsonl:line 1: the prompt is a chat message list but the tokenizer "
                                              r"has no chat_template; give one with model.chat_template \(inline"):
        PromptDataset(recs, make_tokenizer(False), max_prompt_length=16)


def test_chat_template_modes_and_overlong_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "3+4=", "answer": "7"}, {"prompt": "12+34=", "answer": "46"}])
    recs = load_prompt_records(path)
    with pytest.raises(PromptDataError, match="data.apply_chat_template=true but the tokenizer has no chat_template; "
                                              "give one with model.chat_template"):
        PromptDataset(recs, make_tokenizer(False), max_prompt_length=8, apply_chat_template=True)
    with pytest.raises(PromptDataError, match="d.jsonl:line 2: prompt has 6 tokens > max_prompt_length=5"):
        PromptDataset(recs, make_tokenizer(False), max_prompt_length=5, filter_overlong=False)
    messages = load_prompt_records(write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "1"}],
                                                                       "answer": "1"}]))
    with pytest.raises(PromptDataError, match="m.jsonl:line 1: the prompt is a chat message list but "
                                              "data.apply_chat_template is off; set data.apply_chat_template to auto"):
        PromptDataset(messages, make_tokenizer(True), max_prompt_length=8, apply_chat_template=False)


def test_generated_task_entries(tmp_path):
    ds = PromptDataset.from_files(["generated:arithmetic"], make_tokenizer(False), max_prompt_length=8,
                                  prompt_key="question", answer_key="solution", generated_size=32, generated_seed=5)
    assert [(it.prompt_text, it.ground_truth) for it in ds] == [
        (r["prompt"], r["answer"]) for r in generate_arithmetic(32, seed=5)]
    assert ds[0].extra == {"data_source": "arithmetic"}
    assert generated_task("generated:arithmetic").reward_spec == "arithmetic"
    with pytest.raises(PromptDataError, match="unknown generated task 'sudoku'; available: generated:arithmetic"):
        load_prompt_records("generated:sudoku")


def test_parquet_without_pyarrow_gives_install_hint(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PromptDataError, match="needs pyarrow; install it with `pip install pyarrow`"):
        load_prompt_records(str(tmp_path / "d.parquet"))


# ---------------------------------------------------------------------------------------------------- batching
def _dataset(n):
    return list(range(n))  # the loader only indexes the dataset, so plain ints identify the prompts


def _ids(batches):
    return [b.items for b in batches]


def test_epochs_are_seeded_permutations_and_drop_last():
    loader = PromptLoader(_dataset(10), global_batch_size=3, seed=7, num_epochs=2)
    assert loader.batches_per_epoch == 3 and len(loader) == 6
    batches = list(loader)
    assert len(batches) == 6 and [b.epoch for b in batches] == [0, 0, 0, 1, 1, 1]
    epoch0 = sum(_ids(batches[:3]), [])
    epoch1 = sum(_ids(batches[3:]), [])
    assert len(set(epoch0)) == 9 and set(epoch0) <= set(range(10))  # 9 distinct prompts, the 10th dropped
    assert epoch0 != epoch1
    again = list(PromptLoader(_dataset(10), global_batch_size=3, seed=7, num_epochs=2))
    assert _ids(again) == _ids(batches)
    other = list(PromptLoader(_dataset(10), global_batch_size=3, seed=8, num_epochs=2))
    assert _ids(other) != _ids(batches)
    assert _ids(PromptLoader(_dataset(6), global_batch_size=3, shuffle=False)) == [[0, 1, 2], [3, 4, 5]]
    # the permutation is the one random.shuffle gives a list (the loader shuffles an int64 array in its place)
    import random

    order = list(range(10))
    random.Random("verl_mega-prompts:7:1").shuffle(order)
    assert epoch1 == order[:9]
    assert loader.next_batch() is None and len(loader) == 0


def test_dp_shards_partition_each_global_batch():
    full = list(PromptLoader(_dataset(16), global_batch_size=8, seed=3, num_epochs=2))
    shards = [list(PromptLoader(_dataset(16), global_batch_size=8, seed=3, num_epochs=2, dp_rank=r, dp_size=4))
              for r in range(4)]
    for step, batch in enumerate(full):
        pieces = [shards[r][step].items for r in range(4)]
        assert all(len(p) == 2 for p in pieces)
        assert sum(pieces, []) == batch.items


def test_resume_sees_exactly_the_same_next_batches():
    reference = _ids(PromptLoader(_dataset(10), global_batch_size=2, seed=1, num_epochs=3, dp_rank=1, dp_size=2))
    for stop in (0, 3, 5, 7, 14):  # 5 batches per epoch: includes stopping right at an epoch boundary
        first = PromptLoader(_dataset(10), global_batch_size=2, seed=1, num_epochs=3, dp_rank=1, dp_size=2)
        seen = [first.next_batch().items for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON round trip (checkpoints)
        resumed = PromptLoader(_dataset(10), global_batch_size=2, seed=1, num_epochs=3, dp_rank=1, dp_size=2)
        resumed.load_state_dict(state)
        assert seen + _ids(resumed) == reference, stop
    assert state == {"epoch": 2, "index": 4, "seed": 1, "dataset_size": 10, "global_batch_size": 2}


def test_peek_looks_ahead_without_moving():
    loader = PromptLoader(_dataset(10), global_batch_size=3, seed=7, num_epochs=2)
    loader.next_batch()
    ahead = [loader.peek(k) for k in range(1, 7)]
    assert ahead[-1] is None  # 6 batches in all, one served
    rest = list(loader)
    assert _ids(ahead[:5]) == _ids(rest) and [(b.epoch, b.batch_index) for b in ahead[:5]] == \
        [(b.epoch, b.batch_index) for b in rest]


def test_loader_validation():
    with pytest.raises(PromptDataError, match="not divisible by the data-parallel size 4"):
        PromptLoader(_dataset(10), global_batch_size=6, dp_size=4)
    with pytest.raises(PromptDataError, match="only 3 prompts"):
        PromptLoader(_dataset(3), global_batch_size=4)
    loader = PromptLoader(_dataset(10), global_batch_size=2, seed=1)
    with pytest.raises(PromptDataError, match="seed=2 but this run has 1"):
        loader.load_state_dict({"epoch": 0, "index": 1, "seed": 2})
    with pytest.raises(PromptDataError, match="dataset_size=11"):
        loader.load_state_dict({"epoch": 0, "index": 1, "dataset_size": 11})


# -------------------------------------------------------------------------------------------------- arithmetic
def test_arithmetic_task(tmp_path):
    recs = generate_arithmetic(500, seed=3)
    assert recs == generate_arithmetic(500, seed=3) and recs != generate_arithmetic(500, seed=4)
    for r in recs:
        a, op, b, eq = r["prompt"][0], r["prompt"][1], r["prompt"][2], r["prompt"][3]
        assert len(r["prompt"]) == 4 and eq == "=" and op in "+-" and a.isdigit() and b.isdigit()
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert r["answer"] == str(expected) and 0 <= expected <= 18
    assert {r["prompt"][1] for r in recs} == {"+", "-"}
    assert {int(r["answer"]) for r in generate_arithmetic(2000, ops="+")} == set(range(19))
    path = write_arithmetic_jsonl(tmp_path / "sub" / "train.jsonl", 64, seed=3)
    ds = PromptDataset.from_files(path, make_tokenizer(False), max_prompt_length=8)
    assert len(ds) == 64 and ds.num_filtered == 0 and all(len(it.prompt_ids) == 4 for it in ds)
    reward = load_reward_fn("arithmetic")
    assert reward.score_batch([r["answer"] + " done" for r in recs[:5]], [r["answer"] for r in recs[:5]]) == [1.0] * 5
    with pytest.raises(ValueError, match="max_operand must be in 0..9"):
        generate_arithmetic(3, max_operand=12)


class _DropsWhitespace:
    """A tokenizer without BOS whose pre-tokenizer drops whitespace: a blank prompt encodes to no tokens."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text if not c.isspace()]


def test_a_prompt_without_tokens_is_refused_with_its_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": " \t ", "answer": "0"}])
    with pytest.raises(PromptDataError, match=r"d.jsonl:line 2: prompt ' \\t ' encodes to no tokens \(whitespace "
                                              r"only, or characters outside the tokenizer's vocabulary\)"):
        PromptDataset(load_prompt_records(path), _DropsWhitespace(), max_prompt_length=16)


# ------------------------------------------------------------------------------------------------ verl's schema
def verl_rows(pairs, split="train"):
    """Rows as verl's examples/data_preprocess/gsm8k.py builds them (its process_fn), for prompt/answer pairs."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": split, "index": i, "answer": f"#### {a}", "question": q}}
            for i, (q, a) in enumerate(pairs)]


def test_verl_parquet_needs_only_its_path(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(verl_rows([("3+4=", "7"), ("5-2=", "3")])), path)
    ds = PromptDataset.from_files(str(path), make_tokenizer(True), max_prompt_length=16)
    assert [it.ground_truth for it in ds] == ["7", "3"]
    assert ds[0].prompt_ids == [VOCAB["<|user|>"]] + char_ids("3+4=") + [VOCAB["<|assistant|>"]]
    assert ds[1].extra == {"data_source": "openai/gsm8k", "ability": "math",
                           "reward_model": {"style": "rule", "ground_truth": "3"},
                           "extra_info": {"split": "train", "index": 1, "answer": "#### 3", "question": "5-2="}}
    # the same rows as JSONL, and our own format beside them in one list of files
    ours = write_jsonl(tmp_path / "ours.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    mixed = load_prompt_records([write_jsonl(tmp_path / "v.jsonl", verl_rows([("2+2=", "4")])), ours, str(path)])
    assert [r.ground_truth for r in mixed] == ["4", "2", "7", "3"]


def test_verl_rows_that_do_not_fit_name_file_row_and_field(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = verl_rows([("3+4=", "7"), ("5-2=", "3")])
    rows[1]["reward_model"]["ground_truth"] = None  # a column of a parquet file is null where a row has no value
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(PromptDataError) as info:
        load_prompt_records(str(tmp_path / "t.parquet"))
    assert str(info.value).startswith(f"{tmp_path / 't.parquet'}:row 2: field 'reward_model.ground_truth' is null")
    for field, drop in (("reward_model.ground_truth", lambda r: r["reward_model"].pop("ground_truth")),
                        ("data_source", lambda r: r.pop("data_source")), ("prompt", lambda r: r.pop("prompt"))):
        rows = verl_rows([("3+4=", "7"), ("5-2=", "3"), ("1+1=", "2")])
        drop(rows[2])
        msg = _err(tmp_path, "v.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        assert msg.startswith(f"{tmp_path / 'v.jsonl'}:line 3: missing field '{field}' of verl's dataset schema"), msg
    rows = verl_rows([("3+4=", "7"), ("5-2=", "3")])
    rows[1]["data_source"] = None
    assert _err(tmp_path, "n.jsonl", "".join(json.dumps(r) + "\n" for r in rows)) == (
        f"{tmp_path / 'n.jsonl'}:line 2: field 'data_source' is null; give the row its data source (it picks verl's "
        "reward function) or remove it")


class _Bytes:
    """A fast character tokenizer for the memory bound (HF's Rust tokenizer would dominate the test's time)."""

    chat_template = None

    def __len__(self):
        return 128

    def encode(self, text, add_special_tokens=True):
        return [ord(c) & 127 for c in text]


def test_dataset_memory_is_a_small_multiple_of_the_file(tmp_path):
    """A dataset holds its token ids in one flat array and its records pickled in one flat buffer: about 2x a JSONL
    file of arithmetic prompts with a character tokenizer (each prompt is held as tokens and as text); Python lists
    of token ids and dicts held 9.5x, and loading peaked at 19x (measured on a 20 MB file)."""
    import random
    import tracemalloc

    rng = random.Random(0)
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(14_000):
            q = " ".join(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}" for _ in range(20)) + " = ?"
            f.write(json.dumps({"prompt": q, "answer": str(rng.randint(0, 999)), "data_source": "toy",
                                "extra_info": {"index": i, "split": "train"}}) + "\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        ds = PromptDataset.from_files(str(path), _Bytes(), max_prompt_length=512)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(ds) == 14_000 and ds.nbytes < 2.5 * size, ds.nbytes / size
    assert held < 2.5 * size and peak < 3.5 * size, (held / size, peak / size)
    item = ds[13_999]  # an item is made from the flat storage when asked for
    assert item.index == 13_999 and item.prompt_ids == [ord(c) for c in item.prompt_text]
    assert item.extra == {"data_source": "toy", "extra_info": {"index": 13_999, "split": "train"}}


# ------------------------------------------------------------------------------------- huge rows, cheaply filtered
class _Recording:
    """A tokenizer that records the length of every text it is asked to encode."""

    def __init__(self, tok):
        self.tok, self.lengths = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __len__(self):
        return len(self.tok)

    def __call__(self, texts, **kwargs):
        self.lengths += [len(t) for t in texts]
        return self.tok(texts, **kwargs)

    def encode(self, text, **kwargs):
        self.lengths.append(len(text))
        return self.tok.encode(text, **kwargs)


@pytest.mark.parametrize("chat_template", [False, True])
def test_a_huge_row_is_filtered_without_tokenizing_it_whole(tmp_path, monkeypatch, chat_template):
    """A 5 MB row is decided overlong from its prefix alone; every other row is kept or dropped exactly as when each
    is tokenized whole, also where a row is longer than the character bound but its prefix does not decide it."""
    from verl_mega.data import prompts

    limit = 64
    words = "abc de fgh ij klmno p qr stu vw xyz 12 3+4=".split(" ")
    normal = [" ".join(words[(i + j) % len(words)] for j in range(n)) for i, n in enumerate(range(1, 60, 2))]
    huge = ("lorem ipsum " * 500_000)[:5_000_000]
    rows = [{"prompt": p, "answer": str(i)} for i, p in enumerate(normal[:10] + [huge] + normal[10:])]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = make_tokenizer(chat_template)

    def whole(prompt):  # the reference: the row tokenized whole, as the dataset tokenizes it
        if chat_template:
            return tok(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)["input_ids"]
        return tok(prompt)["input_ids"]

    expected = sorted((r["answer"], whole(r["prompt"])) for r in rows
                      if r["prompt"] is not huge and len(whole(r["prompt"])) <= limit)
    assert 5 <= len(expected) < len(normal)  # rows on both sides of the limit
    recording = _Recording(tok)
    ds = PromptDataset.from_files(path, recording, max_prompt_length=limit)
    assert len(huge) not in recording.lengths and max(recording.lengths) <= limit * prompts._CHARS_PER_TOKEN_BOUND
    assert sorted((item.ground_truth, item.prompt_ids) for item in ds) == expected
    assert ds.num_filtered == len(rows) - len(expected)
    # rows longer than the bound whose prefix does not decide them are tokenized whole (a bound of 1 character a
    # token puts most normal rows past it)
    monkeypatch.setattr(prompts, "_CHARS_PER_TOKEN_BOUND", 1)
    recording = _Recording(tok)
    ds = PromptDataset.from_files(write_jsonl(tmp_path / "n.jsonl", [r for r in rows if r["prompt"] is not huge]),
                                  recording, max_prompt_length=limit)
    assert sorted((item.ground_truth, item.prompt_ids) for item in ds) == expected
    assert len(recording.lengths) > len(rows)  # prefixes and whole rows

    monkeypatch.setattr(prompts, "_CHARS_PER_TOKEN_BOUND", 32)
    with pytest.raises(PromptDataError, match=r"line 2: prompt has \d+ tokens in its first \d+ of \d+ characters > "
                                              r"max_prompt_length=64; raise"):
        PromptDataset.from_files(write_jsonl(tmp_path / "h.jsonl", [rows[0], {"prompt": huge, "answer": "1"}]), tok,
                                 max_prompt_length=limit, filter_overlong=False)
