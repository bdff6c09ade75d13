"""Plan a job before the cluster exists: rank training/generation layouts by predicted per-GPU memory and step time.

    python tools/plan.py --model CONFIG.json --gpus N --gpus-per-node G --gpu-mem-gb M [--topo F]
                         [--config RECIPE.yaml [--set key=value ...]]
                         [--tp T --pp P --vpp V --gen-tp G --gen-ep G --ep E --etp T] [--micro-batch B --seq-len S
                         --recompute R]
                         [--global-batch N] [--step-samples N --response-len R --n N]
                         [--offload params,grads,optimizer] [--lora-rank R [--lora-targets T,...]]
                         [--explain] [--json] [--dry-run [--rank R ...]]

Memory is in GiB (2^30 bytes) per GPU, times in seconds per RL step. --json prints one JSON object whose ``plans``
list is ranked best first; each plan has ``tp``, ``pp``, ``vpp``, ``dp``, ``gen_tp``, ``gen_ep``, ``memory_gb`` and
``time_s`` per phase (``train``, ``rollout``, ``reshard``, ``score``), ``step_time_s``, ``reshard_bytes_per_gpu``
and the breakdown. A recipe with ``parallel.layout: auto`` is planned unpinned, and ``auto_choice`` (the JSON) or
the last line (text) names the layout a run of it would take. --dry-run checks the group arithmetic of every
rank of the placement (the recipe's ``placement:`` pools, or the best plan as one pool), then builds the process
groups and the meta-device model of ranks R (default: one rank of every pipeline stage of every pool) in this one
process.
See docs/planning.md for the formulas and the cost model.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

from verl_mega.models.hf_config import arch_from_hf, load_hf_config  # noqa: E402
from verl_mega.planning.memory import GiB, RolloutSpec, Workload, default_roles  # noqa: E402
from verl_mega.planning.params import PlanningError  # noqa: E402
from verl_mega.planning.plan import Cluster, Pins, plan_layouts  # noqa: E402
from verl_mega.planning.timing import H200, StepShape  # noqa: E402


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        print(f"error: {message}; see --help", file=sys.stderr)
        raise SystemExit(2)


def _positive(kind=int, *, zero_ok: bool = False):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"{text!r} must be {'>= 0' if zero_ok else '> 0'}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = _OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF config.json (or a model directory holding one, or a hub ID); "
                                                  "with --config it replaces the recipe's model.path")
    ap.add_argument("--config", default=None, help="a training recipe (YAML): its layout, batch sizes, sequence "
                                                   "lengths, offload and rollout settings replace the flags below")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override of --config")
    ap.add_argument("--gpus", type=_positive(), required=True, help="total GPUs")
    ap.add_argument("--gpus-per-node", type=_positive(), default=8)
    ap.add_argument("--gpu-mem-gb", type=_positive(float), default=80.0, help="memory per GPU, GiB")
    ap.add_argument("--reserve-gb", type=_positive(float, zero_ok=True), default=2.0,
                    help="per-GPU memory kept free (CUDA context, NCCL, fragmentation), GiB")
    ap.add_argument("--topo", default=None, help="saved `nvidia-smi topo -m` of one node (NVLink islands)")
    ap.add_argument("--dp-hierarchy", choices=("off", "node", "island"), default="off",
                    help="data-parallel sync inside nodes / NVLink islands, shards all-reduced across (as "
                         "parallel.dp_hierarchy; island needs --topo)")
    ap.add_argument("--dp-cross-island-dtype", choices=("fp32", "bf16", "fp8"), default="fp32",
                    help="wire format between islands (as parallel.dp_cross_island_dtype)")
    ap.add_argument("--inter-node-gbps", type=_positive(float), default=None,
                    help="GB/s per GPU between nodes (default: the H200 constants' 40, one 400 Gb/s NIC per GPU)")
    for name in ("tp", "pp", "gen-tp", "ep", "etp", "gen-ep"):
        ap.add_argument(f"--{name}", type=_positive(), default=None, help=f"pin {name} (default: enumerate; ep, etp "
                                                                          f"and gen-ep for MoE models)")
    ap.add_argument("--vpp", type=_positive(), default=None, help="pin virtual pipeline stages (1 = no interleaving)")
    ap.add_argument("--micro-batch", type=_positive(), default=1, help="samples per micro-batch per GPU")
    ap.add_argument("--seq-len", type=_positive(), default=4096, help="prompt + response tokens")
    ap.add_argument("--global-batch", type=_positive(), default=1024, help="samples per optimizer step")
    ap.add_argument("--step-samples", type=_positive(), default=None, help="samples per RL step (default: "
                                                                           "--global-batch)")
    ap.add_argument("--response-len", type=_positive(), default=None, help="generated tokens per sample, out of "
                                                                           "--seq-len (default: half of it)")
    ap.add_argument("--n", type=_positive(), default=1, help="samples per prompt (prefilled once)")
    ap.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                    help="pin activation recompute (default: try none and full)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--entropy", action="store_true", help="the actor loss computes the entropy")
    ap.add_argument("--no-sequence-parallel", action="store_true", help="disable SP (on by default when tp > 1)")
    ap.add_argument("--no-critic", action="store_true", help="no critic (GRPO/RLOO/...)")
    ap.add_argument("--no-ref", action="store_true", help="no reference policy (no KL)")
    ap.add_argument("--offload", default="", help="comma list of params,grads,optimizer moved to the host while "
                                                  "actor/critic are idle")
    ap.add_argument("--offload-ref", action="store_true", help="keep reference weights on the host between uses")
    ap.add_argument("--lora-rank", type=_positive(int, zero_ok=True), default=0,
                    help="LoRA adapters of this rank (as model.lora.rank): the base frozen, the reference its base")
    ap.add_argument("--lora-targets", default="all-linear", help="comma list of HF projections (as "
                                                                "model.lora.target_modules)")
    ap.add_argument("--gpu-memory-utilization", type=_positive(float), default=0.5, help="vLLM's share of GPU memory")
    ap.add_argument("--kv-cache-gb", type=_positive(float), default=None, help="explicit vLLM KV budget, GiB")
    ap.add_argument("--max-num-seqs", type=_positive(), default=256)
    ap.add_argument("--max-num-batched-tokens", type=_positive(), default=8192)
    ap.add_argument("--top", type=_positive(), default=10, help="plans to print (text mode)")
    ap.add_argument("--explain", action="store_true", help="print the arithmetic of the best plan")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--dry-run", action="store_true", help="check every rank's groups; build groups + meta model "
                                                          "for --rank")
    ap.add_argument("--rank", type=int, nargs="+", default=None, help="ranks for --dry-run (default: one per "
                                                                      "pipeline stage of every pool)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = None
        if args.config:
            from verl_mega.config import load_config

            cfg = load_config(args.config, args.set, check_paths=False)
        elif args.set:
            raise PlanningError("--set needs --config")
        model = args.model or (cfg.model.path if cfg is not None else None)
        if model is None:
            raise PlanningError("--model is required (or a --config whose model.path holds config.json)")
        from verl_mega.config.hub import resolve_model_config

        # a hub ID (the 7B recipes name one): its config.json alone, fetched into the Hugging Face cache
        arch = arch_from_hf(load_hf_config(resolve_model_config("--model" if args.model else "model.path", model)))
        topology = None
        if args.topo:
            from verl_mega.parallel.topology import parse_topology

            topology = parse_topology(Path(args.topo).read_text())
        hardware = H200 if args.inter_node_gbps is None else replace(
            H200, name=f"H200, {args.inter_node_gbps:g} GB/s per GPU between nodes",
            inter_node_gbps=args.inter_node_gbps)
        cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu_mem_gib=args.gpu_mem_gb,
                          reserve_gib=args.reserve_gb, topology=topology, hardware=hardware)
        work = Workload(micro_batch=args.micro_batch, seq_len=args.seq_len, dtype=args.dtype, entropy=args.entropy)
        offload = tuple(x for x in args.offload.split(",") if x)
        lora = None
        if args.lora_rank:
            from verl_mega.models.lora import LoRASpec, resolve_targets

            lora = LoRASpec(rank=args.lora_rank, alpha=float(args.lora_rank),
                            targets=resolve_targets(tuple(args.lora_targets.split(","))))
        roles = default_roles(critic=not args.no_critic, ref=not args.no_ref, offload=offload,
                              offload_ref=args.offload_ref, lora=lora)
        rollout = RolloutSpec(gpu_memory_utilization=args.gpu_memory_utilization,
                              kv_cache_bytes=args.kv_cache_gb * GiB if args.kv_cache_gb else None,
                              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
        pins = Pins(tp=args.tp, pp=args.pp, vpp=args.vpp, gen_tp=args.gen_tp, recompute=args.recompute,
                    ep=args.ep, etp=args.etp, gen_ep=args.gen_ep)
        global_batch, sequence_parallel = args.global_batch, not args.no_sequence_parallel
        islands = dict(dp_hierarchy=args.dp_hierarchy, cross_island_dtype=args.dp_cross_island_dtype)
        response = args.response_len or max(1, work.seq_len - work.seq_len // 2)
        if response >= work.seq_len:
            raise PlanningError(f"--response-len={response} must be below --seq-len={work.seq_len}")
        step = StepShape(samples=args.step_samples or global_batch, prompt_len=work.seq_len - response,
                         response_len=response, n=args.n)
        placement, auto = None, None
        if cfg is not None:
            from verl_mega.models.hf_config import check_arch_layout
            from verl_mega.parallel.placement import Placement
            from verl_mega.planning.plan import inputs_from_config

            if cfg.parallel.layout == "auto":  # what a run would choose: the same planner, unpinned
                from verl_mega.planning.auto import choose_layout

                auto = choose_layout(cfg, arch, cluster)
                placement = Placement.from_config(auto.cfg, cluster.gpus)
                given = inputs_from_config(cfg, None)
            else:  # the recipe's own runtime checks for this world size (batch splits, layout vs model shape)
                placement = Placement.from_config(cfg, cluster.gpus)
                cfg.validate_runtime(placement, cuda_available=True)
                check_arch_layout(placement.pool_of("actor"), arch)
                given = inputs_from_config(cfg, placement)
            if len(placement.pools) > 1:  # layouts are ranked for the actor's pool
                cluster = Cluster(gpus=placement.pool_of("actor").size, gpus_per_node=args.gpus_per_node,
                                  gpu_mem_gib=args.gpu_mem_gb, reserve_gib=args.reserve_gb, topology=topology,
                                  hardware=hardware)
            pins, work, roles, rollout = given.pins, given.workload, given.roles, given.rollout
            global_batch, sequence_parallel, step = given.global_batch, given.sequence_parallel, given.step
            islands = dict(dp_hierarchy=given.dp_hierarchy, cross_island_dtype=given.cross_island_dtype)
        if auto is not None:
            plans, rejected = auto.plans, auto.rejected
        else:
            plans, rejected = plan_layouts(arch, cluster, work, global_batch=global_batch, roles=roles,
                                           rollout=rollout, pins=pins, sequence_parallel=sequence_parallel,
                                           step=step, **islands)
        if not plans:
            reason = rejected[0].reason if rejected else "no tp/pp combination divides the cluster"
            raise PlanningError(f"no feasible layout (first reason: {reason}); relax the pinned flags")
        reports, sample_path = {}, None
        if args.dry_run:
            from verl_mega.parallel.placement import Placement
            from verl_mega.planning.dry_run import dry_run, sample_path_report

            if auto is None and (placement is None or len(placement.pools) == 1):
                best = plans[0].layout
                placement = Placement.single(cluster.gpus, tp=best.tp, pp=best.pp, vpp=best.vpp, gen_tp=best.gen_tp,
                                             ep=best.ep, etp=best.etp, gen_ep=best.gen_ep,
                                             sequence_parallel=best.sequence_parallel)
            placement = placement.with_dp_hierarchy(  # the run's data-parallel islands, as the planner cut them
                islands["dp_hierarchy"], cluster.dp_island_ranks(islands["dp_hierarchy"]),
                islands["cross_island_dtype"])
            reports["dry_run"] = dry_run(arch, placement, ranks=args.rank, dtype=work.dtype)
            if cfg is not None:  # one step's rows as the recipe makes them, else the flags' global batch
                rows, n = cfg.data.train_batch_size * cfg.rollout.n, cfg.rollout.n
                cap, prompt = cfg.rollout.max_response_length, cfg.data.max_prompt_length
            else:
                rows, n, cap, prompt = global_batch, 1, work.seq_len // 2, work.seq_len // 2
            sample_path = sample_path_report(placement, samples_per_rank=rows // placement.pool_of("actor").dp,
                                             n=n, max_response_length=cap, prompt_length=prompt)
            if any(r.value_head for r in roles):  # the critic's stage differs by its value head
                critic_pool = placement.pool_of("critic")
                critic = [r for r in reports["dry_run"] if placement.pool_of_rank(r.rank) is critic_pool]
                reports["dry_run_critic"] = dry_run(arch, placement, ranks=[r.rank for r in critic], dtype=work.dtype,
                                                    value_head=True)
    except (OSError, ValueError) as exc:  # PlanningError, ModelConfigError, PlacementError, TopologyParseError
        print(f"error: {exc}", file=sys.stderr)
        return 2

    name = Path(model).stem if Path(model).is_file() else Path(model).name
    if args.json:
        out = {"model": {"name": name, "params": arch.num_parameters(), "layers": arch.num_layers,
                         "hidden": arch.hidden_size, "heads": arch.num_heads, "kv_heads": arch.num_kv_heads},
               "cluster": {"gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node,
                           "gpu_mem_gb": cluster.gpu_mem_gib, "reserve_gb": cluster.reserve_gib},
               "workload": {"micro_batch": work.micro_batch, "seq_len": work.seq_len, "dtype": work.dtype,
                            "global_batch": global_batch, "roles": [r.name for r in roles],
                            "step_samples": step.samples, "prompt_len": step.prompt_len,
                            "response_len": step.response_len, "n": step.n, "ppo_epochs": step.ppo_epochs},
               "hardware": dict(cluster.hardware.__dict__),
               "units": "memory in GiB (2^30 bytes) per GPU; times in seconds per RL step; bytes are bytes",
               "plans": [p.to_json(i + 1) for i, p in enumerate(plans)],
               "rejected": [r.to_json() for r in rejected]}
        if auto is not None:
            out["auto_choice"] = auto.plan.to_json(plans.index(auto.plan) + 1)
        out.update({key: [rep.to_json() for rep in reps] for key, reps in reports.items()})
        if reports:
            out["sample_path"] = sample_path
        print(json.dumps(out))
        return 0

    fitting = sum(p.fits for p in plans)
    print(f"{name}: {arch.num_parameters() / 1e9:.2f} B params, {arch.num_layers} layers, h={arch.hidden_size}, "
          f"heads {arch.num_heads}/{arch.num_kv_heads} kv; {cluster.gpus} GPUs ({cluster.gpus_per_node}/node, "
          f"{cluster.gpu_mem_gib:g} GiB); micro-batch {work.micro_batch} × {work.seq_len} tokens, global batch "
          f"{global_batch}, roles {'+'.join(r.name for r in roles)}; RL step {step.samples} samples of "
          f"{step.prompt_len} + {step.response_len} tokens; step-time constants: {cluster.hardware.name}")
    print(f"{len(plans)} layouts evaluated (each with its best gen_tp/gen_ep), {fitting} fit; {len(rejected)} "
          f"rejected. Best first:")
    for i, plan in enumerate(plans[: args.top]):
        print(f"{i + 1:>3}. {plan.headline()}")
    if auto is not None:
        print(f"parallel.layout=auto takes #{plans.index(auto.plan) + 1}: {auto.plan.layout.dims()} "
              f"recompute={auto.plan.recompute}")
    if args.explain:
        print("\nArithmetic of the best plan:")
        print("\n".join(plans[0].explain(cluster)))
        if rejected:
            reasons: dict[str, int] = {}
            for r in rejected:
                key = r.reason.split(" (")[0]
                reasons[key] = reasons.get(key, 0) + 1
            print("\nRejected layouts:")
            for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1]):
                print(f"  {count:>4} × {reason}")
    for key, reps in reports.items():
        for rep in reps:
            print(f"\n{'critic ' if key.endswith('critic') else ''}" + "\n".join(rep.lines()))
    if reports:
        sp, mb = sample_path, 1 / 2**20
        print(f"\nsample path (rollout -> train, one step): {sp['rows']} rows ({sp['samples_per_rank']} per "
              f"data-parallel rank), response lengths lognormal with mean {sp['mean_response_length']:.0f}, capped at "
              f"{sp['max_response_length']}: each rank receives at most {sp['max_bytes_received'] * mb:.2f} MiB "
              f"(gather-everything: {sp['gather_bytes_received'] * mb:.2f} MiB) and sends at most "
              f"{sp['max_bytes_sent'] * mb:.2f} MiB; metadata all-reduce {sp['metadata_bytes'] / 1024:.1f} KiB; "
              f"token imbalance {100 * sp['token_imbalance']:.1f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
