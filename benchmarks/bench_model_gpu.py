"""GPU model benchmark (run on a CUDA machine; prints a table and writes JSON).

    # parity at tp=2 (2 GPUs) — mcore (our SDPA spec, bf16) vs HF transformers (bf16) logits:
    torchrun --nproc-per-node 2 benchmarks/bench_model_gpu.py parity --out parity.json
    # fwd+bwd throughput on 1 GPU: our spec (padded, fused log-probs, packed) vs mcore's local spec vs HF + SDPA at
    # 8×1024 tokens, then long-tailed lengths padded vs packed:
    python benchmarks/bench_model_gpu.py throughput --out throughput.json

The model is a Qwen2.5-1.5B-architecture model with random weights (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

QWEN25_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 1536,
    "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "vocab_size": 151936, "initializer_range": 0.02, "bos_token_id": 151643, "eos_token_id": 151643,
}
QWEN25_7B = {  # the FP8 rollout and the 7B GRPO step
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643, "eos_token_id": 151643,
    "initializer_range": 0.02,
}


def make_model(path: Path, config: dict | None = None) -> None:
    """A random-weight HF model (``config``: :data:`QWEN25_1_5B` by default, or :data:`QWEN25_7B`), bf16, saved to
    ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return
    cfg = AutoConfig.for_model(**(config or QWEN25_1_5B))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(str(path), safe_serialization=True)


def parity(args) -> dict:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoModelForCausalLM

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import load_hf_weights
    from verl_mega.parallel.state import init_distributed

    path = Path(args.model_dir)
    if int(os.environ.get("RANK", "0")) == 0:
        make_model(path)
    groups = init_distributed(tp=int(os.environ.get("WORLD_SIZE", "1")), pp=1)
    tp = groups.size("tp")
    dist.barrier()
    arch = arch_from_hf(load_hf_config(path))
    cfg = transformer_config(arch, tp=tp, dtype="bfloat16")
    chunks = [c.cuda() for c in build_model_chunks(arch, cfg, groups, use_te="false")]
    load_hf_weights(chunks, HFCheckpointReader(path), arch, groups)
    engine = MegatronEngine(chunks, cfg, groups)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, arch.vocab_size, (4, 512), generator=g).cuda()
    pos = torch.arange(512, device="cuda").expand(4, 512)
    res = engine.forward([{"input_ids": ids, "position_ids": pos}],
                         lambda out, mb: {"logits": gather_from_tensor_model_parallel_region(
                             out, group=groups["tp"])[..., :arch.vocab_size]})
    out = {}
    if dist.get_rank() == 0:
        logits = res[0]["logits"].float()
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda().eval()
        with torch.no_grad():
            ref = hf(ids).logits.float()
        lp, lq = torch.log_softmax(ref.double(), -1), torch.log_softmax(logits.double(), -1)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        out = {"tp": tp, "dtype": "bfloat16", "tokens": ids.numel(),
               "logits_max_abs": float((logits - ref).abs().max()),
               "logits_mean_abs": float((logits - ref).abs().mean()),
               "mean_kl_hf_to_mcore": float(kl.mean()), "max_kl": float(kl.max()),
               "argmax_agreement": float((logits.argmax(-1) == ref.argmax(-1)).float().mean())}
        print(json.dumps(out, indent=1))
    dist.barrier()
    return out


def _timed(step, iters: int) -> float:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def _fused_loss(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
    from verl_mega.trainer.micro_batching import next_tokens

    lp, _ = vocab_parallel_logprobs_entropy(logits, next_tokens(ids), vocab_size=vocab, tp_group=None)
    return -lp.mean()


def _time_fwd_bwd(variant: str, arch, args, groups, batches: list[list[int]], profile_to: Path | None = None) -> float:
    """Seconds for forward + backward over ``batches`` (each a list of sequence lengths = one micro-batch).

    ``ours``: our spec with fp32 cross-entropy over the logits (the earlier measurement); ``ours_fused``: the
    chunked log-prob kernel instead; ``ours_eager``: the same with ``model.fused_kernels=false`` (SwiGLU and RMSNorm
    as separate element-wise kernels); ``ours_packed``: the micro-batch's sequences packed (varlen attention), as
    the engine runs them (``forward_packed``), with the chunked kernel; ``local``: mcore's local spec; ``hf``: HF
    transformers with SDPA and its own loss. Our spec compiles SwiGLU and RMSNorm except in ``ours_eager``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from verl_mega.models.build import build_model_chunks, forward_packed
    from verl_mega.models.hf_config import transformer_config

    cfg = transformer_config(arch, dtype="bfloat16", fused_kernels=variant not in ("ours_eager", "local"))
    if variant == "hf":
        from transformers import AutoConfig, AutoModelForCausalLM

        hf_cfg = AutoConfig.for_model(**QWEN25_1_5B)
        hf_cfg._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).cuda().train()
    elif variant == "local":
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                         vocab_size=arch.padded_vocab_size(1), max_sequence_length=4096,
                         share_embeddings_and_output_weights=arch.tie_word_embeddings, position_embedding_type="rope",
                         rotary_base=int(arch.rope_theta), pg_collection=groups.pg_collection).cuda()
    else:
        model = build_model_chunks(arch, cfg, groups, use_te="false")[0].cuda()
    inputs = []
    g = torch.Generator().manual_seed(0)
    for lengths in batches:
        if variant == "ours_packed":
            ids = torch.randint(0, arch.vocab_size, (1, sum(lengths)), generator=g).cuda()
            pos = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
            cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
            inputs.append((ids, pos, (cu, max(lengths))))
        else:  # padded to the micro-batch's longest row
            s = max(lengths)
            ids = torch.randint(0, arch.vocab_size, (len(lengths), s), generator=g).cuda()
            inputs.append((ids, torch.arange(s, device="cuda").expand(len(lengths), s), s))

    def step():
        for ids, pos, extra in inputs:
            if variant == "hf":
                loss = model(input_ids=ids, labels=ids).loss
            elif variant == "ours_packed":
                loss = _fused_loss(forward_packed(model, ids, pos, *extra), ids, arch.vocab_size)
            elif variant == "local":
                causal = torch.triu(torch.ones(extra, extra, dtype=torch.bool, device="cuda"), 1)[None, None]
                logits = model(ids, pos, causal)
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1))
            elif variant in ("ours_fused", "ours_eager"):
                loss = _fused_loss(model(ids, pos, None), ids, arch.vocab_size)
            else:
                logits = model(ids, pos, None)
                loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1))
            loss.backward()

    seconds = _timed(step, args.iters)
    if profile_to is not None:  # where the time goes: one more step under the profiler, kernels by CUDA time
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=90)
        profile_to.write_text(table)
        # and by operator (with input shapes), to tell which op launched which kernel
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
            step()
            torch.cuda.synchronize()
        table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=60,
                                                                   max_name_column_width=60, max_shapes_column_width=70)
        profile_to.with_suffix(".ops.txt").write_text(table)
    model = None  # frees the weights (step() holds the name) before the next model is built
    torch.cuda.empty_cache()
    return seconds


def matmul_peak_flops(n: int = 8192, iters: int = 10, device: str = "cuda", dtype=torch.bfloat16) -> float:
    """Measured dense matmul FLOP/s of this device: ``iters`` n×n @ n×n products after 3 warm-up ones."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ a
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ a
    sync()
    return 2 * n**3 * iters / (time.perf_counter() - t0)


def long_tailed_lengths(n: int, *, median: int, sigma: float, low: int, high: int, seed: int = 0) -> list[int]:
    """``n`` lognormal sequence lengths (median ``median``, log-std ``sigma``) clipped to [low, high]."""
    g = torch.Generator().manual_seed(seed)
    return (median * (sigma * torch.randn(n, generator=g)).exp()).clamp(low, high).long().tolist()


PROFILED = ("ours_fused_logprob", "ours_logprob_eager_elementwise", "ours_packed_fused", "hf_sdpa",
            "longtail_packed_ours_fused")


def throughput(args) -> dict:
    """Forward + backward FLOP/s on one GPU, side by side in one run: fixed 8×1024 micro-batches (our spec with fp32
    cross-entropy, with the fused log-prob kernel, packed; mcore's local spec; HF + SDPA), then long-tailed lengths
    (lognormal) padded per micro-batch of 8 rows vs packed to a token budget (FLOPs of the real tokens only)."""
    from verl_mega.models.hf_config import arch_from_hf
    from verl_mega.parallel.state import init_distributed
    from verl_mega.trainer.micro_batching import first_fit_decreasing
    from verl_mega.models.flops import transformer_flops_per_token

    groups = init_distributed(tp=1, pp=1)
    arch = arch_from_hf(QWEN25_1_5B)
    peak = matmul_peak_flops()

    def flops(lengths: list[int]) -> float:  # model FLOPs of these sequences, each at its own length
        return sum(n * transformer_flops_per_token(arch.num_layers, arch.hidden_size, arch.ffn_hidden_size,
                                                   arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.vocab_size,
                                                   n, True) for n in lengths)

    rows = {}

    def measure(name: str, variant: str, batches: list[list[int]]) -> None:
        profile_to = Path(args.profile_dir) / f"{name}.txt" if args.profile_dir and name in PROFILED else None
        sec = _time_fwd_bwd(variant, arch, args, groups, batches, profile_to)
        tokens = sum(map(sum, batches))
        tflops = sum(flops(b) for b in batches) / sec / 1e12
        rows[name] = {"s_per_iter": sec, "tokens_per_s": tokens / sec, "tflops_per_gpu": tflops,
                      "fraction_of_peak": tflops * 1e12 / peak, "micro_batches": len(batches)}
        print(name, json.dumps(rows[name]), flush=True)

    fixed = [[args.seq_len] * args.micro_batch]
    for name, variant in (("ours_sdpa", "ours"), ("ours_fused_logprob", "ours_fused"),
                          ("ours_logprob_eager_elementwise", "ours_eager"),
                          ("ours_packed_fused", "ours_packed"), ("mcore_local", "local"), ("hf_sdpa", "hf")):
        measure(name, variant, fixed)
    lengths = long_tailed_lengths(64, median=args.seq_len // 3, sigma=0.9, low=32, high=2 * args.seq_len)
    padded = [lengths[i:i + args.micro_batch] for i in range(0, len(lengths), args.micro_batch)]
    packed = [[lengths[i] for i in b] for b in first_fit_decreasing(lengths, args.micro_batch * args.seq_len)]
    measure("longtail_padded_ours_fused", "ours_fused", padded)
    measure("longtail_packed_ours_fused", "ours_packed", packed)
    out = {"model": "Qwen2.5-1.5B architecture (random weights)", "measured_bf16_peak_tflops": peak / 1e12,
           "fixed_tokens_per_micro_batch": args.micro_batch * args.seq_len, "longtail_lengths": lengths, **rows}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["parity", "throughput"])
    ap.add_argument("--model-dir", default="/tmp/qwen25_1_5b_random")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-dir", default=None, help="write a kernel table (torch.profiler) of some variants here")
    args = ap.parse_args()
    result = parity(args) if args.mode == "parity" else throughput(args)
    if args.out and result:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
