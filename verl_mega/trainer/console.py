"""What a run prints. Our own lines at INFO; Megatron, vLLM, transformers and torch only at WARNING and above, minus
the warnings that describe conditions this framework handles on purpose (vLLM runs without a tokenizer, in-process,
on CPU; Megatron's deprecated collectives). ``logging.verbose=true`` shows everything.

The per-step line, the progress bar and the end-of-run summary are :mod:`verl_mega.trainer.metrics`'s.
"""

from __future__ import annotations

import logging
import os
import re
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
_PY_WARNINGS = (  # (category, message regex) of Python warnings from third-party code we call as intended
    (FutureWarning, r"`torch.distributed.(reduce_op|reduce_scatter_tensor|all_gather_into_tensor|_all_gather_base|"
                    r"_reduce_scatter_base)` is deprecated"),
    (UserWarning, r"The .grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    (UserWarning, r"TypedStorage is deprecated"),
)


class _DropExpected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(p.search(text) for p in EXPECTED)


def configure_console(verbose: bool = False) -> None:
    """Call once, first thing, in an entry point (before vLLM, Megatron or transformers are imported)."""
    # vLLM's records go through the root handler below instead of its own (one format, one filter)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", force=True)
    for name in THIRD_PARTY:
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
    if verbose:
        return
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropExpected())
    for category, message in _PY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # its advisories; errors still raise
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars of tiny models
    except ImportError:
        pass
