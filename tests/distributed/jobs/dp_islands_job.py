"""torchrun job (4 ranks, tp=1, dp=4): one optimizer step of the same actor with flat data-parallel groups and with
data-parallel islands, the step between islands in fp32, bf16 and fp8.

    dp_islands_job.py OUT_DIR

The islands come from the recorded topology whose NVLink pairs are GPUs (0,2) and (1,3): with
parallel.dp_hierarchy=island the scheduler puts ranks 0,1 on one pair and ranks 2,3 on the other, so the two islands
play two nodes of two ranks. Every mode builds the tiny model from the same weights and takes one AdamW step on the
same global batch (8 rows, 2 per rank). The job records, independently of the code under test:

* every rank's gradient buffer as the sync receives it (before any reduction), whence the exact (float64) reduced
  gradient: the mean over the ranks;
* every collective that the gradient sync and the parameter all-gather issue: kind, group members, payload bytes
  (torch.distributed's functions and Megatron's module-level reduce-scatter / all-gather wrapped while they run);
* the reduced gradient every rank owns (gathered over the group that shards the optimizer) and the parameters after
  the step.

It asserts on every rank that the reduced gradients lie within the rounding bound of their wire format from the
float64 reference, that the islands end with identical gradients and parameters, and that each mode's parameters
differ from the flat mode's by no more than AdamW's first step makes of their gradients' difference. The island
mode (fp32) saves a checkpoint, which a flat actor resumes: its Adam state (assembled per HF-named tensor, as
optim_reshard_job.py does) must equal the saved one exactly. Rank 0 writes OUT_DIR/report.json (the bytes each
collective moves, per mode) and OUT_DIR/placement.json (the island mode's placement, as a run writes it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
TOPO = ROOT / "tests" / "fixtures" / "topo" / "4gpu_nvlink_pairs_0_2_and_1_3.txt"
MODES = (("off", "fp32"), ("island", "fp32"), ("island", "bf16"), ("island", "fp8"))
LR, EPS = 1e-3, 1e-8
U32 = 2.0 ** -24  # fp32 unit roundoff
ROUNDOFF = {"fp32": 0.0, "bf16": 2.0 ** -8, "fp8": 2.0 ** -4}

CALLS: list[dict] = []  # collectives recorded while RECORDING[0]
RECORDING = [False]


def _record(kind: str, group, payload: torch.Tensor) -> None:
    if RECORDING[0]:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        CALLS.append({"kind": kind, "group": ranks, "bytes": payload.numel() * payload.element_size()})


def _wrap_collectives() -> None:
    """Record the collectives of torch.distributed and the reduce-scatter / all-gather Megatron's gradient buffers
    bound at import."""
    import megatron.core.distributed.param_and_grad_buffer as buffers

    def wrap(kind, fn, payload):
        def wrapped(*args, **kwargs):
            _record(kind, kwargs.get("group"), payload(*args, **kwargs))
            return fn(*args, **kwargs)
        return wrapped

    first = lambda t, *a, **k: t  # noqa: E731  (all_reduce(tensor, ...))
    second = lambda out, inp, *a, **k: inp  # noqa: E731  (reduce-scatter, all-to-all: the input)
    out = lambda out, inp, *a, **k: out  # noqa: E731  (all-gather: the output)
    buffers.dist_reduce_scatter_func = wrap("reduce_scatter", buffers.dist_reduce_scatter_func, second)
    buffers.dist_all_gather_func = wrap("all_gather", buffers.dist_all_gather_func, out)
    dist.all_reduce = wrap("all_reduce", dist.all_reduce, first)
    dist.all_to_all_single = wrap("all_to_all", dist.all_to_all_single, second)
    dist.all_gather_into_tensor = wrap("all_gather", dist.all_gather_into_tensor, out)


def _instrument(engine) -> dict:
    """Snapshot each bucket's gradients as its sync starts, and record collectives during the gradient sync and
    the parameter all-gather."""
    seen: dict = {"local": []}
    for chunk in engine.chunks:
        for bg in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            sync, gather = bg.start_grad_sync, bg.start_param_sync

            def start_grad_sync(*a, _bg=bg, _sync=sync, **k):
                seen["local"] += [b.grad_data.detach().clone() for b in _bg.buckets]
                RECORDING[0] = True
                try:
                    return _sync(*a, **k)
                finally:
                    RECORDING[0] = False

            def start_param_sync(*a, _gather=gather, **k):
                RECORDING[0] = True
                try:
                    return _gather(*a, **k)
                finally:
                    RECORDING[0] = False

            bg.start_grad_sync, bg.start_param_sync = start_grad_sync, start_param_sync
    return seen


def _ring_bytes(call: dict, island_of: dict[int, int], me: int) -> tuple[float, float]:
    """(bytes this rank sends, of them to another island) for one collective, ring algorithms in group order."""
    g, n = call["group"], len(call["group"])
    if n == 1:
        return 0.0, 0.0
    if call["kind"] == "all_to_all":  # 1/n of the input to every other member
        peers = [r for r in g if r != me]
        return (n - 1) / n * call["bytes"], sum(call["bytes"] / n for r in peers if island_of[r] != island_of[me])
    factor = 2 * (n - 1) / n if call["kind"] == "all_reduce" else (n - 1) / n
    successor = g[(g.index(me) + 1) % n]
    sent = factor * call["bytes"]
    return sent, sent if island_of[successor] != island_of[me] else 0.0


def _gather(t: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty(dist.get_world_size(group) * t.numel(), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t.contiguous().view(-1), group=group)
    return out


class _Stub:
    """The data loader and KL controller of a checkpoint, which this job does not use."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _config(mode: str, dtype: str, out_dir: Path):
    from verl_mega.config import load_config

    return load_config(str(ROOT / "configs" / "quickstart_cpu.yaml"), [
        f"parallel.dp_hierarchy={mode}", f"parallel.dp_cross_island_dtype={dtype}", f"parallel.topology_file={TOPO}",
        "actor.lr_warmup_steps=0", f"actor.lr={LR}", "actor.weight_decay=0.0", "actor.grad_clip=0.0",
        f"actor.adam_eps={EPS}", f"trainer.output_dir={out_dir / 'ckpt'}"])


def _build(mode: str, dtype: str, env, path, out_dir: Path):
    from verl_mega.parallel.placement import Placement
    from verl_mega.parallel.scheduler import place_on_devices
    from verl_mega.parallel.state import build_groups, seed_everything
    from verl_mega.trainer import setup
    from verl_mega.trainer.checkpoint import CheckpointManager

    cfg = _config(mode, dtype, out_dir)
    placement, device = place_on_devices(Placement.from_config(cfg, env.world_size), env, str(TOPO),
                                         dp_hierarchy=mode, cross_island_dtype=dtype)
    groups = build_groups(placement)
    seed_everything(cfg.trainer.seed, groups)
    engine = setup.build_role_engine(cfg, groups, path, role_cfg=cfg.actor, total_steps=10).engine
    ckpt = CheckpointManager(cfg, engines={"actor": engine}, loader=_Stub(), kl_ctrl=_Stub())
    return placement, device, groups, engine, ckpt


def _adam_state(engine, arch) -> dict:
    import optim_reshard_job

    optim_reshard_job.STEPS = 1  # the Adam step it expects every state to be at
    return optim_reshard_job.hf_optimizer_state(engine, arch)


def _run_mode(mode: str, dtype: str, env, arch, path, batch, out_dir: Path) -> dict:
    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
    from verl_mega.models.loader import unwrap
    from verl_mega.parallel.scheduler import write_placement_json

    placement, device, groups, engine, ckpt = _build(mode, dtype, env, path, out_dir)
    pool = groups.pool
    if mode != "off":
        write_placement_json(placement, device, out_dir / "placement.json")
    seen = _instrument(engine)
    start = len(CALLS)

    def loss_fn(output, mb):
        lp, _ = vocab_parallel_logprobs_entropy(output[:, :-1], mb["input_ids"][:, 1:], vocab_size=arch.vocab_size,
                                                tp_group=groups["tp"], with_entropy=False)
        return -lp.mean(), {}

    rows = batch.chunk(groups.size("dp"))[groups.dp_rank]
    params_before = {n: p.detach().clone() for n, p in unwrap(engine.chunks[0]).named_parameters()}
    engine.train_step([{"input_ids": rows, "position_ids": torch.arange(rows.shape[1]).expand_as(rows)}], loss_fn)
    calls = CALLS[start:]
    adam = None
    if (mode, dtype) == ("island", "fp32"):  # a checkpoint of the islands' optimizer, for a flat actor to resume
        adam = _adam_state(engine, arch)
        ckpt.save(1)
        ckpt.close()
    chunk = engine.chunks[0]
    (buffer,) = chunk.buffers  # one dtype pair, one bucket: overlap off
    (bucket,) = buffer.buckets
    shard_group = groups["intra_dp" if pool.dp_islands > 1 else "dp"]
    k = dist.get_world_size(shard_group)
    mine = bucket.grad_data.view(k, -1)[dist.get_rank(shard_group)]
    reduced = _gather(mine, shard_group)  # the reduced gradient, shard by shard of the optimizer's group
    local = _gather(seen["local"][0], None).view(env.world_size, -1).double()  # every rank's own gradients
    names = {p: n for n, p in unwrap(chunk).named_parameters()}
    spans = {names[param]: (lo, hi) for param, (lo, hi, _) in buffer.param_index_map.items()}
    grads = {name: reduced[lo:hi].double() for name, (lo, hi) in spans.items()}
    # a fp8 scale covers a block of 128 values of whatever parameters share it: bound it by the largest
    # magnitude of any island's partial sum anywhere in the buffer
    partials = (local / env.world_size).view(max(pool.dp_islands, 1), -1, local.shape[1]).sum(dim=1)
    largest_scale = float(partials.abs().amax(dim=1).sum()) / 448
    params = {n: p.detach().clone() for n, p in unwrap(chunk).named_parameters()}
    for name in params:  # every optimizer instance (island) ends with the same parameters, bit for bit
        everyone = _gather(params[name].float(), None).view(env.world_size, -1)
        assert (everyone == everyone[0]).all(), f"{mode}/{dtype}: ranks disagree on {name} after the step"
    everyone = _gather(reduced, None).view(env.world_size, -1)
    assert (everyone == everyone[0]).all(), f"{mode}/{dtype}: the islands hold different reduced gradients"
    n = env.world_size
    worst = 0.0
    for name, (lo, hi) in spans.items():
        err = (grads[name] - local[:, lo:hi].mean(dim=0)).abs()  # against the float64 mean of every rank's own
        mag = (local[:, lo:hi] / n).abs().sum(dim=0)
        if dtype == "fp32":  # n − 1 additions in any order, each rounding by at most u
            bound = (n - 1) * U32 / (1 - (n - 1) * U32) * mag * 1.0001
        else:  # rounding of every island's partial and of their sum; fp8: e4m3's subnormals (2^-10 of a scale)
            u = ROUNDOFF[dtype]
            bound = (2 * u + u * u + 4 * n * U32) * mag * 1.0001
            if dtype == "fp8":
                bound = bound + 2.0 ** -10 * (2 + u) * 1.01 * largest_scale
        ratio = float((err / bound.clamp_min(1e-300)).max()) if err.max() > 0 else 0.0
        assert ratio <= 1.0, f"{mode}/{dtype}: {name} reduced gradient off its bound by {ratio:.3f}×"
        worst = max(worst, ratio)
    return {"mode": mode, "dtype": dtype, "islands": pool.dp_islands, "per_island": k,
            "grad_elems": bucket.grad_data.numel(), "grad_bytes": bucket.grad_data.element_size(),
            "param_bytes": bucket.param_data.element_size(), "calls": calls, "worst_bound_ratio": worst,
            "island_of": {r: i for i, g in enumerate(placement.pool("main").groups("island")) for r in g},
            "grads": grads, "params": params, "params_before": params_before, "adam": adam}


def _adam_first_step(g: torch.Tensor) -> torch.Tensor:
    """AdamW's first update without weight decay (bias-corrected m̂ = g, v̂ = g²), in float64."""
    return LR * g / (g.abs() + EPS)


def main() -> None:
    from verl_mega.parallel import launch_env
    from verl_mega.parallel.state import init_world
    from verl_mega.trainer import setup

    sys.path.insert(0, str(Path(__file__).parent))  # optim_reshard_job's Adam-state reference
    out_dir = Path(sys.argv[1])
    env = launch_env.discover()
    init_world(timeout_s=120)
    _wrap_collectives()
    path = setup.resolve_model_path(_config("off", "fp32", out_dir))
    arch = setup.model_arch(path)
    batch = torch.randint(0, arch.vocab_size, (8, 24), generator=torch.Generator().manual_seed(0))
    runs = [_run_mode(mode, dtype, env, arch, path, batch, out_dir) for mode, dtype in MODES]
    flat = runs[0]
    *_, engine, ckpt = _build("off", "fp32", env, path, out_dir)  # resumes the islands' checkpoint
    assert ckpt.maybe_resume() == 1
    resumed, saved = _adam_state(engine, arch), runs[1]["adam"]
    assert resumed.keys() == saved.keys() and len(saved) > 0
    bad = [k for k in saved if not torch.equal(resumed[k], saved[k])]
    assert not bad, f"{len(bad)} Adam tensors differ after a flat actor resumed the islands' checkpoint: {bad[:3]}"
    report = {"modes": []}
    flat_islands = runs[1]["island_of"]  # the two "nodes": the islands the scheduler chose
    for run in runs:
        worst_param = 0.0
        for name, p in run["params"].items():
            p, before = p.double().view(-1), run["params_before"][name].double().view(-1)
            # what AdamW's first step makes of the two gradients' difference, plus both modes' fp32 rounding of
            # the update and of the parameter it is added to
            allowed = (_adam_first_step(run["grads"][name]) - _adam_first_step(flat["grads"][name])).abs()
            allowed = allowed + 4 * U32 * (p.abs() + before.abs() + LR) + 1e-12
            dev = (p - flat["params"][name].double().view(-1)).abs()
            worst_param = max(worst_param, float((dev / allowed).max()))
            moved = (p - before).abs().max()
            assert moved > 0.5 * LR, f"{run['mode']}: {name} did not move ({moved})"
        assert worst_param <= 1.0, f"{run['mode']}/{run['dtype']}: parameters off the flat mode's by " \
                                   f"{worst_param:.3f}× what their gradients allow"
        me = dist.get_rank()
        sent = cross = 0.0
        for call in run["calls"]:
            s, c = _ring_bytes(call, flat_islands, me)
            sent, cross = sent + s, cross + c
        totals = torch.tensor([sent, cross], dtype=torch.float64)
        dist.all_reduce(totals)
        groups_seen = sorted({(c["kind"], tuple(c["group"])) for c in run["calls"]})
        report["modes"].append({
            **{k: run[k] for k in ("mode", "dtype", "islands", "per_island", "grad_elems", "grad_bytes",
                                   "param_bytes", "worst_bound_ratio")},
            "worst_param_ratio": worst_param, "sent_per_gpu": float(totals[0]) / env.world_size,
            "cross_per_gpu": float(totals[1]) / env.world_size,
            "collectives_rank0": [list(k) for k in groups_seen]})
    if dist.get_rank() == 0:
        report["islands"] = {str(k): v for k, v in flat_islands.items()}
        report["checkpoint_tensors_compared"] = len(saved)
        (out_dir / "report.json").write_text(json.dumps(report, indent=1))
        print("DP_ISLANDS_OK " + json.dumps({m["dtype"] + "/" + m["mode"]: m["worst_bound_ratio"]
                                             for m in report["modes"]}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
