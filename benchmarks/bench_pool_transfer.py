"""Weights from a training pool to a rollout pool across GPUs (Llama-2-7B architecture, bf16, 13.48 GB).

    torchrun --nproc-per-node 2 benchmarks/bench_pool_transfer.py --out pool_transfer.json

Rank 0 is the training pool (Megatron-Core, tp=1, random init); rank 1 is the rollout pool (one engine, tg=1)
and holds the model in vLLM's parameter layout (fused qkv_proj and gate_up_proj, vocabulary padded to 64 rows),
allocated on its GPU. Side by side, alternating, after warm-ups:

- ``buckets``: ours (:class:`verl_mega.hybrid.pool_sync.PoolWeightSync`): the producer writes vLLM's slices into
  staging buckets, each broadcast over NCCL as soon as it is full while the next fills; the receiver copies every
  slice into its parameter;
- ``gather_broadcast``: the baseline: the full HF tensors (the producer's gather path) are broadcast one by one and
  the receiver writes each into its place in the fused parameters, as vLLM's loader does.

Times are from the start to the end of the transfer on both ranks (CUDA-synchronised); the receiver's
parameters are checked equal after both. Rank 0 prints the table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def vllm_layout_shapes(hf_shapes: dict[str, tuple[int, ...]]) -> tuple[dict, dict]:
    """vLLM's tg=1 parameter shapes from HF's, and where each HF tensor lands: name → (vLLM name, first row)."""
    shapes, place = {}, {}
    for name, shape in hf_shapes.items():
        module, _, kind = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in FUSED:
            fused, index = FUSED[leaf]
            target = f"{parent}.{fused}.{kind}"
            parts = [hf_shapes[f"{parent}.{k}.{kind}"][0] for k, (f, _) in FUSED.items() if f == fused]
            shapes[target] = (sum(parts), *shape[1:])
            place[name] = (target, sum(parts[:index]))
        elif leaf in ("embed_tokens", "lm_head"):
            shapes[name] = (-(-shape[0] // 64) * 64, *shape[1:])
            place[name] = (name, 0)
        else:
            shapes[name], place[name] = shape, (name, 0)
    return shapes, place


def receiver_model(shapes: dict[str, tuple[int, ...]], vocab: int, device) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, pname = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(pname, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16, device=device),
                                                         requires_grad=False))
    for mname in ("model.embed_tokens", "lm_head"):
        module = root.get_submodule(mname)
        module.padding_size = 64
        module.shard_indices = SimpleNamespace(org_vocab_start_index=0, org_vocab_end_index=vocab)
    return root


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    _sync()
    dist.barrier()
    start = time.perf_counter()
    fn()
    _sync()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run (default: 32)")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="pool_transfer.json")
    args = ap.parse_args()

    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_mega.hybrid.pool_sync import PoolWeightSync
    from verl_mega.hybrid.producer import WeightProducer
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, transformer_config
    from verl_mega.parallel.placement import Placement, Pool
    from verl_mega.parallel.state import build_groups, init_world, seed_everything

    init_world()
    rank = dist.get_rank()
    device = torch.device("cuda", rank) if torch.cuda.is_available() else torch.device("cpu")  # CPU: a smoke run
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    hf = dict(LLAMA2_7B, num_hidden_layers=args.layers or LLAMA2_7B["num_hidden_layers"])
    arch = arch_from_hf(hf)
    placement = Placement(2, (Pool(name="train", ranks=(0,), gen_tp=1), Pool(name="gen", ranks=(1,), trains=False)),
                          {"actor": "train", "rollout": "gen"})
    groups = build_groups(placement)
    seed_everything(1, groups)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf), dtype=torch.bfloat16)
    hf_shapes = {n: tuple(p.shape) for n, p in skeleton.state_dict().items()}
    shapes, place = vllm_layout_shapes(hf_shapes)
    producer = model = None
    if rank == 0:
        cfg = transformer_config(arch, dtype="bfloat16")
        chunks = [c.to(device) for c in build_model_chunks(arch, cfg, groups, use_te="false")]
        producer = WeightProducer(groups=groups, arch=arch, chunks=chunks)
    else:
        model = receiver_model(shapes, arch.vocab_size, device)
    ours = PoolWeightSync(placement, bucket_bytes=args.bucket_mb << 20, device=device, producer=producer, model=model)
    pair = ours.groups[0]
    params = dict(model.named_parameters()) if model is not None else {}

    order = [[n for n, _ in producer.full_tensors()] if rank == 0 else None]
    dist.broadcast_object_list(order, src=0)  # the baseline's tensor order, once

    def baseline() -> None:  # full HF tensors, one broadcast each, written where vLLM's loader puts them
        if rank == 0:
            for _, tensor in producer.full_tensors():
                dist.broadcast(tensor.contiguous(), src=0, group=pair)
            return
        for name in order[0]:
            tensor = torch.empty(hf_shapes[name], dtype=torch.bfloat16, device=device)
            dist.broadcast(tensor, src=0, group=pair)
            target, row = place[name]
            params[target].data[row:row + tensor.shape[0]].copy_(tensor)

    for _ in range(2):  # warm-up: NCCL communicators, first-touch allocations
        ours.sync()
        baseline()
    rows = {"buckets": [], "gather_broadcast": []}
    snapshot = None
    for _ in range(args.repeats):
        rows["buckets"].append(timed(ours.sync))
        if rank == 1 and snapshot is None:
            snapshot = {n: p.detach().clone() for n, p in params.items()}
        rows["gather_broadcast"].append(timed(baseline))
    if rank == 1:  # both paths wrote the same weights
        for name, p in params.items():
            assert torch.equal(p, snapshot[name]), f"{name} differs between the bucketed and the baseline path"
    model_bytes = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    times = [None, None]
    dist.all_gather_object(times, rows)
    if rank == 0:
        result = {"model": "Llama-2-7B architecture (random init)", "layers": hf["num_hidden_layers"],
                  "model_bytes_vllm_layout": model_bytes, "bucket_mb": args.bucket_mb, "repeats": args.repeats,
                  "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (gloo)",
                  "torch": torch.__version__, "backend": dist.get_backend()}
        for path in rows:
            for r, who in enumerate(("trainer", "rollout")):
                ms = times[r][path]
                result[f"{path}_{who}_ms"] = {"median": statistics.median(ms), "min": min(ms), "all": ms}
            median = result[f"{path}_rollout_ms"]["median"]
            print(f"{path:18s} median {median:8.1f} ms  ({model_bytes / median / 1e6:.0f} GB/s into the rollout GPU)",
                  flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
