"""The GRPO benchmark's two trainers on CPU (tiny model, 2 ranks, tp=2): the HF-generate baseline samples from the
same weights as Megatron (its sampled-token log-probs equal Megatron's), and both runs train the same actor."""

import json
from pathlib import Path

from torchrun_util import run_torchrun

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_grpo_gpu.py"


def test_bench_grpo_cpu(tmp_path):
    out = tmp_path / "grpo.json"
    run_torchrun(str(BENCH), 2, "--tiny", "--model-dir", str(tmp_path / "tiny"), "--prompts", "4",
                 "--group-size", "4", "--response-length", "16", "--steps", "2", "--baseline-steps", "2",
                 "--out", str(out), timeout=420)
    res = json.loads(out.read_text())
    hybrid, baseline = res["hybrid_steps"], res["baseline_steps"]
    assert len(hybrid) == 2 and len(baseline) == 2
    for step in hybrid + baseline:
        # fp32 on CPU: the rollout's own log-probs of its tokens equal Megatron's recomputation (weights in sync)
        assert step["rollout/logprob_diff_max"] < 1e-4, step["rollout/logprob_diff_max"]
        assert step["count/tokens"] == 4 * 4 * 16  # fixed-length generation: every sample has 16 tokens
    # each hybrid rollout ran on the weights of the previous update
    assert [s["rollout/weight_version"] for s in hybrid] == [s["actor/version"] for s in hybrid]
    # the baseline continued training the same actor
    versions = [s["actor/version"] for s in hybrid + baseline]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert res["speedup_step"] > 0 and res["baseline"]["rollout_s"] > 0
