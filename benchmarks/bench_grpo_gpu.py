"""GRPO throughput: verl_mega (3D-HybridEngine + in-process vLLM + overlapped scoring) vs a plain baseline, same run.

The baseline is what an RL loop looks like without a hybrid engine: every rank keeps a full HF transformers replica
of the actor, generates its share of the prompts with ``model.generate``, and after each update receives the full
weights gathered from the Megatron shards (``iter_hf_tensors`` → ``copy_``); every stage runs one after another.
Everything else — Megatron actor and reference, log-probs, GRPO advantages, the PPO update — is the same code.

    # GPU (2 GPUs, tp=2): a Qwen2.5-1.5B-architecture model with random weights, fixed-length generations
    torchrun --nproc-per-node 2 benchmarks/bench_grpo_gpu.py --model-dir /tmp/qwen1.5b --out grpo.json
    # CPU smoke run of the same code on the bundled tiny model
    torchrun --nproc-per-node 2 benchmarks/bench_grpo_gpu.py --tiny --out grpo_cpu.json

Prints a per-stage table and writes the per-step numbers as JSON.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from long_tail import LengthDist  # noqa: E402

from verl_mega.trainer.rl_trainer import RLTrainer  # noqa: E402
from verl_mega.trainer.transfer import SamplePath  # noqa: E402

STAGES = ("rollout", "reward", "old_logprob", "ref_logprob", "advantage", "actor_update", "weight_sync")


LENGTHS: LengthDist | None = None  # set by --lengths lognormal


def _long_tailed_vllm() -> None:
    """Give every prompt of a vLLM call its own max_tokens from :data:`LENGTHS`."""
    from dataclasses import replace

    from verl_mega.rollout.base import SamplingSpec
    from verl_mega.rollout.vllm_rollout import VLLMRollout

    plain = VLLMRollout.generate

    def generate(self, prompt_token_ids, sampling):
        if LENGTHS is None or not isinstance(sampling, SamplingSpec):
            return plain(self, prompt_token_ids, sampling)
        specs = [replace(sampling, max_tokens=LENGTHS.of(p), min_tokens=0,
                         seed=None if sampling.seed is None else sampling.seed + i)
                 for i, p in enumerate(prompt_token_ids)]
        return plain(self, prompt_token_ids, specs)

    VLLMRollout.generate = generate


class _SampledLogprobs:
    """HF logits processor that records the log-prob of each sampled token: at step t+1 the token sampled at step t
    is the last input id, so only one step's log-softmax is ever held (not the whole (steps, batch, vocab) tensor)."""

    def __init__(self) -> None:
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def take(self, tokens: torch.Tensor) -> None:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, tokens[:, None])[:, 0])
            self.prev = None


class HFGenerateRollout:
    """The :class:`~verl_mega.rollout.colocated.Rollout` of a loop without a hybrid engine: a full HF replica per
    rank generates its share with ``model.generate``; new weights arrive as full tensors gathered from the shards."""

    def __init__(self, hf_model: torch.nn.Module, *, actor_engine, arch, tokenizer, rollout_cfg) -> None:
        self.hf_model, self.engine, self.arch = hf_model, actor_engine, arch
        self.tokenizer, self.rcfg, self.weight_version = tokenizer, rollout_cfg, 0
        self.hf_params = dict(hf_model.named_parameters())
        self.update_weights()

    @torch.no_grad()
    def generate(self, prompt_ids, specs, *, on_finished=None):
        from verl_mega.rollout.base import Generated, Sample

        (spec,) = specs
        world, rank = dist.get_world_size(), dist.get_rank()
        per = -(-len(prompt_ids) // world)
        mine = list(range(rank * per, min(len(prompt_ids), (rank + 1) * per)))
        device = next(self.hf_model.parameters()).device
        pad = self.tokenizer.pad_token_id or 0
        width = max(len(prompt_ids[i]) for i in mine)
        ids = torch.full((len(mine), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for row, i in enumerate(mine):  # left padding: generation continues from the last column
            p = prompt_ids[i]
            ids[row, width - len(p):] = torch.tensor(p)
            attn[row, width - len(p):] = 1
        recorder = _SampledLogprobs()
        torch.manual_seed(spec.seed + (mine[0] if mine else 0))
        # with long-tailed lengths the batch runs until its longest sample stops, as HF generate does with EOS
        stop = [LENGTHS.of(prompt_ids[i]) if LENGTHS else spec.max_tokens for i in mine]
        longest = max(stop, default=spec.max_tokens)
        out = self.hf_model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device), do_sample=True, temperature=spec.temperature,
            top_p=spec.top_p, top_k=spec.top_k, num_return_sequences=spec.n, max_new_tokens=longest,
            min_new_tokens=longest if spec.ignore_eos else 0,
            eos_token_id=None if spec.ignore_eos else self.tokenizer.eos_token_id, pad_token_id=pad,
            logits_processor=[recorder])
        new = out[:, width:]
        recorder.take(new[:, -1])
        lps = torch.stack(recorder.steps, dim=1).cpu() if recorder.steps else torch.zeros(len(new), 0)
        local = []
        eos = self.tokenizer.eos_token_id
        for row, tokens in enumerate(new.cpu().tolist()):
            tokens = tokens[:stop[row // spec.n]]
            if not spec.ignore_eos and eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]  # keep EOS, drop the padding after it
            local.append(Sample(mine[row // spec.n], tokens, lps[row, : len(tokens)].tolist()))
        return [Generated(local, self.weight_version, engine=rank, leader=True)]  # each rank is an engine

    def update_weights(self):
        from verl_mega.models.loader import iter_hf_tensors

        t0 = time.perf_counter()
        with torch.no_grad():
            for name, tensor in iter_hf_tensors(self.engine.chunks, self.arch, self.engine.groups):
                self.hf_params[name].copy_(tensor)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.weight_version += 1
        return {"sync/seconds": time.perf_counter() - t0}

    def prefetch(self, requests) -> None:  # generates in the trainer's processes: nothing to send ahead
        pass

    def release_memory(self) -> None:
        pass

    def restore_memory(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class HFGenerateBaseline(RLTrainer):
    """The same RL step on the HF-generate rollout, with no stage overlap."""

    overlap_host_stages = False


def make_model(path: Path, tiny: bool, arch: str = "1.5b") -> None:
    """A random-weight model plus the bundled character tokenizer, built once (other ranks wait on the lock).
    ``arch``: the Qwen2.5-1.5B or -7B architecture (ignored with ``tiny``)."""
    from verl_mega.models.tiny import build_char_tokenizer, make_tiny_hf_model

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "config.json").exists():
            return
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        if tiny:
            make_tiny_hf_model(tmp, seed=0, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                               num_kv_heads=2, tie_word_embeddings=True)
        else:
            from bench_model_gpu import QWEN25_7B
            from bench_model_gpu import make_model as make_qwen

            tmp.mkdir(parents=True)
            make_qwen(tmp, QWEN25_7B if arch == "7b" else None)
            torch.cuda.empty_cache()  # vLLM's memory profiling must not see this memory being released later
            # reserved tokens fill the tokenizer up to the model's vocabulary, as a real model's would
            build_char_tokenizer(tmp, fill_to=json.loads((tmp / "config.json").read_text())["vocab_size"])
        os.replace(tmp, path)


def run_steps(trainer, job, steps: int) -> list[dict[str, float]]:
    out = []
    for _ in range(steps):
        out.append(trainer.step(job.loader.next_batch()))
    return out


def summarise(steps: list[dict[str, float]], world: int, arch=None, samples: int = 0,
              frozen_base: bool = False, old_in_update: bool = False) -> dict[str, float]:
    """Mean stage times and rates; ``old_in_update``: the old log-probs came from the update (no pass of theirs)."""
    def mean(key: str) -> float:
        vals = [s[key] for s in steps if key in s]
        return statistics.fmean(vals) if vals else 0.0

    res = {f"{st}_s": mean(f"timing/{st}_s") for st in STAGES}
    res["step_s"] = mean("timing/step_s")
    gen, prompt = mean("count/tokens"), mean("count/prompt_tokens")
    res["generated_tokens"], res["prompt_tokens"] = gen, prompt
    res["tokens_per_s_per_gpu"] = (gen + prompt) / res["step_s"] / world
    res["generated_tokens_per_s_per_gpu"] = gen / res["step_s"] / world
    res["rollout_tokens_per_s"] = gen / res["rollout_s"] if res["rollout_s"] else 0.0
    res["logprob_diff_mean"] = mean("rollout/logprob_diff_mean")
    res["overlap_efficiency"] = mean("overlap/efficiency")
    res["tflops_per_gpu"] = mean("perf/tflops_per_device")  # model FLOPs of the whole step, rollout included
    res["mfu"] = mean("perf/mfu")
    res["rollout_prefill_s"] = mean("timing/rollout/prefill_s")
    res["rollout_decode_s"] = mean("timing/rollout/decode_s")
    res["decode_step_ms"] = mean("timing/decode_step_ms")
    if arch is not None and samples:
        # model FLOPs (6N + 12·L·H·s per token, s = the mean sequence length) of the stages over the batch's tokens
        from verl_mega.models.flops import transformer_flops_per_token

        tokens, context = gen + prompt, (gen + prompt) / samples
        for stage, training in (("actor_update", True), ("old_logprob", False), ("ref_logprob", False)):
            per_token = transformer_flops_per_token(arch.num_layers, arch.hidden_size, arch.ffn_hidden_size,
                                                    arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                                    arch.vocab_size, int(context), training,
                                                    frozen_base=frozen_base and stage == "actor_update")
            seconds = res[f"{stage}_s"]
            ran = seconds and not (old_in_update and stage == "old_logprob")
            res[f"{stage}_tflops_per_gpu"] = per_token * tokens / seconds / world / 1e12 if ran else 0.0
        res["mean_sequence_length"] = context
    return res


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The model and batch arguments shared by the RL-step benchmarks."""
    ap.add_argument("--model-dir", default=None, help="where the random model is built once (default under /tmp)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run on the bundled tiny model")
    ap.add_argument("--arch", choices=["1.5b", "7b"], default="1.5b",
                    help="the random model's architecture (Qwen2.5-1.5B or -7B); 7B needs LoRA on one GPU")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="samples per prompt (the GRPO group)")


def run_baseline(args, cfg, job, model_dir: Path, cpu: bool, rank: int) -> list[dict]:
    """The HF-generate baseline's steps, after the hybrid engine's (vLLM gives its memory back first)."""
    job.rollout.release_memory()  # vLLM gives back its weights and KV cache: the baseline has the GPU to itself

    from transformers import AutoModelForCausalLM

    t = job.trainer
    replica = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32 if cpu else torch.bfloat16)
    replica = replica.to("cpu" if cpu else "cuda").eval()
    hf_rollout = HFGenerateRollout(replica, actor_engine=t.actor.engine, arch=job.arch, tokenizer=t.tokenizer,
                                   rollout_cfg=cfg.rollout)
    pool = job.placement.pool_of("actor")
    path = SamplePath(pool, rank, group=t.path.group, max_length=cfg.rollout.max_response_length,
                      balance=cfg.trainer.balance_batch, engines=[(r,) for r in pool.ranks])
    baseline_trainer = HFGenerateBaseline(cfg, actor=t.actor, ref=t.ref, critic=t.critic, reward_model=None,
                                          rollout=hf_rollout, reward_pool=t.reward_pool, tokenizer=t.tokenizer,
                                          profiler=job.profiler, kl_ctrl=t.kl_ctrl, sample_path=path, arch=job.arch)
    baseline_trainer.old_logprobs_in_update = False  # the plain loop, as measured before: every stage a pass of its own
    return run_steps(baseline_trainer, job, args.warmup + args.baseline_steps)[args.warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(ap)
    ap.add_argument("--response-length", type=int, default=512, help="fixed generation length")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of the hybrid engine")
    ap.add_argument("--baseline-steps", type=int, default=2, help="timed steps of the baseline (0: no baseline)")
    ap.add_argument("--gen-tp", type=int, default=None, help="vLLM tensor parallel size (default: the world size)")
    ap.add_argument("--lengths", choices=["fixed", "lognormal"], default="fixed",
                    help="fixed: every sample --response-length tokens; lognormal: per-prompt lengths with median "
                         "--response-length/4, log-std 1.0, clipped to [16, --response-length]")
    ap.add_argument("--old-logprobs", choices=["auto", "separate", "both"], default="auto",
                    help="auto: from the update where exact (the trainer's default); separate: always their own pass; "
                         "both: the timed steps with their own pass, then the same batches again from the update")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*",
                    help="extra config overrides for both runs, e.g. actor.use_dynamic_bsz=true")
    args = ap.parse_args()

    from verl_mega.config import load_config
    from verl_mega.trainer.setup import build_job

    global LENGTHS
    if args.lengths == "lognormal":
        LENGTHS = LengthDist(median=args.response_length // 4, sigma=1.0, low=16, high=args.response_length)
        _long_tailed_vllm()
    default = "/tmp/verl_mega_bench/" + ("tiny-random" if args.tiny else f"qwen2.5-{args.arch}-random-v2")
    model_dir = Path(args.model_dir or default)
    make_model(model_dir, args.tiny, args.arch)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = not torch.cuda.is_available()
    total = 2 * (args.warmup + max(args.steps, args.baseline_steps)) + 2
    overrides = [
        f"model.path={model_dir}", f"model.dtype={'float32' if cpu else 'bfloat16'}", f"parallel.tp={world}",
        f"rollout.gen_tp={args.gen_tp or world}", f"rollout.n={args.group_size}",
        f"rollout.max_response_length={args.response_length}",
        "rollout.ignore_eos=true", f"data.train_batch_size={args.prompts}",
        f"actor.ppo_mini_batch_size={args.prompts}", "actor.micro_batch_size_per_gpu=8",
        "actor.log_prob_micro_batch_size_per_gpu=16", f"trainer.total_steps={total}", "trainer.save_every=0",
        "trainer.resume=off", f"trainer.output_dir={Path(args.out).resolve().parent / 'bench_run'}",
        "logging.tensorboard=false",
        "logging.plot=false", "logging.progress_bar=false", "actor.lr=1e-6", "trainer.deterministic=false",
    ] + (["rollout.kv_cache_memory_bytes=268435456", "rollout.enforce_eager=true"] if cpu else
         ["rollout.kv_cache_memory_bytes=null", "rollout.gpu_memory_utilization=0.35", "rollout.enforce_eager=false"]
         ) + list(args.overrides)
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/quickstart_cpu.yaml", overrides)
    job = build_job(cfg)
    rank = dist.get_rank()

    separate = None
    if args.old_logprobs != "auto":
        exact = job.trainer.old_logprobs_in_update
        job.trainer.old_logprobs_in_update = False
        run_steps(job.trainer, job, args.warmup)
        if args.old_logprobs == "both":  # the same batches (and lengths) twice: their own pass, then the update's
            start = job.loader.state_dict()
            separate = run_steps(job.trainer, job, args.steps)
            job.loader.load_state_dict(start)
            job.trainer.old_logprobs_in_update = exact
        hybrid = run_steps(job.trainer, job, args.steps)
    else:
        hybrid = run_steps(job.trainer, job, args.warmup + args.steps)[args.warmup:]
    baseline = run_baseline(args, cfg, job, model_dir, cpu, rank) if args.baseline_steps else None

    if rank == 0:
        samples = args.prompts * args.group_size
        lora = cfg.model.lora.enabled  # a frozen base: the update computes no weight gradients
        h = summarise(hybrid, world, job.arch, samples, frozen_base=lora,
                      old_in_update=job.trainer.old_logprobs_in_update)
        b = summarise(baseline, world, job.arch, samples, frozen_base=lora) if baseline else None
        sep = summarise(separate, world, job.arch, samples, frozen_base=lora) if separate else None
        result = {"world": world, "device": torch.cuda.get_device_name() if not cpu else "cpu",
                  "lengths": args.lengths, "overrides": list(args.overrides), "prompts": args.prompts,
                  "n": args.group_size, "response_length": args.response_length,
                  "model_dir": str(model_dir), "hybrid": h, "baseline": b,
                  "speedup_step": b["step_s"] / h["step_s"] if b else None, "hybrid_steps": hybrid,
                  "baseline_steps": baseline, "old_logprobs": args.old_logprobs,
                  "old_logprobs_in_update": bool(job.trainer.old_logprobs_in_update),
                  "hybrid_separate_old_logprobs": sep, "hybrid_separate_steps": separate}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"{'stage (mean s/step)':<34}{'verl_mega':>12}{'HF baseline':>14}"
              + (f"{'own old-lp pass':>17}" if sep else ""))
        for key in [f"{s}_s" for s in STAGES] + ["step_s", "tokens_per_s_per_gpu", "generated_tokens_per_s_per_gpu",
                                                  "rollout_tokens_per_s", "logprob_diff_mean", "overlap_efficiency",
                                                  "tflops_per_gpu", "mfu", "rollout_prefill_s", "rollout_decode_s",
                                                  "decode_step_ms", "actor_update_tflops_per_gpu",
                                                  "old_logprob_tflops_per_gpu", "mean_sequence_length"]:
            print(f"{key:<34}{h[key]:>12.3f}" + (f"{b[key]:>14.3f}" if b else f"{'-':>14}")
                  + (f"{sep[key]:>17.3f}" if sep else ""))
        if b:
            print(f"speed-up (step time): {result['speedup_step']:.2f}x")
    job.close()


if __name__ == "__main__":
    main()
