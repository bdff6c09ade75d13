"""Step-time model of one RL step: predicted seconds per phase for a training layout and a generation TP size.

Pure arithmetic over a :class:`~verl_mega.models.hf_config.ModelArch`, a training
:class:`~verl_mega.parallel.placement.Pool` (with its ``gen_tp``), the planner's
:class:`~verl_mega.planning.memory.Workload`, the step's shape (:class:`StepShape`) and a few hardware constants
(:class:`Hardware`). Every addend is a :class:`TimeTerm` with the formula that produced it, so
``tools/plan.py --explain`` prints the arithmetic. The model is derived in docs/planning.md ("The time model").

Phases (the memory model's names):

* **rollout** — vLLM generation. Decoding is memory-bandwidth bound: every decode step reads the GPU's share of the
  weights (M/tg) and the KV cache of the sequences in flight, unless its FLOPs take longer (a roofline: the larger
  of the two), plus a fixed per-step cost (scheduler, sampling, launches) and, for tg > 1, two all-reduces per layer.
  Each of the world/tg engines decodes its share of the samples, as many at once as ``max_num_seqs`` and its KV
  cache allow (waves of that size), for ``response_len`` steps; prefill is compute-bound.
* **reshard** — the 3D-HybridEngine's train → generate switch (bytes received per GPU over the in-place path's
  measured rate, plus rewriting the GPU's own generation weights in HBM), and offloaded state moved to the host and
  back over PCIe.
* **score** — forward passes: old log-probs (always), reference log-probs, critic values.
* **train** — actor (and critic) updates: forward + backward, the data-parallel gradient reduce-scatter and
  parameter all-gather of the distributed optimizer (flat, or inside islands with the shards all-reduced across
  them: :mod:`verl_mega.planning.dp_sync`), and the Adam step itself.

Training compute is model FLOPs over the GPUs at an achieved fraction of the bf16 matmul peak that falls as a GPU's
GEMMs narrow (:meth:`Hardware.efficiency`), times (1 + pipeline bubble); tensor-parallel collectives, pipeline
sends and data-parallel reductions are added serially (our layer spec does not overlap them with compute).
"""

from __future__ import annotations

import math
from dataclasses import replace, dataclass

from verl_mega.models.flops import GPU_PEAKS, attention_flops, attention_weights, matmul_weights
from verl_mega.models.hf_config import ModelArch
from verl_mega.parallel.placement import Pool
from verl_mega.planning.dp_sync import pool_dp_sync
from verl_mega.planning.generation import kv_cache_bytes_per_token
from verl_mega.planning.memory import MemoryPrediction, RoleSpec, RolloutSpec, Workload
from verl_mega.planning.params import PlanningError, generation_params, stage_params

GB = 1e9
PHASES = ("rollout", "reshard", "score", "train")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Per-GPU and link constants of the step-time model; the defaults describe an H200 (SXM, NVLink 4, one 400 Gb/s
    NIC per GPU). "Measured" figures are BENCHMARKS.md's, on the lent 2×H200 machine (NV18 between the GPUs)."""

    name: str = "H200"
    # an 8192³ bf16 matmul as measured on this GPU (models/flops.py GPU_PEAKS; the datasheet's dense bf16 peak is
    # 989); achieved fractions below are of this measured peak
    peak_tflops: float = GPU_PEAKS["H200"].matmul_tflops
    # Achieved fraction η of that peak for a whole forward + backward pass of our layer spec (norms, attention, LM
    # head and fp32 cross-entropy included), as a function of G, the matmul FLOPs of one layer on one GPU for one
    # micro-batch: η(G) = eta_max · min(1, G/knee)^exponent. Smaller per-GPU shards (tp) or micro-batches mean
    # smaller G: the GEMMs fill fewer waves of the 132 SMs and the memory-bound element-wise work weighs more.
    # Fitted to four measurements (BENCHMARKS.md "Step-time model calibration": Qwen2.5-1.5B and -7B, tp=1 and tp=2,
    # 8 × 1024 tokens; TP collective time subtracted): η = 0.442, 0.310, 0.617, 0.603 at G = 767, 383, 3818, 1909
    # GFLOP, reproduced within 1.2 %.
    eta_max: float = 0.61
    knee_gflop: float = 1400.0
    exponent: float = 0.52
    # Routed experts (grouped GEMM with token permutation): the Qwen3-30B-A3B forward + backward runs in BENCHMARKS.md
    # ("Mixture-of-Experts on GPUs": 28.6 % and 25.7 % of peak overall, tp=1, ep=2, 2048 and 1024 tokens per local
    # expert) need 0.20 and 0.24 for the expert FLOPs once the dense part and the all-to-all are taken out; the one
    # constant 0.22 predicts both runs within 5 %. Measured at etp=1 only: narrower expert shards are not charged.
    expert_eta: float = 0.22
    # HBM: measured 4.26 TB/s for a 4 GiB device-to-device copy (bytes read + written); datasheet 4.8 TB/s.
    hbm_gbps: float = 4260.0
    # NVLink, as NCCL's all-gather / reduce-scatter achieve it between two H200s (NV18): t = α + bytes/β, measured
    # 74 µs for 12.6 MB and 146 µs for 29.4 MB received per GPU → β = 233 GB/s, α = 20 µs (datasheet: 450 GB/s each
    # way; NVLink multicast off).
    nvlink_gbps: float = 233.0
    collective_latency_s: float = 20e-6
    # Between nodes: one 400 Gb/s (50 GB/s) InfiniBand NIC per GPU, about 80 % of it for NCCL rings. Not measured.
    inter_node_gbps: float = 40.0
    # Host ↔ GPU for offloaded state: PCIe Gen5 ×16 is 64 GB/s each way; pinned copies reach about 50. Not measured.
    pcie_gbps: float = 50.0
    # vLLM's fixed cost per decode step (scheduling, sampling, CUDA-graph launch) beyond moving bytes: BENCHMARKS.md
    # GRPO config C (1.5B, tg=1, 64 sequences per engine, 1024 tokens) decoded at "avg 4.80 ms/step"; this model's
    # bandwidth term for it is 0.95 ms (3.09 GB of weights + 0.95 GB of KV cache at 4.26 TB/s), leaving 3.85 ms.
    decode_step_overhead_s: float = 3.85e-3
    # The in-place weight sync's rate for bytes a GPU must receive, conversion included (BENCHMARKS.md, 3D-HybridEngine
    # switch, t=2 → tg=1 on Llama-2-7B: 6.74 GB in 45 ms, "≈150 GB/s over NV18 including conversion").
    reshard_gbps: float = 150.0

    def __post_init__(self) -> None:
        for name in ("peak_tflops", "eta_max", "knee_gflop", "exponent", "expert_eta", "hbm_gbps", "nvlink_gbps",
                     "inter_node_gbps", "pcie_gbps", "reshard_gbps"):
            if getattr(self, name) <= 0:
                raise PlanningError(f"hardware: {name}={getattr(self, name)} must be > 0")
        if self.eta_max > 1 or self.expert_eta > 1:
            raise PlanningError(f"hardware: eta_max={self.eta_max} and expert_eta={self.expert_eta} are fractions of "
                                f"the peak; they must be <= 1")
        if self.collective_latency_s < 0 or self.decode_step_overhead_s < 0:
            raise PlanningError("hardware: collective_latency_s and decode_step_overhead_s must be >= 0")

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def efficiency(self, layer_flops: float) -> float:
        """Achieved fraction of the matmul peak when one layer's matmuls on one GPU for one micro-batch take
        `layer_flops`: eta_max · min(1, G/knee)^exponent."""
        return self.eta_max * min(1.0, max(layer_flops, 1.0) / (self.knee_gflop * 1e9)) ** self.exponent


H200 = Hardware()


@dataclass(frozen=True, kw_only=True)
class StepShape:
    """What one RL step processes: `samples` sequences (data.train_batch_size × rollout.n) of `prompt_len` +
    `response_len` tokens (every response is taken at its maximum length: an upper bound), `n` samples per prompt
    (vLLM's prefix cache prefills a prompt once for its n samples), `ppo_epochs` passes over them."""

    samples: int
    prompt_len: int
    response_len: int
    n: int = 1
    ppo_epochs: int = 1

    def __post_init__(self) -> None:
        for key in ("samples", "prompt_len", "response_len", "n", "ppo_epochs"):
            if getattr(self, key) < 1:
                raise PlanningError(f"step: {key}={getattr(self, key)} must be >= 1")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len

    @classmethod
    def for_workload(cls, work: Workload, samples: int) -> "StepShape":
        """`samples` sequences of the workload's length, half prompt and half response (the CLI's default)."""
        prompt = max(1, work.seq_len // 2)
        return cls(samples=samples, prompt_len=prompt, response_len=max(1, work.seq_len - prompt))


@dataclass(frozen=True)
class TimeTerm:
    """One addend of a phase's predicted time, with the arithmetic that produced it."""

    phase: str
    name: str
    seconds: float
    formula: str

    def line(self) -> str:
        return f"{self.name:<36} {self.seconds:>10.3f} s  = {self.formula}"


@dataclass(frozen=True)
class TimePrediction:
    """Predicted seconds of one RL step, phase by phase, on one pool (the rollout colocated with the training roles,
    every GPU running every phase, as :mod:`verl_mega.planning.plan` plans)."""

    terms: tuple[TimeTerm, ...]
    notes: tuple[str, ...] = ()

    @property
    def phases(self) -> dict[str, float]:
        return {p: sum(t.seconds for t in self.terms if t.phase == p) for p in PHASES}

    @property
    def total(self) -> float:
        return sum(t.seconds for t in self.terms)

    def summary(self) -> str:
        ph = self.phases
        return f"step {self.total:.2f} s (" + " + ".join(f"{p} {ph[p]:.2f}" for p in PHASES) + ")"

    def explain(self) -> list[str]:
        lines = [f"predicted time per RL step: {self.summary()}"]
        for phase in PHASES:
            lines += [f"  [{phase}] {self.phases[phase]:.3f} s"] + ["    " + t.line() for t in self.terms
                                                                    if t.phase == phase]
        return lines + ["  " + n for n in self.notes]


# ------------------------------------------------------------------------------------------------------------
# FLOPs
# ------------------------------------------------------------------------------------------------------------


def layer_gemm_flops(arch: ModelArch, tokens: float, tp: int = 1) -> float:
    """G of :meth:`Hardware.efficiency`: the dense matmul FLOPs of one layer on one GPU for `tokens` tokens (the
    micro-batch, which sequence parallelism gathers back before each GEMM), 2·(attention + dense MLP weights)/t·tokens;
    for MoE layers the attention, the shared expert and the router (routed experts: ``Hardware.expert_eta``)."""
    h = arch.hidden_size
    attn = attention_weights(arch)
    if not arch.is_moe:
        return 2 * (attn + 3 * h * arch.ffn_hidden_size) / tp * tokens
    return 2 * (attn + 3 * h * arch.shared_expert_ffn_hidden_size) / tp * tokens + 2 * arch.num_experts * h * tokens


# ------------------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------------------


def _link(hw: Hardware, span: int, node_gpus: int) -> tuple[float, str]:
    """Bandwidth (bytes/s) of a group of consecutive-rank span `span`: NVLink inside a node, else the NIC's."""
    if span <= node_gpus:
        return hw.nvlink_gbps * GB, "NVLink"
    return hw.inter_node_gbps * GB, "inter-node"


def dp_cross_link(hw: Hardware, layout: Pool, node_gpus: int, island_gpus: int) -> tuple[float, str]:
    """Bandwidth (bytes/s) and name of the links a data-parallel group uses between islands: the NICs when a
    pipeline stage's ranks span nodes, PCIe between NVLink islands of one node, NVLink when the group fits one."""
    span = layout.tp * layout.cp * layout.dp
    if span > node_gpus:
        return hw.inter_node_gbps * GB, "inter-node"
    if span > island_gpus:
        return hw.pcie_gbps * GB, "PCIe"
    return hw.nvlink_gbps * GB, "NVLink"


def predict_time(arch: ModelArch, layout: Pool, work: Workload, step: StepShape, memory: MemoryPrediction, *,
                 roles: tuple[RoleSpec, ...], rollout: RolloutSpec, hardware: Hardware = H200,
                 node_gpus: int = 8, island_gpus: int | None = None) -> TimePrediction:
    """Seconds per RL step by phase for `layout` (its gen_tp included). `memory` is the memory model's prediction
    for the same layout (KV cache size, reshard bytes, offloaded bytes, MoE all-to-all bytes). `island_gpus`: GPUs
    per NVLink island (default: the node)."""
    hw = hardware
    t, p, v, dp = layout.tp, layout.pp, layout.vpp or 1, layout.dp
    world, tg = layout.size, layout.gen_tp
    L, h, B = arch.num_layers, arch.hidden_size, work.act_bytes
    s, b = work.seq_len, work.micro_batch
    if s != step.seq_len:
        raise PlanningError(f"step: prompt_len + response_len = {step.seq_len} differs from the workload's "
                            f"seq_len={s}")
    terms: list[TimeTerm] = []
    notes: list[str] = []
    alpha = hw.collective_latency_s
    peak = hw.peak_flops

    # ---- shapes of the step
    m_opt = work.num_microbatches or 1  # micro-batches per DP rank and optimizer step
    global_batch = dp * b * m_opt
    opt_steps = math.ceil(step.samples / global_batch) * step.ppo_epochs
    micro = math.ceil(step.samples / (dp * b))  # micro-batches per DP rank per pass over the step's samples
    tokens = step.samples * s
    bubble = (p - 1) / (v * m_opt)
    eta_d, eta_e = hw.efficiency(layer_gemm_flops(arch, s * b, t)), hw.expert_eta
    attn = attention_flops(arch, s / 2)  # causal: the mean context of a training token is s/2
    sigma = t if layout.sequence_parallel else 1
    critic = any(r.value_head for r in roles)
    ref = any(r.name == "ref" for r in roles)

    def compute(flops_dense: float, flops_expert: float) -> float:
        return (flops_dense / eta_d + flops_expert / eta_e) / (world * peak) * (1 + bubble)

    # ---- tensor-parallel collectives per layer and micro-batch (forward; the backward repeats them)
    moe_layers = arch.is_moe
    coll = (2 if moe_layers else 4) if layout.sequence_parallel else (1 if moe_layers else 2)
    tp_bytes = (2 if moe_layers else 4) * (t - 1) / t * s * b * h * B  # AG + RS (or AR = RS + AG) per layer
    tp_fwd = 0.0 if t == 1 else micro * (L // p) * (coll * alpha + tp_bytes / (hw.nvlink_gbps * GB))
    pp_bw, pp_link = _link(hw, t * dp * p, node_gpus)
    pp_fwd = 0.0 if p == 1 else micro * v * (alpha + s * b * h * B / sigma / pp_bw)
    ep_bw, ep_link = _link(hw, layout.etp * layout.ep, node_gpus)
    a2a_fwd = memory.moe_alltoall_bytes / 2 * (micro / m_opt) / ep_bw  # the memory model counts fwd + bwd per step

    lora = roles[0].lora  # LoRA: the actor's frozen base skips its weight-gradient GEMMs and its optimizer step

    def passes(role: str, value_head: bool, kind: str) -> None:
        dense, experts = matmul_weights(arch, value_head=value_head)
        # backward: input and weight gradients, 2 × forward; a frozen base (LoRA) computes its GEMMs' input gradients
        # only (the adapters' r-wide GEMMs are neglected; core attention has no weights: 3 × either way)
        mult = 1 if kind == "forward" else 3
        gemm_mult = 2 if kind == "update" and lora is not None and role == "actor update" else mult
        extra_dense = extra_attn = 0.0
        if kind == "update" and work.recompute == "full":
            extra_dense, extra_attn = 2 * dense, attn  # one more forward of every layer
        elif kind == "update" and work.recompute == "selective":
            extra_attn = attn  # core attention recomputed
        per_token = gemm_mult * 2 * dense + mult * attn + extra_dense + extra_attn
        flops_d = tokens * per_token * (step.ppo_epochs if kind == "update" else 1)
        flops_e = tokens * (gemm_mult * 2 * experts + (2 * experts if extra_dense else 0)) * \
            (step.ppo_epochs if kind == "update" else 1)
        phase = "score" if kind == "forward" else "train"
        what = "forward" if kind == "forward" else f"forward + backward{' (frozen base)' if gemm_mult == 2 else ''}" + (
            f", {work.recompute} recompute" if work.recompute != "none" else "")
        epochs = step.ppo_epochs if kind == "update" else 1
        expert_txt = f" + {flops_e:.3g} expert FLOPs at η={eta_e:.3f}" if flops_e else ""
        terms.append(TimeTerm(phase, f"{role} compute", compute(flops_d, flops_e),
                              f"{flops_d:.3g} FLOPs ({what}: {tokens:,} tokens × {per_token:.3g}){expert_txt} / "
                              f"({world} GPUs × η={eta_d:.3f} × {hw.peak_tflops:g} TFLOP/s) × (1 + bubble "
                              f"{bubble:.4f})"))
        comm_mult = (1 if kind == "forward" else 2 + (work.recompute == "full")) * epochs
        if t > 1:
            terms.append(TimeTerm(phase, f"{role} TP collectives", tp_fwd * comm_mult,
                                  f"{comm_mult} × {micro} micro-batches × {L // p} layers × ({coll} × α + "
                                  f"{tp_bytes / 2**20:.1f} MiB / {hw.nvlink_gbps:g} GB/s)"))
        if p > 1:
            sends = 1 if kind == "forward" else 2
            terms.append(TimeTerm(phase, f"{role} PP send/recv", pp_fwd * sends * epochs,
                                  f"{sends * epochs} × {micro} micro-batches × {v} chunk(s) × (α + s·b·h·B/σ over "
                                  f"{pp_link})"))
        if a2a_fwd:
            terms.append(TimeTerm(phase, f"{role} MoE all-to-all", a2a_fwd * comm_mult,
                                  f"{comm_mult} × {memory.moe_alltoall_bytes / 2 / 2**30 * micro / m_opt:.2f} GiB "
                                  f"over {ep_link}"))

    # ---- score: frozen forward passes
    passes("old log-prob", False, "forward")
    if ref:
        passes("ref log-prob", False, "forward")
    if critic:
        passes("critic values", True, "forward")

    # ---- train: updates, then per optimizer step the DP reduction and the Adam step
    island = min(island_gpus or node_gpus, node_gpus)
    cross_bw, cross_link = dp_cross_link(hw, layout, node_gpus, island)
    shard = dp // layout.dp_islands  # the distributed optimizer shards inside an island
    for role, value_head in (("actor", False), ("critic", True)) if critic else (("actor", False),):
        passes(f"{role} update", value_head, "update")
        sp = max((stage_params(arch, layout, st, value_head=value_head) for st in {0, p - 1}), key=lambda x: x.total)
        if lora is not None and role == "actor":  # only the adapters are reduced and stepped
            from verl_mega.planning.lora import stage_adapter_params

            sp = replace(sp, layer_params=max(stage_adapter_params(arch, layout, lora, st) for st in {0, p - 1}),
                         embedding=0, output=0, final_norm=0, experts=0)
        pb = 4 if work.dtype == "fp32" else 2
        syncs = pool_dp_sync(layout, dense=sp.total - sp.experts, experts=sp.experts, param_bytes=pb,
                             island_gpus=island)
        seconds = sum(x.seconds(inside_bps=hw.nvlink_gbps * GB, cross_bps=cross_bw, latency_s=alpha) for x in syncs)
        if seconds:
            dense, experts = syncs
            across = sum(x.cross_bytes for x in syncs)
            sent = sum(x.sent_bytes for x in syncs) / 2**30
            terms.append(TimeTerm("train", f"{role} DP grad/param sync", opt_steps * seconds,
                                  f"{opt_steps} optimizer step(s) × {dense.formula}"
                                  + (f"; experts: {experts.formula}" if experts.group > 1 else "")
                                  + (f": {sent:.2f} GiB per GPU, {across / 2**30:.2f} GiB of it over {cross_link}"
                                     if across else f": {sent:.2f} GiB per GPU over NVLink")))
        adam = 30 * sp.total / shard + 4 * sp.total
        terms.append(TimeTerm("train", f"{role} optimizer step", opt_steps * adam / (hw.hbm_gbps * GB),
                              f"{opt_steps} × (30 B × P/{'dp' if shard == dp else '(dp/islands)'} (fp32 grad, master, "
                              f"m, v read; master, m, v, param written) + 4 B × P grad zeroing) over HBM, "
                              f"P={sp.total:,}"))

    # ---- reshard: the 3D-HybridEngine switch and offload traffic
    gen_ep, gen_dp = layout.gen_ep, layout.gen_dp
    gen_bytes = 2 * generation_params(arch, tg, gen_ep)
    rs_bw = min(hw.reshard_gbps, hw.inter_node_gbps if t * dp * p > node_gpus and p > 1 else math.inf) * GB
    terms.append(TimeTerm("reshard", "weight sync", memory.reshard_bytes_per_gpu / rs_bw
                          + 2 * gen_bytes / (hw.hbm_gbps * GB),
                          f"{memory.reshard_bytes_per_gpu / 2**30:.2f} GiB received / {rs_bw / GB:g} GB/s + 2 × "
                          f"{gen_bytes / 2**30:.2f} GiB generation weights rewritten / {hw.hbm_gbps:g} GB/s"))
    if memory.host_offload_bytes:
        terms.append(TimeTerm("reshard", "offload to host and back", 2 * memory.host_offload_bytes /
                              (hw.pcie_gbps * GB), f"2 × {memory.host_offload_bytes / 2**30:.2f} GiB / "
                                                   f"{hw.pcie_gbps:g} GB/s"))

    # ---- rollout
    engines = world // tg
    per_engine = math.ceil(step.samples / engines)
    kv_tok = kv_cache_bytes_per_token(arch, tg)  # bf16, per GPU
    fit = int(max(memory.kv_cache_bytes, 0) // (kv_tok * s))
    conc = max(1, min(rollout.max_num_seqs, per_engine, fit))
    if fit < 1:
        notes.append("the KV cache holds no whole sequence: the rollout time assumes one at a time")
    full, last = divmod(per_engine, conc)  # waves of `conc` sequences, then the rest
    ctx = step.prompt_len + step.response_len / 2
    dense, experts = matmul_weights(arch)

    moe_layers = len(arch.moe_layers)
    a2a_bw, a2a_link = _link(hw, gen_ep, node_gpus)

    def decode_step(c: int) -> tuple[float, float, float, float]:
        """(seconds, bytes read, FLOPs, communication seconds) of one decode step of `c` sequences on one GPU."""
        weights = gen_bytes
        if arch.is_moe:  # a step reads only the experts its tokens route to: E·(1 − (1 − k/E)^c) expected; with
            # expert-parallel generation the tokens of the D engines of the group share the GPU's E/gen_ep experts
            held = 2 * moe_layers * arch.num_experts * 3 * h * arch.moe_ffn_hidden_size
            held /= gen_ep if gen_ep > 1 else tg
            weights -= held * (1 - arch.moe_topk / arch.num_experts) ** (c * gen_dp)
        read = weights + c * ctx * kv_tok
        flops = c * (2 * (dense + experts) + attention_flops(arch, ctx)) / tg
        ar = 0.0 if tg == 1 else 2 * L * (alpha + 2 * (tg - 1) / tg * c * h * 2 / (hw.nvlink_gbps * GB))
        if gen_ep > 1:  # the expert-parallel all-to-all: each token's hidden state to its k experts and back
            ar += moe_layers * 2 * (alpha + c * arch.moe_topk * h * 2 * (gen_ep - 1) / gen_ep / a2a_bw)
        # small-batch GEMMs are bandwidth-bound unless the compute roof (at the wide-GEMM rate) is the higher one
        return max(read / (hw.hbm_gbps * GB), flops / (hw.eta_max * peak)) + ar + hw.decode_step_overhead_s, \
            read, flops, ar

    t_step, read, flops, t_ar = decode_step(conc)
    bound = "bandwidth" if read / (hw.hbm_gbps * GB) >= flops / (hw.eta_max * peak) else "compute"
    decode = step.response_len * (full * t_step + (decode_step(last)[0] if last else 0.0))
    waves = f"{full} wave(s) of {conc}" + (f" + one of {last}" if last else "")
    terms.append(TimeTerm("rollout", "decode", decode,
                          f"{waves} sequences × {step.response_len} steps × {t_step * 1e3:.2f} ms ({bound}-bound: "
                          f"max({read / 2**30:.2f} GiB / {hw.hbm_gbps:g} GB/s, {flops:.3g} FLOPs) + "
                          f"{t_ar * 1e3:.2f} ms TP all-reduces" + (f" and expert all-to-all over {a2a_link}"
                                                                    if gen_ep > 1 else "") +
                          f" + {hw.decode_step_overhead_s * 1e3:.2f} ms per step); "
                          f"{engines} engine(s) of tg={tg}" + (f" (experts over gen_ep={gen_ep})" if gen_ep > 1 else "")
                          + f", {per_engine} sequences each"))
    prompts = math.ceil(per_engine / step.n)
    prefill = prompts * step.prompt_len * (2 * (dense + experts) + attention_flops(arch, step.prompt_len / 2))
    chunk = min(rollout.max_num_batched_tokens, prompts * step.prompt_len)  # tokens of one prefill batch
    eta_p = hw.efficiency(layer_gemm_flops(arch, chunk, tg))  # vLLM shards every matmul over tg
    terms.append(TimeTerm("rollout", "prefill", prefill / tg / (eta_p * peak),
                          f"{prompts} prompts × {step.prompt_len} tokens × (2·N + attention) / (tg={tg} × "
                          f"η={eta_p:.3f} × peak)"))
    return TimePrediction(tuple(terms), tuple(notes))


def time_bucket(ratio: float, granularity: float = 0.02) -> int:
    """Rank key of a time `ratio` ≥ 1 to the fastest comparable plan: 0 within `granularity` (relative) of it, then
    1, 2, ... per further step, so a difference the model cannot resolve falls through to the tie-breakers."""
    return math.floor(math.log(max(ratio, 1.0)) / math.log1p(granularity) + 1e-9)
