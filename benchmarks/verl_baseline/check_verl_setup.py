"""Dry check of the verl GRPO baseline's inputs and config, without GPUs or Ray (run_verl_grpo.sh CHECK_ONLY=1).

Composes verl's hydra config with the launcher's overrides, runs verl's own validate_config, builds the config
dataclasses (HFModelConfig loads the tokenizer and the model config), reads the dataset through verl's RLHFDataset,
tokenizes the first prompt with the Continuous Token builder the agent loop uses, scores a response with the custom
reward, and imports the verl modules of the FSDP + vLLM path.
"""

from __future__ import annotations

import importlib
import os
import sys


def main(overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import verl.trainer

    config_dir = os.path.join(os.path.dirname(verl.trainer.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=overrides)

    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    OmegaConf.resolve(cfg)
    print("validate_config: ok; reference policy:", need_reference_policy(cfg), "critic:", need_critic(cfg))

    model_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.model)
    tok = model_cfg.tokenizer
    print(f"HFModelConfig: {model_cfg.architectures}, attn {model_cfg.hf_config._attn_implementation}, "
          f"tokenizer {type(tok).__name__} ({len(tok)}), eos {tok.eos_token_id}, pad {tok.pad_token_id}")
    rollout_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    print(f"RolloutConfig: {rollout_cfg.name}/{rollout_cfg.mode} tp={rollout_cfg.tensor_model_parallel_size} "
          f"n={rollout_cfg.n} ignore_eos={rollout_cfg.ignore_eos} prompt/response={rollout_cfg.prompt_length}/"
          f"{rollout_cfg.response_length} max_model_len={rollout_cfg.max_model_len}")
    actor_cfg = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    print(f"actor: {type(actor_cfg).__name__} strategy={actor_cfg.strategy} mini_batch={actor_cfg.ppo_mini_batch_size}"
          f" dynamic_bsz={actor_cfg.use_dynamic_bsz} max_tokens/gpu={actor_cfg.ppo_max_token_len_per_gpu}")

    from verl.trainer.ppo.utils import create_rl_dataset
    from verl.utils.dataset.rl_dataset import collate_fn

    ds = create_rl_dataset(cfg.data.train_files, cfg.data, tok, model_cfg.processor, is_train=True)
    batch = collate_fn([ds[i] for i in range(cfg.data.train_batch_size)])
    item = ds[0]
    print(f"dataset: {len(ds)} rows; row 0 raw_prompt {item['raw_prompt']}, ground truth "
          f"{item['reward_model']['ground_truth']}; a batch has keys {sorted(batch)[:8]}...")

    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    builder = create_continuous_token_builder(tok, hf_model_type=model_cfg.hf_config.model_type,
                                              processor=model_cfg.processor)
    ids = builder.build_initial_tokens(list(item["raw_prompt"]))
    print(f"Continuous Token builder {type(builder).__name__}: prompt ids {ids} = {tok.decode(ids)!r}")

    from verl.trainer.ppo.reward import get_custom_reward_fn

    fn = get_custom_reward_fn(cfg)
    gt = item["reward_model"]["ground_truth"]
    scores = [fn(item["data_source"], s, gt, item["extra_info"]) for s in (gt, gt + "1", "x")]
    print(f"reward {getattr(fn, '__name__', fn)}: {scores} for {gt!r}, {gt + '1'!r}, 'x'")
    assert scores == [1.0, 0.0, 0.0], scores

    for mod in ("verl.trainer.main_ppo", "verl.trainer.ppo.v1", "verl.workers.engine_workers",
                "verl.workers.engine.fsdp.transformer_impl", "verl.experimental.agent_loop",
                "verl.experimental.reward_loop", "verl.checkpoint_engine",
                "verl.workers.rollout.vllm_rollout.vllm_async_server"):
        try:
            importlib.import_module(mod)
            print("import ok:", mod)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"import FAILED: {mod}: {type(e).__name__}: {e}")
    print("CHECK DONE")


if __name__ == "__main__":
    main(sys.argv[1:])
