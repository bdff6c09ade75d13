"""Data-parallel islands on CPU: one 4-rank gloo job (tests/distributed/jobs/dp_islands_job.py) steps the same actor
with flat data-parallel groups and with two islands of two ranks taken from a recorded topology, the step between
the islands in fp32, bf16 and fp8. The job asserts the numbers (reduced gradients within their wire format's
rounding bound of a float64 reference, islands in agreement, parameters as close to the flat mode's as AdamW makes
their gradients, a flat actor resuming the islands' checkpoint exactly); here the bytes it counted are compared with
the planner's communication model, and its placement.json with the islands the scheduler chose."""

import json
from pathlib import Path

import pytest

from torchrun_util import run_torchrun
from verl_mega.planning.dp_sync import dp_sync_traffic

from shared_runs import shared_dir

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path) -> None:
    log = run_torchrun("dp_islands_job.py", 4, str(out), timeout=300, env={"PYTHONPATH": str(ROOT)})
    assert "DP_ISLANDS_OK" in log, log[-3000:]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The one job both tests read (made once per session, whichever worker asks first)."""
    out = shared_dir(tmp_path_factory, "dp-islands", _run)
    return json.loads((out / "report.json").read_text()), json.loads((out / "placement.json").read_text())


@pytest.mark.slow
def test_bytes_between_islands_equal_the_planners_model(job):
    report, _ = job
    modes = {(m["mode"], m["dtype"]): m for m in report["modes"]}
    assert report["islands"] == {"0": 0, "1": 0, "2": 1, "3": 1}  # the two "nodes": ranks {0,1} and {2,3}
    for (mode, dtype), m in modes.items():
        want = dp_sync_traffic(elements=m["grad_elems"], group=4, per_island=2, islands=m["islands"],
                               grad_bytes=m["grad_bytes"], param_bytes=m["param_bytes"], cross_dtype=dtype)
        assert (m["sent_per_gpu"], m["cross_per_gpu"]) == (want.sent_bytes, want.cross_bytes), (mode, dtype)
        assert m["worst_bound_ratio"] <= 1.0 and m["worst_param_ratio"] <= 1.0
    seen = {key: {(kind, tuple(group)) for kind, group in m["collectives_rank0"]} for key, m in modes.items()}
    flat, fp32, bf16, fp8 = (modes[k] for k in (("off", "fp32"), ("island", "fp32"), ("island", "bf16"),
                                                 ("island", "fp8")))
    assert flat["islands"] == 1 and fp32["islands"] == bf16["islands"] == fp8["islands"] == 2
    # flat: the reduce-scatter and the all-gather over all four ranks; islands: both inside an island, and only
    # the shard crosses (fp32: Megatron's all-reduce; bf16/fp8: all-to-all + all-gather of the encoded pieces)
    assert seen["off", "fp32"] == {("all_gather", (0, 1, 2, 3)), ("reduce_scatter", (0, 1, 2, 3))}
    assert seen["island", "fp32"] == {("all_gather", (0, 1)), ("reduce_scatter", (0, 1)), ("all_reduce", (0, 2))}
    for dtype in ("bf16", "fp8"):
        assert seen["island", dtype] == {("all_gather", (0, 1)), ("reduce_scatter", (0, 1)), ("all_to_all", (0, 2)),
                                         ("all_gather", (0, 2))}
    # fp32 params here: the flat mode moves 3/4·8 B, half of it across; fp32 islands 2·(1/2)·4 B/2 of the shard
    n = flat["grad_elems"]
    assert flat["cross_per_gpu"] == 0.75 * 8 * n / 2 and fp32["cross_per_gpu"] == 4 * n / 2
    assert bf16["cross_per_gpu"] == fp32["cross_per_gpu"] / 2 and fp8["cross_per_gpu"] < 0.27 * fp32["cross_per_gpu"]


@pytest.mark.slow
def test_placement_json_records_the_islands(job):
    _, placement = job
    islands = placement["dp_hierarchy"]
    assert islands["level"] == "island"
    main = islands["pools"]["main"]
    assert main["islands_per_dp_group"] == 2 and main["ranks_per_island"] == 2 and main["cross_island_dtype"] == "fp8"
    # the recorded topology's NVLink pairs are GPUs (0,2) and (1,3): ranks 0,1 drive one pair, ranks 2,3 the other
    assert [i["ranks"] for i in main["islands"]] == [[0, 1], [2, 3]]
    assert [sorted(d for _, d in i["devices"]) for i in main["islands"]] == [[0, 2], [1, 3]]
    assert main["intra_dp_groups"] == [[0, 1], [2, 3]] and main["inter_dp_groups"] == [[0, 2], [1, 3]]
    assert placement["pools"][0]["dp_islands"] == 2
    for rank in placement["ranks"]:
        assert rank["groups"]["intra_dp"] == [[0, 1], [2, 3]][rank["rank"] // 2]
        assert rank["groups"]["inter_dp"] == [[0, 2], [1, 3]][rank["rank"] % 2]
    assert any("data-parallel islands (island)" in d for d in placement["decisions"])


@pytest.mark.slow
def test_a_flat_actor_resumes_the_islands_checkpoint(job):
    """The job saved the islands' optimizer (sharded over the 2 ranks of an island) and resumed it flat (sharded over
    all 4): every Adam tensor of every HF-named parameter (param, exp_avg, exp_avg_sq) came back exactly."""
    report, _ = job
    assert report["checkpoint_tensors_compared"] == 78  # 26 HF tensors of the tiny model × 3
