"""One in-process vLLM engine driven one step at a time, for a rollout pool that keeps generating.

``LLM.generate`` runs a batch to its last token: the engine idles through the long tail of response lengths, and new
weights must wait for the batch to end. :class:`StreamingEngine` adds each batch's requests to vLLM's own scheduler
and steps it itself, so

- batches overlap: the next batch's requests join while the last one's stragglers decode (continuous batching
  across batches);
- weights can change between two steps (partial rollouts): the running requests are preempted and resumed by
  vLLM's scheduler, which recomputes their KV cache with the new weights, and every token records the weight
  version that sampled it.

Sampling is the same as :meth:`VLLMRollout.generate` (an explicit seed gives prompt i ``seed + i``): a batch that
runs alone draws exactly the tokens ``generate`` would. Each of a prompt's ``n`` samples is a request of its own
(``n = 1``, sample j seeded ``seed + i + j``: the fan-out vLLM does itself for ``n > 1``), so a sample is handed over
when it finishes rather than with its prompt's slowest sample (vLLM holds a final-only ``n > 1`` request's outputs
until all of them are done).
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from verl_mega.rollout.base import RolloutError, SamplingSpec, prompt_seed
from verl_mega.rollout.vllm_rollout import RolloutBatch, VLLMRollout, engine_stance, sampled_logprobs, sampling_params


@dataclass
class _Sequence:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""


@dataclass
class _Batch:
    spec: SamplingSpec
    num_prompts: int
    open_requests: set[str]
    sequences: dict[tuple[int, int], _Sequence] = field(default_factory=dict)  # (prompt, sample index) →


class StreamingEngine:
    """Batches of requests in one vLLM engine, stepped by the caller. Every rank of the engine must make the same
    calls in the same order (vLLM's external launcher runs one scheduler per rank on identical inputs)."""

    def __init__(self, rollout: VLLMRollout, *, deltas: bool = True) -> None:
        self.rollout = rollout
        # deltas: new tokens after every step (per-token versions, a swap mid-request); otherwise a request's tokens
        # come once, when it finishes, which spares the per-step output processing when weights cannot change
        self.deltas = deltas
        self._engine = rollout.llm.llm_engine
        self._batches: dict[Hashable, _Batch] = {}
        self._owner: dict[str, Hashable] = {}  # request id → its batch
        #: (batch, prompt, sample) of every sample that finished in the last :meth:`step`
        self.finished: list[tuple[Hashable, int, int]] = []

    @property
    def version(self) -> int:
        return self.rollout.weight_version

    @property
    def busy(self) -> bool:
        """Whether any request still generates."""
        return bool(self._owner)

    def open(self) -> list[Hashable]:
        """Batches with requests still generating, in the order they were added."""
        return [key for key, b in self._batches.items() if b.open_requests]

    def add(self, key: Hashable, prompt_ids: Sequence[Sequence[int]], spec: SamplingSpec) -> None:
        """Start generating ``spec.n`` samples for every prompt; the batch is taken back with :meth:`take`."""
        if key in self._batches:
            raise RolloutError(f"batch {key!r} is generating already")
        if self.rollout.asleep:
            raise RolloutError("the engine sleeps; wake it up before adding requests")
        batch = self._batches[key] = _Batch(spec, len(prompt_ids), set())
        for i, prompt in enumerate(prompt_ids):
            seed = None if spec.seed is None else prompt_seed(spec.seed, i, spec.n)
            params = sampling_params(spec, seed, stream=self.deltas)
            for j in range(spec.n):  # vLLM's own fan-out of an n > 1 request: n = 1, seed + j
                child = copy.copy(params)
                child.n = 1
                if seed is not None:
                    child.seed = seed + j
                request = f"{key}:{i}:{j}"
                self._engine.add_request(request, {"prompt_token_ids": [int(t) for t in prompt]}, child,
                                         **self.rollout._lora())
                batch.open_requests.add(request)
                self._owner[request] = key

    def step(self) -> list[Hashable]:
        """One engine step; returns the batches whose last request just finished."""
        self.finished = []
        if not self._owner:
            return []
        done = []
        version = self.version
        with engine_stance():
            outputs = self._engine.step()
        for out in outputs:
            key = self._owner.get(out.request_id)
            if key is None:
                continue
            batch = self._batches[key]
            prompt, sample = (int(x) for x in out.request_id.rsplit(":", 2)[1:])
            for completion in out.outputs:  # one: each request is one sample
                seq = batch.sequences.setdefault((prompt, sample), _Sequence())
                new = list(completion.token_ids)
                if not self.deltas:  # a final output holds the whole sequence
                    seq.ids, seq.versions, seq.logprobs = [], [], []
                seq.ids += new
                seq.versions += [version] * len(new)
                if batch.spec.logprobs and new:
                    seq.logprobs += sampled_logprobs(completion.logprobs, new)
                if completion.finish_reason is not None:
                    seq.finish_reason = str(completion.finish_reason)
            if out.finished:
                self.finished.append((key, prompt, sample))
                del self._owner[out.request_id]
                batch.open_requests.discard(out.request_id)
                if not batch.open_requests:
                    done.append(key)
        return done

    def completion(self, key: Hashable, prompt: int, sample: int) -> tuple[list[int], list[float]]:
        """The token ids and log-probs of one sample so far (all of them once it is in :attr:`finished`)."""
        seq = self._batches[key].sequences[(prompt, sample)]
        return seq.ids, seq.logprobs

    def take(self, key: Hashable) -> RolloutBatch:
        """A finished batch, prompt-major (like :meth:`VLLMRollout.generate`), with each token's weight version."""
        batch = self._batches[key]
        if batch.open_requests:
            raise RolloutError(f"batch {key!r} is still generating")
        del self._batches[key]
        out = RolloutBatch(prompt_index=[], token_ids=[], logprobs=[] if batch.spec.logprobs else None,
                           finish_reasons=[], weight_version=self.version, versions=[])
        for (prompt, _), seq in sorted(batch.sequences.items()):
            out.prompt_index.append(prompt)
            out.token_ids.append(seq.ids)
            out.finish_reasons.append(seq.finish_reason)
            out.versions.append(seq.versions)
            if out.logprobs is not None:
                out.logprobs.append(seq.logprobs)
        if any(out.versions):  # the oldest weights any token was sampled with
            out.weight_version = min(v[0] for v in out.versions if v)
        return out

    def weights_changed(self) -> None:
        """New weights are in the model: bump the version and drop cached prefixes computed with the old ones.
        Requests still running are preempted; vLLM's scheduler resumes them, recomputing their KV cache (prompt
        and the tokens so far) with the new weights."""
        self.rollout.weight_version += 1
        llm = self.rollout.llm
        if not self.busy:
            llm.reset_prefix_cache()
        elif "reset_running_requests" in inspect.signature(llm.reset_prefix_cache).parameters:
            if llm.reset_prefix_cache(reset_running_requests=True) is False:
                raise RolloutError("vLLM could not reset its KV cache while requests were running")
        else:
            raise RolloutError("this vLLM cannot preempt running requests at a weight update "
                               "(reset_prefix_cache has no reset_running_requests); set rollout.partial_rollouts=false")


__all__ = ["StreamingEngine"]
