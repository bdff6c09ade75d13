"""The 3D-HybridEngine's producer (HybridFlow §5): this rank's Megatron shards → exactly the vLLM slices it owns,
streamed layer by layer into a transport, plus :class:`WeightSync`, which runs producer and transport for the
rollout.

Per rank and per transformer layer:

1. **micro-DP all-gather** (m = t/tg ranks of one stage): the rank's own TP shard plus m-1 others = block j;
2. **convert** block j straight into vLLM's layout (:mod:`verl_mega.hybrid.convert`);
3. **PP exchange** (pp > 1, the pipeline group): all-gather the converted block of every stage's k-th local layer,
   so after L/p steps every rank holds block j of all layers;
4. **write** into the buffers the transport gives out.

Routed experts (MoE) skip step 1: Megatron's (ep, etp) shards are exchanged point-to-point inside each expert-data-
parallel replica of the stage (:func:`~verl_mega.hybrid.convert.expert_plan`: each rank receives only the expert rows
of its generation block it does not hold), written straight into vLLM's fused expert layout, then join step 3.

Embedding and LM-head rows follow vLLM's vocabulary split, exchanged point-to-point inside the owning stage's
training TP group (only rows a rank lacks), then broadcast along the pipeline group. Peak extra memory is one
layer's buffers. ``mode="reference"`` is the baseline: every rank gathers full HF tensors (TP all-gather + PP
broadcast) and vLLM's own loader slices them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verl_mega.hybrid.convert import (block_copies, block_shape, canonical_name, expert_block_shape,
                                      expert_dest_views, expert_plan, expert_source_views, vllm_name, vllm_slot,
                                      vllm_vocab_rows, vocab_row_plan, write_block)
from verl_mega.hybrid.copy_plan import CopyPlan
from verl_mega.hybrid.transport import InPlaceTransport, WeightSyncError, device_synchronize, is_fp8_linear
from verl_mega.models.hf_config import ModelArch
from verl_mega.models.loader import iter_hf_tensors, unwrap
from verl_mega.models.lora import effective_weight, has_adapters
from verl_mega.models.weights import MAPPED_BUFFERS, ParamRule, mapped_tensors, rule_for
from verl_mega.parallel.state import RankGroups

MODES = ("inplace", "reference")
# vLLM parameters derived from others after loading (MLA's absorbed W_UK_T / W_UV, from kv_b_proj): the transport
# has vLLM recompute them (transport.InPlaceTransport.commit), the producer never writes them
DERIVED = (".W_UK_T", ".W_UV")
# quantization scales vLLM keeps beside a quantized weight: the FP8 transport writes them with their weight
# (vLLM 0.26 registers attention's own as ``attn._k_scale`` etc.; they keep vLLM's values)
SCALES = (".weight_scale", ".input_scale", ".k_scale", ".v_scale", ".q_scale", ".prob_scale", "._k_scale", "._v_scale",
          "._q_scale", "._prob_scale")


def written_names(vllm_names: set[str]) -> set[str]:
    """vLLM's parameters that a weight sync writes: all of them but those it derives and the quantization scales."""
    return {canonical_name(n) for n in vllm_names if not n.endswith(DERIVED + SCALES)}


@dataclass
class _Param:
    suffix: str  # mcore name inside the layer (or top-level name)
    tensor: torch.Tensor
    rule: ParamRule
    layer: torch.nn.Module | None = None  # the owning decoder layer (None: top-level)

    @property
    def data(self) -> torch.Tensor:
        """What vLLM gets: the parameter, or for a linear with LoRA adapters its merged weight ``W + s·B·A``
        (computed from this rank's shards alone, one layer at a time)."""
        return self.tensor.data if self.layer is None else effective_weight(self.layer, self.suffix, self.tensor)

    @property
    def exact(self) -> bool:
        """Kept in fp32 whatever the model's dtype (DeepSeek's routing correction bias, as vLLM keeps it)."""
        return self.suffix.endswith(MAPPED_BUFFERS)


@dataclass(frozen=True)
class _Slot:
    """One parameter's block of a layer step, as the owning stage lays it out for the PP exchange."""

    suffix: str
    layer: int  # global layer
    shape: tuple[int, ...]
    exact: bool


class WeightProducer:
    """This rank's Megatron chunks → its vLLM engine's slices. Collective over the pool: all ranks produce
    together."""

    def __init__(self, *, groups: RankGroups, arch: ModelArch, chunks: list[torch.nn.Module]) -> None:
        self.groups, self.arch = groups, arch
        self.pool = groups.pool
        self.chunks = [unwrap(c) for c in chunks]
        self.received = self.peak = 0
        self._layers = self._local_layers()
        self._top = self._local_top_params()
        self._direct: CopyPlan | None = None
        self.cuda_graph = True  # replay the direct copy plan as a CUDA graph where it can (the benchmark turns it off)
        self.lora = has_adapters(self.chunks)  # the merged weights are new tensors at every sync
        self._experts = self._expert_exchange() if arch.is_moe else None
        self._stage_slots = self._all_stage_slots()

    def _expert_exchange(self) -> dict[str, Any]:
        """This rank's part of the stage's expert plan: pieces to send per peer, to receive per peer, to copy."""
        me, arch = self.groups.rank, self.arch
        plan = expert_plan(self.pool, self.groups.pp_rank, arch.num_experts, arch.moe_ffn_hidden_size)
        sends: dict[int, list] = {}
        recvs: dict[int, list] = {}
        for piece in plan:
            if piece.src == me and piece.dst != me:
                sends.setdefault(piece.dst, []).append(piece)
            elif piece.dst == me and piece.src != me:
                recvs.setdefault(piece.src, []).append(piece)
        local = [piece for piece in plan if piece.src == piece.dst == me]
        c = self.groups.coords
        e0, e1, r0, r1 = self.pool.expert_slice(me, arch.num_experts, arch.moe_ffn_hidden_size)
        return {"sends": sends, "recvs": recvs, "local": local, "slice": (e1 - e0, r1 - r0),
                "src": dict(ep_rank=c["ep"], etp_rank=c["etp"], num_experts=arch.num_experts, ep=self.pool.ep,
                            etp=self.pool.etp, width=arch.moe_ffn_hidden_size),
                "dst": dict(first_expert=e0, first_row=r0, rows=r1 - r0)}

    # ---- setup -------------------------------------------------------------------------------------------
    def _local_layers(self) -> list[tuple[int, list[_Param]]]:
        layers = []
        for model in self.chunks:
            offset = model.stage_layout.layer_offset
            for i, layer in enumerate(model.decoder.layers):
                params = [_Param(n, p, rule_for(f"decoder.layers.{i}.{n}", self.arch, offset), layer)
                          for n, p in mapped_tensors(layer)]
                layers.append((offset + i, params))
        layers.sort(key=lambda x: x[0])
        expected = self.arch.num_layers // self.pool.pp
        if len(layers) != expected:
            raise WeightSyncError(f"this stage holds {len(layers)} layers, the layout expects {expected} (L/pp)")
        return layers

    def _all_stage_slots(self) -> list[list[list[_Slot]]]:
        """Every stage's layer steps as it lays them out (``[stage][step]``): a stage's layers may differ from
        another's (DeepSeek's dense first layers), and each writes the PP exchange in its own layout."""
        mine = [[_Slot(p.suffix, g, self._block_shape(p, self.pool.micro_dp), p.exact) for p in params]
                for g, params in self._layers]
        if self.pool.pp == 1:
            return [mine]
        out: list[Any] = [None] * self.pool.pp
        dist.all_gather_object(out, mine, group=self.groups["pp"])
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

    def check_coverage(self, vllm_names: set[str]) -> None:
        """The slices produced are exactly the receiving model's parameters (less those vLLM derives itself)."""
        names = set()
        for stage in self._stage_slots:
            for step in stage:
                names |= {self._slot_of(s)[0] for s in step}
        names |= {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.arch.tie_word_embeddings:
            names.add("lm_head.weight")
        vllm_names = written_names(vllm_names)
        if names != vllm_names:
            missing, extra = sorted(vllm_names - names), sorted(names - vllm_names)
            raise WeightSyncError(
                f"weight sync does not cover vLLM's model exactly (vLLM-only: {missing[:3]}, sync-only: {extra[:3]}); "
                "the HF config given to vLLM and the Megatron model differ")

    def model_bytes(self) -> int:
        """M: bytes of the model's HF tensors in the training dtype (embeddings once when tied)."""
        return self.arch.num_parameters() * self._layers[0][1][0].tensor.element_size()

    def predicted_bytes(self) -> float:
        """Bytes this rank should receive, by the planner's arithmetic (:meth:`ModelArch.hybrid_sync_bytes`)."""
        return self.arch.hybrid_sync_bytes(self.pool, self.groups.rank, self._layers[0][1][0].tensor.element_size())

    def drop_plan(self) -> None:
        """Forget the direct copy plan (and its graph): the next sync builds it again."""
        self._direct = None

    @property
    def direct_graphed(self) -> bool:
        """Whether the last sync's layer copies replayed a CUDA graph (:class:`CopyPlan`)."""
        return self._direct is not None and self._direct.graphed

    # ---- produce -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def produce(self, sink: InPlaceTransport) -> None:
        """Write this rank's vLLM slices of the current weights into ``sink``."""
        self._sync_vocab(sink, "embedding.word_embeddings.weight", "model.embed_tokens.weight", stage=0)
        direct = isinstance(sink, InPlaceTransport) and not sink.repacks
        if direct and self.pool.micro_dp == 1 and self.pool.pp == 1 and not self.arch.is_moe and \
                not self.arch.is_mla:
            self._copy_layers_direct(sink)
        else:
            for step in range(len(self._layers)):
                self._sync_layer(sink, step)
                sink.commit()
        last = self.pool.pp - 1
        self._sync_replicated(sink, "decoder.final_layernorm.weight", "model.norm.weight", stage=last)
        if not self.arch.tie_word_embeddings:
            self._sync_vocab(sink, "output_layer.weight", "lm_head.weight", stage=last)
        sink.commit()

    def full_tensors(self):
        """Reference path: every rank streams the full HF tensors (its received bytes counted)."""
        local = sum(self._useful_local_bytes(p) for _, params in self._layers for p in params)
        local += sum(self._useful_local_bytes(p) for p in self._top.values())
        streamed = 0
        for name, tensor in iter_hf_tensors(self.chunks, self.arch, self.groups):
            streamed += _nbytes(tensor)
            self.peak = max(self.peak, _nbytes(tensor) * 2)  # gathered shards + the converted full tensor
            yield name, tensor
        self.received = streamed - local

    def _copy_layers_direct(self, sink: InPlaceTransport) -> None:
        """No communication (t = tg, p = 1): strided copies from Megatron's parameters straight into vLLM's.

        The copy plan is built once and reused while both sides keep their storage (offload/onload or a vLLM
        restart moves it, which the pointer key detects); on CUDA its reuses replay a CUDA graph (:class:`CopyPlan`).
        With LoRA adapters each layer's merged weights are made, copied and dropped in turn (the extra peak is one
        layer's)."""
        if self.lora:
            for _, params in self._layers:
                for p in params:
                    shape = block_shape(p.rule, p.tensor.shape, 1)
                    for dst, src in block_copies(p.rule, sink.buffer(vllm_name(p.rule), shape), [p.data], self.arch):
                        dst.copy_(src)
            return
        key = tuple(p.tensor.data_ptr() for _, params in self._layers for p in params)
        key += tuple(t.data_ptr() for t in sink.params.values())
        # the plan's FP8 destinations record into this transport's dict: a new transport (a new vLLM model, which may
        # sit at the old addresses) needs a new plan, or its coverage check would read counts the plan never makes
        key += (id(sink.quantized_written),)
        if self._direct is None or self._direct.key != key:
            pairs = []
            for _, params in self._layers:
                for p in params:
                    shape = block_shape(p.rule, p.tensor.shape, 1)
                    pairs += block_copies(p.rule, sink.buffer(vllm_name(p.rule), shape), [p.tensor.data], self.arch)
            self._direct = CopyPlan(key, pairs, graph=self.cuda_graph)
        self._direct.run()

    def _slot_of(self, slot: _Slot) -> tuple[str, int, int | None]:
        return vllm_slot(rule_for(f"decoder.layers.0.{slot.suffix}", self.arch, slot.layer), self.arch)

    def _dest(self, sink: InPlaceTransport, slot: _Slot) -> torch.Tensor:
        """Where one parameter's block goes in vLLM: its parameter, or its rows of a fused one."""
        name, first, rows = self._slot_of(slot)
        if rows is None:
            return sink.buffer(name, slot.shape)
        return sink.buffer(name, (rows, *slot.shape[1:]))[first:first + slot.shape[0]]

    def _sync_layer(self, sink: InPlaceTransport, step: int) -> None:
        _, params = self._layers[step]
        m, p_size, me = self.pool.micro_dp, self.pool.pp, self.groups.pp_rank
        sharded = [p for p in params if p.rule.kind != "replicated" and not p.rule.is_expert]
        shards: dict[str, list[torch.Tensor]] = {p.suffix: [p.data] for p in params if not p.rule.is_expert}
        live = 0
        if m > 1 and sharded:
            flat = torch.cat([shards[p.suffix][0].reshape(-1) for p in sharded])
            gathered = _all_gather(flat, m, self.groups["micro_dp"])
            self.received += (m - 1) * _nbytes(flat)
            live += _nbytes(flat) + _nbytes(gathered)
            offset = 0
            for p in sharded:
                n = p.tensor.numel()
                shards[p.suffix] = [gathered[i, offset:offset + n].view(p.tensor.shape) for i in range(m)]
                offset += n
        slots = self._stage_slots[me][step]
        if p_size == 1:
            views = {s.suffix: self._dest(sink, s) for s in slots}
            live += self._write_blocks(params, views, shards)
            self.peak = max(self.peak, live)
            return
        # pp > 1: convert into one byte buffer (fp32 slots stay fp32), exchange it over the pipeline group, write
        # every stage's part in that stage's layout
        layouts = [_byte_layout(stage[step], sink.dtype) for stage in self._stage_slots]
        stage_buf = torch.empty(layouts[me][1], dtype=torch.uint8, device=params[0].tensor.device)
        views = {s.suffix: _typed(stage_buf, off, s, dt) for s, off, dt in layouts[me][0]}
        live += self._write_blocks(params, views, shards)
        everyone = _exchange_stages(stage_buf, [size for _, size in layouts], self.groups)
        self.received += sum(size for stage, (_, size) in enumerate(layouts) if stage != me)
        self.peak = max(self.peak, live + sum(_nbytes(b) for b in everyone))
        for stage, (layout, _) in enumerate(layouts):
            for slot, off, dt in layout:
                self._dest(sink, slot).copy_(_typed(everyone[stage], off, slot, dt))

    def _block_shape(self, p: _Param, m: int) -> tuple[int, ...]:
        if p.rule.is_expert:
            return expert_block_shape(p.rule, self.arch, *self._experts["slice"])
        return block_shape(p.rule, p.tensor.shape, m if p.rule.kind != "replicated" else 1)

    def _write_blocks(self, params: list[_Param], views: dict[str, torch.Tensor],
                      shards: dict[str, list[torch.Tensor]]) -> int:
        """Write every parameter of one layer into its destination view; returns the bytes of transient buffers."""
        experts = {p.rule.kind: p for p in params if p.rule.is_expert}
        for p in params:
            if not p.rule.is_expert:
                write_block(p.rule, views[p.suffix], shards[p.suffix], self.arch)
        if not experts:
            return 0
        fc1, fc2 = experts["experts_fc1"], experts["experts_fc2"]
        return self._exchange_experts(fc1.tensor.data, fc2.tensor.data, views[fc1.suffix], views[fc2.suffix])

    def _exchange_experts(self, weight1: torch.Tensor, weight2: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor) -> int:
        """One layer's routed experts: point-to-point inside this rank's expert-data-parallel replica, each rank
        receiving only the rows of its generation block that it does not hold (``expert_plan``)."""
        x = self._experts
        src = lambda piece: expert_source_views(piece, weight1, weight2, **x["src"])  # noqa: E731
        dst = lambda piece: expert_dest_views(piece, w13, w2, **x["dst"])  # noqa: E731
        for piece in x["local"]:
            for to, frm in zip(dst(piece), src(piece)):
                to.copy_(frm)
        ops, inbox, live = [], [], 0
        for peer, pieces in x["sends"].items():
            out = torch.cat([v.reshape(-1) for piece in pieces for v in src(piece)])
            ops.append(dist.P2POp(dist.isend, out, peer))
            live += _nbytes(out)
        for peer, pieces in x["recvs"].items():
            buf = torch.empty(sum(3 * (q.hi - q.lo) for q in pieces) * weight1.shape[0], dtype=weight1.dtype,
                              device=weight1.device)
            ops.append(dist.P2POp(dist.irecv, buf, peer))
            inbox.append((buf, pieces))
            self.received += _nbytes(buf)
            live += _nbytes(buf)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for buf, pieces in inbox:
            offset = 0
            for piece in pieces:
                for to in dst(piece):
                    n = to.numel()
                    to.copy_(buf[offset:offset + n].view(to.shape))
                    offset += n
        return live

    def _sync_replicated(self, sink: InPlaceTransport, mcore_name: str, vllm_param: str, stage: int) -> None:
        dst = sink.buffer(vllm_param, (self.arch.hidden_size,))
        if self.groups.pp_rank == stage:
            dst.copy_(self._top[mcore_name].tensor.data)
        self._pp_broadcast(dst, stage)

    def _sync_vocab(self, sink: InPlaceTransport, mcore_name: str, vllm_param: str, stage: int) -> None:
        module = sink.module(vllm_param.rpartition(".")[0])
        tg, j = self.pool.gen_tp, self.groups.coords["gen_tp"]
        rows = vllm_vocab_rows(self.arch.vocab_size, tg, getattr(module, "padding_size", 64))
        need = rows[j]
        indices = getattr(module, "shard_indices", None)
        if indices is not None and (indices.org_vocab_start_index,
                                    indices.org_vocab_end_index) != (need.start, need.end):
            raise WeightSyncError(f"{vllm_param}: vLLM keeps rows {indices}, the sync planned {need}")
        dst = sink.buffer(vllm_param, (need.partition_rows, self.arch.hidden_size))
        if self.groups.pp_rank == stage:
            shard = self._top[mcore_name].tensor.data
            t, me, tp_ranks = self.pool.tp, self.groups.tp_rank, self.groups.ranks("tp")
            per = shard.shape[0]
            ops = []
            for tr in vocab_row_plan(per * t, t, self.pool.micro_dp, rows):
                if tr.dst == me:
                    into = dst[tr.start - need.start:tr.end - need.start]
                    if tr.src == me:
                        into.copy_(shard[tr.start - me * per:tr.end - me * per])
                    else:
                        recv = into if into.dtype == shard.dtype else torch.empty_like(into, dtype=shard.dtype)
                        ops.append((dist.P2POp(dist.irecv, recv, tp_ranks[tr.src]), into, recv))
                        self.received += _nbytes(recv)
                elif tr.src == me:
                    rows_out = shard[tr.start - me * per:tr.end - me * per].contiguous()
                    ops.append((dist.P2POp(dist.isend, rows_out, tp_ranks[tr.dst]), None, None))
            if ops:
                for req in dist.batch_isend_irecv([op for op, _, _ in ops]):
                    req.wait()
                for _, into, recv in ops:
                    if into is not None and recv is not into:
                        into.copy_(recv)
            dst[need.end - need.start:].zero_()
        self._pp_broadcast(dst, stage)

    def _pp_broadcast(self, dst: torch.Tensor, stage: int) -> None:
        if self.pool.pp == 1:
            return
        buf = dst if dst.is_contiguous() else dst.contiguous()
        dist.broadcast(buf, src=self.groups.global_rank("pp", stage), group=self.groups["pp"])
        if buf is not dst:
            dst.copy_(buf)
        if self.groups.pp_rank != stage:
            self.received += _nbytes(buf)

    def _useful_local_bytes(self, p: _Param) -> int:
        """Bytes of this rank's shard that appear in the HF tensors (Megatron's vocab padding rows do not)."""
        t = p.tensor
        if p.rule.kind == "vocab":
            per, rank = t.shape[0], self.groups.tp_rank
            rows = max(0, min(self.arch.vocab_size, (rank + 1) * per) - rank * per)
            return rows * t[0].numel() * t.element_size()
        return _nbytes(t)


class WeightSync:
    """Training weights → this rank's vLLM engine: the producer writing through a transport (in place when
    colocated), or the reference path. Collective over the pool: all ranks call :meth:`sync` together."""

    def __init__(self, producer: WeightProducer, rollout, mode: str = "inplace") -> None:
        if mode not in MODES:
            raise ValueError(f"weight sync mode={mode!r} is not one of {MODES}")
        fp8 = [n for n, p in rollout.model.named_parameters() if p.dtype == torch.float8_e4m3fn]
        if fp8:
            linears = {f"{n}.weight" for n, m in rollout.model.named_modules() if is_fp8_linear(m)}
            other = [n for n in fp8 if n not in linears]
            if other or producer.arch.is_moe or producer.arch.is_mla:
                raise WeightSyncError(f"vLLM holds FP8 parameters the weight sync cannot quantize into "
                                      f"({(other or fp8)[:2]}); rollout.quantization=fp8 covers the linears of dense "
                                      "decoders with multi-head attention; set rollout.quantization=none")
            if mode == "reference":
                raise WeightSyncError("vLLM holds FP8 weights, which its own loader cannot fill from full bf16 "
                                      "tensors; use the in-place weight sync (rollout.weight_sync=inplace)")
        self.producer, self.rollout, self.mode = producer, rollout, mode
        self.version = 0
        self._transport: InPlaceTransport | None = None
        producer.check_coverage({n for n, _ in rollout.model.named_parameters()})

    @torch.no_grad()
    def sync(self) -> dict[str, float]:
        """Write the current training weights into vLLM; returns bytes, timing and the new weight version."""
        seconds, quantized = self._write()
        self.version += 1
        self.rollout.weights_updated()
        producer = self.producer
        model_bytes, pool = producer.model_bytes(), producer.pool
        return {
            "weight_sync/seconds": seconds,
            "weight_sync/bytes_received": float(producer.received),
            "weight_sync/predicted_bytes": float(producer.predicted_bytes()),
            "weight_sync/peak_buffer_bytes": float(producer.peak),
            "weight_sync/generation_weight_bytes": float(pool.generation_weight_bytes(model_bytes)),
            "weight_sync/model_bytes": float(model_bytes),
            "weight_sync/version": float(self.version),
            "weight_sync/quantized_params": float(quantized),
            "weight_sync/cuda_graph": float(producer.direct_graphed),
        }

    @torch.no_grad()
    def restore(self) -> float:
        """Write the same weights again, as the same version: vLLM discarded its copy (a level-2 sleep) and no new
        weights came since (a validation or a further DAPO round generates next). Returns its seconds."""
        return self._write()[0]

    def _write(self) -> tuple[float, int]:
        """Every vLLM weight written from the current training weights: (seconds, FP8 linears written)."""
        producer = self.producer
        producer.received = producer.peak = 0
        self.rollout.wake_up(["weights"])  # a sleeping engine's weight memory may be unmapped (GPU, level 2)
        device_synchronize()
        start = time.perf_counter()
        quantized = 0
        if self.mode == "inplace":
            model = self.rollout.model
            if self._transport is None or self._transport.model is not model:
                self._transport = InPlaceTransport(model, repacks=self.rollout.is_cpu)
            else:
                self._transport.refresh()
            producer.produce(self._transport)
            quantized = check_quantized_coverage(self._transport)
        else:
            self.rollout.load_full_weights(producer.full_tensors())
        device_synchronize()
        self.rollout.weights_discarded = False
        return time.perf_counter() - start, quantized


def check_quantized_coverage(transport: InPlaceTransport) -> int:
    """Every FP8 linear of vLLM must have been written whole (quantized) by this sync: a parameter, or part of one,
    left out would generate with random weights, silently. Returns how many were written."""
    written, sizes = transport.quantized_written, transport.quantized_sizes
    missed = sorted(set(transport.quantized) - set(written))
    if missed:
        raise WeightSyncError(f"the weight sync wrote {len(written)} of vLLM's {len(transport.quantized)} FP8 linears "
                              f"and missed {len(missed)} (e.g. {missed[:3]}); the layer's sync rule does not reach it")
    partial = sorted(n for n in written if written[n] != sizes.get(n))
    if partial:
        n = partial[0]
        raise WeightSyncError(f"the weight sync wrote {written[n]} of the {sizes.get(n)} elements of vLLM's FP8 {n} "
                              f"({len(partial)} such parameters); its slices do not cover the block")
    return len(written)


def _byte_layout(slots: list[_Slot], dtype: torch.dtype) -> tuple[list[tuple[_Slot, int, torch.dtype]], int]:
    """Byte offsets of a layer step's blocks in one staging buffer, and its size: the fp32 blocks first, so every
    block starts aligned to its own element size with no padding (the bytes sent are the blocks' bytes)."""
    out, offset = [], 0
    for slot in sorted(slots, key=lambda s: not s.exact):
        dt = torch.float32 if slot.exact else dtype
        size = torch.empty((), dtype=dt).element_size()
        if offset % size:
            raise WeightSyncError(f"{slot.suffix}: a {dt} block would start unaligned in the staging buffer")
        out.append((slot, offset, dt))
        offset += math.prod(slot.shape) * size
    return out, offset


def _typed(buf: torch.Tensor, offset: int, slot: _Slot, dtype: torch.dtype) -> torch.Tensor:
    """A block's view of a byte buffer, in its dtype and shape."""
    n = math.prod(slot.shape) * torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + n].view(dtype).view(slot.shape)


def _exchange_stages(mine: torch.Tensor, sizes: list[int], groups: RankGroups) -> list[torch.Tensor]:
    """Every pipeline stage's staging buffer of one layer step: one all-gather when the stages are alike, else a
    broadcast from each stage (their layers differ, e.g. DeepSeek's dense first layers)."""
    n, me = len(sizes), groups.pp_rank
    if len(set(sizes)) == 1:
        return list(_all_gather(mine, n, groups["pp"]))
    out = []
    for stage, size in enumerate(sizes):
        buf = mine if stage == me else torch.empty(size, dtype=mine.dtype, device=mine.device)
        dist.broadcast(buf, src=groups.global_rank("pp", stage), group=groups["pp"])
        out.append(buf)
    return out


def _all_gather(flat: torch.Tensor, n: int, group) -> torch.Tensor:
    """[n, numel] of every member's ``flat`` (a flat output buffer: gloo requires one)."""
    out = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
    dist.all_gather_into_tensor(out, flat, group=group)
    return out.view(n, flat.numel())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
