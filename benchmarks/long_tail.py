"""Long-tailed response lengths for benchmarks with random or tiny models, whose EOS says nothing.

:class:`LengthDist` gives each request a lognormal length (the straggler problem of real RL: a batch waits for its
longest sample). Run as a script it is ``python -m verl_mega.train`` with every vLLM request forced to its own
length (``max_tokens`` from the distribution, EOS ignored), keyed by the request's sampling seed, which the trainer
derives from the data position: every placement and staleness mode sees the same lengths.

    python benchmarks/long_tail.py --median 32 --sigma 1 --high 256 -- --config configs/quickstart_cpu.yaml ...
"""

from __future__ import annotations

import argparse
import math
import sys
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist


@dataclass(frozen=True)
class LengthDist:
    """Lognormal lengths (median, log-std sigma), clipped to [low, high], drawn from a hash of a key."""

    median: int
    sigma: float
    low: int
    high: int

    def of_key(self, key: str) -> int:
        u = (zlib.crc32(key.encode()) + 0.5) / 2**32
        return int(min(self.high, max(self.low, round(self.median * math.exp(self.sigma * NormalDist().inv_cdf(u))))))

    def of(self, prompt) -> int:
        """The length of a prompt's samples (its token ids are the key)."""
        return self.of_key(",".join(map(str, prompt)))


def force_lengths(lengths: LengthDist) -> None:
    """Every vLLM request of this process stops after ``lengths.of_key(its seed)`` tokens, EOS ignored."""
    from verl_mega.rollout import streaming, vllm_rollout

    plain = vllm_rollout.sampling_params

    def forced(spec, seed, *, stream=False):
        if seed is not None:
            spec = replace(spec, max_tokens=min(spec.max_tokens, lengths.of_key(str(seed))), min_tokens=0,
                           ignore_eos=True, stop_token_ids=())
        return plain(spec, seed, stream=stream)

    vllm_rollout.sampling_params = streaming.sampling_params = forced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--median", type=int, required=True)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--low", type=int, default=1)
    ap.add_argument("--high", type=int, required=True)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the arguments of verl_mega.train")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    force_lengths(LengthDist(args.median, args.sigma, args.low, args.high))
    from verl_mega import train

    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    sys.exit(train.main(rest))


if __name__ == "__main__":
    main()
