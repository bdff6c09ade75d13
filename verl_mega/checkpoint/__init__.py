"""Checkpoints: Megatron dist checkpoints of weights and optimizer state, the full training state, HF export."""
