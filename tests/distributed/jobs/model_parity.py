"""torchrun job: mcore logits (built from a tiny HF checkpoint, or a converted dist checkpoint) vs HF transformers.

Args: --tp --pp [--sp] --models qwen2,llama,qwen3 --workdir DIR [--mcore-ckpt DIR]
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--models", default="qwen2,llama,qwen3")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--mcore-ckpt", default=None)
    args = ap.parse_args()

    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from transformers import AutoModelForCausalLM

    from verl_mega.engine.logprobs import vocab_parallel_logprobs_entropy
    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import load_hf_weights
    from verl_mega.models.mcore_ckpt import load_model_dist
    from verl_mega.parallel.state import init_distributed

    groups = init_distributed(tp=args.tp, pp=args.pp, sequence_parallel=args.sp, seed=1)
    report = {}
    for mt in args.models.split(","):
        path = Path(args.workdir) / mt
        arch = arch_from_hf(load_hf_config(path))
        cfg = transformer_config(arch, tp=args.tp, pp=args.pp, sequence_parallel=args.sp,
                                 use_cpu_initialization=True)
        chunks = build_model_chunks(arch, cfg, groups, use_te="false")
        if args.mcore_ckpt:
            load_model_dist(chunks, args.mcore_ckpt, groups)
        else:
            load_hf_weights(chunks, HFCheckpointReader(path), arch, groups)
        engine = MegatronEngine(chunks, cfg, groups)
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(0, arch.vocab_size, (4, 24), generator=g)  # same on every rank
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        mbs = [{"input_ids": ids[i:i + 2], "position_ids": pos[i:i + 2]} for i in (0, 2)]

        def post(output, mb):
            full = gather_from_tensor_model_parallel_region(output, group=groups["tp"])[..., : arch.vocab_size]
            lp, ent = vocab_parallel_logprobs_entropy(output[:, :-1], mb["input_ids"][:, 1:],
                                                      vocab_size=arch.vocab_size, tp_group=groups["tp"],
                                                      with_entropy=True)
            return {"logits": full, "logprobs": lp, "entropy": ent}

        res = engine.forward(mbs, post)
        logits = torch.cat([r["logits"] for r in res])
        lp = torch.cat([r["logprobs"] for r in res])
        ent = torch.cat([r["entropy"] for r in res])
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            ref = hf(ids).logits.double()
        ref_lsm = torch.log_softmax(ref, -1)
        ref_lp = ref_lsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        ref_ent = -(ref_lsm.exp() * ref_lsm).sum(-1)[:, :-1]
        err = (logits.double() - ref).abs().max().item()
        lp_err = (lp.double() - ref_lp).abs().max().item()
        ent_err = (ent.double() - ref_ent).abs().max().item()
        report[mt] = {"logits_max_abs": err, "logprob_max_abs": lp_err, "entropy_max_abs": ent_err}
        assert err < 1e-5, f"{mt}: logits differ from HF by {err}"
        assert lp_err < 1e-5 and ent_err < 1e-5, f"{mt}: logprob {lp_err} / entropy {ent_err} differ from float64"
    if dist.get_rank() == 0:
        print("PARITY " + json.dumps({"tp": args.tp, "pp": args.pp, "sp": args.sp, **report}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
