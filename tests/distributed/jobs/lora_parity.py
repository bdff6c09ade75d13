"""LoRA at this rank's layout (called by jobs/model_parity.py with ``--lora``, inside its runs): the same adapters
(whole tensors from a fixed generator, sliced to each rank's shards) on qwen2 (q/k/v biases) and llama (tied
embeddings); logits of the engine's forward and the adapters' gradients after one lr-0 step of a log-likelihood
loss, against HF transformers + ``peft`` (fp32) and saved for test_model_parity.py to compare layouts."""

from pathlib import Path

import torch
import torch.distributed as dist


def _adapters(arch, spec) -> dict[str, torch.Tensor]:
    """Whole adapters of every layer and target, as PEFT names them; B non-zero (a trained adapter)."""
    from verl_mega.models.lora import HF_MODULE

    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    dims = {"q_proj": (h, arch.num_heads * d), "k_proj": (h, arch.num_kv_heads * d),
            "v_proj": (h, arch.num_kv_heads * d), "o_proj": (arch.num_heads * d, h), "gate_proj": (h, f),
            "up_proj": (h, f), "down_proj": (f, h)}
    g = torch.Generator().manual_seed(11)
    out = {}
    for i in range(arch.num_layers):
        for part in spec.targets:
            fan_in, fan_out = dims[part]
            name = f"base_model.model.model.layers.{i}.{HF_MODULE[part]}.{part}"
            out[f"{name}.lora_A.weight"] = torch.randn(spec.rank, fan_in, generator=g) / fan_in ** 0.5
            out[f"{name}.lora_B.weight"] = torch.randn(fan_out, spec.rank, generator=g) * 0.05
    return out


def check_lora(groups, workdir: str, tag: str, models=("qwen2", "llama")) -> dict:
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models import lora as L
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import load_hf_weights
    from verl_mega.trainer.roles import PolicyRole

    pool = groups.pool
    spec = L.LoRASpec(rank=4, alpha=8.0)
    report, saved = {}, {}
    for mt in models:
        path = Path(workdir) / mt
        arch = arch_from_hf(load_hf_config(path))
        cfg = transformer_config(arch, tp=pool.tp, pp=pool.pp, sequence_parallel=pool.sequence_parallel,
                                 use_cpu_initialization=True)
        chunks = build_model_chunks(arch, cfg, groups, use_te="false", lora=spec)
        load_hf_weights(chunks, HFCheckpointReader(path), arch, groups)
        adapters = _adapters(arch, spec)
        assert L.load_adapter_tensors(chunks, adapters) == len(adapters) // arch.num_layers * \
            sum(len(c.decoder.layers) for c in chunks)
        optim = OptimizerConfig(optimizer="adam", lr=0.0, weight_decay=0.0, clip_grad=0.0,
                                use_distributed_optimizer=False, params_dtype=torch.float32)
        engine = MegatronEngine(chunks, cfg, groups, optimizer_config=optim)
        ids = torch.randint(1, arch.vocab_size, (4, 24), generator=torch.Generator().manual_seed(7))
        pos = torch.arange(ids.shape[1]).expand_as(ids)

        def post(output, mb, arch=arch):
            full = gather_from_tensor_model_parallel_region(output, group=groups["tp"])
            return {"logits": full[..., :arch.vocab_size]}

        logits = torch.cat([r["logits"] for r in engine.forward(
            [{"input_ids": ids[i:i + 2], "position_ids": pos[i:i + 2]} for i in (0, 2)], post)])
        # one lr-0 step of the mean log-likelihood: each data-parallel rank its rows, as the actor trains
        role = PolicyRole(engine, vocab_size=arch.vocab_size, micro_batch_size=1, temperature=1.0)
        count = ids.numel() - ids.shape[0]
        mine = torch.arange(ids.shape[0]).chunk(engine.dp_size)[engine.dp_rank].tolist()
        mbs = [{"input_ids": ids[i:i + 1], "position_ids": pos[i:i + 1], "prompt_len": torch.ones(1, dtype=torch.long),
                "response_mask": torch.ones(1, ids.shape[1] - 1)} for i in mine]
        scale = engine.dp_size * len(mbs)

        def loss_fn(output, mb, role=role, count=count, scale=scale):
            lp, _ = role._logprobs(output, mb, False)
            return -lp.sum() / count * scale, {}

        engine.train_step(mbs, loss_fn)
        grads = L.adapter_tensors(chunks, groups, attr="main_grad")
        trained = L.adapter_tensors(chunks, groups)
        assert all(torch.equal(trained[k], adapters[k].float()) for k in adapters)  # lr 0: unchanged

        # the reference: HF transformers with the same adapter through peft
        hf = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                            LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets)))
        result = set_peft_model_state_dict(hf, adapters)
        assert not [k for k in result.missing_keys if "lora_" in k] and not result.unexpected_keys, result
        out = hf(ids).logits
        (-torch.log_softmax(out.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).sum() / count).backward()
        hf_grads = {n.replace(".default", ""): p.grad for n, p in hf.named_parameters() if "lora_" in n}
        assert set(hf_grads) == set(grads), sorted(set(hf_grads) ^ set(grads))[:3]
        err = (logits.double() - out.detach().double()).abs().max().item()
        grad_err = max((grads[k].double() - hf_grads[k].double()).abs().max().item() for k in grads)
        report[mt] = {"logits_max_abs": err, "grad_max_abs": grad_err}
        assert err < 1e-5 and grad_err < 1e-5, (mt, report[mt])
        saved[mt] = {"logits": logits, "grads": grads}
    if dist.get_rank() == 0:
        torch.save(saved, Path(workdir) / f"lora-{tag}.pt")
    return report
