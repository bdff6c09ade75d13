"""The rollout-only loop: greedy generations equal HF `generate`, and a scoring environment rewards samples."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.rollout.quick import rollout_only


class AdditionEnv:
    def prompts(self):
        return ["1+2=", "3+4="]

    def score(self, prompt, response):
        a, b = int(prompt[0]), int(prompt[2])
        return float(response.strip().startswith(str(a + b)))


def test_rollout_only_greedy_matches_hf(tmp_path):
    path = make_tiny_hf_model(tmp_path / "m", model_type="qwen2", init_std=0.2)
    samples = rollout_only(path, AdditionEnv(), n=1, max_tokens=6, temperature=0.0)
    assert [s["prompt"] for s in samples] == ["1+2=", "3+4="]
    assert all("reward" in s and s["reward"] in (0.0, 1.0) for s in samples)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    for s in samples:
        ids = torch.tensor([tok.encode(s["prompt"], add_special_tokens=False)])
        ref = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert s["token_ids"] == ref[: len(s["token_ids"])] and len(s["token_ids"]) == len(ref)
