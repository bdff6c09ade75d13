"""Mixture-of-Experts in one process (world of one, CPU): the routers' load-balancing and z-losses, their metrics
and gradients against float64 references built from HF's router logits."""

import pytest
import torch

from verl_mega.models.hf_config import arch_from_hf, load_hf_config, transformer_config
from verl_mega.models.tiny import make_tiny_hf_model, moe_fields


@pytest.fixture(scope="module")
def world():
    from verl_mega.parallel.state import init_distributed

    return init_distributed(tp=1, pp=1)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", model_type="qwen3_moe", init_std=0.1,
                              extra=moe_fields("qwen3_moe"))


def _engine(path, world, **moe):
    from megatron.core.optimizer import OptimizerConfig

    from verl_mega.engine.megatron_engine import MegatronEngine
    from verl_mega.models.build import build_model_chunks
    from verl_mega.models.hf_io import HFCheckpointReader
    from verl_mega.models.loader import load_hf_weights

    arch = arch_from_hf(load_hf_config(path))
    cfg = transformer_config(arch, use_cpu_initialization=True, **moe)
    chunks = build_model_chunks(arch, cfg, world, use_te="false")
    load_hf_weights(chunks, HFCheckpointReader(path), arch, world)
    optim = OptimizerConfig(optimizer="adam", lr=0.0, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=False,
                            params_dtype=torch.float32)
    return arch, MegatronEngine(chunks, cfg, world, optimizer_config=optim)


def test_router_aux_and_z_loss_metrics_and_gradients(world, qwen3_moe):
    """With only the routers' losses in play (the main loss is 0·logits), the logged load-balancing loss and z-loss
    equal float64 references, E/(k·T²)·Σ_e P_e·n_e and mean logsumexp², averaged over layers, and the router
    gradients equal autograd of coeff·Σ_layers(loss) through HF's own router logits."""
    from transformers import AutoModelForCausalLM

    aux, z = 0.01, 0.002
    arch, engine = _engine(qwen3_moe, world, moe_aux_loss_coeff=aux, moe_z_loss_coeff=z)
    ids = torch.randint(1, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    mb = {"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16)}
    metrics = engine.train_step([mb], lambda out, mb: (0.0 * out.float().sum(), {}))

    hf = AutoModelForCausalLM.from_pretrained(qwen3_moe, dtype=torch.float32)
    logits = [t.double() for t in hf(ids, output_router_logits=True).router_logits]
    k, e = arch.moe_topk, arch.num_experts
    lb, zl = [], []
    for layer in logits:  # [T, E] each, T in HF's (batch, seq) order: the losses are order-free
        probs = torch.softmax(layer, -1)
        counts = torch.zeros(e, dtype=torch.float64).index_add_(0, layer.topk(k, -1).indices.reshape(-1),
                                                                torch.ones(layer.shape[0] * k, dtype=torch.float64))
        t = layer.shape[0]
        lb.append(e / (k * t * t) * (probs.sum(0) * counts).sum())
        zl.append(torch.logsumexp(layer, -1).square().mean())
    assert metrics["moe_load_balancing_loss"] == pytest.approx(float(sum(lb) / len(lb)), rel=1e-6)
    assert metrics["moe_z_loss"] == pytest.approx(float(sum(zl) / len(zl)), rel=1e-6)
    (aux * sum(lb) + z * sum(zl)).backward()
    model = engine.modules[0]
    for i in range(arch.num_layers):
        got = model.decoder.layers[i].mlp.router.weight.main_grad
        want = hf.model.layers[i].mlp.gate.weight.grad
        assert want.abs().max() > 1e-4 and (got - want).abs().max().item() < 1e-6
    # the tracker is cleared after every step: a model without routers' losses logs none
    _, plain = _engine(qwen3_moe, world, moe_aux_loss_coeff=0.0)
    assert "moe_load_balancing_loss" not in plain.train_step([mb], lambda out, mb: (0.0 * out.float().sum(), {}))


def _hf_routing_hooks(hf, forced=None):
    """Capture every layer's routed experts from HF's routers ([tokens, k], tokens batch-major), or force them to
    ``forced[layer]`` with HF's own weighting of the forced experts (softmax, renormalised when the model does)."""
    captured = []
    for i, layer in enumerate(hf.model.layers):
        def hook(module, args, out, i=i):
            logits, scores, indices = out
            captured.append(indices.detach().clone())
            if forced is None:
                return out
            idx = forced[i]
            weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
            if module.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights.to(logits.dtype), idx

        layer.mlp.gate.register_forward_hook(hook)
    return captured


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe"])
def test_routing_replay_records_and_replays(world, tmp_path, model_type):
    """R2 on one rank: the recorded experts are HF's; replaying other experts gives HF's logits with its routers
    forced to them (renormalised top-k for Qwen3-MoE, raw softmax weights for Qwen2-MoE); the router-agreement
    metric equals the share of replayed experts the routers would have picked, counted over real tokens."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path / model_type, model_type=model_type, init_std=0.1,
                              extra=moe_fields(model_type))
    arch, engine = _engine(path, world, moe_aux_loss_coeff=0.0)
    engine.enable_routing_replay()
    ids = torch.randint(1, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    mb = {"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16)}
    (rec,) = engine.forward([dict(mb)], lambda out, mb: {"logits": out[..., :arch.vocab_size]}, record_routing=True)
    routed = rec["routed_experts"]
    assert routed.shape == (2, 16, arch.num_layers, arch.moe_topk) and routed.dtype == torch.int16

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    captured = _hf_routing_hooks(hf)
    with torch.no_grad():
        hf(ids)
    for layer, want in enumerate(captured):
        got = routed[:, :, layer].reshape(-1, arch.moe_topk).long()
        assert torch.equal(got.sort(-1).values, want.sort(-1).values), layer

    # replay other experts: each token's first expert moved to the next one not already chosen
    forced = routed.long().clone()
    shifted = (forced[..., 0] + 1) % arch.num_experts
    while bool((shifted.unsqueeze(-1) == forced[..., 1:]).any()):
        clash = (shifted.unsqueeze(-1) == forced[..., 1:]).any(-1)
        shifted = torch.where(clash, (shifted + 1) % arch.num_experts, shifted)
    forced[..., 0] = shifted
    valid = torch.ones(2, 16, dtype=torch.bool)
    valid[1, 10:] = False  # padding: not counted by the metric
    seen = {}

    def loss_fn(out, mb):
        seen["logits"] = out[..., :arch.vocab_size].detach().clone()
        return 0.0 * out.float().sum(), {}

    metrics = engine.train_step([{**mb, "routed_experts": forced.to(torch.int16), "routing_valid": valid}], loss_fn)
    hf_forced = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    own = _hf_routing_hooks(hf_forced, forced=[forced[:, :, i].reshape(-1, arch.moe_topk)
                                               for i in range(arch.num_layers)])
    with torch.no_grad():
        ref = hf_forced(ids).logits
        plain = hf(ids).logits
    assert (seen["logits"] - ref).abs().max().item() < 1e-5 < (ref - plain).abs().max().item()
    # what HF's routers pick themselves while the forced experts run (layer > 0 sees forced layers' outputs)
    own = torch.stack([o.view(2, 16, arch.moe_topk) for o in own], 2)
    same = (forced.unsqueeze(-1) == own.unsqueeze(-2)).any(-1).sum(-1).double()  # [b, s, layers]
    want = float((same * valid[..., None]).sum() / (valid.sum() * arch.num_layers * arch.moe_topk))
    assert metrics["router_agreement"] == pytest.approx(want, abs=1e-12) and want < 1.0
    # replaying the recorded routing on unchanged weights: full agreement, no replay state left behind
    again = engine.train_step([{**mb, "routed_experts": routed}], loss_fn)
    assert again["router_agreement"] == 1.0
    assert (seen["logits"] - plain).abs().max().item() < 1e-5
    assert "router_agreement" not in engine.train_step([dict(mb)], loss_fn)


def test_forward_replays_rollout_routing(world, qwen3_moe):
    """R3 on one rank: forward() replays given routing (every model layer → this rank's routers' layers), a -1
    (a token the rollout never ran) lets the router choose, and the agreement metric counts the known tokens."""
    arch, engine = _engine(qwen3_moe, world, moe_aux_loss_coeff=0.0)
    engine.enable_routing_replay()
    assert engine.routing.layers.tolist() == list(range(arch.num_layers))
    ids = torch.randint(1, arch.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    mb = {"input_ids": ids, "position_ids": torch.arange(16).expand(2, 16)}

    def logits(out, mb):
        return {"logits": out[..., :arch.vocab_size]}

    (rec,) = engine.forward([dict(mb)], logits, record_routing=True)
    own = rec["routed_experts"]
    assert engine.routing.local_layers(own).shape == own.shape
    # replaying the routers' own routing, with the last token of each row unknown: same logits, full agreement
    known = own.clone()
    known[:, -1] = -1
    (same,) = engine.forward([{**mb, "routed_experts": known}], logits)
    assert torch.equal(same["logits"], rec["logits"]) and engine.last_router_agreement == 1.0
    # other experts for the first 8 tokens of row 0 (layer 0 only), every other token unknown
    forced = torch.full_like(own, -1)
    forced[0, :8, 0] = (own[0, :8, 0] + 1) % arch.num_experts
    forced[0, :8, 0, 1] = torch.where(forced[0, :8, 0, 1] == forced[0, :8, 0, 0],
                                      (forced[0, :8, 0, 1] + 1) % arch.num_experts, forced[0, :8, 0, 1])
    (moved,) = engine.forward([{**mb, "routed_experts": forced}], logits)
    assert not torch.allclose(moved["logits"][0, :8], rec["logits"][0, :8])
    # row 1 routed itself everywhere (its experts' GEMMs group other tokens: equal up to rounding)
    assert (moved["logits"][1] - rec["logits"][1]).abs().max().item() < 1e-5
    hits = (forced[0, :8, 0].long().unsqueeze(-1) == own[0, :8, 0].long().unsqueeze(-2)).any(-1).sum()
    assert engine.last_router_agreement == pytest.approx(float(hits) / (8 * arch.moe_topk), abs=1e-12)
    with pytest.raises(ValueError, match="records or replays"):
        engine.forward([{**mb, "routed_experts": own}], logits, record_routing=True)


def test_aux_loss_metrics_average_over_the_moe_layers_only(world):
    """DeepSeek's first layers are dense and log no router loss: the metric is the mean over the MoE layers, as
    Megatron's own tracker reports it, not over every layer."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from verl_mega.engine.moe import aux_loss_metrics, moe_layer_count

    deepseek_like = SimpleNamespace(num_layers=4, moe_layer_freq=[0, 1, 1, 1])
    assert moe_layer_count(deepseek_like) == 3
    assert moe_layer_count(SimpleNamespace(num_layers=5, moe_layer_freq=2)) == 3  # layers 0, 2, 4
    assert moe_layer_count(SimpleNamespace(num_layers=4, moe_layer_freq=1)) == 4
    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()
    tracker["seq_load_balancing_loss"] = {"values": torch.tensor([0.0, 1.0, 1.2, 1.4])}  # layer 0 is dense
    metrics = aux_loss_metrics(world, moe_layer_count(deepseek_like), num_microbatches=2)
    tracker.clear()
    assert metrics == {"moe_seq_load_balancing_loss": pytest.approx(3.6 / 3 / 2)}
