"""The outcomes and handlers of tools/from_verl.py's key table (tools/verl_keys.py): a handler gets a verl key, its
value and the whole config, and returns :class:`Map` (verl_mega keys and values), :class:`Same` (nothing to set) or
:class:`Unsupported` (with the reason)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Map", "Same", "Unsupported", "Ctx", "Handler"]


@dataclass(frozen=True)
class Map:
    """verl_mega keys and their values."""

    items: dict[str, Any]
    note: str = ""


@dataclass(frozen=True)
class Same:
    """Nothing to set: verl_mega behaves so anyway (or the feature is off in this config)."""

    reason: str


@dataclass(frozen=True)
class Unsupported:
    reason: str


@dataclass
class Ctx:
    """The whole (flat) verl config, for rules that depend on other keys."""

    flat: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        value = self.flat.get(key, default)
        return default if value is None else value

    @property
    def world(self) -> int:
        return int(self.get("trainer.n_gpus_per_node", 1)) * int(self.get("trainer.nnodes", 1))


Handler = Callable[[str, Any, Ctx], "Map | Same | Unsupported"]
ROLES = {"actor_rollout_ref.actor": "actor", "critic": "critic"}


def _off(value: Any) -> bool:
    """null, false, 0, an empty string / list / mapping, or a word for off."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    if isinstance(value, str):
        return value in ("", "none", "None", "null", "disabled", "disable")
    return isinstance(value, (list, tuple, dict)) and not value


# ------------------------------------------------------------------------------------------------- constructors
NULL = Same("null: verl_mega's default applies")


def to(key: str, convert: Callable[[Any], Any] | None = None, note: str = "") -> Handler:
    return lambda k, v, ctx: NULL if v is None else Map({key: convert(v) if convert else v}, note)


def same(reason: str) -> Handler:
    return lambda k, v, ctx: Same(reason)


def unsupported(reason: str) -> Handler:
    return lambda k, v, ctx: Unsupported(reason)


def off_only(reason: str, what_off: str = "off here") -> Handler:
    """Unsupported when set to something other than an 'off' value (null, false, 0, empty, disabled)."""
    return lambda k, v, ctx: Same(f"{what_off} ({reason.split(';')[0]})") if _off(v) else Unsupported(reason)


def gated(group: str, switch: str, reason: str) -> Handler:
    """The keys of a feature switched by ``<group>.<switch>``: the same while it is off, unsupported when on."""
    def handler(k: str, v: Any, ctx: Ctx) -> Same | Unsupported:
        found = re.search(rf"(^|\.){re.escape(group)}(\.|$)", k)
        head = k[: found.end()].rstrip(".") if found else group
        switch_key = f"{head}.{switch}"
        value = v if k == switch_key else ctx.flat.get(switch_key)
        if _off(value):
            return Same(f"off: {switch_key}={value!r} ({reason.split(':')[0]})")
        return Unsupported(reason)
    return handler


def any_on(prefix: str, reason: str) -> Handler:
    """A group of features each switched by its own ``enable``: unsupported when any is on."""
    return lambda k, v, ctx: Unsupported(reason) if any(
        key.startswith(prefix) and key.endswith(".enable") and not _off(val) for key, val in ctx.flat.items()) else \
        Same(f"off ({reason.split(':')[0]})")


def when(expected: Any, reason_same: str, reason_other: str) -> Handler:
    return lambda k, v, ctx: Same(reason_same) if v == expected else Unsupported(reason_other)


def role_key(k: str) -> str:
    return next(ours for prefix, ours in ROLES.items() if k.startswith(prefix + "."))


def role_to(field_: str, convert: Callable[[Any], Any] | None = None) -> Handler:
    """A key of the actor or the critic → ``<role>.<field_>``."""
    return lambda k, v, ctx: NULL if v is None else Map({f"{role_key(k)}.{field_}": convert(v) if convert else v})


def expand(path: Any) -> Any:
    return os.path.expanduser(path) if isinstance(path, str) else path


def files(value: Any) -> list[str]:
    return [expand(f) for f in (value if isinstance(value, (list, tuple)) else [value])]


# ------------------------------------------------------------------------------------------------- handlers
def _micro_global(k: str, v: Any, ctx: Ctx) -> Map | Same:
    """verl's deprecated global micro-batch sizes: per GPU = global / world size (what verl computes)."""
    if v is None:
        return Same("unset (the *_per_gpu key decides)")
    target = {"actor_rollout_ref.actor.ppo_micro_batch_size": "actor.micro_batch_size_per_gpu",
              "critic.ppo_micro_batch_size": "critic.micro_batch_size_per_gpu",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size": "actor.log_prob_micro_batch_size_per_gpu",
              "actor_rollout_ref.ref.log_prob_micro_batch_size": "ref.micro_batch_size_per_gpu"}[k]
    return Map({target: max(1, int(v) // ctx.world)}, f"global {v} / {ctx.world} GPUs")


def _per_gpu(target: str) -> Handler:
    return lambda k, v, ctx: Same("unset: verl_mega's default applies") if v is None else Map({target: v})


def _warmup(k: str, v: Any, ctx: Ctx) -> Map | Same:
    role = role_key(k)
    if v is not None and int(v) >= 0:
        return Map({f"{role}.lr_warmup_steps": int(v)})
    ratio = float(ctx.get(k.replace("lr_warmup_steps", "lr_warmup_steps_ratio"), 0.0))
    total = ctx.get("trainer.total_training_steps")
    if not ratio:
        return Map({f"{role}.lr_warmup_steps": 0}, "-1 with lr_warmup_steps_ratio 0: no warm-up")
    if total:
        return Map({f"{role}.lr_warmup_steps": int(ratio * int(total))}, f"lr_warmup_steps_ratio {ratio} × "
                                                                           f"{total} steps")
    return Same(f"lr_warmup_steps_ratio={ratio} needs trainer.total_training_steps to become steps; set "
                f"{role}.lr_warmup_steps")


def _decay_style(k: str, v: Any, ctx: Ctx) -> Map | Unsupported | Same:
    if v is None:
        return Same("unset: lr_scheduler_type decides")
    style = {"constant": "constant", "cosine": "cosine", "linear": "linear"}.get(str(v))
    if style is None:
        return Unsupported(f"LR schedule {v!r}: verl_mega decays constant, linear or cosine ({role_key(k)}."
                           f"lr_decay_style)")
    return Map({f"{role_key(k)}.lr_decay_style": style})


def _min_lr_ratio(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if not v:
        return Same("0: the LR decays to 0 (min_lr 0), as verl_mega's default")
    lr = float(ctx.get(k.replace("min_lr_ratio", "lr"), 0.0))
    return Map({f"{role_key(k)}.min_lr": float(v) * lr}, f"min_lr_ratio {v} × lr {lr}")


def _betas(k: str, v: Any, ctx: Ctx) -> Map:
    role = role_key(k)
    return Map({f"{role}.adam_beta1": float(v[0]), f"{role}.adam_beta2": float(v[1])})


def _optimizer(k: str, v: Any, ctx: Ctx) -> Same | Unsupported:
    if str(v).lower() in ("adamw", "adam"):
        return Same("AdamW: verl_mega's optimizer (Megatron's distributed Adam with decoupled weight decay)")
    return Unsupported(f"optimizer {v!r}: verl_mega trains with AdamW only")


def _dtype(k: str, v: Any, ctx: Ctx) -> Map | Same:
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
             "float32": "float32", "fp32": "float32"}
    if k.startswith("actor_rollout_ref.actor.") and str(v) in names:
        return Map({"model.dtype": names[str(v)]})
    return Same("one dtype for every role and the rollout: model.dtype (from the actor's)")


def _recompute(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if k.startswith("actor_rollout_ref.model."):
        return Map({"model.recompute": "full" if v else "none"})
    return Same("one recompute setting for every role: model.recompute (from the actor's)")


def _granularity(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if not k.startswith("actor_rollout_ref.actor."):
        return Same("one recompute setting for every role: model.recompute (from the actor's)")
    if v is None:
        return Same("unset: actor_rollout_ref.model.enable_gradient_checkpointing decides")
    return Map({"model.recompute": "selective" if v == "selective" else "full"})


PARALLEL = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
            "virtual_pipeline_model_parallel_size": "vpp", "context_parallel_size": "cp",
            "expert_model_parallel_size": "ep", "expert_tensor_parallel_size": "etp", "sequence_parallel":
            "sequence_parallel", "use_distributed_optimizer": "use_distributed_optimizer"}


def _megatron_dim(k: str, v: Any, ctx: Ctx) -> Map | Same | Unsupported:
    name = k.rsplit(".", 1)[1]
    ours = PARALLEL[name]
    if k.startswith("actor_rollout_ref.actor."):
        if v is None and ours in ("vpp", "etp"):
            return Same(f"unset: parallel.{ours}=null")
        tp = ctx.flat.get("actor_rollout_ref.actor.megatron.tensor_model_parallel_size") or 1
        if ours == "sequence_parallel" and v and tp == 1:  # Megatron turns it off at tp = 1 (verl's default pair)
            return Map({"parallel.sequence_parallel": False}, "no sequence parallelism without tensor parallelism, "
                                                              "as Megatron decides at tp=1")
        return Map({f"parallel.{ours}": v})
    actor = ctx.flat.get(f"actor_rollout_ref.actor.megatron.{name}")
    if v == actor or k.startswith("reward_model.") and not ctx.get("reward_model.enable"):
        return Same("every training role runs at the actor's layout (parallel.*)")
    return Unsupported(f"{v} differs from the actor's {actor}: verl_mega runs every training role at one layout "
                       f"(parallel.*)")


def _offload(kind: str) -> Handler:
    def handler(k: str, v: Any, ctx: Ctx) -> Map | Same | Unsupported:
        if k.startswith("actor_rollout_ref.ref."):
            return Map({"ref.offload_params": bool(v)}) if kind == "params" else Same("the reference has no "
                                                                                      "optimizer")
        if k.startswith("reward_model."):
            return off_only("the reward model's offload: verl_mega keeps it resident")(k, v, ctx)
        return Map({f"{role_key(k)}.offload_{kind}": bool(v)})
    return handler


def _loss_mode(k: str, v: Any, ctx: Ctx) -> Map | Unsupported:
    known = {"vanilla": "vanilla", "gspo": "gspo", "cispo": "cispo", "clip_cov": "clip_cov", "kl_cov": "kl_cov"}
    if str(v) in known:
        return Map({"actor.policy_loss": known[str(v)]})
    return Unsupported(f"policy loss {v!r}: verl_mega has vanilla (PPO clip), gspo, cispo, clip_cov, kl_cov and "
                       f"decoupled_ppo (actor.policy_loss)")


def _loss_option(field_: str, modes: tuple[str, ...]) -> Handler:
    def handler(k: str, v: Any, ctx: Ctx) -> Map | Same:
        mode = ctx.get("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
        if mode in modes:
            return Map({f"actor.{field_}": v})
        return Same(f"read only by policy_loss.loss_mode in {modes}; this config uses {mode}")
    return handler


def _clip_ratio(k: str, v: Any, ctx: Ctx) -> Map | Same:
    low = ctx.flat.get("actor_rollout_ref.actor.clip_ratio_low")
    high = ctx.flat.get("actor_rollout_ref.actor.clip_ratio_high")
    if low is not None and high is not None:
        return Same("clip_ratio_low / clip_ratio_high are set and win, as in verl")
    return Map({"actor.clip_ratio_low": v if low is None else low, "actor.clip_ratio_high": v if high is None
                else high})


def _kl_type(k: str, v: Any, ctx: Ctx) -> Map | Unsupported:
    if str(v) in ("kl", "abs", "mse", "low_var_kl", "k1", "k2", "k3"):
        return Map({"actor.kl_loss_type" if "kl_loss_type" in k else "algorithm.kl_penalty": str(v)})
    return Unsupported(f"KL estimator {v!r}: verl_mega has kl (k1), abs, mse (k2) and low_var_kl (k3)")


def _adv(k: str, v: Any, ctx: Ctx) -> Map | Unsupported:
    known = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax")
    if str(v) in known:
        return Map({"algorithm.adv_estimator": str(v)})
    return Unsupported(f"advantage estimator {v!r}: verl_mega has {', '.join(known)} (algorithm.adv_estimator)")


def _reward_fn(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if not v:
        return Same("no custom reward function: verl dispatches on data_source (default_compute_score); set "
                    "reward.function to a built-in (by_data_source does that for GSM8K, MATH and DAPO/AIME; gsm8k, "
                    "math, math_dapo, ...) or your file")
    prefix = k.rsplit(".", 1)[0]
    name = ctx.get(f"{prefix}.name", "compute_score")
    return Map({"reward.function": f"{expand(v)}:{name}"})


def _vllm_engine_kwargs(k: str, v: Any, ctx: Ctx) -> Map | Same | Unsupported:
    """verl's engine_kwargs.vllm.<arg>[.<sub>...] → rollout.engine_kwargs.<arg>[...], unless the rollout sets <arg>."""
    from verl_mega.config.rl import ROLLOUT_ENGINE_ARGS

    path = k.split(".engine_kwargs.vllm", 1)[1].lstrip(".")
    if not path:
        return Same("no extra vLLM engine arguments") if _off(v) else Map({"rollout.engine_kwargs": dict(v)})
    arg = path.split(".")[0]
    if arg in ROLLOUT_ENGINE_ARGS:
        return Unsupported(f"vLLM's {arg} is set by verl_mega's rollout (from {ROLLOUT_ENGINE_ARGS[arg]})")
    return Map({f"rollout.engine_kwargs.{path}": v})


def _rollout_quantization(k: str, v: Any, ctx: Ctx) -> Map | Same | Unsupported:
    """verl's rollout quantization → rollout.quantization: FP8 weights in vLLM, quantized by the weight sync."""
    if _off(v):
        return Same("the rollout generates in model.dtype (rollout.quantization=none)")
    if v == "fp8":
        return Map({"rollout.quantization": "fp8"}, "verl quantizes in 128x128 blocks, verl_mega with one scale per "
                                                  "output channel (docs/performance.md)")
    return Unsupported(f"rollout quantization {v!r}: verl_mega's rollout quantizes to fp8 only "
                       "(rollout.quantization=fp8)")


def _cudagraph_sizes(k: str, v: Any, ctx: Ctx) -> Map | Same:
    """verl's cudagraph_capture_sizes → vLLM's own compilation setting, through rollout.engine_kwargs."""
    if v is None:
        return Same("vLLM's own capture sizes")
    return Map({"rollout.engine_kwargs.compilation_config.cudagraph_capture_sizes": [int(x) for x in v]})


# verl's Megatron LoRA names the fused projections; verl_mega names the HF projections inside them
_MEGATRON_LORA_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                          "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
_LORA_CRITIC = "LoRA on the critic: verl_mega's model.lora adapts the policy; the critic trains full weights"


def _lora_rank(ctx: Ctx, head: str) -> int:
    """The LoRA rank a verl role's model section sets: FSDP's ``lora_rank`` or Megatron's ``lora.rank``."""
    for key in (f"{head}.lora_rank", f"{head}.lora.rank"):
        value = ctx.flat.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return int(value)
    return 0


def _lora(k: str, v: Any, ctx: Ctx) -> Map | Same | Unsupported:
    """verl's LoRA keys (FSDP's ``model.lora_rank`` / ``lora_alpha`` / ``target_modules``, Megatron's
    ``model.lora.*``) → model.lora.*, for the actor; the rest of LoRA's keys are the same while it is off."""
    from verl_mega.config.model import LORA_TARGETS

    head = k[: k.index(".model.") + len(".model")]
    name = k[len(head) + 1:].replace("lora.", "", 1).replace("lora_", "", 1)
    rank = _lora_rank(ctx, head)
    if not rank:
        return Same("LoRA off in this config (full fine-tuning)")
    if not head.startswith("actor_rollout_ref."):
        return Unsupported(_LORA_CRITIC)
    if name == "rank":
        return Map({"model.lora.rank": rank})
    if name == "alpha":
        return Map({"model.lora.alpha": float(v)})
    if name == "dropout":
        return Map({"model.lora.dropout": float(v or 0.0)})
    if name == "target_modules":
        targets: list[str] = []
        for t in [v] if isinstance(v, str) else list(v or ["all-linear"]):
            if t in ("all-linear", *LORA_TARGETS):
                targets.append(t)
            elif t in _MEGATRON_LORA_TARGETS:
                targets.extend(_MEGATRON_LORA_TARGETS[t])
            else:
                return Unsupported(f"LoRA target {t!r}: verl_mega adapts {', '.join(LORA_TARGETS)} (or "
                                   f"all-linear)")
        return Map({"model.lora.target_modules": list(dict.fromkeys(targets))})
    if name == "type":
        return Same("plain LoRA") if v in (None, "lora") else Unsupported(f"LoRA type {v!r}: verl_mega has plain "
                                                                          "LoRA")
    if name == "A_init_method":
        return Map({"model.lora.init": "gaussian" if v in ("normal", "gaussian") else "kaiming"},
                   "" if v in ("normal", "gaussian", "kaiming") else f"no {v!r} init of A; Kaiming-uniform (PEFT's)")
    if name == "B_init_method":
        return Same("B starts at zero") if v in (None, "zero") else Unsupported(f"B init {v!r}: B starts at zero")
    if name in ("merge", "dropout_position", "dtype") or name.startswith("freeze_"):
        return Same("adapters on the input of each targeted projection, in model.dtype, merged into vLLM's weights at "
                    "every sync (model.lora.rollout_sync)")
    return off_only(f"LoRA's {name}: not in verl_mega")(k, v, ctx)


def _gen_ep(k: str, v: Any, ctx: Ctx) -> Map | Same:
    """verl's rollout expert_parallel_size (= tensor × data parallel size of vLLM) is rollout.gen_ep."""
    return Same("no expert parallelism in generation") if v in (None, 1) else Map({"rollout.gen_ep": int(v)})


def _gen_dp(k: str, v: Any, ctx: Ctx) -> Same | Unsupported:
    """vLLM data parallelism: only as the attention engines of expert-parallel generation (gen_ep / gen_tp)."""
    if v in (None, 1):
        return Same("one engine per generation-TP group")
    ep = ctx.flat.get("actor_rollout_ref.rollout.expert_parallel_size") or 1
    tp = ctx.flat.get("actor_rollout_ref.rollout.tensor_model_parallel_size") or 1
    if ep > 1 and ep == tp * v:
        return Same("the rollout.gen_ep / rollout.gen_tp data-parallel attention engines of expert-parallel "
                    "generation")
    return Unsupported("vLLM data parallelism without expert parallelism: verl_mega runs one engine per "
                       "generation-TP group")


def _reward_kwargs(k: str, v: Any, ctx: Ctx) -> Map | Same:
    return Map({"reward.kwargs": dict(v)}) if v else Same("no reward kwargs")


def _logger(k: str, v: Any, ctx: Ctx) -> Map:
    names = [v] if isinstance(v, str) else list(v or [])
    out = {"logging.console": "console" in names, "logging.tensorboard": "tensorboard" in names,
           "logging.wandb": "wandb" in names, "logging.mlflow": "mlflow" in names}
    other = [n for n in names if n not in ("console", "tensorboard", "wandb", "mlflow", "file")]
    return Map(out, f"no verl_mega sink for {', '.join(other)}; metrics.jsonl is always written" if other else
               "metrics.jsonl is always written (verl's file logger)")


def _freq(target: str) -> Handler:
    return lambda k, v, ctx: Map({target: max(0, int(v))}, "-1 → 0 (off)" if int(v) < 0 else "")


def _resume_mode(k: str, v: Any, ctx: Ctx) -> Map | Unsupported:
    if v == "auto":
        return Map({"trainer.resume": "auto"})
    if v == "disable":
        return Map({"trainer.resume": "off"})
    if v == "resume_path":
        return Same("trainer.resume_from_path decides")
    return Unsupported(f"resume_mode {v!r}: verl_mega resumes auto, off or from a checkpoint directory")


def _resume_path(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if not v or ctx.get("trainer.resume_mode") != "resume_path":
        return Same("unused unless resume_mode=resume_path")
    return Map({"trainer.resume": expand(v)}, "a verl checkpoint cannot be loaded; see docs/from_verl.md for "
                                              "starting from its HF export")


def _critic_enable(k: str, v: Any, ctx: Ctx) -> Map | Same:
    return Same("null: a critic iff algorithm.adv_estimator=gae, as in verl_mega") if v is None else \
        Map({"critic.enable": bool(v)})


def _critic_path(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if v == ctx.get("actor_rollout_ref.model.path"):
        return Same("the actor's model: verl_mega's default critic initialisation")
    return Map({"critic.model_path": expand(v)})


def _rm_path(k: str, v: Any, ctx: Ctx) -> Map | Same:
    enabled = ctx.get("reward_model.enable") or ctx.get("reward.reward_model.enable")
    if not enabled or not v:
        return Same("the reward model is off in this config")
    return Map({"reward.reward_model_path": expand(v)})


def _filter_overlong(k: str, v: Any, ctx: Ctx) -> Map:
    return Map({"data.filter_overlong_prompts": bool(v)},
               "" if v else "verl then fails on an overlong prompt (truncation=error); so does verl_mega, naming it")


def _truncation(k: str, v: Any, ctx: Ctx) -> Same | Unsupported:
    if v == "error":
        return Same("an overlong prompt is an error naming its file and row (or filtered, "
                    "data.filter_overlong_prompts)")
    return Unsupported(f"truncation={v!r}: verl_mega never truncates a prompt; it filters overlong ones or stops "
                       f"with an error")


def _save_contents(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if not k.startswith("actor_rollout_ref.actor."):
        return Same("one checkpoint policy for every role (from the actor's)")
    contents = list(v or [])
    return Map({"checkpoint.save_optimizer": "optimizer" in contents, "checkpoint.export_hf": "hf_model" in contents})


def _router_replay(k: str, v: Any, ctx: Ctx) -> Map | Same | Unsupported:
    if not k.startswith("actor_rollout_ref.actor."):
        return Same("routing replay is the actor's (actor.routing_replay)")
    mode = {"disabled": "none", "R2": "r2", "R3": "r3", "r2": "r2", "r3": "r3"}.get(str(v))
    return Map({"actor.routing_replay": mode}) if mode else Unsupported(f"router replay mode {v!r}")


def _rollout_is(k: str, v: Any, ctx: Ctx) -> Map | Same:
    return Same("off") if v is None else Map({"actor.rollout_is": str(v)})


def _tp_gen(k: str, v: Any, ctx: Ctx) -> Map:
    return Map({"rollout.gen_tp": int(v)}, "verl_mega carves generation TP groups out of training TP groups: it "
                                           "must divide parallel.tp")


def _val_temperature(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if ctx.get("actor_rollout_ref.rollout.val_kwargs.do_sample") is False:
        return Map({"rollout.val_temperature": 0.0}, "val_kwargs.do_sample=false: greedy")
    return Map({"rollout.val_temperature": float(v)})


def _do_sample(k: str, v: Any, ctx: Ctx) -> Map | Same:
    if k.endswith("val_kwargs.do_sample"):
        return Same("read with val_kwargs.temperature")
    return Same("sampling") if v else Map({"rollout.temperature": 0.0}, "do_sample=false: greedy")


def _n(k: str, v: Any, ctx: Ctx) -> Map | Same | Unsupported:
    if k.endswith("val_kwargs.n"):
        return Same("one answer per validation prompt") if int(v) == 1 else Unsupported(
            "several answers per validation prompt: verl_mega validates one (greedy or at rollout.val_temperature)")
    return Map({"rollout.n": int(v)})


def _free_cache(k: str, v: Any, ctx: Ctx) -> Map:
    return Map({"rollout.free_cache_engine": bool(v)}, "verl_mega's auto keeps vLLM resident when it fits")


def _launch(k: str, v: Any, ctx: Ctx) -> Same:
    ctx.notes.append(f"launch on {ctx.get('trainer.nnodes', 1)} node(s) × {ctx.get('trainer.n_gpus_per_node', 1)} "
                     f"GPUs: torchrun --nnodes {ctx.get('trainer.nnodes', 1)} --nproc-per-node "
                     f"{ctx.get('trainer.n_gpus_per_node', 1)} -m verl_mega.train --config <recipe> "
                     f"(docs/launching.md); the world size is the launcher's, not a config key")
    return Same("the world size comes from the launcher (torchrun --nnodes/--nproc-per-node)")


def _output_dir(k: str, v: Any, ctx: Ctx) -> Map:
    return Map({"trainer.output_dir": expand(v)}, "checkpoints go to <output_dir>/checkpoints/step_N")


def _train_steps(k: str, v: Any, ctx: Ctx) -> Map | Same:
    return Same("null: trainer.total_epochs decides") if v is None else Map({"trainer.total_steps": int(v)})


def _multi_turn(k: str, v: Any, ctx: Ctx) -> Map | Same:
    return Map({"rollout.multi_turn.enable": bool(v)}, "verl's tools (tool_config_path) do not carry over: give "
                                                       "rollout.multi_turn.tools") if v else Same("off")


def _seed(k: str, v: Any, ctx: Ctx) -> Map | Same:
    return Same("null: trainer.seed") if v is None else Map({"data.seed": int(v)})
