"""torchrun job: Adam state saved at one tp/pp/dp layout is restored exactly at another.

    train  --tp T --pp P RUN_DIR[:nodist] ...: per run, an actor with the distributed (or the non-distributed)
           optimizer takes STEPS steps on a fixed batch; then a checkpoint (CheckpointManager, and for the
           distributed optimizer also RUN_DIR/legacy in the per-bucket form of older checkpoints), the reference
           optimizer state, and two more steps (the uninterrupted run's losses)
    resume --tp T --pp P RUN_DIR[:nodist|:legacy] ...: per run, a fresh actor resumes from that checkpoint, its
           optimizer state is compared with the reference exactly, and the same two steps must give the same losses

The reference is computed independently of the checkpoint code: each parameter's Adam state (exp_avg, exp_avg_sq,
fp32 main param) is assembled over the data-parallel group from the optimizer's own ranges, then gathered over
tp/pp and renamed to HF names by the same converter that exports the weights.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
STEPS = 3
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


class _Stub:
    """Stands in for the data loader and KL controller, which this job does not use."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


GROUPS: dict = {}  # this rank's process groups, set in main()


def _batch(vocab_size: int) -> list[dict[str, torch.Tensor]]:
    """This rank's share of a fixed global batch (4 sequences split over the data-parallel ranks)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (4, 16), generator=g)
    dp, rank = GROUPS["groups"].size("dp"), GROUPS["groups"].dp_rank
    rows = ids.chunk(dp)[rank]
    return [{"input_ids": rows, "position_ids": torch.arange(ids.shape[1]).expand_as(rows)}]


def _train_step(engine, vocab_size: int) -> float:
    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy

    def loss_fn(output, mb):
        lp, _ = vocab_parallel_logprobs_entropy(output[:, :-1], mb["input_ids"][:, 1:], vocab_size=vocab_size,
                                                tp_group=engine.groups["tp"], with_entropy=False)
        loss = -lp.mean()
        return loss, {"loss": loss.detach()}

    return engine.train_step(_batch(vocab_size), loss_fn)["loss"]


def _local_state(engine) -> list[tuple[torch.nn.Parameter, dict[str, torch.Tensor]]]:
    """Per model parameter of this rank: its full (TP-local) Adam state, assembled over the DP group."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from verl_mega.models.loader import unwrap

    owners, main_of, group_of = {}, {}, {}
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        if isinstance(opt, DistributedOptimizer):  # holds a range of each parameter on each DP rank
            owners.update({p: opt for p in opt.model_param_gbuf_map})  # the parameters with a range on this rank
            group_of.update({p: opt.data_parallel_group for buf in opt.buffers for p in buf.param_index_map})
        else:  # whole parameters; fp32 models use the params themselves as main params
            model_groups = getattr(opt, "float16_groups", None) or [g["params"] for g in opt.optimizer.param_groups]
            main_groups = getattr(opt, "fp32_from_float16_groups", None) or model_groups
            for param, main in zip(itertools.chain(*model_groups), itertools.chain(*main_groups)):
                main_of[param] = (opt, main)
    out = []
    for param in (p for c in engine.chunks for p in unwrap(c).parameters()):  # same order on every DP rank
        if param in main_of:
            opt, main = main_of[param]
            state = opt.optimizer.state[main]
            assert float(state["step"]) == STEPS, f"Adam step {float(state['step'])} != {STEPS}"
            tensors = {"param": main, "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"]}
            out.append((param, {k: v.detach().float().clone() for k, v in tensors.items()}))
            continue
        full = {k: torch.zeros(param.numel()) for k in STATE_KEYS}
        if param in owners:
            opt = owners[param]
            rng = opt._get_model_param_range_map(param)["param"]
            state = opt._get_main_param_and_optimizer_states(param)
            assert float(state["step"]) == STEPS, f"Adam step {float(state['step'])} != {STEPS}"
            for k in STATE_KEYS:
                full[k][rng.start:rng.end] = state[k].detach().float().view(-1)
        # each element lives on exactly one rank of its optimizer's data-parallel group (with data-parallel islands:
        # one rank of each island, which holds the whole state)
        group = group_of.get(param, engine.groups["dp"])
        for k in STATE_KEYS:
            dist.all_reduce(full[k], group=group)
        out.append((param, {k: v.view(param.shape) for k, v in full.items()}))
    return out


def hf_optimizer_state(engine, arch) -> dict[str, torch.Tensor]:
    """{"exp_avg/<hf name>": full tensor, …} on every rank (collective)."""
    from verl_mega.models.loader import iter_hf_tensors

    local = _local_state(engine)
    saved = [(p, p.data.clone()) for p, _ in local]
    out = {}
    with torch.no_grad():
        for key in STATE_KEYS:
            for param, state in local:
                param.data.copy_(state[key].to(param.dtype))
            out.update({f"{key}/{name}": t.clone() for name, t in iter_hf_tensors(engine.chunks, arch, engine.groups)})
        for param, weights in saved:
            param.data.copy_(weights)
    return out


def _check_losses(losses: list[float], ref: dict, layout: dict) -> None:
    for i, (have, expect) in enumerate(zip(losses, ref["losses"][STEPS:])):
        assert abs(have - expect) <= 1e-5 * abs(expect), \
            f"step {STEPS + 1 + i}: loss {have!r} at {layout} vs {expect!r} at {ref['layout']}"


def _train(run: Path, nodist: bool, build, arch, layout: dict) -> None:
    from verl_mega.trainer import optim_state

    cfg, engine, ckpt = build(run, nodist)
    losses = [_train_step(engine, arch.vocab_size) for _ in range(STEPS)]
    reference = hf_optimizer_state(engine, arch)
    ckpt.save(STEPS)
    if not nodist:
        current = optim_state.sharded_state_dict
        optim_state.sharded_state_dict = functools.partial(current, fmt=optim_state.LEGACY_FORMAT)
        build(run / "legacy", nodist, engine=engine)[2].save(STEPS)
        optim_state.sharded_state_dict = current
        if dist.get_rank() == 0:  # as written before the format was recorded
            meta = run / "legacy" / "checkpoints" / f"step_{STEPS:06d}" / "trainer.json"
            state = json.loads(meta.read_text())
            assert state.pop("optimizer_format") == optim_state.FORMAT  # the CheckpointManager's own claim
            state.pop("schema")
            meta.write_text(json.dumps(state))
            (meta.parent / "manifest.json").unlink()  # nor did it have a manifest
    losses += [_train_step(engine, arch.vocab_size) for _ in range(2)]
    if dist.get_rank() == 0:
        torch.save(reference, run / "optim_reference.pt")
        (run / "losses.json").write_text(json.dumps({"layout": layout, "losses": losses}))


def _resume(run: Path, variant: str, build, arch, layout: dict) -> int:
    """Returns the number of optimizer tensors compared."""
    ref_dir = run
    if variant == "legacy":
        run = run / "legacy"
    ref = json.loads((ref_dir / "losses.json").read_text())
    _, engine, ckpt = build(run, variant == "nodist")
    warnings = _capture_warnings()
    assert ckpt.maybe_resume() == STEPS
    if variant == "legacy" and layout != ref["layout"]:  # that form cannot reshard: weights load, optimizer restarts
        assert any("optimizer state restarts" in w for w in warnings), warnings
        assert not any(s for o in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
                       for s in o.optimizer.state.values())
        _check_losses([_train_step(engine, arch.vocab_size)], ref, layout)
        return 0
    got = hf_optimizer_state(engine, arch)
    want = torch.load(ref_dir / "optim_reference.pt", weights_only=True)
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))[:5]
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} optimizer tensors differ after resharding, e.g. {bad[:3]} " \
                    f"(max abs diff {(got[bad[0]] - want[bad[0]]).abs().max().item():.3g})"
    _check_losses([_train_step(engine, arch.vocab_size) for _ in range(2)], ref, layout)
    return len(want)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("train", "resume"))
    ap.add_argument("runs", nargs="+", help="RUN_DIR[:nodist|:legacy]")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    args = ap.parse_args()

    from verl_mega.config import load_config
    from verl_mega.parallel.state import init_distributed
    from verl_mega.trainer import setup
    from verl_mega.trainer.checkpoint import CheckpointManager

    def config(output_dir: Path, nodist: bool):
        return load_config(str(ROOT / "configs" / "quickstart_cpu.yaml"), [
            f"trainer.output_dir={output_dir}", f"parallel.tp={args.tp}", f"parallel.pp={args.pp}",
            f"parallel.use_distributed_optimizer={'false' if nodist else 'true'}",
            "actor.lr_warmup_steps=0", "actor.lr=1e-3", "actor.weight_decay=0.01"])

    cfg = config(Path(args.runs[0].split(":")[0]), False)
    path = setup.resolve_model_path(cfg)
    arch = setup.model_arch(path)
    groups = GROUPS["groups"] = init_distributed(tp=args.tp, pp=args.pp, seed=cfg.trainer.seed)
    layout = {kind: groups.size(kind) for kind in ("tp", "pp", "dp")}

    def build(output_dir: Path, nodist: bool, engine=None):
        """A fresh actor (or `engine`) and a CheckpointManager writing under output_dir."""
        cfg = config(output_dir, nodist)
        if engine is None:
            engine = setup.build_role_engine(cfg, groups, path, role_cfg=cfg.actor, total_steps=10).engine
        return cfg, engine, CheckpointManager(cfg, engines={"actor": engine}, loader=_Stub(), kl_ctrl=_Stub())

    report = []
    for spec in args.runs:
        run, _, variant = spec.partition(":")
        if args.phase == "train":
            _train(Path(run), variant == "nodist", build, arch, layout)
        else:
            report.append({"run": spec, "tensors": _resume(Path(run), variant, build, arch, layout)})
    if dist.get_rank() == 0:
        print("OPTIM_RESHARD_OK " + json.dumps({"layout": layout, "runs": report}))
    dist.barrier()
    dist.destroy_process_group()


def _capture_warnings() -> list[str]:
    import logging

    records: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("verl_mega.checkpoint").addHandler(handler)
    return records


if __name__ == "__main__":
    main()
