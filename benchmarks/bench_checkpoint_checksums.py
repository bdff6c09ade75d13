"""Cost of checkpoint checksums: SHA-256 of every file at save (manifest.json) and its verification before a resume,
next to the save and load they accompany. One process, CPU (or one GPU), the full training state of an actor
(weights + distributed-optimizer state), written and read by the real CheckpointManager.

    python benchmarks/bench_checkpoint_checksums.py --hidden 1024 --layers 8 --out results/checksums_cpu.json

Prints a table and writes the numbers as JSON. The 64 MiB blocks are split over the ranks and, within a rank, over
``--threads`` hashing threads (``auto``: the node's cores shared among its ranks); each setting is measured in turn in
the same process, side by side. "write s" is the save without its hashing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Stub:
    """Stands in for the data loader and KL controller."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def _train_step(engine, vocab_size: int) -> None:
    import torch

    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy

    ids = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(output, mb):
        lp, _ = vocab_parallel_logprobs_entropy(output[:, :-1], mb["input_ids"][:, 1:], vocab_size=vocab_size,
                                                tp_group=engine.groups["tp"], with_entropy=False)
        return -lp.mean(), {}

    engine.train_step([{"input_ids": ids, "position_ids": torch.arange(16).expand_as(ids)}], loss_fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,auto", help="hashing threads per rank to compare, comma-separated")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from verl_mega.config import load_config
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.parallel.state import init_distributed
    from verl_mega.checkpoint import manager as ckpt_mod
    from verl_mega.trainer import setup
    from verl_mega.checkpoint import integrity
    from verl_mega.checkpoint.integrity import verify_checkpoint

    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    model = make_tiny_hf_model(work / "model", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                               num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=args.hidden // 128,
                               vocab_size=32000, with_tokenizer=False)
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / "quickstart_cpu.yaml"),
                      [f"trainer.output_dir={work / 'out'}", f"model.path={model}", f"model.tokenizer_path={model}",
                       "checkpoint.keep_last=1"], check_paths=False)
    groups = init_distributed(seed=cfg.trainer.seed)
    engine = setup.build_role_engine(cfg, groups, model, role_cfg=cfg.actor, total_steps=10).engine
    _train_step(engine, vocab_size=32000)  # the optimizer holds its state (Adam moments, step) from here on
    manager = ckpt_mod.CheckpointManager(cfg, engines={"actor": engine}, loader=_Stub(), kl_ctrl=_Stub())

    digest_s: list[float] = []
    original = ckpt_mod.CheckpointManager._digests

    def timed(tmp):
        begin = time.perf_counter()
        try:
            return original(tmp)
        finally:
            digest_s.append(time.perf_counter() - begin)

    manager._digests = timed  # instance attribute: the static method, timed
    rows = []
    auto_threads = integrity.hash_threads
    for setting in args.threads.split(","):
        threads = auto_threads() if setting == "auto" else int(setting)
        integrity.hash_threads = lambda threads=threads: threads
        for _ in range(args.repeats):
            step = len(rows) + 1
            begin = time.perf_counter()
            path = manager.save(step)
            save_s = time.perf_counter() - begin
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            begin = time.perf_counter()
            assert verify_checkpoint(cfg, path) == path
            verify_s = time.perf_counter() - begin
            begin = time.perf_counter()
            assert manager.maybe_resume(path) == step
            load_s = time.perf_counter() - begin
            rows.append({"threads": threads, "step": step, "bytes": size, "save_s": save_s, "digest_s": digest_s[-1],
                         "load_s": load_s, "verify_s": verify_s})
    params = sum(p.numel() for c in engine.chunks for p in c.parameters())
    print(f"actor of {params / 1e6:.1f} M parameters, checkpoint of {rows[0]['bytes'] / 1e6:.0f} MB "
          f"(weights + optimizer state), {len(rows)} saves and loads")
    print(f"{'threads':>7} {'step':>4} {'save s':>8} {'write s':>8} {'sha256 s':>9} {'save/write':>10} {'load s':>7} "
          f"{'verify s':>9} {'MB/s verified':>13}")
    for r in rows:
        write_s = r["save_s"] - r["digest_s"]
        print(f"{r['threads']:>7} {r['step']:>4} {r['save_s']:>8.2f} {write_s:>8.2f} {r['digest_s']:>9.2f} "
              f"{r['save_s'] / write_s:>10.2f} {r['load_s']:>7.2f} {r['verify_s']:>9.2f} "
              f"{r['bytes'] / 1e6 / r['verify_s']:>13.0f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"params": params, "hidden": args.hidden, "layers": args.layers,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
