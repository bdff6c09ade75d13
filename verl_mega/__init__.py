"""verl_mega: Megatron-Core-backed RL post-training (PPO, GRPO, ...) with a 3D-HybridEngine for vLLM rollout."""

import warnings as _warnings

__version__ = "0.1.0"

# Megatron-Core announces at import that optional apex / transformer-engine are absent; our own layer spec is
# designed to run without them, so these notices are noise for our users.
for _msg in (r".*(Apex|Transformer Engine)( and Apex)? (is|are) not installed.*",
             r".*tp_group is None, using default tp group.*",
             r".*requires ffn_hidden_size, but it was not provided.*",
             r".*full scope is deprecated.*"):
    _warnings.filterwarnings("ignore", message=_msg)


# The Python surface, imported on first use so `import verl_mega` stays light (no torch/vLLM/Megatron import).
_LAZY = {"RLTrainer": "verl_mega.trainer.api", "vLLMBackend": "verl_mega.trainer.api",
         "HybridEngine": "verl_mega.rollout.colocated", "DataflowBuilder": "verl_mega.trainer.dataflow",
         "rollout_only": "verl_mega.rollout.quick", "load_config": "verl_mega.config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl_mega' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
