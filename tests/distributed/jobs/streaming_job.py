"""Job: a vLLM engine stepped by :class:`~verl_mega.rollout.streaming.StreamingEngine`, checked against vLLM's own
``generate``. Args: --workdir DIR (two tiny models, ``a`` and ``b``: same architecture, different weights).

1. A batch stepped alone draws exactly what ``generate`` draws (sampled, n=2, explicit seed): tokens, log-probs.
2. Stepped with final-only outputs, it draws the same, and vLLM returns a request's output only once it finished.
3. Partial rollout: a greedy batch runs 8 steps under model a, the weights become model b's, and it runs on. Every
   token records its version: k under a, then b (k = 8 where the engine reports each step's token at once; 7 where
   vLLM schedules asynchronously and drops the token of the step in flight at the preemption). The first k tokens
   are a's greedy answer, the rest are b's greedy continuation of the context so far (a fresh ``generate`` under b
   from prompt + those k tokens).
Prints ``STREAMING OK`` at the end.
"""

import argparse
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", required=True)
    work = Path(ap.parse_args().workdir)

    from verl_mega.rollout.streaming import StreamingEngine
    from verl_mega.rollout.vllm_rollout import SamplingSpec, VLLMRollout, VLLMRolloutConfig

    rollout = VLLMRollout(VLLMRolloutConfig(model_path=str(work / "a"), dtype="float32", max_model_len=128,
                                            max_num_seqs=16, kv_cache_memory_bytes=64 << 20))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (int(n),), generator=g).tolist() for n in (5, 9, 7, 12)]
    stream = StreamingEngine(rollout)

    sampled = SamplingSpec(n=2, max_tokens=20, temperature=1.0, seed=11)
    want = rollout.generate(prompts, sampled)
    stream.add("sampled", prompts, sampled)
    while stream.busy:
        stream.step()
    got = stream.take("sampled")
    assert got.prompt_index == want.prompt_index and got.token_ids == want.token_ids, (got.token_ids, want.token_ids)
    assert got.logprobs == want.logprobs
    assert got.versions == [[0] * len(ids) for ids in got.token_ids] and got.weight_version == 0

    # 2. final-only outputs (the colocated trainer steps the engine so): the same draws, and vLLM hands over a
    # request once, when it finishes, instead of rebuilding every running request's output after every step
    final = StreamingEngine(rollout, deltas=False)
    engine_step, finished_flags = final._engine.step, []

    def counting_step():
        outputs = engine_step()
        finished_flags.extend(out.finished for out in outputs)
        return outputs

    final._engine.step = counting_step
    final.add("final", prompts, sampled)
    while final.busy:
        final.step()
    del final._engine.step
    got = final.take("final")
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert finished_flags and all(finished_flags), finished_flags

    greedy = SamplingSpec(n=1, max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=())
    under_a = rollout.generate(prompts, greedy)
    stream.add("partial", prompts, greedy)
    for _ in range(8):  # the first step prefills and samples the first token
        stream.step()
    rollout.load_full_weights(iter(load_file(str(work / "b" / "model.safetensors")).items()))
    stream.weights_changed()
    while stream.busy:
        stream.step()
    got = stream.take("partial")
    k = got.versions[0].count(0)
    assert k in (7, 8) and got.versions == [[0] * k + [1] * (24 - k)] * len(prompts), got.versions
    assert [ids[:k] for ids in got.token_ids] == [ids[:k] for ids in under_a.token_ids]
    contexts = [p + ids[:k] for p, ids in zip(prompts, got.token_ids)]
    under_b = rollout.generate(contexts, replace(greedy, max_tokens=24 - k))
    assert [ids[k:] for ids in got.token_ids] == under_b.token_ids, (got.token_ids, under_b.token_ids)
    assert [ids[k:] for ids in got.token_ids] != [ids[k:] for ids in under_a.token_ids]  # the weights did change
    print("STREAMING OK", flush=True)


if __name__ == "__main__":
    main()
