"""vLLM generation on one GPU, measured before building on it: FP8 weight formats and the share of prefill.

``fp8``: for each weight format, a fresh process builds vLLM on a random-weight model (a config.json alone,
``load_format=dummy``) and reports (a) the parameters of layer 0 after vLLM's post-load processing (name, dtype,
shape, stride: the layout an in-place weight sync must write) and (b) generation tokens/s on the long-tailed
workload (lognormal lengths, EOS ignored). Formats: ``bf16``; ``fp8`` (vLLM's online quantization, one scale per
tensor); ``fp8-channel`` (compressed-tensors: one scale per output channel, activations per token); ``fp8-block``
(128 x 128 blocks, DeepSeek's format); ``fp8-w8a16`` (weights per channel, activations in bf16); each optionally
with ``+kv8`` (an FP8 KV cache), ``+marlin`` (vLLM's weight-only FP8 Marlin kernel, which it uses on Hopper only
when forced) and ``+cq`` (the activations' per-token quantization by vLLM's CUDA ``quant_fp8`` op, fused with the
RMSNorm in front of it by vLLM's own pass, instead of the kernels Inductor generates). Each format also times a
small batch (8 requests x 512 tokens): the long tail's regime.

``decode``: where a decode step's time goes at small and large batches (the long tail is a few sequences decoding
for thousands of steps). Per format and batch size: wall ms per step, and from torch's profiler the GPU's busy ms per
step (the sum of its kernels' times); wall well above busy means the step waits on the host.

``prefill``: how much of a rollout is prefill. The same requests run once in full and once with ``max_tokens=1``
(prefill plus one token), for short prompts with long-tailed responses (the RL workload) and for long prompts
(multi-turn contexts), at several ``max_num_batched_tokens`` (chunked prefill's budget per engine step).

    python benchmarks/probe_rollout_gpu.py fp8 --model 1.5b --formats bf16,fp8,fp8-channel,fp8-block --json fp8.json
    python benchmarks/probe_rollout_gpu.py decode --model 7b --formats bf16,fp8-channel --json decode.json
    python benchmarks/probe_rollout_gpu.py prefill --model 1.5b --json prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from long_tail import LengthDist  # noqa: E402

QWEN = {
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "tie_word_embeddings": True, "vocab_size": 151936},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "tie_word_embeddings": False, "vocab_size": 152064},
}
COMMON = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
          "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "initializer_range": 0.02,
          "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "bfloat16"}
QUANT = {
    "fp8-channel": {"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                    "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                              "symmetric": True, "dynamic": True}}},
                    "ignore": ["lm_head"]},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
}
# weight-only FP8, one scale per output channel, activations stay bf16 (vLLM's W8A16 scheme: its Marlin kernel)
QUANT["fp8-w8a16"] = {**QUANT["fp8-channel"], "config_groups": {"group_0": {
    k: v for k, v in QUANT["fp8-channel"]["config_groups"]["group_0"].items() if k != "input_activations"}}}


def split_format(fmt: str) -> tuple[str, set[str]]:
    base, *flags = fmt.split("+")
    return base, set(flags)


def model_dir(root: Path, model: str, fmt: str) -> Path:
    base, _ = split_format(fmt)
    path = root / f"{model}-{base}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**COMMON, **QWEN[model]}
    if base in QUANT:
        cfg["quantization_config"] = QUANT[base]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def requests(n_prompts: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(n_prompts)]


def build_llm(path: Path, fmt: str, max_len: int, **kw):
    from vllm import LLM

    extra = {}
    base, flags = split_format(fmt)
    if base == "fp8":
        extra["quantization"] = "fp8"
    if "kv8" in flags:
        extra["kv_cache_dtype"] = "fp8"
    if "marlin" in flags:  # vLLM takes Marlin for FP8 on compute capability >= 8.9 only when forced
        os.environ["VLLM_TEST_FORCE_FP8_MARLIN"] = "1"
        extra["kernel_config"] = {"linear_backend": "marlin"}
    if "cq" in flags:  # vLLM's CUDA per-token quantization op (and with it its RMSNorm + quant fusion), not Inductor's
        extra["compilation_config"] = {"custom_ops": ["+quant_fp8"]}
    return LLM(model=str(path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
               max_model_len=max_len, gpu_memory_utilization=0.8, enable_prefix_caching=False, **extra, **kw)


def timed_generate(llm, prompts, lengths, n: int) -> dict:
    import torch
    from vllm import SamplingParams, TokensPrompt

    params = [SamplingParams(n=n, max_tokens=m, ignore_eos=True, temperature=1.0, seed=1000 + i)
              for i, m in enumerate(lengths)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def layer0(llm) -> dict:
    """Layer 0's parameters and buffers after vLLM's post-load processing, and the modules' quant methods."""

    def probe(model):
        layer = model.model.layers[0]
        params = {n: [str(t.dtype), list(t.shape), list(t.stride())]
                  for n, t in list(layer.named_parameters()) + list(layer.named_buffers())}
        methods = {n: type(getattr(m, "quant_method", None)).__name__ for n, m in layer.named_modules()
                   if getattr(m, "quant_method", None) is not None}
        extra = {n: [type(getattr(m, "scheme", None)).__name__] for n, m in layer.named_modules()
                 if getattr(m, "scheme", None) is not None}
        return {"params": params, "quant_methods": methods, "schemes": extra}

    return llm.apply_model(probe)[0]


def one_format(args) -> None:
    """Child process: one format."""
    path = model_dir(Path(args.root), args.model, args.fmt)
    lengths = LengthDist(args.median, 1.0, 1, args.high)
    prompts = requests(args.prompts, args.prompt_len, QWEN[args.model]["vocab_size"])
    per_prompt = [lengths.of_key(str(i)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    llm = build_llm(path, args.fmt, args.prompt_len + args.high + 8, max_num_seqs=args.prompts * args.n)
    init_s = time.perf_counter() - t0
    result = {"format": args.fmt, "init_s": init_s}
    try:
        result["layer0"] = layer0(llm)
    except Exception as exc:  # the probe must not cost the timing
        result["layer0_error"] = f"{type(exc).__name__}: {exc}"
    timed_generate(llm, prompts[:4], [16] * 4, 1)  # warm-up
    result["runs"] = [timed_generate(llm, prompts, per_prompt, args.n) for _ in range(args.repeats)]
    result["small_batch"] = timed_generate(llm, prompts[:8], [512] * 8, 1)
    print(json.dumps(result), flush=True)


def one_decode(args) -> None:
    """Child process: decode-step time per batch size for one format, wall against the GPU's busy time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    path = model_dir(Path(args.root), args.model, args.fmt)
    steps = args.decode_steps
    llm = build_llm(path, args.fmt, args.prompt_len + steps + 8, max_num_seqs=256)
    engine_config = llm.llm_engine.vllm_config
    result = {"format": args.fmt, "steps": steps,
              "async_scheduling": bool(engine_config.scheduler_config.async_scheduling),
              "cudagraph_mode": str(engine_config.compilation_config.cudagraph_mode), "batches": {}}
    prompts = requests(max(args.batches), args.prompt_len, QWEN[args.model]["vocab_size"])
    timed_generate(llm, prompts[:4], [16] * 4, 1)  # warm-up
    for b in args.batches:
        wall = timed_generate(llm, prompts[:b], [steps] * b, 1)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed_generate(llm, prompts[:b], [steps] * b, 1)
        kernels: dict[str, float] = {}  # a kernel's name cut short, summed over the templates that share it
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                kernels[e.key[:90]] = kernels.get(e.key[:90], 0.0) + e.self_device_time_total
        busy_us = sum(kernels.values())
        result["batches"][b] = {"wall_ms_per_step": wall["seconds"] * 1e3 / steps,
                                "gpu_busy_ms_per_step": busy_us / 1e3 / steps, "tokens_per_s": wall["tokens_per_s"],
                                "top_kernels_us_per_step": {k: round(v / steps, 1) for k, v in sorted(
                                    kernels.items(), key=lambda kv: -kv[1])[:12]}}
    print(json.dumps(result), flush=True)


def one_prefill(args) -> None:
    """Child process: the prefill share at one max_num_batched_tokens."""
    path = model_dir(Path(args.root), args.model, "bf16")
    out = {"max_num_batched_tokens": args.budget, "cases": {}}
    llm = build_llm(path, "bf16", 8192 + 1024 + 8, max_num_seqs=256,
                    **({"max_num_batched_tokens": args.budget} if args.budget else {}))
    timed_generate(llm, requests(4, 64, 1000), [8] * 4, 1)
    vocab = QWEN[args.model]["vocab_size"]
    cases = {"rl-short-prompts": (32, 128, 8, LengthDist(128, 1.0, 1, 1024)),
             "long-context-8k": (16, 8192, 4, LengthDist(128, 1.0, 1, 1024))}
    for name, (n_prompts, plen, n, dist) in cases.items():
        prompts = requests(n_prompts, plen, vocab, seed=plen)
        lengths = [dist.of_key(str(i)) for i in range(n_prompts)]
        full = timed_generate(llm, prompts, lengths, n)
        first = timed_generate(llm, prompts, [1] * n_prompts, n)
        out["cases"][name] = {"full": full, "prefill_plus_one": first,
                              "prefill_share": first["seconds"] / full["seconds"],
                              "prompt_tokens": n_prompts * plen, "samples": n_prompts * n}
    print(json.dumps(out), flush=True)


def run_children(argv_list: list[list[str]], save=None) -> list[dict]:
    """One fresh process per argv; ``save(results)`` after each, so a run cut short keeps what it measured."""
    results = []
    for argv in argv_list:
        proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                              env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
        if proc.returncode != 0 or line is None:
            results.append({"argv": argv, "error": proc.stderr[-3000:]})
        else:
            results.append(json.loads(line))
        # a failure's cause is at the end of its traceback; a result's timings before its (long) layer listing
        text = json.dumps({k: v for k, v in results[-1].items() if k != "layer0"})
        print(text[-2000:] if "error" in results[-1] else text[:2000], flush=True)
        if save is not None:
            save(results)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["fp8", "decode", "prefill", "_format", "_decode", "_prefill"])
    ap.add_argument("--model", choices=list(QWEN), default="1.5b")
    ap.add_argument("--formats", default="bf16,fp8,fp8-channel,fp8-block")
    ap.add_argument("--fmt", default="bf16")
    ap.add_argument("--budgets", default="0,2048", help="max_num_batched_tokens values (0: vLLM's default)")
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--median", type=int, default=256)
    ap.add_argument("--high", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8, 64, 256])
    ap.add_argument("--decode-steps", type=int, default=512)
    ap.add_argument("--root", default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.what == "_format":
        return one_format(args)
    if args.what == "_prefill":
        return one_prefill(args)
    if args.what == "_decode":
        return one_decode(args)
    root = args.root or tempfile.mkdtemp(prefix="probe_rollout_")
    common = ["--model", args.model, "--root", root, "--prompts", str(args.prompts), "--n", str(args.n),
              "--prompt-len", str(args.prompt_len), "--median", str(args.median), "--high", str(args.high),
              "--repeats", str(args.repeats)]

    def save(results: list[dict]) -> None:
        if not args.json:
            return
        import torch
        import vllm

        args.json.write_text(json.dumps({"what": args.what, "args": {k: str(v) for k, v in vars(args).items()},
                                         "device": torch.cuda.get_device_name(), "vllm": vllm.__version__,
                                         "torch": torch.__version__, "results": results}, indent=1))

    if args.what in ("fp8", "decode"):
        child = "_format" if args.what == "fp8" else "_decode"
        extra = ["--batches", ",".join(map(str, args.batches)), "--decode-steps", str(args.decode_steps)]
        run_children([[child, "--fmt", f, *common, *extra] for f in args.formats.split(",")], save)
    else:
        run_children([["_prefill", "--budget", b, *common] for b in args.budgets.split(",")], save)

if __name__ == "__main__":
    main()
