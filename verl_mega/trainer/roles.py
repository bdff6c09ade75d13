"""RL roles over the Megatron engine: actor, reference, critic and reward model.

A role knows RL (which quantity it computes, which loss it minimises); the engine knows Megatron. Every tensor a
role hands the engine is in the left-aligned sequence layout of :mod:`verl_mega.trainer.batch`.
"""

from __future__ import annotations

import torch

from verl_mega import algos
from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
from verl_mega.engine.megatron_engine import MegatronEngine
from verl_mega.trainer.batch import Batch
from verl_mega.trainer.micro_batching import MicroBatches, last_token, make_micro_batches, next_tokens, \
    response_frame


def split(engine: MegatronEngine, batch: Batch, keys: tuple[str, ...], *, rows: int, token_budget: int | None,
          packed: bool) -> MicroBatches:
    """The engine's micro-batches of ``batch``: one shape per call with pipeline stages; with a token budget on a
    Mixture-of-Experts model, as many micro-batches on every data-parallel rank (each one's token dispatch is an
    expert-parallel collective)."""
    agree = None
    if token_budget is not None and engine.is_moe and engine.dp_size > 1:
        def agree(n: int) -> int:
            return int(engine.dp_all_reduce(float(n), "max"))
    return make_micro_batches(batch, keys, rows_per_micro_batch=rows, token_budget=token_budget,
                              multiple=engine.seq_multiple, packed=packed,
                              sequence_multiple=2 * engine.cp if engine.cp > 1 else 1,
                              same_shape=engine.groups.size("pp") > 1, agree_count=agree)


class PolicyRole:
    """Log-probs of responses under a (vocab-parallel) LM head: shared by actor and reference."""

    def __init__(self, engine: MegatronEngine, *, vocab_size: int, micro_batch_size: int, temperature: float,
                 max_tokens_per_micro_batch: int | None = None, packed: bool = False,
                 logprob_micro_batch_size: int | None = None) -> None:
        self.engine = engine
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.vocab_size = vocab_size
        self.micro_batch_size = micro_batch_size
        # rows per forward-only pass (no activations kept for a backward: may exceed the update's micro-batch)
        self.logprob_micro_batch_size = logprob_micro_batch_size or micro_batch_size
        self.temperature = temperature
        self.packed = packed

    def _split(self, batch: Batch, keys: tuple[str, ...], rows: int | None = None) -> MicroBatches:
        return split(self.engine, batch, keys, rows=rows or self.micro_batch_size,
                     token_budget=self.max_tokens_per_micro_batch, packed=self.packed)

    def _logprobs(self, output: torch.Tensor, mb: dict[str, torch.Tensor], with_entropy: bool):
        ids, engine = mb["input_ids"], self.engine
        kw = dict(vocab_size=self.vocab_size, tp_group=engine.groups["tp"], temperature=self.temperature,
                  with_entropy=with_entropy)
        if engine.cp == 1:
            lp, ent = vocab_parallel_logprobs_entropy(output, next_tokens(ids), **kw)
        else:  # this rank's chunks predict the tokens after their global positions; then the whole sequence
            nxt = (engine.cp_positions(ids.shape[1], mb).to(ids.device) + 1).clamp(max=ids.shape[1] - 1)
            lp, ent = vocab_parallel_logprobs_entropy(output, ids[:, nxt], **kw)
            lp, ent = (engine.full_sequence(t, mb) if t is not None else None for t in (lp, ent))
        width = mb["response_mask"].shape[1]
        return response_frame(lp, mb, width), (response_frame(ent, mb, width) if ent is not None else None)

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        """Log-probs (and entropy) of the responses. With routing replay the output also has ``routed_experts``
        (this rank's layers), for the update to replay: R2 records this pass's routing; R3 replays the rollout's
        (``rollout_routing``, every model layer) here too, and ``router_agreement`` is the share of its experts
        the routers would have chosen."""
        routing = self.engine.routing
        replay = routing is not None and "rollout_routing" in batch  # R3
        keys = ("input_ids", "prompt_len", "response_mask") + (("rollout_routing", "response_len") if replay else ())
        mbs = self._split(batch, keys, rows=self.logprob_micro_batch_size)
        if replay:
            for mb in mbs:
                mb["routed_experts"] = routing.local_layers(mb.pop("rollout_routing"))
                _routing_valid(mb)

        def post(output, mb):
            lp, ent = self._logprobs(output, mb, with_entropy)
            return {"logprobs": lp} | ({"entropy": ent} if ent is not None else {})

        record = routing is not None and not replay  # R2: the update replays this pass's expert routing
        res = self.engine.forward(mbs.batches, post, record_routing=record)
        out = {k: mbs.restore([r[k] for r in res]) for k in res[0]}
        if record:  # micro-batches may be cut to different widths: pad to the batch's
            width = batch["input_ids"].shape[1]
            out["routed_experts"] = torch.nn.functional.pad(out["routed_experts"], (
                0, 0, 0, 0, 0, width - out["routed_experts"].shape[1]))
        if replay:
            out["routed_experts"] = routing.local_layers(batch["rollout_routing"])
            out["router_agreement"] = torch.tensor(self.engine.last_router_agreement, dtype=torch.float64)
        return out


class ReferencePolicy(PolicyRole):
    """The reference policy of a LoRA actor: the actor's engine with its adapters off, i.e. the frozen base model.
    No second copy of the weights exists. Its routers route on their own, as a reference engine of its own would:
    the actor's routing replay (R2, R3) is the policy's, not the reference's."""

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch, *, with_entropy: bool = False) -> dict[str, torch.Tensor]:
        from verl_mega.models.lora import adapters_off

        routing, self.engine.routing = self.engine.routing, None
        try:
            with adapters_off(self.engine.modules):
                return super().compute_logprobs(batch, with_entropy=with_entropy)
        finally:
            self.engine.routing = routing


def _routing_valid(mb: dict[str, torch.Tensor]) -> None:
    """The tokens the router-agreement metric counts: real tokens of real rows (not the copies of row 0 that pad
    the last micro-batch)."""
    s = mb["input_ids"].shape[1]
    length = mb["prompt_len"] + mb.pop("response_len")
    real_row = mb["response_mask"].any(1)
    mb["routing_valid"] = (torch.arange(s) < length[:, None]) & real_row[:, None]


def _policy_loss_options(cfg) -> dict[str, object]:
    """The actor keys the selected policy loss reads, beside the inputs every loss shares."""
    if cfg.policy_loss == "gspo":
        return {"clip_ratio_low": cfg.gspo_clip_ratio_low, "clip_ratio_high": cfg.gspo_clip_ratio_high}
    if cfg.policy_loss == "kl_cov":
        return {"kl_cov_ratio": cfg.kl_cov_ratio, "ppo_kl_coef": cfg.ppo_kl_coef}
    options = {"clip_ratio_low": cfg.clip_ratio_low, "clip_ratio_high": cfg.clip_ratio_high}
    if cfg.policy_loss == "vanilla":
        options["clip_ratio_c"] = cfg.clip_ratio_c
    elif cfg.policy_loss == "decoupled_ppo":
        options.update(clip_ratio_c=cfg.clip_ratio_c, behaviour_weight_cap=cfg.behaviour_weight_cap)
    elif cfg.policy_loss == "clip_cov":
        options.update(clip_cov_ratio=cfg.clip_cov_ratio, clip_cov_lb=cfg.clip_cov_lb, clip_cov_ub=cfg.clip_cov_ub)
    return options


class Actor(PolicyRole):
    def __init__(self, engine: MegatronEngine, cfg, *, vocab_size: int, temperature: float,
                 packed: bool = False) -> None:
        super().__init__(engine, vocab_size=vocab_size, micro_batch_size=cfg.micro_batch_size_per_gpu,
                         temperature=temperature, packed=packed,
                         max_tokens_per_micro_batch=cfg.max_tokens_per_gpu if cfg.use_dynamic_bsz else None,
                         logprob_micro_batch_size=cfg.log_prob_micro_batch_size_per_gpu)
        self.cfg = cfg

    def update(self, batch: Batch, *, mini_batch_rows: int, old_from_update: bool = False) -> dict[str, float]:
        """PPO epochs × mini-batches over this rank's samples; one optimizer step per mini-batch. Metrics are means
        over the mini-batches, except ``actor/ppo_kl``: the first mini-batch's, taken before its update.

        ``old_from_update`` (:func:`old_logprobs_from_update` decides it): one epoch over one mini-batch, whose
        forward pass runs on the weights the old log-probs are defined by; it supplies them (and the entropy), and
        they are written into ``batch`` after the step, in its row order."""
        cfg = self.cfg
        old_key = () if old_from_update else ("old_logprobs",)
        keys = ("input_ids", "prompt_len", "response_mask", *old_key, "advantages")
        keys += ("ref_logprobs",) if "ref_logprobs" in batch or not old_from_update else ()
        if cfg.rollout_is is not None:
            keys += ("rollout_is_weights",)
        if cfg.policy_loss == "decoupled_ppo":
            keys += ("rollout_logprobs",)
        if "routed_experts" in batch:  # R2: the old-log-prob pass's routing; R3: the rollout's
            keys += ("routed_experts", "response_len")
        batch, off_policy = (batch, {}) if old_from_update else self._off_policy(batch)
        history: list[dict[str, float]] = []
        for _ in range(cfg.ppo_epochs):
            for mini, order in _mini_batches(batch, len(batch) if old_from_update else mini_batch_rows,
                                             shuffle=cfg.shuffle):
                split = self._split(mini, keys)
                mbs = split.batches
                for mb in mbs:
                    if "routed_experts" in mb:  # the router-agreement metric counts real tokens only
                        _routing_valid(mb)
                normalizer = self.engine.dp_all_reduce(
                    sum(algos.agg_loss_normalizer(mb["response_mask"], cfg.loss_agg_mode) for mb in mbs))
                scale = self.engine.dp_size * len(mbs)
                own: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if old_from_update else None
                history.append(self.engine.train_step(mbs, self._loss_fn(normalizer, scale, own)))
                if own is not None:  # micro-batch order → the mini-batch's rows → the batch's
                    for key, got in (("old_logprobs", [lp.cpu() for lp, _ in own]),
                                     ("entropy", [e.cpu() for _, e in own])):
                        rows = split.restore(got)  # on the host, as the engine's forward hands them
                        batch[key] = rows.new_empty(rows.shape).index_copy_(0, order, rows)
        if old_from_update:
            off_policy = self._off_policy(batch)[1]  # uncorrected (old_logprobs_from_update): its metrics alone
        metrics = {f"actor/{k}": sum(h[k] for h in history) / len(history) for k in history[0]} | off_policy
        if "approx_kl" in history[0]:
            # the KL between the old log-probs and the policy at the first mini-batch, before any update of this step:
            # 0 up to rounding on policy (the same weights as the old log-prob pass), a consistency gate
            metrics["actor/ppo_kl"] = history[0]["approx_kl"]
        return metrics

    def _off_policy(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """The behaviour (rollout) vs proximal (old) policy correction of the whole local batch, once per update (the
        old log-probs do not change over epochs), and the step's ``rollout/*`` metrics, summed over data-parallel
        ranks. With actor.rollout_is the batch returned carries the weights and, in mask mode, the response mask
        without the rejected tokens: they leave every loss term and the normaliser. Decoupled PPO computes the same
        token weights inside its loss; here only their metrics."""
        cfg = self.cfg
        corrected = cfg.rollout_is is not None or cfg.policy_loss == "decoupled_ppo"
        if "rollout_logprobs" not in batch:
            if corrected:
                key, off = (("actor.rollout_is", "actor.rollout_is=null") if cfg.rollout_is is not None else
                            ("actor.policy_loss=decoupled_ppo", "actor.policy_loss=vanilla"))
                raise ValueError(f"{key} needs the rollout engine's log-probs of the sampled tokens (batch key "
                                 f"rollout_logprobs); set {off}")
            return batch, {}
        old, rollout, mask = batch["old_logprobs"], batch["rollout_logprobs"], batch["response_mask"]
        correction = None
        if cfg.rollout_is is not None:
            correction = algos.rollout_is_weights(old, rollout, mask, level=cfg.rollout_is, mode=cfg.rollout_is_mode,
                                                  upper=cfg.rollout_is_threshold,
                                                  lower=cfg.rollout_is_threshold_lower)
            batch = Batch({**batch.tensors, "response_mask": correction.mask,
                           "rollout_is_weights": correction.weights}, batch.meta)
        elif cfg.policy_loss == "decoupled_ppo":
            correction = algos.rollout_is_weights(old, rollout, mask, level="token", mode="tis",
                                                  upper=cfg.behaviour_weight_cap)
        sums = self.engine.dp_all_reduce(algos.off_policy_sums(old, rollout, mask, correction))
        return batch, algos.off_policy_metrics(sums, corrected=corrected)

    def _loss_fn(self, normalizer: torch.Tensor, scale: int, own: list | None = None):
        """The PPO loss of a micro-batch. With ``own`` (a list) the old log-probs are this forward pass's own,
        detached (the ratio is exactly 1; the gradient that of the policy's log-probs), and each micro-batch's
        log-probs and entropy are appended to it."""
        cfg = self.cfg
        policy_loss = algos.get_policy_loss_fn(cfg.policy_loss)
        options = _policy_loss_options(cfg)
        if cfg.policy_loss == "clip_cov":
            # Seeded by the optimizer step, the same on every rank: tensor-parallel ranks drop the same tokens.
            options["generator"] = torch.Generator().manual_seed(self.engine.version)

        def loss_fn(output, mb):
            behaviour = {"rollout_log_prob": mb["rollout_logprobs"]} if cfg.policy_loss == "decoupled_ppo" else {}
            need_entropy = True
            lp, ent = self._logprobs(output, mb, need_entropy)
            mask = mb["response_mask"]
            norm = normalizer.to(device=lp.device, dtype=lp.dtype)
            old = mb["old_logprobs"] if own is None else lp.detach()
            if own is not None:
                own.append((old, ent.detach()))
            pg_loss, metrics = policy_loss(
                log_prob=lp, old_log_prob=old, advantages=mb["advantages"], response_mask=mask,
                loss_agg_mode=cfg.loss_agg_mode, normalizer=norm, rollout_is_weights=mb.get("rollout_is_weights"),
                **options, **behaviour)
            # without an entropy bonus the entropy is a metric only: no gradient work for it
            entropy = algos.agg_loss(ent if cfg.entropy_coeff else ent.detach(), mask, cfg.loss_agg_mode,
                                     normalizer=norm)
            loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff else pg_loss
            if cfg.use_kl_loss:
                kl = algos.compute_kl_loss(lp, mb.get("ref_logprobs", old), mask, kind=cfg.kl_loss_type,
                                           loss_agg_mode=cfg.loss_agg_mode, normalizer=norm)
                loss = loss + cfg.kl_loss_coef * kl
                metrics["kl_loss"] = kl.detach() * scale
            # Per-micro-batch values are partial sums over the global normaliser: × scale gives the mini-batch
            # value after the schedule's 1/num_microbatches and DP averaging.
            metrics.update(pg_loss=pg_loss.detach() * scale, entropy=entropy.detach() * scale)
            return loss * scale, metrics

        return loss_fn


def mini_batches(batch: Batch, rows: int, *, shuffle: bool) -> list[Batch]:
    """One epoch's mini-batches of ``rows`` rows: in row order, or in a fresh random order (``shuffle``, drawn from
    torch's generator, which checkpoints save)."""
    return [mini for mini, _ in _mini_batches(batch, rows, shuffle=shuffle)]


def _mini_batches(batch: Batch, rows: int, *, shuffle: bool) -> list[tuple[Batch, torch.Tensor]]:
    """:func:`mini_batches`, each with the batch rows it holds."""
    order = torch.randperm(len(batch)) if shuffle else torch.arange(len(batch))
    return [(batch.select(part), part) for part in (order[start:start + rows] for start in range(0, len(batch), rows))]


def old_logprobs_from_update(cfg) -> bool:
    """Whether the actor's update computes the old log-probs itself (``Actor.update(old_from_update=True)``), so
    that the step skips their separate forward pass. Exact where nothing reads them before the update, and the
    update's first forward pass runs on the weights they are defined by: one PPO epoch over one mini-batch of the
    whole batch, on one pipeline stage (its last stage alone computes log-probs). Not where the reward's KL penalty,
    the rollout correction (actor.rollout_is, decoupled PPO) or routing replay use them first, nor where
    rollout.stream_scoring=all computes them during generation."""
    actor = cfg.actor
    return (actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= cfg.data.train_batch_size
            and cfg.parallel.pp == 1 and not cfg.algorithm.use_kl_in_reward and actor.rollout_is is None
            and actor.policy_loss != "decoupled_ppo" and actor.routing_replay == "none"
            and cfg.rollout.stream_scoring != "all")


class Critic:
    def __init__(self, engine: MegatronEngine, cfg, *, packed: bool = False) -> None:
        self.engine = engine
        self.cfg = cfg
        self.packed = packed

    def _split(self, batch: Batch, keys: tuple[str, ...]) -> MicroBatches:
        cfg = self.cfg
        return split(self.engine, batch, keys, rows=cfg.micro_batch_size_per_gpu,
                     token_budget=cfg.max_tokens_per_gpu if cfg.use_dynamic_bsz else None, packed=self.packed)

    def _values(self, output: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        full = self.engine.full_sequence(output[..., 0].float(), mb)
        return response_frame(full, mb, mb["response_mask"].shape[1])

    @torch.no_grad()
    def compute_values(self, batch: Batch) -> torch.Tensor:
        mbs = self._split(batch, ("input_ids", "prompt_len", "response_mask"))
        res = self.engine.forward(mbs.batches, lambda out, mb: {"values": self._values(out, mb) * mb["response_mask"]})
        return mbs.restore([r["values"] for r in res])

    def update(self, batch: Batch, *, mini_batch_rows: int) -> dict[str, float]:
        cfg = self.cfg
        keys = ("input_ids", "prompt_len", "response_mask", "values", "returns")
        history = []
        for _ in range(cfg.ppo_epochs):
            for mini in mini_batches(batch, mini_batch_rows, shuffle=cfg.shuffle):
                mbs = self._split(mini, keys).batches
                normalizer = self.engine.dp_all_reduce(sum(algos.agg_loss_normalizer(mb["response_mask"])
                                                           for mb in mbs))
                scale = self.engine.dp_size * len(mbs)

                def loss_fn(output, mb, normalizer=normalizer, scale=scale):
                    values = self._values(output, mb)
                    loss, metrics = algos.compute_value_loss(
                        values=values, old_values=mb["values"], returns=mb["returns"],
                        response_mask=mb["response_mask"], cliprange_value=cfg.cliprange_value,
                        normalizer=normalizer.to(device=values.device, dtype=values.dtype))
                    metrics["vf_loss"] = loss.detach() * scale
                    return loss * scale, metrics

                history.append(self.engine.train_step(mbs, loss_fn))
        return {f"critic/{k}": sum(h[k] for h in history) / len(history) for k in history[0]}


class RewardModel:
    """A one-label sequence classifier (its score head as a value head) whose output at the last response token is
    the sequence reward."""

    def __init__(self, engine: MegatronEngine, *, micro_batch_size: int, packed: bool = False) -> None:
        self.engine = engine
        self.micro_batch_size = micro_batch_size
        self.packed = packed

    @torch.no_grad()
    def score(self, batch: Batch) -> torch.Tensor:
        mbs = split(self.engine, batch, ("input_ids", "prompt_len", "response_len", "response_mask"),
                    rows=self.micro_batch_size, token_budget=None, packed=self.packed)

        def post(output, mb):
            return {"score": last_token(self.engine.full_sequence(output[..., 0].float(), mb), mb)}

        res = self.engine.forward(mbs.batches, post)
        return mbs.restore([r["score"] for r in res])

