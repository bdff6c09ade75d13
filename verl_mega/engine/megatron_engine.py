"""The Megatron-Core engine: forward-only and forward-backward through mcore's pipeline schedules, the
distributed optimizer, LR schedule, micro-batching and offload. It knows Megatron, not RL: roles hand it
micro-batches and a loss / post-processing function.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from verl_mega.engine import moe
from verl_mega.engine.grad_sync import install_cross_island_step
from verl_mega.models.build import forward_packed
from verl_mega.models.loader import unwrap
from verl_mega.parallel.cpu_mode import comm_device as _device
from verl_mega.parallel.context import context_chunks, packed_context_chunks
from verl_mega.parallel.state import RankGroups, all_reduce, mcore_tp_dp_cp_group

MicroBatch = dict[str, torch.Tensor]
# post_fn(output, micro_batch) -> dict of per-sample tensors (forward-only), run on the last pipeline stage.
PostFn = Callable[[torch.Tensor, MicroBatch], dict[str, torch.Tensor]]
# loss_fn(output, micro_batch) -> (scalar loss already scaled for accumulation, metrics dict of floats/tensors)
LossFn = Callable[[torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """LR schedule for OptimizerParamScheduler (mcore's own class does the arithmetic)."""

    warmup_steps: int = 0
    total_steps: int = 1
    decay_style: str = "constant"


class MegatronEngine:
    """Owns mcore model chunks of one role on this rank (+ DDP, optimizer, scheduler when trainable), and the
    process groups of the role's pool: every collective it runs, and every one Megatron runs for it, uses them."""

    def __init__(
        self,
        chunks: list[torch.nn.Module],
        model_config,
        groups: RankGroups,
        *,
        optimizer_config: OptimizerConfig | None = None,
        schedule: ScheduleSpec | None = None,
    ) -> None:
        self.config = model_config
        self.groups = groups
        self.trainable = optimizer_config is not None
        pgs = groups.pg_collection
        self.version = 0  # bumped on every optimizer step; rollout reports the version it generated with
        if self.trainable:
            pool = groups.pool
            if pool.dp_islands > 1 and not optimizer_config.use_distributed_optimizer:
                raise ValueError(f"parallel.dp_hierarchy: {pool.dp_islands} data-parallel islands shard the optimizer "
                                 f"inside each island; set parallel.use_distributed_optimizer=true")
            ddp_cfg = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=optimizer_config.use_distributed_optimizer,
                # data-parallel islands: reduce-scatter / all-gather inside an island, shards all-reduced across
                num_distributed_optimizer_instances=pool.dp_islands,
            )
            self.chunks = [
                DistributedDataParallel(config=model_config, ddp_config=ddp_cfg, module=c,
                                        disable_bucketing=(i > 0), pg_collection=pgs)
                for i, c in enumerate(chunks)
            ]
            if pool.dp_islands > 1:  # bf16/fp8 between islands instead of Megatron's fp32 all-reduce
                install_cross_island_step(self.chunks, groups["inter_dp"], pool.dp_cross_island_dtype)
            # mcore refuses gloo groups next to a pg_collection, but its memory-efficient checkpoint gather of the
            # distributed optimizer's state needs the gloo twin of each optimizer's DP group (the dense params' dp·cp,
            # the routed experts' expert-DP): hand it over afterwards
            self.optimizer = get_megatron_optimizer(optimizer_config, self.chunks, use_gloo_process_groups=False,
                                                    pg_collection=pgs)
            twins = {tuple(dist.get_process_group_ranks(groups[k])): groups[f"{k}_gloo"]
                     for k in ("dp_cp", "edp", "intra_dp", "intra_edp")
                     if groups.groups.get(k) is not None and f"{k}_gloo" in groups.groups}
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if hasattr(opt, "data_parallel_group_gloo"):
                    dp_group = getattr(opt, "data_parallel_group", None) or groups["dp_cp"]
                    opt.data_parallel_group_gloo = twins[tuple(dist.get_process_group_ranks(dp_group))]
            sched = schedule or ScheduleSpec()
            lr, min_lr = optimizer_config.lr, optimizer_config.min_lr or 0.0
            self.scheduler = OptimizerParamScheduler(
                self.optimizer,
                init_lr=0.0 if sched.warmup_steps else lr,
                max_lr=lr,
                min_lr=min_lr if sched.decay_style != "constant" else lr,
                lr_warmup_steps=sched.warmup_steps,
                lr_decay_steps=max(sched.total_steps, sched.warmup_steps + 1),
                lr_decay_style=sched.decay_style,
                start_wd=optimizer_config.weight_decay,
                end_wd=optimizer_config.weight_decay,
                wd_incr_steps=1,
                wd_incr_style="constant",
            )
            model_config.finalize_model_grads_func = partial(_finalize_model_grads, groups=groups)
            model_config.grad_scale_func = self.optimizer.scale_loss
        else:
            self.chunks = chunks
            self.optimizer = None
            self.scheduler = None
            for c in chunks:
                c.requires_grad_(False)
        self._offloaded = False
        self.routing: moe.RoutingReplay | None = None
        self.last_router_agreement: float | None = None  # of the last forward that replayed a routing

    def enable_routing_replay(self) -> None:
        """Let :meth:`forward` record the MoE routers' top-k experts and :meth:`train_step` replay them."""
        if not self.is_moe:
            raise ValueError("engine: routing replay needs a Mixture-of-Experts model")
        if self.config.recompute_granularity is not None:
            raise ValueError("engine: routing replay replays each router once per forward; recomputation would run "
                             "the routers again in the backward pass. Set model.recompute=none")
        self.routing = moe.RoutingReplay(self.modules, self.groups, sequence_parallel=self.config.sequence_parallel)

    # ------------------------------------------------------------------ helpers
    @property
    def modules(self) -> list[torch.nn.Module]:
        return [unwrap(c) for c in self.chunks]

    @property
    def is_moe(self) -> bool:
        return bool(self.config.num_moe_experts)

    @property
    def dp_size(self) -> int:
        return self.groups.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.groups.dp_rank

    def dp_all_reduce(self, value, op: str = "sum") -> torch.Tensor:
        """A float64 value reduced over this engine's data-parallel group (`sum`, `max` or `mean`), on the host."""
        return all_reduce(value, self.groups["dp"], op)

    @property
    def _pp(self) -> int:
        return self.groups.size("pp")

    @property
    def cp(self) -> int:
        return self.groups.size("cp")

    @property
    def seq_multiple(self) -> int:
        """Micro-batch widths must be multiples of this: 8 (kernel-friendly), 2·cp (two chunks per CP rank) and, with
        sequence parallelism, cp·tp (each CP rank's tokens split over TP)."""
        sp = self.groups.size("tp") if self.config.sequence_parallel else 1
        return math.lcm(8, 2 * self.cp, self.cp * sp)

    def _cp_order(self, seq_len: int, mb: MicroBatch | None) -> torch.Tensor:
        """Positions of every CP rank's tokens, rank after rank (each rank holds seq_len/cp): the load-balanced chunks
        of the sequence, or of every sequence of a packed ``mb`` (worked out once per micro-batch, on the host)."""
        if mb is not None and "cu_seqlens" in mb:
            if "cp_order" not in mb:
                cu = mb["cu_seqlens"].tolist()
                mb["cp_order"] = torch.tensor([p for r in range(self.cp)
                                               for p in packed_context_chunks(cu, self.cp, r)])
            return mb["cp_order"]
        return torch.tensor([p for r in range(self.cp) for p in context_chunks(seq_len, self.cp, r)])

    def cp_positions(self, seq_len: int, mb: MicroBatch | None = None) -> torch.Tensor:
        """Positions of the sequence (of the pack, for a packed micro-batch ``mb``) this rank's model sees: all of
        them without context parallelism, else the load-balanced chunks of every sequence."""
        return self._cp_order(seq_len, mb).view(self.cp, -1)[self.groups.coords["cp"]]

    def full_sequence(self, local: torch.Tensor, mb: MicroBatch | None = None) -> torch.Tensor:
        """Per-token values of this rank's context-parallel chunks [b, s/cp, …] → the whole sequence (or pack, with
        a packed ``mb``) [b, s, …] on every CP rank; the backward keeps each rank's own chunks. Identity without
        context parallelism."""
        if self.cp == 1:
            return local
        order = self._cp_order(local.shape[1] * self.cp, mb).to(local.device)
        return _GatherSequence.apply(local, self.groups["cp"], order, self.groups.coords["cp"])

    def _run_schedule(self, micro_batches: list[MicroBatch], step_fn, forward_only: bool) -> list[Any]:
        seq_len = max(mb["input_ids"].shape[1] for mb in micro_batches)
        mbs = micro_batches[0]["input_ids"].shape[0]
        if self._pp > 1:  # p2p exchanges assume one activation shape
            for mb in micro_batches:
                if mb["input_ids"].shape != (mbs, seq_len):
                    raise ValueError("engine: with pp>1 every micro-batch of one call must have the same "
                                     "[batch, seq] shape")
        vpp = len(self.chunks)
        iterators = [iter(micro_batches) for _ in range(vpp)] if vpp > 1 else iter(micro_batches)
        fb = get_forward_backward_func(pp_size=self._pp, vp_size=self.groups.pool.vpp)
        extra = {"p2p_communicator": P2PCommunicator(pp_group=self.groups["pp"], config=self.config)} \
            if self._pp > 1 else {}
        return fb(
            forward_step_func=step_fn,
            data_iterator=iterators,
            model=self.chunks if vpp > 1 else self.chunks[0],
            num_microbatches=len(micro_batches),
            seq_length=seq_len,
            micro_batch_size=mbs,
            forward_only=forward_only,
            pg_collection=self.groups.pg_collection,
            **extra,
        )

    def _model_forward(self, model, mb: MicroBatch) -> torch.Tensor:
        device = _device()
        if "cu_seqlens" in mb and self.cp > 1:
            self._cp_order(mb["input_ids"].shape[1], mb)  # from cu_seqlens while they are on the host
        for k, v in mb.items():  # roles build batches on the host; the model and loss run on the device
            if v.device != device and k != "max_seqlen":
                mb[k] = v.to(device, non_blocking=True)
        ids, pos = mb["input_ids"], mb["position_ids"]
        if "cu_seqlens" in mb:  # packed (THD): one row of back-to-back sequences
            cp_layout = None
            if self.cp > 1:  # this rank's chunks of every sequence; the attention reads the pack's layout
                local = self.cp_positions(ids.shape[1], mb)
                cp_layout = (local, mb["cp_order"])
                ids, pos = ids[:, local], pos[:, local]
            return forward_packed(model, ids, pos, mb["cu_seqlens"], int(mb["max_seqlen"]), rope_owner=unwrap(model),
                                  cp_layout=cp_layout)
        if self.cp > 1:  # the model sees this rank's chunks; the loss keeps the whole micro-batch
            local = self.cp_positions(ids.shape[1]).to(device)
            ids, pos = ids[:, local], pos[:, local]
        return model(ids, pos, mb.get("attention_mask"))

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def forward(self, micro_batches: list[MicroBatch], post_fn: PostFn, *, record_routing: bool = False
                ) -> list[dict[str, torch.Tensor]]:
        """Forward-only over micro-batches; returns post_fn's outputs per micro-batch on EVERY rank. With
        ``record_routing`` (after :meth:`enable_routing_replay`) each output also has ``routed_experts``
        [b, s, MoE layers of this rank, k], the experts every token was routed to. Micro-batches that carry
        ``routed_experts`` (and optionally ``routing_valid``) replay that routing instead, as :meth:`train_step`
        does; :attr:`last_router_agreement` then holds the share of replayed experts the routers would have chosen."""
        for c in self.chunks:
            c.eval()
        if record_routing and self.routing is None:
            raise ValueError("engine: forward(record_routing=True) needs enable_routing_replay() first")
        replay = self.routing is not None and "routed_experts" in micro_batches[0]
        if replay and record_routing:
            raise ValueError("engine: forward either records or replays the routing, not both")
        recorded: list[list[torch.Tensor]] = [[] for _ in self.chunks]

        def step(data_iterator, model):
            mb = next(data_iterator)
            if replay:
                self._set_replay_targets(model, mb)
            out = self._model_forward(model, mb)
            if record_routing:
                chunk = self._chunk_index(model)
                recorded[chunk].append(self.routing.collect(chunk, *mb["input_ids"].shape))

            def collect(output):
                return torch.zeros((), device=output.device), post_fn(output, mb)

            return out, collect

        if record_routing or replay:
            self.routing.set_action("record" if record_routing else "replay")
        try:
            results = self._run_schedule(micro_batches, step, forward_only=True)
        finally:
            if record_routing or replay:
                self.routing.set_action(None)
        if replay:
            hits, total = all_reduce(self.routing.agreement(), self.groups["pool"]).tolist()
            self.last_router_agreement = hits / max(total, 1.0)
        results = self._broadcast_from_last_stage(results, len(micro_batches))
        results = [{k: v.cpu() for k, v in r.items()} for r in results]
        if record_routing:
            for i, r in enumerate(results):
                r["routed_experts"] = torch.cat([per_chunk[i] for per_chunk in recorded], dim=2)
        return results

    def _set_replay_targets(self, model, mb: MicroBatch) -> None:
        """This micro-batch's routing to replay (``routed_experts``, this rank's layers), for this chunk's routers."""
        s = mb["input_ids"].shape[1]
        valid = mb.get("routing_valid", torch.ones(mb["input_ids"].shape, dtype=torch.bool))
        self.routing.set_targets(self._chunk_index(model), mb["routed_experts"], valid[:, :s].cpu())

    def _chunk_index(self, model) -> int:
        return next(i for i, c in enumerate(self.chunks) if c is model)

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the given micro-batches (gradient accumulation across them)."""
        if not self.trainable:
            raise RuntimeError("engine: train_step on a frozen engine (no optimizer configured)")
        for c in self.chunks:
            c.train()
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.is_moe:
            moe.clear_aux_losses()

        replay = self.routing is not None and "routed_experts" in micro_batches[0]

        def step(data_iterator, model):
            mb = next(data_iterator)
            if replay:
                self._set_replay_targets(model, mb)
            out = self._model_forward(model, mb)
            return out, partial(self._loss_wrapper, loss_fn, mb)

        if replay:
            self.routing.set_action("replay")
        try:
            outputs = self._run_schedule(micro_batches, step, forward_only=False)
        finally:
            if replay:
                self.routing.set_action(None)
        if self._grads_finite():
            update_ok, grad_norm, _ = self.optimizer.step()
        else:  # bf16/fp32 optimizers have no loss scaler to catch this: skip the update on every rank
            update_ok, grad_norm = False, float("nan")
        if update_ok:
            self.scheduler.step(increment=1)
            self.version += 1
        metrics = self._reduce_metrics(outputs)
        if self.is_moe:
            metrics.update(moe.aux_loss_metrics(self.groups, moe.moe_layer_count(self.config), len(micro_batches)))
        if replay:
            hits, total = all_reduce(self.routing.agreement(), self.groups["pool"]).tolist()
            metrics["router_agreement"] = hits / max(total, 1.0)
        metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
        metrics["update_skipped"] = float(not update_ok)
        metrics["lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def _grads_finite(self) -> bool:
        """True when every gradient (after the DP reduction) is finite on every rank of the pool."""
        local = all(bool(torch.isfinite(buf.grad_data).all()) for c in self.chunks
                    for buf in c.buffers + c.expert_parallel_buffers)
        return float(all_reduce(0.0 if local else 1.0, self.groups["pool"], "max")) == 0.0

    @staticmethod
    def _loss_wrapper(loss_fn: LossFn, mb: MicroBatch, output: torch.Tensor):
        loss, metrics = loss_fn(output, mb)
        return loss, {k: (v.detach().float() if torch.is_tensor(v) else torch.tensor(float(v)))
                      for k, v in metrics.items()}

    def _reduce_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Mean of per-micro-batch metrics, from the last stage, averaged over DP, known on every rank."""
        keys = sorted(outputs[0].keys()) if outputs else []
        n = len(outputs)
        vec = torch.tensor([sum(float(o[k]) for o in outputs) / max(n, 1) for k in keys], dtype=torch.float64)
        keys = self._bcast_obj(keys)
        if vec.numel() != len(keys):
            vec = torch.zeros(len(keys), dtype=torch.float64)
        vec = self._bcast_tensor(vec.to(_device()))
        return {k: float(v) for k, v in zip(keys, self.dp_all_reduce(vec, "mean").tolist())}

    def _bcast_obj(self, obj):
        if self._pp == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.groups.global_rank("pp", -1), group=self.groups["pp"])
        return box[0]

    def _bcast_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self._pp > 1:
            dist.broadcast(t, src=self.groups.global_rank("pp", -1), group=self.groups["pp"])
        return t

    def _broadcast_from_last_stage(self, results: list, n: int) -> list[dict[str, torch.Tensor]]:
        if self._pp == 1:
            return results
        meta = self._bcast_obj([{k: (tuple(v.shape), v.dtype) for k, v in r.items()} for r in results])
        out = []
        last = self.groups.last_stage
        for i, spec in enumerate(meta):
            item = {}
            for k, (shape, dtype) in spec.items():
                t = results[i][k].to(_device()).contiguous() if last else torch.empty(shape, dtype=dtype,
                                                                                       device=_device())
                item[k] = self._bcast_tensor(t)
            out.append(item)
        return out

    # ------------------------------------------------------------------ memory
    def offload(self, *, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move this role's state to host memory while another stage (rollout) needs the accelerator."""
        if self._offloaded or not torch.cuda.is_available():
            return
        if self.trainable:
            for c in self.chunks:
                for buf in c.buffers + c.expert_parallel_buffers:
                    buf.offload_to_cpu(move_params=params, move_grads=grads)
            if optimizer:
                _move_optimizer_state(self.optimizer, "cpu")
        elif params:
            for c in self.chunks:
                c.to("cpu")
        self._offloaded = True
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if not self._offloaded:
            return
        if self.trainable:
            for c in self.chunks:
                for buf in c.buffers + c.expert_parallel_buffers:
                    buf.reload_from_cpu()
            _move_optimizer_state(self.optimizer, "cuda")
        else:
            for c in self.chunks:
                c.to("cuda")
        self._offloaded = False

    def named_parameters(self) -> Iterable[tuple[str, torch.Tensor]]:
        for m in self.modules:
            yield from m.named_parameters()



class _GatherSequence(torch.autograd.Function):
    """All-gather CP chunks [b, s/cp, …] into sequence order; backward: this rank's chunks of the gradient."""

    @staticmethod
    def forward(ctx, local, group, order, rank):
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        out = torch.empty((local.shape[0], order.numel(), *local.shape[2:]), dtype=local.dtype, device=local.device)
        out[:, order] = torch.cat(parts, dim=1)
        ctx.order, ctx.rank, ctx.width = order, rank, local.shape[1]
        return out

    @staticmethod
    def backward(ctx, grad):
        mine = ctx.order[ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width]
        return grad[:, mine], None, None, None


def _finalize_model_grads(*args, groups: RankGroups, **kwargs):
    """Megatron's ``finalize_model_grads`` on this pool's groups (with DeepSeek's router, it also updates every
    router's correction bias from the step's token counts, summed over tensor·data·context parallelism)."""
    with mcore_tp_dp_cp_group(groups):
        kwargs.setdefault("pg_collection", groups.pg_collection)
        return finalize_model_grads(*args, **kwargs)


def _move_optimizer_state(optimizer, device: str) -> None:
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is None:
            continue
        for state in inner.state.values():
            for k, v in state.items():
                if torch.is_tensor(v):
                    state[k] = v.to(device, non_blocking=True)
        for group in inner.param_groups:
            for p in group["params"]:
                if p.device.type != device and device == "cpu":
                    p.data = p.data.to(device, non_blocking=True)
                elif device == "cuda" and p.device.type == "cpu":
                    p.data = p.data.to(device, non_blocking=True)
