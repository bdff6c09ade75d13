"""Config system: bad configs give the intended one-line errors; recipes, overrides, round trips, diffs, docs."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import re
from pathlib import Path

import pytest

from verl_mega.config import (ActorConfig, ConfigError, TrainConfig, config_from_dict, diff_configs,
                              load_config, to_dict, to_yaml)

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
QUICKSTART = str(CONFIGS / "quickstart_cpu.yaml")
# Published architecture values: (layers, attention heads, key/value heads).
QWEN25_7B, LLAMA2_7B = (28, 28, 4), (32, 32, 32)


def _error(fn, *args, **kwargs) -> str:
    with pytest.raises(ValueError) as info:  # ConfigError, PlacementError, ModelConfigError: all one line
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def _placement(cfg, world: int):
    from verl_mega.parallel.placement import Placement

    return Placement.from_config(cfg, world)


def _resolve(world: int, layers: int = 32, heads: int = 32, kv: int = 32, **parallel):
    """The start-up layout checks: the placement of `world` ranks, then the model shape against its pool."""
    from verl_mega.models.hf_config import check_layout

    cfg = load_config(QUICKSTART, [f"parallel.{k}={v}" for k, v in parallel.items()])
    pool = _placement(cfg, world).pool_of("actor")
    check_layout(pool, num_layers=layers, num_heads=heads, num_kv_heads=kv)
    return pool


# ---------------------------------------------------------------- bad configs, exact messages

def test_unknown_key_suggests_sibling():
    assert _error(load_config, None, ["actor.lrr=1e-6"]) == "unknown config key 'actor.lrr'; did you mean 'actor.lr'?"


def test_unknown_key_suggests_other_section():
    assert _error(load_config, None, ["actor.tp=2"]) == "unknown config key 'actor.tp'; did you mean 'parallel.tp'?"


def test_unknown_key_in_recipe_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("rollout:\n  temprature: 0.7\n")
    assert _error(load_config, str(recipe)) == \
        "unknown config key 'rollout.temprature'; did you mean 'rollout.temperature'?"


def test_unknown_key_suggests_near_name_in_other_section():
    assert _error(load_config, None, ["actor.temprature=1"]) == (
        "unknown config key 'actor.temprature'; did you mean 'rollout.temperature'?")


def test_unknown_section():
    assert _error(load_config, None, ["actr.lr=1"]) == "unknown config key 'actr'; did you mean 'actor'?"


def test_product_differs_from_world():
    assert _error(_resolve, 8, tp=2, dp=3) == (
        "parallel: tp·pp·cp·dp = 2·1·1·3 = 6 does not equal the world size 8; set parallel.dp=null to derive dp, "
        "or start 6 processes")


def test_world_not_divisible_by_model_parallel():
    assert _error(_resolve, 6, tp=2, pp=2) == (
        "parallel: world size 6 is not divisible by tp·pp·cp = 2·2·1 = 4; choose parallel.tp/pp/cp whose product "
        "divides 6")


def test_heads_not_divisible_by_tp():
    assert _error(_resolve, 3, heads=32, kv=32, tp=3) == (
        "parallel.tp=3 does not divide the model's 32 attention heads; set parallel.tp to one of 1, 2, 4, 8, 16, 32")


def test_kv_heads_incompatible_with_tp():
    assert _error(_resolve, 4, heads=12, kv=6, tp=4) == (
        "parallel.tp=4 does not divide the model's 6 key/value heads; set parallel.tp to one of 1, 2, 3, 6")
    # The 3D-HybridEngine converts query groups shard by shard: fewer KV heads than TP ranks is refused up front.
    assert _error(_resolve, 8, heads=32, kv=4, tp=8) == (
        "parallel.tp=8 does not divide the model's 4 key/value heads; set parallel.tp to one of 1, 2, 4")
    assert _resolve(8, heads=32, kv=4, tp=4).dp == 2


def test_layers_not_divisible_by_pp_vpp():
    assert _error(_resolve, 4, layers=12, pp=4, vpp=2) == (
        "the model's 12 layers are not divisible by parallel.pp·vpp = 4·2 = 8; choose pp·vpp among 1, 2, 3, 4, 6, "
        "12")
    assert _error(_resolve, 5, layers=12, pp=5) == (
        "the model's 12 layers are not divisible by parallel.pp=5; choose parallel.pp among 1, 2, 3, 4, 6, 12")


def test_vpp_without_pp():
    assert _error(load_config, None, ["parallel.vpp=2"]) == (
        "parallel.vpp=2 needs pipeline parallelism but parallel.pp=1; set parallel.pp>1 or parallel.vpp=null")


def test_sequence_parallel_without_tp():
    assert _error(load_config, None, ["parallel.sequence_parallel=true"]) == (
        "parallel.sequence_parallel=true needs tensor parallelism but parallel.tp=1; set parallel.tp>1 or "
        "parallel.sequence_parallel=false")


def test_bad_enum_value():
    assert _error(load_config, None, ["algorithm.adv_estimator=grpoo"]) == (
        "algorithm.adv_estimator must be one of gae | grpo | dr_grpo | rloo | reinforce_plus_plus | "
        "reinforce_plus_plus_baseline | remax, got 'grpoo'; did you mean 'grpo'?")


def test_negative_lr():
    assert _error(load_config, None, ["actor.lr=-1e-6"]) == (
        "actor.lr must be >= 0.0, got -1e-06; set actor.lr to a value >= 0.0, e.g. actor.lr=1e-06")


def test_train_batch_not_multiple_of_mini_batch():
    assert _error(load_config, QUICKSTART, ["data.train_batch_size=12", "actor.ppo_mini_batch_size=8",
                                            "rollout.n=4"]) == (
        "data.train_batch_size=12 is not a multiple of actor.ppo_mini_batch_size=8 (both in prompts; ×rollout.n=4 in "
        "samples); set actor.ppo_mini_batch_size to a divisor of 12")


def test_mini_batch_not_divisible_over_dp_and_micro():
    cfg = load_config(QUICKSTART, ["actor.ppo_mini_batch_size=2", "data.train_batch_size=6",
                                   "rollout.n=4", "actor.micro_batch_size_per_gpu=8"])  # 8 samples per mini
    assert _error(cfg.validate_runtime, _placement(cfg, 3), cuda_available=False) == (
        "actor.ppo_mini_batch_size·rollout.n = 2·4 = 8 samples do not split over 3 data-parallel ranks; make "
        "actor.ppo_mini_batch_size·rollout.n a multiple of 3")
    assert _error(cfg.validate_runtime, _placement(cfg, 2), cuda_available=False) == (
        "the actor mini-batch has 4 samples per data-parallel rank (actor.ppo_mini_batch_size·rollout.n/dp = 2·4/2), "
        "not a multiple of actor.micro_batch_size_per_gpu=8; set it to a divisor of 4")
    cfg.validate_runtime(_placement(cfg, 1), cuda_available=False)


def test_training_needs_sampling():
    for est in ("gae", "reinforce_plus_plus"):  # log-probs at logits / 0 would be NaN
        assert "rollout.temperature=0 decodes greedily, which gives the policy no log-probs to train" in _error(
            load_config, QUICKSTART, [f"algorithm.adv_estimator={est}", "rollout.temperature=0"]
            + (["critic.enable=true"] if est == "gae" else []))
    assert _error(load_config, QUICKSTART, ["algorithm.adv_estimator=remax", "rollout.temperature=0"]) == (
        "algorithm.adv_estimator=remax compares samples with the greedy answer but rollout.temperature=0 makes them "
        "the greedy answer; set rollout.temperature=1.0")


def test_dapo_and_dr_grpo_combinations():
    assert _error(load_config, QUICKSTART, ["algorithm.adv_estimator=reinforce_plus_plus",
                                            "algorithm.filter_groups.enable=true"]) == (
        "algorithm.filter_groups.enable=true drops groups of equal rewards, which only a group baseline makes "
        "useless, but algorithm.adv_estimator=reinforce_plus_plus; use grpo, dr_grpo, rloo or "
        "reinforce_plus_plus_baseline, or algorithm.filter_groups.enable=false")
    assert _error(load_config, QUICKSTART, ["algorithm.filter_groups.max_num_gen_batches=0"]).startswith(
        "algorithm.filter_groups.max_num_gen_batches")
    assert _error(load_config, QUICKSTART, ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=64"]) == (
        "reward.overlong_buffer.len=64 exceeds rollout.max_response_length=16; set reward.overlong_buffer.len<=16")
    assert _error(load_config, QUICKSTART, ["algorithm.adv_estimator=dr_grpo"]) == (
        "algorithm.adv_estimator=dr_grpo normalises the loss by a constant, but actor.loss_agg_mode=token-mean; "
        "set actor.loss_agg_mode=seq-mean-token-sum-norm")
    dr = load_config(QUICKSTART, ["algorithm.adv_estimator=dr_grpo", "actor.loss_agg_mode=seq-mean-token-sum-norm"])
    assert dr.algorithm.adv_estimator == "dr_grpo"
    assert _error(load_config, QUICKSTART, ["algorithm.adv_estimator=dr_grpo", "rollout.n=1"]).startswith(
        "algorithm.adv_estimator=dr_grpo compares samples of the same prompt but rollout.n=1")


def test_multi_turn_section():
    cfg = load_config(str(CONFIGS / "multi_turn_calculator_cpu.yaml"))
    mt = cfg.rollout.multi_turn
    assert mt.enable and mt.tools == ("calc",) and (mt.tool_call_start, mt.tool_call_end) == ("(", ")")
    assert cfg.reward.function == "calculator" and cfg.data.train_files == ("generated:calculator",)
    assert _error(load_config, QUICKSTART, ["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[]"]) == (
        "rollout.multi_turn.enable=true with no rollout.multi_turn.tools; list at least one tool")
    assert _error(load_config, QUICKSTART, ["rollout.multi_turn.enable=true", "rollout.ignore_eos=true"]) == (
        "rollout.multi_turn.enable=true ends turns at EOS but rollout.ignore_eos=true; set rollout.ignore_eos=false")
    assert _error(load_config, QUICKSTART, ["rollout.multi_turn.max_turns=0"]).startswith(
        "rollout.multi_turn.max_turns")
    assert _error(load_config, QUICKSTART, ['rollout.multi_turn.tool_call_end=""']).startswith(
        "rollout.multi_turn.tool_call_end is empty")


def test_placement_section_errors():
    assert _error(load_config, QUICKSTART, ["placement.pools={a: {tp: 2}}"]) == (
        "placement.pools.a needs size (its number of ranks), e.g. placement.pools.a.size=8")
    assert _error(load_config, QUICKSTART, ["placement.pools={a: {size: 4, tq: 2}}"]) == (
        "placement.pools.a: unknown key(s) ['tq']; pool keys are size, tp, pp, vpp, cp, ep, etp, gen_tp, gen_ep")
    assert _error(load_config, QUICKSTART, ["placement.pools={a: {size: 4}}", "placement.roles={actor: b}"]) == (
        "placement.roles.actor='b' is not a pool of placement.pools (a)")
    assert _error(load_config, QUICKSTART, ["placement.pools={a: {size: 4}}", "parallel.tp=2"]) == (
        "parallel.tp and placement.pools both set a layout; put it in placement.pools.<pool> instead")
    cfg = load_config(QUICKSTART, ["placement.pools={train: {size: 2, tp: 2}, gen: {size: 2, gen_tp: 2}}",
                                   "placement.roles={actor: train, rollout: gen}"])
    placement = _placement(cfg, 4)
    assert not placement.colocated and placement.pool("gen").num_engines == 1 and not placement.pool("gen").trains
    assert _error(_placement, cfg, 6) == ("placement: the pools hold 4 ranks but the world has 6; make the pool "
                                          "sizes add up to the number of processes")


def _build_job_as_rank0_of_two(cfg, monkeypatch):
    from verl_mega.trainer.setup import build_job

    launcher = dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", GROUP_RANK="0", NODE_RANK="0",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT="29511", VERL_MEGA_LAUNCHER="torchrun")
    for key, value in launcher.items():  # rank 0 of a 2-process torchrun job (restored afterwards)
        monkeypatch.setenv(key, value)
    return _error(build_job, cfg)


def test_trainer_refuses_placements_it_cannot_run(tmp_path, monkeypatch):
    two_pools = ["placement.pools={train: {size: 1}, gen: {size: 1}}", f"trainer.output_dir={tmp_path}"]
    cfg = load_config(QUICKSTART, [*two_pools, "ref.enable=true",
                                   "placement.roles={actor: train, ref: gen, rollout: gen}"])
    assert _build_job_as_rank0_of_two(cfg, monkeypatch).startswith(
        "placement.roles: the trainer runs every training role on the actor's pool")
    cfg = load_config(QUICKSTART, ["placement.pools={gen: {size: 1}, train: {size: 1}}",
                                   f"trainer.output_dir={tmp_path}", "placement.roles={actor: train, rollout: gen}"])
    assert _build_job_as_rank0_of_two(cfg, monkeypatch) == (
        "placement.pools: the training pool 'train' starts at rank 1; list it first in placement.pools")
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_rollout_pool_and_staleness_errors():
    colocated = load_config(QUICKSTART, ["rollout.max_staleness=1"])
    assert _error(colocated.validate_runtime, _placement(colocated, 1), cuda_available=False).startswith(
        "rollout.max_staleness=1 lets generation run ahead of training, but the rollout shares the actor's pool")
    pools = ["placement.pools={train: {size: 1}, gen: {size: 1}}", "placement.roles={actor: train, rollout: gen}"]
    colocated = load_config(QUICKSTART, ["rollout.partial_rollouts=true"])
    assert _error(colocated.validate_runtime, _placement(colocated, 1), cuda_available=False).startswith(
        "rollout.partial_rollouts=true swaps weights into a rollout pool of its own while it generates")
    for extra, start in ((["rollout.multi_turn.enable=true"], "rollout.multi_turn.enable=true runs on the actor's"),
                         (["rollout.partial_rollouts=true"], "rollout.partial_rollouts=true needs batches generating "
                                                             "while weights arrive, but rollout.max_staleness=0"),
                         (["rollout.max_staleness=2", "algorithm.filter_groups.enable=true"],
                          "algorithm.filter_groups.enable=true draws extra prompt batches as it goes"),
                         (["rollout.fleet.engines=2", "rollout.max_staleness=1", "rollout.partial_rollouts=true"],
                          "rollout.fleet.engines swaps weights between batches only")):
        cfg = load_config(QUICKSTART, pools + extra)
        assert _error(cfg.validate_runtime, _placement(cfg, 2), cuda_available=False).startswith(start), extra
    assert _error(load_config, QUICKSTART, ["rollout.max_staleness=-1"]).startswith("rollout.max_staleness")
    # what acts only on a vLLM sharing the training GPUs is refused, not ignored
    cfg = load_config(QUICKSTART, pools + ["actor.offload_params=true", "rollout.sleep_level=1"])
    assert _error(cfg.validate_runtime, _placement(cfg, 2), cuda_available=False) == (
        "actor.offload_params, rollout.sleep_level=1: these act on the switch between training and a vLLM on the same "
        "GPUs, but placement.roles.rollout gives the rollout a pool of its own; remove them or map "
        "placement.roles.rollout to the actor's pool")
    cfg = load_config(QUICKSTART, pools + ["rollout.weight_sync=reference"])
    assert _error(cfg.validate_runtime, _placement(cfg, 2), cuda_available=False).startswith(
        "rollout.weight_sync=reference: it acts on the switch")
    colocated = load_config(QUICKSTART, ["rollout.fleet.engines=2"])
    assert _error(colocated.validate_runtime, _placement(colocated, 1), cuda_available=False).startswith(
        "rollout.fleet.engines=2 supervises engines on a rollout pool of its own, but the rollout shares the actor's")
    # and what acts only on a rollout pool of its own, or on a fleet, is refused when there is none
    colocated = load_config(QUICKSTART, ["rollout.weight_bucket_mb=64", "trainer.pool_heartbeat_timeout_s=10"])
    assert _error(colocated.validate_runtime, _placement(colocated, 1), cuda_available=False) == (
        "rollout.weight_bucket_mb=64, trainer.pool_heartbeat_timeout_s=10: these act on a rollout pool of its own, "
        "but the rollout shares the actor's pool; remove them, or give the rollout a pool of its own in "
        "placement.pools/placement.roles")
    cfg = load_config(QUICKSTART, pools + ["rollout.fleet.max_restarts=7"])
    assert _error(cfg.validate_runtime, _placement(cfg, 2), cuda_available=False) == (
        "rollout.fleet.max_restarts=7: it acts on a rollout fleet, but rollout.fleet.engines=0 runs none; set "
        "rollout.fleet.engines, or remove it")
    cfg = load_config(QUICKSTART, pools + ["rollout.fleet.engines=1", "rollout.fleet.max_restarts=7",
                                           "rollout.weight_bucket_mb=64", "trainer.pool_heartbeat_timeout_s=10"])
    cfg.validate_runtime(_placement(cfg, 2), cuda_available=False)
    big = load_config(QUICKSTART, ["placement.pools={train: {size: 1}, gen: {size: 2}}",
                                   "placement.roles={actor: train, rollout: gen}", "rollout.fleet.engines=2"])
    assert _error(big.validate_runtime, _placement(big, 3), cuda_available=False) == (
        "rollout.fleet.engines=2 runs every engine as a process of the rollout pool's one rank (gen_tp=1 each), but "
        "the pool has 2 ranks and gen_tp=1; set placement.pools.gen={size: 1, gen_tp: 1}, or rollout.fleet.engines=0")
    from verl_mega.parallel.pools import check_disaggregated

    cfg = load_config(QUICKSTART, ["placement.pools={train: {size: 2, tp: 2, gen_tp: 1}, gen: {size: 2, gen_tp: 2}}",
                                   "placement.roles={actor: train, rollout: gen}"])
    assert _error(check_disaggregated, _placement(cfg, 4)) == (
        "placement.pools.train.gen_tp=1 differs from the rollout pool's gen_tp=2: the trainer builds exactly the "
        "rollout engines' slices; set placement.pools.train.gen_tp=2")
    ok = load_config(REPO / "configs" / "quickstart_async_cpu.yaml", [])
    assert ok.rollout.max_staleness == 1
    ok.validate_runtime(_placement(ok, 2), cuda_available=False)
    check_disaggregated(_placement(ok, 2))


def test_adaptive_kl_needs_target():
    assert _error(load_config, None, ["algorithm.kl_ctrl.type=adaptive"]) == (
        "algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl; set e.g. algorithm.kl_ctrl.target_kl=0.1 "
        "or use algorithm.kl_ctrl.type=fixed")


def test_policy_loss_option_without_its_loss():
    assert _error(load_config, None, ["actor.clip_cov_ratio=0.001"]) == (
        "actor.clip_cov_ratio=0.001 is only read by actor.policy_loss=clip_cov, but actor.policy_loss=vanilla; set "
        "actor.policy_loss=clip_cov or actor.clip_cov_ratio=null")
    assert _error(load_config, None, ["actor.policy_loss=clip_cov", "actor.ppo_kl_coef=0.5"]) == (
        "actor.ppo_kl_coef=0.5 is only read by actor.policy_loss=kl_cov, but actor.policy_loss=clip_cov; set "
        "actor.policy_loss=kl_cov or actor.ppo_kl_coef=null")
    assert _error(load_config, None, ["actor.gspo_clip_ratio_high=0.001"]).startswith(
        "actor.gspo_clip_ratio_high=0.001 is only read by actor.policy_loss=gspo")


def test_gspo_needs_sequence_mean_aggregation():
    assert _error(load_config, None, ["actor.policy_loss=gspo"]) == (
        "actor.policy_loss=gspo clips a per-sequence ratio and needs actor.loss_agg_mode=seq-mean-token-mean, got "
        "'token-mean'; set actor.loss_agg_mode=seq-mean-token-mean")
    assert _error(load_config, None, ["actor.policy_loss=gspo", "actor.loss_agg_mode=token-sum"]).endswith(
        "got 'token-sum'; set actor.loss_agg_mode=seq-mean-token-mean")


def test_policy_loss_option_ranges():
    assert _error(load_config, None, ["actor.policy_loss=clip_cov", "actor.clip_cov_lb=5", "actor.clip_cov_ub=1"]) \
        == "actor.clip_cov_lb=5.0 must be < actor.clip_cov_ub=1.0; set e.g. actor.clip_cov_lb=1.0 and " \
           "actor.clip_cov_ub=5.0"
    assert _error(load_config, None, ["actor.policy_loss=clip_cov", "actor.clip_cov_ratio=2"]) == (
        "actor.clip_cov_ratio must be <= 1.0, got 2.0; set actor.clip_cov_ratio to a value <= 1.0, e.g. "
        "actor.clip_cov_ratio=0.0002")
    assert _error(load_config, None, ["actor.policy_loss=kl_cov", "actor.kl_cov_ratio=0"]) == (
        "actor.kl_cov_ratio must be > 0.0, got 0.0; set actor.kl_cov_ratio to a value > 0.0, e.g. "
        "actor.kl_cov_ratio=0.0002")
    assert _error(load_config, None, ["actor.policy_loss=kl_cov", "actor.ppo_kl_coef=-1"]).startswith(
        "actor.ppo_kl_coef must be >= 0.0, got -1.0")
    assert _error(load_config, None, ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean",
                                      "actor.gspo_clip_ratio_low=1.5"]).startswith(
        "actor.gspo_clip_ratio_low must be < 1.0, got 1.5")
    assert _error(load_config, None, ["actor.policy_loss=ppo"]) == (
        "actor.policy_loss must be one of vanilla | gspo | cispo | clip_cov | kl_cov | decoupled_ppo, got 'ppo'")
    assert _error(load_config, None, ["actor.loss_agg_mode=token_sum"]).endswith(
        "got 'token_sum'; did you mean 'token-sum'?")


def test_policy_loss_options_resolve_to_paper_defaults():
    gspo = load_config(None, ["actor.policy_loss=gspo", "actor.loss_agg_mode=seq-mean-token-mean"]).actor
    assert (gspo.gspo_clip_ratio_low, gspo.gspo_clip_ratio_high, gspo.clip_cov_ratio) == (3e-4, 4e-4, None)
    clip_cov = load_config(None, ["actor.policy_loss=clip_cov", "actor.clip_cov_ub=8"]).actor
    assert (clip_cov.clip_cov_ratio, clip_cov.clip_cov_lb, clip_cov.clip_cov_ub) == (2e-4, 1.0, 8.0)
    kl_cov = load_config(None, ["actor.policy_loss=kl_cov"]).actor
    assert (kl_cov.kl_cov_ratio, kl_cov.ppo_kl_coef, kl_cov.gspo_clip_ratio_low) == (2e-4, 1.0, None)
    vanilla = load_config(None).actor
    assert vanilla.policy_loss == "vanilla" and vanilla.rollout_is is None and vanilla.rollout_is_threshold is None


def test_rollout_is_option_without_rollout_is():
    assert _error(load_config, None, ["actor.rollout_is_threshold=3"]) == (
        "actor.rollout_is_threshold=3.0 has no effect while actor.rollout_is=null; set actor.rollout_is=token (or "
        "sequence), or actor.rollout_is_threshold=null")
    assert _error(load_config, None, ["actor.rollout_is_mode=mask"]).startswith(
        "actor.rollout_is_mode='mask' has no effect while actor.rollout_is=null")
    assert _error(load_config, None, ["actor.rollout_is_threshold_lower=0.5"]).startswith(
        "actor.rollout_is_threshold_lower=0.5 has no effect while actor.rollout_is=null")


def test_rollout_is_thresholds():
    token = ["actor.rollout_is=token"]
    assert _error(load_config, None, [*token, "actor.rollout_is_threshold_lower=0.5"]) == (
        "actor.rollout_is_threshold_lower=0.5 is only read by actor.rollout_is_mode=mask (tis only truncates from "
        "above); set actor.rollout_is_mode=mask or actor.rollout_is_threshold_lower=null")
    mask = [*token, "actor.rollout_is_mode=mask"]
    assert _error(load_config, None, [*mask, "actor.rollout_is_threshold_lower=3"]) == (
        "actor.rollout_is_threshold_lower=3.0 must be below actor.rollout_is_threshold=2.0; set "
        "actor.rollout_is_threshold_lower=0.5 (or null for 1/upper)")
    assert _error(load_config, None, [*mask, "actor.rollout_is_threshold=4", "actor.rollout_is_threshold_lower=1.5"]) \
        == "actor.rollout_is_threshold_lower=1.5 would reject tokens on which rollout and training agree (ratio 1); " \
           "set it <= 1, e.g. actor.rollout_is_threshold_lower=0.25"
    assert _error(load_config, None, [*mask, "actor.rollout_is_threshold_lower=-1"]).startswith(
        "actor.rollout_is_threshold_lower must be > 0.0, got -1.0")
    assert _error(load_config, None, [*token, "actor.rollout_is_threshold=0.5"]) == (
        "actor.rollout_is_threshold must be > 1.0, got 0.5; set actor.rollout_is_threshold to a value > 1.0, e.g. "
        "actor.rollout_is_threshold=2.0")
    assert _error(load_config, None, ["actor.rollout_is=geometric"]).startswith(
        "actor.rollout_is expects token | sequence | null, got 'geometric'")


def test_rollout_is_needs_a_sampling_temperature():
    # vLLM reports the sampled distribution's log-probs, the actor scores at rollout.temperature: any T > 0 agrees
    assert load_config(QUICKSTART, ["actor.rollout_is=token", "rollout.temperature=0.7"]).actor.rollout_is == "token"
    assert _error(load_config, QUICKSTART, ["actor.rollout_is=token", "rollout.temperature=0",
                                          "algorithm.adv_estimator=reinforce_plus_plus"]) == (
        "actor.rollout_is=token weights tokens by the sampling distribution's log-probs, but rollout.temperature=0 "
        "decodes greedily; set rollout.temperature > 0 or actor.rollout_is=null")


def test_rollout_is_resolves_and_round_trips(tmp_path):
    tis = load_config(QUICKSTART, ["actor.rollout_is=sequence"]).actor
    assert (tis.rollout_is_mode, tis.rollout_is_threshold, tis.rollout_is_threshold_lower) == ("tis", 2.0, None)
    cfg = load_config(QUICKSTART, ["actor.rollout_is=token", "actor.rollout_is_mode=mask",
                                   "actor.rollout_is_threshold=4"])
    assert cfg.actor.rollout_is_threshold_lower == 0.25
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    assert load_config(str(saved)) == cfg


def test_decoupled_ppo_keys():
    cfg = load_config(QUICKSTART, ["actor.policy_loss=decoupled_ppo"])
    assert (cfg.actor.policy_loss, cfg.actor.behaviour_weight_cap) == ("decoupled_ppo", None)  # null: untruncated
    assert load_config(QUICKSTART, ["actor.policy_loss=decoupled_ppo", "actor.behaviour_weight_cap=5"]
                       ).actor.behaviour_weight_cap == 5.0
    assert _error(load_config, None, ["actor.behaviour_weight_cap=5"]) == (
        "actor.behaviour_weight_cap=5.0 is only read by actor.policy_loss=decoupled_ppo, but "
        "actor.policy_loss=vanilla; set actor.policy_loss=decoupled_ppo or actor.behaviour_weight_cap=null")
    assert _error(load_config, None, ["actor.policy_loss=decoupled_ppo", "actor.behaviour_weight_cap=1"]) == (
        "actor.behaviour_weight_cap must be > 1.0, got 1.0; set actor.behaviour_weight_cap to a value > 1.0, e.g. "
        "actor.behaviour_weight_cap=5.0")
    assert _error(load_config, None, ["actor.policy_loss=decoupled_ppo", "actor.rollout_is=sequence"]) == (
        "actor.policy_loss=decoupled_ppo already weights every token by π_old/π_rollout, actor.rollout_is=sequence "
        "would correct the same gap twice; set actor.rollout_is=null")
    assert load_config(QUICKSTART, ["actor.policy_loss=decoupled_ppo", "rollout.temperature=0.7"]
                       ).rollout.temperature == 0.7
    assert _error(load_config, QUICKSTART, ["actor.policy_loss=decoupled_ppo", "rollout.temperature=0",
                                          "algorithm.adv_estimator=reinforce_plus_plus"]) == (
        "actor.policy_loss=decoupled_ppo weights tokens by the sampling distribution's log-probs, but "
        "rollout.temperature=0 decodes greedily; set rollout.temperature > 0 or actor.policy_loss=vanilla")


def test_override_without_equals():
    assert _error(load_config, None, ["actor.lr"]) == "override 'actor.lr' must look like key=value, e.g. actor.lr=1e-6"


def test_override_into_a_value():
    assert _error(load_config, None, ["actor.lr.peak=1"]) == (
        "override key 'actor.lr.peak': actor.lr is a value, not a section; use actor.lr=<value>")


def test_wrong_type():
    assert _error(load_config, None, ["parallel.tp=two"]) == (
        "parallel.tp expects int, got 'two' (str); set parallel.tp to a value of that type")
    assert _error(load_config, None, ["rollout.enforce_eager=yes"]) == (
        "rollout.enforce_eager expects bool, got 'yes' (str); set rollout.enforce_eager to a value of that type")


def test_missing_recipe_file():
    missing = str(CONFIGS / "quickstart_cpuu.yaml")
    assert _error(load_config, missing) == (
        f"config file '{missing}' does not exist; did you mean {CONFIGS / 'quickstart_cpu.yaml'}?")


def test_yaml_syntax_error(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("actor:\n  lr: 1e-6\n bad: [\n")
    message = _error(load_config, str(recipe))
    assert message.startswith(f"cannot parse {recipe} at line ") and message.endswith("; fix the YAML syntax")


def test_duplicate_yaml_keys_are_refused(tmp_path):
    recipe = tmp_path / "dup.yaml"
    recipe.write_text("actor:\n  lr: 1.0e-4\n  ppo_epochs: 1\n  lr: 2.0e-4\n")
    assert _error(load_config, str(recipe)) == (
        f"{recipe} at line 4, column 3: key 'lr' appears twice (lines 2 and 4); keep one")
    recipe.write_text("actor: {lr: 1.0e-4}\nactor: {lr: 2.0e-4}\n")
    assert "key 'actor' appears twice (lines 1 and 2)" in _error(load_config, str(recipe))


def test_empty_recipe_is_refused(tmp_path):
    for text in ("", "# only a comment\n", "{}\n"):
        recipe = tmp_path / "empty.yaml"
        recipe.write_text(text)
        assert _error(load_config, str(recipe)).startswith(f"config file '{recipe}' is empty;")


def test_reward_workers_and_error_fraction():
    assert "reward.num_workers=0: reward functions run in worker processes" in _error(
        load_config, None, ["reward.function=arithmetic", "reward.num_workers=0"])
    assert "reward.max_error_frac=1.5 is a fraction" in _error(
        load_config, None, ["reward.function=arithmetic", "reward.max_error_frac=1.5"])
    assert "trainer.time_limit_s" in _error(load_config, None, ["reward.function=arithmetic",
                                                                "trainer.time_limit_s=0"])


def test_include_cycle(tmp_path):
    (tmp_path / "a.yaml").write_text("defaults: b.yaml\n")
    (tmp_path / "b.yaml").write_text("defaults: a.yaml\n")
    assert _error(load_config, str(tmp_path / "a.yaml")) == (
        "recipe include cycle a.yaml -> b.yaml -> a.yaml; remove one of these `defaults:` entries")


def test_gae_needs_critic():
    assert _error(load_config, None, ["critic.enable=false"]) == (
        "algorithm.adv_estimator=gae needs a critic but critic.enable=false; set critic.enable=true (or null), or "
        "pick another estimator such as grpo")


def test_grpo_needs_group():
    assert _error(load_config, None, ["algorithm.adv_estimator=grpo"]) == (
        "algorithm.adv_estimator=grpo compares samples of the same prompt but rollout.n=1; set rollout.n>=2, e.g. "
        "rollout.n=8")


def test_kl_loss_needs_reference():
    assert _error(load_config, QUICKSTART, ["ref.enable=false"]) == (
        "actor.use_kl_loss=true needs the reference policy but ref.enable=false; set ref.enable=true (or null) or "
        "actor.use_kl_loss=false")


def test_generation_tp_must_divide_training_tp():
    assert _error(load_config, None, ["parallel.tp=2", "rollout.gen_tp=4"]) == (
        "rollout.gen_tp=4 must divide parallel.tp=2 (generation TP groups are carved out of each training TP group); "
        "set rollout.gen_tp to a divisor of 2")


def test_kv_cache_budget_required_on_cpu():
    cfg = load_config(QUICKSTART, ["rollout.kv_cache_memory_bytes=null"])
    dims = _placement(cfg, 1)
    assert _error(cfg.validate_runtime, dims, cuda_available=False) == (
        "rollout.kv_cache_memory_bytes is required on CPU (vLLM-CPU cannot size its KV cache from device memory); "
        "set e.g. rollout.kv_cache_memory_bytes=1073741824")
    cfg.validate_runtime(dims, cuda_available=True)
    assert _error(load_config, None, ["rollout.kv_cache_memory_bytes=0"]) == (
        "rollout.kv_cache_memory_bytes must be > 0, got 0; set rollout.kv_cache_memory_bytes to a value > 0, "
        "e.g. rollout.kv_cache_memory_bytes=1073741824")


def test_missing_paths(tmp_path):
    missing = str(tmp_path / "ckpt")
    assert _error(load_config, QUICKSTART, [f"trainer.resume={missing}"]) == (
        f"trainer.resume='{missing}' does not exist; set trainer.resume to auto, off or an existing checkpoint "
        "directory")
    assert _error(load_config, None, [f"model.path={tmp_path}"]) == (
        f"model.path='{tmp_path}' has no config.json; point model.path at a Hugging Face model directory")
    assert _error(load_config, None, [f"data.train_files=[{tmp_path}/train.jsonl]", "reward.function=gsm8k"]) == (
        f"data.train_files[0]='{tmp_path}/train.jsonl' does not exist; set data.train_files[0] to an existing file or "
        f"a hub dataset ID (ORG/NAME)")


def test_reward_function_required_for_own_data():
    assert _error(load_config, None, ["data.train_files=[train.jsonl]"], check_paths=False) == (
        "reward.function is required for data.train_files=['train.jsonl']; set reward.function=gsm8k (built-in), "
        "a dotted path, or reward.reward_model_path")


def test_a_reward_model_alone_scores_a_run_but_not_dynamic_sampling():
    only_rm = ["reward.function=null", "reward.reward_model_path=rm"]
    assert load_config(QUICKSTART, only_rm, check_paths=False).reward.function is None
    assert _error(load_config, QUICKSTART, [*only_rm, "algorithm.filter_groups.enable=true"], check_paths=False) == (
        "algorithm.filter_groups.enable=true keeps groups whose reward-function scores differ, but only a reward "
        "model scores this run (reward.function is unset); set reward.function or algorithm.filter_groups.enable=false")


# ---------------------------------------------------------------- loading, overrides, immutability

def test_recipes_load_and_resolve_autos():
    grpo = load_config(QUICKSTART)
    assert (grpo.algorithm.adv_estimator, grpo.critic.enable, grpo.ref.enable) == ("grpo", False, True)
    assert grpo.reward.function == "arithmetic" and grpo.rollout.gen_tp == grpo.parallel.tp == 1
    assert grpo.model.tokenizer_path == "tiny" and grpo.rollout.seed == grpo.data.seed == grpo.trainer.seed

    ppo = load_config(str(CONFIGS / "ppo_cpu.yaml"))
    assert (ppo.algorithm.adv_estimator, ppo.critic.enable, ppo.ref.enable) == ("gae", True, True)
    # `defaults:` include: inherited keys, overridden keys, nested sections merged key by key.
    assert ppo.actor.lr == grpo.actor.lr and ppo.data == grpo.data and ppo.rollout.n == 2
    assert ppo.actor.use_kl_loss is False and ppo.actor.kl_loss_type == grpo.actor.kl_loss_type
    assert ppo.critic.ppo_mini_batch_size == ppo.actor.ppo_mini_batch_size and ppo.critic.model_path == "tiny"
    assert ppo.trainer.output_dir == "outputs/ppo_cpu" and ppo.trainer.total_steps == grpo.trainer.total_steps


@pytest.mark.parametrize("recipe, world, shape", [("grpo_qwen2.5_7b", 8, QWEN25_7B), ("ppo_llama2_7b", 8, LLAMA2_7B),
                                                  ("grpo_1gpu", 1, (28, 12, 2))])
def test_gpu_recipes_fit_their_models(recipe, world, shape):
    cfg = load_config(str(CONFIGS / f"{recipe}.yaml"), check_paths=False)
    layers, heads, kv = shape
    from verl_mega.models.hf_config import check_layout

    placement = _placement(cfg, world)
    pool = placement.pool_of("actor")
    assert pool.size == pool.tp * pool.pp * pool.cp * pool.dp == world
    check_layout(pool, num_layers=layers, num_heads=heads, num_kv_heads=kv)
    cfg.validate_runtime(placement, cuda_available=True)


def test_override_value_types(tmp_path):
    cfg = load_config(QUICKSTART, [
        "actor.lr=3e-6", "parallel.tp=2", "rollout.gen_tp=1", "data.train_files=[a.jsonl, b.parquet]",
        "reward.function=gsm8k", "trainer.total_steps=null", "trainer.resume=off", "rollout.enforce_eager=false",
        "rollout.kv_cache_memory_bytes=4e9", "reward.kwargs={scale: 2, tags: [x]}", "actor={ppo_epochs: 2}",
        "model.use_te=true",
    ], check_paths=False)
    assert cfg.actor.lr == 3e-6 and isinstance(cfg.actor.lr, float) and cfg.parallel.tp == 2
    assert cfg.data.train_files == ("a.jsonl", "b.parquet")
    assert cfg.trainer.total_steps is None and cfg.trainer.resume == "off" and cfg.rollout.enforce_eager is False
    assert cfg.rollout.kv_cache_memory_bytes == 4_000_000_000 and isinstance(cfg.rollout.kv_cache_memory_bytes, int)
    assert dict(cfg.reward.kwargs) == {"scale": 2, "tags": ("x",)} and cfg.model.use_te is True
    # A section override merges into the recipe's section instead of replacing it.
    assert cfg.actor.ppo_epochs == 2 and cfg.actor.lr == 3e-6 and cfg.actor.use_kl_loss is True
    # A single path where a list is expected; a later override wins.
    single = load_config(None, ["data.train_files=a.jsonl", "reward.function=gsm8k", "actor.lr=1", "actor.lr=2"],
                         check_paths=False)
    assert single.data.train_files == ("a.jsonl",) and single.actor.lr == 2.0


def test_python_construction_is_validated_and_immutable():
    cfg = TrainConfig(actor={"lr": 2e-6}, algorithm={"kl_ctrl": {"kl_coef": 0.01}})
    assert cfg.actor.lr == 2e-6 and cfg.algorithm.kl_ctrl.kl_coef == 0.01
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.lr = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor = ActorConfig()
    with pytest.raises(TypeError):
        cfg.reward.kwargs["x"] = 1  # type: ignore[index]
    with pytest.raises(TypeError):
        ActorConfig(1e-6)  # keyword-only
    assert isinstance(cfg.data.train_files, tuple)
    assert _error(TrainConfig, actor={"lr": -1.0}).startswith("actor.lr must be >= 0.0")
    assert _error(ActorConfig, lr=float("nan")) == "actor.lr must be a finite number, got nan; set actor.lr to a " \
                                                   "finite value"
    assert pickle.loads(pickle.dumps(cfg)) == cfg and hash(cfg) == hash(pickle.loads(pickle.dumps(cfg)))


# ---------------------------------------------------------------- saving and comparing

@pytest.mark.parametrize("recipe", ["quickstart_cpu", "ppo_cpu", "grpo_qwen2.5_7b", "ppo_llama2_7b", "grpo_1gpu"])
def test_to_yaml_round_trip(recipe, tmp_path):
    cfg = load_config(str(CONFIGS / f"{recipe}.yaml"), ["reward.kwargs={mode: 'off', n: '1e5'}"], check_paths=False)
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(cfg))
    again = load_config(str(saved), check_paths=False)
    assert again == cfg and to_dict(again) == to_dict(cfg)
    assert again.reward.kwargs["mode"] == "off" and again.reward.kwargs["n"] == "1e5"


def test_diff_configs_reports_only_result_changing_keys():
    base = load_config(QUICKSTART)
    assert diff_configs(base, base) == []
    neutral = load_config(QUICKSTART, ["trainer.output_dir=elsewhere", "trainer.total_steps=80", "logging.plot=false",
                                       "parallel.tp=2", "actor.micro_batch_size_per_gpu=4", "checkpoint.keep_last=5",
                                       "rollout.kv_cache_memory_bytes=1e9"])
    assert diff_configs(base, neutral) == []
    # The quickstart runs GRPO without a critic, so critic keys cannot change its results.
    assert diff_configs(base, load_config(QUICKSTART, ["critic.lr=1e-3"])) == []
    changed = load_config(QUICKSTART, ["actor.lr=4e-5", "rollout.temperature=0.7", "reward.kwargs={scale: 2}"])
    assert diff_configs(base, changed) == ["actor.lr: 0.0003 -> 4e-05", "reward.kwargs: {} -> <absent>",
                                           "rollout.temperature: 1.0 -> 0.7", "reward.kwargs.scale: <absent> -> 2"]


def test_diff_configs_run_length_counts_when_lr_decays_over_it():
    cosine = ["actor.lr_decay_style=cosine"]
    a, b = load_config(QUICKSTART, cosine), load_config(QUICKSTART, [*cosine, "trainer.total_steps=80"])
    assert diff_configs(a, b) == ["trainer.total_steps: 100 -> 80"]
    fixed = ["actor.lr_decay_style=cosine", "actor.lr_decay_steps=100"]
    assert diff_configs(load_config(QUICKSTART, fixed), load_config(QUICKSTART, [*fixed, "trainer.total_steps=80"])) \
        == []


def test_diff_configs_accepts_saved_dicts_with_unknown_keys():
    cfg = load_config(QUICKSTART)
    saved = to_dict(cfg)
    saved["actor"]["old_option"] = 1  # a key a later version no longer knows counts as result-changing
    assert diff_configs(saved, cfg) == ["actor.old_option: 1 -> <absent>"]
    assert config_from_dict(to_dict(cfg)) == cfg


def test_retired_rollout_backend():
    """rollout.backend was accepted and never read: it is gone, and a checkpoint whose config holds its only value
    resumes as if it were absent."""
    cfg = load_config(QUICKSTART)
    saved = to_dict(cfg)
    saved["rollout"]["backend"] = "vllm"
    assert diff_configs(saved, cfg) == []
    saved["rollout"]["backend"] = "sglang"
    assert diff_configs(saved, cfg) == ["rollout.backend: 'sglang' -> <absent>"]
    with pytest.raises(ConfigError, match="rollout.backend"):
        load_config(QUICKSTART, ["rollout.backend=vllm"])


def test_configuration_reference_is_current():
    doc = REPO / "docs" / "configuration.md"
    assert doc.is_file(), "docs/configuration.md missing; run python tools/docgen.py > docs/configuration.md"
    assert doc.read_text() == _tool("docgen").generate_reference(), \
        "docs/configuration.md is stale; run python tools/docgen.py > docs/configuration.md"
    # Every leaf key of the schema is documented.
    documented = set(re.findall(r"^\| `([\w.]+)` \|", doc.read_text(), flags=re.M))
    leaves = {k for k, v in _flat_keys(to_dict(TrainConfig())) if not isinstance(v, dict) or k.endswith("kwargs")}
    assert leaves <= documented, sorted(leaves - documented)


def _flat_keys(data: dict, prefix: str = ""):
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        yield dotted, value
        if isinstance(value, dict):
            yield from _flat_keys(value, dotted)


def test_diff_configs_keys_newer_than_the_saved_config():
    cfg = load_config(QUICKSTART)
    saved = to_dict(cfg)
    for name in ("policy_loss", "rollout_is", "rollout_is_threshold", "clip_cov_ratio"):
        del saved["actor"][name]  # a checkpoint written before these keys existed
    assert diff_configs(saved, cfg) == []  # at their defaults they keep the earlier behaviour
    changed = load_config(QUICKSTART, ["actor.rollout_is=token"])
    assert diff_configs(saved, changed) == ["actor.rollout_is_mode: null -> 'tis'",
                                            "actor.rollout_is: <absent> -> 'token'",
                                            "actor.rollout_is_threshold: <absent> -> 2.0"]


def test_recipe_files_are_all_loadable():
    for recipe in sorted(os.listdir(CONFIGS)):
        if recipe.endswith(".yaml"):
            load_config(str(CONFIGS / recipe), check_paths=False)


def _tool(name: str):
    """tools/<name>.py, imported."""
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docgen_help_is_its_usage_not_the_document(capsys):
    docgen = _tool("docgen")
    with pytest.raises(SystemExit) as info:
        docgen.main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: tools/docgen.py")
    assert "python tools/docgen.py > docs/configuration.md" in out and "# Configuration reference" not in out
    with pytest.raises(SystemExit):
        docgen.main(["--bogus"])
    assert capsys.readouterr().out == ""
    assert docgen.main([]) == 0 and capsys.readouterr().out == docgen.generate_reference()


def test_check_cli(capsys):
    main = _tool("check_config").main

    qwen = str(CONFIGS / "grpo_qwen2.5_7b.yaml")
    assert main([qwen, "--world-size", "8", "--model-shape", "28,28,4", "--no-check-paths"]) == 0
    out = capsys.readouterr()
    assert "adv_estimator: grpo" in out.out and "layout OK: main: 8 ranks, tp=1 pp=1 dp=8 gen_tp=1" in out.err
    assert main([qwen, "parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", "rollout.gen_tp=2",
                 "actor.micro_batch_size_per_gpu=5",
                 "--world-size", "1024", "--model-shape", "28,28,4", "--no-check-paths"]) == 0
    assert "layout OK: main: 1024 ranks, tp=2 pp=2 dp=256 gen_tp=2 sp" in capsys.readouterr().err
    assert main([qwen, "parallel.tp=8", "--world-size", "1024", "--model-shape", "28,28,4", "--no-check-paths"]) == 2
    assert capsys.readouterr().err == ("error: parallel.tp=8 does not divide the model's 28 attention heads; set "
                                       "parallel.tp to one of 1, 2, 4, 7, 14, 28\n")


def test_packing_rules():
    """Packed sequences run with context parallelism on our attention spec only, and never with routing replay;
    with packing a token budget works at pp>1 (padded rows need pp=1)."""
    cfg = load_config(QUICKSTART, ["model.use_remove_padding=true", "model.use_te=true", "parallel.cp=2"])
    assert _error(cfg.validate_runtime, _placement(cfg, 2), cuda_available=False) == (
        "model.use_remove_padding=true with context parallelism (cp=2) runs on our attention spec, but "
        "model.use_te=True selects Transformer Engine's; set model.use_te=false")
    load_config(QUICKSTART, ["model.use_remove_padding=true", "model.use_te=false", "parallel.cp=2"]
                ).validate_runtime(_placement(cfg, 2), cuda_available=False)
    assert _error(load_config, QUICKSTART, ["model.use_remove_padding=true", "actor.routing_replay=r2",
                                            "model.tiny_arch=qwen3_moe"]).startswith(
        "actor.routing_replay=r2 replays routings recorded per padded row, but model.use_remove_padding=true packs "
        "rows; set")
    budget = ["actor.use_dynamic_bsz=true", "actor.max_tokens_per_gpu=4096", "parallel.pp=2"]
    padded = load_config(QUICKSTART, budget)
    assert "needs parallel.pp=1" in _error(padded.validate_runtime, _placement(padded, 2), cuda_available=False)
    packed = load_config(QUICKSTART, budget + ["model.use_remove_padding=true"])
    packed.validate_runtime(_placement(packed, 2), cuda_available=False)


def test_stream_scoring_errors():
    ok = load_config(QUICKSTART, ["rollout.stream_scoring=all"])
    ok.validate_runtime(_placement(ok, 1), cuda_available=False)
    for extra, world, start in (
            (["rollout.free_cache_engine=true"], 1, "rollout.stream_scoring=all runs the roles while vLLM holds"),
            (["parallel.tp=2", "rollout.gen_tp=1"], 2, "rollout.stream_scoring=all keeps each vLLM engine's "
                                                       "samples on the replica made of its ranks"),
            (["parallel.pp=2"], 2, "rollout.stream_scoring=all keeps each vLLM engine's samples"),
            (["actor.offload_params=true"], 1, "rollout.stream_scoring=all scores during generation, with the "
                                               "parameters on the device, but actor.offload_params=true"),
            (["algorithm.adv_estimator=remax", "critic.enable=null"], 1,
             "rollout.stream_scoring=all cannot run with algorithm.adv_estimator=remax"),
            (["data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "algorithm.adv_estimator=gae",
              "actor.micro_batch_size_per_gpu=4", "critic.micro_batch_size_per_gpu=4"], 2,
             "rollout.stream_scoring=all trains each engine's prompts on its own replica"),
            (["placement.pools={train: {size: 1}, gen: {size: 1}}", "placement.roles={actor: train, rollout: gen}"],
             2, "rollout.stream_scoring=all scores while a colocated vLLM generates")):
        cfg = load_config(QUICKSTART, ["rollout.stream_scoring=all", *extra])
        assert _error(cfg.validate_runtime, _placement(cfg, world), cuda_available=False).startswith(start), extra
    assert _error(load_config, QUICKSTART, ["rollout.stream_chunk=0"]).startswith("rollout.stream_chunk")
    # rewards alone stream with any layout, vLLM asleep or parameters offloaded: the roles score after generation
    for extra in (["parallel.tp=2", "rollout.gen_tp=1"], ["parallel.pp=2"]):
        cfg = load_config(QUICKSTART, ["rollout.stream_scoring=reward", "rollout.free_cache_engine=true",
                                       "actor.offload_params=true", *extra])
        cfg.validate_runtime(_placement(cfg, 2), cuda_available=False)
    cfg = load_config(QUICKSTART, ["rollout.stream_scoring=reward", "rollout.multi_turn.enable=true",
                                   "rollout.multi_turn.tools=[calculator]"])
    assert _error(cfg.validate_runtime, _placement(cfg, 1), cuda_available=False).startswith(
        "rollout.stream_scoring=reward cannot run with rollout.multi_turn.enable=true")
    assert "one of" in _error(load_config, QUICKSTART, ["rollout.stream_scoring=maybe"])


@pytest.mark.parametrize("extra, world, chosen", [
    ([], 1, "reward"),
    (["parallel.pp=2", "rollout.free_cache_engine=true"], 2, "reward"),
    (["rollout.multi_turn.enable=true", "rollout.multi_turn.tools=[calculator]"], 1, "off"),
    (["algorithm.filter_groups.enable=true"], 1, "off"),
    (["algorithm.adv_estimator=remax", "critic.enable=null"], 1, "off"),
    (["placement.pools={train: {size: 1}, gen: {size: 1}}", "placement.roles={actor: train, rollout: gen}"], 2, "off"),
])
def test_stream_scoring_auto_streams_the_reward_where_it_can(extra, world, chosen):
    cfg = load_config(QUICKSTART, ["rollout.stream_scoring=auto", *extra])
    assert cfg.rollout.stream_scoring == "auto"  # resolved once the placement is known
    cfg.validate_runtime(_placement(cfg, world), cuda_available=False)
    assert cfg.rollout.stream_scoring == chosen


def test_deterministic_mode_runs_eager_kernels():
    """trainer.deterministic: `auto` fused kernels stay eager (torch's inductor refuses to autotune in deterministic
    mode, which crashed the first step on a GPU); asking for compiled kernels there is refused up front."""
    from verl_mega.trainer.setup import fused_kernels

    plain, det = load_config(QUICKSTART, ["trainer.deterministic=false"]), load_config(
        QUICKSTART, ["trainer.deterministic=true"])
    assert fused_kernels(plain, cuda=True) and not fused_kernels(plain, cuda=False)
    assert not fused_kernels(det, cuda=True)
    assert fused_kernels(load_config(QUICKSTART, ["trainer.deterministic=false", "model.fused_kernels=true"]),
                         cuda=False)
    with pytest.raises(ValueError, match=r"^model.fused_kernels=true compiles kernels .* model.fused_kernels=auto"):
        load_config(QUICKSTART, ["trainer.deterministic=true", "model.fused_kernels=true"])


def test_keys_that_would_do_nothing_are_refused():
    """A key that is accepted must act: these would be read by nothing in the configuration they are set in."""
    assert _error(load_config, QUICKSTART, ["algorithm.kl_ctrl.target_kl=0.05"]) == (
        "algorithm.kl_ctrl.target_kl=0.05 steers the adaptive controller only, but algorithm.kl_ctrl.type=fixed; set "
        "algorithm.kl_ctrl.type=adaptive or remove target_kl")
    assert _error(load_config, QUICKSTART, ["model.tokenizer_path=/tmp"]) == (
        "model.tokenizer_path='/tmp' with model.path=tiny: the tiny model brings its own tokenizer; remove "
        "model.tokenizer_path or set model.path to your model")
    assert _error(load_config, QUICKSTART, ["model.path=/some/model", "model.tiny_task=calculator"],
                  check_paths=False) == ("model.tiny_task shapes the bundled tiny model, but "
                                         "model.path='/some/model'; remove it or set model.path=tiny")
    assert _error(load_config, QUICKSTART, ["data.val_files=[generated:addition_small]"]) == (
        "data.val_files is set but no validation runs (trainer.val_every=0, trainer.val_before_train=false); set "
        "trainer.val_every=N or trainer.val_before_train=true, or data.val_files=[]")
    assert _error(load_config, QUICKSTART, ["model.path=/some/model", "critic.model_path=tiny"],
                  check_paths=False).startswith("critic.model_path=tiny starts the critic from the bundled tiny model")


def test_values_past_a_hard_limit_are_refused_at_the_config(tmp_path, monkeypatch, capsys):
    """rollout.n over vLLM's limit, and run lengths whose batch count would not fit the loader's int64 len(), are
    refused when the config loads: a one-line error, exit code 2, nothing built and no output directory."""
    import vllm.envs

    from verl_mega import train
    from verl_mega.config.rl import vllm_max_n

    monkeypatch.delenv("VLLM_MAX_N_SEQUENCES", raising=False)
    assert vllm_max_n() == vllm.envs.VLLM_MAX_N_SEQUENCES == 16384  # vLLM's own reading of its limit
    assert load_config(QUICKSTART, ["rollout.n=16384"]).rollout.n == 16384
    assert _error(load_config, QUICKSTART, ["rollout.n=1000000"]) == (
        "rollout.n=1000000 is over vLLM's limit of 16384 samples per prompt (VLLM_MAX_N_SEQUENCES); set rollout.n to "
        "at most 16384, e.g. rollout.n=8")
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "64")
    assert vllm_max_n() == vllm.envs.VLLM_MAX_N_SEQUENCES == 64
    assert "over vLLM's limit of 64" in _error(load_config, QUICKSTART, ["rollout.n=65"])
    monkeypatch.delenv("VLLM_MAX_N_SEQUENCES")

    assert load_config(QUICKSTART, [f"trainer.total_steps={10**9}"]).trainer.total_steps == 10**9
    assert _error(load_config, QUICKSTART, [f"trainer.total_steps={10**21}"]) == (
        f"trainer.total_steps must be <= 1000000000, got {10**21}; set trainer.total_steps to a value <= 1000000000, "
        f"e.g. trainer.total_steps=100")
    assert "trainer.total_epochs must be <= 1000000000" in _error(
        load_config, QUICKSTART, ["trainer.total_steps=null", f"trainer.total_epochs={10**21}"])
    assert "algorithm.filter_groups.max_num_gen_batches must be <= 1000000000" in _error(
        load_config, QUICKSTART, [f"algorithm.filter_groups.max_num_gen_batches={10**21}"])

    monkeypatch.setattr("verl_mega.trainer.setup.build_job", lambda cfg: pytest.fail("the job was built"))
    capsys.readouterr()
    for override in ("rollout.n=1000000", f"trainer.total_steps={10**21}"):
        out = tmp_path / "out"
        assert train.main(["--config", QUICKSTART, override, f"trainer.output_dir={out}"]) == 2
        errors = capsys.readouterr().err.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith(f"error: {override.split('=')[0]}"), errors
        assert not out.exists()


def test_recipe_files_that_cannot_be_read_as_recipes_are_named_without_their_content(tmp_path):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"actor:\n  lr: 1.0e-4   # caf\xe9\n")
    assert _error(load_config, str(latin)) == (
        f"config file '{latin}' is not UTF-8 text (byte 0xe9 at line 2, column 21); save it as UTF-8")
    including = tmp_path / "inc.yaml"
    including.write_text(f"defaults: {latin}\n")
    assert f"config file '{latin}' (included from {including}) is not UTF-8 text" in _error(load_config, str(including))

    # a system file given as defaults: its lines parse as keys of a mapping; none of its content is echoed
    secret = tmp_path / "shadow"
    secret.write_text("root:$6$s3cretHash:20228:0:99999:7:::\ndaemon:*:20228:0:99999:7:::\n")
    listing = tmp_path / "users.yaml"
    listing.write_text("alice: s3cret\nbob: hunter2\n")
    for other in (secret, listing):
        including.write_text(f"defaults: {other}\n")
        message = _error(load_config, str(including))
        assert message.startswith(f"config file '{other}' (included from {including}) is not a verl_mega recipe: its "
                                  f"top-level keys are not config sections (actor, algorithm, ")
        assert message.endswith("give a YAML recipe, e.g. configs/quickstart_cpu.yaml")
        assert not any(word in message for word in ("s3cret", "20228", "daemon", "alice", "hunter2")), message
    # a recipe with a mistyped section beside real ones still gets the suggestion
    typo = tmp_path / "typo.yaml"
    typo.write_text("actr: {lr: 1.0e-4}\nrollout: {n: 2}\n")
    assert _error(load_config, str(typo)) == "unknown config key 'actr'; did you mean 'actor'?"

    assert _error(load_config, str(CONFIGS)) == (
        f"config file '{CONFIGS}' is a directory; give a YAML recipe file, e.g. configs/quickstart_cpu.yaml")


def test_null_unsets_a_key_that_cannot_be_null():
    """key=null sets null where the key's type takes it; elsewhere it unsets the key (its default applies)."""
    llama = str(CONFIGS / "ppo_llama2_7b.yaml")
    pinned = load_config(llama, check_paths=False)
    assert (pinned.parallel.tp, pinned.parallel.sequence_parallel) == (4, True)
    unset = load_config(llama, ["parallel.tp=null", "parallel.sequence_parallel=null", "rollout.gen_tp=null"],
                        check_paths=False)
    assert (unset.parallel.tp, unset.parallel.sequence_parallel, unset.rollout.gen_tp) == (1, False, 1)
    assert unset.actor.lr == pinned.actor.lr  # nothing else moved
    cfg = load_config(QUICKSTART, ["trainer.total_epochs=null", "reward.kwargs.scale=null", "parallel.vpp=null"])
    assert cfg.trainer.total_epochs is None and cfg.reward.kwargs["scale"] is None and cfg.parallel.vpp is None
    pools = load_config(str(CONFIGS / "ppo_llama2_7b_two_pools.yaml"),
                        ["placement=null", "parallel.sequence_parallel=null"], check_paths=False)
    assert not pools.placement.pools and not pools.placement.roles
    assert load_config(QUICKSTART, ["actor.lr=null"]).actor.lr == ActorConfig().lr
    assert "unknown config key 'parallel.tpp'" in _error(load_config, QUICKSTART, ["parallel.tpp=null"])


def test_layout_auto_given_as_an_override_replaces_the_recipes_layout():
    llama = str(CONFIGS / "ppo_llama2_7b.yaml")
    cfg = load_config(llama, ["parallel.layout=auto"], check_paths=False)
    assert (cfg.parallel.layout, cfg.parallel.tp, cfg.parallel.sequence_parallel, cfg.rollout.gen_tp) == \
        ("auto", 1, False, 1)
    assert cfg.parallel.use_distributed_optimizer == load_config(llama, check_paths=False) \
        .parallel.use_distributed_optimizer  # the engine flags stay the recipe's
    # dims given beside auto on the command line, or a recipe that says auto and pins dims, still conflict
    assert "parallel.layout=auto chooses the layout, but parallel.tp=2 is set" in _error(
        load_config, llama, ["parallel.layout=auto", "parallel.tp=2"], check_paths=False)
    assert "parallel.layout=auto chooses the layout, but parallel.tp=4" in _error(
        load_config, llama, ["parallel={layout: auto, tp: 4}"], check_paths=False)
