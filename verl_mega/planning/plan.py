"""Layout planner: enumerate feasible training layouts (tp, pp, vpp, dp; for Mixture-of-Experts models ep and etp)
and generation tg for a cluster, predict per-GPU memory of every phase (:mod:`verl_mega.planning.memory`) and the
time of one RL step (:mod:`verl_mega.planning.timing`), and rank them.

It plans one pool of every GPU, the placement ``parallel.layout=auto`` runs: the training roles (actor, critic,
reference) share one training layout there, the critic differing by its value head, the reference by being frozen,
and the rollout generates on the same GPUs at tg (colocated). A rollout pool of its own is not planned here;
``tools/plan.py --dry-run`` checks the groups of such a placement.

**Feasibility** (a layout breaking one is listed as rejected, with the reason):
tp divides the GPUs of a node (TP groups never cross nodes) and the model's heads, key/value heads and FFN width;
pp divides the layers and tp·pp divides the GPU count; vpp needs pp > 1, pp·vpp dividing the layers and a number of
micro-batches M divisible by pp (Megatron's interleaved schedule); tg divides tp (the 3D-HybridEngine carves each
generation TP group out of a training TP group, ``Pool`` enforces it: tp=1 training generates at tg=1); the global
batch splits into dp × micro-batch × M; with sequence parallelism tp divides the sequence length.

**Generation TP and EP** are chosen per training layout: of the tg dividing tp and, for MoE models, the gen_ep
(1: every expert sliced over tg; else tg·D with D dividing the data-parallel TP groups of a stage and gen_ep the
expert count: vLLM's expert parallelism over D attention engines), the pair with the smallest cost key below (so
each training layout is listed once, with its best generation layout).

**Cost model** (lexicographic, smaller first):

1. fits: every phase ≤ GPU memory − reserve and the KV cache holds at least one full sequence (plans that do not
   fit follow, least over budget first);
2. TP groups (training and generation) that leave an NVLink island (from ``--topo``; 0 without a topology, since
   TP groups never span nodes);
3. predicted seconds per RL step (rollout + reshard + score + train, :func:`~verl_mega.planning.timing.predict_time`),
   compared at 2 % granularity (a difference the model cannot resolve falls through to the tie-breakers);
4. 3D-HybridEngine bytes received per GPU at the train→generate switch;
5. MoE: the token dispatcher's all-to-all bytes per GPU and step (0 for dense models), at 0.1 GiB granularity;
6. smaller model-parallel size tp·pp (less TP/PP communication per layer), then fewer virtual stages (fewer
   pipeline messages), then more memory headroom.

MoE layouts enumerate ep among the divisors of the expert count that divide tp·dp, with etp ∈ {1, tp}; ep·etp must
divide tp·dp, etp and tg the experts' width, and tp > 1 needs sequence parallelism.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from itertools import product

from verl_mega.models.hf_config import ModelArch
from verl_mega.parallel.topology import NodeTopology
from verl_mega.planning.memory import (
    GiB,
    MemoryPrediction,
    RoleSpec,
    RolloutSpec,
    Workload,
    default_roles,
    gib,
    predict_memory,
    training_pool,
)
from verl_mega.planning.dp_sync import pool_dp_sync
from verl_mega.planning.params import PlanningError, stage_params
from verl_mega.parallel.placement import Placement, PlacementError, Pool, divisors
from verl_mega.planning.timing import H200, Hardware, StepShape, TimePrediction, predict_time, time_bucket

PHASES = ("train", "rollout", "reshard", "score")


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """GPUs available to the job: identical nodes of `gpus_per_node` GPUs with `gpu_mem_gib` each."""

    gpus: int
    gpus_per_node: int
    gpu_mem_gib: float
    reserve_gib: float = 2.0  # CUDA context, NCCL buffers, allocator fragmentation
    topology: NodeTopology | None = None
    hardware: Hardware = H200  # constants of the step-time model

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise PlanningError(f"--gpus={self.gpus} and --gpus-per-node={self.gpus_per_node} must be >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise PlanningError(f"--gpus={self.gpus} is not a whole number of {self.gpus_per_node}-GPU nodes; "
                                f"use a multiple of --gpus-per-node")
        if self.gpu_mem_gib <= 0 or self.reserve_gib < 0 or self.reserve_gib >= self.gpu_mem_gib:
            raise PlanningError(f"--gpu-mem-gb={self.gpu_mem_gib} must be > 0 and above --reserve-gb="
                                f"{self.reserve_gib}")
        if self.topology is not None and self.topology.num_gpus != self.gpus_per_node:
            raise PlanningError(f"--topo describes {self.topology.num_gpus} GPUs per node but --gpus-per-node="
                                f"{self.gpus_per_node}; make them agree")

    @property
    def node_gpus(self) -> int:
        """GPUs per node actually used (a job smaller than one node uses part of it)."""
        return min(self.gpus, self.gpus_per_node)

    @property
    def island_gpus(self) -> int:
        """GPUs of one NVLink island: the smallest island of ``topology``, else the whole node (NVSwitch)."""
        if self.topology is None:
            return self.node_gpus
        return min(self.node_gpus, min(len(i) for i in self.topology.nvlink_islands))

    def dp_island_ranks(self, level: str) -> int | None:
        """Ranks per data-parallel island for ``parallel.dp_hierarchy=level`` (the run's own rule)."""
        from verl_mega.parallel.scheduler import dp_island_ranks

        try:
            return dp_island_ranks(level, self.node_gpus, self.topology)
        except PlacementError as exc:
            raise PlanningError(f"{exc} (tools/plan.py: --dp-hierarchy, --topo)") from None

    @property
    def budget_bytes(self) -> float:
        return (self.gpu_mem_gib - self.reserve_gib) * GiB


@dataclass(frozen=True, kw_only=True)
class Pins:
    """Values fixed on the command line; None enumerates. vpp=1 means no interleaving."""

    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    gen_tp: int | None = None
    recompute: str | None = None
    ep: int | None = None
    etp: int | None = None
    gen_ep: int | None = None


@dataclass(frozen=True)
class Rejected:
    tp: int
    pp: int
    vpp: int | None
    gen_tp: int | None
    reason: str

    def to_json(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "vpp": self.vpp, "gen_tp": self.gen_tp, "reason": self.reason}


@dataclass(frozen=True)
class Plan:
    layout: Pool
    recompute: str
    num_microbatches: int
    memory: MemoryPrediction
    over_budget: tuple[str, ...]  # why it does not fit (empty when it fits)
    bubble: float
    time_factor: float
    tp_off_island: int
    gen_off_island: int
    headroom_bytes: float
    time: TimePrediction
    dp_sync: dict  # the actor's data-parallel sync per optimizer step: bytes per GPU, inside and between islands
    time_bucket: int = 0  # 2 % steps above the fastest plan of its (fits, GiB over, off-island) group: see _ranked

    @property
    def fits(self) -> bool:
        return not self.over_budget

    @property
    def _group(self) -> tuple:
        over = max(0.0, -self.headroom_bytes)
        return 0 if self.fits else 1, round(gib(over), 2), self.tp_off_island + self.gen_off_island

    @property
    def cost(self) -> tuple:
        # Time at 2 % granularity: what the model cannot resolve falls through to reshard bytes and smaller tp·pp.
        return (*self._group, self.time_bucket, round(self.memory.reshard_bytes_per_gpu / 2**20),
                round(gib(self.memory.moe_alltoall_bytes), 1),
                self.layout.tp * self.layout.pp, self.layout.vpp or 1, -round(gib(self.headroom_bytes), 2))

    def to_json(self, rank: int) -> dict:
        lay, mem = self.layout, self.memory
        totals = mem.totals_gib()
        return {
            "rank": rank, "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "ep": lay.ep, "etp": lay.etp,
            "gen_tp": lay.gen_tp, "gen_ep": lay.gen_ep,
            "sequence_parallel": lay.sequence_parallel, "recompute": self.recompute,
            "num_microbatches": self.num_microbatches, "fits": self.fits, "over_budget": list(self.over_budget),
            "memory_gb": {name: totals[name] for name in PHASES},
            "memory_breakdown_gb": {name: mem.phases[name].breakdown_gib() for name in PHASES},
            "worst_stage": dict(mem.worst_stage),
            "headroom_gb": round(gib(self.headroom_bytes), 3),
            "kv_cache_gb": round(gib(mem.kv_cache_bytes), 3),
            "kv_cache_tokens": int(max(mem.kv_cache_bytes, 0) // mem.kv_bytes_per_token),
            "reshard_bytes_per_gpu": int(round(mem.reshard_bytes_per_gpu)),
            "reshard_extra_peak_bytes": int(round(mem.reshard_extra_peak_bytes)),
            "host_offload_gb": round(gib(mem.host_offload_bytes), 3),
            "moe_comm_gb_per_step": {t.name: round(gib(t.bytes), 3) for t in mem.comm},
            "pipeline_bubble": round(self.bubble, 4), "time_factor": round(self.time_factor, 4),
            "tp_groups_off_nvlink": self.tp_off_island, "gen_tp_groups_off_nvlink": self.gen_off_island,
            "dp_islands": lay.dp_islands, "dp_cross_island_dtype": lay.dp_cross_island_dtype, "dp_sync": self.dp_sync,
            "step_time_s": round(self.time.total, 4),
            "time_s": {name: round(sec, 4) for name, sec in self.time.phases.items()},
            "cost": list(self.cost),
        }

    def headline(self) -> str:
        totals = self.memory.totals_gib()
        mem = " ".join(f"{p}={totals[p]:.1f}" for p in PHASES)
        fit = "fits" if self.fits else "DOES NOT FIT (" + "; ".join(self.over_budget) + ")"
        return (f"{self.layout.dims()} recompute={self.recompute} M={self.num_microbatches}: {fit}; "
                f"{self.time.summary()}; GiB/GPU {mem}; bubble {self.bubble:.3f}; reshard "
                f"{self.memory.reshard_bytes_per_gpu / GiB:.2f} GiB/GPU")

    def explain(self, cluster: Cluster) -> list[str]:
        lay = self.layout
        v = lay.vpp or 1
        lines = [self.headline(),
                 f"  budget per GPU: {cluster.gpu_mem_gib} GiB − reserve {cluster.reserve_gib} GiB = "
                 f"{cluster.budget_bytes / GiB:.2f} GiB; headroom {gib(self.headroom_bytes):.2f} GiB",
                 f"  bubble = (p − 1)/(v·M) = ({lay.pp} − 1)/({v}·{self.num_microbatches}) = {self.bubble:.4f}; "
                 f"time factor = (1 + bubble) × {4 / 3 if self.recompute == 'full' else 1:.3f} (recompute) = "
                 f"{self.time_factor:.4f}",
                 f"  TP groups off NVLink islands per node: training {self.tp_off_island}, generation "
                 f"{self.gen_off_island}",
                 f"  data-parallel sync per optimizer step (actor): {self.dp_sync['bytes_per_gpu'] / GiB:.2f} GiB per "
                 f"GPU, {self.dp_sync['cross_island_bytes_per_gpu'] / GiB:.2f} GiB of it between islands of "
                 f"{self.dp_sync['island_gpus']} GPUs",
                 f"  cost key (fits, GiB over, off-island, step-time bucket (2 %), reshard MiB, all-to-all GiB, "
                 f"tp·pp, vpp, −headroom) = {self.cost}"]
        lines += ["  " + line for line in self.time.explain()]
        lines += ["  " + line for line in self.memory.explain()]
        return lines


def _island_report(topology: NodeTopology | None, tp: int, gen_tp: int, cache: dict) -> tuple[int, int]:
    """(training TP groups, generation TP groups) per node that leave an NVLink island."""
    if topology is None:
        return 0, 0
    key = (tp, gen_tp)
    if key not in cache:
        from verl_mega.parallel.scheduler import TopologyAwareScheduler

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the counts below carry the information
            node = Placement.single(topology.num_gpus, tp=tp, gen_tp=gen_tp)
            placement = TopologyAwareScheduler([topology]).plan(node)
        cache[key] = tuple(sum(not r.in_nvlink_island for r in placement.reports[kind]) for kind in ("tp", "gen_tp"))
    return cache[key]


def _structural_reason(arch: ModelArch, cluster: Cluster, tp: int, pp: int, vpp: int | None, gen_tp: int,
                       work: Workload, global_batch: int, sequence_parallel: bool, ep: int = 1, etp: int = 1,
                       gen_ep: int = 1) -> str | None:
    node = cluster.node_gpus
    if node % tp:
        return f"tp={tp} does not divide the {node} GPUs of a node (TP groups would cross nodes)"
    widths = [("heads", arch.num_heads), ("kv heads", arch.num_kv_heads)]
    widths += [("shared expert ffn", arch.shared_expert_ffn_hidden_size)] if arch.is_moe else \
        [("ffn", arch.ffn_hidden_size)]
    for name, value in widths:
        if value % tp:
            return f"tp={tp} does not divide {name}={value}"
    if arch.is_moe:
        stage = cluster.gpus // pp
        if arch.num_experts % ep or stage % (ep * etp) or arch.moe_ffn_hidden_size % etp:
            return (f"ep={ep}, etp={etp}: ep must divide the {arch.num_experts} experts, ep·etp the {stage} GPUs of "
                    f"a stage and etp the expert width {arch.moe_ffn_hidden_size}")
        if gen_ep == 1 and arch.moe_ffn_hidden_size % gen_tp:
            return f"gen_tp={gen_tp} does not divide the expert width {arch.moe_ffn_hidden_size}"
        if gen_ep > 1 and (gen_ep % gen_tp or arch.num_experts % gen_ep or (cluster.gpus // (tp * pp)) %
                           (gen_ep // gen_tp)):
            return (f"gen_ep={gen_ep}: must be gen_tp·D with D dividing dp={cluster.gpus // (tp * pp)}, and divide "
                    f"the {arch.num_experts} experts")
        if tp > 1 and not sequence_parallel:
            return f"tp={tp} with experts needs sequence parallelism"
    if arch.num_layers % pp:
        return f"pp={pp} does not divide layers={arch.num_layers}"
    if cluster.gpus % (tp * pp):
        return f"tp·pp={tp * pp} does not divide {cluster.gpus} GPUs"
    if tp % gen_tp:
        return f"gen_tp={gen_tp} does not divide tp={tp}"
    dp = cluster.gpus // (tp * pp)
    if global_batch % (dp * work.micro_batch):
        return f"global batch {global_batch} does not split into dp={dp} × micro-batch {work.micro_batch}"
    m = global_batch // (dp * work.micro_batch)
    if vpp is not None:
        if pp == 1:
            return "vpp needs pp > 1"
        if arch.num_layers % (pp * vpp):
            return f"pp·vpp={pp * vpp} does not divide layers={arch.num_layers}"
        if m % pp:
            return f"interleaving needs the {m} micro-batches per step to be a multiple of pp={pp}"
    if sequence_parallel and tp > 1 and work.seq_len % tp:
        return f"sequence parallelism needs tp={tp} to divide seq_len={work.seq_len}"
    return None


def plan_layouts(arch: ModelArch, cluster: Cluster, work: Workload, *, global_batch: int,
                 roles: tuple[RoleSpec, ...] | None = None, rollout: RolloutSpec | None = None,
                 pins: Pins | None = None, sequence_parallel: bool = True, step: StepShape | None = None,
                 dp_hierarchy: str = "off", cross_island_dtype: str = "fp32") -> tuple[list[Plan], list[Rejected]]:
    """Every training layout allowed by `pins`, each with its best generation tg, ranked by the cost model (best
    first), and the rejected ones with reasons. `step` is what one RL step processes (default: `global_batch`
    samples of the workload's length, half prompt and half response). `dp_hierarchy` (node | island) cuts every
    layout's data-parallel groups at islands as a run would (``parallel.dp_hierarchy``); a layout where that is
    impossible is rejected with the run's reason."""
    pins = pins or Pins()
    island_ranks = cluster.dp_island_ranks(dp_hierarchy)
    roles = roles or default_roles()
    rollout = rollout or RolloutSpec()
    if global_batch < 1:
        raise PlanningError(f"--global-batch={global_batch} must be >= 1")
    step = step or StepShape.for_workload(work, global_batch)
    node = cluster.node_gpus
    tps = [pins.tp] if pins.tp else divisors(node)
    if pins.tp and pins.tp > node:
        raise PlanningError(f"--tp={pins.tp} exceeds the {node} GPUs of a node; TP groups must stay inside a node")
    pps = [pins.pp] if pins.pp else divisors(arch.num_layers)
    recomputes = [pins.recompute] if pins.recompute else ["none", "full"]
    plans: list[Plan] = []
    rejected: list[Rejected] = []
    island_cache: dict = {}
    for tp, pp in product(tps, pps):
        if pins.pp is None and cluster.gpus % (tp * pp):
            continue  # not a layout of this cluster at all; not worth listing
        if pins.vpp is not None:
            vpps: list[int | None] = [None if pins.vpp == 1 else pins.vpp]
        else:
            vpps = [None] + ([v for v in divisors(arch.num_layers // pp) if v > 1] if pp > 1 and
                             arch.num_layers % pp == 0 else [])
        gen_tps = [pins.gen_tp] if pins.gen_tp else divisors(tp)
        for vpp, (ep, etp) in product(vpps, _expert_layouts(arch, cluster, tp, pp, pins)):
            allowed = []
            for gen_tp, gen_ep in ((g, e) for g in gen_tps for e in _generation_eps(arch, cluster, tp, pp, g, pins)):
                reason = _structural_reason(arch, cluster, tp, pp, vpp, gen_tp, work, global_batch,
                                            sequence_parallel, ep, etp, gen_ep)
                if reason:
                    rejected.append(Rejected(tp, pp, vpp, gen_tp, reason))
                else:
                    allowed.append((gen_tp, gen_ep))
            if not allowed:
                continue
            dp = cluster.gpus // (tp * pp)
            m = global_batch // (dp * work.micro_batch)
            for rec in recomputes:
                w = Workload(**{**work.__dict__, "recompute": rec, "num_microbatches": m})
                candidates = []
                for gen_tp, gen_ep in allowed:  # the generation layout chosen apart from training: the best one
                    layout = training_pool(tp=tp, pp=pp, dp=dp, gen_tp=gen_tp, vpp=vpp, ep=ep, etp=etp,
                                           gen_ep=gen_ep, sequence_parallel=sequence_parallel and tp > 1)
                    try:
                        layout = Placement(layout.size, (layout,)).with_dp_hierarchy(
                            dp_hierarchy, island_ranks, cross_island_dtype).pools[0]
                    except PlacementError as exc:
                        rejected.append(Rejected(tp, pp, vpp, gen_tp, str(exc)))
                        continue
                    tp_off, gen_off = _island_report(cluster.topology, tp, gen_tp, island_cache)
                    candidates.append(_evaluate(arch, cluster, layout, w, roles, rollout, tp_off, gen_off, step))
                if candidates:
                    plans.append(_ranked(candidates)[0])
    return _ranked(plans), rejected


def _ranked(plans: list[Plan]) -> list[Plan]:
    """`plans` sorted by cost, each time bucket counted from the fastest plan of its group: plans within 2 % of it
    tie on time (bucket 0) and the next criteria decide, then the next 2 %, and so on."""
    best: dict[tuple, float] = {}
    for plan in plans:
        best[plan._group] = min(best.get(plan._group, plan.time.total), plan.time.total)
    ranked = [replace(p, time_bucket=time_bucket(p.time.total / best[p._group])) for p in plans]
    return sorted(ranked, key=lambda p: p.cost)


def _expert_layouts(arch: ModelArch, cluster: Cluster, tp: int, pp: int, pins: Pins) -> list[tuple[int, int]]:
    """(ep, etp) pairs to try: (1, tp) for a dense model; for MoE the pinned values, else ep among the divisors of
    the expert count that divide the GPUs of a stage, etp ∈ {1, tp}."""
    if not arch.is_moe:
        return [(1, tp)]
    stage = cluster.gpus // pp if cluster.gpus % pp == 0 else 1
    eps = [pins.ep] if pins.ep else [e for e in divisors(arch.num_experts) if stage % e == 0]
    etps = [pins.etp] if pins.etp else sorted({1, tp})
    return [(e, t) for e in eps for t in etps]


def _generation_eps(arch: ModelArch, cluster: Cluster, tp: int, pp: int, gen_tp: int, pins: Pins) -> list[int]:
    """gen_ep values to try: 1 for a dense model; for MoE the pinned value, else 1 and every gen_tp·D with D
    dividing dp (the training TP groups of a stage an expert-parallel generation group can join) and gen_tp·D
    dividing the expert count."""
    if not arch.is_moe:
        return [1]
    if pins.gen_ep:
        return [pins.gen_ep]
    dp = cluster.gpus // (tp * pp) if cluster.gpus % (tp * pp) == 0 else 1
    return [1] + [gen_tp * d for d in divisors(dp) if arch.num_experts % (gen_tp * d) == 0 and gen_tp * d > 1]


def _evaluate(arch: ModelArch, cluster: Cluster, layout: Pool, work: Workload, roles: tuple[RoleSpec, ...],
              rollout: RolloutSpec, tp_off: int, gen_off: int, step: StepShape) -> Plan:
    mem = predict_memory(arch, layout, work, roles=roles, rollout=rollout, gpu_mem_bytes=cluster.gpu_mem_gib * GiB)
    budget = cluster.budget_bytes
    over = [f"{name} {gib(ph.total):.1f} > {gib(budget):.1f} GiB" for name, ph in mem.phases.items()
            if ph.total > budget]
    if mem.kv_cache_bytes < mem.kv_bytes_per_token * work.seq_len:
        over.append(f"KV cache {gib(mem.kv_cache_bytes):.2f} GiB < one {work.seq_len}-token sequence")
    m, v = work.num_microbatches or 1, layout.vpp or 1
    bubble = (layout.pp - 1) / (v * m)
    time_factor = (1 + bubble) * (4 / 3 if work.recompute == "full" else 1.0)
    timing = predict_time(arch, layout, work, step, mem, roles=roles, rollout=rollout, hardware=cluster.hardware,
                          node_gpus=cluster.node_gpus, island_gpus=cluster.island_gpus)
    return Plan(layout=layout, recompute=work.recompute, num_microbatches=m, memory=mem, over_budget=tuple(over),
                bubble=bubble, time_factor=time_factor, tp_off_island=tp_off, gen_off_island=gen_off,
                headroom_bytes=budget - mem.peak, time=timing, dp_sync=_dp_sync_report(arch, cluster, layout, work))


def _dp_sync_report(arch: ModelArch, cluster: Cluster, layout: Pool, work: Workload) -> dict:
    """The actor's data-parallel sync per optimizer step on its largest pipeline stage (bytes per GPU)."""
    sp = max((stage_params(arch, layout, st) for st in {0, layout.pp - 1}), key=lambda x: x.total)
    syncs = pool_dp_sync(layout, dense=sp.total - sp.experts, experts=sp.experts,
                         param_bytes=4 if work.dtype == "fp32" else 2, island_gpus=cluster.island_gpus)
    return {"island_gpus": cluster.island_gpus, "islands_per_dp_group": layout.dp_islands,
            "cross_island_dtype": layout.dp_cross_island_dtype,
            "bytes_per_gpu": round(sum(x.sent_bytes for x in syncs)),
            "cross_island_bytes_per_gpu": round(sum(x.cross_bytes for x in syncs))}


@dataclass(frozen=True)
class ConfigInputs:
    """What a TrainConfig fixes for the planner (the cluster comes from the caller)."""

    pins: Pins
    workload: Workload
    roles: tuple[RoleSpec, ...]
    rollout: RolloutSpec
    global_batch: int
    sequence_parallel: bool
    step: StepShape
    dp_hierarchy: str = "off"
    cross_island_dtype: str = "fp32"


def resident_rollout_memory(cfg, placement: Placement, arch: ModelArch, gpu_mem_bytes: float) -> tuple[float, float]:
    """``rollout.free_cache_engine=auto``: the memory model's per-GPU peak of the training roles on the actor's pool
    (training and scoring, vLLM's terms left out) and what vLLM takes resident beside them at the config's settings
    (its weights, activation reserve and KV cache). The trainer sets both against the memory free on the device."""
    given = inputs_from_config(cfg, placement)
    resident = replace(given.rollout, free_cache_engine=False)
    pred = predict_memory(arch, placement.pool_of("actor"), given.workload, roles=given.roles, rollout=resident,
                          gpu_mem_bytes=gpu_mem_bytes)

    def vllm(phase) -> float:
        return sum(t.bytes for t in phase.terms if t.name.startswith("vLLM"))

    training = max(pred.phases[name].total - vllm(pred.phases[name]) for name in ("train", "score"))
    return training, vllm(pred.phases["rollout"])


def inputs_from_config(cfg, placement: Placement | None) -> ConfigInputs:
    """Planner inputs of a validated :class:`~verl_mega.config.TrainConfig`: the actor pool's layout is pinned (with
    ``placement=None``, as for ``parallel.layout=auto``, only the recompute mode is, and sequence parallelism is on
    wherever tp > 1), the micro-batch is the actor's, a sample is max_prompt_length + max_response_length tokens, an
    optimizer step takes ppo_mini_batch_size · rollout.n samples, an RL step data.train_batch_size · rollout.n
    samples over actor.ppo_epochs, and the roles carry their own offload flags."""
    actor, critic, ref, rollout, p = cfg.actor, cfg.critic, cfg.ref, cfg.rollout, cfg.parallel
    dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[cfg.model.dtype]
    work = Workload(micro_batch=actor.micro_batch_size_per_gpu, dtype=dtype, recompute=cfg.model.recompute,
                    seq_len=cfg.data.max_prompt_length + rollout.max_response_length,
                    entropy=actor.entropy_coeff > 0)
    from verl_mega.models.lora import spec_from_config

    lora = spec_from_config(cfg.model.lora, cfg.trainer.seed)
    roles = [RoleSpec(name="actor", offload_params=actor.offload_params, offload_grads=actor.offload_grads,
                      offload_optimizer=actor.offload_optimizer, lora=lora)]
    if critic.enable:
        roles.append(RoleSpec(name="critic", value_head=True, offload_params=critic.offload_params,
                              offload_grads=critic.offload_grads, offload_optimizer=critic.offload_optimizer))
    if ref.enable:  # LoRA: the reference is the actor's base (adapters off), no second model
        roles.append(RoleSpec(name="ref", trainable=False, offload_params=ref.offload_params and lora is None,
                              lora=lora))
    defaults = RolloutSpec()
    spec = RolloutSpec(gpu_memory_utilization=rollout.gpu_memory_utilization,
                       kv_cache_bytes=rollout.kv_cache_memory_bytes,
                       free_cache_engine=rollout.free_cache_engine is not False,  # auto: plan as asleep
                       max_num_seqs=rollout.max_num_seqs or defaults.max_num_seqs,
                       max_num_batched_tokens=rollout.max_num_batched_tokens or defaults.max_num_batched_tokens)
    step = StepShape(samples=cfg.data.train_batch_size * rollout.n, prompt_len=cfg.data.max_prompt_length,
                     response_len=rollout.max_response_length, n=rollout.n, ppo_epochs=actor.ppo_epochs)
    islands = dict(dp_hierarchy=p.dp_hierarchy, cross_island_dtype=p.dp_cross_island_dtype)
    if placement is None:
        return ConfigInputs(pins=Pins(recompute=cfg.model.recompute), workload=work, roles=tuple(roles), rollout=spec,
                            global_batch=actor.ppo_mini_batch_size * rollout.n, sequence_parallel=True, step=step,
                            **islands)
    pool = placement.pool_of("actor")
    pins = Pins(tp=pool.tp, pp=pool.pp, vpp=pool.vpp or 1, gen_tp=pool.gen_tp, recompute=cfg.model.recompute,
                ep=pool.ep, etp=pool.etp, gen_ep=pool.gen_ep)
    return ConfigInputs(pins=pins, workload=work, roles=tuple(roles), rollout=spec,
                        global_batch=actor.ppo_mini_batch_size * rollout.n, sequence_parallel=p.sequence_parallel,
                        step=step, **islands)
