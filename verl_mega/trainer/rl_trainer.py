"""One RL step (rollout → score → advantage → critic update → actor update → weight sync) as a dataflow.

This is the control flow a researcher edits: the algorithm is plain Python over batches and the pure functions of
:mod:`verl_mega.algos`; communication and memory live in the engine, the rollout and the hybrid engine.
"""

from __future__ import annotations

from typing import Any

import threading

import torch
import torch.distributed as dist

from verl_mega import algos
from verl_mega.config import TrainConfig
from verl_mega.rollout.colocated import SEED_MODULUS
from verl_mega.rollout.multi_turn import check_tool_failures
from verl_mega.rollout.vllm_rollout import SamplingSpec
from verl_mega.trainer.batch import Batch, pack_sequences
from verl_mega.trainer.dataflow import DataflowBuilder
from verl_mega.trainer.stream_scoring import StreamScorer, gather_rows
from verl_mega.trainer.transfer import RowTable, imbalance


class RLTrainer:
    #: run host-only stages (rule-based reward scoring) in threads, overlapped with device stages
    overlap_host_stages = True

    def __init__(self, cfg: TrainConfig, *, actor, ref, critic, reward_model, rollout, reward_pool, tokenizer,
                 profiler, kl_ctrl, sample_path, arch=None, val_prompts=None, more_prompts=None,
                 upcoming=None) -> None:
        self.cfg = cfg
        self.actor, self.ref, self.critic, self.reward_model = actor, ref, critic, reward_model
        self.rollout, self.reward_pool = rollout, reward_pool
        self.tokenizer, self.profiler, self.kl_ctrl = tokenizer, profiler, kl_ctrl
        self.arch = arch  # the model's architecture: with it the step counts its model FLOPs (perf/* metrics)
        self.val_prompts = val_prompts  # a PromptBatch of data.val_files, for validate()
        self.more_prompts = more_prompts  # the next prompt batch (dynamic sampling generates from several per step)
        self.upcoming = upcoming  # upcoming(k): the batch k steps ahead, unconsumed (rollout.max_staleness sends it)
        self.path = sample_path  # rollout → train: which rows reach this rank, and which it scores (transfer.py)
        self.prescored = self.baseline_scores = None
        self._reward_counts = [0, 0, 0]  # this step's errors, timeouts and scored samples on this rank
        self._reward_first_error: str | None = None
        self._reward_infos: dict[str, tuple[float, int]] = {}  # the function's dict values: (sum, count) per key
        engine = actor.engine  # samples are split over the actor's data-parallel group
        self.dp, self.dp_rank = engine.dp_size, engine.dp_rank
        self.flow = self._build_flow()
        # rollout.stream_scoring: the step's samples are scored while vLLM generates (trainer/stream_scoring.py)
        self.stream_roles = cfg.rollout.stream_scoring == "all"  # the roles score during generation too
        self.scorer = build_stream_scorer(self) if cfg.rollout.stream_scoring != "off" else None
        self._stream_lock = threading.Lock()
        self._stream_out: dict | None = None

    # ------------------------------------------------------------------ the step, as a graph
    def _build_flow(self):
        b = DataflowBuilder(self.profiler).add_rollout(actor=self._rollout)
        # CPU reward scoring runs in a thread, overlapped with device scoring
        b.add_stage("reward", self._reward, deps=("rollout",), host=self.overlap_host_stages)
        b.add_stage("old_logprob", self._old_logprob, deps=("rollout",))
        if self.ref is not None:
            b.add_stage("ref_logprob", self._ref_logprob, deps=("rollout",))
        if self.critic is not None:
            b.add_stage("values", self._values, deps=("rollout",))
        if self.reward_model is not None:
            b.add_stage("rm_score", self._rm_score, deps=("rollout",))
        b.add_stage("advantage", self._advantage, deps=("reward", "old_logprob"))
        if self.critic is not None:
            b.add_critic_update(critic=self._critic_update, data="advantage")
        b.add_policy_update(actor=self._actor_update, data="advantage")
        b.add_stage("weight_sync", self._weight_sync, deps=("actor_update",))
        return b.build()

    @classmethod
    def create(cls, *, actor, actor_backend=None, recipe=None, overrides=None) -> "RLTrainer":
        """``RLTrainer.create(actor="tiny"|HF dir, actor_backend=vLLMBackend(...), overrides={...})``: build the whole
        job from a recipe (default configs/quickstart_cpu.yaml) and return its trainer (see trainer/api.py)."""
        from verl_mega.trainer.api import create_trainer

        return create_trainer(cls, actor=actor, actor_backend=actor_backend, recipe=recipe, overrides=overrides)

    def close(self) -> None:
        """Finish pending checkpoint writes and release vLLM and the reward pool (trainers from :meth:`create`)."""
        job = getattr(self, "job", None)
        if job is not None:
            job.close()
            self.job = None

    def enable_profiling(self) -> None:
        """Print the per-stage profile tree after every step (same as trainer.profile=true)."""
        self.print_each_step = True

    def print_profiling_summary(self) -> None:
        """The last step's stage tree: rollout, scoring and its overlap, updates, sync, overlap efficiency."""
        print(self.profiler.format_tree(), flush=True)

    def step(self, prompt_batch=None) -> dict[str, float]:
        """One RL step on ``prompt_batch`` (by default the next batch of the job's data loader)."""
        if prompt_batch is None:
            if getattr(self, "job", None) is None:
                raise ValueError("RLTrainer.step() without a prompt batch needs a trainer from RLTrainer.create(); "
                                 "pass a batch from a PromptLoader otherwise")
            prompt_batch = self.job.loader.next_batch() if self.job_step < self.job.total_steps else None
            if prompt_batch is None:
                raise StopIteration(f"trainer.total_steps={self.job.total_steps} (or the data) is exhausted")
            self.job_step += 1
        self.profiler.reset_step()
        self._reward_counts, self._reward_first_error, self._reward_infos = [0, 0, 0], None, {}
        out = self.flow.run({"prompts": prompt_batch})
        if getattr(self, "print_each_step", False) and dist.get_rank() == 0:
            self.print_profiling_summary()
        metrics: dict[str, float] = {}
        for name in ("rollout", "reward", "advantage", "critic_update", "actor_update", "weight_sync"):
            if isinstance(out.get(name), dict):
                metrics.update({k: v for k, v in out[name].items() if isinstance(v, float)})
        metrics.update(self.profiler.step_summary())  # stage times, overlap, tokens/s, TFLOP/s, MFU
        # which batch of the data this step trained on (a resumed or asynchronous run can be checked against it)
        metrics.update({"data/epoch": float(prompt_batch.epoch), "data/batch_index": float(prompt_batch.batch_index)})
        metrics.update(self._reward_health())
        return metrics

    def _reward_health(self) -> dict[str, float]:
        """reward/errors and reward/timeouts of the step, over the pool's samples (each is scored on one rank).
        Past reward.max_error_frac the run stops with the function's first error; the counts are summed over every
        rank first, so all ranks stop together."""
        from verl_mega.rewards import RewardFunctionFailed

        totals = self.path.sum_over_pool(torch.tensor([*self._reward_counts, len(self._reward_infos)],
                                                      dtype=torch.float64))
        errors, timeouts, samples, info_keys = totals.tolist()
        limit = self.cfg.reward.max_error_frac
        if samples and (errors + timeouts) / samples > limit:
            firsts = [self._reward_first_error]
            group = self.path.group
            if group is not None and dist.get_world_size(group) > 1:
                firsts = [None] * dist.get_world_size(group)
                dist.all_gather_object(firsts, self._reward_first_error, group=group)
            first = " ".join(str(next((f for f in firsts if f), "unknown")).split())
            raise RewardFunctionFailed(
                f"reward function '{self.reward_pool.fn.name}' failed on {errors + timeouts:g} of {samples:g} samples "
                f"of this step ({errors:g} errors, {timeouts:g} timeouts), more than reward.max_error_frac={limit:g}; "
                f"first: {first}; fix the function, or raise reward.timeout_s or reward.max_error_frac")
        return {"reward/errors": errors, "reward/timeouts": timeouts,
                **(self._reward_info_means() if info_keys else {})}

    def _reward_info_means(self) -> dict[str, float]:
        """``reward/<key>`` means of the values the reward function returned beside ``score``, over the pool."""
        from verl_mega.rewards.pool import info_metrics

        everyone, group = [self._reward_infos], self.path.group
        if group is not None and dist.get_world_size(group) > 1:
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, self._reward_infos, group=group)
        return info_metrics(everyone)

    # ------------------------------------------------------------------ stages
    def _rollout(self, ctx) -> dict[str, Any]:
        """Generate; then this rank receives the rows its data-parallel replica trains on (and only those) and
        packs them, padded to the global batch's widest row."""
        limit = self.cfg.rollout.max_response_length
        items, table, local, metrics = self._sample(ctx["prompts"])
        packing_from = self.profiler.now()
        prompt_len = torch.tensor([len(items[p].prompt_ids) for p in table.prompt.tolist()])
        rows, owner = self.path.deliver(local, table, prompt_len,
                                        by_engine=self.scorer is not None and self.stream_roles)
        mine = sorted(rows)
        samples = [rows[row] for row in mine]
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
            packed["rollout_routing"] = _rollout_routing(samples, packed["input_ids"].shape[1], self.path.routing)
        self.batch = Batch(packed, {"row": mine, "group": [s.prompt for s in samples]})
        self.items, self.table, self.rows = items, table, rows
        tokens = table.length
        self.profiler.record("postprocess", packing_from, self.profiler.now(), parent="rollout")
        self.profiler.add_counter("tokens", float(tokens.sum()))  # generated tokens, all ranks
        self.profiler.add_counter("prompt_tokens", float(prompt_len.sum()))
        if self.arch is not None:
            self.profiler.add_counter("flops", self._step_flops(prompt_len, tokens))
        # how many weight versions each sample lags the policy being trained (0 in synchronous training)
        current = getattr(self.rollout, "weight_version", None)
        if current is not None:
            metrics = {**metrics, "rollout/staleness_mean": float((current - table.version).double().mean())}
        return {**metrics, **staleness, "rollout/response_length": float(tokens.sum()) / len(table),
                "rollout/weight_version": float(table.version.max()),
                "rollout/truncated_frac": float((tokens >= limit).float().mean()),
                "rollout/dp_token_imbalance": imbalance(owner, prompt_len + tokens, self.dp)}

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

    def _sample(self, prompt_batch):
        """The step's prompts, its rows' table and this engine's rows: one generation of the prompt batch or, with
        DAPO dynamic sampling, generations of further batches until data.train_batch_size groups have rewards that
        differ (dropped groups fill a batch still short after algorithm.filter_groups.max_num_gen_batches)."""
        fcfg, frac = self.cfg.algorithm.filter_groups, self.cfg.rollout.multi_turn.max_tool_failure_frac
        specs = self._specs(prompt_batch)
        self._prefetch(prompt_batch)
        n = specs[0].n
        items, rounds, batch, counts, candidates = [], 0, prompt_batch, {}, []
        while batch is not None:
            rounds += 1
            generated = self._generate(batch, specs)
            offset = len(items)
            items += batch.items
            gen = generated[0]
            seen: dict[int, int] = {}
            rows_of = []  # row of each local sample: prompt-major, n per prompt
            for s in gen.samples:
                rows_of.append(s.prompt * n + seen.get(s.prompt, 0))
                seen[s.prompt] = seen.get(s.prompt, 0) + 1
            table, c = self.path.table(gen, rows_of, [offset + i // n for i in range(len(batch.items) * n)],
                                       counts=True)
            counts = {k: counts.get(k, 0.0) + v for k, v in c.items()}
            local = {row: s._replace(prompt=s.prompt + offset) for row, s in zip(rows_of, gen.samples)}
            if len(generated) > 1:
                self.baseline_scores = self._engine_scores(generated[1], items, offset, len(batch.items))
            if not fcfg.enable:
                self.prescored = None
                return items, table, local, _episode_metrics(counts, frac)
            scores = self._engine_scores(gen, items, offset, len(table), rows_of=rows_of)
            candidates.append((table, local, scores))
            keep = algos.dynamic_sampling_keep(scores, table.prompt).rows
            if len(set(table.prompt[keep].tolist()) | _kept_groups(candidates[:-1])) >= len(prompt_batch) or \
                    rounds >= fcfg.max_num_gen_batches:
                break
            batch = self.more_prompts() if self.more_prompts is not None else None
        table, local, self.prescored, metrics = _filter_groups(candidates, len(prompt_batch))
        metrics["dapo/gen_batches"] = float(rounds)
        metrics["dapo/kept_group_frac"] = metrics.pop("kept_groups") / max(1, len(items))
        return items, table, local, {**metrics, **_episode_metrics(counts, frac)}

    def _generate(self, batch, specs):
        """The rollout of one prompt batch; with rollout.stream_scoring its samples are scored as they finish."""
        prompts = [p.prompt_ids for p in batch.items]
        if self.scorer is None:
            return self.rollout.generate(prompts, specs)
        n, chunk = specs[0].n, self.scorer.chunk_rows
        self._stream_items, self._stream_out = batch.items, None
        self.scorer.start()

        def finished(samples, running: int) -> None:  # a prompt's samples are rows prompt·n … prompt·n + n − 1
            rows = [s.prompt * n + seen for seen, s in zip(_occurrence(s.prompt for s in samples), samples)]
            # once fewer samples than a micro-batch are still generating, waiting for a full one is waiting for
            # the end: the tail is scored as it finishes
            self.scorer.add(list(zip(rows, samples)), flush=running < chunk, generating=running)

        try:
            return self.rollout.generate(prompts, specs, on_finished=finished)
        finally:
            self.scorer.close()  # what is left is the last micro-batch

    def _streamed(self, key: str, *, by_row: bool = False):
        """A streamed output for the batch's rows, in their order (``by_row``: as scored, {row: value}); None
        when that output is not streamed. The first stage to ask waits for the last micro-batch."""
        if self.scorer is None or (key != "reward" and not self.stream_roles):
            return None
        with self._stream_lock:  # the reward stage asks from a host thread
            if self.scorer.active:
                self._stream_out = self.scorer.results()
        scored = self._stream_out.get(key, {})
        return scored if by_row else gather_rows(scored, self.batch.meta["row"])

    def _specs(self, prompt_batch) -> list[SamplingSpec]:
        specs = [self._sampling(prompt_batch)]
        if self.cfg.algorithm.adv_estimator == "remax":  # ReMax's baseline: one greedy answer per prompt
            specs.append(SamplingSpec(n=1, max_tokens=self.cfg.rollout.max_response_length, temperature=0.0,
                                      stop_token_ids=specs[0].stop_token_ids, logprobs=True))
        return specs

    def _prefetch(self, prompt_batch) -> None:
        """rollout.max_staleness=k on a rollout pool of its own: this step's batch and the next k go to the pool
        now (in order), so it generates them while this step trains."""
        k = self.cfg.rollout.max_staleness
        if not k or self.upcoming is None or not hasattr(self.rollout, "submit"):
            return
        batches = [prompt_batch] + [self.upcoming(i) for i in range(1, k + 1)]
        for batch in filter(None, batches):
            ids, specs = [p.prompt_ids for p in batch.items], self._specs(batch)
            if not self.rollout.submitted(ids, specs):
                self.rollout.submit(ids, specs)

    def _engine_scores(self, gen, items, offset: int, num_rows: int, rows_of=None) -> torch.Tensor:
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
                                          [items[offset + s.prompt].ground_truth for s in samples],
                                          [min(len(s.ids), limit) for s in samples],
                                          [items[offset + s.prompt].extra for s in samples])
        return self.path.sum_over_pool(partial)

    def _scores(self, texts: list[str], truths: list, lengths, extras: list) -> torch.Tensor:
        """Reward-function scores plus, with reward.overlong_buffer, DAPO's overlong penalty. ``extras``: each
        sample's row fields (data_source, extra_info, ...) for the function."""
        result = self.reward_pool.score(texts, truths, extras)
        for key, (total, count) in result.info_sums().items():
            mine = self._reward_infos.get(key, (0.0, 0))
            self._reward_infos[key] = (mine[0] + total, mine[1] + count)
        self._reward_counts = [self._reward_counts[0] + result.num_errors,
                               self._reward_counts[1] + result.num_timeouts, self._reward_counts[2] + len(texts)]
        self._reward_first_error = self._reward_first_error or result.first_error
        scores = torch.tensor(result.scores, dtype=torch.float32)
        ob = self.cfg.reward.overlong_buffer
        if ob.enable:
            limit = self.cfg.rollout.max_response_length
            scores = scores + algos.overlong_buffer_penalty(torch.as_tensor(lengths), limit, ob.len, ob.penalty_factor)
        return scores

    def _text(self, ids: list[int] | torch.Tensor) -> str:
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode([t for t in (ids.tolist() if torch.is_tensor(ids) else ids) if t != eos])

    def _sampling(self, prompt_batch, *, validation: bool = False) -> SamplingSpec:
        """Training samples rollout.n answers per prompt; validation one, at rollout.val_temperature (0: greedy).
        Seeds are explicit and derived from the data position, so a resumed run samples exactly what an
        uninterrupted one would (prompt i of the batch gets the seed + i)."""
        rcfg = self.cfg.rollout
        base = rcfg.seed if rcfg.seed is not None else self.cfg.trainer.seed
        position = prompt_batch.epoch * 1_000_003 + prompt_batch.batch_index
        return SamplingSpec(n=1 if validation else rcfg.n, max_tokens=rcfg.max_response_length,
                            temperature=rcfg.val_temperature if validation else rcfg.temperature,
                            top_p=1.0 if validation else rcfg.top_p, top_k=0 if validation else max(rcfg.top_k, 0),
                            ignore_eos=rcfg.ignore_eos,
                            # fixed-length generation: EOS must not stop it either
                            stop_token_ids=() if rcfg.ignore_eos else (self.tokenizer.eos_token_id,), logprobs=True,
                            seed=(base * 7_919 + position * 65_537) % SEED_MODULUS)

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
        every forward (old/ref log-probs, values, RM) and forward+backward (updates × ppo_epochs) over the batch."""
        from verl_mega.trainer.profiler import transformer_flops_per_token

        a = self.arch
        # a token passes through its k routed experts (and the shared one): the MLP width it is computed at
        ffn = a.moe_topk * a.moe_ffn_hidden_size + a.shared_expert_ffn_hidden_size if a.is_moe else a.ffn_hidden_size

        def per_token(training: bool, context: float) -> float:
            return transformer_flops_per_token(a.num_layers, a.hidden_size, ffn, a.num_heads,
                                               a.num_kv_heads, a.head_dim, a.vocab_size, int(context), training)

        lengths = (prompt_len + response_len).float()
        context = float(lengths.mean())
        fwd, train = per_token(False, context), per_token(True, context)
        passes = fwd + train * self.cfg.actor.ppo_epochs
        passes += fwd * ((self.ref is not None) + (self.reward_model is not None))
        if self.critic is not None:
            passes += fwd + train * self.cfg.critic.ppo_epochs
        gen_context = float((prompt_len + response_len / 2).float().mean())
        return float(lengths.sum()) * passes + float(response_len.sum()) * per_token(False, gen_context)

    def _reward(self, ctx) -> tuple[torch.Tensor, bool]:
        """Rewards of the rows this rank scores (its share of its replica's rows), in a vector over every row of
        the step, and whether that vector is already complete (dynamic sampling scored every row)."""
        if self.prescored is not None:
            return self.prescored, True
        partial = torch.zeros(len(self.table), dtype=torch.float32)
        streamed = self._streamed("reward", by_row=True)
        if streamed is not None:  # scored during generation, each row by one rank of its engine
            for row, score in streamed.items():
                partial[row] = score
            return partial, False
        rows = self.path.replica_share(self.batch.meta["row"])
        if rows:
            samples = [self.rows[row] for row in rows]
            partial[rows] = self._scores([self._text(s.ids) for s in samples],
                                         [self.items[s.prompt].ground_truth for s in samples],
                                         self.table.length[rows].tolist(),
                                         [self.items[s.prompt].extra for s in samples])
        return partial, False

    def _old_logprob(self, ctx) -> torch.Tensor:
        streamed = self._streamed("old_logprobs")
        if streamed is not None:
            out = {"logprobs": streamed, "entropy": self._streamed("entropy")}
        else:
            out = self.actor.compute_logprobs(self.batch, with_entropy=True)
        self.batch["old_logprobs"] = out["logprobs"]
        if "routed_experts" in out:  # actor.routing_replay=r2/r3: the update replays this routing
            self.batch["routed_experts"] = out["routed_experts"]
        self.batch["entropy"] = out["entropy"]
        mask = self.batch["response_mask"]
        diff = (out["logprobs"] - self.batch["rollout_logprobs"]).abs() * mask
        worst = diff.max() if mask.any() else diff.sum()
        self.logprob_gap = {"rollout/logprob_diff_max": self._dp_reduce(worst, "max"),
                            "rollout/logprob_diff_mean": self._dp_reduce(algos.masked_mean(diff, mask), "mean")}
        if "router_agreement" in out:  # R3: Megatron's routers vs vLLM's routing, same weights (pool-wide already)
            self.logprob_gap["rollout/router_agreement"] = float(out["router_agreement"])
        return out["logprobs"]

    def _ref_logprob(self, ctx) -> torch.Tensor:
        streamed = self._streamed("ref_logprobs")
        self.batch["ref_logprobs"] = streamed if streamed is not None else self.ref.compute_logprobs(self.batch)[
            "logprobs"]
        return self.batch["ref_logprobs"]

    def _values(self, ctx) -> torch.Tensor:
        streamed = self._streamed("values")
        self.batch["values"] = streamed if streamed is not None else self.critic.compute_values(self.batch)
        return self.batch["values"]

    def _rm_score(self, ctx) -> torch.Tensor:
        streamed = self._streamed("rm_score")
        return streamed if streamed is not None else self.reward_model.score(self.batch)

    def _advantage(self, ctx) -> dict[str, float]:
        acfg = self.cfg.algorithm
        b = self.batch
        scores, complete = ctx["reward"]
        if not complete:
            scores = self.path.sum_over_pool(scores)
        if "rm_score" in ctx:  # the reward model scored the replica's rows on each of its ranks: count them once
            rm = torch.zeros_like(scores)
            if self.path.replica[0] == dist.get_rank():
                rm[b.meta["row"]] = ctx["rm_score"].float()
            scores = scores + self.path.sum_over_pool(rm)
        mask = b["response_mask"]
        token_rewards = algos.outcome_to_token_rewards(scores[b.meta["row"]], mask)
        metrics = {}
        if acfg.use_kl_in_reward:
            token_rewards, kl_metrics = algos.apply_kl_penalty(token_rewards, b["old_logprobs"], b["ref_logprobs"],
                                                               mask, self.kl_ctrl.value, acfg.kl_penalty)
            current_kl = self._dp_reduce(kl_metrics["kl"], "mean")
            self.kl_ctrl.update(current_kl, len(self.table))
            metrics.update({"kl/reward_kl": current_kl, "kl/coef": float(self.kl_ctrl.value)})
        # groups are whole on each rank (group baselines need no communication); whitening sums over the replicas
        baselines = self.baseline_scores[torch.tensor(b.meta["group"])] if self.baseline_scores is not None else None
        b["advantages"], b["returns"] = algos.compute_advantage(
            acfg.adv_estimator, token_level_rewards=token_rewards, response_mask=mask, values=b.tensors.get("values"),
            group_index=b.meta["group"], reward_baselines=baselines, gamma=acfg.gamma, lam=acfg.lam,
            norm_adv_by_std_in_grpo=acfg.norm_adv_by_std_in_grpo, batch_sum=self._batch_sum)
        if "ref_logprobs" not in b:
            b["ref_logprobs"] = b["old_logprobs"]
        if self.baseline_scores is not None:
            metrics["reward/baseline_mean"] = float(self.baseline_scores[self.table.prompt].mean())
        metrics.update(self.logprob_gap)
        metrics.update({"reward/mean": float(scores.mean()), "reward/max": float(scores.max()),
                        "reward/min": float(scores.min()),
                        "actor/entropy_rollout": self._dp_reduce(algos.masked_mean(b["entropy"], mask), "mean")})
        if "ref_logprobs" in b.tensors and self.ref is not None:
            kl = algos.masked_mean(algos.kl_penalty(b["old_logprobs"], b["ref_logprobs"], "kl"), mask)
            metrics["kl/actor_ref"] = self._dp_reduce(kl, "mean")
        return metrics

    def _critic_update(self, ctx) -> dict[str, float]:
        rows = self._mini_rows(self.cfg.critic.ppo_mini_batch_size)
        return self.critic.update(self.batch, mini_batch_rows=rows)

    def _actor_update(self, ctx) -> dict[str, float]:
        return self.actor.update(self.batch, mini_batch_rows=self._mini_rows(self.cfg.actor.ppo_mini_batch_size))

    def _weight_sync(self, ctx) -> dict[str, float]:
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


def _occurrence(keys):
    """For each key, how many times it came before (0, 1, … per key)."""
    seen: dict = {}
    for key in keys:
        seen[key] = seen.get(key, -1) + 1
        yield seen[key]


def build_stream_scorer(trainer: RLTrainer) -> StreamScorer:
    """The scoring stages of rollout.stream_scoring, over micro-batches of finished samples: the same roles and
    reward function as the synchronous stages, per micro-batch."""
    limit, pad = trainer.cfg.rollout.max_response_length, trainer.tokenizer.pad_token_id or 0

    def pack(pairs) -> Batch:
        samples = [s for _, s in pairs]
        packed = pack_sequences([trainer._stream_items[s.prompt].prompt_ids for s in samples],
                                [s.ids for s in samples], pad_id=pad, max_response_length=limit,
                                multiple_of=trainer.actor.engine.seq_multiple)
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
                                        [trainer._stream_items[b.meta["group"][i]].ground_truth for i in mine],
                                        lengths, [trainer._stream_items[b.meta["group"][i]].extra for i in mine])
        return {"reward": out}

    stages = []
    if trainer.stream_roles:  # rollout.stream_scoring=all: the roles' forward passes too
        stages.append(("old_logprob", old_logprob))
        if trainer.ref is not None:
            stages.append(("ref_logprob", lambda b: {"ref_logprobs": trainer.ref.compute_logprobs(b)["logprobs"]}))
        if trainer.critic is not None:
            stages.append(("values", lambda b: {"values": trainer.critic.compute_values(b)}))
        if trainer.reward_model is not None:
            stages.append(("rm_score", lambda b: {"rm_score": trainer.reward_model.score(b)}))
    stages.append(("reward", reward))
    device = None  # the reward function alone uses no device
    if trainer.stream_roles and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return StreamScorer(stages=stages, pack=pack, chunk_rows=trainer.cfg.rollout.stream_chunk,
                        profiler=trainer.profiler, device=device)


def _rollout_routing(samples, width: int, shape: tuple[int, int]) -> torch.Tensor:
    """The samples' routed experts in the packed layout [rows, width, model layers, k] (int16, -1: unknown)."""
    out = torch.full((len(samples), width, *shape), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        if s.routing is not None:
            m = min(width, s.routing.shape[0])
            out[i, :m] = s.routing[:m]
    return out


def _episode_metrics(counts: dict[str, float], max_failure_frac: float) -> dict[str, float]:
    """Multi-turn rollouts: turns and tool calls per episode, and the share of tool calls that answered an error.
    Past rollout.multi_turn.max_tool_failure_frac failed calls (counted over the pool) the run stops, on every rank."""
    if not counts.get("episodes"):
        return {}
    check_tool_failures(counts["tool_calls"], counts.get("tool_failures", 0.0), max_failure_frac)
    episodes = counts["episodes"]
    return {"rollout/turns": counts["turns"] / episodes, "rollout/tool_calls": counts["tool_calls"] / episodes,
            "rollout/tool_error_frac": counts["tool_errors"] / max(counts["tool_calls"], 1.0)}


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
