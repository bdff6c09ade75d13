"""Dry run of one rank of a large world in one process: every process group and the rank's model, no communication.

torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``: a ``FakeProcessGroup`` that completes
every collective without moving data) lets one process claim to be rank R of a world of N. On it we run
Megatron-Core's own ``parallel_state.initialize_model_parallel`` (which calls ``dist.new_group`` for every group of
the world, exactly as on the cluster; gloo side groups are off because the fake backend has no gloo twin), then
create the 3D-HybridEngine generation-TP and micro-DP groups the same way, and build the rank's pipeline stage of
the model on the meta device (shapes only, no memory). Then we check, for this rank:

* mcore's TP / PP / DP groups equal the layout arithmetic of :class:`~verl_mega.hybrid.layout.HybridLayout`;
* the generation TP group lies inside the training TP group, is strided by t/tg and ascending (``new_group``
  sorts members), and meets the micro-DP group in this rank only;
* the meta model holds exactly the parameters the memory model predicts for this stage, and the layer offsets of
  its (virtual) chunks are the ones Megatron assigns.

A mismatch raises :class:`DryRunError` naming the group or tensor count.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from verl_mega.models.hf_config import ModelArch
from verl_mega.parallel.state import new_groups
from verl_mega.planning.memory import Layout, PlanningError, stage_params

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class DryRunError(PlanningError):
    """The groups or model built for a rank differ from the plan; the message names which."""


def expected_rank_groups(layout: Layout, rank: int) -> dict[str, tuple[int, ...]]:
    """This rank's groups by pure arithmetic (Megatron order tp-dp-pp; HybridFlow §5 for generation groups)."""
    hybrid = layout.hybrid()
    plan = hybrid.rank_plan(rank)
    dp_group = tuple(hybrid.rank_of(d, plan.pp_rank, plan.tp_rank) for d in range(layout.dp))
    return {"tp": plan.train_tp_group, "pp": plan.pp_group, "dp": dp_group, "gen_tp": plan.gen_tp_group,
            "micro_dp": plan.micro_dp_group}


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Make this process rank `rank` of `world_size` over torch's fake backend; tears everything down after."""
    from megatron.core import parallel_state as mpu
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if not 0 <= rank < world_size:
        raise DryRunError(f"dry run: --rank {rank} is outside the world of {world_size} ranks")
    if dist.is_initialized():
        raise DryRunError("dry run: torch.distributed is already initialised in this process; run the dry run in "
                          "a fresh process (e.g. tools/plan.py --dry-run)")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if mpu.model_parallel_is_initialized():
            mpu.destroy_model_parallel()
        dist.destroy_process_group()


@dataclass
class DryRunReport:
    world_size: int
    rank: int
    layout: Layout
    stage: int
    groups: dict[str, tuple[int, ...]]
    new_group_calls: int  # groups built world-wide (every rank calls new_group for every group)
    member_of: int  # of those, the groups this rank belongs to
    seconds_groups: float
    seconds_model: float = 0.0
    params_on_rank: int | None = None
    predicted_params: int | None = None
    chunk_layer_offsets: list[int] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "layout": self.layout.describe(),
                "pp_stage": self.stage, "groups": {k: list(v) for k, v in self.groups.items()},
                "new_group_calls": self.new_group_calls,
                "member_of": self.member_of, "seconds_groups": round(self.seconds_groups, 3),
                "seconds_model": round(self.seconds_model, 3), "params_on_rank": self.params_on_rank,
                "predicted_params": self.predicted_params, "chunk_layer_offsets": self.chunk_layer_offsets,
                "checks": self.checks}

    def lines(self) -> list[str]:
        def short(ranks: tuple[int, ...]) -> str:
            if len(ranks) <= 12:
                return str(list(ranks))
            return f"[{ranks[0]}, {ranks[1]}, …, {ranks[-1]}] ({len(ranks)})"

        out = [f"dry run: rank {self.rank} of {self.world_size} ({self.layout.describe()}), pipeline stage "
               f"{self.stage}: {self.new_group_calls} process groups built ({self.member_of} with this rank) in "
               f"{self.seconds_groups:.2f} s, meta model in "
               f"{self.seconds_model:.2f} s"]
        out += [f"  {name:<9} {short(ranks)}" for name, ranks in self.groups.items()]
        if self.params_on_rank is not None:
            out.append(f"  params on this rank: {self.params_on_rank:,} (memory model: {self.predicted_params:,}); "
                       f"chunk layer offsets {self.chunk_layer_offsets}")
        out += [f"  ok: {c}" for c in self.checks]
        return out


@contextlib.contextmanager
def _count_new_group_calls() -> Iterator[list[int]]:
    """Count torch.distributed.new_group calls (mcore's and ours) while active."""
    calls = [0]
    original = dist.new_group

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    dist.new_group = counting
    try:
        yield calls
    finally:
        dist.new_group = original


def _group_ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def _expect(label: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if actual != expected:
        raise DryRunError(f"dry run: {label} group {list(actual)[:16]} differs from the plan's {list(expected)[:16]}; "
                          f"the layout arithmetic and megatron.core.parallel_state disagree")


def dry_run(arch: ModelArch, layout: Layout, *, rank: int, build_model: bool = True, value_head: bool = False,
            dtype: str = "bf16") -> DryRunReport:
    """Build every process group and this rank's meta model for rank `rank` of `layout.world` ranks; check them."""
    from megatron.core import parallel_state as mpu

    from verl_mega.parallel.cpu_mode import enable_cpu_mode

    if dtype not in _DTYPES:
        raise DryRunError(f"dry run: dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    hybrid = layout.hybrid(arch)  # raises LayoutError for impossible generation layouts
    plan = hybrid.rank_plan(rank) if 0 <= rank < layout.world else None
    expected = expected_rank_groups(layout, rank) if plan else {}
    enable_cpu_mode()  # mcore's CUDA calls (RoPE tables, RNG) land on the CPU when there is no GPU
    with fake_world(rank, layout.world):
        start = time.perf_counter()
        before = len(dist.distributed_c10d._world.pg_names)
        with _count_new_group_calls() as calls:
            mpu.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                          virtual_pipeline_model_parallel_size=layout.vpp,
                                          create_gloo_process_groups=False)
            gen_group = new_groups(hybrid.gen_tp_groups, plan.gen_tp_group) if layout.tg > 1 else None
            micro_group = new_groups(hybrid.micro_dp_groups, plan.micro_dp_group) if hybrid.micro_dp > 1 else None
        seconds_groups = time.perf_counter() - start
        member_of = len(dist.distributed_c10d._world.pg_names) - before
        actual = {"tp": _group_ranks(mpu.get_tensor_model_parallel_group()),
                  "pp": _group_ranks(mpu.get_pipeline_model_parallel_group()),
                  "dp": _group_ranks(mpu.get_data_parallel_group()),
                  "gen_tp": _group_ranks(gen_group) if gen_group is not None else (rank,),
                  "micro_dp": _group_ranks(micro_group) if micro_group is not None else (rank,)}
        report = DryRunReport(world_size=layout.world, rank=rank, layout=layout, stage=plan.pp_rank,
                              groups=actual, new_group_calls=calls[0], member_of=member_of,
                              seconds_groups=seconds_groups)
        for name in ("tp", "pp", "dp", "gen_tp", "micro_dp"):
            _expect(name, actual[name], expected[name])
        report.checks.append("mcore TP/PP/DP groups and 3D-HybridEngine groups equal the layout arithmetic")
        _check_generation_groups(layout, rank, actual)
        report.checks.append(f"generation TP group ⊂ training TP group, stride t/tg={hybrid.micro_dp}, ascending; "
                             f"∩ micro-DP group = {{{rank}}}")
        if mpu.get_pipeline_model_parallel_rank() != plan.pp_rank or \
                mpu.get_tensor_model_parallel_rank() != plan.tp_rank or mpu.get_data_parallel_rank() != plan.dp_rank:
            raise DryRunError("dry run: mcore's (tp, pp, dp) ranks of this process differ from the layout's")
        if build_model:
            _build_meta_model(arch, layout, plan.pp_rank, report, value_head=value_head, dtype=dtype)
    return report


def _check_generation_groups(layout: Layout, rank: int, groups: dict[str, tuple[int, ...]]) -> None:
    gen, tp, micro = groups["gen_tp"], groups["tp"], groups["micro_dp"]
    stride = layout.tp // layout.tg
    if not set(gen) <= set(tp) or len(gen) != layout.tg:
        raise DryRunError(f"dry run: generation TP group {list(gen)} is not {layout.tg} ranks of the training TP "
                          f"group {list(tp)}")
    if list(gen) != sorted(gen) or any(b - a != stride for a, b in zip(gen, gen[1:])):
        raise DryRunError(f"dry run: generation TP group {list(gen)} is not ascending with stride {stride}")
    if set(gen) & set(micro) != {rank}:
        raise DryRunError(f"dry run: generation TP group {list(gen)} and micro-DP group {list(micro)} must share "
                          f"exactly rank {rank}")


def _build_meta_model(arch: ModelArch, layout: Layout, stage: int, report: DryRunReport, *, value_head: bool,
                      dtype: str) -> None:
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import transformer_config

    start = time.perf_counter()
    cfg = transformer_config(arch, tp=layout.tp, pp=layout.pp, vpp=layout.vpp,
                             sequence_parallel=bool(layout.sequence_parallel), dtype=_DTYPES[dtype],
                             use_cpu_initialization=True, perform_initialization=False)
    with torch.device("meta"):
        chunks = build_model_chunks(arch, cfg, value_head=value_head, use_te="false")
    report.seconds_model = time.perf_counter() - start
    params = {id(p): p for c in chunks for p in c.parameters()}  # a tied weight counts once
    if any(p.device.type != "meta" for p in params.values()):
        raise DryRunError("dry run: a parameter was allocated outside the meta device")
    report.params_on_rank = sum(p.numel() for p in params.values())
    report.predicted_params = stage_params(arch, layout, stage, value_head=value_head).total
    if report.params_on_rank != report.predicted_params:
        raise DryRunError(f"dry run: stage {stage} holds {report.params_on_rank:,} parameters but the memory model "
                          f"predicts {report.predicted_params:,}; fix verl_mega/planning/memory.py")
    v = layout.vpp or 1
    per_chunk = arch.num_layers // (layout.pp * v)
    report.chunk_layer_offsets = [c.stage_layout.layer_offset for c in chunks]
    want = [(c * layout.pp + stage) * per_chunk for c in range(v)]
    if report.chunk_layer_offsets != want or any(c.stage_layout.num_layers != per_chunk for c in chunks):
        raise DryRunError(f"dry run: stage {stage} chunks start at layers {report.chunk_layer_offsets}, expected "
                          f"{want} with {per_chunk} layers each")
    report.checks.append(f"meta model of stage {stage}: {len(chunks)} chunk(s), parameter count equals the memory "
                         f"model")
