"""actor.shuffle and critic.shuffle: each PPO epoch walks the rows in a fresh random order, or in row order."""

from types import SimpleNamespace

import torch

from verl_mega.trainer.batch import Batch
from verl_mega.trainer.roles import Critic, mini_batches


def _batch(rows: int) -> Batch:
    return Batch({"row": torch.arange(rows), "response_mask": torch.ones(rows, 3)}, {})


def test_mini_batches_cover_every_row_once_per_epoch():
    assert [m["row"].tolist() for m in mini_batches(_batch(6), 4, shuffle=False)] == [[0, 1, 2, 3], [4, 5]]
    torch.manual_seed(0)
    shuffled = [m["row"].tolist() for m in mini_batches(_batch(16), 4, shuffle=True)]
    assert [len(m) for m in shuffled] == [4] * 4
    assert sorted(r for m in shuffled for r in m) == list(range(16))
    assert shuffled != [list(range(s, s + 4)) for s in range(0, 16, 4)]


class _Engine:
    dp_size = 1

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def dp_all_reduce(self, x):
        return x

    def train_step(self, mbs, loss_fn):
        self.seen.append([r for mb in mbs for r in mb["row"].tolist()])
        return {"vf_loss": 0.0}


def _critic_order(shuffle: bool) -> list[list[int]]:
    engine = _Engine()
    critic = Critic(engine, SimpleNamespace(ppo_epochs=2, shuffle=shuffle))
    critic._split = lambda mini, keys: SimpleNamespace(batches=[mini.tensors])
    torch.manual_seed(1)
    critic.update(_batch(16), mini_batch_rows=8)
    return engine.seen


def test_the_critic_reads_critic_shuffle():
    assert _critic_order(False) == [list(range(8)), list(range(8, 16))] * 2
    shuffled = _critic_order(True)
    assert len(shuffled) == 4 and all(sorted(a + b) == list(range(16)) for a, b in (shuffled[:2], shuffled[2:]))
    assert shuffled[:2] != [list(range(8)), list(range(8, 16))] and shuffled[:2] != shuffled[2:]
