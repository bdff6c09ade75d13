"""Job: the Python entry point — RLTrainer.create(actor="tiny", actor_backend=vLLMBackend(...)) then trainer.step(),
saving as `python -m verl_mega.train` does (trainer.save_every=2 of 3 steps: steps 2 and 3).

Args: OUTPUT_DIR. Writes OUTPUT_DIR/api_metrics.json (rank 0)."""

import json
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    import torch.distributed as dist

    from verl_mega import RLTrainer, vLLMBackend

    trainer = RLTrainer.create(
        actor="tiny", actor_backend=vLLMBackend(gen_tp=1, kv_cache_memory_bytes=64 << 20, enforce_eager=True),
        overrides={"trainer.total_steps": 3, "trainer.output_dir": str(out), "trainer.save_every": 2,
                   "data.train_batch_size": 4, "actor.ppo_mini_batch_size": 4, "logging.tensorboard": False,
                   "trainer.profile": True})  # profile: vLLM also reports per-request stats
    trainer.enable_profiling()
    rows = [trainer.step() for _ in range(3)]
    try:
        trainer.step()
        exhausted = False
    except StopIteration:
        exhausted = True
    rank = dist.get_rank()
    trainer.close()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "api_metrics.json").write_text(json.dumps({"rows": rows, "exhausted": exhausted}))
    from verl_mega.parallel.state import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main()
