"""A 1024-rank world (128 nodes × 8 GPUs, tp=8, pp=4, generation gen_tp=4) built in one process, and a two-pool
placement of 768 training + 256 rollout ranks.

The group arithmetic is swept over every rank; the real dry run (torch's fake backend + the run's own group
builder + a meta-device model) runs for ranks of every pipeline stage. Invariants are computed here from the
definitions and Megatron-Core's own rank generator, never copied from the code under test.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch.distributed as dist

from verl_mega.models.hf_config import ModelConfigError, arch_from_hf, load_hf_config
from verl_mega.parallel.placement import Placement, Pool
from verl_mega.planning.dry_run import DryRunError

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "fixtures" / "hf_configs" / "llama-2-7b.json"
WORLD, NODE, TP, PP, TG = 1024, 8, 8, 4, 4
DP = WORLD // (TP * PP)
LAYOUT = Placement.single(WORLD, tp=TP, pp=PP, gen_tp=TG)
# 768 training ranks (tp=8, pp=4, dp=24) + 256 rollout ranks (64 vLLM engines of gen_tp=4)
TWO_POOLS = Placement(WORLD, (Pool(name="train", ranks=tuple(range(768)), tp=TP, pp=PP, gen_tp=TG),
                              Pool(name="rollout", ranks=tuple(range(768, WORLD)), gen_tp=4, trains=False)),
                      {"actor": "train", "rollout": "rollout"})
TIME_LIMIT_S = 10.0
# the dry runs are held to TIME_LIMIT_S each: they run with the box to themselves, not beside another test
pytestmark = pytest.mark.alone


def check_rank_groups(rank: int, groups: dict[str, tuple[int, ...]]) -> None:
    tp, pp, dp, gen, micro = (groups[k] for k in ("tp", "pp", "dp", "gen_tp", "micro_dp"))
    # TP: tp consecutive ranks, all on the node of this rank.
    assert len(tp) == TP and rank in tp
    assert list(tp) == list(range(tp[0], tp[0] + TP)) and tp[0] % TP == 0
    assert {r // NODE for r in tp} == {rank // NODE}
    # PP: one rank per stage, same position in every other dimension (stride tp·dp in Megatron's order).
    assert len(pp) == PP and rank in pp and all(b - a == TP * DP for a, b in zip(pp, pp[1:]))
    # DP: same TP rank and stage, dp different replicas.
    assert len(dp) == DP and rank in dp
    assert {r % TP for r in dp} == {rank % TP} and {r // (TP * DP) for r in dp} == {rank // (TP * DP)}
    for a, b in ((tp, pp), (tp, dp), (pp, dp)):
        assert set(a) & set(b) == {rank}
    # 3D-HybridEngine: generation TP = tg ranks of the training TP group strided by t/tg (ascending: new_group
    # sorts); micro-DP = t/tg consecutive ranks; they meet in this rank only.
    assert len(gen) == TG and set(gen) <= set(tp) and list(gen) == sorted(gen)
    assert all(b - a == TP // TG for a, b in zip(gen, gen[1:]))
    assert len(micro) == TP // TG and set(micro) <= set(tp)
    assert list(micro) == list(range(micro[0], micro[0] + TP // TG))
    assert set(gen) & set(micro) == {rank}


def test_group_arithmetic_for_every_rank():
    from megatron.core.parallel_state import RankGenerator

    pool = LAYOUT.pool("main")
    start = time.perf_counter()
    seen: dict[str, set[tuple[int, ...]]] = defaultdict(set)
    for rank in range(WORLD):
        groups = {kind: pool.group_of(kind, rank) for kind in ("tp", "pp", "dp", "gen_tp", "micro_dp")}
        check_rank_groups(rank, groups)
        for kind, group in groups.items():
            seen[kind].add(group)
    LAYOUT.check()
    elapsed = time.perf_counter() - start
    counts = {"tp": WORLD // TP, "pp": WORLD // PP, "dp": WORLD // DP, "gen_tp": WORLD // TG,
              "micro_dp": WORLD // (TP // TG)}
    for kind, groups in seen.items():
        assert len(groups) == counts[kind], kind
        assert sorted(r for g in groups for r in g) == list(range(WORLD)), f"{kind} groups do not partition the world"
    # Megatron's own rank generator (what initialize_model_parallel uses) agrees on every group.
    gen = RankGenerator(tp=TP, ep=1, dp=DP, pp=PP, cp=1, order="tp-cp-ep-dp-pp")
    for kind in ("tp", "pp", "dp"):
        assert {tuple(g) for g in gen.get_ranks(kind)} == seen[kind], kind
    # HybridFlow §5 from mcore's TP groups: generation TP strided by t/tg, micro-DP runs of t/tg
    m = TP // TG
    assert seen["gen_tp"] == {tuple(g[k::m]) for g in gen.get_ranks("tp") for k in range(m)}
    assert seen["micro_dp"] == {tuple(g[j * m:(j + 1) * m]) for g in gen.get_ranks("tp") for j in range(TG)}
    assert elapsed < TIME_LIMIT_S


_SUBPROCESS = """
import json, sys, time, warnings
warnings.filterwarnings("ignore")
from verl_mega.models.hf_config import arch_from_hf, load_hf_config
from verl_mega.parallel.placement import Placement, Pool
from verl_mega.planning.dry_run import dry_run
spec = json.loads(sys.argv[1])
arch = arch_from_hf(load_hf_config(spec["model"]))
pools = tuple(Pool(**{**p, "ranks": tuple(range(*p["ranks"]))}) for p in spec["pools"])
placement = Placement(spec["world"], pools, spec["roles"])
out = []
for rank in spec["ranks"]:
    start = time.perf_counter()
    (report,) = dry_run(arch, placement, ranks=[rank], build_model=spec["build_model"])
    out.append({**report.to_json(), "wall_s": time.perf_counter() - start})
print("REPORTS " + json.dumps(out))
"""


def run_dry_runs(ranks: list[int], placement: Placement, *, build_model: bool = True, model: Path = MODEL
                 ) -> list[dict]:
    """In this process when it has no torch.distributed state, else in a fresh one (the fake world needs that)."""
    pools = [{"name": p.name, "ranks": [p.ranks[0], p.ranks[-1] + 1], "tp": p.tp, "pp": p.pp, "vpp": p.vpp,
              "ep": p.ep, "etp": p.etp, "gen_tp": p.gen_tp, "gen_ep": p.gen_ep, "trains": p.trains,
              "sequence_parallel": p.sequence_parallel} for p in placement.pools]
    spec = {"model": str(model), "ranks": ranks, "build_model": build_model, "world": placement.world_size,
            "pools": pools, "roles": dict(placement.roles)}
    if dist.is_initialized():
        proc = subprocess.run([sys.executable, "-c", _SUBPROCESS, json.dumps(spec)], capture_output=True, text=True,
                              timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("REPORTS "))
        return json.loads(line[len("REPORTS "):])
    import megatron.core.parallel_state  # noqa: F401  (import time is not part of the dry run)

    from verl_mega.planning.dry_run import dry_run

    arch = arch_from_hf(load_hf_config(model))
    out = []
    for rank in ranks:
        start = time.perf_counter()
        (report,) = dry_run(arch, placement, ranks=[rank], build_model=build_model)
        out.append({**report.to_json(), "wall_s": time.perf_counter() - start})
        assert not dist.is_initialized()  # the fake world is torn down again
    return out


def test_dry_run_1024_ranks_every_stage():
    ranks = [0, 300, 517, 1023, 255, 768]  # stages 0, 1, 2, 3, 0, 3
    reports = run_dry_runs(ranks, LAYOUT)
    arch = arch_from_hf(load_hf_config(MODEL))
    h, L = arch.hidden_size, arch.num_layers
    for rank, rep in zip(ranks, reports):
        assert rep["wall_s"] < TIME_LIMIT_S, rep
        assert rep["pp_stage"] == rank // (TP * DP)
        check_rank_groups(rank, {k: tuple(v) for k, v in rep["groups"].items()})
        assert rep["new_group_calls"] <= 16  # only the rank's own groups: O(kinds), not O(groups in the job)
        assert rep["chunk_layer_offsets"] == [rep["pp_stage"] * L // PP]
    # Parameters: one rank per stage, sharded parts × tp add up to the HF model (+ Megatron's vocabulary padding).
    per_stage = {rep["pp_stage"]: rep["params_on_rank"] for rep in reports}
    assert sorted(per_stage) == list(range(PP))
    replicated = {s: 2 * h * L // PP + (h if s == PP - 1 else 0) for s in range(PP)}  # RMSNorm weights
    padded_vocab = math.ceil(arch.vocab_size / (128 * TP)) * 128 * TP
    sharded_total = sum(TP * (per_stage[s] - replicated[s]) for s in range(PP))
    assert sharded_total == arch.num_parameters() - (2 * h * L + h) + 2 * (padded_vocab - arch.vocab_size) * h


def test_mcore_groups_at_every_tp_and_stage_position():
    # One rank for each (TP rank, pipeline stage) pair, the DP replica varying, through mcore's real group setup.
    ranks = [t + TP * ((7 * t + 3 * s) % DP + DP * s) for t in range(TP) for s in range(PP)]
    reports = run_dry_runs(ranks, LAYOUT, build_model=False)
    for rank, rep in zip(ranks, reports):
        check_rank_groups(rank, {k: tuple(v) for k, v in rep["groups"].items()})
        assert rep["wall_s"] < TIME_LIMIT_S


def test_two_pool_placement_at_1024_ranks():
    """768 training + 256 rollout ranks: the training pool's stages and a rollout engine, built and checked."""
    ranks = [0, 517, 767, 768, 1023]
    reports = run_dry_runs(ranks, TWO_POOLS)
    dp = 768 // (TP * PP)
    for rank, rep in zip(ranks, reports):
        assert rep["wall_s"] < TIME_LIMIT_S and rep["world_size"] == WORLD
        groups = {k: tuple(v) for k, v in rep["groups"].items()}
        if rank < 768:
            assert rep["pool"] == "train" and rep["pp_stage"] == rank // (TP * dp)
            assert len(groups["dp"]) == dp and all(r < 768 for g in groups.values() for r in g)
            assert rep["params_on_rank"] == rep["predicted_params"]
        else:  # a vLLM engine of 4 consecutive rollout ranks; no training model is built there
            assert rep["pool"] == "rollout" and groups["gen_tp"] == tuple(range(rank - rank % 4, rank - rank % 4 + 4))
            assert rep["params_on_rank"] is None


def test_dry_run_moe_expert_parallel_1024_ranks():
    """Qwen3-30B-A3B at 1024 ranks, tp=4 pp=4 with 128 experts over ep=16 (etp=1): every rank's expert groups are
    Megatron's (checked inside the dry run against HyperCommGrid), EP groups are 16 consecutive ranks inside a
    pipeline stage, and the stages' meta models add up to the HF model."""
    arch = arch_from_hf(load_hf_config(MODEL.parent / "qwen3-30b-a3b.json"))
    tp, pp, ep = 4, 4, 16
    layout = Placement.single(WORLD, tp=tp, pp=pp, ep=ep, etp=1, gen_tp=4, sequence_parallel=True)
    ranks = [0, 300, 517, 1023]
    reports = run_dry_runs(ranks, layout, model=MODEL.parent / "qwen3-30b-a3b.json")
    h, L, d = arch.hidden_size, arch.num_layers, arch.head_dim
    stage_size = WORLD // pp
    for rank, rep in zip(ranks, reports):
        assert rep["wall_s"] < TIME_LIMIT_S and rep["params_on_rank"] == rep["predicted_params"]
        groups = {k: tuple(v) for k, v in rep["groups"].items()}
        first = rank - rank % ep
        assert groups["ep"] == tuple(range(first, first + ep)) and groups["etp"] == (rank,)
        assert groups["edp"] == tuple(range(rank % stage_size % ep + rank // stage_size * stage_size,
                                            (rank // stage_size + 1) * stage_size, ep))
        assert set(groups["tp"]) <= set(groups["ep"])  # a TP group never straddles two EP groups here
    per_stage = {rep["pp_stage"]: rep["params_on_rank"] for rep in reports}
    assert sorted(per_stage) == list(range(pp))
    layers = L // pp
    experts = layers * arch.num_experts // ep * 3 * h * arch.moe_ffn_hidden_size  # per rank, etp = 1
    replicated = {s: layers * (2 * h + 2 * d + arch.num_experts * h) + (h if s == pp - 1 else 0) for s in range(pp)}
    padded_vocab = math.ceil(arch.vocab_size / (128 * tp)) * 128 * tp
    rebuilt = sum(tp * (per_stage[s] - replicated[s] - experts) + ep * experts + replicated[s] for s in range(pp))
    assert rebuilt == arch.num_parameters() + 2 * (padded_vocab - arch.vocab_size) * h


@pytest.mark.parametrize("name,tp,pp,ep,gen_tp,gen_ep", [("deepseek-v3", 8, 1, 256, 4, 256),
                                                         ("qwen3-235b-a22b", 4, 2, 128, 1, 128)])
def test_dry_run_expert_parallel_generation_1024_ranks(name, tp, pp, ep, gen_tp, gen_ep):
    """The 1024-GPU plans of DeepSeek-V3 and Qwen3-235B-A22B (docs/moe.md): the dry run sweeps every rank and
    builds each checked rank's expert-parallel generation group with the run's own group builder; the group is the
    gen_ep ranks of gen_ep/gen_tp engines at the rank's position in consecutive training TP groups of its stage."""
    arch = MODEL.parent / f"{name}.json"
    layout = Placement.single(WORLD, tp=tp, pp=pp, ep=ep, etp=1, gen_tp=gen_tp, gen_ep=gen_ep,
                              sequence_parallel=True)
    ranks = [0, 517, 1023]
    reports = run_dry_runs(ranks, layout, build_model=False, model=arch)
    d = gen_ep // gen_tp
    for rank, rep in zip(ranks, reports):
        groups = {k: tuple(v) for k, v in rep["groups"].items()}
        stage_first = rank - rank % (WORLD // pp)
        block = (rank - stage_first) // (tp * d)  # D consecutive TP groups of the stage
        first = stage_first + block * tp * d + rank % tp % (tp // gen_tp)
        want = tuple(range(first, first + tp * d, tp // gen_tp))
        assert groups["gen_ep"] == want and len(want) == gen_ep, (rank, groups["gen_ep"][:8])
        assert set(groups["gen_tp"]) <= set(groups["gen_ep"]) and set(groups["gen_tp"]) <= set(groups["tp"])
    assert "expert-parallel generation groups of" in reports[0]["checks"][0]


def test_dry_run_deepseek_meta_model_counts():
    """DeepSeek-V3's widths cut to 4 layers (a dense first layer, then MoE; MLA with its replicated latent
    projections): the meta model of a rank holds exactly the parameters the memory model predicts."""
    import tempfile

    cfg = json.loads((MODEL.parent / "deepseek-v3.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps({**cfg, "num_hidden_layers": 4, "first_k_dense_replace": 1}))
        layout = Placement.single(WORLD, tp=8, pp=2, ep=64, etp=1, gen_tp=8, gen_ep=64, sequence_parallel=True)
        reports = run_dry_runs([0, 1023], layout, model=path)
    assert all(rep["params_on_rank"] == rep["predicted_params"] for rep in reports)
    assert reports[0]["params_on_rank"] != reports[1]["params_on_rank"]  # stage 0 holds the dense layer


def test_dry_run_interleaved_chunks():
    layout = Placement.single(WORLD, tp=TP, pp=PP, gen_tp=TG, vpp=2)
    (rep,) = run_dry_runs([777], layout)
    stage, per_chunk = 777 // (TP * DP), 32 // (PP * 2)
    assert rep["chunk_layer_offsets"] == [(c * PP + stage) * per_chunk for c in range(2)]
    assert rep["wall_s"] < TIME_LIMIT_S


def test_dry_run_rejects_bad_rank_and_layout():
    from verl_mega.planning.dry_run import dry_run

    arch = arch_from_hf(load_hf_config(MODEL))
    was_initialized = dist.is_initialized()
    if not was_initialized:
        with pytest.raises(DryRunError, match="outside the world"):
            dry_run(arch, LAYOUT, ranks=[WORLD], build_model=False)
    with pytest.raises(ModelConfigError, match="28 attention heads"):  # Qwen2.5-7B: 28 heads, tp=8
        from verl_mega.models.hf_config import check_layout

        qwen = arch_from_hf(load_hf_config(MODEL.parent / "qwen2.5-7b.json"))
        check_layout(LAYOUT.pool("main"), num_layers=qwen.num_layers, num_heads=qwen.num_heads,
                     num_kv_heads=qwen.num_kv_heads)
    assert dist.is_initialized() == was_initialized  # nothing was left behind


# tools/plan.py run as `python tools/plan.py ARGS` (as __main__, its exit code and its two streams) for several
# ARGS in one interpreter: one start of torch and Megatron-Core for the three command lines below, not three
_CLI_DRIVER = """
import contextlib, io, json, runpy, sys
results = []
for argv in json.loads(sys.argv[1]):
    out, err, sys.argv = io.StringIO(), io.StringIO(), argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    results.append({"rc": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
sys.__stdout__.write("CLI " + json.dumps(results) + "\\n")
"""


def run_plan_cli(*arg_lists: list[str]) -> list[subprocess.CompletedProcess]:
    argvs = [[str(REPO / "tools" / "plan.py"), *args] for args in arg_lists]
    proc = subprocess.run([sys.executable, "-c", _CLI_DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("CLI "))
    return [subprocess.CompletedProcess(argv, r["rc"], r["stdout"], r["stderr"])
            for argv, r in zip(argvs, json.loads(line[len("CLI "):]))]


def test_plan_cli_dry_run():
    """A rank outside the world is one error line (exit 2, nothing on stdout); --json of a 1024-rank single-pool
    layout; and the recipe whose placement has a 768-rank training pool and a 256-rank rollout pool."""
    bad, single, two_pools = run_plan_cli(
        ["--model", str(MODEL), "--gpus", "16", "--tp", "8", "--dry-run", "--rank", "16"],
        ["--model", str(MODEL), "--gpus", str(WORLD), "--gpus-per-node", str(NODE), "--gpu-mem-gb", "80", "--tp",
         str(TP), "--pp", str(PP), "--gen-tp", str(TG), "--vpp", "1", "--dry-run", "--rank", "517", "--json"],
        ["--config", str(REPO / "configs" / "ppo_llama2_7b_two_pools.yaml"), "--model", str(MODEL), "--gpus",
         str(WORLD), "--dry-run", "--rank", "5", "767", "768", "--json"])

    assert bad.returncode == 2 and bad.stdout == ""
    lines = [x for x in bad.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "outside the world of 16" in lines[0], bad.stderr[-2000:]

    assert single.returncode == 0, single.stderr[-3000:]
    data = json.loads(single.stdout)
    (rep,) = data["dry_run"]
    assert rep["world_size"] == WORLD and rep["rank"] == 517
    check_rank_groups(517, {k: tuple(v) for k, v in rep["groups"].items()})
    assert rep["seconds_groups"] + rep["seconds_model"] < TIME_LIMIT_S
    assert any("group arithmetic of all 1024 ranks" in c for c in rep["checks"])
    best = data["plans"][0]
    assert (best["tp"], best["pp"], best["gen_tp"], best["dp"]) == (TP, PP, TG, DP)

    assert two_pools.returncode == 0, two_pools.stderr[-3000:]
    data = json.loads(two_pools.stdout)
    reps = data["dry_run"]
    assert [r["pool"] for r in reps] == ["train", "train", "rollout"]
    assert reps[0]["groups"]["tp"] == [4, 5, 6, 7] and reps[0]["groups"]["gen_tp"] in ([4, 6], [5, 7])
    assert reps[1]["pp_stage"] == 1 and len(reps[1]["groups"]["dp"]) == 96
    assert reps[2]["groups"]["gen_tp"] == [768, 769]
    assert data["plans"][0]["tp"] == 4 and data["plans"][0]["dp"] == 96  # memory planned for the training pool
