"""One RL step: sample → score → advantage → critic update → actor update → weight update.

This is the control flow a researcher edits: :meth:`RLTrainer.step` is the algorithm in plain Python over batches
and the pure functions of :mod:`verl_mega.algos`; communication and memory live in the engine, the rollout and the
hybrid engine. The stages hand their results on as local values and one record per step (:class:`StepData`).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from verl_mega import algos
from verl_mega.config import TrainConfig
from verl_mega.config.rl import GROUP_ESTIMATORS
from verl_mega.parallel.rows import RowTable, imbalance, split_groups
from verl_mega.rollout.base import SEED_MODULUS, Sample, SamplingSpec
from verl_mega.trainer.batch import Batch, pack_sequences
from verl_mega.trainer.dataflow import DataflowBuilder, run_stage
from verl_mega.trainer.roles import old_logprobs_from_update
from verl_mega.rollout.multi_turn import episode_metrics
from verl_mega.rollout.routing_capture import packed_routing
from verl_mega.trainer.stream_scoring import PendingScores, build_stream_scorer, gather_rows


@dataclass
class RewardTally:
    """The reward function's errors, timeouts and scored samples of one step on this rank, and its first error."""

    errors: int = 0
    timeouts: int = 0
    samples: int = 0
    first_error: str | None = None
    infos: dict[str, tuple[float, int]] = field(default_factory=dict)  # its dict values: (sum, count) per key


@dataclass
class StepData:
    """What the stages of one step hand on: the sampling stage fills it, the scoring stages add their tensors to
    ``batch`` (old_logprobs, ref_logprobs, values, then advantages and returns)."""

    prompts: Any  # the step's PromptBatch
    tally: RewardTally = field(default_factory=RewardTally)
    items: list = field(default_factory=list)  # the prompts of every generated batch (DAPO: several), by row.prompt
    table: RowTable | None = None  # every row of the step, the same on every rank
    rows: dict[int, Sample] = field(default_factory=dict)  # the rows this rank trains on, by row index
    batch: Batch | None = None  # those rows, packed
    scores: torch.Tensor | None = None  # every row's reward when dynamic sampling already scored them all
    baselines: torch.Tensor | None = None  # ReMax: each prompt's greedy answer's reward
    streamed: Callable[[], dict] | None = None  # rollout.stream_scoring: outputs scored during generation, by row
    metrics: dict[str, float] = field(default_factory=dict)  # the sampling stage's


class RLTrainer:
    #: run host-only stages (rule-based reward scoring) in a thread, overlapped with device stages
    overlap_host_stages = True

    def __init__(self, cfg: TrainConfig, *, actor, ref, critic, reward_model, rollout, reward_pool, tokenizer,
                 profiler, kl_ctrl, sample_path, arch=None, val_prompts=None, more_prompts=None) -> None:
        self.cfg = cfg
        self.actor, self.ref, self.critic, self.reward_model = actor, ref, critic, reward_model
        self.rollout, self.reward_pool = rollout, reward_pool
        self.tokenizer, self.profiler, self.kl_ctrl = tokenizer, profiler, kl_ctrl
        self.arch = arch  # the model's architecture: with it the step counts its model FLOPs (perf/* metrics)
        self.val_prompts = val_prompts  # a PromptBatch of data.val_files, for validate()
        self.more_prompts = more_prompts  # the next prompt batch (dynamic sampling generates from several per step)
        self.path = sample_path  # rollout → train: which rows reach this rank, and which it scores (transfer.py)
        engine = actor.engine  # samples are split over the actor's data-parallel group
        self.dp, self.dp_rank = engine.dp_size, engine.dp_rank
        # rollout.stream_scoring: off, reward (the reward function scores during generation) or all (the roles too)
        self.stream_scoring = cfg.rollout.stream_scoring
        self.print_each_step = False
        self._host_pool: ThreadPoolExecutor | None = None
        # the old log-probs from the actor's update, no pass of their own, where exact (a benchmark may turn it off)
        self.old_logprobs_in_update = old_logprobs_from_update(cfg)

    # ------------------------------------------------------------------ the step
    def step(self, prompts) -> dict[str, float]:
        """One RL step on a prompt batch (a PromptBatch of the job's loader); returns the step's metrics. A rollout
        pool of its own has been sent this batch (and the ones after it) by ``rollout.prefetch`` already."""
        self.profiler.reset_step()
        # sample: generate, move every row to the data-parallel replica that trains on it, pack
        data = self._stage("rollout", self._rollout, prompts)
        # score: the reward function in a thread while the roles' forward passes run
        rewards = self._host_stage("reward", self._reward, data)
        logprob_gap = self._stage("old_logprob", self._old_logprob, data)
        if self.ref is not None:
            self._stage("ref_logprob", self._ref_logprob, data)
        if self.critic is not None:
            self._stage("values", self._values, data)
        rm_scores = self._stage("rm_score", self._rm_score, data) if self.reward_model is not None else None
        # advantage, then the critic and the actor learn from it
        advantage = self._stage("advantage", self._advantage, data, rewards.result(), rm_scores)
        critic = self._stage("critic_update", self._critic_update, data) if self.critic is not None else {}
        actor = self._stage("actor_update", self._actor_update, data)
        # weight update: the rollout generates the next batch with the new weights
        synced = self._stage("weight_sync", self._weight_sync)
        if self.print_each_step and dist.get_rank() == 0:
            self.print_profiling_summary()
        metrics = {k: v for part in (data.metrics, logprob_gap, advantage, critic, actor, synced)
                   for k, v in part.items() if isinstance(v, float)}
        metrics.update(self.profiler.step_summary())  # stage times, overlap, tokens/s, TFLOP/s, MFU
        # which batch of the data this step trained on (a resumed or asynchronous run can be checked against it)
        metrics.update({"data/epoch": float(prompts.epoch), "data/batch_index": float(prompts.batch_index)})
        metrics.update(self._reward_health(data.tally))
        return metrics

    def dataflow(self) -> DataflowBuilder:
        """The step as a graph, for the :class:`~verl_mega.trainer.dataflow.DataflowBuilder` façade: the stages
        :meth:`step` runs, each depending on the stages whose results it reads (``run({"prompts": batch})`` runs
        them; stage "rollout" is the step's :class:`StepData`). Add or replace stages before ``build()``."""
        b = DataflowBuilder(self.profiler).add_rollout(actor=lambda c: self._rollout(c["prompts"]))
        b.add_stage("reward", lambda c: self._reward(c["rollout"]), deps=("rollout",), host=self.overlap_host_stages)
        scoring = [("old_logprob", self._old_logprob, self.actor), ("ref_logprob", self._ref_logprob, self.ref),
                   ("values", self._values, self.critic), ("rm_score", self._rm_score, self.reward_model)]
        scoring = [(name, fn) for name, fn, role in scoring if role is not None]
        for name, fn in scoring:
            b.add_stage(name, lambda c, fn=fn: fn(c["rollout"]), deps=("rollout",))
        b.add_stage("advantage", lambda c: self._advantage(c["rollout"], c["reward"], c.get("rm_score")),
                    deps=("rollout", "reward", *(name for name, _ in scoring)))
        if self.critic is not None:  # values and returns
            b.add_critic_update(critic=lambda c: self._critic_update(c["rollout"]),
                                data=("rollout", "values", "advantage"))
        policy = ("rollout", "old_logprob", *(("ref_logprob",) if self.ref is not None else ()), "advantage")
        b.add_policy_update(actor=lambda c: self._actor_update(c["rollout"]), data=policy)
        return b.add_stage("weight_sync", lambda c: self._weight_sync(), deps=("actor_update",))

    def enable_profiling(self) -> None:
        """Print the per-stage profile tree after every step (same as trainer.profile=true)."""
        self.print_each_step = True

    def print_profiling_summary(self) -> None:
        """The last step's stage tree: rollout, scoring and its overlap, updates, sync, overlap efficiency."""
        print(self.profiler.format_tree(), flush=True)

    def _stage(self, name: str, fn: Callable, *args) -> Any:
        return run_stage(self.profiler, name, fn, *args)

    def _host_stage(self, name: str, fn: Callable, *args) -> Future:
        """A host stage (the reward function) in a thread; with overlap_host_stages off, here and now."""
        if not self.overlap_host_stages:
            done: Future = Future()
            done.set_result(self._stage(name, fn, *args))
            return done
        if self._host_pool is None:
            self._host_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-stage")
        return self._host_pool.submit(run_stage, self.profiler, name, fn, *args, host=True)

    # ------------------------------------------------------------------ sample
    def _rollout(self, prompts) -> StepData:
        """Generate; then this rank receives the rows its data-parallel replica trains on (and only those) and
        packs them, padded to the global batch's widest row."""
        limit = self.cfg.rollout.max_response_length
        data = StepData(prompts)
        local, metrics = self._sample(data)
        items, table = data.items, data.table
        packing_from = self.profiler.now()
        prompt_len = torch.tensor([len(items[p].prompt_ids) for p in table.prompt.tolist()])
        data.rows, owner = self.path.deliver(local, table, prompt_len, by_engine=self.stream_scoring == "all")
        if self.cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and (split := split_groups(table.prompt, owner)):
            raise RuntimeError(f"prompt groups {split[:4]} are split over data-parallel replicas: their baselines "
                               "would be taken over part of each group")
        mine = sorted(data.rows)
        samples = [data.rows[row] for row in mine]
        packed = pack_sequences([items[s.prompt].prompt_ids for s in samples], [s.ids for s in samples],
                                pad_id=self.tokenizer.pad_token_id or 0, max_response_length=limit,
                                multiple_of=self.actor.engine.seq_multiple,
                                min_width=int((prompt_len + table.length).max()))
        # vLLM's own log-probs of the sampled tokens: a live check that rollout and training agree
        packed["rollout_logprobs"] = torch.zeros_like(packed["response_mask"])
        for i, s in enumerate(samples):  # the EOS token is kept in the response: the policy must learn to stop
            packed["rollout_logprobs"][i, : len(s.logprobs)] = torch.as_tensor(s.logprobs, dtype=torch.float32)
            if s.mask is not None:  # a multi-turn episode: tools' answers are context, not actions
                packed["response_mask"][i, : len(s.mask)] *= torch.as_tensor(s.mask, dtype=torch.float32)
        staleness = self._token_staleness(samples, packed) if table.versioned else {}
        if self.path.routing is not None:  # R3: the experts vLLM routed each token to, replayed in training
            packed["rollout_routing"] = packed_routing(samples, packed["input_ids"].shape[1], self.path.routing)
        data.batch = Batch(packed, {"row": mine, "group": [s.prompt for s in samples]})
        tokens = table.length
        self.profiler.record("postprocess", packing_from, self.profiler.now(), parent="rollout")
        self.profiler.add_counter("tokens", float(tokens.sum()))  # generated tokens, all ranks
        self.profiler.add_counter("prompt_tokens", float(prompt_len.sum()))
        if self.arch is not None:
            self.profiler.add_counter("flops", self._step_flops(prompt_len, tokens))
        # how many weight versions each sample lags the policy being trained (0 in synchronous training)
        metrics["rollout/staleness_mean"] = float((self.rollout.weight_version - table.version).double().mean())
        data.metrics = {**metrics, **staleness, "rollout/response_length": float(tokens.sum()) / len(table),
                        "rollout/weight_version": float(table.version.max()),
                        "rollout/truncated_frac": float((tokens >= limit).float().mean()),
                        "rollout/dp_token_imbalance": imbalance(owner, prompt_len + tokens, self.dp)}
        return data

    def _sample(self, data: StepData) -> tuple[dict[int, Sample], dict[str, float]]:
        """This engine's rows of the step (``data.items`` and ``data.table`` are filled in): one generation of the
        prompt batch or, with DAPO dynamic sampling, generations of further batches until data.train_batch_size
        groups have rewards that differ (dropped groups fill a batch still short after
        algorithm.filter_groups.max_num_gen_batches)."""
        fcfg, frac = self.cfg.algorithm.filter_groups, self.cfg.rollout.multi_turn.max_tool_failure_frac
        n = self.cfg.rollout.n  # the training specs' (RLTrainer.specs)
        rounds, batch, counts, candidates = 0, data.prompts, {}, []
        while batch is not None:
            rounds += 1
            generated = self._generate(batch, self.specs(batch), data)  # each batch: its own position's seeds
            offset = len(data.items)
            data.items += batch.items
            gen = generated[0]
            rows_of = [s.prompt * n + k for k, s in zip(_occurrence(s.prompt for s in gen.samples), gen.samples)]
            table, c = self.path.table(gen, rows_of, [offset + i // n for i in range(len(batch.items) * n)],
                                       counts=True)
            # a fleet's counters are the rollout pool's state after the batch, not per-batch amounts
            counts = {k: v if k.startswith("fleet/") else counts.get(k, 0.0) + v for k, v in c.items()}
            local = {row: s._replace(prompt=s.prompt + offset) for row, s in zip(rows_of, gen.samples)}
            if len(generated) > 1:
                data.baselines = self._engine_scores(generated[1], data, offset, len(batch.items))
            if not fcfg.enable:
                data.table = table
                return local, {**episode_metrics(counts, frac), **_fleet_metrics(counts)}
            scores = self._engine_scores(gen, data, offset, len(table), rows_of=rows_of)
            candidates.append((table, local, scores))
            keep = algos.dynamic_sampling_keep(scores, table.prompt).rows
            if len(set(table.prompt[keep].tolist()) | _kept_groups(candidates[:-1])) >= len(data.prompts) or \
                    rounds >= fcfg.max_num_gen_batches:
                break
            batch = self.more_prompts() if self.more_prompts is not None else None
        data.table, local, data.scores, metrics = _filter_groups(candidates, len(data.prompts))
        metrics["dapo/gen_batches"] = float(rounds)
        metrics["dapo/kept_group_frac"] = metrics.pop("kept_groups") / max(1, len(data.items))
        return local, {**metrics, **episode_metrics(counts, frac), **_fleet_metrics(counts)}

    def _generate(self, batch, specs, data: StepData):
        """The rollout of one prompt batch; with rollout.stream_scoring its samples are scored as they finish."""
        prompts = [p.prompt_ids for p in batch.items]
        if self.stream_scoring == "off":
            return self.rollout.generate(prompts, specs)
        scorer = build_stream_scorer(self, batch.items, data.tally, roles=self.stream_scoring == "all")
        n, chunk = specs[0].n, scorer.chunk_rows
        scorer.start()
        data.streamed = scorer.outputs  # the first stage to ask waits for the last micro-batch

        def finished(samples, running: int) -> None:  # sample j of a prompt is row prompt·n + j
            # once fewer samples than a micro-batch are still generating, waiting for a full one is waiting for
            # the end: the tail is scored as it finishes
            scorer.add([(s.prompt * n + j, s) for j, s in samples], flush=running < chunk, generating=running)

        try:
            return self.rollout.generate(prompts, specs, on_finished=finished)
        finally:
            scorer.close()  # what is left is the last micro-batch

    def _streamed(self, data: StepData, key: str, *, by_row: bool = False):
        """A streamed output for the batch's rows, in their order (``by_row``: as scored, {row: value}); None
        when that output is not streamed."""
        if data.streamed is None or (key != "reward" and self.stream_scoring != "all"):
            return None
        scored = data.streamed().get(key, {})
        return scored if by_row else gather_rows(scored, data.batch.meta["row"])

    def _token_staleness(self, samples, packed) -> dict[str, float]:
        """Partial rollouts: the weight version that sampled each response token goes into the batch
        (``rollout_versions``); token-weighted staleness and the share of samples that span several versions."""
        versions = torch.zeros(packed["response_mask"].shape, dtype=torch.long)
        for i, s in enumerate(samples):
            if s.versions is not None:
                got = torch.as_tensor(s.versions)[: versions.shape[1]]
                versions[i, : len(got)] = got
        packed["rollout_versions"] = versions
        mask = packed["response_mask"]
        lag = (self.rollout.weight_version - versions).float()
        spans = torch.tensor([float(s.versions is not None and len(s.versions) > 0 and int(s.versions[0]) !=
                                    int(s.versions[-1])) for s in samples])
        return {"rollout/token_staleness_mean": self._dp_reduce(algos.masked_mean(lag, mask), "mean"),
                "rollout/partial_frac": self._dp_reduce(spans.mean(), "mean")}

    def specs(self, prompt_batch) -> list[SamplingSpec]:
        """The sampling specs of the step on ``prompt_batch`` (a rollout request is its prompts and these)."""
        specs = [self._sampling(prompt_batch)]
        if self.cfg.algorithm.adv_estimator == "remax":  # ReMax's baseline: one greedy answer per prompt
            specs.append(SamplingSpec(n=1, max_tokens=self.cfg.rollout.max_response_length, temperature=0.0,
                                      stop_token_ids=specs[0].stop_token_ids, ignore_eos=specs[0].ignore_eos,
                                      logprobs=True))
        return specs

    def _sampling(self, prompt_batch, *, validation: bool = False) -> SamplingSpec:
        """Training samples rollout.n answers per prompt; validation one, at rollout.val_temperature (0: greedy).
        Seeds are explicit and derived from the data position, so a resumed run samples exactly what an
        uninterrupted one would (prompt i of the batch gets ``prompt_seed(seed, i, n)``)."""
        rcfg = self.cfg.rollout
        base = rcfg.seed if rcfg.seed is not None else self.cfg.trainer.seed
        position = prompt_batch.epoch * 1_000_003 + prompt_batch.batch_index
        return SamplingSpec(n=1 if validation else rcfg.n, max_tokens=rcfg.max_response_length,
                            temperature=rcfg.val_temperature if validation else rcfg.temperature,
                            top_p=1.0 if validation else rcfg.top_p, top_k=0 if validation else max(rcfg.top_k, 0),
                            ignore_eos=rcfg.ignore_eos,
                            # fixed-length generation: EOS must not stop it either
                            stop_token_ids=() if rcfg.ignore_eos else (self.tokenizer.eos_token_id,), logprobs=True,
                            # steps a prime apart, more than a step's prompts·n seeds (rollout.base.prompt_seed)
                            seed=(base * 7_919 + position * 1_000_003) % SEED_MODULUS)

    # ------------------------------------------------------------------ score
    def _reward(self, data: StepData) -> tuple[torch.Tensor, bool]:
        """Rewards of the rows this rank scores (its share of its replica's rows), in a vector over every row of
        the step, and whether that vector is already complete (dynamic sampling scored every row)."""
        if data.scores is not None:
            return data.scores, True
        partial = torch.zeros(len(data.table), dtype=torch.float32)
        streamed = self._streamed(data, "reward", by_row=True)
        if streamed is not None:  # scored during generation, each row by one rank of its engine
            for row, score in streamed.items():
                partial[row] = score
            return partial, False
        rows = self.path.replica_share(data.batch.meta["row"])
        if rows:
            samples = [data.rows[row] for row in rows]
            partial[rows] = self._scores([self._text(s.ids) for s in samples], [data.items[s.prompt] for s in samples],
                                         data.table.length[rows].tolist(), data.tally)
        return partial, False

    def _engine_scores(self, gen, data: StepData, offset: int, num_rows: int, rows_of=None) -> torch.Tensor:
        """Every row's reward, known to every rank: each rank scores its share of its engine's samples, one
        all-reduce. ``rows_of``: each sample's row (default: its prompt, one sample per prompt)."""
        rows_of = rows_of if rows_of is not None else [s.prompt for s in gen.samples]
        by_row = dict(zip(rows_of, gen.samples))
        share = self.path.engine_share(sorted(by_row))
        limit = self.cfg.rollout.max_response_length
        partial = torch.zeros(num_rows, dtype=torch.float32)
        if share:
            samples = [by_row[row] for row in share]
            partial[share] = self._scores([self._text(s.ids) for s in samples],
                                          [data.items[offset + s.prompt] for s in samples],
                                          [min(len(s.ids), limit) for s in samples], data.tally)
        return self.path.sum_over_pool(partial)

    def _scores(self, texts: list[str], prompts: list, lengths, tally: RewardTally) -> torch.Tensor:
        """Reward-function scores plus, with reward.overlong_buffer, DAPO's overlong penalty. ``prompts``: each
        sample's prompt item (its ground truth, and its row's fields for the function: data_source, extra_info...)."""
        return self._submit_scores(texts, prompts, lengths, tally).finish()

    def _submit_scores(self, texts: list[str], prompts: list, lengths, tally: RewardTally) -> PendingScores:
        """:meth:`_scores` handed to the reward pool: returns at once; ``finish()`` waits for the pool and returns
        the scores (counting the function's errors in ``tally``)."""
        future = self.reward_pool.submit(texts, [p.ground_truth for p in prompts], [p.extra for p in prompts])

        def finish() -> torch.Tensor:
            result = future.result()
            for key, (total, count) in result.info_sums().items():
                mine = tally.infos.get(key, (0.0, 0))
                tally.infos[key] = (mine[0] + total, mine[1] + count)
            tally.errors, tally.timeouts = tally.errors + result.num_errors, tally.timeouts + result.num_timeouts
            tally.samples += len(texts)
            tally.first_error = tally.first_error or result.first_error
            scores = torch.tensor(result.scores, dtype=torch.float32)
            ob = self.cfg.reward.overlong_buffer
            if ob.enable:
                limit = self.cfg.rollout.max_response_length
                scores = scores + algos.overlong_buffer_penalty(torch.as_tensor(lengths), limit, ob.len,
                                                                ob.penalty_factor)
            return scores

        return PendingScores(future, finish)

    def _text(self, ids: list[int] | torch.Tensor) -> str:
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode([t for t in (ids.tolist() if torch.is_tensor(ids) else ids) if t != eos])

    def _reward_health(self, tally: RewardTally) -> dict[str, float]:
        """reward/errors and reward/timeouts of the step, over the pool's samples (each is scored on one rank).
        Past reward.max_error_frac the run stops with the function's first error; the counts are summed over every
        rank first, so all ranks stop together."""
        from verl_mega.rewards import RewardFunctionFailed
        from verl_mega.rewards.pool import info_metrics

        counts = torch.tensor([tally.errors, tally.timeouts, tally.samples, len(tally.infos)], dtype=torch.float64)
        errors, timeouts, samples, info_keys = self.path.sum_over_pool(counts).tolist()
        limit = self.cfg.reward.max_error_frac
        if samples and (errors + timeouts) / samples > limit:
            first = " ".join(str(next((f for f in self._pool_objects(tally.first_error) if f), "unknown")).split())
            raise RewardFunctionFailed(
                f"reward function '{self.reward_pool.name}' failed on {errors + timeouts:g} of {samples:g} samples "
                f"of this step ({errors:g} errors, {timeouts:g} timeouts), more than reward.max_error_frac={limit:g}; "
                f"first: {first}; fix the function, or raise reward.timeout_s or reward.max_error_frac")
        # reward/<key>: the means, over the pool, of the values the reward function returned beside its score
        infos = info_metrics(self._pool_objects(tally.infos)) if info_keys else {}
        return {"reward/errors": errors, "reward/timeouts": timeouts, **infos}

    def _pool_objects(self, obj: Any) -> list:
        """``obj`` of every rank of the pool (the sample path's group)."""
        group = self.path.group
        if group is None or dist.get_world_size(group) == 1:
            return [obj]
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, obj, group=group)
        return everyone

    def _old_logprob(self, data: StepData) -> dict[str, float]:
        """The actor's log-probs and entropy of the sampled tokens before the update; returns how far they are from
        vLLM's own log-probs of the same tokens. Where the update computes them itself, nothing (its metrics then)."""
        if self.old_logprobs_in_update:
            return {}
        b = data.batch
        streamed = self._streamed(data, "old_logprobs")
        if streamed is not None:
            out = {"logprobs": streamed, "entropy": self._streamed(data, "entropy")}
        else:
            out = self.actor.compute_logprobs(b, with_entropy=True)
        b["old_logprobs"] = out["logprobs"]
        if "routed_experts" in out:  # actor.routing_replay=r2/r3: the update replays this routing
            b["routed_experts"] = out["routed_experts"]
        b["entropy"] = out["entropy"]
        gap = self._old_metrics(b)
        if "router_agreement" in out:  # R3: Megatron's routers vs vLLM's routing, same weights (pool-wide already)
            gap["rollout/router_agreement"] = float(out["router_agreement"])
        return gap

    def _old_metrics(self, b, *, kl: bool = False) -> dict[str, float]:
        """How far the old log-probs are from vLLM's, the old policy's entropy and (``kl``) its KL to the reference."""
        mask = b["response_mask"]
        diff = (b["old_logprobs"] - b["rollout_logprobs"]).abs() * mask
        worst = diff.max() if mask.any() else diff.sum()
        metrics = {"rollout/logprob_diff_max": self._dp_reduce(worst, "max"),
                   "rollout/logprob_diff_mean": self._dp_reduce(algos.masked_mean(diff, mask), "mean"),
                   "actor/entropy_rollout": self._dp_reduce(algos.masked_mean(b["entropy"], mask), "mean")}
        if kl and self.ref is not None:
            kl_ref = algos.masked_mean(algos.kl_penalty(b["old_logprobs"], b["ref_logprobs"], "kl"), mask)
            metrics["kl/actor_ref"] = self._dp_reduce(kl_ref, "mean")
        return metrics

    def _ref_logprob(self, data: StepData) -> None:
        streamed = self._streamed(data, "ref_logprobs")
        data.batch["ref_logprobs"] = streamed if streamed is not None else \
            self.ref.compute_logprobs(data.batch)["logprobs"]

    def _values(self, data: StepData) -> None:
        streamed = self._streamed(data, "values")
        data.batch["values"] = streamed if streamed is not None else self.critic.compute_values(data.batch)

    def _rm_score(self, data: StepData) -> torch.Tensor:
        streamed = self._streamed(data, "rm_score")
        return streamed if streamed is not None else self.reward_model.score(data.batch)

    # ------------------------------------------------------------------ advantage
    def _advantage(self, data: StepData, rewards: tuple[torch.Tensor, bool],
                   rm_scores: torch.Tensor | None) -> dict[str, float]:
        """Every row's reward (``rewards``: this rank's, or every row's when complete; plus the reward model's
        score of this rank's rows) → token rewards (KL penalty) → advantages and returns."""
        acfg, b = self.cfg.algorithm, data.batch
        scores, complete = rewards
        if not complete:
            scores = self.path.sum_over_pool(scores)
        if rm_scores is not None:  # the reward model scored the replica's rows on each of its ranks: count them once
            rm = torch.zeros_like(scores)
            if self.path.replica[0] == dist.get_rank():
                rm[b.meta["row"]] = rm_scores.float()
            scores = scores + self.path.sum_over_pool(rm)
        mask = b["response_mask"]
        token_rewards = algos.outcome_to_token_rewards(scores[b.meta["row"]], mask)
        metrics = {}
        if acfg.use_kl_in_reward:
            token_rewards, kl_metrics = algos.apply_kl_penalty(token_rewards, b["old_logprobs"], b["ref_logprobs"],
                                                               mask, self.kl_ctrl.value, acfg.kl_penalty)
            current_kl = self._dp_reduce(kl_metrics["kl"], "mean")
            self.kl_ctrl.update(current_kl, len(data.table))
            metrics.update({"kl/reward_kl": current_kl, "kl/coef": float(self.kl_ctrl.value)})
        # groups are whole on each rank (group baselines need no communication); whitening sums over the replicas
        baselines = data.baselines[torch.tensor(b.meta["group"])] if data.baselines is not None else None
        b["advantages"], b["returns"] = algos.compute_advantage(
            acfg.adv_estimator, token_level_rewards=token_rewards, response_mask=mask, values=b.tensors.get("values"),
            group_index=b.meta["group"], reward_baselines=baselines, gamma=acfg.gamma, lam=acfg.lam,
            norm_adv_by_std_in_grpo=acfg.norm_adv_by_std_in_grpo, batch_sum=self._batch_sum)
        if "ref_logprobs" not in b and "old_logprobs" in b:  # (from the update: its loss takes them alike)
            b["ref_logprobs"] = b["old_logprobs"]
        if data.baselines is not None:
            metrics["reward/baseline_mean"] = float(data.baselines[data.table.prompt].mean())
        metrics.update({"reward/mean": float(scores.mean()), "reward/max": float(scores.max()),
                        "reward/min": float(scores.min())})
        if "old_logprobs" in b and self.ref is not None:  # (from the update: after it)
            kl = algos.masked_mean(algos.kl_penalty(b["old_logprobs"], b["ref_logprobs"], "kl"), mask)
            metrics["kl/actor_ref"] = self._dp_reduce(kl, "mean")
        return metrics

    # ------------------------------------------------------------------ update
    def _critic_update(self, data: StepData) -> dict[str, float]:
        return self.critic.update(data.batch, mini_batch_rows=self._mini_rows(self.cfg.critic.ppo_mini_batch_size))

    def _actor_update(self, data: StepData) -> dict[str, float]:
        b, in_update = data.batch, self.old_logprobs_in_update
        metrics = self.actor.update(b, mini_batch_rows=self._mini_rows(self.cfg.actor.ppo_mini_batch_size),
                                    old_from_update=in_update)
        return metrics | (self._old_metrics(b, kl=True) if in_update else {})

    def _weight_sync(self) -> dict[str, float]:
        metrics = dict(self.rollout.update_weights())
        metrics["actor/version"] = float(self.actor.engine.version)
        return metrics

    def _mini_rows(self, prompts_per_mini: int) -> int:
        return max(1, prompts_per_mini * self.cfg.rollout.n // self.dp)

    def _dp_reduce(self, value, op: str) -> float:
        return float(self.actor.engine.dp_all_reduce(value, op))

    def _batch_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel replicas (the rows of a step are split over them)."""
        if self.dp == 1:
            return value
        return self.actor.engine.dp_all_reduce(value).to(value.dtype)

    # ------------------------------------------------------------------ validation and FLOPs
    def validate(self) -> dict[str, float]:
        """Generate one answer per data.val_files prompt with the current weights and score it: val/* metrics.
        Every rank scores its share of its engine's answers; one all-reduce sums them."""
        if self.val_prompts is None:
            raise ValueError("RLTrainer.validate() needs data.val_files; set data.val_files=[...]")
        items = self.val_prompts.items
        (gen,) = self.rollout.generate([p.prompt_ids for p in items], [self._sampling(self.val_prompts,
                                                                                     validation=True)])
        by_prompt = {s.prompt: s for s in gen.samples}
        mine = [by_prompt[p] for p in self.path.engine_share(sorted(by_prompt))]
        scores = self.reward_pool.score([self._text(s.ids) for s in mine], [items[s.prompt].ground_truth for s in mine],
                                        [items[s.prompt].extra for s in mine])
        totals = torch.tensor([float(sum(scores.scores)), float(sum(len(s.ids) for s in mine)), float(len(mine))],
                              dtype=torch.float64)
        total, tokens, count = self.path.sum_over_pool(totals).tolist()
        return {"val/reward/mean": total / count, "val/response_length": tokens / count, "val/num_samples": count}

    def _step_flops(self, prompt_len: torch.Tensor, response_len: torch.Tensor) -> float:
        """Model FLOPs of this step, all ranks: generation (forward per generated token at its mean context) plus
        every forward (old/ref log-probs, values, RM) and forward+backward (updates × ppo_epochs) over the batch;
        the critic and the reward model end in a value head. With LoRA the actor's base weights are frozen: its
        update skips their weight-gradient GEMMs."""
        from verl_mega.models.flops import model_flops_per_token

        def per_token(context: float, training: bool = False, value_head: bool = False, frozen: bool = False) -> float:
            return model_flops_per_token(self.arch, context=int(context), training=training, value_head=value_head,
                                         frozen_base=frozen)

        lengths = (prompt_len + response_len).float()
        context = float(lengths.mean())
        lora = self.cfg.model.lora.enabled
        passes = per_token(context) * (not self.old_logprobs_in_update)  # the old log-probs' own pass
        passes += per_token(context, True, frozen=lora) * self.cfg.actor.ppo_epochs
        passes += per_token(context) * (self.ref is not None)
        passes += per_token(context, value_head=True) * (self.reward_model is not None)
        if self.critic is not None:
            passes += per_token(context, value_head=True) + per_token(context, True, True) * self.cfg.critic.ppo_epochs
        gen_context = float((prompt_len + response_len / 2).float().mean())
        return float(lengths.sum()) * passes + float(response_len.sum()) * per_token(gen_context)


def _occurrence(keys):
    """For each key, how many times it came before (0, 1, … per key)."""
    seen: dict = {}
    for key in keys:
        seen[key] = seen.get(key, -1) + 1
        yield seen[key]


def _fleet_metrics(counts: dict[str, float]) -> dict[str, float]:
    """A rollout fleet's state after the step's batch (rollout.fleet): engines serving, prompt groups redone on
    another engine and engine restarts, both since the job's attempt started."""
    return {f"rollout/{k.removeprefix('fleet/')}": v for k, v in counts.items() if k.startswith("fleet/")}


def _kept_groups(candidates) -> set[int]:
    """Groups that dynamic sampling kept in earlier rounds."""
    return {g for table, _, scores in candidates
            for g in table.prompt[algos.dynamic_sampling_keep(scores, table.prompt).rows].tolist()}


def _filter_groups(candidates, num_groups: int):
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
    kept_groups = {int(candidates[k][0].prompt[row]) for k, row in kept}
    metrics = {"kept_groups": float(len(kept_groups)),
               "dapo/generated_reward_mean": float(torch.cat([s for _, _, s in candidates]).mean()),
               "dapo/filled_groups": float(num_groups - len(kept_groups & set(groups)))}
    return table, local, scores, metrics
