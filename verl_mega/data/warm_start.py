"""The warm start of the bundled tiny model: a few supervised steps on a generated task, so that RL starts from a
policy that sometimes samples the right answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from verl_mega.rewards.math_reward import arithmetic_score


def warm_start(model_dir: str | Path, records: list[dict[str, Any]], *, steps: int, lr: float = 3e-3,
               batch_size: int = 64, seed: int = 0) -> dict[str, float]:
    """Briefly supervise a tiny model on `prompt → answer<eos>` so that RL starts from a policy that sometimes
    samples the right answer (RL from a random 0.5M-parameter model would need far longer than a CPU demo).

    Plain single-process PyTorch on the HF model: it only prepares the demo's starting point. Returns the final
    sampled accuracy on `records` (temperature 1), measured the same way the reward does. Records with a
    ``demonstration`` (segments ``[text, trained]``, a multi-turn episode with its tool answers) are trained on those
    instead, and only the loss is reported.
    """
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    model_dir = Path(model_dir)
    tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    encoded = [encode_demonstration(tok, r) for r in records]
    width = max(len(p) + len(a) for p, a, _ in encoded)
    ids = torch.full((len(encoded), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, (p, a, train) in enumerate(encoded):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p): len(p) + len(a)] = torch.where(torch.tensor(train), torch.tensor(a), -100)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(encoded), (batch_size,), generator=gen)
        loss = model(input_ids=ids[idx], labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    stats = {"loss": loss.item() if steps else float("nan")}
    if not any("demonstration" in r for r in records):
        stats["sampled_accuracy"] = _sampled_accuracy(model, tok, encoded, records, gen)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return stats


def encode_demonstration(tok: Any, record: dict[str, Any]) -> tuple[list[int], list[int], list[bool]]:
    """(prompt ids, response ids ending in EOS, whether each response token is trained on) of a record: its answer,
    or its ``demonstration`` segments ``[text, trained]``."""
    prompt = tok.encode(record["prompt"], add_special_tokens=False)
    response, trained = [], []
    for text, train in record.get("demonstration") or [[str(record["answer"]), True]]:
        piece = tok.encode(text, add_special_tokens=False)
        response, trained = response + piece, trained + [bool(train)] * len(piece)
    return prompt, response + [tok.eos_token_id], trained + [True]


@torch.no_grad()
def _sampled_accuracy(model, tok, encoded, records, gen: torch.Generator, max_new: int = 4) -> float:
    correct = 0
    for (p, _, _), r in zip(encoded, records):
        seq = torch.tensor([p])
        out = []
        for _ in range(max_new):
            probs = torch.softmax(model(seq).logits[0, -1].double(), -1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
            if nxt == tok.eos_token_id:
                break
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        correct += arithmetic_score(tok.decode(out), r["answer"])
    return correct / len(records)
