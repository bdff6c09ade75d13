"""What a run prints. Our own lines at INFO; Megatron, vLLM, transformers and torch only at WARNING and above, minus
the warnings that describe conditions this framework handles on purpose (vLLM runs without a tokenizer, in-process,
on CPU; Megatron's deprecated collectives). ``logging.verbose=true`` shows everything.

The per-step line, the progress bar and the end-of-run summary are :mod:`verl_mega.trainer.metrics`'s.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

THIRD_PARTY = ("megatron", "vllm", "transformers", "torch", "tensorboard", "matplotlib", "PIL", "filelock", "urllib3",
               "huggingface_hub", "safetensors", "ray", "numexpr", "asyncio")

# Warnings of handled conditions. Each names the condition, so a new warning of the same library still shows.
EXPECTED = tuple(re.compile(p) for p in (
    r"Chat template warmup failed",  # vLLM tries a chat template; we pass token ids (skip_tokenizer_init)
    r"Using None for EOS token id because tokenizer is not initialized",  # stop tokens come from our tokenizer
    r"Tokenizer not available when `skip_tokenizer_init=True`",
    r"The global random seed is set to",  # in-process vLLM: our RNG streams are forked around its sampler
    r"Enforce eager set, disabling torch.compile",  # rollout.enforce_eager asked for it
    r"Inductor compilation was disabled by user settings",
    r"Triton is not installed|Triton is installed|requires Triton|triton-cpu is expected",  # vLLM-CPU hints
    r"is not found in LD_PRELOAD",
    r"CPU backend doesn't allow to use `torch.set_num_threads`",
    r"Reset SSM cache type to float32",
    r"Explicitly set \(.*\) GiB for KV cache",  # rollout.kv_cache_memory_bytes asked for it
))
# (category, message regex, module regex: where the warning is attributed, "" for anywhere) of Python warnings from
# third-party code we call as intended
_PY_WARNINGS = (
    (FutureWarning, r"`torch.distributed.(reduce_op|reduce_scatter_tensor|all_gather_into_tensor|_all_gather_base|"
                    r"_reduce_scatter_base)` is deprecated", ""),
    (UserWarning, r"The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", ""),
    (UserWarning, r"TypedStorage is deprecated", ""),
    # a resume: Megatron-Core's dist-checkpoint loader calls torch's deprecated load_state_dict and builds torch
    # ShardedTensors (attributed to the CPU shim's dispatch on CPU)
    (FutureWarning, r"`load_state_dict` is deprecated", r"megatron\.core\.dist_checkpointing\."),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
     r"(megatron\.core|torch\.distributed|verl_mega\.parallel\.cpu_mode)(\.|$)"),
)


class _DropExpected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.search(text) for p in EXPECTED)


def configure_console(verbose: bool = False) -> None:
    """Call once, first thing, in an entry point. The result does not depend on whether vLLM, Megatron or
    transformers were imported before (a user's script, or a process that preloaded them)."""
    # vLLM's records go through the root handler below instead of its own (one format, one filter)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    if os.environ["VLLM_CONFIGURE_LOGGING"] == "0":
        _take_over_vllm_logger()
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
    if not verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_DropExpected())
        drop_expected_warnings()
        _drop_teardown_noise()
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its advisories; errors still raise
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    # transformers reads TRANSFORMERS_VERBOSITY once, when first imported: apply it (or verbose's INFO) here
    level = hf_logging.log_levels.get(os.environ.get("TRANSFORMERS_VERBOSITY", "").lower())
    if verbose:
        hf_logging.set_verbosity_info()
    elif level is not None:
        hf_logging.set_verbosity(level)
    if not verbose:
        hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars of tiny models
        try:
            from huggingface_hub.utils import disable_progress_bars
        except ImportError:
            return
        disable_progress_bars()  # HF_HUB_DISABLE_PROGRESS_BARS is read when huggingface_hub is imported


# Destructors that fail only at interpreter shutdown, after the modules they call are torn down: vLLM-CPU's oneDNN
# matmul handlers stay referenced from vLLM's module-level registries until then, and release nothing that the exiting
# process would keep (the command line ends with os._exit and never gets there; a Python script ends normally).
_TEARDOWN_NOISE = ("CPUDNNLGEMMHandler.__del__",)


def _drop_teardown_noise() -> None:
    if getattr(sys.unraisablehook, "_verl_mega", False):
        return

    def hook(args, _default=sys.unraisablehook, _finalizing=sys.is_finalizing) -> None:
        if _finalizing() and getattr(args.object, "__qualname__", "") in _TEARDOWN_NOISE:
            return
        _default(args)

    hook._verl_mega = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def drop_expected_warnings() -> None:
    """Hide the Python warnings of :data:`_PY_WARNINGS`, each by category, message and the module it comes from."""
    for category, message, module in _PY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


def _take_over_vllm_logger() -> None:
    """An imported vLLM configured a handler of its own on the "vllm" logger (VLLM_CONFIGURE_LOGGING was unset
    then); its records go to the root handler instead, like those of a vLLM imported after this call."""
    vllm_logger = logging.getLogger("vllm")
    for handler in list(vllm_logger.handlers):
        vllm_logger.removeHandler(handler)
    vllm_logger.propagate = True
