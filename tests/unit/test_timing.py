"""The planner's step-time model against hand-computed values and the measurements it is calibrated on, the ranking
it gives (tp=1 with dp over the GPUs for 1.5B-8B models when they fit), and `parallel.layout: auto`."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from pathlib import Path

import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.models.hf_config import ModelArch, arch_from_hf, load_hf_config
from verl_mega.planning.memory import RoleSpec, RolloutSpec, Workload, default_roles, predict_memory, training_pool
from verl_mega.planning.params import generation_params, stage_params
from verl_mega.planning.plan import Cluster, Pins, inputs_from_config, plan_layouts
from verl_mega.models.flops import attention_flops, matmul_weights
from verl_mega.planning.timing import H200, Hardware, StepShape, layer_gemm_flops, predict_time, time_bucket

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "tests" / "fixtures" / "hf_configs"
GRPO_7B = REPO / "configs" / "grpo_qwen2.5_7b.yaml"

# h=64, a=4 heads, k=2 kv heads, d=16, f=128, V=1000, 4 layers, untied: small enough to count by hand.
SMALL = ModelArch(model_type="qwen2", num_layers=4, hidden_size=64, ffn_hidden_size=128, num_heads=4,
                  num_kv_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=256, rope_theta=1e4,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=True, qk_norm=False)
# Round constants; a knee of 1000 FLOPs puts every GEMM of these examples at eta_max.
HW = Hardware(peak_tflops=1.0, eta_max=0.5, knee_gflop=1e-6, exponent=0.5, hbm_gbps=1000.0, nvlink_gbps=1.0,
              inter_node_gbps=0.5, pcie_gbps=1.0, collective_latency_s=1e-5, decode_step_overhead_s=1e-3,
              reshard_gbps=2.0)
ACTOR_REF = (RoleSpec(name="actor"), RoleSpec(name="ref", trainable=False))
GiB = 2**30


def _arch(name: str) -> ModelArch:
    return arch_from_hf(load_hf_config(CONFIGS / f"{name}.json"))


def _terms(pred) -> dict[str, float]:
    return {t.name: t.seconds for t in pred.terms}


# ---------------------------------------------------------------------------------------------------- by hand
def test_flops_and_efficiency_by_hand():
    # per layer Q, K, V 64·(4 + 2·2)·16 + output 4·16·64 = 12288, SwiGLU 3·64·128 = 24576; LM head 1000·64
    assert matmul_weights(SMALL) == (4 * (12288 + 24576) + 64000, 0)
    assert matmul_weights(SMALL, value_head=True) == (4 * (12288 + 24576) + 64, 0)
    assert attention_flops(SMALL, 24) == 4 * 4 * 4 * 16 * 24  # 2·2·L·a·d·context
    assert layer_gemm_flops(SMALL, 64, 2) == 2 * 36864 / 2 * 64
    hw = Hardware(eta_max=0.6, knee_gflop=1000.0, exponent=0.5)
    assert hw.efficiency(250e9) == pytest.approx(0.6 * 0.5)  # 0.6 · (250/1000)^0.5
    assert hw.efficiency(4e12) == 0.6  # above the knee
    assert time_bucket(1.0) == time_bucket(1.019) == 0 and time_bucket(1.021) == 1 and time_bucket(1.05) == 2
    with pytest.raises(ValueError, match="eta_max"):
        Hardware(eta_max=1.5)


def test_step_time_terms_by_hand():
    """tp=2, dp=2 (4 GPUs), tg=2; 16 samples of 16 + 16 tokens in micro-batches of 2, 8 per optimizer step."""
    lay = training_pool(tp=2, pp=1, dp=2, gen_tp=2)  # sequence parallel
    work = Workload(micro_batch=2, seq_len=32, num_microbatches=2)
    rollout = RolloutSpec(kv_cache_bytes=24576, max_num_seqs=4, max_num_batched_tokens=64)
    step = StepShape(samples=16, prompt_len=16, response_len=16, n=2)
    mem = predict_memory(SMALL, lay, work, roles=ACTOR_REF, rollout=rollout)
    pred = predict_time(SMALL, lay, work, step, mem, roles=ACTOR_REF, rollout=rollout, hardware=HW)
    got = _terms(pred)
    n_mm, tokens = 4 * 36864 + 64000, 16 * 32
    fwd = tokens * (2 * n_mm + 1024 * 16)  # 2·N + causal attention at mean context s/2 = 16
    assert got["old log-prob compute"] == pytest.approx(fwd / (4 * 0.5 * 1e12))
    assert got["ref log-prob compute"] == pytest.approx(fwd / (4 * 0.5 * 1e12))
    assert got["actor update compute"] == pytest.approx(3 * fwd / (4 * 0.5 * 1e12))
    # 4 micro-batches per DP rank × 4 layers × (4 collectives × α + (t−1)/t·4·s·b·h·B bytes over 1 GB/s)
    tp_fwd = 4 * 4 * (4 * 1e-5 + 4 * 0.5 * 32 * 2 * 64 * 2 / 1e9)
    assert got["old log-prob TP collectives"] == pytest.approx(tp_fwd)
    assert got["actor update TP collectives"] == pytest.approx(2 * tp_fwd)
    p_stage = stage_params(SMALL, lay, 0).total
    assert p_stage == 4 * 18624 + 2 * 32768 + 64
    # 2 optimizer steps × (2α + (dp−1)/dp × (4 + 2) B × P)
    assert got["actor DP grad/param sync"] == pytest.approx(2 * (2e-5 + 0.5 * 6 * p_stage / 1e9))
    assert got["actor optimizer step"] == pytest.approx(2 * (30 * p_stage / 2 + 4 * p_stage) / 1e12)
    gen = 2 * generation_params(SMALL, 2)
    assert got["weight sync"] == pytest.approx(2 * gen / 1e12)  # tg = tp: nothing received, own weights rewritten
    # 2 engines × 8 sequences; 256 B of KV per token and GPU, 3 sequences of 32 tokens fit: waves 3 + 3 + 2
    kv_tok = 2 * 4 * 1 * 16 * 2

    def decode_step(c):
        flops = c * (2 * n_mm + 1024 * 24) / 2  # mean context 16 + 8
        read = gen + c * 24 * kv_tok
        return max(read / 1e12, flops / 0.5e12) + 2 * 4 * (1e-5 + 2 * 0.5 * c * 64 * 2 / 1e9) + 1e-3

    assert got["decode"] == pytest.approx(16 * (2 * decode_step(3) + decode_step(2)))
    # 4 prompts per engine (n = 2 samples share one prefill), 16 tokens each, over tg = 2
    assert got["prefill"] == pytest.approx(4 * 16 * (2 * n_mm + 1024 * 8) / 2 / 0.5e12)
    assert pred.total == pytest.approx(sum(got.values()))
    assert set(pred.phases) == {"rollout", "reshard", "score", "train"}


def test_pipeline_bubble_and_sends_by_hand():
    lay = training_pool(tp=1, pp=2, dp=2, gen_tp=1)  # 4 GPUs, M = 2 micro-batches per step: bubble 1/2
    work = Workload(micro_batch=2, seq_len=32, num_microbatches=2)
    rollout = RolloutSpec(kv_cache_bytes=2**20)
    step = StepShape(samples=16, prompt_len=16, response_len=16)
    mem = predict_memory(SMALL, lay, work, roles=ACTOR_REF, rollout=rollout)
    fwd = 16 * 32 * ((2 * (4 * 36864 + 64000)) + 1024 * 16) / (4 * 0.5e12)
    send = 32 * 2 * 64 * 2  # s·b·h·B per micro-batch
    for node, bw in ((8, 1e9), (2, 0.5e9)):  # the 4-GPU pipeline inside a node, or across 2-GPU nodes
        got = _terms(predict_time(SMALL, lay, work, step, mem, roles=ACTOR_REF, rollout=rollout, hardware=HW,
                                  node_gpus=node))
        assert got["old log-prob compute"] == pytest.approx(fwd * 1.5)
        assert got["old log-prob PP send/recv"] == pytest.approx(4 * (1e-5 + send / bw))
        assert got["actor update PP send/recv"] == pytest.approx(2 * 4 * (1e-5 + send / bw))
    assert _terms(predict_time(SMALL, lay, work, step, mem, roles=ACTOR_REF, rollout=rollout, hardware=HW))[
        "weight sync"] == pytest.approx(mem.reshard_bytes_per_gpu / 2e9 + 2 * 2 * generation_params(SMALL, 1) / 1e12)


# ---------------------------------------------------------------------------------------------------- calibration
def _update_seconds(arch: ModelArch, tp: int, micro: int, seq: int, hw: Hardware = H200, **dims) -> float:
    """One forward + backward of `micro` × `seq` tokens on one TP group (the calibration benchmark's iteration)."""
    lay = training_pool(tp=tp, pp=1, dp=dims.pop("dp", 1), gen_tp=tp, **dims)
    work = Workload(micro_batch=micro, seq_len=seq, num_microbatches=1)
    roles, rollout = (RoleSpec(name="actor"),), RolloutSpec(kv_cache_bytes=GiB)
    step = StepShape(samples=micro * lay.dp, prompt_len=seq // 2, response_len=seq - seq // 2)
    pred = predict_time(arch, lay, work, step, predict_memory(arch, lay, work, roles=roles, rollout=rollout),
                        roles=roles, rollout=rollout, hardware=hw)
    return sum(t.seconds for t in pred.terms if t.name.startswith("actor update") and "DP" not in t.name)


@pytest.mark.parametrize("name,tp,measured", [
    # BENCHMARKS.md "Step-time model calibration": seconds per 8 × 1024-token forward + backward
    ("qwen2.5-1.5b", 1, 0.2245), ("qwen2.5-1.5b", 2, 0.1768), ("qwen2.5-7b", 1, 0.7274), ("qwen2.5-7b", 2, 0.4049)])
def test_dense_training_time_matches_the_measurements(name, tp, measured):
    assert _update_seconds(_arch(name), tp, 8, 1024) == pytest.approx(measured, rel=0.03)


@pytest.mark.parametrize("layers,micro,fraction,peak", [(8, 8, 0.2864, 786.5), (16, 4, 192.1 / 736.1, 736.1)])
def test_moe_training_time_matches_the_measurements(layers, micro, fraction, peak):
    """BENCHMARKS.md "Mixture-of-Experts on GPUs": Qwen3-30B-A3B cut to 8 / 16 layers, tp=1, dp=2, ep=2, reported as
    a share of the matmul peak of model FLOPs 6·N_active + 12·L·a·d·s + 6·L·h·E per token."""
    arch = dataclasses.replace(_arch("qwen3-30b-a3b"), num_layers=layers)
    h, a, d, L = arch.hidden_size, arch.num_heads, arch.head_dim, layers
    n_active = L * (h * (a + 2 * arch.num_kv_heads) * d + a * d * h + 3 * h * arch.moe_topk
                    * arch.moe_ffn_hidden_size) + h * arch.vocab_size
    per_token = 6 * n_active + 12 * L * a * d * 2048 + 6 * L * h * arch.num_experts
    measured = per_token * micro * 2048 / (fraction * peak * 1e12)
    predicted = _update_seconds(arch, 1, micro, 2048, Hardware(peak_tflops=peak), dp=2, ep=2, etp=1)
    assert predicted == pytest.approx(measured, rel=0.06)


def test_decode_step_matches_the_measurement():
    """BENCHMARKS.md GRPO config C: Qwen2.5-1.5B, two tg=1 engines, 16 prompts × 8 samples of 4 + 1024 tokens,
    vLLM at 0.35 of an H200: "Decode Loop ... avg 4.80 ms/step over 1023 steps"."""
    arch = _arch("qwen2.5-1.5b")
    lay = training_pool(tp=2, pp=1, dp=1, gen_tp=1)
    work = Workload(micro_batch=8, seq_len=1028, num_microbatches=16)
    roles = default_roles(critic=False)
    rollout = RolloutSpec(gpu_memory_utilization=0.35)
    step = StepShape(samples=128, prompt_len=4, response_len=1024, n=8)
    mem = predict_memory(arch, lay, work, roles=roles, rollout=rollout, gpu_mem_bytes=139.8 * GiB)
    decode = _terms(predict_time(arch, lay, work, step, mem, roles=roles, rollout=rollout))["decode"]
    assert decode / 1024 == pytest.approx(4.80e-3, rel=0.02)


# ---------------------------------------------------------------------------------------------------- ranking
ROLES = default_roles(critic=False, offload_ref=True)  # GRPO: actor + reference (offloaded while idle)
ROLLOUT = RolloutSpec(gpu_memory_utilization=0.3)
WORK = Workload(micro_batch=2, seq_len=2048)


def _plans(arch: ModelArch, gpus: int, **kw):
    return plan_layouts(arch, Cluster(gpus=gpus, gpus_per_node=8, gpu_mem_gib=139.8), WORK, global_batch=256,
                        roles=ROLES, rollout=ROLLOUT, **kw)[0]


@pytest.mark.parametrize("name", ["qwen2.5-1.5b", "qwen2.5-7b"])
@pytest.mark.parametrize("gpus", [2, 8])
def test_small_models_train_at_tp1_with_dp_over_the_gpus(name, gpus):
    plans = _plans(_arch(name), gpus)
    best = plans[0]
    assert best.fits and (best.layout.tp, best.layout.pp, best.layout.dp, best.layout.gen_tp) == (1, 1, gpus, 1)
    assert best.recompute == "none"  # recompute costs a forward pass when memory does not need it
    tp2 = next(p for p in plans if p.layout.tp == 2 and p.layout.pp == 1 and p.recompute == "none")
    assert tp2.time.phases["train"] > 1.05 * best.time.phases["train"]  # collectives and narrower GEMMs
    assert [p.cost for p in plans] == sorted(p.cost for p in plans)


def test_70b_does_not_train_at_tp1():
    plans = _plans(_arch("llama-2-70b"), 16)
    best = plans[0]
    assert best.fits and best.layout.tp > 1
    assert not any(p.fits for p in plans if p.layout.tp == 1)


def test_generation_tp_is_the_best_for_each_training_layout():
    """Each training layout is listed once, with the gen_tp (dividing tp) that the cost key prefers."""
    arch, cluster = _arch("qwen2.5-7b"), Cluster(gpus=8, gpus_per_node=8, gpu_mem_gib=139.8)
    plans, _ = plan_layouts(arch, cluster, WORK, global_batch=256, roles=ROLES, rollout=ROLLOUT,
                            pins=Pins(tp=4, pp=1, vpp=1, recompute="none"))
    (plan,) = plans
    alone = {}
    for tg in (1, 2, 4):
        (p,), _ = plan_layouts(arch, cluster, WORK, global_batch=256, roles=ROLES, rollout=ROLLOUT,
                               pins=Pins(tp=4, pp=1, vpp=1, gen_tp=tg, recompute="none"))
        alone[tg] = p
    assert plan.layout.gen_tp in (1, 2, 4)
    fastest = min(p.time.total for p in alone.values())
    assert plan.time.total <= fastest * 1.02  # the chosen tg is within the model's resolution of the fastest
    layouts = [(p.layout.tp, p.layout.pp, p.layout.vpp, p.recompute) for p in _plans(arch, 8)]
    assert len(layouts) == len(set(layouts))


# ---------------------------------------------------------------------------------------------------- auto
def _auto_cfg(*overrides: str):
    return load_config(GRPO_7B, ["parallel.layout=auto", *overrides], check_paths=False)


def test_auto_layout_resolves_to_the_planners_choice():
    from verl_mega.parallel.placement import Placement
    from verl_mega.planning.auto import resolve_auto_layout

    arch, cfg = _arch("qwen2.5-7b"), _auto_cfg()
    for gpus, mem in ((8, 139.8), (8, 80.0)):
        resolved = resolve_auto_layout(cfg, arch, world_size=gpus, gpus_per_node=8, gpu=("NVIDIA H200", mem))
        given = inputs_from_config(cfg, None)
        plans, _ = plan_layouts(arch, Cluster(gpus=gpus, gpus_per_node=8, gpu_mem_gib=mem), given.workload,
                                global_batch=given.global_batch, roles=given.roles, rollout=given.rollout,
                                pins=given.pins, step=given.step)
        best = plans[0].layout
        assert plans[0].fits
        p, r = resolved.parallel, resolved.rollout
        assert (p.layout, p.tp, p.pp, p.vpp, p.ep, r.gen_tp, p.sequence_parallel) == (
            "manual", best.tp, best.pp, best.vpp, best.ep, best.gen_tp, best.sequence_parallel)
        assert Placement.from_config(resolved, gpus).pool_of("actor").dims() == best.dims()
    on_h200 = resolve_auto_layout(cfg, arch, world_size=8, gpus_per_node=8, gpu=("NVIDIA H200", 139.8))
    assert (on_h200.parallel.tp, on_h200.parallel.pp, on_h200.rollout.gen_tp) == (1, 1, 1)
    # On 80 GiB tp=1 pp=1 does not fit; tp=2 pp=1 does, but its collectives and half-width GEMMs are predicted to
    # cost more than a pipeline's 0.6 % bubble (the former cost key, smaller tp·pp after the bubble, took tp=2).
    on_80 = resolve_auto_layout(cfg, arch, world_size=8, gpus_per_node=8, gpu=("NVIDIA H100", 80.0))
    assert (on_80.parallel.tp, on_80.parallel.pp, on_80.rollout.gen_tp) == (1, 2, 1)
    assert resolve_auto_layout(load_config(GRPO_7B, check_paths=False), arch, world_size=8, gpus_per_node=8,
                               gpu=("x", 1.0)).parallel.layout == "manual"  # manual: untouched, nothing planned


def test_auto_layout_that_nothing_fits_is_one_line_naming_the_fix():
    from verl_mega.planning.auto import resolve_auto_layout

    with pytest.raises(ConfigError) as err:
        resolve_auto_layout(_auto_cfg(), _arch("llama-2-70b"), world_size=2, gpus_per_node=2,
                            gpu=("NVIDIA H200", 139.8))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("parallel.layout=auto: no layout of 2 GPUs of 139.8 GiB fits")
    assert "GiB per GPU" in msg and "model.recompute=full" in msg and "more GPUs" in msg


def test_auto_layout_conflicts_are_config_errors():
    from verl_mega.planning.auto import choose_layout

    with pytest.raises(ConfigError, match="parallel.layout=auto chooses the layout, but parallel.tp=2 is set"):
        _auto_cfg("parallel.tp=2")
    cfg = load_config(REPO / "configs" / "ppo_llama2_7b_two_pools.yaml",
                      ["parallel.layout=auto", "parallel.sequence_parallel=false"], check_paths=False)
    with pytest.raises(ConfigError, match="placement.pools is set"):
        choose_layout(cfg, _arch("llama-2-7b"), Cluster(gpus=1024, gpus_per_node=8, gpu_mem_gib=80))


def test_build_job_runs_on_the_auto_layout(monkeypatch, tmp_path):
    """The run takes the resolved config before anything is placed: setup hands the planner the world size and the
    ranks per node from the launcher, and builds the placement from its choice."""
    from verl_mega.parallel import launch_env
    from verl_mega.parallel.placement import Placement
    from verl_mega.planning import auto
    from verl_mega.trainer import setup

    (tmp_path / "config.json").write_text((CONFIGS / "qwen2.5-7b.json").read_text())
    seen = {}

    class Stop(Exception):
        pass

    class Env:
        world_size, local_world_size, rank = 8, 8, 0

        def export_to_os_environ(self):
            pass

    def placement(cfg, world):
        seen["cfg"], seen["world"] = cfg, world
        raise Stop

    monkeypatch.setattr(launch_env, "discover", lambda: Env())
    monkeypatch.setattr(setup, "resolve_model_path", lambda cfg: tmp_path)
    monkeypatch.setattr(auto, "local_gpu", lambda gpus_per_node: ("NVIDIA H200", 139.8))
    monkeypatch.setattr(Placement, "from_config", placement)
    with pytest.raises(Stop):
        setup.build_job(_auto_cfg(f"model.path={tmp_path}"))  # the recipe's hub ID would be fetched
    cfg = seen["cfg"]
    assert seen["world"] == 8 and cfg.parallel.layout == "manual"
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.rollout.gen_tp) == (1, 1, 1)


def test_plan_cli_shows_time_per_phase_and_the_auto_choice(capsys):
    spec = importlib.util.spec_from_file_location("plan_cli", REPO / "tools" / "plan.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    argv = ["--config", str(GRPO_7B), "--model", str(CONFIGS / "qwen2.5-7b.json"), "--gpus", "8", "--gpu-mem-gb",
            "139.8", "--set", "parallel.layout=auto"]
    assert cli.main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    best = data["plans"][0]
    assert data["auto_choice"]["rank"] == 1 and (best["tp"], best["pp"], best["dp"], best["gen_tp"]) == (1, 1, 8, 1)
    assert set(best["time_s"]) == {"rollout", "reshard", "score", "train"}
    assert best["step_time_s"] == pytest.approx(sum(best["time_s"].values()), abs=1e-3)
    assert data["workload"]["step_samples"] == 1024 * 5 and data["workload"]["response_len"] == 1024
    assert cli.main([*argv, "--top", "3"]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x.lstrip()[:2] in ("1.", "2.", "3.")]
    assert len(lines) == 3 and all(re_step(x) for x in lines)
    assert "parallel.layout=auto takes #1: tp=1 pp=1 dp=8 gen_tp=1" in out


def re_step(line: str) -> bool:
    import re

    return re.search(r"step [\d.]+ s \(rollout [\d.]+ \+ reshard [\d.]+ \+ score [\d.]+ \+ train [\d.]+\)",
                     line) is not None


def test_time_model_rejects_a_mismatched_step():
    lay = training_pool(tp=1, pp=1, dp=1, gen_tp=1)
    work = Workload(micro_batch=1, seq_len=32)
    mem = predict_memory(SMALL, lay, work, roles=ACTOR_REF, rollout=RolloutSpec(kv_cache_bytes=2**20))
    with pytest.raises(ValueError, match="seq_len=32"):
        predict_time(SMALL, lay, work, StepShape(samples=1, prompt_len=8, response_len=8), mem, roles=ACTOR_REF,
                     rollout=RolloutSpec(kv_cache_bytes=2**20))
    assert math.isfinite(predict_time(SMALL, lay, work, StepShape(samples=1, prompt_len=16, response_len=16), mem,
                                      roles=ACTOR_REF, rollout=RolloutSpec(kv_cache_bytes=2**20)).total)


def test_grpo_step_matches_the_measurement():
    """BENCHMARKS.md GRPO config C, a whole step no constant was fitted to: 9.81 s per step measured (rollout 4.38,
    old + reference log-probs 1.18 + 1.13, actor update 3.05)."""
    arch = _arch("qwen2.5-1.5b")
    lay = training_pool(tp=2, pp=1, dp=1, gen_tp=1)
    work = Workload(micro_batch=8, seq_len=1028, num_microbatches=16)
    roles, rollout = default_roles(critic=False), RolloutSpec(gpu_memory_utilization=0.35)
    step = StepShape(samples=128, prompt_len=4, response_len=1024, n=8)
    mem = predict_memory(arch, lay, work, roles=roles, rollout=rollout, gpu_mem_bytes=139.8 * GiB)
    pred = predict_time(arch, lay, work, step, mem, roles=roles, rollout=rollout)
    assert pred.total == pytest.approx(9.81, rel=0.10)
    assert pred.phases["train"] == pytest.approx(3.05, rel=0.15)
    assert pred.phases["score"] == pytest.approx(2.31, rel=0.2)


@pytest.mark.parametrize("flag,value", [("--gpu-mem-gb", "nan"), ("--gpu-mem-gb", "inf"), ("--reserve-gb", "nan"),
                                        ("--gpu-memory-utilization", "inf")])
def test_plan_cli_names_a_flag_that_is_not_a_finite_number(capsys, flag, value):
    spec = importlib.util.spec_from_file_location("plan_cli", REPO / "tools" / "plan.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    with pytest.raises(SystemExit) as info:
        cli.main(["--model", str(CONFIGS / "qwen2.5-7b.json"), "--gpus", "8", flag, value])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err == f"error: argument {flag}: '{value}' is not a finite number; see --help"


def test_auto_layout_plans_every_shipped_recipe(tmp_path, capsys):
    """`--set parallel.layout=auto` (docs/planning.md) on each recipe of configs/: the override replaces the
    recipe's pinned layout and the planner picks one. The two-pool recipes unset their pools (placement=null; a
    rollout pool's staleness then goes to 0), as the error for auto with pools says."""
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.planning.auto import choose_layout
    from verl_mega.trainer.setup import tiny_sizes

    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert len(recipes) >= 9
    for recipe in recipes:
        cfg = load_config(recipe, ["parallel.layout=auto"], check_paths=False)
        extra = []
        if cfg.placement.pools:
            with pytest.raises(ConfigError, match="placement.pools is set; set parallel.layout=manual, or unset the "
                                                  "pools with placement=null"):
                choose_layout(cfg, _arch("llama-2-7b"), Cluster(gpus=8, gpus_per_node=8, gpu_mem_gib=80.0))
            extra = ["placement=null"] + (["rollout.max_staleness=0"] if cfg.rollout.max_staleness else [])
            cfg = load_config(recipe, ["parallel.layout=auto", *extra], check_paths=False)
        if cfg.model.path == "tiny":
            model = tmp_path / cfg.model.tiny_arch
            if not model.exists():
                make_tiny_hf_model(model, with_tokenizer=False, **tiny_sizes(cfg.model.tiny_arch))
            arch, cluster = arch_from_hf(load_hf_config(model)), Cluster(gpus=2, gpus_per_node=2, gpu_mem_gib=8.0)
        else:
            arch = _arch("qwen2.5-7b" if "qwen" in recipe.name else "llama-2-7b")
            cluster = Cluster(gpus=8, gpus_per_node=8, gpu_mem_gib=80.0)
        chosen = choose_layout(cfg, arch, cluster).cfg
        assert chosen.parallel.layout == "manual" and chosen.parallel.tp * chosen.parallel.pp <= cluster.gpus, recipe
    # the documented command itself
    spec = importlib.util.spec_from_file_location("plan_cli", REPO / "tools" / "plan.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    assert cli.main(["--config", str(REPO / "configs" / "ppo_llama2_7b.yaml"), "--model",
                     str(CONFIGS / "llama-2-7b.json"), "--gpus", "8", "--gpu-mem-gb", "80", "--set",
                     "parallel.layout=auto"]) == 0
    assert "parallel.layout=auto takes #1: " in capsys.readouterr().out
