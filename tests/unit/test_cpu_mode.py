"""The CPU shim's torch-function mode: CUDA placement becomes CPU whichever way it is passed, and every other call
goes through unchanged."""

import torch

from verl_mega.parallel.cpu_mode import _CudaToCpuMode


def test_cuda_placement_becomes_cpu_however_it_is_passed():
    x = torch.arange(4.0)
    with _CudaToCpuMode():
        made = [torch.zeros(2, device="cuda"), torch.empty(2, device=torch.device("cuda", 0)),
                torch.ones(2, device=0), x.to("cuda"), x.to(device="cuda:0"), x.cuda(), x.new_zeros((2,), device=0),
                x.new_empty((2,), device="cuda"), torch.zeros(2, pin_memory=True)]
        assert torch.device(0) == torch.device("cpu")  # torch.device(torch.cuda.current_device())
        assert x.type() == "torch.cuda.FloatTensor" and x.long().type() == "torch.cuda.LongTensor"
        assert x.type(torch.float64).dtype == torch.float64  # a conversion is still a conversion
    assert all(t.device.type == "cpu" for t in made)
    assert not made[-1].is_pinned()


def test_other_calls_are_unchanged():
    x = torch.arange(6.0).view(2, 3)
    with _CudaToCpuMode():
        y = (x * 2).sum(dim=0)
        shape, dtype = x.shape, x.dtype
        z = x.to(torch.float64)
    assert torch.equal(y, torch.tensor([6.0, 10.0, 14.0]))
    assert shape == (2, 3) and dtype == torch.float32 and z.dtype == torch.float64


def _shown(install, message: str, category: type[Warning], module: str) -> bool:
    """Whether a warning of `category` with `message`, attributed to `module`, still shows after `install`."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install()
        warnings.warn_explicit(message, category, f"{module.replace('.', '/')}.py", 1, module=module)
    return len(caught) == 1


def test_expected_warnings_are_hidden_by_message_and_module_only():
    """A resume (Megatron's dist-checkpoint loader) and tp = 2 in CPU mode (Megatron's CUDA stream advice) warn about
    what the framework does on purpose; the same messages from anywhere else still show."""
    from verl_mega.parallel.cpu_mode import drop_cuda_hints
    from verl_mega.trainer.console import drop_expected_warnings

    load = "`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead."
    sharded = "Please use DTensor instead and we are deprecating ShardedTensor."
    cuda = ("When using async grad allreduce it is recommended to set the environment variable "
            "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
    cases = [(drop_expected_warnings, load, FutureWarning, "megatron.core.dist_checkpointing.strategies.torch"),
             (drop_expected_warnings, sharded, FutureWarning, "verl_mega.parallel.cpu_mode"),
             (drop_expected_warnings, sharded, FutureWarning, "torch.distributed.checkpoint.planner"),
             (drop_cuda_hints, cuda, UserWarning, "megatron.core.tensor_parallel.layers")]
    for install, message, category, module in cases:
        assert not _shown(install, message, category, module), (message, module)
        assert _shown(install, message, category, "user_code.train"), (message, "elsewhere")
        assert _shown(lambda: None, message, category, module)  # shown without the filter
