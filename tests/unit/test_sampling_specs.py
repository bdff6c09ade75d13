"""What a step asks vLLM for (trainer/rl_trainer.py RLTrainer.specs, rollout/base.py prompt_seed): no two samples of
a batch, nor of neighbouring steps, share a random stream, and ReMax's greedy baseline answers under the samples'
EOS rule."""

from types import SimpleNamespace

from verl_mega.config import load_config
from verl_mega.data.loader import PromptBatch
from verl_mega.rollout.base import prompt_seed
from verl_mega.trainer.rl_trainer import RLTrainer

QUICKSTART = "configs/quickstart_cpu.yaml"


def _trainer(*overrides: str) -> SimpleNamespace:
    """RLTrainer's spec methods over a config alone (they read nothing else but the tokenizer's EOS)."""
    trainer = SimpleNamespace(cfg=load_config(QUICKSTART, list(overrides), check_paths=False),
                              tokenizer=SimpleNamespace(eos_token_id=2))
    trainer._sampling = lambda batch, **kw: RLTrainer._sampling(trainer, batch, **kw)
    return trainer


def _seeds(spec, prompts: int) -> set[int]:
    """Every sample's seed: prompt i's sample j draws with prompt_seed(seed, i, n) + j, as vLLM fans a request out."""
    return {prompt_seed(spec.seed, i, spec.n) + j for i in range(prompts) for j in range(spec.n)}


def test_no_two_samples_of_a_batch_or_of_consecutive_steps_share_a_seed():
    trainer = _trainer("rollout.n=8")
    prompts = 1024
    first = RLTrainer.specs(trainer, PromptBatch([], epoch=0, batch_index=0))[0]
    second = RLTrainer.specs(trainer, PromptBatch([], epoch=0, batch_index=1))[0]
    assert len(_seeds(first, prompts)) == prompts * 8  # all distinct within the batch
    assert not _seeds(first, prompts) & _seeds(second, prompts)  # and none reused by the next step
    # dynamic sampling's further batches are batches of their own data position: their own seeds
    assert RLTrainer.specs(trainer, PromptBatch([], epoch=1, batch_index=0))[0].seed != first.seed


def test_remax_baseline_follows_the_samples_eos_rule():
    for ignore_eos in (False, True):
        trainer = _trainer("algorithm.adv_estimator=remax", f"rollout.ignore_eos={ignore_eos}")
        sampled, baseline = RLTrainer.specs(trainer, PromptBatch([], epoch=0, batch_index=0))
        assert baseline.temperature == 0.0 and baseline.n == 1
        assert baseline.ignore_eos == sampled.ignore_eos == ignore_eos
        assert baseline.stop_token_ids == sampled.stop_token_ids == (() if ignore_eos else (2,))
