"""The one placement of a job: named rank pools, which role runs on which pool, each pool's parallel layout, and
every process group, as pure arithmetic over integers.

This is the only rank arithmetic in the package. The trainer, the 3D-HybridEngine, the topology scheduler, the
planner and the 1024-rank dry run all read the same :class:`Placement`; nothing here touches torch.distributed, so
placements of thousands of ranks are built and checked in one process.

**Training groups** follow Megatron-Core's rank order ``tp-cp-ep-dp-pp`` inside each pool (tp fastest): dense
groups use the grid (tp, cp, dp, pp), expert groups the grid (etp, ep, edp, pp) over the same ranks, exactly as
``megatron.core.parallel_state`` builds them; the unit tests compare both with mcore's own generators.

**Generation groups** (HybridFlow §5, the 3D-HybridEngine). Inside every training TP group ``[r0 … r(t-1)]`` of a
pool that trains and generates, with m = tp/gen_tp:

* the generation TP group of position k takes the ranks strided by m: ``r(k), r(k+m), …`` — so the concatenation
  of the training shards ``j·m … j·m+m-1`` is exactly generation block j and every rank reuses its own shard;
* the micro-DP group is a run of m consecutive ranks ``r(j·m) … r(j·m+m-1)``: an all-gather inside it turns each
  rank's 1/t shard into generation block j.

Each generation TP group is one vLLM engine. A rollout-only pool (``trains=False``) cuts its ranks into consecutive
engines of gen_tp ranks.

**Expert-parallel generation** (``gen_ep`` > 1, Mixture-of-Experts models): vLLM shards the routed experts over
gen_ep ranks (its expert parallelism over D = gen_ep/gen_tp data-parallel attention engines of gen_tp ranks each)
while attention stays tensor-parallel inside each engine. Such a generation group (``gen_ep`` kind) is not bounded by
one training TP group: it joins the engines at the same position k of D consecutive training TP groups of a
pipeline stage (they differ in their data-/expert-parallel coordinates), so it stays ascending in rank and every
rank of a pipeline group keeps the same generation coordinates (its attention block j and its expert slice, EP rank
d·gen_tp + j). Generation EP rank e serves experts [e·E/gen_ep, (e+1)·E/gen_ep) whole.

**Data-parallel islands** (``parallel.dp_hierarchy``). A training pool with ``dp_islands`` = I > 1 cuts each
pipeline stage's tp·cp·dp ranks into I consecutive blocks, one per island (an NVLink island or a node, as the
topology scheduler orders the devices): Megatron-Core's partial distributed optimizer with
``num_distributed_optimizer_instances`` = I. Gradients are reduce-scattered and parameters all-gathered inside a
block (``intra_dp``, ``intra_edp``); only each rank's shard is all-reduced across the blocks, between the ranks at
the same position in every block (``inter_dp``: one group for dense and expert parameters, as mcore requires).
``dist_opt`` is a block over every pipeline stage: one optimizer instance, where gradient norms are reduced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Mapping

from verl_mega.parallel.wire import CROSS_ISLAND_DTYPES

ROLES = ("actor", "critic", "ref", "reward_model", "rollout")
TRAINING_ROLES = ("actor", "critic", "ref", "reward_model")
DEFAULT_POOL = "main"
# Every group kind a rank belongs to, in the order groups are built (the same order on every rank).
DENSE_KINDS = {"tp": ("tp",), "cp": ("cp",), "dp": ("dp",), "pp": ("pp",), "dp_cp": ("cp", "dp"),
               "tp_cp": ("tp", "cp"), "mp": ("tp", "pp"), "tp_dp_cp": ("tp", "cp", "dp"),
               "pool": ("tp", "cp", "dp", "pp")}
EXPERT_KINDS = {"ep": ("ep",), "etp": ("etp",), "edp": ("edp",), "tp_ep": ("etp", "ep"),
                "tp_ep_pp": ("etp", "ep", "pp")}
GENERATION_KINDS = ("gen_tp", "micro_dp", "gen_ep")
# Data-parallel islands (one island of the whole tp·cp·dp slice when the pool is flat): the island's ranks, the
# dense and expert data-parallel ranks inside it, the ranks at the same position in every island, the optimizer
# instance (an island over every pipeline stage).
ISLAND_KINDS = ("island", "intra_dp", "intra_edp", "inter_dp", "dist_opt")
GROUP_KINDS = (*DENSE_KINDS, "embd", *EXPERT_KINDS, *GENERATION_KINDS, *ISLAND_KINDS)
# What placement.json records for every rank (and, for a pool with dp_islands > 1, ISLAND_JSON_KINDS).
JSON_KINDS = ("tp", "pp", "dp", "cp", "ep", "gen_tp", "micro_dp", "gen_ep")
ISLAND_JSON_KINDS = ("island", "intra_dp", "inter_dp")
DP_HIERARCHY_LEVELS = ("off", "node", "island")


class PlacementError(ValueError):
    """An impossible placement; the message is one line naming the pool or key and the fix."""


def divisors(n: int) -> list[int]:  # the sizes a layout may split n into, ascending
    return [d for d in range(1, n + 1) if n % d == 0]


def _grid_groups(ranks: tuple[int, ...], shape: tuple[tuple[str, int], ...], dims: Iterable[str]
                 ) -> tuple[tuple[int, ...], ...]:
    """Groups of ``ranks`` laid out on a mixed-radix grid (first dim fastest) that vary only along ``dims``.

    Members come out in ascending grid order, groups in the order of their first member."""
    dims = set(dims)
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, rank in enumerate(ranks):
        key, rest = [], index
        for name, size in shape:
            if name not in dims:
                key.append(rest % size)
            rest //= size
        groups.setdefault(tuple(key), []).append(rank)
    return tuple(tuple(g) for g in groups.values())


@dataclass(frozen=True, kw_only=True)
class Pool:
    """A set of ranks and its layout. ``dp`` is derived: size / (tp·pp·cp). For the expert grid, ``etp`` (default:
    tp) and ``ep`` split tp·cp·dp, the rest is expert data parallelism. ``gen_tp`` (default: tp) and ``gen_ep`` shape
    the vLLM engines when the pool generates (``gen_ep`` > 1: the experts sharded over gen_ep ranks, see the module
    docstring); a pool that does not train (``trains=False``) only generates."""

    name: str
    ranks: tuple[int, ...]
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    gen_tp: int | None = None
    gen_ep: int = 1
    sequence_parallel: bool = False
    trains: bool = True
    dp_islands: int = 1
    dp_cross_island_dtype: str = "fp32"

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(self.ranks))
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if self.gen_tp is None:
            object.__setattr__(self, "gen_tp", self.tp if self.trains else 1)
        k = self._key
        for key in ("tp", "pp", "cp", "ep", "etp", "gen_tp", "gen_ep"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise PlacementError(f"{k(key)}={value!r} must be a positive int")
        if not self.ranks or len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise PlacementError(f"pool {self.name!r}: ranks must be distinct non-negative ints, got "
                                 f"{list(self.ranks)[:8]}")
        if self.sequence_parallel and self.tp == 1:
            raise PlacementError(f"{k('sequence_parallel')}=true needs tp > 1; set {k('tp')}>1 or "
                                 f"{k('sequence_parallel')}=false")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise PlacementError(f"{k('vpp')}={self.vpp} needs vpp >= 2 and pp > 1 ({k('pp')}={self.pp}); set "
                                 f"{k('vpp')}=null")
        model_parallel = self.tp * self.pp * self.cp
        if self.size % model_parallel:
            ranks = f"world size {self.size} is" if self.name == DEFAULT_POOL else f"its {self.size} ranks are"
            raise PlacementError(f"{self._where}: {ranks} not divisible by tp·pp·cp = {self.tp}·{self.pp}·"
                                 f"{self.cp} = {model_parallel}; choose {k('tp')}/pp/cp whose product divides "
                                 f"{self.size}")
        dense_replica = self.tp * self.cp * self.dp
        if dense_replica % (self.etp * self.ep):
            raise PlacementError(f"{self._where}: etp·ep = {self.etp}·{self.ep} must divide tp·cp·dp = {dense_replica} "
                                 f"(experts are laid over the same ranks); choose {k('ep')} among "
                                 f"{divisors(dense_replica // self.etp)}")
        if self.trains and self.tp % self.gen_tp:
            raise PlacementError(f"{k('gen_tp')}={self.gen_tp} must divide {k('tp')}={self.tp} (generation TP groups "
                                 f"are carved out of each training TP group); choose among {divisors(self.tp)}")
        if self.size % self.gen_tp:
            raise PlacementError(f"{self._where}: gen_tp={self.gen_tp} must divide its {self.size} ranks; choose "
                                 f"{k('gen_tp')} among {divisors(self.size)}")
        if self.gen_ep > 1:
            engines = self.size // self.gen_tp if not self.trains else self.cp * self.dp
            if self.gen_ep % self.gen_tp or engines % (self.gen_ep // self.gen_tp):
                what = "the cp·dp training TP groups of a pipeline stage" if self.trains else "its engines"
                raise PlacementError(
                    f"{k('gen_ep')}={self.gen_ep} must be gen_tp·D with D dividing {what} ({engines}): an expert-"
                    f"parallel generation group joins D engines of gen_tp={self.gen_tp}; choose {k('gen_ep')} among "
                    f"{[self.gen_tp * d for d in divisors(engines)]}")
        self._check_islands()

    def _check_islands(self) -> None:
        islands, dtype = self.dp_islands, self.dp_cross_island_dtype
        if not isinstance(islands, int) or isinstance(islands, bool) or islands < 1:
            raise PlacementError(f"{self._where}: dp_islands={islands!r} must be a positive int")
        if dtype not in CROSS_ISLAND_DTYPES:
            raise PlacementError(f"parallel.dp_cross_island_dtype={dtype!r} is not one of "
                                 f"{', '.join(CROSS_ISLAND_DTYPES)}")
        if islands == 1:
            if dtype != "fp32":
                raise PlacementError(f"parallel.dp_cross_island_dtype={dtype} compresses the step between islands, "
                                     f"but {self._where} has one island per data-parallel group; set "
                                     f"parallel.dp_hierarchy=node or island, or parallel.dp_cross_island_dtype=fp32")
            return
        if not self.trains:
            raise PlacementError(f"{self._where}: only generates; data-parallel islands are for training pools")
        if (self.cp * self.dp) % islands or self.edp % islands:
            raise PlacementError(f"{self._where}: {islands} islands must divide the data-parallel sizes dp·cp = "
                                 f"{self.dp * self.cp} and expert dp = {self.edp}; set parallel.dp_hierarchy=off")

    @property
    def island_ranks(self) -> int:
        """Ranks of one pipeline stage in one island: tp·cp·dp / dp_islands."""
        return self.tp * self.cp * self.dp // self.dp_islands

    @property
    def _where(self) -> str:
        return "parallel" if self.name == DEFAULT_POOL else f"placement.pools.{self.name}"

    def _key(self, key: str) -> str:
        """The config key a user sets for ``key`` of this pool (``parallel.*`` / ``rollout.gen_tp`` for the single
        pool, ``placement.pools.<name>.*`` otherwise)."""
        if self.name == DEFAULT_POOL:
            return f"rollout.{key}" if key in ("gen_tp", "gen_ep") else f"parallel.{key}"
        return f"placement.pools.{self.name}.{key}"

    # ---- sizes --------------------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def dp(self) -> int:
        return self.size // (self.tp * self.pp * self.cp)

    @property
    def chunks(self) -> int:
        """Model chunks in a pipeline: pp·vpp."""
        return self.pp * (self.vpp or 1)

    @property
    def edp(self) -> int:
        return self.size // (self.etp * self.ep * self.pp)

    @property
    def micro_dp(self) -> int:
        """m = tp/gen_tp: training TP ranks whose shards make one generation block (1 for rollout-only pools)."""
        return self.tp // self.gen_tp if self.trains else 1

    @property
    def num_engines(self) -> int:
        return self.size // self.gen_tp

    @property
    def gen_dp(self) -> int:
        """D: vLLM's data-parallel attention engines in one expert-parallel generation group (1 without gen_ep)."""
        return max(1, self.gen_ep // self.gen_tp)

    def describe(self) -> str:
        return f"{self.name}: {self.size} ranks, {self.dims()}"

    def dims(self) -> str:
        if not self.trains:
            ep = f" gen_ep={self.gen_ep}" if self.gen_ep > 1 else ""
            return f"generation only, gen_tp={self.gen_tp}{ep} ({self.num_engines} engines)"
        parts = [f"tp={self.tp}", f"pp={self.pp}"] + ([f"vpp={self.vpp}"] if self.vpp else [])
        parts += [f"cp={self.cp}"] * (self.cp > 1) + [f"ep={self.ep}", f"etp={self.etp}"] * (self.ep > 1)
        islands = [f"dp_islands={self.dp_islands}"] + [f"({self.dp_cross_island_dtype} across)"] * (
            self.dp_cross_island_dtype != "fp32") if self.dp_islands > 1 else []
        return " ".join(parts + [f"dp={self.dp}", f"gen_tp={self.gen_tp}"] + [f"gen_ep={self.gen_ep}"] *
                        (self.gen_ep > 1) + ["sp"] * self.sequence_parallel + islands)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "first_rank": self.ranks[0], "trains": self.trains,
                **{k: getattr(self, k) for k in ("tp", "pp", "vpp", "cp", "ep", "etp", "dp", "gen_tp", "gen_ep",
                                                 "sequence_parallel", "dp_islands", "dp_cross_island_dtype")}}

    # ---- groups -------------------------------------------------------------------------------------------
    @cached_property
    def _dense_shape(self) -> tuple[tuple[str, int], ...]:
        return (("tp", self.tp), ("cp", self.cp), ("dp", self.dp), ("pp", self.pp))

    @cached_property
    def _all_groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        out = {kind: _grid_groups(self.ranks, self._dense_shape, dims) for kind, dims in DENSE_KINDS.items()}
        # mcore's embedding group: the first and last stage of each pipeline (word embeddings tied or not)
        out["embd"] = tuple(tuple(sorted({g[0], g[-1]})) for g in out["pp"])
        expert_shape = (("etp", self.etp), ("ep", self.ep), ("edp", self.edp), ("pp", self.pp))
        out.update({kind: _grid_groups(self.ranks, expert_shape, dims) for kind, dims in EXPERT_KINDS.items()})
        d = self.gen_dp
        if self.trains:
            # an expert-parallel generation group: the engines at position k of D consecutive training TP groups
            m, gen, micro, blocks = self.micro_dp, [], [], []
            for first in range(0, len(out["tp"]), d):
                tps = out["tp"][first:first + d]
                for k in range(m):
                    engines = [tp_group[k::m] for tp_group in tps]
                    gen += engines
                    blocks.append(tuple(r for e in engines for r in e))
                micro += [tp_group[j * m:(j + 1) * m] for tp_group in tps for j in range(self.gen_tp)]
            out["gen_tp"], out["micro_dp"] = tuple(gen), tuple(micro)
        else:
            out["gen_tp"] = tuple(self.ranks[i:i + self.gen_tp] for i in range(0, self.size, self.gen_tp))
            out["micro_dp"] = tuple((r,) for r in self.ranks)
            blocks = [self.ranks[i:i + self.gen_tp * d] for i in range(0, self.size, self.gen_tp * d)]
        out["gen_ep"] = tuple(blocks) if self.gen_ep > 1 else tuple((r,) for r in self.ranks)
        out.update(self._island_groups(out))
        return out

    def _island_groups(self, out: dict[str, tuple[tuple[int, ...], ...]]) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Islands: consecutive blocks of ``island_ranks`` ranks of each pipeline stage (mcore cuts each data-parallel
        group into contiguous runs, its intra-instance groups, and takes the i-th member of every run as one
        inter-instance group); the optimizer instance is island j of every stage."""
        block, stage = self.island_ranks, self.tp * self.cp * self.dp
        island_of = {r: (i // stage, i % stage // block) for i, r in enumerate(self.ranks)}  # (stage, island)
        offset = {r: i % block for i, r in enumerate(self.ranks)}
        groups: dict[str, dict[tuple, list[int]]] = {k: {} for k in ISLAND_KINDS}
        for r in self.ranks:
            pp_index, island = island_of[r]
            groups["island"].setdefault((pp_index, island), []).append(r)
            groups["inter_dp"].setdefault((pp_index, offset[r]), []).append(r)
            groups["dist_opt"].setdefault((island,), []).append(r)
        for kind, parent in (("intra_dp", "dp_cp"), ("intra_edp", "edp")):
            for g in out[parent]:
                for r in g:
                    groups[kind].setdefault((island_of[r], g[0]), []).append(r)
        return {k: tuple(tuple(g) for g in v.values()) for k, v in groups.items()}

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """Every group of ``kind`` (see ``GROUP_KINDS``) in this pool. Engines are numbered in ``gen_tp`` order."""
        if kind not in self._all_groups:
            raise PlacementError(f"unknown group kind {kind!r}; one of {', '.join(GROUP_KINDS)}")
        return self._all_groups[kind]

    @cached_property
    def _member_of(self) -> dict[str, dict[int, int]]:
        return {kind: {r: i for i, g in enumerate(groups) for r in g} for kind, groups in self._all_groups.items()}

    def group_of(self, kind: str, rank: int) -> tuple[int, ...] | None:
        """The rank's group of ``kind``; None for the embedding group of a middle pipeline stage (it has none)."""
        if kind == "embd" and rank in self.ranks and rank not in self._member_of["embd"]:
            return None
        return self.groups(kind)[self._index(kind, rank)]

    def _index(self, kind: str, rank: int) -> int:
        self.groups(kind)
        if rank not in self._member_of[kind]:
            raise PlacementError(f"rank {rank} is not in pool {self.name!r}")
        return self._member_of[kind][rank]

    @cached_property
    def _position(self) -> dict[int, int]:  # a planner asks for the coords of ~10^6 ranks: no linear search
        return {r: i for i, r in enumerate(self.ranks)}

    def coords(self, rank: int) -> dict[str, int]:
        """The rank's position along every dimension: tp, cp, dp, pp, ep, etp, edp, gen_tp (its block j), engine,
        gen_ep (its expert-parallel generation rank: the experts it serves; 0 without gen_ep)."""
        if rank not in self._position:
            raise PlacementError(f"rank {rank} is not in pool {self.name!r}")
        index = self._position[rank]
        out = {}
        for shape in (self._dense_shape, (("etp", self.etp), ("ep", self.ep), ("edp", self.edp), ("pp", self.pp))):
            rest = index
            for name, size in shape:
                out[name] = rest % size
                rest //= size
        out.update(self._generation_coords(index))
        return out

    def _generation_coords(self, index: int) -> dict[str, int]:
        """engine, gen_tp and gen_ep of the rank at ``index`` of the pool, by the arithmetic the groups are laid out
        with (``Placement.check`` compares the two): training TP group g = index // tp, position p in it; engine k =
        p mod m of that group, block j = p // m; D consecutive TP groups form one expert-parallel group."""
        d = self.gen_dp
        if not self.trains:
            engine, j = divmod(index, self.gen_tp)
            return {"engine": engine, "gen_tp": j, "gen_ep": (engine % d) * self.gen_tp + j if self.gen_ep > 1 else 0}
        m = self.micro_dp
        g, pos = divmod(index, self.tp)
        k, j = pos % m, pos // m
        engine = (g // d) * d * m + k * d + g % d
        return {"engine": engine, "gen_tp": j, "gen_ep": (g % d) * self.gen_tp + j if self.gen_ep > 1 else 0}

    def vllm_rank_order(self) -> list[int]:
        """vLLM builds TP groups from consecutive ranks; position v of this list is the rank that plays vLLM rank v,
        so vLLM's consecutive groups are our (strided) generation TP groups, engine by engine; with gen_ep > 1 the
        engines of one expert-parallel group come together (vLLM's data-parallel × tensor-parallel block), so its
        data-parallel and expert-parallel groups are ours too. Every group is ascending in rank, which matters
        because ``torch.distributed.new_group`` sorts its members."""
        if self.gen_ep == 1:
            return [rank for group in self.groups("gen_tp") for rank in group]
        return [rank for group in self.groups("gen_ep") for rank in group]

    # ---- HybridFlow Table 2 (pg = 1) ------------------------------------------------------------------------
    def sync_bytes_per_rank(self, model_bytes: float) -> float:
        """Bytes one rank receives at the training → generation switch: (t·p − tg)/(tg·t·p)·M."""
        tp_total = self.tp * self.pp
        return model_bytes * (tp_total - self.gen_tp) / (self.gen_tp * tp_total)

    def expert_slice(self, rank: int, num_experts: int, width: int) -> tuple[int, int, int, int]:
        """The routed experts ``rank`` serves in generation, as (first expert, end, first row, end row) of every MoE
        layer: rows [j·f/tg, (j+1)·f/tg) of all E experts (vLLM's TP slices every expert), or with gen_ep > 1 the
        whole experts [e·E/gen_ep, (e+1)·E/gen_ep) of its expert-parallel rank e."""
        return self.expert_slice_at(self.coords(rank), num_experts, width)

    def expert_slice_at(self, c: dict[str, int], num_experts: int, width: int) -> tuple[int, int, int, int]:
        """:meth:`expert_slice` at coordinates ``c`` (:meth:`coords`)."""
        if self.gen_ep > 1:
            per = num_experts // self.gen_ep
            return c["gen_ep"] * per, (c["gen_ep"] + 1) * per, 0, width
        fj = width // self.gen_tp
        return 0, num_experts, c["gen_tp"] * fj, (c["gen_tp"] + 1) * fj

    def generation_weight_bytes(self, model_bytes: float) -> float:
        """Generation weights one rank holds: M/tg."""
        return model_bytes / self.gen_tp


@dataclass(frozen=True)
class Placement:
    """Pools that partition the world's ranks, and the pool of every role. Colocated = rollout pool is the actor's
    pool; a role left out runs on the actor's pool."""

    world_size: int
    pools: tuple[Pool, ...]
    roles: Mapping[str, str] = field(default_factory=dict)
    # what the training pools' data-parallel islands are (``off``: flat data-parallel groups), see with_dp_hierarchy
    dp_hierarchy: str = "off"

    def __post_init__(self) -> None:
        object.__setattr__(self, "pools", tuple(self.pools))
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise PlacementError(f"placement: pool names repeat: {names}")
        owner: dict[int, str] = {}
        for pool in self.pools:
            for r in pool.ranks:
                if r in owner:
                    raise PlacementError(f"placement: rank {r} is in pools {owner[r]!r} and {pool.name!r}; pools must "
                                         f"not overlap")
                owner[r] = pool.name
        if sorted(owner) != list(range(self.world_size)):
            raise PlacementError(f"placement: the pools hold {len(owner)} ranks but the world has {self.world_size}; "
                                 f"make the pool sizes add up to the number of processes")
        unknown = sorted(set(self.roles) - set(ROLES))
        if unknown:
            raise PlacementError(f"placement.roles: unknown role(s) {unknown}; roles are {', '.join(ROLES)}")
        roles = dict(self.roles)
        if "actor" not in roles:
            if len(self.pools) > 1:
                raise PlacementError("placement.roles.actor is not set and there are several pools; name the actor's "
                                     "pool, e.g. placement.roles={actor: train, rollout: rollout}")
            roles["actor"] = self.pools[0].name
        for role in ROLES:
            roles.setdefault(role, roles["actor"])
        for role, name in roles.items():
            if name not in names:
                raise PlacementError(f"placement.roles.{role}={name!r} is not a pool; pools are {names}")
        if roles["rollout"] != roles["actor"] and self.pool(roles["rollout"]).gen_ep > 1:
            raise PlacementError(f"placement.pools.{roles['rollout']}.gen_ep > 1: expert-parallel generation runs with "
                                 f"the rollout on the actor's pool (colocated); set placement.roles.rollout="
                                 f"{roles['actor']} or gen_ep=1")
        for role in TRAINING_ROLES:
            if not self.pool(roles[role]).trains:
                raise PlacementError(f"placement: role {role} runs on pool {roles[role]!r}, which only generates; put "
                                     f"{role} on a training pool")
        object.__setattr__(self, "roles", roles)
        object.__setattr__(self, "_owner", owner)

    @classmethod
    def single(cls, world_size: int, **dims: Any) -> "Placement":
        """Everything on one pool of all ranks (today's ``parallel.*`` spelling): the colocated placement."""
        return cls(world_size, (Pool(name=DEFAULT_POOL, ranks=tuple(range(world_size)), **dims),))

    @classmethod
    def from_config(cls, cfg: Any, world_size: int) -> "Placement":
        """From a TrainConfig: ``placement.pools`` (name → size and dims, laid out in rank order) and
        ``placement.roles`` when given, else one pool from ``parallel.*``, ``rollout.gen_tp`` and ``rollout.gen_ep``."""
        spec = getattr(cfg, "placement", None)
        if spec is None or not spec.pools:
            p = cfg.parallel
            if p.dp is not None and p.dp * p.tp * p.pp * p.cp != world_size:
                raise PlacementError(f"parallel: tp·pp·cp·dp = {p.tp}·{p.pp}·{p.cp}·{p.dp} = "
                                     f"{p.tp * p.pp * p.cp * p.dp} does not equal the world size {world_size}; set "
                                     f"parallel.dp=null to derive dp, or start {p.tp * p.pp * p.cp * p.dp} processes")
            return cls.single(world_size, tp=p.tp, pp=p.pp, vpp=p.vpp, cp=p.cp, ep=p.ep, etp=p.etp,
                              gen_tp=cfg.rollout.gen_tp, gen_ep=cfg.rollout.gen_ep,
                              sequence_parallel=p.sequence_parallel)
        pools, start = [], 0
        trained = {spec.roles.get(r, spec.roles.get("actor")) for r in TRAINING_ROLES}
        for name, dims in spec.pools.items():
            dims = dict(dims)
            size = dims.pop("size")
            trains = name in trained
            pools.append(Pool(name=name, ranks=tuple(range(start, start + size)), trains=trains,
                              sequence_parallel=trains and cfg.parallel.sequence_parallel, **dims))
            start += size
        return cls(world_size, tuple(pools), dict(spec.roles))

    def with_dp_hierarchy(self, level: str, ranks_per_island: int | None, cross_island_dtype: str = "fp32"
                          ) -> "Placement":
        """This placement with every training pool's data-parallel groups cut at islands of ``ranks_per_island``
        consecutive ranks (``level`` node: the ranks of a node; island: of an NVLink island, after the topology
        scheduler has ordered each node's devices island by island). Each pipeline stage of a pool must cover whole
        islands, each island hold whole TP·CP and expert (etp·ep) groups and at least two data-parallel ranks, and a
        data-parallel group span at least two islands; otherwise a one-line error names parallel.dp_hierarchy."""
        from dataclasses import replace

        key = "parallel.dp_hierarchy"
        if level not in DP_HIERARCHY_LEVELS:
            raise PlacementError(f"{key}={level!r} is not one of {', '.join(DP_HIERARCHY_LEVELS)}")
        if level == "off":
            if cross_island_dtype != "fp32":
                raise PlacementError(f"parallel.dp_cross_island_dtype={cross_island_dtype} needs islands; set {key}="
                                     f"node or island, or parallel.dp_cross_island_dtype=fp32")
            return self
        u = ranks_per_island
        if not u or u < 1:
            raise PlacementError(f"{key}={level}: the size of an island is unknown; give parallel.topology_file or "
                                 f"run where nvidia-smi works, or set {key}=node")
        where = f"{key}={level}, {u} ranks per {level}"
        pools = []
        for pool in self.pools:
            if not pool.trains:
                pools.append(pool)
                continue
            stage, model = pool.tp * pool.cp * pool.dp, pool.tp * pool.cp
            name = "the world" if pool.name == DEFAULT_POOL else f"pool {pool.name!r}"
            if u % model or u % (pool.etp * pool.ep):
                raise PlacementError(f"{where}: a TP·CP group of {model} ranks (expert etp·ep = "
                                     f"{pool.etp * pool.ep}) does not fit an island a whole number of times; choose "
                                     f"parallel.tp/cp/ep dividing {u}, or set {key}=off")
            if u == model:
                raise PlacementError(f"{where}: tp·cp = {model} fills an island, so each island holds one "
                                     f"data-parallel rank and nothing is reduced inside it; lower parallel.tp or set "
                                     f"{key}=off")
            if stage <= u:
                raise PlacementError(f"{where}: each data-parallel group of {name} already lies inside a single "
                                     f"{level} (tp·cp·dp = {stage} ranks per pipeline stage); nothing crosses "
                                     f"islands, set {key}=off")
            if stage % u or pool.ranks[0] % u:
                raise PlacementError(f"{where}: the {stage} ranks of each pipeline stage of {name} do not cover "
                                     f"whole islands; make tp·cp·dp a multiple of {u} (and each pool start on an "
                                     f"island), or set {key}=off")
            pools.append(replace(pool, dp_islands=stage // u, dp_cross_island_dtype=cross_island_dtype))
        return replace(self, pools=tuple(pools), dp_hierarchy=level)

    # ---- lookups ------------------------------------------------------------------------------------------
    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise PlacementError(f"placement has no pool {name!r}; pools are {[p.name for p in self.pools]}")

    def pool_of(self, role: str) -> Pool:
        return self.pool(self.roles[role])

    def pool_of_rank(self, rank: int) -> Pool:
        return self.pool(self._owner[rank])  # type: ignore[attr-defined]

    @property
    def colocated(self) -> bool:
        return self.roles["rollout"] == self.roles["actor"]

    def describe(self) -> str:
        roles = ", ".join(f"{r}→{p}" for r, p in self.roles.items())
        return "; ".join(p.describe() for p in self.pools) + f"; roles {roles}"

    def rank_record(self, rank: int) -> dict[str, Any]:
        """What placement.json says about one rank (devices are added by the topology scheduler)."""
        pool = self.pool_of_rank(rank)
        kinds = JSON_KINDS + (ISLAND_JSON_KINDS if pool.dp_islands > 1 else ())
        groups = {kind: list(pool.group_of(kind, rank)) for kind in kinds}
        return {"rank": rank, "pool": pool.name, "coords": pool.coords(rank), "groups": groups}

    def check(self) -> list[str]:
        """Verify the group arithmetic of every rank of every pool; returns the checks made (raises on failure).

        The generation groups must partition each training TP group, be strided by m and ascending, and meet the
        micro-DP group in exactly one rank; every group kind must partition its pool."""
        done = []
        for pool in self.pools:
            for kind in GROUP_KINDS:
                flat = sorted(r for g in pool.groups(kind) for r in g)
                if kind != "embd" and flat != sorted(pool.ranks):
                    raise PlacementError(f"pool {pool.name!r}: {kind} groups do not partition the pool")
            for rank in pool.ranks:  # the coordinates' arithmetic against the groups themselves
                c = pool.coords(rank)
                want = {"engine": pool._index("gen_tp", rank), "gen_tp": pool.group_of("gen_tp", rank).index(rank),
                        "gen_ep": pool.group_of("gen_ep", rank).index(rank)}
                if {k: c[k] for k in want} != want:
                    raise PlacementError(f"pool {pool.name!r}: rank {rank}'s generation coordinates "
                                         f"{ {k: c[k] for k in want} } differ from its groups' {want}")
            if pool.trains:
                m = pool.micro_dp
                for rank in pool.ranks:
                    gen, tp = pool.group_of("gen_tp", rank), pool.group_of("tp", rank)
                    micro = pool.group_of("micro_dp", rank)
                    if not set(gen) <= set(tp) or list(gen) != sorted(gen) or len(gen) != pool.gen_tp:
                        raise PlacementError(f"pool {pool.name!r}: generation TP group {gen} is not an ascending "
                                             f"subset of TP group {tp}")
                    if any(tp.index(b) - tp.index(a) != m for a, b in zip(gen, gen[1:])):
                        raise PlacementError(f"pool {pool.name!r}: generation TP group {gen} is not strided by {m}")
                    if set(gen) & set(micro) != {rank}:
                        raise PlacementError(f"pool {pool.name!r}: generation TP {gen} and micro-DP {micro} groups "
                                             f"must meet in rank {rank} only")
                for group in pool.groups("pp"):  # the producer's PP exchange: one layout for a whole pipeline
                    coords = {(pool.coords(r)["gen_tp"], pool.coords(r)["gen_ep"]) for r in group}
                    if len(coords) != 1:
                        raise PlacementError(f"pool {pool.name!r}: pipeline group {list(group)[:8]} mixes generation "
                                             f"coordinates {sorted(coords)}")
            how = (f"generation groups strided by {pool.micro_dp} inside TP groups, one rank in common with micro-DP"
                   if pool.trains else f"engines of {pool.gen_tp} consecutive ranks")
            if pool.gen_ep > 1:
                engines = set(pool.groups("gen_tp"))
                for block in pool.groups("gen_ep"):
                    parts = [block[i:i + pool.gen_tp] for i in range(0, len(block), pool.gen_tp)]
                    if list(block) != sorted(block) or len(block) != pool.gen_ep or not set(parts) <= engines:
                        raise PlacementError(f"pool {pool.name!r}: expert-parallel generation group {list(block)[:8]} "
                                             f"is not {pool.gen_dp} whole engines of gen_tp={pool.gen_tp} in "
                                             f"ascending order")
                how += (f"; expert-parallel generation groups of {pool.gen_dp} engines ({pool.gen_ep} ranks), "
                        f"ascending, one generation layout per pipeline group")
            done.append(f"{pool.describe()}: {len(GROUP_KINDS)} group kinds partition the pool; {how}")
        return done
