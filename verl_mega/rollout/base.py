"""What every rollout shares: the :class:`Rollout` protocol the trainer drives, the types that cross it, and the
table of stop reasons that a rollout pool of its own passes on to the trainer. Implementations: the colocated
:class:`~verl_mega.rollout.colocated.ColocatedRollout` (vLLM on the training ranks) and the disaggregated
:class:`~verl_mega.rollout.disaggregated.RemoteRollout` (vLLM on a pool of its own)."""

from __future__ import annotations

import signal

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import torch

SEED_MODULUS = 2**31 - 1


def prompt_seed(seed: int, prompt: int, n: int) -> int:
    """The seed of prompt ``prompt`` of a batch whose base seed is ``seed``: sample j of it draws with this + j (as
    vLLM fans an n > 1 request out), so with a stride of n no two samples of a batch share a random stream (a
    stride of 1 gave prompt i's sample j the stream of prompt i + 1's sample j - 1)."""
    return (seed + prompt * n) % SEED_MODULUS
#: why a run stops, by severity: every rank's reasons are combined by taking the most severe (an all-reduce of the
#: index); a rollout pool of its own passes on the signals its ranks received by name
STOP_REASONS = ("", "trainer.time_limit_s", "SIGINT", "SIGTERM")
#: the signals that request a stop, and the reason each stands for: SIGUSR1 is how launch/mpirun.sh passes a SIGTERM
#: on (Open MPI ends the ranks at once on a TERM)
STOP_SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGUSR1: "SIGTERM", signal.SIGINT: "SIGINT"}


class RolloutError(RuntimeError):
    """The rollout engine cannot start or run; the message names the cause and the fix."""


def engine_share(items: Sequence[Any], engine: int, num_engines: int) -> Sequence[Any]:
    """Engine ``engine``'s contiguous share of a global list, out of ``num_engines`` engines."""
    n = len(items)
    return items[engine * n // num_engines:(engine + 1) * n // num_engines]


@dataclass(frozen=True, kw_only=True)
class SamplingSpec:
    """How to sample. ``temperature=0`` is greedy; ``top_k=0`` and ``top_p=1`` disable those filters.

    ``seed=None`` samples from a stream shared by the engine's ranks, fresh for every call and engine;
    an explicit seed gives prompt i the seed ``seed + i`` (reproducible, through vLLM's per-request generators).
    """

    n: int = 1
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        if self.n <= 0 or self.max_tokens <= 0:
            raise ValueError(f"sampling: n={self.n} and max_tokens={self.max_tokens} must be positive")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(
                f"sampling: temperature={self.temperature} must be ≥ 0, top_p={self.top_p} in (0, 1], "
                f"top_k={self.top_k} ≥ 0 (0 disables)"
            )


class Sample(NamedTuple):
    prompt: int  # index in the global prompt batch
    ids: list[int]  # the response: generated tokens and, in multi-turn episodes, the tools' answers
    logprobs: list[float]  # of the sampled tokens (0 for a tool's tokens)
    mask: list[int] | None = None  # multi-turn: 1 where the policy wrote the token, 0 for a tool's answer
    #: routing replay R3: the experts each prompt and response token was routed to in the rollout,
    #: ``[tokens, model layers, top-k]`` int16 (-1: unknown, e.g. the last token, which vLLM never runs)
    routing: torch.Tensor | None = None
    #: partial rollouts: the weight version that sampled each response token (None: all by the batch's version)
    versions: list[int] | None = None


@dataclass
class Generated:
    """One engine's samples for one sampling spec, prompt-major, with the prompt indices of the global batch; the
    engine's weight version, and counts (multi-turn: episodes, turns, tool_calls, tool_errors). ``engine``: which
    engine made them; ``leader``: whether this rank is the engine's first (every rank of an engine holds the same
    samples; :mod:`verl_mega.trainer.transfer` moves them to the ranks that train on them)."""

    samples: list[Sample]
    version: int
    engine: int = 0
    leader: bool = True
    counts: dict[str, float] = field(default_factory=dict)


#: one generation request: the global prompt batch (token ids) and its sampling specs
Request = tuple[Sequence[Sequence[int]], Sequence[SamplingSpec]]


class Rollout(Protocol):
    """What the trainer needs from a rollout, wherever its engines run.

    - ``generate`` takes the global prompt batch and returns, on every rank of an engine, that engine's share of
      the samples, one :class:`Generated` per spec. ``on_finished(samples, still_generating)``: called as samples
      finish, each as (its index in its prompt's group, the sample), while the engine still generates the rest (one
      spec; a rollout that cannot stream refuses it).
    - ``prefetch``: the asynchronous look-ahead. The requests a later ``generate`` will ask for, in order, sent
      now so that a rollout pool of its own generates them while the trainer trains (a no-op when colocated).
    - ``weight_version``: the weight updates it has received; ``stop_requested``: a signal (``SIGTERM``,
      ``SIGINT``) that ranks the trainer does not share received, '' when none.
    """

    stop_requested: str

    @property
    def weight_version(self) -> int: ...
    def generate(self, prompt_ids: Sequence[Sequence[int]], specs: Sequence[SamplingSpec], *,
                 on_finished: Callable[[list[tuple[int, Sample]], int], None] | None = None) -> list[Generated]: ...
    def prefetch(self, requests: Sequence[Request]) -> None: ...
    def update_weights(self) -> dict[str, float]: ...  # new weights from the trainer (collective)
    def release_memory(self) -> None: ...
    def restore_memory(self) -> None: ...
    def shutdown(self) -> None: ...
