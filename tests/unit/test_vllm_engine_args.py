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


def _inductor_benchmarking_allowed() -> bool:
    """inductor's own guard of its autotuning benchmarks (what vLLM's torch.compile ran into)."""
    from torch._inductor.runtime.benchmarking import may_ban_benchmarking

    try:
        may_ban_benchmarking()
    except RuntimeError:
        return False
    return True


def test_vllm_is_built_and_stepped_outside_the_training_determinism(monkeypatch):
    # trainer.deterministic governs training kernels only: under it, vLLM's build (compile, CUDA graphs) ran into
    # inductor's "In the deterministic mode of Inductor, we will avoid those benchmarkings"
    import torch

    from verl_mega.parallel.state import set_deterministic
    from verl_mega.rollout.vllm_rollout import engine_stance

    seen: list = []

    class RecordingLLM:
        def __init__(self, **kwargs):
            seen.append((torch.are_deterministic_algorithms_enabled(), _inductor_benchmarking_allowed()))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=RecordingLLM))
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    set_deterministic(True)
    try:
        assert not _inductor_benchmarking_allowed()  # what training runs under
        _build_llm(VLLMRolloutConfig(model_path="m"), False)
        assert seen == [(False, True)]  # built on torch's defaults
        with engine_stance():  # an engine step: inductor may benchmark; the algorithms flag stays for the scorer
            seen.append((torch.are_deterministic_algorithms_enabled(), _inductor_benchmarking_allowed()))
        assert seen[1] == (True, True)
        # and the training setting is back, warn-only as set_deterministic set it
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not _inductor_benchmarking_allowed()
    finally:
        set_deterministic(False)
    _build_llm(VLLMRolloutConfig(model_path="m"), False)  # off stays off
    assert seen[2] == (False, True) and not torch.are_deterministic_algorithms_enabled()


def _vllm_starts(total: int, free: int, utilization: float) -> bool:
    """vLLM's own start-up check of the free memory (``request_memory``)."""
    from types import SimpleNamespace

    from vllm.v1.worker.utils import request_memory

    try:
        request_memory(SimpleNamespace(total_memory=total, free_memory=free, device_="cuda:0"),
                       SimpleNamespace(gpu_memory_utilization=utilization))
    except ValueError:
        return False
    return True


def test_vllm_asks_for_no_more_memory_than_the_training_engines_left_free():
    from verl_mega.trainer.rollout_setup import RESERVE_BYTES, vllm_memory

    gib = 1 << 30
    total, free = int(139.8 * gib), int(111.26 * gib)  # one H200, a 1.5B actor and its reference built
    # the ppo recipe on a GPU: an explicit 256 MiB KV cache, and vLLM's own default utilization (0.92) failed to start
    assert not _vllm_starts(total, free, 0.92)
    m = vllm_memory(choice="auto", total=total, free=free, training_peak=25 * gib, vllm_need=5 * gib,
                    utilization=0.5, kv_cache_given=True)
    assert not m.free_cache and m.room_bytes == free - RESERVE_BYTES
    assert _vllm_starts(total, free, m.gpu_memory_utilization) and m.gpu_memory_utilization * total <= m.room_bytes
    # resident, the KV cache sized from the utilization: the asked share when it fits beside the training peak ...
    m = vllm_memory(choice="auto", total=total, free=free, training_peak=40 * gib, vllm_need=0.5 * total,
                    utilization=0.5, kv_cache_given=False)
    assert not m.free_cache and m.gpu_memory_utilization == 0.5
    # ... lowered to what the peak leaves when vLLM is kept resident regardless
    m = vllm_memory(choice=False, total=total, free=free, training_peak=100 * gib, vllm_need=0.5 * total,
                    utilization=0.5, kv_cache_given=False)
    assert not m.free_cache and m.room_bytes == total - 100 * gib - RESERVE_BYTES
    assert m.gpu_memory_utilization * total <= m.room_bytes < 0.5 * total
    # auto: that does not fit, so vLLM sleeps while the roles train; built now, it still takes only what is free
    m = vllm_memory(choice="auto", total=total, free=50 * gib, training_peak=100 * gib, vllm_need=0.5 * total,
                    utilization=0.5, kv_cache_given=False)
    assert m.free_cache and m.room_bytes == 50 * gib - RESERVE_BYTES
    assert _vllm_starts(total, 50 * gib, m.gpu_memory_utilization) and m.gpu_memory_utilization < 0.5
    with pytest.raises(ConfigError, match=r"rollout: vLLM has no GPU memory left beside the training roles' predicted "
                                          r"peak .* or rollout.free_cache_engine=auto$"):
        vllm_memory(choice=False, total=total, free=free, training_peak=total - gib, vllm_need=gib,
                    utilization=0.5, kv_cache_given=False)


def test_the_tokenizerless_chat_template_warmup_is_not_logged_but_other_warmup_failures_are(caplog):
    """vLLM's LLM() warms up a chat template with a tokenizer our engines never load (skip_tokenizer_init): that one
    failure is dropped, so clean runs print no traceback; any other failure of the warm-up is still logged."""
    import logging

    from verl_mega.rollout.vllm_rollout import WARMUP_LOGGER, quiet_tokenizerless_warmup

    quiet_tokenizerless_warmup()
    quiet_tokenizerless_warmup()  # once, however many engines are built
    logger = logging.getLogger(WARMUP_LOGGER)
    assert sum(type(f).__name__ == "_TokenizerlessWarmup" for f in logger.filters) == 1
    for exc in (ValueError("Tokenizer not available when `skip_tokenizer_init=True`"), ValueError("bad template")):
        try:
            raise exc
        except ValueError:
            with caplog.at_level(logging.WARNING, logger=WARMUP_LOGGER):
                logger.warning("Chat template warmup failed", exc_info=True)
    assert [r.exc_info[1].args[0] for r in caplog.records if r.name == WARMUP_LOGGER] == ["bad template"]
