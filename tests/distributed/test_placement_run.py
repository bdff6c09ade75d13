"""The placement on the run path: a 4-rank job whose recorded topology has NVLink pairs (0,2) and (1,3) puts its
TP groups there, and placement.json records every rank's node, device, pool and groups."""

import json
import os
import sys
from pathlib import Path

import pytest

from torchrun_util import run_torchrun

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
from rl_steps import check  # noqa: E402
from test_rl_loop import same_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOPO = ROOT / "tests" / "fixtures" / "topo" / "4gpu_nvlink_pairs_0_2_and_1_3.txt"
SMALL = ["trainer.total_steps=2", "trainer.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false",
         "logging.plot=false", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
         "actor.micro_batch_size_per_gpu=4", "rollout.kv_cache_memory_bytes=33554432"]


@pytest.mark.slow
def test_four_ranks_tp2_on_recorded_topology(tmp_path):
    """Also: with 4 ranks (tp=2 × dp=2), each rank receiving only its rows gives exactly the metrics of the
    gather-everything transport."""
    for transport in ("scatter", "gather"):
        run_torchrun("rl_steps.py", 4, str(ROOT / "configs" / "quickstart_cpu.yaml"), str(tmp_path / transport),
                     "parallel.tp=2", f"parallel.topology_file={TOPO}", f"trainer.sample_transport={transport}",
                     *SMALL, env={"VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))},
                     timeout=900)
    out = tmp_path / "scatter"
    check(str(out), 2, critic=False)
    assert same_results(out, tmp_path / "gather")
    placement = json.loads((out / "placement.json").read_text())
    ranks = placement["ranks"]
    assert placement["world_size"] == 4 and placement["colocated"] and placement["topology"] == str(TOPO)
    assert [p["name"] for p in placement["pools"]] == ["main"] and placement["pools"][0]["dp"] == 2
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3] and {r["node"] for r in ranks} == {0}
    tp_devices = {frozenset(ranks[m]["device"] for m in r["groups"]["tp"]) for r in ranks}
    assert tp_devices == {frozenset({0, 2}), frozenset({1, 3})}  # TP groups on the NVLink pairs
    for r in ranks:
        assert r["pool"] == "main" and r["rank"] in r["groups"]["tp"] and len(r["groups"]["dp"]) == 2
        assert set(r["groups"]) >= {"tp", "pp", "dp", "ep", "gen_tp", "micro_dp"}
        assert r["groups"]["gen_tp"] == r["groups"]["tp"]  # gen_tp = tp: one vLLM engine per TP group
