"""3D-HybridEngine on CPU: Megatron-Core (gloo) → in-process vLLM-CPU, for (p, t) → tg layouts.

Each case is one torchrun job (``jobs/hybrid_sync_job.py``) that asserts, on every rank: greedy vLLM tokens after
the sync equal HF ``generate`` on the perturbed (DeepSeek-V3: other) weights; every tensor handed to vLLM equals
what vLLM's own loader cuts from the full tensor; bytes received equal a first-principles count; vLLM vs Megatron
log-probs agree. Here the Table-2 formula is checked on the reported per-rank bytes.
"""

import json
import math

import pytest

from torchrun_util import run_torchrun, tagged_report
from verl_mega.models.tiny import make_tiny_hf_model, moe_fields

# (pp, tp, gen_tp, ranks, model, vocab, tied, (hidden, heads, kv heads)). vocab 300 misaligns Megatron's and
# vLLM's vocab padding, so embedding rows travel point-to-point; 512 aligns them, making bytes exactly Table 2.
SMALL, WIDE = (128, 4, 2), (256, 8, 4)  # head_dim 32 (vLLM-CPU needs ≥ 32); WIDE lets t=4 split the KV heads
CASES = [
    (1, 2, 2, 2, "qwen2", 300, False, SMALL),
    (1, 2, 1, 2, "llama", 512, True, SMALL),
    (2, 1, 1, 2, "qwen3", 512, False, SMALL),
    (2, 2, 2, 4, "llama", 512, False, SMALL),
    (1, 4, 2, 4, "qwen2", 512, False, WIDE),  # strided generation TP groups {0,2},{1,3}
]


def _ids(case):
    pp, tp, tg, n, model, vocab, tied, _ = case
    return f"p{pp}t{tp}-tg{tg}-{model}-v{vocab}" + ("-tied" if tied else "")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_hybrid_sync(case, tmp_path):
    pp, tp, tg, nproc, model_type, vocab, tied, (h, heads, kv) = case
    f, d, layers = 2 * h, h // heads, 2 * pp
    model_dir = make_tiny_hf_model(tmp_path / model_type, model_type=model_type, vocab_size=vocab,
                                   hidden_size=h, intermediate_size=f, num_heads=heads, num_kv_heads=kv,
                                   num_layers=layers, tie_word_embeddings=tied, init_std=0.1, with_tokenizer=False)
    out = run_torchrun("hybrid_sync_job.py", nproc, "--pp", str(pp), "--tp", str(tp), "--gen-tp", str(tg),
                       "--model-dir", str(model_dir), timeout=540)
    report = tagged_report(out, "HYBRID")
    ranks = report["ranks"]
    assert len(ranks) == nproc and all(r["checked"] > 0 for r in ranks)

    # HybridFlow Table 2 on the TP-sharded part of the model; norms are replicated in Megatron's TP group and
    # only cross stages. With aligned vocab padding this is exact per rank (p = 1) or on average (p > 1: the
    # embedding and LM head sit on the first/last stage only).
    elem = 4
    sharded_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * f
    if model_type == "qwen2":
        sharded_layer += heads * d + 2 * kv * d
    replicated = layers * (2 * h + (2 * d if model_type == "qwen3" else 0)) + h
    sharded = (layers * sharded_layer + vocab * h * (1 if tied else 2)) * elem
    table2 = (tp * pp - tg) / (tg * tp * pp) * sharded
    mean = sum(r["bytes"] for r in ranks) / nproc
    if vocab % (128 * tp) == 0:
        assert math.isclose(mean, table2 + (pp - 1) / pp * replicated * elem, rel_tol=1e-12), (mean, table2)
        if pp == 1:
            assert all(r["bytes"] == table2 for r in ranks)
    # the reference path moves (t·p - 1)/(t·p) of everything to every rank; ours (t·p - tg)/(tg·t·p)
    for r in ranks:
        assert r["ref_bytes"] > r["bytes"] if tg > 1 else r["ref_bytes"] >= r["bytes"]
        assert r["lp_diff"] < 1e-4
    print(_ids(case), json.dumps({k: report[k] for k in ("model_bytes", "predicted_bytes")}),
          json.dumps([{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in ranks]))


# Mixture of experts: (pp, tp, ep, etp, gen_tp, ranks, model). 8 experts of width 64, top-2, hidden 128 (vLLM-CPU's
# fused-MoE kernel wants multiples of 32: 64/tg is). Experts cross EP ranks (ep=2), expert TP against generation TP
# (etp=1 vs tg=2), micro-DP gathers (tp=2, tg=1), pipeline stages with a shared expert (qwen2_moe).
MOE_CASES = [
    (1, 2, 2, 1, 2, 2, "qwen3_moe"),
    (1, 2, 1, 2, 1, 2, "mixtral"),
    (2, 1, 2, 1, 1, 4, "qwen2_moe"),
]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", MOE_CASES, ids=lambda c: f"p{c[0]}t{c[1]}ep{c[2]}etp{c[3]}-tg{c[4]}-{c[6]}")
def test_hybrid_sync_moe(case, tmp_path):
    """The job's checks for MoE: greedy vLLM tokens after the sync equal HF generate, every vLLM tensor (fused
    w13/w2 experts included) equals vLLM's own loader's, bytes received equal a first-principles count of the expert
    rows each rank lacks — and equal the planner's prediction (Table 2 on the rest + the experts' own term)."""
    pp, tp, ep, etp, tg, nproc, model_type = case
    model_dir = make_tiny_hf_model(tmp_path / model_type, model_type=model_type, vocab_size=512, hidden_size=128,
                                   num_heads=4, num_kv_heads=2, num_layers=2 * pp, init_std=0.1,
                                   intermediate_size=64 if model_type == "mixtral" else 256, with_tokenizer=False,
                                   extra=moe_fields(model_type))
    out = run_torchrun("hybrid_sync_job.py", nproc, "--pp", str(pp), "--tp", str(tp), "--ep", str(ep), "--etp",
                       str(etp), "--gen-tp", str(tg), "--model-dir", str(model_dir), timeout=540)
    report = tagged_report(out, "HYBRID")
    ranks = report["ranks"]
    assert len(ranks) == nproc and all(r["checked"] > 0 and r["lp_diff"] < 1e-4 for r in ranks)
    assert all(r["bytes"] == r["predicted"] for r in ranks), ranks  # exact: vocab 512 aligns both paddings
    # gen_tp = 1: every rank needs the whole model, the reference path cannot move more
    assert all(r["ref_bytes"] > r["bytes"] if tg > 1 else r["ref_bytes"] >= r["bytes"] for r in ranks)
    print(report["layout"], json.dumps([{k: r[k] for k in ("rank", "bytes", "predicted", "ref_bytes", "sync_s")}
                                        for r in ranks]))


def planted_deepseek(out_dir, *, seed: int = 0):
    """A tiny DeepSeek-V3 (MLA, a dense first layer, then sigmoid top-4 routing with the correction bias and a shared
    expert) whose greedy choices are decided by clear margins: each token's embedding is a large share of the residual
    stream and the LM head prefers its successor, while the layers still move the logits (they change the greedy
    path of some prompts). vLLM-CPU runs MLA only in bf16, where near-ties of random weights would flip greedy tokens
    between vLLM and HF; measured: top-2 logit margins of at least 1.25 along the test's greedy paths, in fp32 and
    bf16 alike."""
    import torch
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(out_dir, model_type="deepseek_v3", vocab_size=512, hidden_size=128, intermediate_size=256,
                              num_heads=4, num_kv_heads=4, num_layers=2, init_std=0.1, with_tokenizer=False, seed=seed,
                              extra=moe_fields("deepseek_v3"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        unit = torch.nn.functional.normalize(hf.model.embed_tokens.weight, dim=-1)
        hf.model.embed_tokens.weight.copy_(16 * unit)
        hf.lm_head.weight.copy_(20 * torch.roll(unit, 1, 0))
    hf.save_pretrained(path)
    return path


# DeepSeek-V3 (pp, tp, ep, etp, gen_tp): vLLM TP=2 over MLA heads with experts across EP ranks (tg=2 slices of their
# width); pipeline stages of different layers (dense | MoE) exchanged with the router's fp32 correction bias.
DEEPSEEK_CASES = [(1, 2, 2, 1, 2), (2, 1, 1, 1, 1)]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", DEEPSEEK_CASES, ids=lambda c: f"p{c[0]}t{c[1]}ep{c[2]}etp{c[3]}-tg{c[4]}")
def test_hybrid_sync_deepseek(case, tmp_path):
    """DeepSeek-V3 in bf16 (vLLM-CPU's MLA runs only in bf16): vLLM starts from other weights; after the in-place
    sync its greedy tokens equal HF generate's, every vLLM tensor (fused_qkv_a_proj, the W_UK_T / W_UV vLLM splits
    out of kv_b_proj after the sync, fused experts, the fp32 correction bias) equals what vLLM's own loader builds,
    each rank's bytes equal a first-principles count and the planner's prediction, and Megatron's log-probs of vLLM's
    tokens are within two bf16 spacings of the largest logit of vLLM's (logits here reach |z| ~ 130, where bf16's
    spacing is 1: the rounding of two kernels, 0.19 apart on this AVX2-only CPU)."""
    pp, tp, ep, etp, tg = case
    model_dir = planted_deepseek(tmp_path / "deepseek_v3")
    other = make_tiny_hf_model(tmp_path / "start", model_type="deepseek_v3", vocab_size=512, hidden_size=128,
                               intermediate_size=256, num_heads=4, num_kv_heads=4, num_layers=2, init_std=0.1,
                               with_tokenizer=False, seed=1, extra=moe_fields("deepseek_v3"))
    out = run_torchrun("hybrid_sync_job.py", tp * pp, "--pp", str(pp), "--tp", str(tp), "--ep", str(ep), "--etp",
                       str(etp), "--gen-tp", str(tg), "--model-dir", str(model_dir), "--vllm-model-dir", str(other),
                       "--perturb", "0", "--dtype", "bfloat16", "--lp-tol-ulps", "2", timeout=540)
    report = tagged_report(out, "HYBRID")
    ranks = report["ranks"]
    assert len(ranks) == tp * pp and all(r["checked"] > 0 for r in ranks)
    assert all(r["bytes"] == r["predicted"] for r in ranks), ranks
    print(report["layout"], json.dumps([{k: r[k] for k in ("rank", "bytes", "predicted", "ref_bytes", "sync_s",
                                                           "lp_diff")} for r in ranks]))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_expert_parallel_generation_slices(tmp_path):
    """Expert-parallel generation (gen_ep > 1) on 4 ranks, tiny DeepSeek-V3 (vLLM-CPU cannot run expert
    parallelism: its fused-MoE kernel fails; tests/gpu/test_ep_generation_gpu.py runs vLLM itself): each rank's
    producer output is exactly what vLLM's expert map gives its EP rank — E/gen_ep whole experts, no other — plus its
    attention TP slices, all equal to the HF tensors; bytes received equal a first-principles count and the planner's
    prediction; the transient peak stays within the pipeline's layer step."""
    model_dir = make_tiny_hf_model(tmp_path / "deepseek_v3", model_type="deepseek_v3", vocab_size=512, init_std=0.1,
                                   num_kv_heads=4, with_tokenizer=False, extra=moe_fields("deepseek_v3"))
    report = tagged_report(run_torchrun("ep_generation_job.py", 4, "--model-dir", str(model_dir), timeout=540),
                           "EPGEN")
    for layout, ranks in report.items():
        slices = sorted({tuple(r["experts"]) for r in ranks})  # the EP ranks' experts partition the 8 experts
        assert len(ranks) == 4 and [e for s in slices for e in s] == list(range(8)), layout
        print(layout, json.dumps([{k: r[k] for k in ("rank", "gen_ep_rank", "bytes", "peak")} for r in ranks]))
    assert any(r["bytes"] > 0 for r in report["tp2-dp2-ep2-gen_tp2-gen_ep4"])  # experts do move between ranks
