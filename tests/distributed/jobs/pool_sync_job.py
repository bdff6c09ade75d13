"""torchrun job: weights from a training pool (Megatron-Core, gloo) to a rollout pool, in buckets, checked against
the perturbed model's full HF tensors sliced and fused by hand into vLLM's layout.

Args: --tp --pp [--gen-tp] --model-dir DIR --work DIR; the training pool is the first tp·pp ranks, the other ranks
are rollout engines of gen_tp ranks each. Each rollout rank holds a module with vLLM's parameter names and shapes
for its rank j (qkv_proj = [q_j; k_j; v_j], gate_up_proj = [gate_j; up_j], vocabulary rows padded to 64 and split),
filled with NaN before the sync.
Checks: every parameter equals the hand-fused tensor exactly, after each of two syncs (the second after the
weights changed again); each rollout rank received exactly its model's bytes; only one training rank sent.
Rank 0 prints ``POOLSYNC {json}``.
"""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from hybrid_sync_job import perturb

VLLM_VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding pads the vocabulary to a multiple of this


def vllm_slices(hf: dict[str, torch.Tensor], tg: int, j: int) -> dict[str, torch.Tensor]:
    """vLLM's parameters on rank j of a tg-way engine, from full HF tensors: row-parallel weights split by columns,
    column-parallel ones by rows ([q_j; k_j; v_j] and [gate_j; up_j] when fused), the vocabulary padded to 64 rows
    and split evenly, norms whole."""
    def rows(t: torch.Tensor, parts: int = tg) -> torch.Tensor:
        return t.chunk(parts, dim=0)[j]

    out = {}
    for name, t in hf.items():
        if ".self_attn.q_proj." in name:
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([rows(t), rows(k), rows(v)])
        elif ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([rows(t), rows(hf[name.replace("gate_proj",
                                                                                                    "up_proj")])])
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = -(-t.shape[0] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            out[name] = rows(torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])]))
        elif any(k in name for k in (".o_proj.weight", ".down_proj.weight")):
            out[name] = t.chunk(tg, dim=1)[j]
        elif not any(k in name for k in (".k_proj.", ".v_proj.", ".up_proj.")):
            out[name] = t
    return out


def receiver_module(expected: dict[str, torch.Tensor], vocab: int, tg: int, j: int) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, t in expected.items():
        *path, pname = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(pname, torch.nn.Parameter(torch.full_like(t, float("nan")), requires_grad=False))
    per = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // tg
    for mname in ("model.embed_tokens", "lm_head"):
        if f"{mname}.weight" in expected:
            module = root.get_submodule(mname)
            module.padding_size = VLLM_VOCAB_PADDING
            module.shard_indices = SimpleNamespace(org_vocab_start_index=min(j * per, vocab),
                                                   org_vocab_end_index=min((j + 1) * per, vocab))
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, required=True)
    ap.add_argument("--gen-tp", type=int, default=1)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()

    from safetensors.torch import load_file, save_file

    from verl_mega.hybrid.pool_sync import PoolWeightSync
    from verl_mega.hybrid.producer import WeightProducer
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import iter_hf_tensors, load_hf_weights
    from verl_mega.parallel.placement import Placement, Pool
    from verl_mega.parallel.state import build_groups, init_world

    init_world(timeout_s=300)
    rank, world = dist.get_rank(), dist.get_world_size()
    train_size = args.tp * args.pp
    placement = Placement(world, (Pool(name="train", ranks=tuple(range(train_size)), tp=args.tp, pp=args.pp,
                                               gen_tp=args.gen_tp),
                                  Pool(name="gen", ranks=tuple(range(train_size, world)), gen_tp=args.gen_tp,
                                       trains=False)),
                          {"actor": "train", "rollout": "gen"})
    groups = build_groups(placement)
    trains = rank < train_size
    arch = arch_from_hf(load_hf_config(args.model_dir))
    work = Path(args.work)
    producer = model = None
    if trains:
        cfg = transformer_config(arch, tp=args.tp, pp=args.pp, use_cpu_initialization=True)
        chunks = build_model_chunks(arch, cfg, groups, use_te="false")
        load_hf_weights(chunks, HFCheckpointReader(args.model_dir), arch, groups)
        producer = WeightProducer(groups=groups, arch=arch, chunks=chunks)

    def publish(round_: int) -> None:  # the training pool's current full HF tensors, for the receivers to check
        if trains:
            perturb(chunks, arch, {**groups.coords, "tp": groups.coords["tp"] + 10 * round_})
            full = {n: t.clone() for n, t in iter_hf_tensors(chunks, arch, groups)}
            if rank == 0:
                save_file(full, str(work / f"full{round_}.safetensors"))
        dist.barrier()

    publish(0)
    tg, j = args.gen_tp, groups.coords["gen_tp"]

    def expected_of(round_: int) -> dict[str, torch.Tensor]:
        full = load_file(str(work / f"full{round_}.safetensors"))
        return vllm_slices(full, tg, j)

    if not trains:
        model = receiver_module(expected_of(0), arch.vocab_size, tg, j)
    sync = PoolWeightSync(placement, bucket_bytes=4096, device=torch.device("cpu"), producer=producer, model=model)
    report = {"rank": rank, "trains": trains, "block": sync.block, "sends": rank in sync.plan.sources}
    for round_ in (0, 1):
        if round_:
            publish(round_)
        metrics = sync.sync()
        if trains:
            report[f"sent{round_}"] = metrics["weight_sync/bytes_sent"]
            continue
        expected = expected_of(round_)
        params = dict(model.named_parameters())
        assert set(params) == set(expected), (sorted(params), sorted(expected))
        for name, want in expected.items():
            got = params[name]
            assert torch.equal(got, want), f"rank {rank} round {round_}: {name} max diff {(got - want).abs().max()}"
        model_bytes = sum(t.numel() * t.element_size() for t in expected.values())
        assert metrics["weight_sync/bytes_received"] == model_bytes, (metrics, model_bytes)
        report[f"received{round_}"] = metrics["weight_sync/bytes_received"]
        report["model_bytes"] = model_bytes
    everyone = [None] * world
    dist.all_gather_object(everyone, report)
    if rank == 0:
        print("POOLSYNC " + json.dumps({"ranks": everyone}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
