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
