"""Disaggregated weight sync on CPU: a Megatron-Core training pool (gloo) broadcasts each generation block in
buckets to rank j of every rollout engine; see ``jobs/pool_sync_job.py`` for what each rank checks. Here: the
zero-redundancy accounting across ranks."""

import pytest

from torchrun_util import run_torchrun, tagged_report
from verl_mega.models.tiny import make_tiny_hf_model, moe_fields

pytestmark = pytest.mark.slow

# (tp, pp, gen_tp, ranks, model, vocab, tied): tp=2 tg=1 → two one-rank engines (the training pair gathers its
# halves into one block); tp=2 tg=2 → one two-rank engine, two blocks, two sources; pp=2 → stages exchange their
# layers, here DeepSeek-V3's in bf16 (a dense MLA layer | an MoE layer whose router keeps its correction bias in
# fp32, which must arrive bit for bit); vocab 300 misaligns Megatron's and vLLM's vocab padding
CASES = [(2, 1, 1, 4, "qwen2", 300, False), (2, 1, 2, 4, "qwen2", 300, True), (1, 2, 1, 3, "deepseek_v3", 512, False)]


def _ids(c):
    tp, pp, tg, n = c[:4]
    return f"t{tp}p{pp}-{(n - tp * pp) // tg}x tg{tg}-{c[4]}" + ("-tied" if c[6] else "")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_pool_sync(case, tmp_path):
    tp, pp, tg, nproc, model_type, vocab, tied = case
    deepseek = model_type == "deepseek_v3"
    model_dir = make_tiny_hf_model(tmp_path / model_type, model_type=model_type, vocab_size=vocab,
                                   hidden_size=128 if deepseek else 64, intermediate_size=256 if deepseek else 128,
                                   num_heads=4, num_kv_heads=4 if deepseek else 2, num_layers=2,
                                   tie_word_embeddings=tied, init_std=0.1, with_tokenizer=False,
                                   extra=moe_fields(model_type) if deepseek else None)
    out = run_torchrun("pool_sync_job.py", nproc, "--tp", str(tp), "--pp", str(pp), "--gen-tp", str(tg),
                       "--dtype", "bfloat16" if deepseek else "float32", "--model-dir", str(model_dir),
                       "--work", str(tmp_path), timeout=240)
    ranks = tagged_report(out, "POOLSYNC")["ranks"]
    receivers = [r for r in ranks if not r["trains"]]
    senders = [r for r in ranks if r["trains"] and r["sends"]]
    assert len(receivers) == nproc - tp * pp and sorted(r["block"] for r in senders) == list(range(tg)), ranks
    if deepseek:  # both rounds re-derived the absorbed weights of both MLA layers
        assert all(r["mla_refreshed"] == 4 for r in receivers), receivers
    for round_ in (0, 1):
        # block j's source sends it once per sync, whatever the number of engines; every rollout rank receives
        # exactly its own slices (M/tg), and no other training rank sends anything
        for src in senders:
            assert all(src[f"sent{round_}"] == r["model_bytes"] for r in receivers if r["block"] == src["block"])
        assert all(r[f"received{round_}"] == r["model_bytes"] for r in receivers)
        assert all(r[f"sent{round_}"] == 0 for r in ranks if r["trains"] and not r["sends"])
