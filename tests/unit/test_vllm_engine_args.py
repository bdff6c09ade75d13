"""What the rollout hands ``vllm.LLM``: the engine arguments built from ``rollout.*`` (a stand-in LLM records them)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from verl_mega.config import ConfigError, load_config
from verl_mega.config.base import FrozenDict
from verl_mega.config.rl import ROLLOUT_ENGINE_ARGS
from verl_mega.rollout.vllm_rollout import FP8_QUANTIZATION_CONFIG, VLLMRolloutConfig, _build_llm
from verl_mega.trainer.rollout_setup import vllm_config

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "quickstart_cpu.yaml"


def _engine_args(monkeypatch, config: VLLMRolloutConfig, *, is_cpu: bool = True) -> dict:
    seen: dict = {}

    class RecordingLLM:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=RecordingLLM))
    _build_llm(config, is_cpu)
    return seen


def _plain(value) -> bool:
    if isinstance(value, FrozenDict) or isinstance(value, tuple):
        return False
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return True


def test_nested_engine_kwargs_reach_vllm_as_plain_dicts_and_lists(monkeypatch):
    # the config freezes mappings; vLLM's pydantic configs refuse a FrozenDict (compilation_config and the like)
    config = VLLMRolloutConfig(model_path="m", engine_kwargs={"compilation_config": {"custom_ops": ["+quant_fp8"]},
                                                               "max_loras": 1})
    assert isinstance(config.engine_kwargs["compilation_config"], FrozenDict)
    args = _engine_args(monkeypatch, config)
    assert args["compilation_config"] == {"custom_ops": ["+quant_fp8"]}
    assert args["max_loras"] == 1
    assert _plain(args)


def test_fp8_settings_become_vllm_arguments(monkeypatch):
    args = _engine_args(monkeypatch, VLLMRolloutConfig(model_path="m", quantization="fp8", kv_cache_dtype="fp8"),
                        is_cpu=False)
    assert args["hf_overrides"] == {"quantization_config": dict(FP8_QUANTIZATION_CONFIG)}
    assert args["kv_cache_dtype"] == "fp8" and args["load_format"] == "dummy"
    assert args["enable_sleep_mode"] is True and "kv_cache_memory_bytes" not in args
    plain = _engine_args(monkeypatch, VLLMRolloutConfig(model_path="m"))
    assert "hf_overrides" not in plain and "kv_cache_dtype" not in plain and "kv_cache_memory_bytes" in plain


def test_rollout_engine_kwargs_reach_the_engine_and_may_not_set_what_the_rollout_sets(tmp_path):
    cfg = load_config(RECIPE, ["rollout.engine_kwargs.block_size=32", "model.lora.rank=4",
                               "model.lora.rollout_sync=adapter"], check_paths=False)
    engine = vllm_config(cfg, tmp_path, gen_tp=1)
    assert engine.engine_kwargs["block_size"] == 32 and engine.engine_kwargs["enable_lora"] is True
    for key, hint in (("tensor_parallel_size", "rollout.gen_tp"), ("max_loras", "model.lora.rollout_sync"),
                      ("hf_overrides", "rollout.quantization")):
        with pytest.raises(ConfigError, match=rf"rollout.engine_kwargs.{key}: .*{hint}"):
            load_config(RECIPE, [f"rollout.engine_kwargs.{key}=1"], check_paths=False)


def test_every_argument_the_rollout_sets_is_reserved(monkeypatch):
    # rollout.engine_kwargs may not override them: ROLLOUT_ENGINE_ARGS must name each one _build_llm passes
    configs = [(VLLMRolloutConfig(model_path="m", max_num_batched_tokens=512), True),
               (VLLMRolloutConfig(model_path="m", quantization="fp8", kv_cache_dtype="fp8", gen_ep=2), False),
               (VLLMRolloutConfig(model_path="m", kv_cache_memory_bytes=1 << 30), False)]
    for config, is_cpu in configs:
        assert set(_engine_args(monkeypatch, config, is_cpu=is_cpu)) <= set(ROLLOUT_ENGINE_ARGS)


def test_the_keys_the_refusals_name_exist(monkeypatch, tmp_path):
    # a refused engine argument names the key to set instead: each such key must be one a recipe can set
    import re

    cfg = load_config(RECIPE, ["rollout.enable_prefix_caching=false"], check_paths=False)
    named = {m for hint in ROLLOUT_ENGINE_ARGS.values()
             for m in re.findall(r"\b(?:rollout|model|data|actor|trainer)\.[a-z_.]*[a-z_]", hint)}
    assert len(named) > 10
    for key in sorted(named):
        node = cfg
        for part in key.split("."):
            assert hasattr(node, part), f"ROLLOUT_ENGINE_ARGS names {key}, which is not a config key"
            node = getattr(node, part)
    assert _engine_args(monkeypatch, vllm_config(cfg, tmp_path, gen_tp=1))["enable_prefix_caching"] is False
    assert _engine_args(monkeypatch, VLLMRolloutConfig(model_path="m"))["enable_prefix_caching"] is True
