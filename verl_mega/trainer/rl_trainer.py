"""One RL step (rollout → score → advantage → critic update → actor update → weight sync) as a dataflow.

This is the control flow a researcher edits: the algorithm is plain Python over batches and the pure functions of
:mod:`verl_mega.algos`; communication and memory live in the engine, the rollout and the hybrid engine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from verl_mega import algos
from verl_mega.config import TrainConfig
from verl_mega.parallel.cpu_mode import comm_device
from verl_mega.rollout.colocated import SEED_MODULUS
from verl_mega.rollout.vllm_rollout import SamplingSpec
from verl_mega.trainer.batch import Batch, pack_sequences
from verl_mega.trainer.dataflow import DataflowBuilder


class RLTrainer:
    #: run host-only stages (rule-based reward scoring) in threads, overlapped with device stages
    overlap_host_stages = True

    def __init__(self, cfg: TrainConfig, *, actor, ref, critic, reward_model, rollout, reward_pool, tokenizer,
                 profiler, kl_ctrl, arch=None, val_prompts=None, more_prompts=None) -> None:
        self.cfg = cfg
        self.actor, self.ref, self.critic, self.reward_model = actor, ref, critic, reward_model
        self.rollout, self.reward_pool = rollout, reward_pool
        self.tokenizer, self.profiler, self.kl_ctrl = tokenizer, profiler, kl_ctrl
        self.arch = arch  # the model's architecture: with it the step counts its model FLOPs (perf/* metrics)
        self.val_prompts = val_prompts  # a PromptBatch of data.val_files, for validate()
        self.more_prompts = more_prompts  # the next prompt batch (dynamic sampling generates from several per step)
        self.prescored = None
        engine = actor.engine  # samples are split over the actor's data-parallel group
        self.dp, self.dp_rank, self.dp_group = engine.dp_size, engine.dp_rank, engine.groups["dp"]
        self.flow = self._build_flow()

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
        out = self.flow.run({"prompts": prompt_batch})
        if getattr(self, "print_each_step", False) and dist.get_rank() == 0:
            self.print_profiling_summary()
        metrics: dict[str, float] = {}
        for name in ("rollout", "reward", "advantage", "critic_update", "actor_update", "weight_sync"):
            if isinstance(out.get(name), dict):
                metrics.update({k: v for k, v in out[name].items() if isinstance(v, float)})
        metrics.update(self.profiler.step_summary())  # stage times, overlap, tokens/s, TFLOP/s, MFU
        return metrics

    # ------------------------------------------------------------------ stages
    def _rollout(self, ctx) -> dict[str, Any]:
        """Generate, then pack the global batch of samples and keep this data-parallel rank's rows."""
        rcfg = self.cfg.rollout
        prompts, samples, baselines, versions, scores, metrics = self._sample(ctx["prompts"])
        packing_from = self.profiler.now()
        prompt_ids = [prompts[s.prompt].prompt_ids for s in samples]
        # the EOS token is kept in the response: the policy must learn to stop
        limit = rcfg.max_response_length
        packed = pack_sequences(prompt_ids, [s.ids[:limit] for s in samples], pad_id=self.tokenizer.pad_token_id or 0,
                                max_response_length=limit, multiple_of=self.actor.engine.seq_multiple)
        # vLLM's own log-probs of the sampled tokens: a live check that rollout and training agree
        packed["rollout_logprobs"] = torch.zeros_like(packed["response_mask"])
        for i, s in enumerate(samples):
            packed["rollout_logprobs"][i, : len(s.logprobs[:limit])] = torch.tensor(s.logprobs[:limit])
            if s.mask is not None:  # a multi-turn episode: tools' answers are context, not actions
                packed["response_mask"][i, : len(s.mask[:limit])] *= torch.tensor(s.mask[:limit])
        meta = {"group": [s.prompt for s in samples], "ground_truth": [prompts[s.prompt].ground_truth for s in samples],
                "response_text": [self._text(s.ids) for s in samples]}
        if baselines:
            meta["baseline_text"] = [self._text(baselines[s.prompt]) for s in samples]
            meta["baseline_len"] = [len(baselines[s.prompt]) for s in samples]
        full = Batch(packed, meta)
        rows = len(full) // self.dp
        mine = range(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        self.batch = full.select(mine)
        self.prescored = scores[mine.start:mine.stop] if scores is not None else None
        self.global_rows = len(full)
        n_tokens = float(packed["response_len"].sum())
        self.profiler.record("postprocess", packing_from, self.profiler.now(), parent="rollout")
        self.profiler.add_counter("tokens", n_tokens)  # generated tokens, all ranks
        self.profiler.add_counter("prompt_tokens", float(packed["prompt_len"].sum()))
        if self.arch is not None:
            self.profiler.add_counter("flops", self._step_flops(packed["prompt_len"], packed["response_len"]))
        return {**metrics, "rollout/response_length": n_tokens / len(full),
                "rollout/weight_version": float(max(versions)),
                "rollout/truncated_frac": float((packed["response_len"] >= rcfg.max_response_length).float().mean())}

    def _sample(self, prompt_batch):
        """The step's samples: one generation of the prompt batch or, with DAPO dynamic sampling, generations of
        further batches until data.train_batch_size groups have rewards that differ (dropped groups fill a batch
        that is still short after algorithm.filter_groups.max_num_gen_batches). Returns the prompts, prompt-major
        samples indexing them, ReMax's greedy answers, weight versions, the filter's rewards and metrics."""
        fcfg, rcfg = self.cfg.algorithm.filter_groups, self.cfg.rollout
        specs = [self._sampling(prompt_batch)]
        if self.cfg.algorithm.adv_estimator == "remax":  # ReMax's baseline: one greedy answer per prompt
            specs.append(SamplingSpec(n=1, max_tokens=rcfg.max_response_length, temperature=0.0,
                                      stop_token_ids=specs[0].stop_token_ids, logprobs=True))
        items, kept, dropped, versions, rounds, batch, counts = [], [], [], set(), 0, prompt_batch, {}
        while batch is not None:
            rounds += 1
            generated = self.rollout.generate([p.prompt_ids for p in batch.items], specs)
            offset, versions = len(items), versions | generated[0].versions
            items += batch.items
            samples = [s._replace(prompt=s.prompt + offset) for s in generated[0].samples]
            counts = {k: counts.get(k, 0.0) + v for k, v in generated[0].counts.items()}
            if not fcfg.enable:
                baselines = {s.prompt: s.ids[:rcfg.max_response_length] for s in generated[1].samples} \
                    if len(generated) > 1 else {}
                return items, samples, baselines, versions, None, _episode_metrics(counts)
            scores = self._score_all(samples, items)
            keep = algos.dynamic_sampling_keep(scores, [s.prompt for s in samples]).rows.tolist()
            for sample, score, k in zip(samples, scores.tolist(), keep):
                (kept if k else dropped).append((sample, score))
            if len({s.prompt for s, _ in kept}) >= len(prompt_batch) or rounds >= fcfg.max_num_gen_batches:
                break
            batch = self.more_prompts() if self.more_prompts is not None else None
        groups: dict[int, list] = {}
        for sample, score in kept + dropped:  # whole groups, the kept ones first
            if sample.prompt in groups or len(groups) < len(prompt_batch):
                groups.setdefault(sample.prompt, []).append((sample, score))
        chosen = [x for g in groups.values() for x in g]
        kept_groups = {s.prompt for s, _ in kept}
        metrics = {"dapo/gen_batches": float(rounds), "dapo/kept_group_frac": len(kept_groups) / max(1, len(items)),
                   # the policy's reward before filtering (reward/mean is the filtered batch's)
                   "dapo/generated_reward_mean": sum(c for _, c in kept + dropped) / max(1, len(kept + dropped)),
                   "dapo/filled_groups": float(len(prompt_batch) - len(kept_groups & set(groups))),
                   **_episode_metrics(counts)}
        return items, [s for s, _ in chosen], {}, versions, torch.tensor([c for _, c in chosen]), metrics

    def _score_all(self, samples, items) -> torch.Tensor:
        """Rewards of every sample on every rank: each data-parallel rank scores its share, one gather."""
        share = [s for i, s in enumerate(samples) if i % self.dp == self.dp_rank]
        mine = self._scores([self._text(s.ids) for s in share], [items[s.prompt].ground_truth for s in share],
                            [len(s.ids[:self.cfg.rollout.max_response_length]) for s in share]).tolist()
        parts = self._dp_all_gather_list([mine]) if self.dp > 1 else [mine]
        return torch.tensor([parts[i % self.dp][i // self.dp] for i in range(len(samples))], dtype=torch.float32)

    def _scores(self, texts: list[str], truths: list, lengths) -> torch.Tensor:
        """Reward-function scores plus, with reward.overlong_buffer, DAPO's overlong penalty."""
        scores = torch.tensor(self.reward_pool.score(texts, truths).scores, dtype=torch.float32)
        ob = self.cfg.reward.overlong_buffer
        if ob.enable:
            limit = self.cfg.rollout.max_response_length
            scores = scores + algos.overlong_buffer_penalty(torch.as_tensor(lengths), limit, ob.len, ob.penalty_factor)
        return scores

    def _text(self, ids: list[int]) -> str:
        eos = self.tokenizer.eos_token_id
        return self.tokenizer.decode([t for t in ids if t != eos])

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
        Every rank scores its share of the answers; one all-reduce sums them."""
        if self.val_prompts is None:
            raise ValueError("RLTrainer.validate() needs data.val_files; set data.val_files=[...]")
        items = self.val_prompts.items
        samples = self.rollout.generate([p.prompt_ids for p in items],
                                        [self._sampling(self.val_prompts, validation=True)])[0].samples
        mine = samples[self.dp_rank::self.dp]
        scores = self.reward_pool.score([self._text(s.ids) for s in mine],
                                        [items[s.prompt].ground_truth for s in mine]).scores
        totals = [float(sum(scores)), float(sum(len(s.ids) for s in mine)), float(len(mine))]
        total, tokens, count = self.actor.engine.dp_all_reduce(totals).tolist()
        return {"val/reward/mean": total / count, "val/response_length": tokens / count, "val/num_samples": count}

    def _step_flops(self, prompt_len: torch.Tensor, response_len: torch.Tensor) -> float:
        """Model FLOPs of this step, all ranks: generation (forward per generated token at its mean context) plus
        every forward (old/ref log-probs, values, RM) and forward+backward (updates × ppo_epochs) over the batch."""
        from verl_mega.trainer.profiler import transformer_flops_per_token

        a = self.arch

        def per_token(training: bool, context: float) -> float:
            return transformer_flops_per_token(a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_heads,
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

    def _reward(self, ctx) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores of this rank's samples and, for ReMax, of their prompts' greedy answers (scored in the same call);
        dynamic sampling scored them already."""
        if self.prescored is not None:
            return self.prescored, None
        texts, truths = self.batch.meta["response_text"], self.batch.meta["ground_truth"]
        baselines = self.batch.meta.get("baseline_text", [])
        lengths = self.batch["response_len"].tolist() + self.batch.meta.get("baseline_len", [])
        scores = self._scores(texts + baselines, truths + truths[:len(baselines)], lengths)
        return scores[:len(texts)], (scores[len(texts):] if baselines else None)

    def _old_logprob(self, ctx) -> torch.Tensor:
        out = self.actor.compute_logprobs(self.batch, with_entropy=True)
        self.batch["old_logprobs"] = out["logprobs"]
        if "routed_experts" in out:  # actor.routing_replay=r2: the update replays this routing
            self.batch["routed_experts"] = out["routed_experts"]
        self.batch["entropy"] = out["entropy"]
        mask = self.batch["response_mask"]
        diff = (out["logprobs"] - self.batch["rollout_logprobs"]).abs() * mask
        worst = diff.max() if mask.any() else diff.sum()
        self.logprob_gap = {"rollout/logprob_diff_max": self._dp_reduce(worst, "max"),
                            "rollout/logprob_diff_mean": self._dp_reduce(algos.masked_mean(diff, mask), "mean")}
        return out["logprobs"]

    def _ref_logprob(self, ctx) -> torch.Tensor:
        self.batch["ref_logprobs"] = self.ref.compute_logprobs(self.batch)["logprobs"]
        return self.batch["ref_logprobs"]

    def _values(self, ctx) -> torch.Tensor:
        self.batch["values"] = self.critic.compute_values(self.batch)
        return self.batch["values"]

    def _rm_score(self, ctx) -> torch.Tensor:
        return self.reward_model.score(self.batch)

    def _advantage(self, ctx) -> dict[str, float]:
        acfg = self.cfg.algorithm
        b = self.batch
        scores, baselines = ctx["reward"]
        scores = scores + (ctx["rm_score"] if "rm_score" in ctx else 0.0)
        mask = b["response_mask"]
        token_rewards = algos.outcome_to_token_rewards(scores, mask)
        metrics = {}
        if acfg.use_kl_in_reward:
            token_rewards, kl_metrics = algos.apply_kl_penalty(token_rewards, b["old_logprobs"], b["ref_logprobs"],
                                                               mask, self.kl_ctrl.value, acfg.kl_penalty)
            current_kl = self._dp_reduce(kl_metrics["kl"], "mean")
            self.kl_ctrl.update(current_kl, self.global_rows)
            metrics.update({"kl/reward_kl": current_kl, "kl/coef": float(self.kl_ctrl.value)})
        # advantages see the whole global batch (group baselines, global whitening), then each rank keeps its rows
        fields = {"token_rewards": token_rewards, "mask": mask}
        if self.critic is not None:
            fields["values"] = b["values"]
        if baselines is not None:
            fields["reward_baselines"] = baselines
        full = self._dp_all_gather(fields)
        group = torch.tensor(self._dp_all_gather_list(b.meta["group"]))
        adv, ret = algos.compute_advantage(
            acfg.adv_estimator, token_level_rewards=full["token_rewards"], response_mask=full["mask"],
            values=full.get("values"), group_index=group, reward_baselines=full.get("reward_baselines"),
            gamma=acfg.gamma, lam=acfg.lam, norm_adv_by_std_in_grpo=acfg.norm_adv_by_std_in_grpo)
        rows = len(b)
        own = slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        b["advantages"], b["returns"] = adv[own], ret[own]
        if "ref_logprobs" not in b:
            b["ref_logprobs"] = b["old_logprobs"]
        all_scores = torch.cat(self._dp_all_gather({"s": scores[:, None]})["s"].unbind(0))
        if "reward_baselines" in full:
            metrics["reward/baseline_mean"] = float(full["reward_baselines"].mean())
        metrics.update(self.logprob_gap)
        metrics.update({"reward/mean": float(all_scores.mean()), "reward/max": float(all_scores.max()),
                        "reward/min": float(all_scores.min()),
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

    def _dp_all_gather(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every data-parallel rank's rows, concatenated in rank order (advantages see the global batch)."""
        if self.dp == 1:
            return tensors
        out = {}
        for k, t in tensors.items():
            t = t.to(comm_device()).contiguous()
            parts = [torch.empty_like(t) for _ in range(self.dp)]
            dist.all_gather(parts, t, group=self.dp_group)
            out[k] = torch.cat(parts).cpu()
        return out

    def _dp_all_gather_list(self, values: list) -> list:
        if self.dp == 1:
            return list(values)
        parts: list = [None] * self.dp
        dist.all_gather_object(parts, list(values), group=self.dp_group)
        return [v for p in parts for v in p]


def _episode_metrics(counts: dict[str, float]) -> dict[str, float]:
    """Multi-turn rollouts: turns and tool calls per episode, and the share of tool calls that failed."""
    if not counts.get("episodes"):
        return {}
    episodes = counts["episodes"]
    return {"rollout/turns": counts["turns"] / episodes, "rollout/tool_calls": counts["tool_calls"] / episodes,
            "rollout/tool_error_frac": counts["tool_errors"] / max(counts["tool_calls"], 1.0)}
