"""Checkpoints of the full training state, written atomically, and resume.

Layout under ``<trainer.output_dir>/checkpoints/``::

    step_000010/
        actor/           mcore dist checkpoint: model + optimizer state (both reshard on load, see optim_state),
                         and verl_mega_model.json, so that tools/convert_mcore_to_hf.py converts it
        critic/          same, when a critic runs
        rank_00000.pt    per-rank RNG states (torch, cuda, python, numpy, mcore tracker)
        trainer.json     step, data-loader position, KL controller, LR schedulers, engine versions, layout,
                         optimizer format, config
        COMPLETE         written last, inside the temp dir, before the rename
    latest               name of the newest complete checkpoint (replaced atomically, after the rename)

Every rank writes into ``.tmp-step_N``; after a barrier rank 0 marks it COMPLETE and renames it. A directory
without COMPLETE is never loaded, so a kill at any point leaves either the previous or the new checkpoint usable.
A checkpoint is deleted (pruning) by renaming it to ``.trash-step_N`` first, so a kill midway never leaves a partial
``step_N``; the next save removes every ``.tmp-*`` and ``.trash-*`` left behind.
With ``checkpoint.async_save`` mcore's background writer writes the shards while training goes on; the same
finalisation runs once every rank has finished (checked each step, awaited before the next save and at the end).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from verl_mega.checkpoint import optim_state
from verl_mega.checkpoint.integrity import (SCHEMA, BrokenCheckpointError, ResumeError, checkpoint_files,
                                            block_items, find_checkpoint, hash_blocks, manifest_entries,
                                            verify_checkpoint, write_manifest)
from verl_mega.config import to_dict
from verl_mega.parallel.launch_env import restart_counters
from verl_mega.parallel.state import pool_group

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

log = logging.getLogger("verl_mega.checkpoint")


__all__ = ["CheckpointManager", "NonFiniteError", "ResumeError", "BrokenCheckpointError", "find_checkpoint",
           "fault_point"]


class NonFiniteError(RuntimeError):
    pass


FAULT_ENV = "VERL_MEGA_FAULT_INJECT"
TMP_PREFIX, TRASH_PREFIX = ".tmp-", ".trash-"  # hidden names: glob("step_*") and resume never see them
_NEARLY_FULL = 64 << 20  # bytes left on the disk after a failed save below which the disk is named as the cause


def fault_point(phase: str, step: int) -> None:
    """Crash-consistency testing hook: ``VERL_MEGA_FAULT_INJECT=<phase>@<step>`` SIGKILLs this process at that
    point (phases: step_start, save_begin, save_shards_written, save_renamed, save_done); with ``/first`` appended,
    only in the job's first attempt (no launcher has restarted it), so that a restarted job runs on. Inert
    otherwise."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    point, _, attempt = spec.partition("/")
    if attempt not in ("", "first"):
        raise ValueError(f"{FAULT_ENV}={spec!r}: write <phase>@<step> or <phase>@<step>/first")
    if point == f"{phase}@{step}" and (not attempt or not any(restart_counters().values())):
        os.kill(os.getpid(), 9)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier(group=pool_group())


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _layout(engine) -> dict[str, int]:
    return {kind: engine.groups.size(kind) for kind in ("tp", "pp", "dp")}


def async_save_request(sharded_sd: dict, checkpoint_dir: Path) -> "AsyncRequest":
    """mcore's async save of one dist checkpoint: writes the common part now and returns the AsyncRequest that
    writes the shards (schedule it on an AsyncCallsQueue). CPU tensors are copied first: mcore stages tensors for
    the background writer with `tensor.to("cpu")`, a copy on GPU but a no-op for CPU tensors, which training would
    keep updating while they are written; the copy makes the checkpoint a snapshot of this step."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    for value in nested_values(sharded_sd):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and isinstance(value.data, torch.Tensor) \
                and value.data.device.type == "cpu":
            value.data = value.data.detach().clone()
    return dist_checkpointing.save(sharded_sd, str(checkpoint_dir), async_sharded_save=True,
                                   preprocess_common_before_consistancy_check=optim_state.common_for_consistency_check)


def discard(path: Path) -> None:
    """Delete checkpoint directory `path` so that no partial `step_N` is ever visible: renamed (atomically) to a
    hidden ``.trash-`` name first, then removed. A kill midway leaves only the hidden name (removed at the next
    save); an rmtree in place could leave COMPLETE and trainer.json without the manifest, a visible step_N that
    resume=auto would have to try and refuse."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def write_latest(root: Path, name: str) -> None:
    """Point ``root/latest`` at checkpoint `name`, atomically (a reader sees the old name or the new one)."""
    tmp = root / ".latest.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / "latest")


def remove_leftovers(root: Path) -> list[str]:
    """Remove what failed or killed saves (``.tmp-step_*``) and deletions (``.trash-*``) left under `root` (rank 0,
    with no save in flight); returns their names."""
    found = sorted(p for pattern in (f"{TMP_PREFIX}step_*", f"{TRASH_PREFIX}*") for p in root.glob(pattern))
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return [p.name for p in found]


def _flat(model_sd: dict) -> dict:
    """The model part as the optimizer expects it: one dict over all (virtual-pipeline) chunks."""
    return {k: v for d in model_sd.values() for k, v in d.items()} if len(model_sd) > 1 else model_sd["model"]


class CheckpointManager:
    def __init__(self, cfg, *, engines: dict[str, Any], loader, kl_ctrl, hf_source: Path | None = None,
                 arch=None, tokenizer=None) -> None:
        self.cfg = cfg
        # the export's tokenizer is the run's (model.tokenizer_path, model.chat_template), not model.path's files
        self.hf_source, self.arch, self.tokenizer = hf_source, arch, tokenizer
        self.root = Path(cfg.trainer.output_dir) / "checkpoints"
        self.engines = {k: v for k, v in engines.items() if v is not None}
        self.loader = loader
        self.kl_ctrl = kl_ctrl
        self._nonfinite = 0
        self.last_saved = 0  # the newest step saved or resumed from (its checkpoint may still be in flight)
        self._async_queue = None
        if cfg.checkpoint.async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            # mcore's forking caller: the persistent one spawns a worker that needs a CUDA device
            self._async_queue = AsyncCallsQueue(persistent=False)

    # ------------------------------------------------------------------ save
    def should_save(self, step: int, total_steps: int) -> bool:
        """Whether `step` ends with a save. Called once per step on every rank, so it is also where a finished
        background save gets finalised (see poll)."""
        self.poll()
        every = self.cfg.trainer.save_every
        return bool(every) and (step % every == 0 or step == total_steps)

    def poll(self, blocking: bool = False) -> None:
        """Finalise background saves that every rank has finished writing (collective: call on all ranks at the same
        point). blocking=True waits for the pending ones first."""
        if self._async_queue is not None:
            self._async_queue.maybe_finalize_async_calls(blocking=blocking)

    def save_last(self, step: int) -> None:
        """The run ends at `step`, before trainer.total_steps (the data ran out first): save it, as should_save
        does for the last step, unless it was saved (collective)."""
        if self.cfg.trainer.save_every and step > self.last_saved:
            self.save(step)

    def close(self) -> None:
        """Wait until a pending background save is complete and visible (collective)."""
        if self._async_queue is not None:
            self._async_queue.close()

    def save(self, step: int) -> Path:
        """Write the full training state of `step`. With checkpoint.async_save the shards are written in the
        background and the checkpoint becomes visible (COMPLETE, rename, `latest`) at a later poll/save/close.
        A full disk is reported as an OSError naming the checkpoint directory."""
        try:
            path = self._save(step)
            self.last_saved = step
            return path
        except BaseException as exc:  # torch's CheckpointException (per-rank write failures) is a BaseException
            from verl_mega.checkpoint.safe_load import disk_full_error

            tmp = str(self.root / f"{TMP_PREFIX}step_{step:06d}")
            full = disk_full_error(exc)
            # torch's zip writer reports a full disk without its errno ("unexpected pos …"): look at the disk itself
            if full is None and not isinstance(exc, (KeyboardInterrupt, SystemExit)) \
                    and shutil.disk_usage(self.root).free < _NEARLY_FULL:
                full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if full is not None:
                raise OSError(full.errno, full.strerror, full.filename or tmp) from exc
            raise

    def _save(self, step: int) -> Path:
        from megatron.core import dist_checkpointing

        from verl_mega.checkpoint.mcore import model_sharded_state_dict

        self.poll(blocking=True)  # one save in flight at a time: the previous one is finalised first
        fault_point("save_begin", step)
        name = f"step_{step:06d}"
        tmp = self.root / f"{TMP_PREFIX}{name}"
        if _rank() == 0:
            left = remove_leftovers(self.root)  # nothing is in flight now (polled above)
            if left:
                log.info("removed what failed or interrupted saves and deletions left: %s", ", ".join(left))
            tmp.mkdir(parents=True)
        _barrier()
        requests = []
        check = optim_state.common_for_consistency_check
        for role, engine in self.engines.items():
            model_sd = model_sharded_state_dict(engine.chunks, engine.groups)
            sd = dict(model_sd)
            if self.cfg.checkpoint.save_optimizer:
                sd["optimizer"] = optim_state.sharded_state_dict(engine.optimizer, _flat(model_sd))
            if _rank() == 0:
                (tmp / role).mkdir(exist_ok=True)
            _barrier()
            if self._async_queue is None:
                dist_checkpointing.save(sd, str(tmp / role), preprocess_common_before_consistancy_check=check)
            else:
                requests.append(async_save_request(sd, tmp / role))
        if self.cfg.checkpoint.export_hf:
            self._export_hf(tmp / "hf")  # reads the live weights, so it runs now; visible only with the rename
        torch.save(rng_state(), tmp / f"rank_{_rank():05d}.pt")
        # captured now: loader, KL controller and schedulers move on while the shards are written
        trainer_json = json.dumps(self._trainer_state(step), indent=1, default=str) if _rank() == 0 else ""
        finalize = functools.partial(self._finalize, step, tmp, trainer_json)
        if not requests:
            _barrier()
            finalize()
            return self.root / name
        requests[-1].add_finalize_fn(finalize)  # mcore runs it once every rank finished writing every request
        for request in requests:
            self._async_queue.schedule_async_request(request)
        return self.root / name

    def _trainer_state(self, step: int) -> dict[str, Any]:
        return {"schema": SCHEMA, "step": step, "loader": self.loader.state_dict(),
                "kl_ctrl": self.kl_ctrl.state_dict(),
                "engines": {r: {"version": e.version, "scheduler": e.scheduler.state_dict()}
                            for r, e in self.engines.items()},
                "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                "layout": _layout(self.engines["actor"]), "optimizer_format": optim_state.FORMAT,
                "config": to_dict(self.cfg)}

    def _finalize(self, step: int, tmp: Path, trainer_json: str) -> None:
        """All shards of `tmp` are on disk on every rank (collective): rank 0 writes trainer.json, the ranks hash a
        share of the files each, rank 0 writes the manifest, marks the directory COMPLETE and makes it visible."""
        fault_point("save_shards_written", step)
        final = self.root / tmp.name.removeprefix(TMP_PREFIX)
        if _rank() == 0:
            (tmp / "trainer.json").write_text(trainer_json)
            # after the shards: mcore takes a directory that holds files already for a broken save and says so
            if "actor" in self.engines:
                self._write_model_meta(tmp / "actor", self.engines["actor"])
        _barrier()
        entries = self._digests(tmp)
        if _rank() == 0:
            write_manifest(tmp, entries)
            (tmp / "COMPLETE").write_text("ok\n")
            if final.exists():
                discard(final)
            os.replace(tmp, final)
            fault_point("save_renamed", step)
            write_latest(self.root, final.name)
            self._prune(final)
            log.info("checkpoint %s complete", final)
        _barrier()
        fault_point("save_done", step)

    @staticmethod
    def _digests(tmp: Path) -> dict[str, dict[str, Any]]:
        """Size and block digests of every file of `tmp` (collective): every world_size-th 64 MiB block of the
        one listing is hashed on this rank, on its threads, so a large shard is hashed by many cores at once."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        listing = [None]
        if _rank() == 0:
            listing = [{n: (tmp / n).stat().st_size for n in checkpoint_files(tmp)}]
        if world > 1:  # one listing, so that every block is hashed exactly once
            dist.broadcast_object_list(listing, src=0, group=pool_group())
        sizes = listing[0]
        begin = time.perf_counter()
        mine = block_items(sizes)[_rank()::world]
        parts = [hash_blocks(tmp, mine)]
        if world > 1:
            gathered: list = [None] * world
            dist.all_gather_object(gathered, parts[0], group=pool_group())
            parts = gathered
        log.debug("checkpoint %s: SHA-256 of %d blocks on this rank in %.3f s", tmp.name, len(mine),
                  time.perf_counter() - begin)
        return manifest_entries(tmp, sizes, {k: v for part in parts for k, v in part.items()})

    def _write_model_meta(self, role_dir: Path, engine) -> None:
        """The converters' meta file (checkpoint.mcore.write_model_meta), so that tools/convert_mcore_to_hf.py turns
        the actor directory into an HF model. Only the actor's: the critic is a value model, with no HF causal-LM
        form."""
        if self.hf_source is None:
            return
        from verl_mega.checkpoint.mcore import write_model_meta
        from verl_mega.models.hf_config import load_hf_config
        from verl_mega.models.loader import unwrap
        from verl_mega.models.lora import has_adapters

        write_model_meta(role_dir, load_hf_config(self.hf_source), self.cfg.model.dtype,
                         padded_vocab_size=unwrap(engine.chunks[0]).vocab_size,
                         layout={kind: engine.groups.size(kind) for kind in ("tp", "pp", "ep", "etp")},
                         adapters_only=has_adapters(engine.modules))

    def _export_hf(self, out: Path) -> None:
        """The actor as HF safetensors + config + tokenizer (collective over the model-parallel ranks); with LoRA
        adapters that is the merged model, and ``hf_adapter/`` beside it holds the PEFT adapter."""
        from verl_mega.models.hf_io import config_with_dtype, write_hf_checkpoint
        from verl_mega.models.lora import adapter_tensors, has_adapters, lora_spec_of, write_peft_adapter
        from verl_mega.models.loader import iter_hf_tensors
        from verl_mega.checkpoint.mcore import TOKENIZER_FILES

        actor = self.engines["actor"]
        # LoRA: the PEFT adapter (hf_adapter/) beside the merged model (hf/); gathered first, on every rank
        adapters = adapter_tensors(actor.modules, actor.groups) if has_adapters(actor.modules) else None
        stream = iter_hf_tensors(actor.chunks, self.arch, actor.groups)
        if _rank() != 0:
            for _ in stream:  # other ranks take part in the gathers
                pass
            return
        out.mkdir(parents=True)
        written = write_hf_checkpoint(out, ((k, v.cpu()) for k, v in stream))
        if self.hf_source is not None and (self.hf_source / "config.json").exists():  # saying the dtype written
            hf_cfg = json.loads((self.hf_source / "config.json").read_text())
            (out / "config.json").write_text(json.dumps(config_with_dtype(hf_cfg, written), indent=2))
        for name in () if self.tokenizer is not None else TOKENIZER_FILES:
            if self.hf_source is not None and (self.hf_source / name).exists():
                shutil.copy2(self.hf_source / name, out / name)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(out))
        if adapters is not None:
            write_peft_adapter(out.parent / "hf_adapter", adapters, lora_spec_of(actor.modules),
                               str(self.hf_source) if self.hf_source is not None else None)

    def _prune(self, final: Path) -> None:
        """Keep the newest checkpoint.keep_last complete checkpoints, counting from `final`, the one just written:
        it always stays, and so does any newer one (an abandoned run's, set aside at resume; never this save's to
        delete)."""
        keep = self.cfg.checkpoint.keep_last
        older = sorted(p for p in self.root.glob("step_*") if (p / "COMPLETE").exists() and p.name < final.name)
        for old in older[:max(0, len(older) - keep + 1)] if keep else []:
            try:
                discard(old)
            except OSError as exc:  # the new checkpoint is complete: a failed deletion must not fail the save
                log.warning("checkpoint %s could not be removed (%s); it stays", old, exc)

    # ------------------------------------------------------------------ resume
    def maybe_resume(self, path: Path | None | str = "select") -> int:
        """Load a checkpoint; returns the step it holds (0 when starting fresh). ``path``: the checkpoint that
        find_checkpoint + verify_checkpoint chose (build_job does that before building); by default they run here
        (collective)."""
        if path == "select":
            path = verify_checkpoint(self.cfg, find_checkpoint(self.cfg))
        if path is None:
            return 0
        from verl_mega.models.loader import unwrap
        from verl_mega.checkpoint.mcore import check_adapters_match, load_model_state, model_sharded_state_dict
        from verl_mega.checkpoint.safe_load import load_dist, weights_only_load
        from verl_mega.checkpoint.integrity import read_trainer_state

        path = Path(path)
        state = read_trainer_state(path)
        has_optimizer = state["config"].get("checkpoint", {}).get("save_optimizer", True)
        for role, engine in self.engines.items():
            model_sd = model_sharded_state_dict(engine.chunks, engine.groups)
            check_adapters_match(model_sd, path / role)
            sd = dict(model_sd)
            fmt = state.get("optimizer_format", optim_state.LEGACY_FORMAT)
            if self.cfg.checkpoint.save_optimizer and not has_optimizer:
                log.warning("resume: %s was saved without optimizer state (checkpoint.save_optimizer=false); the "
                            "weights load, the optimizer state restarts", path.name)
            elif self.cfg.checkpoint.save_optimizer:
                if fmt in optim_state.RESHARDABLE or state.get("layout") == _layout(engine):
                    sd["optimizer"] = optim_state.sharded_state_dict(engine.optimizer, _flat(model_sd),
                                                                     is_loading=True, fmt=fmt)
                else:
                    log.warning("resume: %s holds %s optimizer state in the %s form, which loads only at its own "
                                "layout %s (now %s); the weights are resharded, the optimizer state restarts",
                                path.name, role, fmt, state.get("layout"), _layout(engine))
            loaded = load_dist(sd, path / role)
            for i, c in enumerate(engine.chunks):
                load_model_state(unwrap(c), loaded["model" if len(engine.chunks) == 1 else f"model{i}"])
            if "optimizer" in sd:  # `loaded` can hold the optimizer's common part even when sd asked for none
                optim_state.load(engine.optimizer, loaded["optimizer"])
            engine.version = state["engines"][role]["version"]
            engine.scheduler.load_state_dict(state["engines"][role]["scheduler"])
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank_file = path / f"rank_{_rank():05d}.pt"
        if state["world_size"] == world:
            set_rng_state(weights_only_load(rank_file, what=str(rank_file)))
        else:
            log.warning("resume: %s was saved by %d ranks, this run has %d; RNG streams restart from the seed "
                        "(results will differ from an uninterrupted run)", path.name, state["world_size"], world)
        log.info("resumed from %s (step %d)", path, state["step"])
        self.last_saved = int(state["step"])
        return self.last_saved

    # ------------------------------------------------------------------ guards
    def guard_nonfinite(self, metrics: dict[str, float], step: int) -> None:
        bad = [k for k in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
               if k in metrics and not math.isfinite(metrics[k])]
        if not bad:
            self._nonfinite = 0
            return
        self._nonfinite += 1
        log.warning("step %d: non-finite %s; the optimizer step was skipped (%d in a row)", step, bad, self._nonfinite)
        if self._nonfinite >= self.cfg.trainer.max_consecutive_nonfinite:
            raise NonFiniteError(f"step {step}: {self._nonfinite} consecutive steps with non-finite {bad}; lower the "
                                 "learning rate or check the reward function, then resume from the last checkpoint")
