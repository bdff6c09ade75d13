"""FP8 rollout weights: the quantizer against float64 arithmetic, the quantized slices of every generation block
against the full HF tensors, the coverage proof of a sync, and the config keys.

The e4m3 reference here is written from the format's definition (3 mantissa bits, exponent bias 7, subnormals below
2^-6, largest finite 448, round to nearest even), not with torch's float8 cast."""

from __future__ import annotations

import pytest
import torch
from test_hybrid_convert import COMBOS, _arch, _hf, _reader, _vllm_slice

from verl_mega.hybrid.convert import block_copies, block_shape, vllm_name, write_block
from verl_mega.hybrid.fp8 import FP8_DTYPE, Fp8Rows
from verl_mega.hybrid.producer import check_quantized_coverage, written_names
from verl_mega.hybrid.transport import InPlaceTransport, WeightSyncError
from verl_mega.models.weights import hf_to_mcore_shard, rule_for


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """float64 → the nearest float8 e4m3fn value (ties to even), saturating at ±448; in float64."""
    x = x.double()
    ax = x.abs().clamp(max=448.0)
    _, exp = torch.frexp(ax)  # ax = m · 2^exp, m in [0.5, 1): floor(log2 ax) = exp - 1
    ulp = torch.where(ax >= 2.0 ** -6, torch.exp2((exp - 1 - 3).double()), torch.full_like(ax, 2.0 ** -9))
    return torch.sign(x) * torch.round(ax / ulp) * ulp  # torch.round: half to even


def e4m3_ulp(y: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3 values at |y| (float64)."""
    ay = y.abs().double()
    _, exp = torch.frexp(ay)
    return torch.where(ay >= 2.0 ** -6, torch.exp2((exp - 1 - 3).double()), torch.full_like(ay, 2.0 ** -9))


def assert_quantized(codes: torch.Tensor, scale: torch.Tensor, w: torch.Tensor, where: str = "") -> None:
    """``codes`` · ``scale`` is the per-row e4m3 quantization of ``w`` (float64 reference): scales are amax/448 (1 for
    an all-zero row), codes the nearest e4m3 values of w/scale (a code may differ by one e4m3 step where w/scale sits
    on a tie after the code's fp32 division: at most 1e-3 of them), and the dequantized error is within half a step."""
    w64, s64 = w.double().reshape(-1, w.shape[-1]), scale.double().reshape(-1, 1)
    q64 = codes.double().reshape(-1, w.shape[-1])
    amax = w64.abs().amax(dim=1, keepdim=True)
    want_scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    assert torch.allclose(s64, want_scale, rtol=2.0 ** -23, atol=0), f"{where}: scales are not amax/448"
    assert torch.isfinite(q64).all(), f"{where}: NaN codes"
    ref = e4m3_round(w64 / s64)
    off = (q64 - ref).abs()
    assert (off <= e4m3_ulp(ref) * (1 + 1e-12)).all(), f"{where}: codes off by more than one e4m3 step"
    assert (off > 0).double().mean() <= 1e-3, f"{where}: {(off > 0).sum()} codes differ from round-to-nearest"
    err = (q64 * s64 - w64).abs()
    bound = torch.maximum(w64.abs() * 2.0 ** -4, s64 * 2.0 ** -10)  # half a step: 3 mantissa bits, subnormals 2^-9
    assert (err <= bound * (1 + 1e-6) + s64 * 2.0 ** -9 * (off > 0)).all(), f"{where}: error beyond half a step"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizer_against_float64(dtype):
    g = torch.Generator().manual_seed(0)
    rows, cols = 64, 96
    w = torch.randn(rows, cols, generator=g, dtype=torch.float64) * torch.exp(3 * torch.randn(rows, 1, generator=g))
    w[3] = 0.0  # an all-zero row
    w[5, 7] = 1e3 * w[5].abs().max()  # one outlier: the rest of its row falls into e4m3's subnormals
    w[9] *= 1e-30  # tiny magnitudes: the scale adapts, codes stay normal
    w[11, :] = -2.5  # a constant row: every code is -448
    w = w.to(dtype)
    dst = Fp8Rows(torch.empty(rows, cols, dtype=FP8_DTYPE), torch.empty(rows, 1))
    dst.copy_(w)
    assert_quantized(dst.weight, dst.scale, w, str(dtype))
    assert dst.scale[3].item() == 1.0 and (dst.weight[3].float() == 0).all()
    assert (dst.weight[11].float() == -448).all()
    assert dst.weight[5, 7].float().item() == 448.0
    # the largest element of every row dequantizes to itself (to fp32 rounding of amax/448 · 448)
    deq = dst.weight.double() * dst.scale.double()
    amax = w.double().abs().amax(dim=1)
    assert torch.allclose(deq.abs().amax(dim=1), amax, rtol=2.0 ** -22)


def test_quantizer_chunks_long_slices(monkeypatch):
    import verl_mega.hybrid.fp8 as fp8

    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 16, generator=g) * torch.linspace(0.1, 10, 40)[:, None]
    whole = Fp8Rows(torch.empty(40, 16, dtype=FP8_DTYPE), torch.empty(40, 1))
    whole.copy_(w)
    monkeypatch.setattr(fp8, "_CHUNK_ELEMS", 48)  # 3 rows per step, a ragged last chunk
    chunked = Fp8Rows(torch.empty(40, 16, dtype=FP8_DTYPE), torch.empty(40, 1))
    chunked.copy_(w)
    assert torch.equal(whole.weight.view(torch.uint8), chunked.weight.view(torch.uint8))
    assert torch.equal(whole.scale, chunked.scale)


class _Linear(torch.nn.Module):
    """vLLM's per-channel FP8 linear after loading, as measured on vLLM 0.26 (H200) and 0.32 (CPU): ``weight``
    [in, out] e4m3 with strides (1, in), i.e. the transpose of row-major [out, in] storage; ``weight_scale`` [out, 1]
    fp32."""

    def __init__(self, out: int, inp: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(out, inp, dtype=FP8_DTYPE).t(), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.full((out, 1), float("nan")), requires_grad=False)


class _Norm(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n), requires_grad=False)


def _vllm_like(arch, tg: int) -> torch.nn.Module:
    """One decoder layer named as vLLM names it, its four linears in the FP8 layout (generation rank of tg)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    layer = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    layer.self_attn, layer.mlp = torch.nn.Module(), torch.nn.Module()
    layer.self_attn.qkv_proj = _Linear((arch.num_heads + 2 * arch.num_kv_heads) * d // tg, h)
    layer.self_attn.o_proj = _Linear(h, arch.num_heads * d // tg)
    layer.mlp.gate_up_proj = _Linear(2 * f // tg, h)
    layer.mlp.down_proj = _Linear(h, f // tg)
    layer.input_layernorm = _Norm(h)
    return model


LINEARS = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
           "mlp.linear_fc2.weight"]


# the reused copy plan (``direct``) runs when every rank already holds its block (t = tg)
@pytest.mark.parametrize("heads,kv,t,tg,direct", [(*c, False) for c in COMBOS] + [(*c, True) for c in COMBOS
                                                                                  if c[2] == c[3]])
def test_quantized_blocks_equal_quantized_vllm_slices(heads, kv, t, tg, direct):
    """Each generation block, written slice by slice into vLLM's transposed FP8 storage, holds the per-row
    quantization of exactly the rows vLLM's loader would keep (cut from the full HF tensors here); row-parallel
    blocks gathered from m > 1 shards share one scale per row across the shards."""
    arch = _arch(heads, kv)
    hf = {k: v * torch.exp(2 * torch.randn(v.shape[0], *[1] * (v.dim() - 1), generator=torch.Generator()
                                           .manual_seed(len(k)))) for k, v in _hf(arch).items()}
    read, m = _reader(hf), t // tg
    for j in range(tg):
        model = _vllm_like(arch, tg)
        sink = InPlaceTransport(model, repacks=False)
        plans = []
        for suffix in LINEARS + ["input_layernorm.weight"]:
            rule = rule_for(f"decoder.layers.0.{suffix}", arch)
            own = [hf_to_mcore_shard(rule, read, arch, r, t, padded_vocab=0) for r in range(t)][j * m:(j + 1) * m]
            dst = sink.buffer(vllm_name(rule), block_shape(rule, own[0].shape, m))
            if direct:
                plans += block_copies(rule, dst, own, arch)
            else:
                write_block(rule, dst, own, arch)
        for again in range(2 if direct else 0):  # a reused plan's writes after a refresh are recorded again
            if again:
                sink.refresh()
            for to, src in plans:
                to.copy_(src)
            assert check_quantized_coverage(sink) == 4
        assert check_quantized_coverage(sink) == 4
        for suffix in LINEARS:
            name = vllm_name(rule_for(f"decoder.layers.0.{suffix}", arch))
            module = model.get_submodule(name.rpartition(".")[0])
            expected = _vllm_slice(hf, name, j, tg)
            assert_quantized(module.weight.t(), module.weight_scale, expected, f"{name} t={t} tg={tg} j={j}")
        assert torch.equal(model.model.layers[0].input_layernorm.weight, hf["model.layers.0.input_layernorm.weight"])


def test_coverage_names_missing_and_partial_parameters():
    arch = _arch(4, 2)
    model = _vllm_like(arch, 1)
    sink = InPlaceTransport(model, repacks=False)
    assert sorted(sink.quantized) == sorted(f"model.layers.0.{n}.weight" for n in
                                            ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                             "mlp.down_proj"))
    assert sink.dtype == torch.float32  # slices travel in the model's dtype, not in FP8
    read = _reader(_hf(arch))
    for suffix in LINEARS[:3]:  # down_proj left out
        rule = rule_for(f"decoder.layers.0.{suffix}", arch)
        shard = hf_to_mcore_shard(rule, read, arch, 0, 1, padded_vocab=0)
        write_block(rule, sink.buffer(vllm_name(rule), tuple(shard.shape)), [shard], arch)
    with pytest.raises(WeightSyncError, match=r"wrote 3 of vLLM's 4 FP8 linears and missed 1 .*mlp\.down_proj"):
        check_quantized_coverage(sink)
    rule = rule_for("decoder.layers.0.mlp.linear_fc2.weight", arch)
    shard = hf_to_mcore_shard(rule, read, arch, 0, 1, padded_vocab=0)
    sink.buffer(vllm_name(rule), tuple(shard.shape))[: shard.shape[0] // 2].copy_(shard[: shard.shape[0] // 2])
    with pytest.raises(WeightSyncError, match=r"wrote 576 of the 1152 elements of vLLM's FP8 .*down_proj"):
        check_quantized_coverage(sink)


def test_fp8_destination_refuses_other_layouts():
    arch = _arch(4, 2)
    model = _vllm_like(arch, 1)
    proj = model.model.layers[0].self_attn.o_proj
    proj.weight_scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)  # per-tensor
    sink = InPlaceTransport(model, repacks=False)
    with pytest.raises(WeightSyncError, match=r"scales \(1,\), not one per output channel"):
        sink.buffer("model.layers.0.self_attn.o_proj.weight", (24, 32))
    proj.weight_scale = torch.nn.Parameter(torch.ones(24, 1), requires_grad=False)
    proj.weight = torch.nn.Parameter(torch.zeros(32, 24, dtype=FP8_DTYPE), requires_grad=False)  # row-major [in, out]
    sink.refresh()
    with pytest.raises(WeightSyncError, match="lays FP8 weights out differently"):
        sink.buffer("model.layers.0.self_attn.o_proj.weight", (24, 32))


def _config_error(overrides):
    from verl_mega.config import load_config

    with pytest.raises(ValueError) as info:
        load_config(None, overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_config_keys():
    from verl_mega.config import load_config
    from verl_mega.rollout.vllm_rollout import FP8_QUANTIZATION_CONFIG, VLLMRolloutConfig

    cfg = load_config(None, ["rollout.quantization=fp8", "rollout.kv_cache_dtype=fp8"])
    assert (cfg.rollout.quantization, cfg.rollout.kv_cache_dtype) == ("fp8", "fp8")
    assert _config_error(["rollout.quantization=fp8", "rollout.weight_sync=reference"]) == (
        "rollout.quantization=fp8 needs the in-place weight sync (vLLM's own loader cannot fill FP8 parameters from "
        "bf16 tensors); set rollout.weight_sync=inplace")
    assert "placement.roles.rollout" in _config_error(
        ["rollout.quantization=fp8", "placement.pools={train: {size: 2}, gen: {size: 2}}",
         "placement.roles={actor: train, rollout: gen}"])
    assert "rollout.quantization" in _config_error(["rollout.quantization=int8"])
    assert "rollout.kv_cache_dtype" in _config_error(["rollout.kv_cache_dtype=fp16"])
    assert VLLMRolloutConfig(model_path="m", quantization="fp8").load_format == "dummy"
    assert VLLMRolloutConfig(model_path="m").load_format == "auto"
    with pytest.raises(ValueError, match="leave load_format at auto or dummy"):
        VLLMRolloutConfig(model_path="m", quantization="fp8", load_format="safetensors")
    weights = FP8_QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"]
    assert (weights["strategy"], weights["type"], weights["num_bits"]) == ("channel", "float", 8)


def test_a_sync_writes_weights_but_not_the_scales_vllm_keeps_itself():
    layer = "model.layers.0.self_attn"
    names = {f"{layer}.qkv_proj.weight", f"{layer}.qkv_proj.weight_scale", f"{layer}.qkv_proj.input_scale",
             f"{layer}.attn._k_scale", f"{layer}.attn._q_scale", f"{layer}.attn._v_scale", f"{layer}.attn.k_scale",
             f"{layer}.attn._prob_scale", "model.layers.0.mlp.down_proj.weight"}
    assert written_names(names) == {f"{layer}.qkv_proj.weight", "model.layers.0.mlp.down_proj.weight"}
