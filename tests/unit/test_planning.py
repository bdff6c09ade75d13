"""Planner memory formulas against hand-computed values, feasibility rules, ranking and the tools/plan.py JSON."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest

from verl_mega.models.hf_config import ModelArch, arch_from_hf, load_hf_config
from verl_mega.planning.memory import (
    training_pool,
    RolloutSpec,
    Workload,
    activation_terms,
    default_roles,
    in_flight,
    layer_activation_bytes,
    logits_bytes,
    predict_memory,
    training_state_terms,
)
from verl_mega.planning.params import PlanningError, generation_params, layer_params, stage_params
from verl_mega.planning.plan import Cluster, Pins, plan_layouts

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "fixtures" / "hf_configs"
TOPO = REPO / "tests" / "fixtures" / "topo"

# h=64, a=4 heads, k=2 kv heads, d=16, f=128, V=1000, 4 layers, QKV bias: small enough to count by hand.
SMALL = ModelArch(model_type="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=256, rope_theta=1e4,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, qk_norm=False)


def _small(**changes) -> ModelArch:
    return ModelArch(**{**SMALL.__dict__, **changes})


# ---------------------------------------------------------------------------------------------------- parameters
def test_layer_and_stage_params_by_hand():
    # QKV 64·(4+2·2)·16 + bias 128 + proj 64·64 + fc1 64·256 + fc2 128·64 + two norms 2·64
    assert layer_params(SMALL, 1) == 8192 + 128 + 4096 + 16384 + 8192 + 128 == 37120
    assert layer_params(SMALL, 2) == 4096 + 64 + 2048 + 8192 + 4096 + 128 == 18624
    lay = training_pool(tp=2, pp=2, dp=1, gen_tp=2)
    # vocabulary padded to a multiple of 128·tp = 256 → 1024 rows, 1024·64/2 per rank
    assert stage_params(SMALL, lay, 0).total == 2 * 18624 + 32768
    assert stage_params(SMALL, lay, 1).total == 2 * 18624 + 32768 + 64  # + output layer + final norm
    assert stage_params(SMALL, lay, 1, value_head=True).total == 2 * 18624 + 64 + 64
    tied = _small(tie_word_embeddings=True)
    assert stage_params(tied, training_pool(tp=2, pp=1, dp=1, gen_tp=2), 0).total == 4 * 18624 + 32768 + 64
    assert stage_params(tied, lay, 1).total == 2 * 18624 + 32768 + 64  # mcore keeps a copy on the last stage
    # vLLM pads the vocabulary to 64: 1024 rows; embedding + lm_head + final norm
    assert generation_params(SMALL, 2) == 4 * 18624 + 2 * 1024 * 64 // 2 + 64


def test_training_state_bytes_by_hand():
    bf16 = [t.bytes for t in training_state_terms(70080, 4, "bf16")]
    assert bf16 == [2 * 70080, 4 * 70080, 12 * 70080 / 4]
    fp32 = [t.bytes for t in training_state_terms(70080, 4, "fp32")]
    assert fp32 == [4 * 70080, 4 * 70080, 8 * 70080 / 4]


# ---------------------------------------------------------------------------------------------------- activations
def test_layer_activations_by_hand():
    lay = training_pool(tp=2, pp=1, dp=1, gen_tp=2)  # sequence parallel on (tp > 1)
    work = Workload(micro_batch=2, seq_len=32, dtype="bf16")
    # per token: norms 2·(4+2·2)·64/2 = 512, q/k/v/out 2·(3·4+4)·16/2 = 256, SwiGLU 5·2·128/2 = 640 → 1408
    kept = 64 * 1408
    assert layer_activation_bytes(SMALL, lay, work, recompute="selective") == kept
    # + log-sum-exp 64 tokens · 4·4/2 B + RoPE cos/sin 4·2·32·16 B
    assert layer_activation_bytes(SMALL, lay, work) == kept + 512 + 4096
    assert layer_activation_bytes(SMALL, lay, work, recompute="full") == 2 * 64 * 64 / 2
    no_sp = training_pool(tp=2, pp=1, dp=1, gen_tp=2, sequence_parallel=False)
    assert layer_activation_bytes(SMALL, no_sp, work, recompute="selective") == 64 * (1024 + 256 + 640)
    mha = _small(num_kv_heads=4)  # v stays a view of the fused QKV output: a + 2k = 12 heads
    attention = 2 * (3 * 4 + 12) * 16 / 2
    assert layer_activation_bytes(mha, lay, work, recompute="selective") == 64 * (512 + attention + 640)
    fp32 = Workload(micro_batch=2, seq_len=32, dtype="fp32")
    assert layer_activation_bytes(SMALL, lay, fp32, recompute="selective") == 64 * (
        2 * (4 + 8) * 64 / 2 + 4 * 16 * 16 / 2 + 5 * 4 * 128 / 2)


def test_stage_activations_by_hand():
    work = Workload(micro_batch=2, seq_len=32, dtype="bf16")
    one = training_pool(tp=2, pp=1, dp=1, gen_tp=2)
    # kept logits: final norm (4+4)·64·64/2 + (2+8)·64 tokens·1024/2
    assert logits_bytes(SMALL, one, work) == 16384 + 327680
    terms = activation_terms(SMALL, one, work, 0)
    # 4 layers + logits + loss gradient (4 + 2)·64·1024/2 (larger than the MLP moment 2·2·64·128/2)
    assert sum(t.bytes for t in terms) == 4 * 94720 + 344064 + 196608
    two = training_pool(tp=2, pp=2, dp=1, gen_tp=2)
    # stage 0 holds 2 micro-batches × 2 layers and their send/recv buffers 2·(2·2·64·64/2);
    # MLP backward 2·2·64·128/2
    assert sum(t.bytes for t in activation_terms(SMALL, two, work, 0)) == 2 * 2 * 94720 + 2 * 8192 + 16384
    assert in_flight(training_pool(tp=1, pp=4, dp=1, gen_tp=1), 0, None) == 4
    assert in_flight(training_pool(tp=1, pp=4, dp=1, gen_tp=1), 3, None) == 1
    assert in_flight(training_pool(tp=1, pp=4, dp=1, gen_tp=1), 0, 3) == 3
    assert in_flight(training_pool(tp=1, pp=4, dp=1, gen_tp=1, vpp=2), 0, None) == 2 * 3 + 1 * 4 + 1
    assert in_flight(training_pool(tp=1, pp=4, dp=1, gen_tp=1, vpp=2), 3, None) == 4 + 1


# ---------------------------------------------------------------------------------------------------- phases
def test_rollout_offload_and_reshard_by_hand():
    lay = training_pool(tp=2, pp=2, dp=1, gen_tp=1)
    rollout = RolloutSpec(kv_cache_bytes=10_000, max_num_batched_tokens=64, max_num_seqs=4)
    work = Workload(micro_batch=1, seq_len=32)
    mem = predict_memory(SMALL, lay, work, rollout=rollout)
    m_bytes = 2 * (4 * 37120 + 2 * 1000 * 64 + 64)  # bf16 HF model
    assert mem.reshard_bytes_per_gpu == pytest.approx((4 - 1) / (1 * 4) * m_bytes)  # (t·p − tg)/(tg·t·p)·M
    assert mem.reshard_extra_peak_bytes == pytest.approx(m_bytes / 1)
    assert mem.kv_bytes_per_token == 2 * 4 * 2 * 16 * 2  # K and V, 4 layers, 2 kv heads at gen_tp=1, d=16, bf16

    lay = training_pool(tp=2, pp=1, dp=2, gen_tp=2)
    base = predict_memory(SMALL, lay, work, rollout=rollout)
    off = predict_memory(SMALL, lay, work, rollout=rollout,
                         roles=default_roles(offload=("params", "grads", "optimizer")))
    actor = 4 * 18624 + 32768 + 32768 + 64  # stage params at tp=2
    critic = 4 * 18624 + 32768 + 64 + 64  # value head instead of the output layer
    state = 2 + 4 + 12 / 2  # bf16 params, fp32 grads, (master, m, v)/dp bytes per parameter
    vllm = 2 * generation_params(SMALL, 2) + (2 * 64 * (128 + 384 + 192) / 2 + 8 * 4 * 1000) + 10_000
    assert base.phases["rollout"].total == pytest.approx(state * (actor + critic) + 2 * actor + vllm)
    assert off.phases["rollout"].total == pytest.approx(2 * actor + vllm)
    assert off.host_offload_bytes == pytest.approx(state * (actor + critic))
    with pytest.raises(PlanningError, match="GPU memory"):
        predict_memory(SMALL, lay, work)  # neither GPU memory nor a KV budget


# ---------------------------------------------------------------------------------------------------- planner
def _qwen7b() -> ModelArch:
    return arch_from_hf(load_hf_config(CONFIGS / "qwen2.5-7b.json"))


def test_feasibility_rules_hold_for_every_plan():
    arch = _qwen7b()
    cluster = Cluster(gpus=16, gpus_per_node=8, gpu_mem_gib=80)
    plans, rejected = plan_layouts(arch, cluster, Workload(seq_len=4096), global_batch=1024)
    assert plans
    for p in plans:
        lay = p.layout
        assert 8 % lay.tp == 0 and lay.tp % lay.gen_tp == 0
        assert arch.num_heads % lay.tp == 0 and arch.num_kv_heads % lay.tp == 0
        assert arch.num_layers % (lay.pp * (lay.vpp or 1)) == 0
        assert lay.tp * lay.pp * lay.dp == 16
        assert p.num_microbatches * lay.dp == 1024
    assert {r.tp for r in rejected} == {8} and all("heads=28" in r.reason for r in rejected)
    fits = [p.fits for p in plans]
    assert fits == sorted(fits, reverse=True)  # every fitting plan first
    assert [p.cost for p in plans] == sorted(p.cost for p in plans)


@pytest.mark.parametrize("pins,kwargs,reason", [
    (Pins(tp=2, pp=2, vpp=2), dict(global_batch=6), "multiple of pp=2"),  # dp=2 → M=3 micro-batches
    (Pins(tp=2, pp=1), dict(global_batch=1002), "does not split"),  # dp=4
    (Pins(tp=2, pp=3), dict(global_batch=1024), "does not divide layers"),
    (Pins(tp=4), dict(global_batch=1024), "kv heads=2"),
])
def test_rejections_name_the_rule(pins, kwargs, reason):
    _, rejected = plan_layouts(SMALL, Cluster(gpus=8, gpus_per_node=8, gpu_mem_gib=80), Workload(seq_len=64),
                               pins=pins, **kwargs)
    assert rejected and all(reason in r.reason for r in rejected), rejected


# 8 heads of 8 = h: every tp up to 8 divides the heads, so only the rule under test rejects.
WIDE = _small(num_heads=8, num_kv_heads=8, head_dim=8)


def test_sequence_parallel_needs_divisible_sequence():
    _, rejected = plan_layouts(WIDE, Cluster(gpus=4, gpus_per_node=4, gpu_mem_gib=80), Workload(seq_len=30),
                               global_batch=8, pins=Pins(tp=4))
    assert any("seq_len=30" in r.reason for r in rejected)


def test_bad_cluster_and_pins():
    with pytest.raises(PlanningError, match="whole number"):
        Cluster(gpus=12, gpus_per_node=8, gpu_mem_gib=80)
    with pytest.raises(PlanningError, match="exceeds"):
        plan_layouts(SMALL, Cluster(gpus=16, gpus_per_node=8, gpu_mem_gib=80), Workload(), global_batch=64,
                     pins=Pins(tp=16))
    with pytest.raises(PlanningError, match="gen_tp=3"):
        training_pool(tp=4, pp=1, dp=1, gen_tp=3)


def test_memory_decides_fit_and_ranking():
    arch = arch_from_hf(load_hf_config(CONFIGS / "llama-2-70b.json"))
    cluster = Cluster(gpus=128, gpus_per_node=8, gpu_mem_gib=79.6)
    plans, _ = plan_layouts(arch, cluster, Workload(seq_len=4096), global_batch=1024)
    tp1 = [p for p in plans if p.layout.tp == 1 and p.layout.pp == 1]
    assert tp1 and not any(p.fits for p in tp1)  # 70B replicas on every GPU cannot fit
    best = plans[0]
    assert best.fits and max(ph.total for ph in best.memory.phases.values()) <= cluster.budget_bytes


def test_topology_penalises_tp_groups_outside_nvlink_islands():
    from verl_mega.parallel.topology import parse_topology

    topo = parse_topology((TOPO / "a6000_8gpu_nvlink_pairs.txt").read_text())  # NVLink pairs only
    cluster = Cluster(gpus=8, gpus_per_node=8, gpu_mem_gib=48, topology=topo)
    plans, _ = plan_layouts(WIDE, cluster, Workload(seq_len=64), global_batch=64)
    by_tp = {p.layout.tp: p.tp_off_island for p in plans}  # training TP groups: the same for every gen_tp
    assert by_tp[1] == 0 and by_tp[2] == 0 and by_tp[4] > 0 and by_tp[8] > 0
    fitting = [p for p in plans if p.fits]
    penalties = [p.tp_off_island + p.gen_off_island for p in fitting]
    assert penalties == sorted(penalties)


# ---------------------------------------------------------------------------------------------------- CLI
def _load_cli():
    spec = importlib.util.spec_from_file_location("plan_cli", REPO / "tools" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = _load_cli().main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_json_interface(capsys):
    code, out, err = _run(capsys, "--model", str(CONFIGS / "qwen2.5-7b.json"), "--gpus", "16", "--gpus-per-node",
                          "8", "--gpu-mem-gb", "80", "--json")
    assert code == 0, err
    data = json.loads(out)
    arch = _qwen7b()
    m_bytes = 2 * arch.num_parameters()
    assert [p["rank"] for p in data["plans"]] == list(range(1, len(data["plans"]) + 1))
    for p in data["plans"]:
        assert p["tp"] * p["pp"] * p["dp"] == 16 and p["tp"] % p["gen_tp"] == 0
        assert set(p["memory_gb"]) >= {"train", "rollout"}
        assert all(v > 0 for v in p["memory_gb"].values())
        t, pp, tg = p["tp"], p["pp"], p["gen_tp"]
        assert p["reshard_bytes_per_gpu"] == pytest.approx((t * pp - tg) / (tg * t * pp) * m_bytes, abs=1)
    assert data["plans"][0]["fits"]


@pytest.mark.parametrize("argv,needle", [
    (["--gpus", "0"], "--gpus"),
    (["--gpus", "12"], "whole number"),
    (["--gpus", "16", "--tp", "3"], "no feasible layout"),
    (["--gpus", "16", "--offload", "weights"], "offload"),
    (["--gpus", "16", "--gen-tp", "3", "--tp", "4"], "no feasible layout"),
    (["--gpus", "16", "--recompute", "sometimes"], "recompute"),
])
def test_cli_bad_flags_give_one_line_errors(capsys, argv, needle):
    code, out, err = _run(capsys, "--model", str(CONFIGS / "qwen2.5-7b.json"), *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error:") and needle in err, err


def test_cli_missing_model_file(capsys, tmp_path):
    code, _, err = _run(capsys, "--model", str(tmp_path / "nope.json"), "--gpus", "8")
    assert code == 2 and "config.json" in err and len(err.strip().splitlines()) == 1


def test_cli_explain_prints_the_arithmetic(capsys):
    code, out, err = _run(capsys, "--model", str(CONFIGS / "llama-2-7b.json"), "--gpus", "8", "--gpu-mem-gb", "80",
                          "--explain", "--top", "3")
    assert code == 0, err
    assert "Arithmetic of the best plan" in out and "bubble = (p − 1)/(v·M)" in out
    assert "reshard bytes per GPU = (t·p − tg)/(tg·t·p)·M" in out


def test_inputs_from_a_training_recipe(capsys):
    import yaml

    from verl_mega.config import load_config
    from verl_mega.planning.plan import inputs_from_config

    recipe = REPO / "configs" / "ppo_llama2_7b.yaml"
    raw = yaml.safe_load(recipe.read_text())
    from verl_mega.parallel.placement import Placement

    cfg = load_config(recipe, check_paths=False)
    given = inputs_from_config(cfg, Placement.from_config(cfg, 8))
    assert (given.pins.tp, given.pins.pp, given.pins.gen_tp) == (raw["parallel"]["tp"], raw["parallel"]["pp"],
                                                                 raw["rollout"]["gen_tp"])
    assert given.workload.micro_batch == raw["actor"]["micro_batch_size_per_gpu"]
    assert given.workload.seq_len == raw["data"]["max_prompt_length"] + raw["rollout"]["max_response_length"]
    assert given.workload.recompute == raw["model"]["recompute"]
    assert given.global_batch == raw["actor"]["ppo_mini_batch_size"] * raw["rollout"]["n"]
    roles = {r.name: r for r in given.roles}
    assert set(roles) == {"actor", "critic", "ref"}  # gae → critic, KL in reward → reference
    assert roles["critic"].offload_optimizer and not roles["actor"].offload_optimizer
    assert roles["ref"].offload_params and not roles["ref"].trainable

    code, out, err = _run(capsys, "--config", str(recipe), "--model", str(CONFIGS / "llama-2-7b.json"),
                          "--gpus", "8", "--json", "--set", "rollout.gen_tp=4")
    assert code == 0, err
    plans = json.loads(out)["plans"]
    assert {(p["tp"], p["gen_tp"], p["recompute"]) for p in plans} == {(4, 4, "selective")}


# ---------------------------------------------------------------------------------------------------- experts
# 8 experts of width 32, top-2, h=64: every count below is written out from the definitions.
MOE = _small(model_type="qwen3_moe", qkv_bias=False, qk_norm=True, num_experts=8, moe_topk=2, moe_ffn_hidden_size=32,
             moe_renormalize=True)


def test_moe_params_state_and_comm_by_hand():
    from verl_mega.planning.memory import moe_comm_terms

    # attention 64·128·16/… at tp=2: QKV 64·8·16/2 + proj 64·64/2; norms 2·64 + q/k norms 2·16; router 8·64
    attention = 64 * 8 * 16 // 2 + 64 * 64 // 2
    experts = 8 // 4 * 3 * 64 * 32  # ep=4, etp=1: two whole experts
    lay = training_pool(tp=2, pp=1, dp=4, gen_tp=2, ep=4, etp=1)
    assert lay.edp == 2  # 8 ranks hold 4 expert shards: each twice
    assert layer_params(MOE, 2, ep=4, etp=1) == attention + 128 + 32 + 512 + experts
    sp = stage_params(MOE, lay, 0)
    assert sp.experts == 4 * experts
    # bf16 optimizer state: 12 B per param, dense ones over D=4, experts over D_e=2
    opt = training_state_terms(sp.total, lay.dp, "bf16", experts=sp.experts, edp=lay.edp)[2]
    assert opt.bytes == 12 * (sp.total - sp.experts) / 4 + 12 * sp.experts / 2
    work = Workload(micro_batch=2, seq_len=64, num_microbatches=3)
    a2a, grads = moe_comm_terms(MOE, lay, work)
    # forward + backward, dispatch + combine: 4·k·(s·b/σ)·h·B·(ep−1)/ep per layer and micro-batch
    assert a2a.bytes == 4 * 2 * (64 * 2 / 2) * 64 * 2 * 3 / 4 * 4 * 3
    assert grads.bytes == 2 * (2 - 1) / 2 * 4 * sp.experts
    assert moe_comm_terms(SMALL, training_pool(tp=2, pp=1, dp=4, gen_tp=2), work) == []


def test_moe_reshard_bytes_is_the_worst_rank():
    """The planner's reshard figure is the largest per-rank count over the whole pool (it evaluates a few ranks)."""
    from verl_mega.planning.generation import reshard_bytes

    for tp, pp, dp, ep, etp, tg, gen_ep in ((2, 2, 2, 2, 1, 2, 1), (2, 1, 4, 4, 2, 1, 1), (4, 2, 1, 2, 1, 2, 1),
                                            (1, 2, 4, 4, 1, 1, 1), (2, 2, 4, 8, 1, 2, 8), (2, 1, 4, 2, 2, 1, 4),
                                            (1, 2, 8, 2, 1, 1, 8)):
        lay = training_pool(tp=tp, pp=pp, dp=dp, gen_tp=tg, ep=ep, etp=etp, gen_ep=gen_ep)
        worst = max(MOE.hybrid_sync_bytes(lay, r, 2) for r in lay.ranks)
        assert reshard_bytes(MOE, lay) == worst, (tp, pp, dp, ep, etp, tg, gen_ep)


def test_moe_plans_at_1024_gpus():
    """Qwen3-235B-A22B (PPO with a critic) and DeepSeek-V3 (GRPO, idle state offloaded) on 1024 × 80 GB: with
    expert-parallel generation both have layouts with ep > 1 that fit for training and rollout; with the experts
    sliced over each engine's gen_tp ranks (gen_ep = 1) none does — every generation rank would hold 1/gen_tp of all
    experts."""
    cluster = Cluster(gpus=1024, gpus_per_node=8, gpu_mem_gib=80)
    work = Workload(micro_batch=1, seq_len=4096)
    cases = [("qwen3-235b-a22b.json", default_roles(), Pins(tp=4, pp=2, recompute="none", etp=1)),
             ("deepseek-v3.json", default_roles(critic=False, offload=("params", "grads", "optimizer"),
                                                offload_ref=True), Pins(tp=8, pp=1, recompute="none", etp=1))]
    for name, roles, pins in cases:
        arch = arch_from_hf(load_hf_config(CONFIGS / name))
        plans, _ = plan_layouts(arch, cluster, work, global_batch=1024, roles=roles, pins=pins)
        best = plans[0]
        assert best.fits and best.layout.ep > 1 and best.layout.gen_ep > 1, (name, best.headline())
        assert best.memory.phases["rollout"].total <= cluster.budget_bytes and best.memory.kv_cache_bytes > 0
        assert best.memory.phases["train"].total <= cluster.budget_bytes
        sliced, _ = plan_layouts(arch, cluster, work, global_batch=1024, roles=roles,
                                 pins=replace(pins, gen_ep=1, ep=best.layout.ep))
        assert not any(p.fits for p in sliced), (name, sliced[0].headline())


def test_the_resident_rollout_memory_is_the_training_peak_and_the_vllm_terms_apart():
    """rollout.free_cache_engine=auto weighs vLLM resident (its weights, activation reserve and KV cache) against the
    training roles' peak: the two parts of the peak predicted with vLLM resident; asleep, training holds no vLLM
    memory and its peak is that training peak."""
    from verl_mega.config import load_config
    from verl_mega.models.hf_config import arch_from_hf
    from verl_mega.parallel.placement import Placement
    from verl_mega.planning.memory import GiB, predict_memory
    from verl_mega.planning.plan import inputs_from_config, resident_rollout_memory

    recipe = REPO / "configs" / "grpo_qwen2.5_7b.yaml"
    arch = arch_from_hf(json.loads((CONFIGS / "qwen2.5-7b.json").read_text()))
    for overrides, gpu_gib in ((["parallel.tp=2", "rollout.gen_tp=2", "rollout.gpu_memory_utilization=0.3"], 141),
                               (["parallel.tp=1", "parallel.sequence_parallel=false", "rollout.gen_tp=1",
                                 "rollout.gpu_memory_utilization=0.5"], 80)):
        cfg = load_config(recipe, overrides, check_paths=False)
        placement = Placement.from_config(cfg, 8)
        training, vllm = resident_rollout_memory(cfg, placement, arch, gpu_gib * GiB)
        given = inputs_from_config(cfg, placement)
        asleep = predict_memory(arch, placement.pool_of("actor"), given.workload, roles=given.roles,
                                rollout=given.rollout, gpu_mem_bytes=gpu_gib * GiB)
        assert not [t for t in asleep.phases["train"].terms if t.name.startswith("vLLM")]
        assert training == max(asleep.phases["train"].total, asleep.phases["score"].total)
        # the KV cache is the asked share less vLLM's weights and activation reserve: the terms add up to the share
        share = float(overrides[-1].split("=")[1]) * gpu_gib * GiB
        assert vllm == pytest.approx(share, rel=1e-12)
