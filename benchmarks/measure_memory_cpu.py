"""Measured vs predicted training memory on CPU: small models through the Megatron-Core engine (world of one).

    python benchmarks/measure_memory_cpu.py [--dtype fp32|bf16] [--only NAME] [--json OUT]

Each configuration builds an mcore model with :class:`~verl_mega.engine.megatron_engine.MegatronEngine` (DDP with
fp32 main grads, distributed optimizer, AdamW), runs two optimizer steps of a log-prob loss (the actor's shape of
computation) and measures, by tracking every tensor storage the process allocates (a ``TorchDispatchMode`` sees
each op's outputs; a weak-reference finaliser sees each storage freed):

* ``state``: live bytes after the first step — params + grads + optimizer state;
* ``act``: peak live bytes during forward/backward of the second step minus ``state``;
* ``peak``: peak live bytes of the whole second step (includes the grad reduce-scatter and optimizer step).

The prediction comes from :mod:`verl_mega.planning.memory` with tp = pp = dp = 1 and backend gloo. Prints a table
(and writes JSON with --json); ``docs/planning.md`` shows the result.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import weakref
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from verl_mega.models.hf_config import ModelArch  # noqa: E402
from verl_mega.planning.memory import (  # noqa: E402
    training_pool,
    Workload,
    activation_terms,
    training_state_terms,
)
from verl_mega.planning.params import stage_params  # noqa: E402

MiB = 2**20

_BASE = dict(num_layers=4, hidden_size=512, ffn_hidden_size=1408, num_heads=8, num_kv_heads=2, head_dim=64,
             vocab_size=4000, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=False, qkv_bias=True, qk_norm=False, model_type="qwen2")
# (name, architecture overrides, workload fields, value head)
CONFIGS: list[tuple[str, dict, dict, bool]] = [
    ("qwen2-gqa b2 s256", {}, dict(micro_batch=2, seq_len=256), False),
    ("qwen2-gqa b1 s1024", {}, dict(micro_batch=1, seq_len=1024), False),
    ("qwen2-gqa b2 s256 selective", {}, dict(micro_batch=2, seq_len=256, recompute="selective"), False),
    ("qwen2-gqa b4 s512 full", {}, dict(micro_batch=4, seq_len=512, recompute="full"), False),
    ("qwen2-gqa b2 s256 entropy", {}, dict(micro_batch=2, seq_len=256, entropy=True), False),
    ("llama-mha b2 s512", dict(model_type="llama", num_kv_heads=8, qkv_bias=False, num_layers=3, vocab_size=8000),
     dict(micro_batch=2, seq_len=512), False),
    ("qwen3-qknorm tied b2 s256", dict(model_type="qwen3", qkv_bias=False, qk_norm=True, tie_word_embeddings=True),
     dict(micro_batch=2, seq_len=256), False),
    ("critic value-head b2 s512", {}, dict(micro_batch=2, seq_len=512), True),
]


class LiveBytes(TorchDispatchMode):
    """Live and peak bytes of every tensor storage created while active (views share their storage)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key in self._live:
                    continue
                self._live[key] = storage.nbytes()
                self.current += storage.nbytes()
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._free, key)
        return out


GROUPS: dict = {}  # the world of one's process groups, set in main()


def _loss_fn(arch: ModelArch, work: Workload, value_head: bool):
    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy

    def loss(output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict]:
        if value_head:
            return output.float().pow(2).mean(), {}
        lp, ent = vocab_parallel_logprobs_entropy(output[:, :-1], mb["input_ids"][:, 1:], vocab_size=arch.vocab_size,
                                                  tp_group=GROUPS["groups"]["tp"], with_entropy=work.entropy)
        value = -lp.mean()
        if ent is not None:
            value = value - 0.01 * ent.mean()
        return value, {}

    return loss


def measure(arch: ModelArch, work: Workload, value_head: bool) -> dict[str, float]:
    from megatron.core.optimizer import OptimizerConfig

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import transformer_config

    dtype = {"fp32": "float32", "bf16": "bfloat16"}[work.dtype]
    torch.manual_seed(0)
    tracker = LiveBytes()
    marks: dict[str, int] = {}
    with tracker:
        cfg = transformer_config(arch, dtype=dtype, recompute=work.recompute, use_cpu_initialization=True)
        chunks = build_model_chunks(arch, cfg, GROUPS["groups"], value_head=value_head, use_te="false")
        marks["params"] = tracker.current
        opt = OptimizerConfig(optimizer="adam", lr=1e-5, use_distributed_optimizer=True, bf16=dtype == "bfloat16",
                              params_dtype=cfg.params_dtype)
        engine = MegatronEngine(chunks, cfg, GROUPS["groups"], optimizer_config=opt)
        marks["grads"] = tracker.current - marks["params"]
        finalize = cfg.finalize_model_grads_func

        def finalize_and_mark(*args, **kwargs):
            marks["fwd_bwd_peak"] = tracker.peak  # backward is done; the grad sync and optimizer step follow
            return finalize(*args, **kwargs)

        cfg.finalize_model_grads_func = finalize_and_mark
        ids = torch.randint(0, arch.vocab_size, (work.micro_batch, work.seq_len))
        pos = torch.arange(work.seq_len).expand_as(ids)
        batch = [{"input_ids": ids, "position_ids": pos}]
        loss = _loss_fn(arch, work, value_head)
        engine.train_step(batch, loss)
        state = tracker.current
        tracker.reset_peak()
        start = time.perf_counter()
        engine.train_step(batch, loss)
        seconds = time.perf_counter() - start
        peak = tracker.peak
    del engine, chunks
    gc.collect()
    return {"params": marks["params"], "grads": marks["grads"], "optimizer": state - marks["params"] - marks["grads"],
            "state": state, "act": marks["fwd_bwd_peak"] - state, "peak": peak, "step_s": seconds}


def predict(arch: ModelArch, work: Workload, value_head: bool) -> dict[str, float]:
    layout = training_pool(tp=1)
    params = stage_params(arch, layout, 0, value_head=value_head)
    state_terms = training_state_terms(params.total, 1, work.dtype)
    act = sum(t.bytes for t in activation_terms(arch, layout, work, 0, value_head=value_head))
    # After the backward pass: gloo flattens the grad buffer for the reduce-scatter (see memory.py).
    transient = max(4 * params.total, 4 * params.largest)
    state = sum(t.bytes for t in state_terms)
    return {"params": state_terms[0].bytes, "grads": state_terms[1].bytes, "optimizer": state_terms[2].bytes,
            "state": state, "act": act, "peak": state + max(act, transient)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--only", default=None, help="run only configurations whose name contains this text")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args(argv)

    from verl_mega.parallel.state import init_distributed

    GROUPS["groups"] = init_distributed(tp=1, pp=1)
    rows = []
    header = (f"{'configuration':<30} {'what':<10} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8}")
    print(f"dtype={args.dtype}, torch {torch.__version__}, world of one (tp=pp=dp=1), CPU")
    print(header)
    print("-" * len(header))
    for name, overrides, work_kwargs, value_head in CONFIGS:
        if args.only and args.only not in name:
            continue
        arch = ModelArch(**{**_BASE, **overrides})
        work = Workload(dtype=args.dtype, backend="gloo", **work_kwargs)
        got, want = measure(arch, work, value_head), predict(arch, work, value_head)
        row = {"name": name, "dtype": args.dtype, "measured": got, "predicted": want}
        rows.append(row)
        for what in ("state", "act", "peak"):
            err = (want[what] - got[what]) / got[what]
            row[f"error_{what}"] = err
            print(f"{name:<30} {what:<10} {want[what] / MiB:>14.2f} {got[what] / MiB:>13.2f} {100 * err:>7.2f}%")
    worst = max(abs(r[f"error_{w}"]) for r in rows for w in ("state", "act", "peak")) if rows else 0.0
    print(f"worst |error| {100 * worst:.2f}% over {len(rows)} configurations")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    from verl_mega.parallel.state import destroy_distributed

    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
