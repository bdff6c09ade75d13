"""A reward model (reward.reward_model_path) is an HF sequence-classification checkpoint with one label: its score
head rates the last token. In one process (world of one, CPU, fp32) our reward model's scores are HF transformers'
logits for the same sequences; a critic started from such a checkpoint starts from its head; a causal LM given as a
reward model is refused before anything is built."""

from pathlib import Path

import pytest
import torch

from verl_mega.config import load_config
from verl_mega.models.hf_io import CheckpointError, HFCheckpointReader
from verl_mega.models.tiny import make_tiny_hf_model, make_tiny_reward_model
from verl_mega.trainer.batch import Batch, pack_sequences

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml"


@pytest.fixture(scope="module")
def world():
    from verl_mega.parallel.state import init_distributed

    return init_distributed(tp=1, pp=1)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    """A tiny causal LM turned into a one-label sequence classifier by HF itself (a score head of its own)."""
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm") / "reward_model", seed=3)


def test_reward_model_scores_are_hf_logits_of_the_last_token(world, reward_model_dir):
    from transformers import AutoModelForSequenceClassification

    from verl_mega.trainer import setup
    from verl_mega.trainer.roles import RewardModel

    cfg = load_config(QUICKSTART, ["model.dtype=float32"], check_paths=False)
    engine = setup.build_role_engine(cfg, world, reward_model_dir, scores=True).engine
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 30, (n,), generator=gen).tolist() for n in (3, 6, 4)]
    responses = [torch.randint(5, 30, (n,), generator=gen).tolist() for n in (5, 2, 7)]
    batch = Batch(dict(pack_sequences(prompts, responses, pad_id=0, max_response_length=8)), {})
    ours = RewardModel(engine, micro_batch_size=2).score(batch)
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([p + r])).logits[0, 0] for p, r in zip(prompts, responses)])
    torch.testing.assert_close(ours.float(), want, rtol=0, atol=1e-5)


def test_a_critic_starts_from_a_score_head_and_a_causal_lm_is_no_reward_model(world, reward_model_dir, tmp_path):
    from verl_mega.models.build import ValueHead
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config
    from verl_mega.models.loader import check_checkpoint_matches
    from verl_mega.trainer import setup

    cfg = load_config(QUICKSTART, ["model.dtype=float32"], check_paths=False)
    critic = setup.build_role_engine(cfg, world, reward_model_dir, value_head=True).engine
    head = next(m for m in critic.modules[0].modules() if isinstance(m, ValueHead))
    assert torch.equal(head.weight, HFCheckpointReader(reward_model_dir).get("score.weight"))
    causal = make_tiny_hf_model(tmp_path / "causal", seed=3)
    arch = arch_from_hf(load_hf_config(causal))
    check_checkpoint_matches(HFCheckpointReader(causal), arch, head="value")  # a critic may start from it
    with pytest.raises(CheckpointError, match=r"has no score.weight: a reward model is an HF sequence-classification "
                                              r"checkpoint with num_labels=1"):
        check_checkpoint_matches(HFCheckpointReader(causal), arch, head="score")
