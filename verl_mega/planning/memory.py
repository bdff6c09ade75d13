"""Per-GPU memory model of one RL step: training (params, grads, optimizer, activations), vLLM rollout and the
3D-HybridEngine transition. Pure arithmetic over a :class:`~verl_mega.models.hf_config.ModelArch` and a training
:class:`~verl_mega.parallel.placement.Pool`; every number comes with the formula that produced it (:class:`Term`),
so ``tools/plan.py --explain`` prints the arithmetic. The model itself (training state, Korthikanti-style
activations for our layer spec, pipeline in-flight micro-batches, vLLM weights and KV cache, HybridFlow Table 2)
is derived in docs/planning.md.

Symbols: L layers, h hidden, a heads, k key/value heads, d head dim, f FFN hidden, V vocabulary padded for tp,
s sequence length, b micro-batch, B bytes per activation element, t training TP, σ = t with sequence parallelism
(else 1), p PP, v virtual stages, D data parallel, tg generation TP. Mixture of experts: E experts of width f_e,
top-k routing, f_s the shared expert's width, ep / etp expert parallel / expert TP, D_e = t·D/(ep·etp) expert data
parallel (the ranks that hold the same experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from verl_mega.models.arch import stage_layer_indices
from verl_mega.models.hf_config import ModelArch, ModelConfigError, check_arch_layout
from verl_mega.parallel.placement import PlacementError, Pool
from verl_mega.planning.generation import kv_cache_bytes_per_token, reshard_bytes
from verl_mega.planning.params import (PlanningError, StageParams, generation_layer_params, generation_params,
                                       stage_params)

GiB = 2**30
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_RECOMPUTE = ("none", "selective", "full")


def gib(nbytes: float) -> float:
    return nbytes / GiB


def _fmt_bytes(nbytes: float) -> str:
    if abs(nbytes) >= GiB / 100:
        return f"{nbytes / GiB:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB" if abs(nbytes) >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


@dataclass(frozen=True)
class Term:
    """One addend of a memory total, with the arithmetic that produced it."""

    name: str
    bytes: float
    formula: str

    def line(self) -> str:
        return f"{self.name:<36} {_fmt_bytes(self.bytes):>11}  = {self.formula}"


@dataclass(frozen=True)
class Phase:
    """Per-GPU memory of one phase of the RL step: the sum of its terms."""

    name: str
    terms: tuple[Term, ...]
    note: str = ""

    @property
    def total(self) -> float:
        return sum(t.bytes for t in self.terms)

    def breakdown_gib(self) -> dict[str, float]:
        return {t.name: round(gib(t.bytes), 4) for t in self.terms}

    def explain(self) -> list[str]:
        head = f"[{self.name}] {_fmt_bytes(self.total)}" + (f"  ({self.note})" if self.note else "")
        return [head] + ["  " + t.line() for t in self.terms]


# ------------------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------------------


def training_pool(*, tp: int, pp: int = 1, dp: int = 1, gen_tp: int | None = None, vpp: int | None = None,
                  sequence_parallel: bool | None = None, ep: int = 1, etp: int | None = None,
                  gen_ep: int = 1) -> Pool:
    """One training pool of tp·pp·dp ranks (cp = 1), the planner's unit; sequence parallelism on when tp > 1
    unless told otherwise; for MoE, ep·etp of the tp·dp ranks of a stage split the experts, and gen_ep > 1 shards
    them in generation."""
    try:
        return Pool(name="train", ranks=tuple(range(tp * pp * dp)), tp=tp, pp=pp, vpp=vpp, gen_tp=gen_tp, ep=ep,
                    etp=etp, gen_ep=gen_ep,
                    sequence_parallel=tp > 1 if sequence_parallel is None else sequence_parallel)
    except PlacementError as exc:
        raise PlanningError(str(exc)) from None


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one training micro-batch looks like and how it is run."""

    micro_batch: int = 1
    seq_len: int = 4096
    recompute: Literal["none", "selective", "full"] = "none"
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    num_microbatches: int | None = None  # per DP rank and optimizer step; None: enough to fill the pipeline
    entropy: bool = False  # the actor loss also computes the entropy (entropy_coeff > 0)
    backend: Literal["nccl", "gloo"] = "nccl"

    def __post_init__(self) -> None:
        for key in ("micro_batch", "seq_len"):
            if getattr(self, key) < 1:
                raise PlanningError(f"workload: {key}={getattr(self, key)} must be >= 1")
        if self.num_microbatches is not None and self.num_microbatches < 1:
            raise PlanningError(f"workload: num_microbatches={self.num_microbatches} must be >= 1")
        if self.recompute not in _RECOMPUTE:
            raise PlanningError(f"workload: recompute={self.recompute!r} is not one of {'|'.join(_RECOMPUTE)}")
        if self.dtype not in _DTYPE_BYTES:
            raise PlanningError(f"workload: dtype={self.dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        if self.backend not in ("nccl", "gloo"):
            raise PlanningError(f"workload: backend={self.backend!r} is not nccl|gloo")

    @property
    def act_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, kw_only=True)
class RoleSpec:
    """One role colocated on every GPU, and what it moves to host memory while idle."""

    name: str
    trainable: bool = True
    value_head: bool = False
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False
    # a models.lora.LoRASpec: the actor's adapters alone carry grads and optimizer state; the reference is the actor's
    # base with the adapters off, holding nothing of its own
    lora: object | None = None


def default_roles(*, critic: bool = True, ref: bool = True, offload: tuple[str, ...] = (),
                  offload_ref: bool = False, lora=None) -> tuple[RoleSpec, ...]:
    """Actor (+ critic with a value head) (+ frozen reference). `offload` ⊆ {params, grads, optimizer}. With
    ``lora`` (a LoRASpec) the actor trains adapters only and the reference is its base: a reference role with no
    weights of its own."""
    bad = set(offload) - {"params", "grads", "optimizer"}
    if bad:
        raise PlanningError(f"offload: {sorted(bad)} not among params, grads, optimizer")
    flags = {f"offload_{name}": name in offload for name in ("params", "grads", "optimizer")}
    roles = [RoleSpec(name="actor", lora=lora, **flags)]
    if critic:
        roles.append(RoleSpec(name="critic", value_head=True, **flags))
    if ref:  # with LoRA the actor's own base (adapters off): its forward passes, no weights of its own
        roles.append(RoleSpec(name="ref", trainable=False, offload_params=offload_ref and lora is None, lora=lora))
    return tuple(roles)


@dataclass(frozen=True, kw_only=True)
class RolloutSpec:
    """vLLM memory settings (``rollout.*`` of the config)."""

    gpu_memory_utilization: float = 0.5
    kv_cache_bytes: float | None = None  # explicit KV budget per GPU (rollout.kv_cache_memory_bytes)
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    free_cache_engine: bool = True  # vLLM sleeps during training (KV cache and weights released)

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise PlanningError(f"rollout: gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise PlanningError(f"rollout: kv_cache_bytes={self.kv_cache_bytes} must be > 0")


def training_state_terms(params: int, dp: int, dtype: str, *, experts: int = 0, edp: int = 1, islands: int = 1,
                         adapters: int | None = None) -> list[Term]:
    """Params, fp32 main grads and distributed-optimizer state of a rank holding `params` parameters, of which
    `experts` are routed-expert weights (their optimizer state is sharded over the expert-data-parallel group D_e).
    With data-parallel islands (`islands` per group) the optimizer shards inside an island only: over dp/islands.
    With LoRA (`adapters`: the rank's adapter parameters) the base is frozen: grads and optimizer state are the
    adapters' only."""
    pb = _DTYPE_BYTES[dtype]
    if adapters is not None:
        per, what = (8, "(4 + 4) B") if pb == 4 else (12, "(4 master + 4 m + 4 v) B")
        return [Term("params", pb * (params + adapters), f"{pb} B × ({params:,} frozen + {adapters:,} adapter)"),
                Term("grads (fp32 main grads)", 4 * adapters, f"4 B × {adapters:,} adapter params"),
                Term("optimizer (master, m, v)" if pb != 4 else "optimizer (Adam m, v)",
                     per * adapters / (dp // islands), f"{what} × {adapters:,} adapter params / dp={dp // islands}")]
    if islands > 1:
        terms = training_state_terms(params, dp // islands, dtype, experts=experts, edp=edp // islands)
        return terms[:2] + [Term(terms[2].name, terms[2].bytes, terms[2].formula.replace(
            "dp=", f"(dp/{islands} islands)=").replace("D_e=", f"(D_e/{islands} islands)="))]
    terms = [Term("params", pb * params, f"{pb} B × {params:,} params"),
             Term("grads (fp32 main grads)", 4 * params, f"4 B × {params:,}")]
    per = 8 if pb == 4 else 12
    what = "(4 + 4) B" if pb == 4 else "(4 master + 4 m + 4 v) B"
    dense = params - experts
    name = "optimizer (Adam m, v)" if pb == 4 else "optimizer (master, m, v)"
    if not experts:
        terms.append(Term(name, per * params / dp, f"{what} × {params:,} / dp={dp}"))
    else:
        terms.append(Term(name, per * dense / dp + per * experts / edp,
                          f"{what} × ({dense:,} / dp={dp} + {experts:,} experts / D_e={edp})"))
    return terms


# ------------------------------------------------------------------------------------------------------------
# Activations
# ------------------------------------------------------------------------------------------------------------


def layer_activation_bytes(arch: ModelArch, layout: Pool, work: Workload, *, recompute: str | None = None,
                           layer: int | None = None) -> float:
    """A_layer: bytes autograd keeps for one transformer layer (``layer``: default the first MoE layer, or layer 0)
    and one micro-batch (module docstring)."""
    rec = work.recompute if recompute is None else recompute
    s, b, B = work.seq_len, work.micro_batch, work.act_bytes
    h, a, k, d, t = arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim, layout.tp
    sigma = t if layout.sequence_parallel else 1
    if rec == "full":
        return B * s * b * h / sigma
    layer = (arch.moe_layers[0] if arch.is_moe else 0) if layer is None else layer
    mlp = _mlp_activation_per_token(arch, layout, B, layer)
    if arch.is_mla:
        per_token = 2 * (4 + 2 * B) * h / sigma + _mla_activation_per_token(arch, layout, B) + mlp
        total = s * b * per_token
        return total + (s * b * 4 * a / t if rec == "none" else 0.0)
    v_kv = a if a > k else a + 2 * k
    per_token = 2 * (4 + 2 * B) * h / sigma + B * (3 * a + v_kv) * d / t + mlp
    if arch.qk_norm:
        # fp32: the norm's input is the tensor itself, and k is a view that keeps the fused QKV output alive.
        per_token += ((4 + B) * (a + k) + (4 * (a + k) if B == 4 else 0)) * d / t
    total = s * b * per_token
    if rec == "none":
        total += s * b * 4 * a / t + 4 * B * s * d
    return total


def _mla_activation_per_token(arch: ModelArch, layout: Pool, B: int) -> float:
    """Multi-head latent attention's bytes per token (derived for Megatron's MLA on our spec, not measured): the
    latent down projections' outputs B·(q_r + r + rope)/σ and their fp32 norms (4 + 2B)·(q_r + r)/σ (whole on
    every rank, for its σ-share of tokens), the up projections' outputs B·a·(q_d + nope + v)/t, the rotary key
    gathered over the sequence B·rope, the contiguous query, key and value B·a·(2·q_d + v)/t and the attention
    output B·a·v/t (the fp32 log-sum-exp is added by the caller)."""
    t = layout.tp
    sigma = t if layout.sequence_parallel else 1
    a, qd, r, rope, q = arch.num_heads, arch.head_dim, arch.kv_lora_rank, arch.qk_rope_head_dim, arch.q_lora_rank or 0
    nope, v = arch.qk_nope_head_dim, arch.v_head_dim
    down = B * (q + r + rope) / sigma + (4 + 2 * B) * (q + r) / sigma
    return down + B * a * (qd + nope + v) / t + B * rope + B * a * (2 * qd + v) / t + B * a * v / t


def _mlp_activation_per_token(arch: ModelArch, layout: Pool, B: int, layer: int | None = None) -> float:
    """MLP bytes autograd keeps per token of the micro-batch. Dense: fc1 output, activation and product, 5·B·f/t.
    MoE (tokens split by σ, each routed to k experts): the same 5·B·f_e per routed copy (expert TP splits the width
    of tokens it gathers, so etp cancels), the permuted and dispatched copies of the hidden state 2·B·h·etp, the
    router's fp32 logits and scores 8·E, and the shared expert's 5·B·f_s/t."""
    t = layout.tp
    layer = (arch.moe_layers[0] if arch.is_moe else 0) if layer is None else layer
    if not arch.is_moe_layer(layer):
        return 5 * B * arch.ffn_hidden_size / t
    sigma = t if layout.sequence_parallel else 1
    k, etp = arch.moe_topk, layout.etp
    routed = (k * (5 * B * arch.moe_ffn_hidden_size + 2 * B * arch.hidden_size * etp) + 8 * arch.num_experts) / sigma
    return routed + 5 * B * arch.shared_expert_ffn_hidden_size / t


def mlp_grad_bytes(arch: ModelArch, layout: Pool, work: Workload) -> float:
    """The MLP backward's transient fc1-output gradient: 2·B·s·b·f/t (dense), 2·B·s·b·k·f_e/σ (MoE); the larger
    where dense and MoE layers mix."""
    s, b, B, t = work.seq_len, work.micro_batch, work.act_bytes, layout.tp
    dense = 2 * B * s * b * arch.ffn_hidden_size / t
    if not arch.is_moe:
        return dense
    sigma = t if layout.sequence_parallel else 1
    moe = 2 * B * s * b * arch.moe_topk * arch.moe_ffn_hidden_size / sigma
    return moe if arch.all_layers_moe else max(dense, moe)


def moe_comm_terms(arch: ModelArch, layout: Pool, work: Workload) -> list[Term]:
    """Bytes one GPU sends per actor optimizer step for the experts (0 for dense models): the token dispatcher's
    all-to-all, dispatch and combine in the forward pass and again in the backward, 4·k·(s·b/σ)·h·B·(ep−1)/ep per
    MoE layer and micro-batch over its L/p layers and M micro-batches; and the expert gradients' reduction over
    D_e, 2·(D_e−1)/D_e × 4 B × expert params (a ring reduce-scatter + all-gather, vs the dense params over D)."""
    if not arch.is_moe:
        return []
    t, ep, edp = layout.tp, layout.ep, layout.edp
    sigma = t if layout.sequence_parallel else 1
    s, b, B, m = work.seq_len, work.micro_batch, work.act_bytes, work.num_microbatches or 1
    # the MoE layers of the busiest stage (DeepSeek's dense first layers sit on stage 0)
    layers = max(sum(arch.is_moe_layer(i) for i in stage_layer_indices(arch.num_layers, layout.pp, layout.vpp, st))
                 for st in range(layout.pp))
    a2a = 4 * arch.moe_topk * s * b / sigma * arch.hidden_size * B * (ep - 1) / ep * layers * m
    experts = max(stage_params(arch, layout, st).experts for st in range(layout.pp))
    grads = 2 * (edp - 1) / edp * 4 * experts
    return [Term("MoE all-to-all (dispatch + combine)", a2a,
                 f"4·k·(s·b/σ)·h·B·(ep−1)/ep × {layers} layers × M={m} (k={arch.moe_topk}, ep={ep})"),
            Term("expert grad reduction over D_e", grads, f"2·(D_e−1)/D_e × 4 B × {experts:,} (D_e={edp})")]


def logits_bytes(arch: ModelArch, layout: Pool, work: Workload, *, value_head: bool = False) -> float:
    """Last stage, kept until the backward pass: final norm plus the log-prob loss over vocabulary-parallel logits
    (the logits, the shifted logits and their exponentials: (B + 8)·s·b·V/t; entropy adds 12·s·b·V/t)."""
    s, b, B, t = work.seq_len, work.micro_batch, work.act_bytes, layout.tp
    sigma = t if layout.sequence_parallel else 1
    norm = (4 + 2 * B) * s * b * arch.hidden_size / sigma
    if value_head:
        return norm + 3 * 4 * s * b  # values [s, b, 1] and their fp32 loss terms
    per_vocab = B + 8 + (12 if work.entropy else 0)
    return norm + per_vocab * s * b * arch.padded_vocab_size(t) / t


def in_flight(layout: Pool, stage: int, num_microbatches: int | None) -> int:
    """Micro-batch chunks (of L/(p·v) layers) whose activations `stage` holds at its peak under Megatron's 1F1B."""
    p, v = layout.pp, layout.vpp or 1
    if p == 1:
        held = 1
    elif layout.vpp is None:
        held = p - stage
    else:
        held = 2 * (p - stage - 1) + (v - 1) * p + 1
    if num_microbatches is not None:
        held = min(held, num_microbatches * v)
    return held


def activation_terms(arch: ModelArch, layout: Pool, work: Workload, stage: int, *,
                     value_head: bool = False) -> list[Term]:
    """Activations of `stage` at its peak: everything kept for backward plus the larger of two backward moments —
    the loss gradient on the last stage (logits still alive), or the last layer's MLP backward (logits freed; with
    full recompute, that layer rebuilt first)."""
    p, v = layout.pp, layout.vpp or 1
    chunk_layers = arch.num_layers // (p * v)
    held = in_flight(layout, stage, work.num_microbatches)
    # the stage's chunk of the most activation (where dense and MoE layers mix they differ)
    per_layer = max(sum(layer_activation_bytes(arch, layout, work, layer=(c * p + stage) * chunk_layers + i)
                        for i in range(chunk_layers)) for c in range(v)) / chunk_layers
    s, b, B, t = work.seq_len, work.micro_batch, work.act_bytes, layout.tp
    sigma = t if layout.sequence_parallel else 1
    rec = work.recompute
    terms = [Term(f"activations ({rec} recompute)", held * chunk_layers * per_layer,
                  f"{held} micro-batch chunk(s) × {chunk_layers} layers × {_fmt_bytes(per_layer)}/layer "
                  f"(s={s}, b={b}, B={B})")]
    if p > 1:
        buf = 2 * B * s * b * arch.hidden_size / sigma
        terms.append(Term("pipeline send/recv", held * buf, f"{held} × 2 × {B} B × s·b·h/σ"))
    mlp_grad = mlp_grad_bytes(arch, layout, work)
    layer_moment, layer_formula = mlp_grad, ("MLP backward: fc1-output grad " + (
        "2·B·s·b·k·f_e/σ" if arch.is_moe else "2·B·s·b·f/t"))
    if rec == "full":
        layer_moment += layer_activation_bytes(arch, layout, work, recompute="none")
        layer_formula = "recomputed layer + " + layer_formula
    if stage == p - 1:
        kept = logits_bytes(arch, layout, work, value_head=value_head)
        what = "value head" if value_head else f"log-prob loss, V={arch.padded_vocab_size(t)}"
        terms.append(Term("final norm + logits", kept, f"(4 + 2B)·s·b·h/σ + {what}"))
        # fp32 gradient of the loss w.r.t. the logits, plus its cast back to the logits' dtype when that is 16-bit.
        grad_bytes = 4 + (B if B < 4 else 0)
        loss_grad = 0.0 if value_head else grad_bytes * s * b * arch.padded_vocab_size(t) / t
        if loss_grad + kept >= layer_moment:
            terms.append(Term("backward peak: loss grad", loss_grad,
                              f"{grad_bytes} B × s·b·V/t (fp32 grad{' + its cast' if B < 4 else ''}), logits alive"))
        else:
            terms.append(Term("backward peak: last layer", layer_moment - kept, layer_formula + ", logits freed"))
    else:
        terms.append(Term("backward peak: last layer", layer_moment, layer_formula))
    return terms


def forward_only_terms(arch: ModelArch, layout: Pool, work: Workload, *, value_head: bool = False) -> list[Term]:
    """Scoring (ref / old log-prob / critic values): no activations kept, one layer's and the logits' transients."""
    one = layer_activation_bytes(arch, layout, work, recompute="none")
    return [Term("forward transients", one, "≤ one layer's intermediates (nothing kept without grad)"),
            Term("final norm + logits", logits_bytes(arch, layout, work, value_head=value_head),
                 "as in training, last stage")]


# ------------------------------------------------------------------------------------------------------------
# Phases
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPrediction:
    """Per-GPU memory of each phase on the worst pipeline stage, plus the rollout and reshard figures."""

    layout: Pool
    phases: dict[str, Phase]
    worst_stage: dict[str, int]
    kv_cache_bytes: float
    kv_bytes_per_token: float
    reshard_bytes_per_gpu: float
    reshard_extra_peak_bytes: float
    host_offload_bytes: float
    notes: tuple[str, ...] = field(default_factory=tuple)
    comm: tuple[Term, ...] = field(default_factory=tuple)  # MoE traffic per GPU and actor step (moe_comm_terms)

    @property
    def moe_alltoall_bytes(self) -> float:
        return sum(t.bytes for t in self.comm if "all-to-all" in t.name)

    def totals_gib(self) -> dict[str, float]:
        return {name: round(gib(ph.total), 3) for name, ph in self.phases.items()}

    @property
    def peak(self) -> float:
        return max(ph.total for ph in self.phases.values())

    def explain(self) -> list[str]:
        lines: list[str] = []
        for name, phase in self.phases.items():
            lines += phase.explain() + [f"  (worst pipeline stage: {self.worst_stage[name]})"]
        lines.append(f"KV cache per GPU {_fmt_bytes(self.kv_cache_bytes)} at {_fmt_bytes(self.kv_bytes_per_token)}"
                     f"/token → {int(self.kv_cache_bytes // max(self.kv_bytes_per_token, 1)):,} tokens")
        lines += list(self.notes)
        return lines


def _state_terms(sp: StageParams, layout: Pool, dtype: str) -> list[Term]:
    return training_state_terms(sp.total, layout.dp, dtype, experts=sp.experts, edp=layout.edp,
                                islands=layout.dp_islands, adapters=sp.adapters)


def _resident_terms(role: RoleSpec, sp: StageParams, layout: Pool, dtype: str, *, keep_params: bool = False
                    ) -> list[Term]:
    """What an idle role leaves on the GPU (its offload flags applied)."""
    if role.lora is not None and not role.trainable:
        return []  # LoRA's reference: the actor's weights
    terms = _state_terms(sp, layout, dtype) if role.trainable else _state_terms(sp, layout, dtype)[:1]
    kept = []
    for term in terms:
        kind = term.name.split(" ")[0]
        offloaded = {"params": role.offload_params and not keep_params, "grads": role.offload_grads,
                     "optimizer": role.offload_optimizer}[kind]
        if not offloaded:
            kept.append(Term(f"{role.name} {term.name}", term.bytes, term.formula))
    return kept


def _stage_state(arch: ModelArch, layout: Pool, role: RoleSpec, stage: int) -> StageParams:
    sp = stage_params(arch, layout, stage, value_head=role.value_head)
    if role.lora is None or not role.trainable:
        return sp
    from verl_mega.planning.lora import stage_adapter_params

    return replace(sp, adapters=stage_adapter_params(arch, layout, role.lora, stage))


def predict_memory(arch: ModelArch, layout: Pool, work: Workload, *, roles: tuple[RoleSpec, ...] | None = None,
                   rollout: RolloutSpec | None = None, gpu_mem_bytes: float | None = None) -> MemoryPrediction:
    """Per-GPU memory of every phase, on the pipeline stage where it peaks."""
    roles = roles or default_roles()
    rollout = rollout or RolloutSpec()
    if roles[0].name != "actor" or not roles[0].trainable:
        raise PlanningError("roles: the first role must be the trainable actor")
    if arch.num_layers % layout.chunks:
        raise PlanningError(f"pp·vpp={layout.chunks} must divide num_layers={arch.num_layers}")
    try:
        check_arch_layout(layout, arch)
    except ModelConfigError as exc:
        raise PlanningError(str(exc)) from None
    dt = work.dtype
    gen_params = generation_params(arch, layout.gen_tp, layout.gen_ep)
    gen_bytes = 2 * gen_params
    model_bytes = 2 * arch.num_parameters()  # M of HybridFlow Table 2, bf16 weights
    at = f"tg={layout.gen_tp}" + (f", experts over gen_ep={layout.gen_ep}" if layout.gen_ep > 1 else "")
    vllm_weights = Term("vLLM weights", gen_bytes, f"2 B × {gen_params:,} params at {at}")
    tokens = rollout.max_num_batched_tokens
    h, d = arch.hidden_size, arch.head_dim
    # vLLM's MLP intermediate per token: f (dense), or k routed experts' f_e plus the shared expert's
    f = arch.moe_topk * arch.moe_ffn_hidden_size + arch.shared_expert_ffn_hidden_size if arch.is_moe \
        else arch.ffn_hidden_size
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * d if not arch.is_mla else \
        arch.num_heads * (2 * d + arch.v_head_dim)  # MLA: the expanded queries, keys and values of a prefill
    act_reserve = (2 * tokens * (qkv + 3 * f + 3 * h) / layout.gen_tp
                   + 2 * 4 * rollout.max_num_seqs * arch.vocab_size)
    vllm_act = Term("vLLM profiling activations", act_reserve,
                    f"2 B × {tokens} tokens × ((a+2k)·d + 3f + 3h)/tg + 2 × 4 B × {rollout.max_num_seqs} seqs × "
                    f"vocab")
    kv_per_token = kv_cache_bytes_per_token(arch, layout.gen_tp)
    if rollout.kv_cache_bytes is not None:
        kv = float(rollout.kv_cache_bytes)
        vllm_terms = [vllm_weights, vllm_act, Term("vLLM KV cache", kv, "rollout.kv_cache_memory_bytes")]
    else:
        if gpu_mem_bytes is None:
            raise PlanningError("rollout: give the GPU memory or an explicit KV-cache budget to size the KV cache")
        share = rollout.gpu_memory_utilization * gpu_mem_bytes
        kv = share - gen_bytes - act_reserve
        vllm_terms = [vllm_weights, vllm_act,
                      Term("vLLM KV cache", kv, f"{rollout.gpu_memory_utilization} × {_fmt_bytes(gpu_mem_bytes)} − "
                                                f"weights − profiling activations")]

    phases: dict[str, Phase] = {}
    worst: dict[str, int] = {}

    def pick(name: str, candidates: list[tuple[int, Phase]]) -> None:
        stage, phase = max(candidates, key=lambda sp: sp[1].total)
        phases[name], worst[name] = phase, stage

    stages = sorted({0, layout.pp - 1})  # embedding / most activations on the first, logits on the last

    def idle(others: list[RoleSpec], stage: int, *, keep: str | None = None) -> list[Term]:
        out: list[Term] = []
        for r in others:
            out += _resident_terms(r, _stage_state(arch, layout, r, stage), layout, dt, keep_params=r.name == keep)
        return out

    # Training: each trainable role in turn, the others idle, vLLM asleep.
    train_candidates = []
    for role in (r for r in roles if r.trainable):
        for stage in stages:
            sp = _stage_state(arch, layout, role, stage)
            params = sp.total
            state = [Term(f"{role.name} {t.name}", t.bytes, t.formula) for t in _state_terms(sp, layout, dt)]
            acts = [Term(f"{role.name} {t.name}", t.bytes, t.formula)
                    for t in activation_terms(arch, layout, work, stage, value_head=role.value_head)]
            params = params if sp.adapters is None else sp.adapters  # LoRA: the optimizer steps the adapters
            step_tmp = 4 * (params if work.backend == "nccl" else sp.largest) / (layout.dp // layout.dp_islands)
            transient = Term(f"{role.name} optimizer step temporaries", step_tmp,
                             f"4 B × {'P' if work.backend == 'nccl' else 'largest param'}/"
                             f"{'dp' if layout.dp_islands == 1 else '(dp/islands)'} (AdamW "
                             f"{'foreach' if work.backend == 'nccl' else 'single-tensor'})")
            if work.backend == "gloo":
                copy = Term(f"{role.name} gloo grad flatten copy", 4 * params / (layout.vpp or 1),
                            "4 B × P / vpp (coalesced reduce-scatter of one chunk's grad buffer)")
                transient = max(transient, copy, key=lambda term: term.bytes)
            act_total = sum(t.bytes for t in acts)
            peak_terms = acts if act_total >= transient.bytes else [transient]
            others = [r for r in roles if r is not role]
            vllm_idle = [] if rollout.free_cache_engine else vllm_terms
            note = "activations peak" if act_total >= transient.bytes else "after backward: step transient peak"
            train_candidates.append((stage, Phase(f"train:{role.name}", tuple(state + peak_terms + idle(others, stage)
                                                                              + vllm_idle), note)))
    pick("train", train_candidates)

    # Scoring: frozen forward passes (ref log-probs, old log-probs, critic values).
    score_candidates = []
    for role in roles:
        for stage in stages:
            own = _resident_terms(role, _stage_state(arch, layout, role, stage), layout, dt, keep_params=True)
            fwd = forward_only_terms(arch, layout, work, value_head=role.value_head)
            if stage != layout.pp - 1:
                fwd = fwd[:1]
            fwd = [Term(f"{role.name} {t.name}", t.bytes, t.formula) for t in fwd]
            others = [r for r in roles if r is not role]
            score_candidates.append((stage, Phase(f"score:{role.name}", tuple(own + fwd + idle(others, stage)))))
    pick("score", score_candidates)

    # Train → generate transition: vLLM weights woken, the actor's shards still on the GPU, one layer in flight.
    layer_block = 2 * max(generation_layer_params(arch, layout.gen_tp, layout.gen_ep, i)
                          for i in {0, *arch.moe_layers[:1]})
    reshard_candidates = []
    for stage in stages:
        actor = roles[0]
        keep = idle([actor], stage, keep="actor")
        buf = Term("reshard buffers", (layout.pp + 1) * layer_block,
                   f"(pp + 1) × one layer at tg ({_fmt_bytes(layer_block)}): micro-DP gather + PP exchange")
        reshard_candidates.append((stage, Phase("reshard", tuple(keep + idle(list(roles[1:]), stage)
                                                                 + [vllm_weights, buf]))))
    pick("reshard", reshard_candidates)

    # Rollout: vLLM awake with its KV cache, every role idle.
    rollout_candidates = [(stage, Phase("rollout", tuple(idle(list(roles), stage) + vllm_terms)))
                          for stage in stages]
    pick("rollout", rollout_candidates)

    host = 0.0
    for role in (r for r in roles if r.trainable or r.lora is None):
        sp = max((_stage_state(arch, layout, role, s) for s in stages), key=lambda x: x.total)
        for term in _state_terms(sp, layout, dt)[: 3 if role.trainable else 1]:
            kind = term.name.split(" ")[0]
            if getattr(role, f"offload_{kind}", False):
                host += term.bytes
    resharded = reshard_bytes(arch, layout)
    notes = [f"3D-HybridEngine: {layout.dims()}, {layout.num_engines} vLLM engines, micro-DP {layout.micro_dp}"]
    extra_peak = layout.generation_weight_bytes(model_bytes)
    if arch.is_moe or arch.is_mla:
        extra_peak = arch.generation_weight_bytes(layout.gen_tp, layout.gen_ep, 2)
        share = f"M/tg with the experts over gen_ep={layout.gen_ep}" if layout.gen_ep > 1 else "M/tg"
        notes.append(f"reshard bytes per GPU (worst rank) = Table 2 on the non-expert tensors + replicated tensors of "
                     f"other stages + expert rows of the rank's generation slice it lacks = {_fmt_bytes(resharded)}; "
                     f"extra peak {share} = {_fmt_bytes(extra_peak)}")
    else:
        notes.append(f"reshard bytes per GPU = (t·p − tg)/(tg·t·p)·M = ({layout.tp}·{layout.pp} − {layout.gen_tp})/"
                     f"({layout.gen_tp}·{layout.tp}·{layout.pp}) × {_fmt_bytes(model_bytes)} = "
                     f"{_fmt_bytes(resharded)}; extra peak M/tg = "
                     f"{_fmt_bytes(layout.generation_weight_bytes(model_bytes))}")
    comm = moe_comm_terms(arch, layout, work)
    notes += [f"communication per actor step: {t.line()}" for t in comm]
    if kv < kv_per_token * work.seq_len:
        notes.append(f"vLLM KV cache {_fmt_bytes(kv)} cannot hold one {work.seq_len}-token sequence")
    return MemoryPrediction(layout=layout, phases=phases, worst_stage=worst, kv_cache_bytes=kv,
                            kv_bytes_per_token=kv_per_token,
                            reshard_bytes_per_gpu=resharded,
                            reshard_extra_peak_bytes=extra_peak,
                            host_offload_bytes=host, notes=tuple(notes), comm=tuple(comm))
