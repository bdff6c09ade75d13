"""The tiny model's warm start: stopping at a demonstration probability instead of a step count."""

import torch

from verl_mega.data.tasks import generated_task
from verl_mega.models.tiny import _demonstration_probability, encode_demonstration, make_tiny_hf_model, warm_start
from verl_mega.trainer.setup import TINY_SIZES


def _reference_probability(model, tok, records) -> float:
    """Token by token, each prefix through the model afresh, in float64: the chance of sampling each demonstration."""
    total = 0.0
    for r in records:
        prompt, answer, trained = encode_demonstration(tok, r)
        p, context = 1.0, list(prompt)
        for token, train in zip(answer, trained):
            with torch.no_grad():
                probs = torch.softmax(model(input_ids=torch.tensor([context])).logits[0, -1].double(), -1)
            p *= float(probs[token]) if train else 1.0
            context.append(token)
        total += p
    return total / len(records)


def test_demonstration_probability_matches_a_token_by_token_reference(tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    make_tiny_hf_model(tmp_path / "m", seed=0, **TINY_SIZES)
    records = generated_task("generated:calculator").generate(6, seed=0)
    warm_start(tmp_path / "m", records, steps=30, seed=0)  # away from uniform, so that the check has teeth
    tok = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "m"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m"), dtype=torch.float32).eval()
    encoded = [encode_demonstration(tok, r) for r in records]
    width = max(len(p) + len(a) for p, a, _ in encoded)
    ids = torch.full((len(encoded), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, (p, a, t) in enumerate(encoded):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p): len(p) + len(a)] = torch.where(torch.tensor(t), torch.tensor(a), -100)
    want = _reference_probability(model, tok, records)
    assert want > 1e-6
    assert abs(_demonstration_probability(model, ids, labels) - want) < 1e-5 * max(want, 1e-3)


def test_warm_start_stops_at_its_target(tmp_path):
    records = generated_task("generated:addition_small").generate(256, seed=0)
    make_tiny_hf_model(tmp_path / "a", seed=0, **TINY_SIZES)
    make_tiny_hf_model(tmp_path / "b", seed=0, **TINY_SIZES)
    reached = warm_start(tmp_path / "a", records, steps=200, seed=0, target=0.3)
    assert reached["demonstration_probability"] >= 0.3 and reached["steps"] % 5 == 0 and reached["steps"] < 200
    # the same run without a target, stopped 5 steps earlier, was still below it
    before = warm_start(tmp_path / "b", records, steps=int(reached["steps"]) - 5, seed=0)
    assert before["demonstration_probability"] < 0.3, (reached, before)
