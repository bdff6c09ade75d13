"""3D-HybridEngine layout planner (HybridFlow §5): training layout (p, t, d) → generation layout (pg=1, tg, dg, d).

Pure functions over integers; nothing here touches torch.distributed, so layouts of thousands of ranks are planned
and checked in one process.

Training ranks follow Megatron-Core's default order ``tp-cp-ep-dp-pp`` (cp = ep = 1): global rank
``g = tp_rank + t·(dp_rank + d·pp_rank)``; ``order="tp-pp-dp"`` selects Megatron's alternative mapping.

Inside one training data-parallel replica (p·t ranks; PP stage s, TP rank r), with micro-DP size m = t/tg:

* generation TP rank ``j = r // m``: the rank serves rows/columns block j of tg of every tensor. That block is the
  concatenation of the training TP shards ``j·m … j·m+m-1``, so the rank's own shard is part of it;
* **micro-DP group** = the m consecutive TP ranks ``j·m … j·m+m-1`` of one stage: an all-gather inside it turns
  each rank's 1/t shard of the stage's layers into block j (received: (m-1)/t of the stage's layers);
* **PP exchange** = Megatron's own pipeline group (same r, every stage): an all-gather of block j of each stage's
  layers gives every rank block j of *all* layers (received: (p-1)·m/t of one stage's layers).
  The union of micro-DP group × pipeline group (m·p ranks) is the **gather group**: its ranks end with the
  identical block j and no other rank needs that block, so nothing is sent twice (redundancy 0);
* **generation TP group** = one rank per block j with the same position (s, r mod m): ranks ``r mod m + k·m``
  (k = 0…tg-1) of one stage's TP group — strided by m, as in the paper; dg = p·t/tg of them per replica.

Per rank this receives (t·p − tg)/(tg·t·p)·M bytes of an M-byte model (HybridFlow Table 2 with pg = 1), and
the generation weights take M/tg. Folding PP into generation DP (pg = 1) is what vLLM's in-process
``external_launcher`` mode supports and keeps decode free of pipeline bubbles.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

_ORDERS = ("tp-dp-pp", "tp-pp-dp")


class LayoutError(ValueError):
    """A training/generation layout the 3D-HybridEngine cannot build; the message names the fix."""


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """The model sizes that constrain tensor parallelism (heads and KV heads split by tg, FFN and vocab too)."""

    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    num_layers: int

    def __post_init__(self) -> None:
        for key in ("num_heads", "num_kv_heads", "ffn_hidden_size", "num_layers"):
            if getattr(self, key) <= 0:
                raise LayoutError(f"model dims: {key}={getattr(self, key)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise LayoutError(
                f"model dims: num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )


@dataclass(frozen=True)
class RankPlan:
    """Everything one rank needs to know about its place in both layouts."""

    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    gen_tp_rank: int  # block j of tg this rank serves in generation
    gen_engine: int  # index of this rank's generation TP group (vLLM engine), 0 … world/tg - 1
    gen_tp_group: tuple[int, ...]  # ordered by generation TP rank
    micro_dp_group: tuple[int, ...]  # ordered by training TP rank (= concatenation order of shards)
    pp_group: tuple[int, ...]  # ordered by pipeline stage
    train_tp_group: tuple[int, ...]  # ordered by training TP rank
    gather_group: tuple[int, ...]  # micro_dp × pp: every rank that ends with the same block


@dataclass(frozen=True, kw_only=True)
class HybridLayout:
    """Training layout (p, t, d) and generation TP size tg (pg = 1). Build with :func:`plan_layout`."""

    p: int
    t: int
    d: int
    tg: int
    order: str = "tp-dp-pp"
    dims: ModelDims | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for key in ("p", "t", "d", "tg"):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise LayoutError(f"layout: {key}={value!r} must be a positive int")
        if self.order not in _ORDERS:
            raise LayoutError(f"layout: order={self.order!r} is not one of {_ORDERS}")
        if self.t % self.tg:
            raise LayoutError(
                f"layout: generation tp={self.tg} must divide training tp={self.t} so each rank reuses its own "
                f"shard; pick tg among {[k for k in range(1, self.t + 1) if self.t % k == 0]}"
            )
        if self.dims is not None:
            _check_dims(self.dims, self.t, self.tg, self.p)

    # ---- sizes -------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.p * self.t * self.d

    @property
    def micro_dp(self) -> int:
        """m = t/tg: training TP ranks whose shards form one generation block."""
        return self.t // self.tg

    @property
    def dg(self) -> int:
        """Generation engines per training DP replica: p·t/tg."""
        return self.p * self.t // self.tg

    @property
    def num_engines(self) -> int:
        return self.world_size // self.tg

    # ---- rank arithmetic ---------------------------------------------------------------------------------
    def rank_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        if self.order == "tp-dp-pp":
            return tp_rank + self.t * (dp_rank + self.d * pp_rank)
        return tp_rank + self.t * (pp_rank + self.p * dp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, pp_rank, tp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"layout: rank {rank} is outside the world of {self.world_size}")
        tp_rank, rest = rank % self.t, rank // self.t
        if self.order == "tp-dp-pp":
            return rest % self.d, rest // self.d, tp_rank
        return rest // self.p, rest % self.p, tp_rank

    def engine_of(self, dp_rank: int, pp_rank: int, tp_rank: int) -> int:
        return (dp_rank * self.p + pp_rank) * self.micro_dp + tp_rank % self.micro_dp

    def rank_plan(self, rank: int) -> RankPlan:
        dp, s, r = self.coords(rank)
        m, j = self.micro_dp, r // self.micro_dp
        pos = r % m
        return RankPlan(
            rank=rank,
            dp_rank=dp,
            pp_rank=s,
            tp_rank=r,
            gen_tp_rank=j,
            gen_engine=self.engine_of(dp, s, r),
            gen_tp_group=tuple(self.rank_of(dp, s, pos + k * m) for k in range(self.tg)),
            micro_dp_group=tuple(self.rank_of(dp, s, j * m + i) for i in range(m)),
            pp_group=tuple(self.rank_of(dp, st, r) for st in range(self.p)),
            train_tp_group=tuple(self.rank_of(dp, s, i) for i in range(self.t)),
            gather_group=tuple(self.rank_of(dp, st, j * m + i) for st in range(self.p) for i in range(m)),
        )

    # ---- all groups (what every rank must create, in the same order) -----------------------------------
    @cached_property
    def gen_tp_groups(self) -> list[tuple[int, ...]]:
        """Generation TP groups indexed by engine, each ordered by generation TP rank."""
        groups: list[tuple[int, ...] | None] = [None] * self.num_engines
        for rank in range(self.world_size):
            plan = self.rank_plan(rank)
            groups[plan.gen_engine] = plan.gen_tp_group
        return groups  # type: ignore[return-value]

    @cached_property
    def micro_dp_groups(self) -> list[tuple[int, ...]]:
        return sorted({self.rank_plan(r).micro_dp_group for r in range(self.world_size)})

    @cached_property
    def pp_groups(self) -> list[tuple[int, ...]]:
        return sorted({self.rank_plan(r).pp_group for r in range(self.world_size)})

    def vllm_rank_order(self) -> list[int]:
        """vLLM builds TP groups from consecutive ranks; this maps its rank v to our physical rank.

        Engine e's generation TP rank k is vLLM rank e·tg + k, so vLLM's consecutive groups are our strided ones.
        Each group is ascending in physical rank (tp is Megatron's fastest dimension), which matters because
        ``torch.distributed.new_group`` sorts its members: only the grouping can change, never the order inside.
        """
        return [rank for group in self.gen_tp_groups for rank in group]

    # ---- HybridFlow Table 2 predictions ------------------------------------------------------------------
    def predicted_bytes_per_rank(self, model_bytes: float) -> float:
        """Bytes each rank receives during the training→generation transition: (t·p − tg)/(tg·t·p)·M."""
        tp_total = self.t * self.p
        return model_bytes * (tp_total - self.tg) / (self.tg * tp_total)

    def generation_weight_bytes(self, model_bytes: float) -> float:
        """Generation weights held per rank (the paper's peak extra memory): M/(tg·pg)."""
        return model_bytes / self.tg

    def describe(self) -> str:
        return (
            f"train (p={self.p}, t={self.t}, d={self.d}) → generate (pg=1, tg={self.tg}, dg={self.dg}, d={self.d}); "
            f"micro-DP {self.micro_dp}, {self.num_engines} vLLM engines"
        )


def _check_dims(dims: ModelDims, t: int, tg: int, p: int) -> None:
    # Megatron needs t | heads and t | kv heads; vLLM needs tg | heads and either tg | kv heads or kv | tg
    # (replication). Since tg | t, the Megatron checks imply the vLLM ones and no KV replication is ever needed.
    for name, value in (("num_heads", dims.num_heads), ("num_kv_heads", dims.num_kv_heads)):
        if value % t:
            raise LayoutError(f"layout: training tp={t} must divide {name}={value}; choose a tp that divides it")
        if value % tg:
            raise LayoutError(f"layout: generation tp={tg} must divide {name}={value}; choose a smaller tg")
    if dims.ffn_hidden_size % t:
        raise LayoutError(f"layout: training tp={t} must divide ffn_hidden_size={dims.ffn_hidden_size}")
    if dims.num_layers % p:
        raise LayoutError(f"layout: pp={p} must divide num_layers={dims.num_layers}; change pp")


def plan_layout(
    *,
    world_size: int,
    tp: int,
    pp: int,
    gen_tp: int,
    dims: ModelDims | None = None,
    order: str = "tp-dp-pp",
) -> HybridLayout:
    """Plan the generation layout for a training world; raises :class:`LayoutError` on impossible layouts."""
    if tp <= 0 or pp <= 0 or world_size <= 0:
        raise LayoutError(f"layout: world_size={world_size}, tp={tp}, pp={pp} must be positive")
    if world_size % (tp * pp):
        raise LayoutError(
            f"layout: world size {world_size} is not a multiple of tp·pp={tp * pp}; change tp/pp or the rank count"
        )
    return HybridLayout(p=pp, t=tp, d=world_size // (tp * pp), tg=gen_tp, order=order, dims=dims)
