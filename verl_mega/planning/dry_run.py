"""Dry run of ranks of a large placement in one process: every process group and the rank's model, no communication.

torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``: a ``FakeProcessGroup`` that completes
every collective without moving data) lets one process claim to be rank R of a world of N. On it we build the
rank's groups exactly as a run does (:func:`verl_mega.parallel.state.build_groups`, the same code, from the same
:class:`~verl_mega.parallel.placement.Placement`) and, for a rank of a training pool, build its pipeline stage of
the model on the meta device (shapes only, no memory) with those groups. Then we check, for this rank:

* its dense groups (tp, cp, dp, pp) and expert groups (ep, etp, edp over Megatron's expert grid etp·ep·edp·pp)
  equal Megatron-Core's own enumeration of the pool (``HyperCommGrid`` with the pool's rank offset: an
  implementation independent of ours), and every group the run created has the members the placement names
  (whose generation groups ``Placement.check`` verified for every rank: inside the training TP group, strided
  by tp/gen_tp, ascending, meeting the micro-DP group in one rank; the expert-parallel generation groups whole
  engines, ascending, one generation layout per pipeline group);
* the meta model holds exactly the parameters the memory model predicts for this stage, and the layer offsets of
  its (virtual) chunks are the ones Megatron assigns.

Before any rank is built, ``Placement.check`` sweeps the group arithmetic of every rank of every pool.
A mismatch raises :class:`DryRunError` naming the group or tensor count.
"""

from __future__ import annotations

import math

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from verl_mega.models.hf_config import ModelArch
from verl_mega.parallel.placement import Placement, PlacementError
from verl_mega.planning.params import PlanningError, stage_params

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CHECKED_KINDS = ("tp", "cp", "dp", "pp", "dp_cp", "mp", "ep", "etp", "edp", "gen_tp", "micro_dp", "gen_ep")
ISLAND_GROUP_KINDS = ("intra_dp", "intra_edp", "inter_dp", "dist_opt")  # with data-parallel islands


class DryRunError(PlanningError):
    """The groups or model built for a rank differ from the plan; the message names which."""


@contextlib.contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """Make this process rank `rank` of `world_size` over torch's fake backend; tears everything down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if not 0 <= rank < world_size:
        raise DryRunError(f"dry run: --rank {rank} is outside the world of {world_size} ranks")
    if dist.is_initialized():
        raise DryRunError("dry run: torch.distributed is already initialised in this process; run the dry run in "
                          "a fresh process (e.g. tools/plan.py --dry-run)")
    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)  # mcore's HyperCommGrid reads it
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


@dataclass
class DryRunReport:
    world_size: int
    rank: int
    pool: str
    layout: str
    stage: int
    groups: dict[str, tuple[int, ...]]
    new_group_calls: int  # groups this rank created (each rank creates only the groups it belongs to)
    seconds_groups: float
    seconds_model: float = 0.0
    params_on_rank: int | None = None
    predicted_params: int | None = None
    chunk_layer_offsets: list[int] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "pool": self.pool, "layout": self.layout,
                "pp_stage": self.stage, "groups": {k: list(v) for k, v in self.groups.items()},
                "new_group_calls": self.new_group_calls, "seconds_groups": round(self.seconds_groups, 3),
                "seconds_model": round(self.seconds_model, 3), "params_on_rank": self.params_on_rank,
                "predicted_params": self.predicted_params, "chunk_layer_offsets": self.chunk_layer_offsets,
                "checks": self.checks}

    def lines(self) -> list[str]:
        def short(ranks: tuple[int, ...]) -> str:
            return str(list(ranks)) if len(ranks) <= 12 else f"[{ranks[0]}, {ranks[1]}, …, {ranks[-1]}] ({len(ranks)})"

        model = (f", pipeline stage {self.stage}, meta model in {self.seconds_model:.2f} s"
                 if self.params_on_rank is not None else "")
        out = [f"dry run: rank {self.rank} of {self.world_size}, pool {self.layout}: {self.new_group_calls} process "
               f"groups built in {self.seconds_groups:.2f} s{model}"]
        out += [f"  {name:<9} {short(ranks)}" for name, ranks in self.groups.items()]
        if self.params_on_rank is not None:
            out.append(f"  params on this rank: {self.params_on_rank:,} (memory model: {self.predicted_params:,}); "
                       f"chunk layer offsets {self.chunk_layer_offsets}")
        out += [f"  ok: {c}" for c in self.checks]
        return out


@contextlib.contextmanager
def _count_new_group_calls() -> Iterator[list[int]]:
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


def default_ranks(placement: Placement) -> list[int]:
    """One rank of every pipeline stage of every pool, plus each pool's last rank."""
    ranks = set()
    for pool in placement.pools:
        ranks |= set(pool.group_of("pp", pool.ranks[0])) | {pool.ranks[-1]}
    return sorted(ranks)


def dry_run(arch: ModelArch, placement: Placement, *, ranks: list[int] | None = None, build_model: bool = True,
            value_head: bool = False, dtype: str = "bf16") -> list[DryRunReport]:
    """Check the arithmetic of every rank, then build the groups (and meta model) of ``ranks``."""
    if dtype not in _DTYPES:
        raise DryRunError(f"dry run: dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    try:
        sweep = placement.check()
    except PlacementError as exc:
        raise DryRunError(f"dry run: {exc}") from None
    reports = [_dry_run_rank(arch, placement, r, build_model=build_model, value_head=value_head, dtype=dtype)
               for r in (default_ranks(placement) if ranks is None else ranks)]
    reports[0].checks.insert(0, f"group arithmetic of all {placement.world_size} ranks: " + "; ".join(sweep))
    return reports


def _dry_run_rank(arch: ModelArch, placement: Placement, rank: int, *, build_model: bool, value_head: bool,
                  dtype: str) -> DryRunReport:
    from verl_mega.parallel.cpu_mode import enable_cpu_mode
    from verl_mega.parallel.state import build_groups

    enable_cpu_mode()  # mcore's CUDA calls (RoPE tables, RNG) land on the CPU when there is no GPU
    with fake_world(rank, placement.world_size):
        pool = placement.pool_of_rank(rank)
        start = time.perf_counter()
        with _count_new_group_calls() as calls:
            groups = build_groups(placement, rank)
        kinds = CHECKED_KINDS + (ISLAND_GROUP_KINDS if pool.dp_islands > 1 else ())
        built = {kind: tuple(dist.get_process_group_ranks(groups[kind])) for kind in kinds}
        report = DryRunReport(world_size=placement.world_size, rank=rank, pool=pool.name, layout=pool.describe(),
                              stage=pool.coords(rank)["pp"], groups=built, new_group_calls=calls[0],
                              seconds_groups=time.perf_counter() - start)
        for kind, members in built.items():
            if members != pool.group_of(kind, rank):
                raise DryRunError(f"dry run: rank {rank}'s {kind} group {list(members)[:16]} differs from the "
                                  f"placement's {list(pool.group_of(kind, rank))[:16]}")
        _check_against_mcore(pool, rank, built)
        report.checks.append(f"{len(built)} group kinds built with the members the placement names; tp/cp/dp/pp "
                             f"and ep/etp/edp equal mcore's HyperCommGrid enumeration of pool {pool.name!r}")
        if build_model and pool.trains:
            _build_meta_model(arch, groups, report, value_head=value_head, dtype=dtype)
    return report


def _check_against_mcore(pool, rank: int, built: dict[str, tuple[int, ...]]) -> None:
    from megatron.core.hyper_comm_grid import HyperCommGrid

    if not pool.trains or list(pool.ranks) != list(range(pool.ranks[0], pool.ranks[0] + pool.size)):
        return
    grid = HyperCommGrid([pool.tp, pool.cp, pool.dp, pool.pp], ["tp", "cp", "dp", "pp"], rank_offset=pool.ranks[0])
    # Megatron's expert grid: the same ranks as (etp, ep, edp, pp), tp fastest (its "tp" is expert TP)
    experts = HyperCommGrid([pool.etp, pool.ep, pool.edp, pool.pp], ["tp", "ep", "dp", "pp"],
                            rank_offset=pool.ranks[0])
    for kind, on, dim in (("tp", grid, "tp"), ("cp", grid, "cp"), ("dp", grid, "dp"), ("pp", grid, "pp"),
                          ("ep", experts, "ep"), ("etp", experts, "tp"), ("edp", experts, "dp")):
        mine = [tuple(g) for g in on._gen_rank_enum([dim]) if rank in g]
        if mine != [built[kind]]:
            raise DryRunError(f"dry run: rank {rank}'s {kind} group {list(built[kind])[:16]} differs from mcore's "
                              f"{[list(g)[:16] for g in mine]}")


def _build_meta_model(arch: ModelArch, groups, report: DryRunReport, *, value_head: bool, dtype: str) -> None:
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import transformer_config

    pool, stage = groups.pool, report.stage
    start = time.perf_counter()
    cfg = transformer_config(arch, tp=pool.tp, pp=pool.pp, vpp=pool.vpp, cp=pool.cp, ep=pool.ep, etp=pool.etp,
                             sequence_parallel=pool.sequence_parallel, dtype=_DTYPES[dtype],
                             use_cpu_initialization=True, perform_initialization=False)
    with torch.device("meta"):
        chunks = build_model_chunks(arch, cfg, groups, value_head=value_head, use_te="false")
    report.seconds_model = time.perf_counter() - start
    params = {id(p): p for c in chunks for p in c.parameters()}  # a tied weight counts once
    if any(p.device.type != "meta" for p in params.values()):
        raise DryRunError("dry run: a parameter was allocated outside the meta device")
    report.params_on_rank = sum(p.numel() for p in params.values())
    report.predicted_params = stage_params(arch, pool, stage, value_head=value_head).total
    if report.params_on_rank != report.predicted_params:
        raise DryRunError(f"dry run: stage {stage} holds {report.params_on_rank:,} parameters but the memory model "
                          f"predicts {report.predicted_params:,}; fix verl_mega/planning/params.py")
    v = pool.vpp or 1
    per_chunk = arch.num_layers // (pool.pp * v)
    report.chunk_layer_offsets = [c.stage_layout.layer_offset for c in chunks]
    want = [(c * pool.pp + stage) * per_chunk for c in range(v)]
    if report.chunk_layer_offsets != want or any(c.stage_layout.num_layers != per_chunk for c in chunks):
        raise DryRunError(f"dry run: stage {stage} chunks start at layers {report.chunk_layer_offsets}, expected "
                          f"{want} with {per_chunk} layers each")
    report.checks.append(f"meta model of stage {stage}: {len(chunks)} chunk(s), parameter count equals the memory "
                         f"model")


def sample_path_report(placement: Placement, *, samples_per_rank: int, n: int, max_response_length: int,
                       prompt_length: int, mean_response_length: float | None = None, seed: int = 0) -> dict:
    """The rollout → train sample path of one step on ``placement``'s actor pool (verl_mega/parallel/rows.py):
    bytes each rank sends and receives for ``samples_per_rank`` × dp rows with long-tailed (lognormal, sigma 1,
    capped) response lengths, assigned and routed exactly as the trainer does, plus the metadata all-reduce."""
    import random

    import torch

    from verl_mega.parallel.rows import RowTable, assign_rows, imbalance, route_bytes, table_bytes

    pool = placement.pool_of("actor")
    rows = samples_per_rank * pool.dp
    if rows % n:
        raise DryRunError(f"dry run: {samples_per_rank} samples per data-parallel rank × dp={pool.dp} is not a "
                          f"multiple of rollout.n={n}")
    mean = mean_response_length or max_response_length / 4
    rng = random.Random(seed)
    mu = math.log(mean) - 0.5  # lognormal with sigma 1 has mean exp(mu + 1/2)
    lengths = torch.tensor([max(1, min(max_response_length, int(rng.lognormvariate(mu, 1.0)))) for _ in range(rows)])
    prompt = torch.arange(rows // n).repeat_interleave(n)
    engines = [tuple(g) for g in pool.groups("gen_tp")]
    prompts = rows // n
    engine = torch.tensor([e for e in range(len(engines)) for _ in range(n * ((e + 1) * prompts // len(engines)
                                                                             - e * prompts // len(engines)))])
    table = RowTable(prompt, lengths, torch.zeros_like(prompt), engine, masked=False)
    tokens = lengths + prompt_length
    owner = assign_rows(prompt, tokens, pool.dp, balance=True)
    ranks = list(pool.ranks)
    sent, received = route_bytes(table, owner, ranks=ranks, replica_of=[pool.coords(r)["dp"] for r in ranks],
                                 engines=engines)
    return {"world_size": placement.world_size, "dp": pool.dp, "rows": rows, "samples_per_rank": samples_per_rank,
            "mean_response_length": float(lengths.float().mean()), "max_response_length": max_response_length,
            "max_bytes_received": max(received), "max_bytes_sent": max(sent),
            "mean_bytes_received": sum(received) / len(ranks), "metadata_bytes": table_bytes(rows, len(engines)),
            "gather_bytes_received": sum(int(w) * 4 for w in table.words()),
            "token_imbalance": imbalance(owner, tokens, pool.dp)}
