"""Disaggregated weight sync on CPU: a Megatron-Core training pool (gloo) broadcasts each generation block in
buckets to rank j of every rollout engine; see ``jobs/pool_sync_job.py`` for what each rank checks. Here: the
zero-redundancy accounting across ranks."""

import json

import pytest

from torchrun_util import run_torchrun, tagged_report
from verl_mega.models.tiny import make_tiny_hf_model

pytestmark = pytest.mark.slow

# (tp, pp, ranks, model, vocab, tied): tp=2 → two rollout engines (the training pair gathers its halves);
# pp=2 → one engine (stages exchange their layers); vocab 300 misaligns Megatron's and vLLM's vocab padding
CASES = [(2, 1, 4, "qwen2", 300, False), (1, 2, 3, "llama", 512, True)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}p{c[1]}-{c[2] - c[0] * c[1]}engines-{c[3]}")
def test_pool_sync(case, tmp_path):
    tp, pp, nproc, model_type, vocab, tied = case
    model_dir = make_tiny_hf_model(tmp_path / model_type, model_type=model_type, vocab_size=vocab, hidden_size=64,
                                   intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=2,
                                   tie_word_embeddings=tied, init_std=0.1, with_tokenizer=False)
    out = run_torchrun("pool_sync_job.py", nproc, "--tp", str(tp), "--pp", str(pp), "--model-dir", str(model_dir),
                       "--work", str(tmp_path), timeout=240)
    ranks = tagged_report(out, "POOLSYNC")["ranks"]
    receivers = [r for r in ranks if not r["trains"]]
    senders = [r for r in ranks if r["trains"] and r["sends"]]
    assert len(receivers) == nproc - tp * pp and len(senders) == 1, json.dumps(ranks)
    for round_ in (0, 1):
        # one block (tg=1): the source sends the model once per sync, whatever the number of engines; every
        # rollout rank receives exactly its engine's model (M/tg), and no other training rank sends anything
        assert senders[0][f"sent{round_}"] == receivers[0]["model_bytes"]
        assert all(r[f"received{round_}"] == r["model_bytes"] for r in receivers)
        assert all(r[f"sent{round_}"] == 0 for r in ranks if r["trains"] and not r["sends"])
