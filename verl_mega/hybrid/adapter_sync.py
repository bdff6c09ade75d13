"""The adapter-only weight sync of a LoRA actor (``model.lora.rollout_sync=adapter``): vLLM runs its own LoRA.

The first sync writes the frozen base into vLLM through the in-place 3D-HybridEngine (adapters off), exactly as full
fine-tuning's sync does, so vLLM's base is the training base bit for bit. Every sync after that moves only the
adapters: gathered whole over TP and the pipeline stages (:func:`~verl_mega.models.lora.adapter_tensors`, r-wide
tensors), written as a PEFT adapter into a directory in ``/dev/shm`` (memory) and handed to vLLM as a
``LoRARequest`` that replaces the previous adapter in place (vLLM's own loader, which splits it over the generation
TP ranks). Each rank writes its own copy: an engine's ranks load what they read themselves.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from verl_mega.config.model import VLLM_LORA_RANKS  # vLLM's accepted max_lora_rank values (vllm.config.lora)
from verl_mega.hybrid.producer import WeightSync
from verl_mega.hybrid.transport import device_synchronize
from verl_mega.models.lora import adapter_tensors, adapters_off, lora_spec_of, write_peft_adapter


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds ``rank``."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"model.lora.rank={rank}: vLLM's LoRA takes ranks up to {VLLM_LORA_RANKS[-1]}; use "
                         f"model.lora.rollout_sync=merge")
    return fits[0]


class AdapterSync:
    """Same contract as :class:`~verl_mega.hybrid.producer.WeightSync` (``sync()`` → metrics, collective over the
    pool), for a rollout built with vLLM's LoRA enabled."""

    def __init__(self, base_sync: WeightSync) -> None:
        self.base_sync = base_sync
        self.rollout = base_sync.rollout
        self.producer = base_sync.producer
        self.version = 0
        self.spec = lora_spec_of(self.producer.chunks)
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        self.root = Path(tempfile.mkdtemp(prefix=f"verl_mega_lora_{os.getpid()}_", dir=root))
        self._current: Path | None = None
        self._loads = 0  # adapters handed to vLLM so far; each one's id

    @torch.no_grad()
    def sync(self) -> dict[str, float]:
        first = self.version == 0
        base = {}
        if first:  # the base, once, through the in-place sync (which records the new weights itself)
            with adapters_off(self.producer.chunks):
                base = self.base_sync.sync()
        device_synchronize()
        start = time.perf_counter()
        tensors = adapter_tensors(self.producer.chunks, self.producer.groups)
        self.version += 1
        target = self.root / f"v{self.version}"
        write_peft_adapter(target, tensors, self.spec)
        if self._current is not None:  # the engine reads the new directory at its next generation
            shutil.rmtree(self._current, ignore_errors=True)
        self._current = target
        self._hand_over()
        if not first:
            self.rollout.weights_updated()
        adapter_bytes = float(sum(t.numel() * t.element_size() for t in tensors.values()))
        return {"weight_sync/seconds": time.perf_counter() - start + base.get("weight_sync/seconds", 0.0),
                "weight_sync/bytes_received": adapter_bytes + base.get("weight_sync/bytes_received", 0.0),
                "weight_sync/adapter_bytes": adapter_bytes,
                "weight_sync/model_bytes": float(self.producer.model_bytes()),
                "weight_sync/version": float(self.version)}

    @torch.no_grad()
    def restore(self) -> float:
        """The base again (adapters off), as the same version: vLLM discarded it (a level-2 sleep), and with it the
        adapter's slots, so the adapter is handed over again too."""
        with adapters_off(self.producer.chunks):
            seconds = self.base_sync.restore()
        if self._current is not None:
            self._hand_over()
        return seconds

    def _hand_over(self) -> None:
        """The current adapter, under an id vLLM has not seen: vLLM loads it into its slots once, at the next
        generation's first step, and reuses it for every later step. (One id loaded "in place" would be read from
        disk and copied again at every engine step.)"""
        from vllm.lora.request import LoRARequest

        self._loads += 1
        self.rollout.lora_request = LoRARequest(lora_name=f"policy-{self._loads}", lora_int_id=self._loads,
                                                lora_path=str(self._current))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
