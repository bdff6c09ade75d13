"""The trainer end of a sync across pools (BucketSender) and the rollout end (receive_buckets), joined in-process by
a loopback group: bucket sizes, slices in their own dtype (fp32 beside bf16), a fused parameter written in parts."""

import torch

from verl_mega.hybrid.pool_sync import _StagingSink, write_weights
from verl_mega.hybrid.transport import BucketSender, InPlaceTransport, RolloutLayout, receive_buckets

CPU = torch.device("cpu")
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


class _Done:
    def wait(self) -> None:
        pass


class _Loopback:
    """Both ends of a two-rank group in one process: what the sender broadcasts, the receiver gets, in order."""

    def __init__(self) -> None:
        self.wire: list[torch.Tensor] = []
        self.sender, self.receiver = _End(self, sends=True), _End(self, sends=False)


class _End:
    def __init__(self, link: _Loopback, sends: bool) -> None:
        self.link, self.sends = link, sends

    def broadcast(self, tensors: list[torch.Tensor], opts) -> _Done:
        if self.sends:
            self.link.wire.append(tensors[0].clone())
        else:
            tensors[0].copy_(self.link.wire.pop(0))
        return _Done()


def _module(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    root = torch.nn.Module()
    for name, t in params.items():
        *path, pname = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(pname, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def _deepseek_like() -> dict[str, torch.Tensor]:
    """A bf16 engine whose router keeps DeepSeek's correction bias in fp32, as vLLM does; biases one router update
    (1e-3) apart, which bf16 rounds onto one value."""
    torch.manual_seed(0)
    bias = torch.rand(8) * 0.5 + 1.0
    bias[1] = bias[0] + 1e-3
    return {"model.embed_tokens.weight": torch.randn(16, 4).bfloat16(),
            "model.layers.1.mlp.gate.weight": torch.randn(8, 4).bfloat16(),
            "model.norm.weight": torch.randn(3).bfloat16(),  # 6 bytes: the fp32 slice after it starts aligned
            BIAS: bias}


def _send(layout: RolloutLayout, tensors: dict[str, torch.Tensor], link: _Loopback, bucket_bytes: int) -> BucketSender:
    sender = BucketSender(layout, dtype=torch.bfloat16, device=CPU, bucket_bytes=bucket_bytes, group=link.sender)
    for name, t in tensors.items():
        sender.buffer(name, tuple(t.shape)).copy_(t)
        sender.commit()
    sender.finish()
    return sender


def test_a_bucket_is_no_larger_than_the_block():
    model = torch.nn.Linear(8, 4)  # 32 + 4 elements
    layout = RolloutLayout.of(model)
    assert layout.names == ("bias", "weight") and layout.nbytes == 36 * 4 and not layout.dtypes
    sender = BucketSender(layout, dtype=torch.float32, device=CPU, bucket_bytes=512 << 20)
    assert sender.bucket_bytes == 36 * 4
    weight = sender.buffer("weight", (4, 8))
    assert weight.untyped_storage().nbytes() == 36 * 4  # one bucket for the whole block, not 512 MiB
    sender.buffer("bias", (4,))
    sender.finish()
    assert sender.sent_bytes == 0  # no group: scratch buckets, nothing sent


def test_a_layout_of_unknown_size_keeps_the_configured_bucket():
    layout = RolloutLayout(("weight",), "float32")
    assert layout.nbytes == 0
    sender = BucketSender(layout, dtype=torch.bfloat16, device=CPU, bucket_bytes=1024)
    assert sender.bucket_bytes == 1024


def test_fp32_slices_of_a_bf16_engine_arrive_bit_for_bit():
    """DeepSeek's e_score_correction_bias travels in fp32 (vLLM's dtype for it), the rest in bf16: the engine, the
    background staging sink and the fleet's write get the trainer's values exactly; bytes are the block's."""
    want = _deepseek_like()
    layout = RolloutLayout.of(_module(want))
    assert layout.dtype == "bfloat16" and dict(layout.dtypes) == {BIAS: "float32"}
    block_bytes = sum(t.numel() * t.element_size() for t in want.values())
    assert layout.nbytes == block_bytes

    for bucket_bytes in (1 << 20, 64):  # one bucket; a bucket per slice or two
        link = _Loopback()
        sender = _send(layout, want, link, bucket_bytes)
        wire = list(link.wire)
        engine = _module({n: torch.full_like(t, float("nan")) for n, t in want.items()})
        received = receive_buckets(InPlaceTransport(engine, repacks=False), layout, group=link.receiver,
                                   group_src=0, device=CPU)
        assert received == sender.sent_bytes >= block_bytes
        got = dict(engine.named_parameters())
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        assert got[BIAS][0] != got[BIAS][1]

        link.wire = wire  # the same sync, received in the background (a rollout server or the fleet's supervisor)
        staged = _StagingSink(layout, CPU)
        receive_buckets(staged, layout, group=link.receiver, group_src=0, device=CPU)
        assert staged.tensors[BIAS].dtype == torch.float32 and torch.equal(staged.tensors[BIAS], want[BIAS])
        fleet_engine = _module({n: torch.zeros_like(t) for n, t in want.items()})
        write_weights(fleet_engine, False, staged.tensors)
        assert all(torch.equal(p, want[n]) for n, p in fleet_engine.named_parameters())


def test_a_fused_parameter_completed_when_its_bucket_is_full():
    """MLA's fused_qkv_a_proj is written in two parts, one slice: when its first part fills the bucket, the second
    part gets the same view and opens no (empty) bucket, which the send could not size."""
    layout = RolloutLayout(("fused_qkv_a_proj.weight",), "float32")
    fused = torch.arange(8.0).view(4, 2)
    link = _Loopback()
    sender = BucketSender(layout, dtype=torch.float32, device=CPU, bucket_bytes=fused.numel() * 4, group=link.sender)
    first = sender.buffer("fused_qkv_a_proj.weight", (4, 2))
    first[:2].copy_(fused[:2])
    second = sender.buffer("fused_qkv_a_proj.weight", (4, 2))  # the bucket is full now
    assert second.data_ptr() == first.data_ptr()
    second[2:].copy_(fused[2:])
    sender.finish()
    assert len(link.wire) == 3  # header + bucket, then the end marker
    engine = _module({"fused_qkv_a_proj.weight": torch.zeros(4, 2)})
    receive_buckets(InPlaceTransport(engine, repacks=False), layout, group=link.receiver, group_src=0, device=CPU)
    assert torch.equal(engine.get_parameter("fused_qkv_a_proj.weight"), fused)
