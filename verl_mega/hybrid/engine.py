"""The 3D-HybridEngine façade: one actor switching between Megatron training and vLLM generation in place.

    engine = HybridEngine(arch=arch, chunks=actor_chunks, rollout_config=VLLMRolloutConfig(...))
    engine.to_generation()          # wake vLLM weights → sync shards → wake KV cache
    batch = engine.generate(prompts, SamplingSpec(n=4, max_tokens=512))
    engine.to_training()            # vLLM sleeps: KV cache freed (GPU), weights offloaded/discarded

``HybridEngine().is_available()`` answers, without building anything, whether this process can run it, and
:meth:`HybridEngine.why_unavailable` says why not. On a single device the same code runs with every
communication step skipped (t = tg = p = 1).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import torch

from verl_mega.hybrid.layout import HybridLayout, ModelDims, plan_layout
from verl_mega.models.hf_config import ModelArch
from verl_mega.rollout.vllm_rollout import RolloutBatch, SamplingSpec, VLLMRollout, VLLMRolloutConfig

logger = logging.getLogger(__name__)


class HybridEngine:
    """Layout planner + in-process vLLM rollout + weight sync for one actor. Collective: all ranks together."""

    def __init__(self, *, arch: ModelArch | None = None, chunks: list[torch.nn.Module] | None = None,
                 rollout_config: VLLMRolloutConfig | None = None, layout: HybridLayout | None = None,
                 sync_mode: str = "inplace") -> None:
        self.arch, self.chunks, self.rollout_config = arch, chunks, rollout_config
        self.layout = layout
        self.sync_mode = sync_mode
        self.rollout: VLLMRollout | None = None
        self._sync = None
        self.metrics: dict[str, float] = {}
        if arch is not None and chunks is not None and rollout_config is not None:
            self.build()

    # ---- availability ------------------------------------------------------------------------------------
    @staticmethod
    def why_unavailable() -> str | None:
        """None when this process can run the engine, else the reason and the fix."""
        import torch.distributed as dist

        try:
            from vllm.platforms import current_platform
        except Exception as exc:  # vLLM import errors vary by build
            return f"vLLM is not importable ({type(exc).__name__}: {exc}); install verl_mega[gpu] or verl_mega[cpu]"
        cuda = torch.cuda.is_available()
        if cuda and current_platform.is_cpu():
            return "CUDA is present but the installed vLLM is the CPU build; install verl_mega[gpu]"
        if not cuda and not current_platform.is_cpu():
            return "no CUDA device and vLLM is not the CPU build; install verl_mega[cpu] for CPU mode"
        if dist.is_initialized():
            backend = dist.get_backend()
            if cuda and backend != "nccl" and "nccl" not in str(backend):
                return f"torch.distributed uses {backend!r} on GPUs; initialise it with NCCL"
        elif int(__import__("os").environ.get("WORLD_SIZE", "1")) > 1:
            return "WORLD_SIZE > 1 but torch.distributed is not initialised; call parallel.state.init_distributed()"
        if cuda and not dist.is_nccl_available():
            return "this PyTorch build has no NCCL; GPU weight sync needs it"
        return None

    def is_available(self) -> bool:
        reason = self.why_unavailable()
        if reason is not None:
            logger.warning("HybridEngine unavailable: %s", reason)
        return reason is None

    # ---- building ----------------------------------------------------------------------------------------
    def build(self) -> None:
        """Plan the layout (from Megatron's groups unless given), start vLLM, prepare the sync."""
        from verl_mega.hybrid.sync import WeightSync

        if self.arch is None or self.chunks is None or self.rollout_config is None:
            raise ValueError("HybridEngine needs arch=, chunks= and rollout_config= to build")
        reason = self.why_unavailable()
        if reason is not None:
            raise RuntimeError(f"HybridEngine unavailable: {reason}")
        if self.layout is None:
            self.layout = _layout_from_megatron(self.arch, self.rollout_config.gen_tp)
        self.rollout = VLLMRollout(self.rollout_config, self.layout)
        self._sync = WeightSync(layout=self.layout, arch=self.arch, chunks=self.chunks, rollout=self.rollout,
                                mode=self.sync_mode)

    # ---- switching ---------------------------------------------------------------------------------------
    def to_generation(self) -> dict[str, float]:
        """Training → generation: weights first (so the KV cache cannot crowd them out), then the KV cache."""
        rollout, sync = self._ready()
        start = time.perf_counter()
        rollout.wake_up(["weights"])
        woke = time.perf_counter()
        metrics = dict(sync.sync())
        synced = time.perf_counter()
        rollout.wake_up(["kv_cache"])
        _cuda_sync()
        done = time.perf_counter()
        metrics.update({"switch/wake_weights_s": woke - start, "switch/wake_kv_cache_s": done - synced,
                        "switch/to_generation_s": done - start})
        self.metrics = metrics
        return metrics

    def to_training(self) -> None:
        """Generation → training: vLLM sleeps (KV cache freed; weights offloaded or discarded on GPU)."""
        rollout, _ = self._ready()
        rollout.sleep()

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingSpec) -> RolloutBatch:
        rollout, _ = self._ready()
        return rollout.generate(prompt_token_ids, sampling)

    @property
    def weight_version(self) -> int:
        return self.rollout.weight_version if self.rollout is not None else 0

    def _ready(self):
        if self.rollout is None or self._sync is None:
            raise RuntimeError("HybridEngine is not built; pass arch=, chunks=, rollout_config= or call build()")
        return self.rollout, self._sync


def _layout_from_megatron(arch: ModelArch, gen_tp: int) -> HybridLayout:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    world = dist.get_world_size() if dist.is_initialized() else 1
    tp = mpu.get_tensor_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    pp = mpu.get_pipeline_model_parallel_world_size() if mpu.model_parallel_is_initialized() else 1
    dims = ModelDims(num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                     ffn_hidden_size=arch.ffn_hidden_size, num_layers=arch.num_layers)
    return plan_layout(world_size=world, tp=tp, pp=pp, gen_tp=gen_tp, dims=dims)


def _cuda_sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
