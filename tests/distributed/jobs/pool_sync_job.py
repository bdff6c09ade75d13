"""torchrun job: weights from a training pool (Megatron-Core, gloo) to a rollout pool, in buckets, checked against
the perturbed model's full HF tensors sliced and fused by hand into vLLM's layout.

Args: --tp --pp [--gen-tp] [--dtype] --model-dir DIR --work DIR; the training pool is the first tp·pp ranks, the
other ranks are rollout engines of gen_tp ranks each. Each rollout rank holds a module with vLLM's parameter names,
shapes and dtypes for its rank j (qkv_proj = [q_j; k_j; v_j], gate_up_proj = [gate_j; up_j], MLA's
fused_qkv_a_proj = [q_a; kv_a], experts fused into w13 / w2, vocabulary rows padded to 64 and split; DeepSeek's
correction bias fp32 in a bf16 model, as vLLM keeps it), filled with NaN before the sync.
Checks: every parameter equals the hand-fused tensor exactly, in its dtype, after each of two syncs (the second after
the weights changed again, the correction bias by one router update); the MLA layers re-derived their absorbed
weights from the new kv_b_proj; each rollout rank received exactly its model's bytes; only one training rank sent.
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
    column-parallel ones by rows ([q_j; k_j; v_j] and [gate_j; up_j] when fused; MLA's q_b_proj / kv_b_proj), routed
    experts stacked into w13 [E, 2f/tg, h] and w2 [E, h, f/tg], the vocabulary padded to 64 rows and split evenly,
    norms, routers, their correction bias and MLA's latent down projections ([q_a; kv_a]) whole."""
    def rows(t: torch.Tensor, parts: int = tg) -> torch.Tensor:
        return t.chunk(parts, dim=0)[j]

    out = {}
    experts: dict[str, int] = {}  # MoE block → number of routed experts
    for name, t in hf.items():
        if ".experts." in name:  # routed experts (a shared expert is ``shared_expert(s).``)
            block, _, rest = name.partition(".experts.")
            experts[block] = max(experts.get(block, 0), int(rest.split(".")[0]) + 1)
        elif ".self_attn.q_proj." in name:
            k, v = hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat([rows(t), rows(k), rows(v)])
        elif ".q_a_proj." in name:
            out[name.replace("q_a_proj", "fused_qkv_a_proj")] = torch.cat(
                [t, hf[name.replace("q_a_proj", "kv_a_proj_with_mqa")]])
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([rows(t), rows(hf[name.replace("gate_proj",
                                                                                                    "up_proj")])])
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            padded = -(-t.shape[0] // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
            out[name] = rows(torch.cat([t, t.new_zeros(padded - t.shape[0], t.shape[1])]))
        elif any(k in name for k in (".o_proj.weight", ".down_proj.weight")):
            out[name] = t.chunk(tg, dim=1)[j]
        elif any(k in name for k in (".q_b_proj.", ".kv_b_proj.")):
            out[name] = rows(t)
        elif not any(k in name for k in (".k_proj.", ".v_proj.", ".up_proj.", ".kv_a_proj_with_mqa.")):
            out[name] = t
    for block, n in experts.items():
        expert = [{p: hf[f"{block}.experts.{e}.{p}_proj.weight"] for p in ("gate", "up", "down")} for e in range(n)]
        out[f"{block}.experts.w13_weight"] = torch.stack([torch.cat([rows(x["gate"]), rows(x["up"])]) for x in expert])
        out[f"{block}.experts.w2_weight"] = torch.stack([x["down"].chunk(tg, dim=1)[j] for x in expert])
    return out


class LatentAttention(torch.nn.Module):
    """vLLM's MLA layer as the in-place transport sees it: once its kv_b_proj is written, the transport re-runs the
    post-load step that derives W_UK_T / W_UV from it; here that step records the kv_b_proj it derived them from."""

    def __init__(self) -> None:
        super().__init__()
        self.W_UV = self.derived_from = None

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        self.derived_from = self.kv_b_proj.weight.detach().clone()


def receiver_module(expected: dict[str, torch.Tensor], vocab: int, tg: int, j: int) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, t in expected.items():
        *path, pname = name.split(".")
        mod = root
        for i, part in enumerate(path):
            if not hasattr(mod, part):
                mla = f"{'.'.join(path[:i + 1])}.kv_b_proj.weight" in expected
                mod.add_module(part, LatentAttention() if mla else torch.nn.Module())
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
    ap.add_argument("--dtype", default="float32", help="Megatron's and vLLM's dtype")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--work", required=True)
    args = ap.parse_args()

    from safetensors.torch import load_file, save_file

    from verl_mega.hybrid.pool_sync import PoolWeightSync
    from verl_mega.hybrid.producer import WeightProducer
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import iter_hf_tensors, load_hf_weights, unwrap
    from verl_mega.models.weights import MAPPED_BUFFERS
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
        cfg = transformer_config(arch, tp=args.tp, pp=args.pp, use_cpu_initialization=True, dtype=args.dtype)
        chunks = build_model_chunks(arch, cfg, groups, use_te="false")
        load_hf_weights(chunks, HFCheckpointReader(args.model_dir), arch, groups)
        producer = WeightProducer(groups=groups, arch=arch, chunks=chunks)

    def publish(round_: int) -> None:  # the training pool's current full HF tensors, for the receivers to check
        if trains:
            perturb(chunks, arch, {**groups.coords, "tp": groups.coords["tp"] + 10 * round_})
            for chunk in chunks if round_ else []:  # DeepSeek's fp32 correction bias: one router update (1e-3)
                for name, buf in unwrap(chunk).named_buffers():
                    if name.endswith(MAPPED_BUFFERS):
                        buf.add_(1e-3)
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
        # by name, as vLLM registers them (safetensors stores fp32 tensors first, and a layout must not take its
        # dtype from whichever parameter comes first)
        model = receiver_module(dict(sorted(expected_of(0).items())), arch.vocab_size, tg, j)
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
            assert got.dtype == want.dtype and torch.equal(got, want), \
                f"rank {rank} round {round_}: {name} ({got.dtype}) max diff {(got.float() - want.float()).abs().max()}"
        for mname, module in model.named_modules():  # vLLM re-derived W_UK_T / W_UV from the kv_b_proj just sent
            if isinstance(module, LatentAttention):
                assert torch.equal(module.derived_from, expected[f"{mname}.kv_b_proj.weight"]), mname
                report["mla_refreshed"] = report.get("mla_refreshed", 0) + 1
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
