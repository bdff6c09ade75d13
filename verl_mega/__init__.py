"""verl_mega: Megatron-Core-backed RL post-training (PPO, GRPO, ...) with a 3D-HybridEngine for vLLM rollout."""

__version__ = "0.1.0"
