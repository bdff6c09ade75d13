"""Where things run: the `parallel` section (one pool of every rank) and the `placement` section (several pools).

Both become one :class:`verl_mega.parallel.placement.Placement` at start-up (``Placement.from_config``), where the
checks that need the world size or the model shape run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from verl_mega.config.base import ConfigSection, FrozenDict, fmt, option

POOL_KEYS = ("size", "tp", "pp", "vpp", "cp", "ep", "etp", "gen_tp", "gen_ep")
ROLE_NAMES = ("actor", "critic", "ref", "reward_model", "rollout")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(ConfigSection):
    """Megatron-Core training layout of the single pool (every rank; world = tp·pp·cp·dp). With
    `placement.pools` set, the pools carry the layout instead and only the engine flags here apply."""

    SECTION: ClassVar[str] = "parallel"
    # A layout change reshards the checkpoint on load; it does not change what is computed.
    AFFECTS_RESULTS: ClassVar[bool] = False
    PLANNED: ClassVar[tuple[str, ...]] = ("tp", "pp", "vpp", "cp", "dp", "ep", "etp", "sequence_parallel")

    layout: Literal["manual", "auto"] = option(
        "manual", help="`manual`: the layout below (and `rollout.gen_tp`). `auto`: at launch, before anything is "
                       "built, the planner (docs/planning.md) ranks every layout of the world size for this model "
                       "and workload by predicted memory and step time and the run takes the best that fits: tp, pp, "
                       "vpp, ep, etp, sequence parallelism (on when tp > 1) and `rollout.gen_tp` are chosen, so leave "
                       "them unset; the choice and its predicted time are logged. Not with `placement.pools`.")
    tp: int = option(1, help="Tensor-parallel size (Megatron `tensor_model_parallel_size`).")
    pp: int = option(1, help="Pipeline-parallel size (Megatron `pipeline_model_parallel_size`).")
    vpp: int | None = option(None, help="Virtual pipeline stages per pipeline rank (interleaved 1F1B); "
                                        "null disables interleaving. Needs pp > 1.")
    cp: int = option(1, help="Context-parallel size: every sequence is split over cp ranks in load-balanced chunks "
                             "(attention gathers keys and values over them), for long sequences.")
    dp: int | None = option(None, help="Data-parallel size; null derives it as world / (tp·pp·cp).")
    ep: int = option(1, help="Expert-parallel size of Mixture-of-Experts models (Megatron "
                             "`expert_model_parallel_size`): each rank holds 1/ep of every layer's experts; the ep "
                             "ranks come out of tp·cp·dp (docs/moe.md).")
    etp: int | None = option(None, help="Expert tensor-parallel size (Megatron `expert_tensor_parallel_size`): each "
                                        "expert's FFN width is split over etp ranks; null uses tp.")
    sequence_parallel: bool = option(False, help="Megatron sequence parallelism on every training pool (shards "
                                                 "LayerNorm/dropout "
                                                 "activations over the TP group). Needs tp > 1.")
    use_distributed_optimizer: bool = option(True, help="Shard optimizer state over data-parallel ranks "
                                                        "(Megatron DistributedOptimizer / ZeRO-1).")
    topology_file: str | None = option(None, help="A recorded `nvidia-smi topo -m` of the nodes; null runs "
                                                  "nvidia-smi on each node. Decides which GPU each rank drives "
                                                  "(docs/topology.md).")
    dp_hierarchy: Literal["off", "node", "island"] = option(
        "off", help="Data-parallel gradient sync that follows the hardware (docs/topology.md): `off` reduce-scatters "
                    "gradients and all-gathers parameters over each whole data-parallel group; `node` or `island` "
                    "(the node's NVLink islands, from its topology) does both inside each node/island and all-reduces "
                    "only each rank's shard across them (Megatron's `num_distributed_optimizer_instances` = islands "
                    "per data-parallel group; optimizer state is then sharded inside an island only). Needs the "
                    "distributed optimizer, at least two data-parallel ranks per island and two islands.")
    dp_cross_island_dtype: Literal["fp32", "bf16", "fp8"] = option(
        "fp32", affects_results=True,
        help="Wire format of the step between islands when `dp_hierarchy` is on: `fp32` (Megatron's all-reduce), "
             "`bf16` (half the bytes) or `fp8` (e4m3 with an fp32 scale per 128 values: about a quarter). Sums "
             "stay in fp32; the error is bounded and measured in docs/performance.md.")

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "dp", "ep", "etp"):
            self._check_range(name, ge=1)
        if self.layout == "auto":
            defaults = ParallelConfig()
            taken = [f"parallel.{k}={fmt(getattr(self, k))}" for k in self.PLANNED
                     if getattr(self, k) != getattr(defaults, k)]
            self._require(not taken, f"parallel.layout=auto chooses the layout, but {', '.join(taken)} is set; unset "
                                     f"it or set parallel.layout=manual")
        self._require(self.vpp is None or self.vpp >= 2,
                      f"parallel.vpp must be >= 2 virtual stages, got {self.vpp}; set parallel.vpp=null to disable "
                      f"interleaving")
        self._require(self.dp_hierarchy == "off" or self.use_distributed_optimizer,
                      f"parallel.dp_hierarchy={self.dp_hierarchy} shards the optimizer inside each island and needs "
                      f"the distributed optimizer; set parallel.use_distributed_optimizer=true or "
                      f"parallel.dp_hierarchy=off")
        self._require(self.dp_cross_island_dtype == "fp32" or self.dp_hierarchy != "off",
                      f"parallel.dp_cross_island_dtype={self.dp_cross_island_dtype} compresses the step between "
                      f"islands, but parallel.dp_hierarchy=off has none; set parallel.dp_hierarchy=node or island, or "
                      f"parallel.dp_cross_island_dtype=fp32")
        self._require(self.vpp is None or self.pp > 1,
                      f"parallel.vpp={self.vpp} needs pipeline parallelism but parallel.pp=1; "
                      f"set parallel.pp>1 or parallel.vpp=null")


@dataclass(frozen=True, kw_only=True)
class PlacementConfig(ConfigSection):
    """Several pools of ranks, laid out in rank order, and the pool of each role. Empty: one pool from
    `parallel.*` and `rollout.gen_tp`, every role on it (colocated)."""

    SECTION: ClassVar[str] = "placement"
    AFFECTS_RESULTS: ClassVar[bool] = False

    pools: Mapping[str, Any] = option(FrozenDict(), help="Pool name → {size, tp, pp, vpp, cp, ep, etp, gen_tp, "
                                                         "gen_ep}; sizes in ranks, pools laid out in this order.")
    roles: Mapping[str, Any] = option(FrozenDict(), help="Role (actor, critic, ref, reward_model, rollout) → pool "
                                                         "name; a role left out runs on the actor's pool.")

    def validate(self) -> None:
        for name, dims in self.pools.items():
            where = f"placement.pools.{name}"
            self._require(isinstance(dims, Mapping), f"{where} must be a mapping like {{size: 8, tp: 2}}")
            unknown = sorted(set(dims) - set(POOL_KEYS))
            self._require(not unknown, f"{where}: unknown key(s) {unknown}; pool keys are {', '.join(POOL_KEYS)}")
            self._require("size" in dims, f"{where} needs size (its number of ranks), e.g. {where}.size=8")
            for key, value in dims.items():
                ok = value is None and key == "vpp" or isinstance(value, int) and not isinstance(value, bool) \
                    and value >= 1
                self._require(ok, f"{where}.{key} must be a positive int, got {value!r}")
        for role, pool in self.roles.items():
            self._require(role in ROLE_NAMES, f"placement.roles.{role}: unknown role; roles are "
                                              f"{', '.join(ROLE_NAMES)}")
            self._require(pool in self.pools, f"placement.roles.{role}={pool!r} is not a pool of placement.pools "
                                              f"({', '.join(self.pools) or 'none'})")
        self._require(not self.roles or bool(self.pools), "placement.roles needs placement.pools")
