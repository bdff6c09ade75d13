"""Hub model and dataset IDs where a config names a path: parsed, checked offline at config time, resolved through a
Hugging Face cache written in the hub's own layout (tests/hub_cache.py), one process of a node at a time, with
one-line errors when nothing is cached or the hub cannot be reached."""

from __future__ import annotations

import fcntl
import json
import socket
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import hub_cache
from verl_mega.config import ConfigError, load_config
from verl_mega.config import hub
from verl_mega.data.records import load_prompt_records

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart_cpu.yaml"



def _parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _verl_rows(tag: str, n: int = 2) -> list[dict]:
    return [{"data_source": tag, "prompt": [{"role": "user", "content": f"{tag} question {i}"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}
            for i in range(n)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from verl_mega.models.tiny import make_tiny_hf_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    make_tiny_hf_model(out, seed=0)
    return out


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache of this test's own, offline."""
    return hub_cache.offline_cache(tmp_path, monkeypatch)


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_what_is_a_hub_id(tmp_path, monkeypatch):
    ref = hub.parse_model("Qwen/Qwen2.5-7B-Instruct")
    assert (ref.repo_id, ref.revision, ref.repo_type) == ("Qwen/Qwen2.5-7B-Instruct", None, "model")
    assert hub.parse_model("meta-llama/Llama-2-7b-chat-hf@v1.0").revision == "v1.0"
    assert hub.parse_model("Org/Name@refs/pr/3").revision == "refs/pr/3"
    for local in ("/models/Qwen2.5-7B-Instruct", "./Org/Name", "~/models/x", "tiny", "a/b/c", "Org/Na me", "Org--x/y"):
        assert hub.parse_model(local) is None, local
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    assert hub.parse_model("Org/Name") is None  # a directory that exists is a local path

    ref = hub.parse_dataset("openai/gsm8k@abc:main:test")
    assert (ref.repo_id, ref.revision, ref.config, ref.split) == ("openai/gsm8k", "abc", "main", "test")
    ref = hub.parse_dataset("openai/gsm8k:test")
    assert (ref.config, ref.split, ref.repo_type) == (None, "test", "dataset")
    for local in ("data/train.parquet", "gsm8k/test.jsonl", "x/y.json", "generated:arithmetic", "/data/x"):
        assert hub.parse_dataset(local) is None, local


def test_offline_model_resolves_from_the_cache(cache, tiny_model):
    snapshot = hub_cache.add_dir(cache, "Org/Tiny", tiny_model)
    cfg = load_config(QUICKSTART, ["model.path=Org/Tiny"])  # the config check finds it in the cache
    assert (cfg.model.path, cfg.model.tokenizer_path) == ("Org/Tiny", "Org/Tiny")
    resolved = hub.resolve_config(cfg)
    assert resolved.model.path == resolved.model.tokenizer_path == str(snapshot)
    assert resolved.critic.model_path == "Org/Tiny"  # GRPO: no critic, nothing of it fetched
    gae = hub.resolve_config(load_config(QUICKSTART, ["model.path=Org/Tiny", "algorithm.adv_estimator=gae"]))
    assert gae.critic.enable and gae.critic.model_path == gae.model.path == str(snapshot)  # null → model.path
    message = _error(hub.resolve_config, load_config(QUICKSTART, ["model.path=Org/Tiny", "algorithm.adv_estimator=gae",
                                                                  "critic.model_path=Org/Critic"], check_paths=False))
    assert message.startswith("critic.model_path='Org/Critic': HF_HUB_OFFLINE=1 and the Hugging Face cache ")
    assert resolved.data == cfg.data and resolved.actor == cfg.actor  # nothing else changes
    plain = load_config(QUICKSTART, [])
    assert hub.resolve_config(plain) is plain  # no hub ID: the same object
    assert (Path(resolved.model.path) / "model.safetensors").is_file()


def test_revisions(cache, tiny_model, tmp_path):
    main = hub_cache.add_dir(cache, "Org/Tiny", tiny_model)
    other = tmp_path / "other"
    other.mkdir()
    for f in tiny_model.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    (other / "README.md").write_text("v2\n")
    v2 = hub_cache.add_dir(cache, "Org/Tiny", other, refs=("v2",))
    assert main != v2
    assert hub.resolve_model("model.path", "Org/Tiny") == str(main)
    assert hub.resolve_model("model.path", "Org/Tiny@v2") == str(v2)
    assert hub.resolve_model("model.path", f"Org/Tiny@{v2.name}") == str(v2)  # a commit hash
    message = _error(hub.resolve_model, "model.path", "Org/Tiny@v3")
    assert message.startswith("model.path='Org/Tiny@v3': HF_HUB_OFFLINE=1 and the Hugging Face cache ")
    assert "model Org/Tiny at revision 'v3'" in message


def test_offline_without_a_copy_is_one_line(cache):
    message = _error(load_config, QUICKSTART, ["model.path=Org/Missing"])
    assert message == (f"model.path='Org/Missing': HF_HUB_OFFLINE=1 and the Hugging Face cache {cache} has no copy "
                       f"of the model Org/Missing; set HF_HUB_OFFLINE=0 to download it, give a local path instead, "
                       f"or check the name")
    message = _error(load_config, QUICKSTART, ["data.train_files=[Org/NoData]", "reward.function=gsm8k"])
    assert message.startswith("data.train_files[0]='Org/NoData': HF_HUB_OFFLINE=1 and the Hugging Face cache ")
    assert "dataset Org/NoData" in message and "give local parquet/JSON/JSONL files instead" in message
    message = _error(load_config, QUICKSTART, ["model.path=/nope/model"])
    assert message == ("model.path='/nope/model' does not exist; set model.path to a Hugging Face model directory, "
                       "a hub ID (ORG/NAME) or tiny")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub(cache, tiny_model, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    load_config(QUICKSTART, ["model.path=Org/Missing"])  # online, the config check leaves the fetch to the job
    message = _error(hub.resolve_model, "model.path", "Org/Missing")
    assert message == (f"model.path='Org/Missing': the Hugging Face hub cannot be reached and the cache {cache} has "
                       f"no copy of the model Org/Missing; check the connection (and HF_ENDPOINT), give a local path "
                       f"instead, or check the name")
    snapshot = hub_cache.add_dir(cache, "Org/Tiny", tiny_model)
    assert hub.resolve_model("model.path", "Org/Tiny") == str(snapshot)  # what is cached still resolves


def test_hub_datasets(cache, tmp_path):
    src = tmp_path / "src"
    gsm8k = {"README.md": hub_cache.GSM8K_CARD}
    for config in ("main", "socratic"):
        for split in ("train", "test"):
            rel = f"{config}/{split}-00000-of-00001.parquet"
            gsm8k[rel] = _parquet(src / rel, _verl_rows(f"{config}-{split}"))
    snap = hub_cache.add_repo(cache, "openai/gsm8k", gsm8k, repo_type="dataset")
    assert hub.resolve_dataset("data.train_files[0]", "openai/gsm8k:main:train") == \
        [str(snap / "main/train-00000-of-00001.parquet")]
    assert hub.resolve_dataset("data.train_files[0]", "openai/gsm8k:socratic") == \
        [str(snap / "socratic/train-00000-of-00001.parquet")]  # ORG/NAME:CONFIG, the key's split
    assert hub.resolve_dataset("data.val_files[0]", "openai/gsm8k:main") == \
        [str(snap / "main/test-00000-of-00001.parquet")]
    assert _error(hub.resolve_dataset, "data.train_files[0]", "openai/gsm8k") == (
        "data.train_files[0]='openai/gsm8k': the dataset openai/gsm8k has configurations main, socratic; name one, "
        "e.g. openai/gsm8k:main:train")
    assert "no configuration 'nope' (it has main, socratic)" in \
        _error(hub.resolve_dataset, "data.train_files[0]", "openai/gsm8k:nope:train")
    assert _error(hub.resolve_dataset, "data.train_files[0]", "openai/gsm8k:main:dev") == (
        "data.train_files[0]='openai/gsm8k:main:dev': the dataset openai/gsm8k (configuration main) has no "
        "parquet/JSON/JSONL files for the split 'dev' (its splits: test, train); name a split (openai/gsm8k:SPLIT) "
        "or give local files")

    # no card: the splits come from the file names, as `datasets` infers them; a file with no split name is train
    split_files = {rel: _parquet(src / "s" / rel, _verl_rows(rel)) for rel in
                   ("data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet", "data/test.parquet")}
    snap = hub_cache.add_repo(cache, "Org/Split", split_files, repo_type="dataset")
    assert hub.resolve_dataset("data.train_files[0]", "Org/Split") == \
        [str(snap / "data/train-00000-of-00002.parquet"), str(snap / "data/train-00001-of-00002.parquet")]
    assert hub.resolve_dataset("data.val_files[0]", "Org/Split") == [str(snap / "data/test.parquet")]
    dapo = {"data/dapo-math-17k.parquet": _parquet(src / "dapo.parquet", _verl_rows("math_dapo"))}
    snap = hub_cache.add_repo(cache, "Org/Dapo", dapo, repo_type="dataset")
    assert hub.resolve_dataset("data.val_files[0]", "Org/Dapo:train") == [str(snap / "data/dapo-math-17k.parquet")]
    assert "split 'test' (its splits: train)" in _error(hub.resolve_dataset, "data.val_files[0]", "Org/Dapo")

    # through the config: the entries become the files, which the data loader reads
    cfg = load_config(QUICKSTART, ["data.train_files=[openai/gsm8k:main:train,Org/Split]",
                                   "data.val_files=[openai/gsm8k:main:test]", "trainer.val_every=1",
                                   "reward.function=gsm8k"])
    resolved = hub.resolve_config(cfg)
    assert len(resolved.data.train_files) == 3 and len(resolved.data.val_files) == 1
    records = load_prompt_records(resolved.data.train_files)
    assert [r.extra["data_source"] for r in records][:2] == ["main-train", "main-train"] and len(records) == 6
    assert records[0].ground_truth == "0"


def _lock_file(cache: Path, repo: str, repo_type: str = "model") -> Path:
    name = f"{repo_type}s--" + repo.replace("/", "--")
    path = cache / ".locks" / name / "verl_mega.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def test_a_waiter_names_the_process_it_waits_for(cache, tiny_model, monkeypatch):
    hub_cache.add_dir(cache, "Org/Tiny", tiny_model)
    monkeypatch.setenv("VERL_MEGA_HUB_WAIT_S", "0.5")
    with open(_lock_file(cache, "Org/Tiny"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("rank 8 (local rank 0), pid 4242 on node7")
        held.flush()
        message = _error(hub.resolve_model, "model.path", "Org/Tiny")
    assert message == (f"model.path='Org/Tiny': waited 0.5 s for rank 8 (local rank 0), pid 4242 on node7, which is "
                       f"fetching Org/Tiny into {cache}; check that process (or the connection), download it first "
                       f"with `hf download Org/Tiny`, or raise VERL_MEGA_HUB_WAIT_S")
    monkeypatch.setenv("VERL_MEGA_HUB_WAIT_S", "soon")
    assert "VERL_MEGA_HUB_WAIT_S='soon' is not a number" in _error(hub.resolve_model, "model.path", "Org/Tiny")


def test_the_node_resolves_one_process_at_a_time(cache, tiny_model, monkeypatch):
    """A waiter resolves only after the holder lets go, then reuses its result without asking the hub again."""
    snapshot = hub_cache.add_dir(cache, "Org/Tiny", tiny_model)
    results: list[str] = []
    with open(_lock_file(cache, "Org/Tiny"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: results.append(hub.resolve_model("model.path", "Org/Tiny")))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not results  # it waits while the lock is held
        # what the holder leaves when done: the record of its fetch
        held.seek(0)
        held.truncate()
        record = {"spec": ["model.path", "Org/Tiny", "model"], "result": str(snapshot), "at": time.time()}
        held.write(json.dumps(record))
        held.flush()
        calls: list[str] = []
        monkeypatch.setattr(hub, "_snapshot", lambda *a, **k: calls.append("hub") or str(snapshot))
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(timeout=30)
    assert results == [str(snapshot)] and calls == []  # the holder's record, no second look-up
    # a record older than this process (an earlier launch) is not trusted: the hub (here the cache) is asked again
    monkeypatch.setattr(hub, "_started", lambda: time.time() + 60)
    assert hub.resolve_model("model.path", "Org/Tiny") == str(snapshot) and calls == ["hub"]


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_converter_takes_a_hub_id(cache, tiny_model, tmp_path, capsys):
    tool = _tool("convert_hf_to_mcore")
    assert tool.main(["--hf-path", "Org/Missing", "--output", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --hf-path='Org/Missing': HF_HUB_OFFLINE=1 and the Hugging Face cache {cache} has no copy "
                   f"of the model Org/Missing; set HF_HUB_OFFLINE=0 to download it, give a local path instead, or "
                   f"check the name\n")
    assert not (tmp_path / "none").exists()
    hub_cache.add_dir(cache, "Org/Tiny", tiny_model)
    assert tool.main(["--hf-path", "Org/Tiny", "--output", str(tmp_path / "mcore")]) == 0
    assert "wrote Megatron dist checkpoint" in capsys.readouterr().out
    assert any((tmp_path / "mcore").iterdir())


def test_from_verl_says_a_hub_id_is_fetched(tmp_path):
    out, report = tmp_path / "recipe.yaml", tmp_path / "report.txt"
    rc = _tool("from_verl").main(["actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct", "-o", str(out),
                                  "--report", str(report)])
    assert rc == 0 and "model:\n  path: Qwen/Qwen2.5-7B-Instruct\n" in out.read_text()
    assert ("model.path='Qwen/Qwen2.5-7B-Instruct' is a Hugging Face hub ID: fetched into the Hugging Face cache "
            "when the job starts") in report.read_text()
    load_config(out, [], check_paths=False)  # and the recipe takes it


def test_the_planner_reads_a_hub_models_config(cache, capsys):
    config = REPO / "tests" / "fixtures" / "hf_configs" / "qwen2.5-7b.json"
    snapshot = hub_cache.add_repo(cache, "Qwen/Qwen2.5-7B-Instruct", {"config.json": config})
    assert hub.resolve_model_config("model.path", "Qwen/Qwen2.5-7B-Instruct") == str(snapshot)
    assert _error(hub.resolve_model, "model.path", "Qwen/Qwen2.5-7B-Instruct") == (
        f"model.path='Qwen/Qwen2.5-7B-Instruct': the cached copy {snapshot} holds no *.safetensors weights (a "
        f"partial copy); set HF_HUB_OFFLINE=0 to fetch the rest, or give a local model directory")
    plan = _tool("plan")
    # the recipe names the hub ID: the planner needs no --model
    assert plan.main(["--config", str(REPO / "configs" / "grpo_qwen2.5_7b.yaml"), "--gpus", "8"]) == 0
    assert "28 layers, h=3584, heads 28/4 kv" in capsys.readouterr().out
    # and the config check's layout check reads the same config.json
    assert _tool("check_config").main([str(REPO / "configs" / "grpo_qwen2.5_7b.yaml"), "--world-size", "8",
                                       "--no-check-paths"]) == 0
    capsys.readouterr()
    assert plan.main(["--model", "Org/Missing", "--gpus", "8"]) == 2
    assert capsys.readouterr().err.startswith("error: --model='Org/Missing': HF_HUB_OFFLINE=1 and the Hugging Face ")


def test_rollout_only_takes_a_hub_id(cache):
    from verl_mega.rollout.quick import rollout_only

    assert _error(rollout_only, "Org/Missing", ["1+1="]).startswith(
        "model_path='Org/Missing': HF_HUB_OFFLINE=1 and the Hugging Face cache ")  # before vLLM starts


def test_a_tokenizer_id_fetches_no_weights_and_a_read_only_cache_reads_offline(cache, tmp_path, monkeypatch):
    tokenizer = {"tokenizer.json": "{}", "tokenizer_config.json": "{}"}
    snapshot = hub_cache.add_repo(cache, "Org/Tok", tokenizer)
    assert hub.resolve_model("model.tokenizer_path", "Org/Tok") == str(snapshot)  # no config.json, no weights asked
    assert _error(hub.resolve_model, "model.path", "Org/Tok") == (
        "model.path='Org/Tok': the hub repository has no config.json at its top level; give the ID of a Hugging Face "
        "transformers model, or a local model directory")
    # a cache where no lock can be made (a read-only one, here `.locks` is a file): offline it is read as it is
    (cache / ".locks").rename(tmp_path / "locks")
    (cache / ".locks").write_text("")
    assert hub.resolve_model("model.tokenizer_path", "Org/Tok") == str(snapshot)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    message = _error(hub.resolve_model, "model.tokenizer_path", "Org/Tok")
    assert message.startswith(f"model.tokenizer_path='Org/Tok': the Hugging Face cache {cache} is not writable (")
    assert message.endswith("point HF_HOME or HF_HUB_CACHE at a writable directory, or set HF_HUB_OFFLINE=1 to read "
                            "it as it is")


@pytest.fixture
def hub_answers(monkeypatch):
    """A local stand-in for the hub's API answering with its error codes: Org/Missing does not exist, Org/Gated is
    gated, Org/Tiny has no revision 'nope'."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, code = ((403, "GatedRepo") if "/Org/Gated" in self.path else
                            (404, "RevisionNotFound") if "/revision/nope" in self.path else (404, "RepoNotFound"))
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()
    thread.join(timeout=10)


def test_what_the_hub_answers_is_one_line(cache, hub_answers):
    assert _error(hub.resolve_model, "model.path", "Org/Missing") == (
        "model.path='Org/Missing': the hub has no model Org/Missing (or it is private: log in with `hf auth login` or "
        "set HF_TOKEN); check the name, or give a local path instead")
    assert _error(hub.resolve_model, "model.path", "Org/Gated") == (
        "model.path='Org/Gated': the model Org/Gated is gated; accept its terms on the hub page and log in (`hf auth "
        "login`, or set HF_TOKEN), or give a local path instead")
    assert _error(hub.resolve_model, "model.path", "Org/Tiny@nope") == (
        "model.path='Org/Tiny@nope': the model Org/Tiny has no revision 'nope'; give a branch, tag or commit it has "
        "(ID@REVISION), or drop @nope")
    assert _error(hub.resolve_dataset, "data.train_files[0]", "Org/Missing") == (
        "data.train_files[0]='Org/Missing': the hub has no dataset Org/Missing (or it is private: log in with `hf auth "
        "login` or set HF_TOKEN); check the name, or give local parquet/JSON/JSONL files instead")


def test_one_process_of_the_node_fetches(cache, monkeypatch):
    """Three processes of a node (local ranks) resolve one model at once from a stand-in hub: each file is
    downloaded once (the .bin copy not at all), the hub is asked for the revision once, and all get one snapshot."""
    import os
    import subprocess
    import sys

    monkeypatch.delenv("HF_HUB_OFFLINE")
    files = {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": bytes(4096), "tokenizer.json": b"{}",
             "pytorch_model.bin": bytes(4096)}
    code = "from verl_mega.config.hub import resolve_model; print(resolve_model('model.path', 'Org/Tiny'))"
    with hub_cache.StandInHub("Org/Tiny", files) as stand_in:
        env = {**os.environ, "HF_ENDPOINT": stand_in.endpoint, "HF_HUB_CACHE": str(cache)}
        procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "RANK": str(i), "LOCAL_RANK": str(i)},
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
                 for i in range(3)]
        outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    assert {out.strip() for out, _ in outs} == {str(cache / "models--Org--Tiny" / "snapshots" / ("c" * 40))}
    assert sorted(stand_in.fetched()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [path for _, path in stand_in.requests if "/revision/" in path] == ["/api/models/Org/Tiny/revision/main"]


def test_a_hub_dataset_fetches_its_card_then_its_split(cache, monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    files = {"README.md": hub_cache.GSM8K_CARD.encode(), ".gitattributes": b"*.parquet filter=lfs\n"}
    for config in ("main", "socratic"):
        for split in ("train", "test"):
            rel = f"{config}/{split}-00000-of-00001.parquet"
            files[rel] = _parquet(tmp_path / rel, _verl_rows(f"{config}-{split}")).read_bytes()
    with hub_cache.StandInHub("openai/gsm8k", files, repo_type="dataset") as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.endpoint)
        found = hub.resolve_dataset("data.val_files[0]", "openai/gsm8k:main")
    snapshot = cache / "datasets--openai--gsm8k" / "snapshots" / ("c" * 40)
    assert found == [str(snapshot / "main" / "test-00000-of-00001.parquet")]
    assert sorted(stand_in.fetched()) == [".gitattributes", "README.md", "main/test-00000-of-00001.parquet"]
    assert [r.extra["data_source"] for r in load_prompt_records(found)] == ["main-test", "main-test"]
