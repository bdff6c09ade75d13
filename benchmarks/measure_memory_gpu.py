"""Measured vs predicted per-GPU training memory on CUDA (bf16), one row per rank.

    torchrun --nproc-per-node N benchmarks/measure_memory_gpu.py --model qwen2.5-1.5b|CONFIG.json
        [--tp T --pp P --vpp V] [--micro-batch B --seq-len S --num-microbatches M] [--recompute R] [--json OUT]

Builds the model (random weights; ``qwen2.5-1.5b`` is built in, any HF config.json works, e.g.
tests/fixtures/hf_configs/llama-2-7b.json) with :class:`~verl_mega.engine.megatron_engine.MegatronEngine`: bf16
params, fp32 main grads, distributed optimizer over the data-parallel ranks, our SDPA layer spec (``use_te=false``,
the spec the activation formula describes). Two optimizer steps of the actor's log-prob loss; from
``torch.cuda.memory_allocated`` / ``max_memory_allocated`` relative to before the model was built:

* ``state``: after the first step (params + grads + optimizer state);
* ``act``: peak of the second step's forward/backward minus ``state``;
* ``peak``: peak of the whole second step (includes the optimizer step).

The prediction is :mod:`verl_mega.planning.memory` for the rank's pipeline stage (backend nccl).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import warnings  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# Published config.json values of Qwen/Qwen2.5-1.5B-Instruct (weights are random here).
QWEN25_1_5B = {
    "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "vocab_size": 151936,
}
GiB = 2**30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--num-microbatches", type=int, default=None, help="default: 2·pp")
    ap.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs CUDA; use benchmarks/measure_memory_cpu.py on CPU", file=sys.stderr)
        return 2

    from megatron.core.optimizer import OptimizerConfig

    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.parallel.state import init_distributed
    from verl_mega.planning.memory import Workload, activation_terms, training_state_terms
    from verl_mega.planning.params import stage_params

    hf = QWEN25_1_5B if args.model == "qwen2.5-1.5b" else load_hf_config(args.model)
    arch = arch_from_hf(hf)
    groups = init_distributed(tp=args.tp, pp=args.pp, vpp=args.vpp, sequence_parallel=args.tp > 1, seed=1)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    layout = groups.pool
    m = args.num_microbatches or 2 * args.pp
    work = Workload(micro_batch=args.micro_batch, seq_len=args.seq_len, recompute=args.recompute, dtype="bf16",
                    num_microbatches=m, backend="nccl")

    cfg = transformer_config(arch, tp=args.tp, pp=args.pp, vpp=args.vpp, sequence_parallel=layout.sequence_parallel,
                             dtype="bfloat16", recompute=args.recompute)
    chunks = build_model_chunks(arch, cfg, groups, use_te="false")
    opt = OptimizerConfig(optimizer="adam", lr=1e-6, bf16=True, params_dtype=torch.bfloat16,
                          use_distributed_optimizer=True)
    engine = MegatronEngine(chunks, cfg, groups, optimizer_config=opt)
    finalize, marks = cfg.finalize_model_grads_func, {}

    def finalize_and_mark(*a, **k):
        torch.cuda.synchronize()
        marks["fwd_bwd_peak"] = torch.cuda.max_memory_allocated() - base
        return finalize(*a, **k)

    cfg.finalize_model_grads_func = finalize_and_mark
    g = torch.Generator().manual_seed(0)  # same batch on every rank
    batch = []
    for _ in range(m):
        ids = torch.randint(0, arch.vocab_size, (args.micro_batch, args.seq_len), generator=g).cuda()
        batch.append({"input_ids": ids, "position_ids": torch.arange(args.seq_len, device="cuda").expand_as(ids)})

    def loss_fn(output, mb):
        lp, _ = vocab_parallel_logprobs_entropy(output[:, :-1], mb["input_ids"][:, 1:], vocab_size=arch.vocab_size,
                                                tp_group=groups["tp"])
        return -lp.mean(), {}

    engine.train_step(batch, loss_fn)
    torch.cuda.synchronize()
    state = torch.cuda.memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    engine.train_step(batch, loss_fn)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base

    stage = groups.pp_rank
    params = stage_params(arch, layout, stage).total
    want_state = sum(t.bytes for t in training_state_terms(params, layout.dp, "bf16"))
    want_act = sum(t.bytes for t in activation_terms(arch, layout, work, stage))
    want_peak = want_state + max(want_act, 4 * params / layout.dp)  # foreach AdamW temporary after backward
    row = {"rank": dist.get_rank(), "stage": stage, "tp_rank": groups.tp_rank, "params": params,
           "measured": {"state": state, "act": marks["fwd_bwd_peak"] - state, "peak": peak},
           "predicted": {"state": want_state, "act": want_act, "peak": want_peak}}
    rows: list = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        name = args.model if args.model == "qwen2.5-1.5b" else Path(args.model).stem
        print(f"{name}: {arch.num_parameters() / 1e9:.2f} B params; {layout.describe()} recompute={args.recompute} "
              f"micro-batch {args.micro_batch} × {args.seq_len} tokens, M={m}; torch {torch.__version__}, "
              f"{torch.cuda.get_device_name()}")
        print(f"{'rank':>4} {'stage':>5} {'what':<6} {'predicted GiB':>14} {'measured GiB':>13} {'error':>8}")
        for r in rows:
            for what in ("state", "act", "peak"):
                got, want = r["measured"][what], r["predicted"][what]
                r[f"error_{what}"] = (want - got) / got
                print(f"{r['rank']:>4} {r['stage']:>5} {what:<6} {want / GiB:>14.3f} {got / GiB:>13.3f} "
                      f"{100 * r[f'error_{what}']:>7.2f}%")
        if args.json:
            Path(args.json).write_text(json.dumps({"model": name, "layout": layout.describe(), "rows": rows},
                                                  indent=1))
    dist.barrier()
    from verl_mega.parallel.state import destroy_distributed

    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
