"""The trainer end of a sync across pools sizes its staging buckets by the block it carries."""

import torch

from verl_mega.hybrid.transport import BucketSender, RolloutLayout


def test_a_bucket_is_no_larger_than_the_block():
    model = torch.nn.Linear(8, 4)  # 32 + 4 elements
    layout = RolloutLayout.of(model)
    assert layout.names == ("bias", "weight") and layout.elements == 36
    sender = BucketSender(layout, dtype=torch.float32, device=torch.device("cpu"), bucket_bytes=512 << 20)
    assert sender.bucket_elems == 36
    weight = sender.buffer("weight", (4, 8))
    assert weight.untyped_storage().nbytes() == 36 * 4  # one bucket for the whole block, not 512 MiB
    sender.buffer("bias", (4,))
    sender.finish()
    assert sender.sent_bytes == 0  # no group: scratch buckets, nothing sent


def test_a_layout_of_unknown_size_keeps_the_configured_bucket():
    layout = RolloutLayout(("weight",), "float32")
    assert layout.elements == 0
    sender = BucketSender(layout, dtype=torch.bfloat16, device=torch.device("cpu"), bucket_bytes=1024)
    assert sender.bucket_elems == 512
