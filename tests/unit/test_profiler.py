"""StageProfiler: interval arithmetic and step numbers checked against hand-computed values on recorded intervals."""

import sys
import threading

import pytest

from verl_mega.models.flops import transformer_flops_per_token
from verl_mega.trainer.profiler import StageProfiler, intersect, subtract, total_length, union


def test_interval_arithmetic_hand_computed():
    spans = [(5, 6), (0, 2), (1, 3), (6, 7), (8, 8), (9, 8.5)]  # touching merge; empty / reversed ignored
    assert union(spans) == [(0, 3), (5, 7)]
    assert total_length(spans) == 5.0
    assert total_length([]) == 0.0
    a, b = [(0, 4), (6, 10)], [(3, 7), (9, 12)]
    assert intersect(a, b) == [(3, 4), (6, 7), (9, 10)]
    assert subtract(a, b) == [(0, 3), (7, 9)]
    assert subtract(b, a) == [(4, 6), (10, 12)]
    assert subtract(a, []) == [(0, 4), (6, 10)]
    assert subtract(a, [(-1, 20)]) == []
    assert intersect(a, []) == []


def _pipelined_step(prof: StageProfiler) -> None:
    """One step on a synthetic timeline (seconds):

    rollout      [0, 10)  with prefill [0, 1), decode [1, 9), postprocess [9, 10)
    reward       [8, 12) and [9, 11) (two pool threads)   -> wall 4
    ref_logprob  [10, 13)                                  -> wall 3
    values       [10, 14)                                  -> wall 4
    advantage    [14, 14.5); actor_update [15, 20); weight_sync [20, 21); gap [14.5, 15) is in no stage
    """
    prof.record("rollout", 0, 10)
    prof.record("prefill", 0, 1, parent="rollout")
    prof.record("rollout/decode", 1, 9)
    prof.record("postprocess", 9, 10, parent="rollout")
    prof.record("reward", 8, 12)
    prof.record("reward", 9, 11)
    prof.record("ref_logprob", 10, 13)
    prof.record("values", 10, 14)
    prof.record("advantage", 14, 14.5)
    prof.record("actor_update", 15, 20)
    prof.record("weight_sync", 20, 21)


def test_step_summary_hand_computed():
    prof = StageProfiler(peak_flops=1e12, n_devices=2, flops_per_token=1e9)
    _pipelined_step(prof)
    prof.add_counter("tokens", 3000)
    prof.add_counter("tokens", 1200)
    prof.add_counter("decode_steps", 64)
    s = prof.step_summary()
    assert s["timing/step_s"] == 21.0
    assert s["timing/rollout_s"] == 10.0
    assert s["timing/rollout/decode_s"] == 8.0
    assert s["timing/reward_s"] == 4.0  # union of the two thread intervals, not their 6 s sum
    assert s["timing/values_s"] == 4.0
    assert s["timing/untracked_s"] == pytest.approx(0.5)
    assert s["timing/decode_step_ms"] == pytest.approx(8000 / 64)
    # Overlap of each top-level stage with all others.
    assert s["overlap/rollout_s"] == 2.0  # reward during [8, 10)
    assert s["overlap/reward_s"] == 4.0  # [8,10) rollout, [10,12) ref/values
    assert s["overlap/ref_logprob_s"] == 3.0
    assert s["overlap/values_s"] == 3.0  # [10, 13); [13, 14) alone
    assert s["overlap/actor_update_s"] == 0.0
    assert s["overlap/reward_with_rollout_s"] == 2.0
    assert s["overlap/values_with_rollout_s"] == 0.0
    # Scoring = reward ∪ ref ∪ values = [8, 14); outside rollout/advantage/update/sync: [10, 14) -> 4 s exposed.
    assert s["overlap/scoring_serial_s"] == 11.0  # 4 + 3 + 4
    assert s["overlap/scoring_exposed_s"] == 4.0
    assert s["overlap/scoring_hidden_s"] == 7.0
    assert s["overlap/efficiency"] == pytest.approx(7 / 11)
    assert s["count/tokens"] == 4200.0
    assert s["perf/tokens_per_s"] == pytest.approx(200.0)
    assert s["perf/tokens_per_s_per_device"] == pytest.approx(100.0)
    # 4200 tokens * 1e9 FLOP / 21 s / 2 devices = 1e11 FLOP/s per device = 10% of 1e12.
    assert s["perf/tflops_per_device"] == pytest.approx(0.1)
    assert s["perf/mfu"] == pytest.approx(0.1)


def test_flops_counter_overrides_flops_per_token():
    prof = StageProfiler(peak_flops=2e12, n_devices=4, flops_per_token=1.0)
    prof.record("actor_update", 0, 5)
    prof.add_counter("tokens", 10)
    prof.add_counter("flops", 8e12)
    assert prof.step_summary()["perf/mfu"] == pytest.approx(8e12 / 5 / (2e12 * 4))


def test_overlap_efficiency_extremes():
    serial = StageProfiler()
    for name, (a, b) in {"rollout": (0, 4), "reward": (4, 6), "values": (6, 9)}.items():
        serial.record(name, a, b)
    s = serial.step_summary()
    assert s["overlap/efficiency"] == 0.0 and s["overlap/scoring_exposed_s"] == 5.0

    hidden = StageProfiler()
    hidden.record("rollout", 0, 10)
    hidden.record("reward", 1, 3)
    hidden.record("ref_logprob", 2, 9)
    assert hidden.step_summary()["overlap/efficiency"] == 1.0

    # Two scoring stages hiding behind each other only: 2 + 2 serial, [0, 3) exposed -> 1/4 hidden.
    mutual = StageProfiler()
    mutual.record("reward", 0, 2)
    mutual.record("values", 1, 3)
    assert mutual.step_summary()["overlap/efficiency"] == pytest.approx(0.25)

    no_scoring = StageProfiler()
    no_scoring.record("rollout", 0, 1)
    assert "overlap/efficiency" not in no_scoring.step_summary()
    assert "Overlap Efficiency" in no_scoring.format_tree()


def test_custom_scoring_stages():
    prof = StageProfiler(scoring_stages=("judge",))
    prof.record("rollout", 0, 4)
    prof.record("judge", 3, 5)
    prof.record("reward", 5, 6)  # not scoring here: counts as a stage the judge could hide behind
    s = prof.step_summary()
    assert s["overlap/scoring_serial_s"] == 2.0 and s["overlap/efficiency"] == 0.5


def test_stage_context_with_clock_and_sync_hook():
    ticks = iter(range(100))
    calls = []
    prof = StageProfiler(clock=lambda: float(next(ticks)), synchronize=lambda: calls.append("sync"))
    with prof.stage("rollout"):
        with prof.stage("decode", parent="rollout"):
            pass
        with prof.stage("rollout/postprocess", sync=False):
            pass
    with pytest.raises(KeyError):
        with prof.stage("reward", sync=False):
            raise KeyError("the interval is still recorded")
    assert prof.intervals() == {
        "rollout/decode": [(1.0, 2.0)],
        "rollout/postprocess": [(3.0, 4.0)],
        "rollout": [(0.0, 5.0)],
        "reward": [(6.0, 7.0)],
    }
    assert calls == ["sync"] * 4  # entry and exit of the two synced stages
    assert prof.overlap("rollout", "rollout/decode") == 1.0


def test_bad_input_errors():
    prof = StageProfiler()
    with pytest.raises(ValueError, match="before start"):
        prof.record("rollout", 2.0, 1.0)
    with pytest.raises(ValueError, match="invalid"):
        prof.record("/rollout", 0.0, 1.0)
    with pytest.raises(ValueError, match="n_devices"):
        StageProfiler(n_devices=0)
    with pytest.raises(ValueError, match="peak_flops"):
        StageProfiler(peak_flops=0.0)
    assert prof.step_summary() == {}


def test_reset_step_clears_intervals_and_counters():
    prof = StageProfiler()
    _pipelined_step(prof)
    prof.add_counter("tokens", 5)
    prof.reset_step()
    assert prof.intervals() == {} and prof.counters() == {} and prof.step_summary() == {}
    prof.record("actor_update", 100, 103)
    assert prof.step_summary()["timing/step_s"] == 3.0


def test_concurrent_stages_of_one_name_from_threads():
    """Threads are all inside a stage of the same name at once; each interval must pair its own thread's start
    and end (a per-name "open stage" slot would mix them up), and nothing may be lost."""
    n_threads, rounds = 4, 50
    local = threading.local()

    def clock() -> float:  # each thread has its own timeline: thread k ticks k*1e6 + 1, + 2, ...
        local.ticks = getattr(local, "ticks", 0) + 1
        return 1e6 * local.k + local.ticks

    prof = StageProfiler(clock=clock)
    barrier = threading.Barrier(n_threads, timeout=30)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often so unguarded read-modify-writes would show

    def work(k: int) -> None:
        local.k = k
        for i in range(rounds):
            with prof.stage("reward", sync=False):
                barrier.wait()  # every thread is inside "reward" here
            prof.record("values", 1e6 * k + i, 1e6 * k + i + 0.5)
            prof.add_counter("tokens", 1)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(old_interval)
    assert not any(t.is_alive() for t in threads)
    iv = prof.intervals()
    assert len(iv["reward"]) == len(iv["values"]) == n_threads * rounds
    for start, end in iv["reward"]:
        assert end - start == 1.0 and start // 1e6 == end // 1e6, (start, end)
    assert prof.counters()["tokens"] == n_threads * rounds
    s = prof.step_summary()
    assert s["timing/reward_s"] == n_threads * rounds * 1.0  # disjoint per-thread timelines
    assert s["timing/values_s"] == n_threads * rounds * 0.5


def test_format_tree_has_promised_sections():
    prof = StageProfiler(peak_flops=1e12, flops_per_token=1e9)
    _pipelined_step(prof)
    prof.record("rm_score", 9, 12)
    prof.record("my_filter", 21, 21.5)
    prof.add_counter("tokens", 4200)
    prof.add_counter("decode_steps", 64)
    tree = prof.format_tree(step=7)
    lines = tree.splitlines()
    assert lines[0] == "Step profile (step 7)"
    for section in ("Rollout Generation", "Prefill", "Decode Loop", "Postprocess", "Critic Scoring",
                    "RM Evaluation", "Reference Log-Prob", "Reward Function", "Advantage (GAE) Computation",
                    "Critic Update", "Actor Update", "Weight Sync", "My Filter", "Total Wall Time",
                    "Overlap Efficiency", "MFU"):
        assert section in tree, section
    order = [next(i for i, line in enumerate(lines) if label in line)
             for label in ("Rollout Generation", "Prefill", "Decode Loop", "Postprocess", "Critic Scoring",
                           "Actor Update", "Total Wall Time", "Overlap Efficiency")]
    assert order == sorted(order)
    assert "avg 125.00 ms/step over 64 steps" in tree
    critic_update = next(line for line in lines if "Critic Update" in line)
    assert "not run" in critic_update
    rm = next(line for line in lines if "RM Evaluation" in line)
    assert "overlap with rollout 1.000s (33.3%)" in rm  # [9, 12) ∩ [0, 10) = 1 s of 3 s
    assert "21.500s" in next(line for line in lines if "Total Wall Time" in line)


def test_transformer_flops_against_published_parameter_counts():
    # Llama-2-7B: 6,738,415,616 parameters; minus the input embedding (32000*4096) and the 65 RMSNorm vectors
    # (4096 each) leaves the weights that enter a matmul per token (the untied LM head included).
    n_llama = 6_738_415_616 - 32000 * 4096 - 65 * 4096
    train = transformer_flops_per_token(32, 4096, 11008, 32, 32, 128, 32000, 4096, training=True)
    assert train == 6 * n_llama + 12 * 32 * 32 * 128 * 4096
    infer = transformer_flops_per_token(32, 4096, 11008, 32, 32, 128, 32000, 512, training=False)
    assert infer == 2 * n_llama + 4 * 32 * 32 * 128 * 512

    # Mistral-7B (GQA, 8 KV heads): 7,241,732,096 parameters, same embedding/norm layout.
    n_mistral = 7_241_732_096 - 32000 * 4096 - 65 * 4096
    assert transformer_flops_per_token(32, 4096, 14336, 32, 8, 128, 32000, 0, training=False) == 2 * n_mistral

    # GPT-2 small (plain MLP, tied LM head): 124,439,808 parameters minus position embeddings (1024*768), biases
    # (12 * (2304 + 768 + 3072 + 768)) and LayerNorms (25 * 2 * 768); the tied wte counts once, as the LM head.
    n_gpt2 = 124_439_808 - 1024 * 768 - 12 * (2304 + 768 + 3072 + 768) - 25 * 2 * 768
    gpt2 = transformer_flops_per_token(12, 768, 3072, 12, 12, 64, 50257, 1024, training=True, gated_mlp=False)
    assert gpt2 == 6 * n_gpt2 + 12 * 12 * 12 * 64 * 1024
    # a frozen base (LoRA) computes its weights' input gradients only: 4N, attention still 3 forwards
    assert transformer_flops_per_token(12, 768, 3072, 12, 12, 64, 50257, 1024, training=True, gated_mlp=False,
                                       frozen_base=True) == 4 * n_gpt2 + 12 * 12 * 12 * 64 * 1024

    with pytest.raises(ValueError, match="kv_heads"):
        transformer_flops_per_token(2, 64, 128, 6, 4, 16, 100, 8, training=True)


def test_decode_step_average_needs_a_step_count():
    once = StageProfiler()
    once.record("rollout/decode", 0, 2)
    assert "timing/decode_step_ms" not in once.step_summary()
    assert "ms/step" not in once.format_tree()

    per_step = StageProfiler()
    for i in range(4):
        per_step.record("decode", i, i + 0.25, parent="rollout")
    assert per_step.step_summary()["timing/decode_step_ms"] == 250.0
    assert "avg 250.00 ms/step over 4 steps" in per_step.format_tree()


def test_step_flops_hand_computed():
    """One RL step's model FLOPs for a toy architecture, worked out by hand:
    N = 1·[4·(2+2)·2 + 2·2·4 + 3·4·8] + 4·10 = 184; per token fwd = 2N + 4·L·H·d·s = 368 + 16s,
    train = 6N + 12·L·H·d·s = 1104 + 48s. Rows of 4 and 8 tokens → s = 6: fwd 464, train 1392.
    Old log-prob (fwd) + actor update (train, 1 epoch) + reference (fwd) = 2320 per token × 12 tokens = 27840;
    generation: 6 generated tokens at mean context int(mean(2+1, 4+2)) = 4 → 6 · (368 + 64) = 2592. Total 30432.
    A critic ends in a value head: N = 184 − 4·10 + 4 = 148, fwd 296 + 16·6 = 392, train 1176."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from verl_mega.models.arch import ModelArch
    from verl_mega.trainer.rl_trainer import RLTrainer

    arch = ModelArch(model_type="qwen2", num_layers=1, hidden_size=4, ffn_hidden_size=8, num_heads=2, num_kv_heads=1,
                     head_dim=2, vocab_size=10, max_position_embeddings=16, rope_theta=1e4, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, qkv_bias=False, qk_norm=False)
    cfg = SimpleNamespace(actor=SimpleNamespace(ppo_epochs=1), critic=SimpleNamespace(ppo_epochs=1),
                          model=SimpleNamespace(lora=SimpleNamespace(enabled=False)))
    fake = SimpleNamespace(arch=arch, cfg=cfg, ref=object(), critic=None, reward_model=None,
                           old_logprobs_in_update=False)
    flops = RLTrainer._step_flops(fake, torch.tensor([2, 4]), torch.tensor([2, 4]))
    assert flops == 30432.0
    # old log-probs taken from the update's own forward pass: their pass (12 tokens × fwd 464) is not run
    fake.old_logprobs_in_update = True
    assert RLTrainer._step_flops(fake, torch.tensor([2, 4]), torch.tensor([2, 4])) == 30432.0 - 12 * 464
    fake.old_logprobs_in_update = False
    # a critic adds one forward and one forward+backward per token, with its value head: 12 · (392 + 1176) more
    fake.critic = object()
    assert RLTrainer._step_flops(fake, torch.tensor([2, 4]), torch.tensor([2, 4])) == 30432.0 + 12 * (392 + 1176)
    # LoRA: the actor's frozen base skips its weight gradients; the update is 4N + 3·16s = 736 + 288 = 1024 per
    # token instead of 1392 (the critic, trained in full, is unchanged): 12 · (1392 − 1024) fewer
    cfg.model.lora.enabled = True
    assert RLTrainer._step_flops(fake, torch.tensor([2, 4]), torch.tensor([2, 4])) == \
        30432.0 + 12 * (392 + 1176) - 12 * 368
    cfg.model.lora.enabled = False
    # MoE: a token runs k=2 routed experts of width 3 plus a shared expert of width 2, i.e. an MLP of width 8 (the
    # dense ffn_hidden_size is then unused), and its router over E=4 experts: E·h = 16 more weights, 2·16 = 32 more
    # FLOPs per forward. 12 tokens × (fwd + train + fwd = 1 + 3 + 1 forwards) + 6 generated tokens × 1 forward
    fake.critic = None
    fake.arch = dataclasses.replace(arch, model_type="qwen2_moe", ffn_hidden_size=999, num_experts=4, moe_topk=2,
                                    moe_ffn_hidden_size=3, shared_expert_ffn_hidden_size=2)
    assert RLTrainer._step_flops(fake, torch.tensor([2, 4]), torch.tensor([2, 4])) == 30432.0 + 32 * (12 * 5 + 6)


def test_detect_peak_flops():
    from verl_mega.models.flops import detect_peak_flops

    assert detect_peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert detect_peak_flops("NVIDIA A100-SXM4-80GB", "float16") == 312e12
    assert detect_peak_flops("NVIDIA H200", "float32") is None  # fp32 peak differs: no guess
    assert detect_peak_flops("Some Future GPU", "bfloat16") is None
    assert detect_peak_flops(None, "bfloat16") is None


def test_the_advantage_line_names_the_configured_estimator():
    for estimator, name in (("gae", "GAE"), ("grpo", "GRPO"), ("dr_grpo", "Dr. GRPO"), ("rloo", "RLOO"),
                            ("reinforce_plus_plus", "REINFORCE++"), ("remax", "ReMax")):
        prof = StageProfiler(advantage_estimator=estimator)
        prof.record("advantage", 0.0, 1.0)
        lines = [line for line in prof.format_tree().splitlines() if "Advantage" in line]
        assert len(lines) == 1 and f"Advantage ({name}) Computation" in lines[0], (estimator, lines)
