"""A run whose model and data are hub IDs, resolved offline from a Hugging Face cache in the hub's own layout by two
ranks of one node, is the run of the same files given as local paths, step for step."""

from __future__ import annotations

from pathlib import Path

import pytest
from runs import QUIET, train

import hub_cache
from verl_mega.data.arithmetic import generate_arithmetic

pytestmark = pytest.mark.slow

TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _deterministic(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing/", "perf/", "overlap/", "weight_sync/seconds"))}


def test_hub_ids_run_as_the_local_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from verl_mega.models.tiny import make_tiny_hf_model

    model, data, template = tmp_path / "model", tmp_path / "train.parquet", tmp_path / "template.jinja"
    make_tiny_hf_model(model, seed=0)
    rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": r["prompt"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r["answer"]}, "extra_info": {"index": i}}
            for i, r in enumerate(generate_arithmetic(64, seed=0, ops="+", max_operand=4))]
    pq.write_table(pa.Table.from_pylist(rows), data)
    template.write_text(TEMPLATE)
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    hub_cache.add_dir(cache, "Org/Tiny", model)
    hub_cache.add_repo(cache, "Org/Sums", {"data/train-00000-of-00001.parquet": data}, repo_type="dataset")

    common = [*QUIET, "trainer.total_steps=2", f"model.chat_template={template}", "reward.function=arithmetic",
              "rollout.max_response_length=6"]
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    local = train(tmp_path / "local", "quickstart_cpu.yaml",
                  [*common, f"model.path={model}", f"data.train_files=[{data}]"], nproc=2, env=env, timeout=600)
    hub = train(tmp_path / "hub", "quickstart_cpu.yaml",
                [*common, "model.path=Org/Tiny", "data.train_files=[Org/Sums]"], nproc=2, env=env, timeout=600)
    assert [r["step"] for r in hub] == [1, 2]
    assert [_deterministic(r) for r in hub] == [_deterministic(r) for r in local]
    # both ranks went through the node's lock: the record of the last resolution is there
    assert Path(cache / ".locks" / "models--Org--Tiny" / "verl_mega.lock").read_text().startswith('{"spec"')
