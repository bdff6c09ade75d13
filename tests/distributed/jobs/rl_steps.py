"""torchrun job: a few RL steps of a recipe at a given layout, then checks on rank 0.

Args: RECIPE OUTPUT_DIR [overrides...]
"""

import json
import math
import os
import sys
from pathlib import Path



def main() -> None:
    recipe, out, *overrides = sys.argv[1:]
    lengths = os.environ.get("VERL_MEGA_TEST_LENGTHS")  # "median,longest": long-tailed lengths, forced per request
    if lengths:
        sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
        from long_tail import LengthDist, force_lengths

        median, longest = map(int, lengths.split(","))
        force_lengths(LengthDist(median, 1.0, 1, longest))
    from verl_mega.train import main as train_main

    rc = train_main(["--config", recipe, f"trainer.output_dir={out}", *overrides])
    assert rc == 0, f"train exited with {rc}"


def check(out: str, steps: int, *, critic: bool) -> dict:
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
    for r in rows:
        for key in ("actor/pg_loss", "actor/grad_norm") + (("critic/vf_loss", "critic/grad_norm") if critic else ()):
            assert key in r and math.isfinite(r[key]), (key, r.get(key))
        # the rollout of step k ran on the weights synced after k-1 updates (+1 for the initial sync) ...
        assert r["rollout/weight_version"] == r["step"], r
        assert r["actor/version"] == r["step"] * r.get("updates_per_step", 1) or r["actor/version"] >= r["step"]
        # ... and vLLM's log-probs of its own samples equal the training model's (same weights)
        assert r["rollout/logprob_diff_max"] < 1e-4, r["rollout/logprob_diff_max"]
        # synchronous training: every sample comes from the current weights, behaviour and proximal policy agree
        assert r["rollout/staleness_mean"] == 0.0, r
        assert abs(r["rollout/behaviour_kl"]) < 1e-4 and 0.0 <= r["rollout/behaviour_kl_k3"] < 1e-4, r
    assert rows[-1]["actor/grad_norm"] > 0
    return rows[-1]


if __name__ == "__main__":
    main()
