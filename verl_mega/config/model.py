"""The `model` config section."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from verl_mega.config.base import ConfigSection, option
from verl_mega.config.hub import expand_home

TINY_MODEL = "tiny"  # special model.path: build the bundled tiny model instead of loading a checkpoint
TinyTask = Literal["arithmetic", "addition_small", "calculator"]  # data.tasks.GENERATED_TASKS (a unit test checks)


LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # the projections every layer has, MoE or not
LORA_TARGETS = (*LORA_ATTENTION, "gate_proj", "up_proj", "down_proj")  # models.lora.HF_TARGETS
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA takes (max_lora_rank)


@dataclass(frozen=True, kw_only=True)
class LoRAConfig(ConfigSection):
    """Low-rank adapters (docs/lora.md): the base model is frozen in `model.dtype` (no fp32 master copy, gradient or
    optimizer state), each targeted projection learns `(alpha/rank)·B·A`, the reference policy is the base with the
    adapters off, and the rollout gets the merged weights through the in-place weight sync."""

    SECTION: ClassVar[str] = "model.lora"

    rank: int = option(0, help="Adapter rank r; 0 disables LoRA (full fine-tuning), and the other model.lora keys "
                                "are then refused. At most 512 with rollout_sync=adapter (vLLM's limit).")
    alpha: float = option(16.0, help="Scaling numerator: adapters add (alpha/rank)·B·A (PEFT's lora_alpha).")
    dropout: float = option(0.0, help="Dropout on the adapters' input while training (PEFT's lora_dropout).")
    target_modules: tuple[str, ...] = option(
        ("all-linear",), help="HF projections that get adapters: any of q_proj, k_proj, v_proj, o_proj, gate_proj, "
                              "up_proj, down_proj, or `all-linear` for all of them. Routed experts of MoE layers "
                              "carry none.")
    init: Literal["kaiming", "gaussian"] = option(
        "kaiming", help="Initialisation of A (B starts at zero, so training starts from the base model): PEFT's "
                        "default Kaiming-uniform, or N(0, 1/rank) (PEFT's `gaussian`).")
    rollout_sync: Literal["merge", "adapter"] = option(
        "merge", help="How vLLM gets the new policy. `merge`: the 3D-HybridEngine writes W + (alpha/rank)·B·A into "
                      "vLLM's weights in place (a sync moves as many bytes as full fine-tuning). `adapter`: vLLM's "
                      "own LoRA; the base is synced once, then each sync hands vLLM the adapters only (colocated "
                      "rollout only).")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def validate(self) -> None:
        self._check_range("rank", ge=0, example=16)
        self._check_range("alpha", gt=0.0, example=16)
        self._check_range("dropout", ge=0.0, lt=1.0, example=0.05)
        bad = [t for t in self.target_modules if t not in (*LORA_TARGETS, "all-linear")]
        self._require(not bad and bool(self.target_modules),
                      f"model.lora.target_modules={list(self.target_modules)}: {bad or 'empty'} not among "
                      f"{list(LORA_TARGETS)} or all-linear; name HF projections, e.g. [q_proj, v_proj]")
        if not self.enabled:  # a recipe that sets the adapters up but not their rank would train every weight
            set_up = self.changed()  # rank is 0, its default: only the other keys
            self._require(not set_up, f"model.lora.{set_up[0] if set_up else ''} is set but model.lora.rank=0 "
                                      f"(LoRA off: full fine-tuning); set model.lora.rank (e.g. 16), or remove "
                                      f"model.lora.{set_up[0] if set_up else ''}")
        self._require(self.rollout_sync != "adapter" or self.rank <= VLLM_LORA_RANKS[-1],
                      f"model.lora.rank={self.rank}: vLLM's LoRA (model.lora.rollout_sync=adapter) takes ranks up "
                      f"to {VLLM_LORA_RANKS[-1]}; lower model.lora.rank, or use model.lora.rollout_sync=merge")


@dataclass(frozen=True, kw_only=True)
class ModelConfig(ConfigSection):
    """The policy model (actor; also the reference policy and, unless `critic.model_path` is set, the critic's
    initialisation). The Megatron `TransformerConfig` is derived from the HF `config.json`; it is not re-declared
    here."""

    SECTION: ClassVar[str] = "model"

    path: str = option(TINY_MODEL, help="HF model directory (config.json + *.safetensors), a hub ID `ORG/NAME` or "
                                        "`ORG/NAME@REVISION` (fetched into the Hugging Face cache at start; "
                                        "docs/data.md), or `tiny` to build the bundled tiny model (no download).")
    dtype: Literal["float32", "bfloat16", "float16"] = option(
        "bfloat16", help="Parameter and compute dtype for training and rollout; optimizer state stays float32.")
    tokenizer_path: str | None = option(None, help="Tokenizer directory or hub ID; null uses `model.path`.")
    trust_remote_code: bool = option(False, help="Allow custom modelling/tokenizer code shipped inside the model "
                                                 "directory (only for directories you trust).")
    make_vocab_size_divisible_by: int = option(
        128, help="Pad the vocabulary to a multiple of this × tp (Megatron's vocab padding; padded logits are "
                  "masked).")
    recompute: Literal["none", "selective", "full"] = option(
        "none", help="Activation recomputation: `selective` recomputes attention internals, `full` whole layers.",
        affects_results=False)
    use_te: Literal["auto"] | bool = option(
        "auto", help="Use Transformer Engine layers: `auto` when `transformer_engine` imports, else our SDPA spec.",
        affects_results=False)
    fused_kernels: Literal["auto"] | bool = option(
        "auto", help="Compile the element-wise work between the GEMMs: Megatron's fused SwiGLU "
                     "(`bias_activation_fusion`, also for the experts) and our spec's RMSNorm, each one kernel "
                     "forward and one backward (`torch.compile`). `auto`: on CUDA, unless trainer.deterministic (torch "
                     "refuses inductor's autotuning in deterministic mode). Same operations; bf16 rounding of "
                     "intermediates can differ in the last bit.", affects_results=False)

    use_remove_padding: bool = option(
        False, help="Pack each micro-batch's sequences back to back in one row (THD, `cu_seqlens`) instead of padding "
                    "rows to the longest: attention stays inside each sequence (varlen flash attention on CUDA, a "
                    "block-diagonal mask elsewhere, Transformer Engine's packed path with the TE spec) and no token "
                    "is spent on padding. All roles (actor, reference, critic, reward model). With context "
                    "parallelism each sequence is split over the CP ranks (our attention spec only). Not with "
                    "routing replay.", affects_results=False)
    moe_aux_loss_coeff: float | None = option(
        None, help="Mixture-of-Experts: weight of the routers' load-balancing loss (Switch-style; Megatron "
                   "`moe_aux_loss_coeff`), logged as `actor/moe_load_balancing_loss` (DeepSeek's sequence-wise loss: "
                   "`actor/moe_seq_load_balancing_loss`), the mean over MoE layers; null takes config.json's "
                   "`router_aux_loss_coef`, 0 disables. Dense models ignore it.")
    moe_z_loss_coeff: float = option(
        0.0, help="Mixture-of-Experts: weight of the routers' z-loss (ST-MoE; Megatron `moe_z_loss_coeff`), logged "
                  "as `actor/moe_z_loss`; 0 disables. Dense models ignore it.")
    moe_router_bias_update_rate: float | None = option(
        None, help="DeepSeek-V3's aux-loss-free balancing: after every optimizer step each router's correction bias "
                   "moves by this much towards the experts that got fewer than the mean number of tokens (Megatron "
                   "`moe_router_bias_update_rate`, from the step's token counts summed over the pool); null: "
                   "DeepSeek's 0.001, 0 keeps the checkpoint's bias. Models without the bias ignore it.")
    moe_token_dispatcher: Literal["alltoall", "allgather"] = option(
        "alltoall", help="Mixture-of-Experts: Megatron's token dispatcher between expert-parallel ranks "
                         "(`moe_token_dispatcher_type`).", affects_results=False)
    lora: LoRAConfig = option(factory=LoRAConfig, help="LoRA adapters instead of full fine-tuning.")
    tiny_arch: Literal["qwen2", "qwen3_moe", "mixtral", "deepseek_v3"] = option(
        "qwen2", help="With `path: tiny`: the bundled tiny model's family: a dense Qwen2, or a Mixture-of-Experts "
                      "Qwen3-MoE / Mixtral (8 experts of width 64, top-2) for trying expert parallelism and routing "
                      "replay on a laptop, or DeepSeek-V3 (multi-head latent attention, a dense first layer, sigmoid "
                      "top-4 of 8 experts; vLLM-CPU runs it in bf16 only: model.dtype=bfloat16).")
    tiny_task: TinyTask | None = option(
        None, help="With `path: tiny`: the generated task (`arithmetic`, `addition_small`, `calculator`) the tiny "
                   "model is warm-started on; null takes the `generated:<task>` of data.train_files, else arithmetic. "
                   "Set it when the training data are files of that task (e.g. a verl parquet of it).")
    chat_template: str | None = option(
        None, help="A Jinja chat template that replaces the tokenizer's own (verl's "
                   "actor_rollout_ref.model.custom_chat_template), inline or as a path to a .jinja file; null keeps "
                   "the tokenizer's. Prompts given as chat messages need one.")
    tiny_warmstart_steps: int = option(
        20, help="With `path: tiny`: supervised warm-start steps on the generated task before RL, so that the "
                 "policy sometimes samples a right answer (0 = start from random weights). With "
                 "`tiny_warmstart_target` it is the most steps.")
    tiny_warmstart_target: float | None = option(
        None, help="With `path: tiny`: stop the warm start once the policy reproduces the task's demonstrations with "
                   "this mean probability (teacher-forced, checked every 5 steps), so that RL starts from the same "
                   "skill whatever the numerics of the libraries (a fixed step count lands anywhere on a steep "
                   "learning curve). null: run all `tiny_warmstart_steps`.")

    def validate(self) -> None:
        for name in ("path", "tokenizer_path"):
            self._set(name, expand_home(getattr(self, name)))
        self._require(bool(self.path.strip()), "model.path is empty; set model.path to an HF model directory or tiny")
        if self.tokenizer_path is None:
            self._set("tokenizer_path", self.path)
        tiny = self.path == "tiny"
        self._require(not tiny or self.tokenizer_path == "tiny",
                      f"model.tokenizer_path={self.tokenizer_path!r} with model.path=tiny: the tiny model brings its "
                      f"own tokenizer; remove model.tokenizer_path or set model.path to your model")
        given = [k for k in ("tiny_task", "tiny_warmstart_target") if getattr(self, k) is not None]
        self._require(tiny or not given, f"model.{given[0] if given else ''} shapes the bundled tiny model, but "
                                         f"model.path={self.path!r}; remove it or set model.path=tiny")
        self._check_range("make_vocab_size_divisible_by", ge=1, example=128)
        self._check_range("tiny_warmstart_steps", ge=0, example=20)
        self._check_range("tiny_warmstart_target", gt=0.0, lt=1.0, example=0.2)
        if self.chat_template is not None:
            self._require(bool(self.chat_template.strip()), "model.chat_template is empty; give a Jinja template, a "
                                                            ".jinja file, or null")
        self._check_range("moe_aux_loss_coeff", ge=0.0, example=0.001)
        self._check_range("moe_z_loss_coeff", ge=0.0, example=0.001)
        self._check_range("moe_router_bias_update_rate", ge=0.0, example=0.001)
        self._require(not (self.lora.enabled and self.use_te is True),
                      "model.lora needs our layer spec (Transformer Engine fuses the norm into the projections the "
                      "adapters read); set model.use_te=auto or false")
