"""``parallel.layout: auto``: at launch, before anything is placed or built, the planner ranks every layout of the
world size for the run's model and workload (:func:`verl_mega.planning.plan.plan_layouts`: memory first, then
predicted step time) and the run takes the best one that fits and passes the config's batch checks."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
from pathlib import Path

from verl_mega.config.base import ConfigError
from verl_mega.models.hf_config import ModelArch, check_arch_layout
from verl_mega.parallel.placement import Placement
from verl_mega.planning.memory import GiB
from verl_mega.planning.plan import Cluster, Plan, Rejected, inputs_from_config, plan_layouts
from verl_mega.planning.timing import H200

log = logging.getLogger("verl_mega")

FIX = ("actor.offload_params/offload_grads/offload_optimizer=true, a lower rollout.gpu_memory_utilization or "
       "actor.micro_batch_size_per_gpu, or run on more GPUs")


@dataclasses.dataclass(frozen=True)
class AutoLayout:
    """The config with the chosen layout filled in (``parallel.layout=manual``), the plan it came from and every
    ranked plan."""

    cfg: object
    plan: Plan
    plans: list[Plan]
    rejected: list[Rejected]

    def summary(self, cluster: Cluster) -> str:
        plan, fitting = self.plan, sum(p.fits for p in self.plans)
        return (f"parallel.layout=auto chose {plan.layout.dims()} recompute={plan.recompute} (ranked first of "
                f"{fitting} fitting layouts on {cluster.gpus} GPUs of {cluster.gpu_mem_gib:.1f} GiB): predicted "
                f"{plan.time.summary()}, peak {plan.memory.peak / GiB:.1f} GiB per GPU")


def with_layout(cfg, plan: Plan):
    """`cfg` running `plan`'s layout: parallel.tp/pp/vpp/ep/etp/sequence_parallel and rollout.gen_tp/gen_ep."""
    lay = plan.layout
    parallel = dataclasses.replace(cfg.parallel, layout="manual", tp=lay.tp, pp=lay.pp, vpp=lay.vpp, cp=1, dp=None,
                                   ep=lay.ep, etp=None if lay.etp == lay.tp else lay.etp,
                                   sequence_parallel=lay.sequence_parallel)
    return dataclasses.replace(cfg, parallel=parallel, rollout=dataclasses.replace(cfg.rollout, gen_tp=lay.gen_tp,
                                                                                   gen_ep=lay.gen_ep))


def choose_layout(cfg, arch: ModelArch, cluster: Cluster) -> AutoLayout:
    """The planner's best fitting layout for `cfg` (a validated TrainConfig with ``parallel.layout=auto``) on
    `cluster`; a one-line :class:`ConfigError` naming the problem and the fix when none fits."""
    if cfg.placement.pools:
        raise ConfigError("parallel.layout=auto plans one colocated pool of every rank, but placement.pools is set; "
                          "set parallel.layout=manual, or unset the pools with placement=null (a rollout pool's "
                          "rollout.max_staleness then needs rollout.max_staleness=0)")
    given = inputs_from_config(cfg, None)
    plans, rejected = plan_layouts(arch, cluster, given.workload, global_batch=given.global_batch, roles=given.roles,
                                   rollout=given.rollout, pins=given.pins, sequence_parallel=given.sequence_parallel,
                                   step=given.step, dp_hierarchy=given.dp_hierarchy,
                                   cross_island_dtype=given.cross_island_dtype)
    name = f"a {arch.num_parameters() / 1e9:.2f} B-parameter {arch.model_type} model"
    where = f"{cluster.gpus} GPUs of {cluster.gpu_mem_gib:.1f} GiB"
    if not plans:
        reason = rejected[0].reason if rejected else "no tp·pp divides the GPU count"
        raise ConfigError(f"parallel.layout=auto: no layout of {where} suits {name} (first reason: {reason}); "
                          f"change the batch sizes or the number of GPUs")
    problems: list[str] = []
    for plan in plans:
        if not plan.fits:
            break
        candidate = with_layout(cfg, plan)
        try:  # the checks a run makes once the world size is known
            placement = Placement.from_config(candidate, cluster.gpus)
            candidate.validate_runtime(placement, cuda_available=True)
            check_arch_layout(placement.pool_of("actor"), arch)
        except ValueError as exc:
            problems.append(f"{plan.layout.dims()}: {exc}")
            continue
        return AutoLayout(candidate, plan, plans, rejected)
    if problems:
        raise ConfigError(f"parallel.layout=auto: every layout of {where} that fits {name} fails a batch check, "
                          f"first {problems[0]}")
    best = plans[0]
    raise ConfigError(f"parallel.layout=auto: no layout of {where} fits {name} with this workload; the closest, "
                      f"{best.layout.dims()} recompute={best.recompute}, needs {best.memory.peak / GiB:.1f} GiB per "
                      f"GPU ({'; '.join(best.over_budget)}); set "
                      f"{'model.recompute=full, ' if cfg.model.recompute != 'full' else ''}{FIX}")


def local_gpu(gpus_per_node: int) -> tuple[str, float]:
    """(name, memory in GiB) of this node's first visible GPU, read from ``nvidia-smi`` so that CUDA is not
    initialised before the topology scheduler picks each rank's device. On CPU (no CUDA build, or
    VERL_MEGA_FORCE_CPU=1) the host's memory shared by the node's ranks."""
    import torch

    if torch.version.cuda is None or os.environ.get("VERL_MEGA_FORCE_CPU", "0") == "1":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return "cpu", host / gpus_per_node / GiB
    if not shutil.which("nvidia-smi"):
        raise ConfigError("parallel.layout=auto reads the GPUs' memory with nvidia-smi, which is not on PATH; put it "
                          "on PATH or set parallel.layout=manual with a layout (tools/plan.py ranks them)")
    out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    rows = [line.rsplit(",", 1) for line in out.strip().splitlines() if "," in line]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    first = int(visible.split(",")[0]) if visible.split(",")[0].strip().isdigit() else 0
    name, mib = rows[min(first, len(rows) - 1)]
    return name.strip(), float(mib) / 1024


def resolve_auto_layout(cfg, arch: ModelArch, *, world_size: int, gpus_per_node: int, rank: int = 0,
                        gpu: tuple[str, float] | None = None):
    """`cfg` itself unless ``parallel.layout=auto``; then `cfg` with the planner's choice for `world_size` ranks of
    `gpus_per_node` per node on this node's GPUs (`gpu`: (name, GiB), default read from the node), logged once."""
    if cfg.parallel.layout != "auto":
        return cfg
    name, mem_gib = gpu or local_gpu(gpus_per_node)
    topology = None
    if cfg.parallel.topology_file:
        from verl_mega.parallel.topology import parse_topology

        topo = parse_topology(Path(cfg.parallel.topology_file).read_text())
        if topo.num_gpus >= gpus_per_node:
            topology = topo.subset(list(range(gpus_per_node)))
    cluster = Cluster(gpus=world_size, gpus_per_node=gpus_per_node, gpu_mem_gib=mem_gib, topology=topology,
                      hardware=H200)
    chosen = choose_layout(cfg, arch, cluster)
    if rank == 0:
        log.info("%s [%s; step-time constants of the %s]", chosen.summary(cluster), name, cluster.hardware.name)
    return chosen.cfg
