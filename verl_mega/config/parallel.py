"""Training parallel layout: the `parallel` config section and the resolved :class:`ParallelDims`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from verl_mega.config.base import ConfigError, ConfigSection, option


@dataclass(frozen=True, kw_only=True)
class ParallelConfig(ConfigSection):
    """Megatron-Core training layout. Ranks are split as world = tp·pp·cp·dp; the checks that need the world size
    or the model shape (heads, key/value heads, layers) run in `ParallelDims.resolve` at start-up."""

    SECTION: ClassVar[str] = "parallel"
    # A layout change reshards the checkpoint on load; it does not change what is computed.
    AFFECTS_RESULTS: ClassVar[bool] = False

    tp: int = option(1, help="Tensor-parallel size (Megatron `tensor_model_parallel_size`).")
    pp: int = option(1, help="Pipeline-parallel size (Megatron `pipeline_model_parallel_size`).")
    vpp: int | None = option(None, help="Virtual pipeline stages per pipeline rank (interleaved 1F1B); "
                                        "null disables interleaving. Needs pp > 1.")
    cp: int = option(1, help="Context-parallel size (sequence split across ranks for long sequences).")
    dp: int | None = option(None, help="Data-parallel size; null derives it as world / (tp·pp·cp).")
    sequence_parallel: bool = option(False, help="Megatron sequence parallelism (shards LayerNorm/dropout "
                                                 "activations over the TP group). Needs tp > 1.")
    use_distributed_optimizer: bool = option(True, help="Shard optimizer state over data-parallel ranks "
                                                        "(Megatron DistributedOptimizer / ZeRO-1).")

    def validate(self) -> None:
        for name in ("tp", "pp", "cp", "dp"):
            self._check_range(name, ge=1)
        self._require(self.vpp is None or self.vpp >= 2,
                      f"parallel.vpp must be >= 2 virtual stages, got {self.vpp}; set parallel.vpp=null to disable "
                      f"interleaving")
        self._require(self.vpp is None or self.pp > 1,
                      f"parallel.vpp={self.vpp} needs pipeline parallelism but parallel.pp=1; "
                      f"set parallel.pp>1 or parallel.vpp=null")
        self._require(not self.sequence_parallel or self.tp > 1,
                      "parallel.sequence_parallel=true needs tensor parallelism but parallel.tp=1; "
                      "set parallel.tp>1 or parallel.sequence_parallel=false")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The resolved training layout: every size is known and world = tp·pp·cp·dp."""

    tp: int
    pp: int
    vpp: int | None
    cp: int
    dp: int
    world: int

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "dp", "world"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ParallelDims.{name} must be a positive int, got {value!r}")
        if self.vpp is not None and (self.vpp < 2 or self.pp < 2):
            raise ConfigError(f"ParallelDims.vpp={self.vpp} needs vpp >= 2 and pp > 1 (pp={self.pp}); "
                              f"use vpp=None to disable interleaving")
        product = self.tp * self.pp * self.cp * self.dp
        if product != self.world:
            raise ConfigError(f"parallel: tp·pp·cp·dp = {self.tp}·{self.pp}·{self.cp}·{self.dp} = {product} does "
                              f"not equal the world size {self.world}; set parallel.dp=null to derive dp, or change "
                              f"parallel.tp/pp/cp/dp so their product is {self.world}")

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one model replica: tp·pp·cp."""
        return self.tp * self.pp * self.cp

    def describe(self) -> str:
        vpp = f" vpp={self.vpp}" if self.vpp else ""
        return f"tp={self.tp} pp={self.pp}{vpp} cp={self.cp} dp={self.dp} (world {self.world})"

    def mcore_kwargs(self) -> dict[str, int | None]:
        """Keyword arguments for `megatron.core.parallel_state.initialize_model_parallel`."""
        return {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                "virtual_pipeline_model_parallel_size": self.vpp, "context_parallel_size": self.cp}

    @classmethod
    def resolve(cls, parallel_cfg: ParallelConfig, world_size: int, *, num_layers: int, num_heads: int,
                num_kv_heads: int | None = None) -> ParallelDims:
        """Derive dp and check the layout against the world size and the model shape, with one-line errors."""
        tp, pp, cp, vpp = parallel_cfg.tp, parallel_cfg.pp, parallel_cfg.cp, parallel_cfg.vpp
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world size must be a positive int, got {world_size!r}; check WORLD_SIZE / the launcher")
        model_parallel = tp * pp * cp
        if parallel_cfg.dp is None:
            if world_size % model_parallel:
                raise ConfigError(f"parallel: world size {world_size} is not divisible by tp·pp·cp = "
                                  f"{tp}·{pp}·{cp} = {model_parallel}; choose parallel.tp/pp/cp whose product divides "
                                  f"{world_size}")
            dp = world_size // model_parallel
        else:
            dp = parallel_cfg.dp
        dims = cls(tp=tp, pp=pp, vpp=vpp, cp=cp, dp=dp, world=world_size)

        if num_heads % tp:
            raise ConfigError(f"parallel.tp={tp} does not divide the model's {num_heads} attention heads; "
                              f"set parallel.tp to one of {_divisors(num_heads)}")
        # Megatron splits query groups over TP, or replicates them when there are fewer groups than TP ranks.
        if num_kv_heads % tp and tp % num_kv_heads:
            raise ConfigError(f"parallel.tp={tp} does not fit the model's {num_kv_heads} key/value heads "
                              f"(Megatron needs kv_heads % tp == 0 or tp % kv_heads == 0); set parallel.tp to a "
                              f"divisor or multiple of {num_kv_heads}")
        stages = pp * (vpp or 1)
        if num_layers % stages:
            what = f"parallel.pp·vpp = {pp}·{vpp} = {stages}" if vpp else f"parallel.pp={pp}"
            raise ConfigError(f"the model's {num_layers} layers are not divisible by {what}; choose "
                              f"{'pp·vpp' if vpp else 'parallel.pp'} among {_divisors(num_layers)}")
        return dims
