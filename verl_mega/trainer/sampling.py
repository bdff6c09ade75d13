"""Pieces of the sampling stage of the RL step (:mod:`verl_mega.trainer.rl_trainer`): DAPO's dynamic sampling over
several generation rounds, the scorer of rollout.stream_scoring, multi-turn counts and routed experts in the packed
layout."""

from __future__ import annotations

from typing import Any

import torch

from verl_mega import algos
from verl_mega.parallel.rows import RowTable
from verl_mega.rollout.multi_turn import check_tool_failures
from verl_mega.trainer.batch import Batch, pack_sequences
from verl_mega.trainer.stream_scoring import StreamScorer


def build_stream_scorer(trainer: Any, items: list, tally: Any, *, roles: bool) -> StreamScorer:
    """The scoring stages of rollout.stream_scoring for one generation of ``items`` (the prompts), over
    micro-batches of finished samples: the same reward function (its errors counted in ``tally``) and, with
    ``roles`` (``all``), the same roles as the synchronous stages, per micro-batch."""
    limit, pad = trainer.cfg.rollout.max_response_length, trainer.tokenizer.pad_token_id or 0

    def pack(pairs) -> Batch:
        samples = [s for _, s in pairs]
        packed = pack_sequences([items[s.prompt].prompt_ids for s in samples], [s.ids for s in samples], pad_id=pad,
                                max_response_length=limit, multiple_of=trainer.actor.engine.seq_multiple)
        return Batch(packed, {"row": [row for row, _ in pairs], "group": [s.prompt for s in samples]})

    def old_logprob(b: Batch):
        out = trainer.actor.compute_logprobs(b, with_entropy=True)
        return {"old_logprobs": out["logprobs"], "entropy": out["entropy"]}

    def reward(b: Batch):  # this rank's share of the micro-batch; the other ranks of its engine score the rest
        rows = b.meta["row"]
        share = set(trainer.path.engine_share(rows))
        mine = [i for i, row in enumerate(rows) if row in share]
        out = torch.zeros(len(rows), dtype=torch.float32)
        if mine:
            lengths = b["response_len"][mine].tolist()
            out[mine] = trainer._scores([trainer._text(b["responses"][i, :n]) for i, n in zip(mine, lengths)],
                                        [items[b.meta["group"][i]].ground_truth for i in mine], lengths, tally)
        return {"reward": out}

    stages = []
    if roles:  # rollout.stream_scoring=all: the roles' forward passes too
        stages.append(("old_logprob", old_logprob))
        if trainer.ref is not None:
            stages.append(("ref_logprob", lambda b: {"ref_logprobs": trainer.ref.compute_logprobs(b)["logprobs"]}))
        if trainer.critic is not None:
            stages.append(("values", lambda b: {"values": trainer.critic.compute_values(b)}))
        if trainer.reward_model is not None:
            stages.append(("rm_score", lambda b: {"rm_score": trainer.reward_model.score(b)}))
    stages.append(("reward", reward))
    device = None  # the reward function alone uses no device
    if roles and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return StreamScorer(stages=stages, pack=pack, chunk_rows=trainer.cfg.rollout.stream_chunk,
                        profiler=trainer.profiler, device=device)


def occurrence(keys):
    """For each key, how many times it came before (0, 1, … per key)."""
    seen: dict = {}
    for key in keys:
        seen[key] = seen.get(key, -1) + 1
        yield seen[key]


def rollout_routing(samples, width: int, shape: tuple[int, int]) -> torch.Tensor:
    """The samples' routed experts in the packed layout [rows, width, model layers, k] (int16, -1: unknown)."""
    out = torch.full((len(samples), width, *shape), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        if s.routing is not None:
            m = min(width, s.routing.shape[0])
            out[i, :m] = s.routing[:m]
    return out


def episode_metrics(counts: dict[str, float], max_failure_frac: float) -> dict[str, float]:
    """Multi-turn rollouts: turns and tool calls per episode, and the share of tool calls that answered an error.
    Past rollout.multi_turn.max_tool_failure_frac failed calls (counted over the pool) the run stops, on every rank."""
    if not counts.get("episodes"):
        return {}
    check_tool_failures(counts["tool_calls"], counts.get("tool_failures", 0.0), max_failure_frac)
    episodes = counts["episodes"]
    return {"rollout/turns": counts["turns"] / episodes, "rollout/tool_calls": counts["tool_calls"] / episodes,
            "rollout/tool_error_frac": counts["tool_errors"] / max(counts["tool_calls"], 1.0)}


def kept_groups(candidates) -> set[int]:
    """Groups that dynamic sampling kept in earlier rounds."""
    return {g for table, _, scores in candidates
            for g in table.prompt[algos.dynamic_sampling_keep(scores, table.prompt).rows].tolist()}


def filter_groups(candidates, num_groups: int):
    """DAPO's batch from the rounds' (table, rows, scores): the first ``num_groups`` groups whose rewards differ,
    then, if short, groups that were dropped; whole groups, kept ones first. Returns the new table, this engine's
    rows renumbered, every row's score and metrics."""
    kept, dropped = [], []
    for k, (table, _, scores) in enumerate(candidates):
        keep = algos.dynamic_sampling_keep(scores, table.prompt).rows.tolist()
        for row, ok in enumerate(keep):
            (kept if ok else dropped).append((k, row))
    groups: dict[int, list[tuple[int, int]]] = {}
    for k, row in kept + dropped:
        g = int(candidates[k][0].prompt[row])
        if g in groups or len(groups) < num_groups:
            groups.setdefault(g, []).append((k, row))
    chosen = [x for rows in groups.values() for x in rows]
    pick = {name: torch.stack([getattr(candidates[k][0], name)[row] for k, row in chosen])
            for name in ("prompt", "length", "version", "engine")}
    table = RowTable(**pick, masked=any(t.masked for t, _, _ in candidates),
                     versioned=any(t.versioned for t, _, _ in candidates))
    local = {new: candidates[k][1][row] for new, (k, row) in enumerate(chosen) if row in candidates[k][1]}
    scores = torch.stack([candidates[k][2][row] for k, row in chosen])
    kept_set = {int(candidates[k][0].prompt[row]) for k, row in kept}
    metrics = {"kept_groups": float(len(kept_set)),
               "dapo/generated_reward_mean": float(torch.cat([s for _, _, s in candidates]).mean()),
               "dapo/filled_groups": float(num_groups - len(kept_set & set(groups)))}
    return table, local, scores, metrics
