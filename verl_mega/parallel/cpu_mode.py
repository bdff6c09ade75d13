"""CPU mode: lets Megatron-Core run over gloo on a machine without CUDA (dev laptops, CI).

Megatron-Core hard-codes CUDA in a handful of places (``device=torch.cuda.current_device()``, ``tensor.cuda()``,
``torch.cuda.*`` RNG calls, ``tensor.type() == "torch.cuda.FloatTensor"`` checks). Rather than forking mcore, this
module installs a small, reversible shim *only when CUDA is absent*:

* a :class:`torch.overrides.TorchFunctionMode` that rewrites any CUDA ``device`` argument to CPU and makes
  ``Tensor.cuda()`` a no-op; the autograd engine runs Python ``backward`` methods without the caller's function
  modes, so custom autograd functions' backward (mcore's all-to-all allocates with ``device=current_device()``)
  re-enter it;
* ``Tensor.type()`` reports ``torch.cuda.*Tensor`` for CPU tensors, which mcore's dtype checks expect;
* ``torch.cuda.current_device / get_rng_state / set_rng_state / manual_seed / synchronize`` and mcore's
  ``_get/_set_cuda_rng_state`` act on the CPU generator;
* ``torch.cuda.Stream / Event / stream / current_stream`` are host-synchronous stand-ins (CPU work is already
  ordered), which mcore's MoE alltoall token dispatcher uses for its device-to-host copies; that dispatcher's
  "device → host" step also turns split sizes into numpy arrays, which it skips for tensors already on the host, so
  the shim does it for CPU tensors too (``all_to_all_single`` wants int sequences).

Everything numerical still runs through the real mcore code paths; only device placement changes. The shim is
process-global, idempotent, and a no-op when CUDA is available.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"enabled": False}

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # mcore passes torch.cuda.current_device() (an int) as the device.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placement to CPU for every torch function call made while active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Every torch call of the process passes here (tensor properties too): the common case, nothing to rewrite,
        # returns at once.
        if not kwargs and func not in _REWRITTEN:
            return func(*args)
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.device and args and _is_cuda_device(args[0]):
            return torch.device("cpu")  # torch.device(torch.cuda.current_device()) (mcore's YaRN RoPE)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            tensor = args[0]
            return _CUDA_TYPE_NAMES.get(tensor.dtype, "torch.cuda.FloatTensor")
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func in (torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros) and args:
            args = tuple("cpu" if (i > 0 and _is_cuda_device(a) and not isinstance(a, int)) else a
                         for i, a in enumerate(args))
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


# the functions rewritten even when called without keyword arguments (a device passed positionally)
_REWRITTEN = frozenset({torch.Tensor.cuda, torch.device, torch.Tensor.type, torch.Tensor.to, torch.Tensor.new_empty,
                        torch.Tensor.new_zeros})


def cuda_available() -> bool:
    return torch.cuda.is_available() and os.environ.get("VERL_MEGA_FORCE_CPU", "0") != "1"


def enable_cpu_mode() -> bool:
    """Install the shim if CUDA is absent. Returns True when CPU mode is active. Safe to call repeatedly."""
    with _LOCK:
        if _STATE["enabled"]:
            return True
        if cuda_available():
            return False
        mode = _CudaToCpuMode()
        mode.__enter__()
        _STATE["mode"] = mode
        _patch_backward()
        _patch_cuda_namespace()
        _patch_mcore_rng()
        _patch_mcore_moe_dtoh()
        drop_cuda_hints()
        _STATE["enabled"] = True
        return True


def drop_cuda_hints() -> None:
    """Megatron's advice, at tp > 1, to set CUDA_DEVICE_MAX_CONNECTIONS=1 is about CUDA streams, of which CPU mode
    has none: hidden, by message and the module that gives it."""
    warnings.filterwarnings("ignore", message=r".*environment variable CUDA_DEVICE_MAX_CONNECTIONS",
                            category=UserWarning, module=r"megatron\.core\.tensor_parallel\.layers$")


@contextlib.contextmanager
def in_this_thread() -> Iterator[None]:
    """Apply the shim in the calling thread too: its torch-function mode, like every mode, is per thread, so a
    thread that runs Megatron code (scoring while vLLM generates) enters it here. A no-op without the shim."""
    if not _STATE["enabled"]:
        yield
        return
    with _CudaToCpuMode():
        yield


class _HostEvent:
    """A CUDA event on the host: CPU work is synchronous, so it has always completed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostStream:
    """A CUDA stream on the host: work runs in program order, so waits and events are no-ops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return event or _HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HostStream)

    def __hash__(self) -> int:
        return 0


def _patch_cuda_namespace() -> None:
    cpu_gen = torch.random.default_generator
    host_stream = _HostStream()
    patches = {
        "Stream": _HostStream,
        "Event": _HostEvent,
        "current_stream": lambda device=None: host_stream,
        "default_stream": lambda device=None: host_stream,
        "stream": lambda stream=None: contextlib.nullcontext(),
        "current_device": lambda: 0,
        "device_count": lambda: 1,
        "get_rng_state": lambda device="cuda": cpu_gen.get_state(),
        "set_rng_state": lambda new_state, device="cuda": cpu_gen.set_state(new_state),
        "manual_seed": lambda seed: None,  # the CPU generator is seeded by torch.manual_seed
        "manual_seed_all": lambda seed: None,
        "synchronize": lambda device=None: None,
        "set_device": lambda device: None,
        "empty_cache": lambda: None,
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
    }
    saved = {}
    for name, fn in patches.items():
        saved[name] = getattr(torch.cuda, name, None)
        setattr(torch.cuda, name, fn)
    _STATE["saved_cuda"] = saved


def _patch_mcore_rng() -> None:
    """mcore's CudaRNGStatesTracker forks CUDA generators; on CPU it must fork the CPU generator instead."""
    from megatron.core.tensor_parallel import random as mcore_random

    cpu_gen = torch.random.default_generator

    def _get_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
        return cpu_gen.get_state()

    def _set_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
        cpu_gen.set_state(new_state)

    _STATE["saved_mcore"] = (mcore_random._get_cuda_rng_state, mcore_random._set_cuda_rng_state)
    mcore_random._get_cuda_rng_state = _get_state
    mcore_random._set_cuda_rng_state = _set_state


def _patch_backward() -> None:
    from torch.autograd import function

    original = function.BackwardCFunction.apply

    def apply(self, *args: Any) -> Any:
        with _CudaToCpuMode():
            return original(self, *args)

    _STATE["saved_backward"] = original
    function.BackwardCFunction.apply = apply


def _patch_mcore_moe_dtoh() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    _STATE["saved_moe_dtoh"] = original
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def comm_device() -> torch.device:
    """Where tensors must live for collectives: NCCL needs CUDA tensors, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
