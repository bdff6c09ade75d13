"""Megatron shards → vLLM generation blocks, against slices cut directly from the full HF tensors."""

from __future__ import annotations

import pytest
import torch

from verl_mega.hybrid.convert import block_shape, vllm_name, vllm_vocab_rows, vocab_row_plan, write_block
from verl_mega.models.hf_config import ModelArch
from verl_mega.models.weights import hf_to_mcore_shard, rule_for


def _arch(heads: int, kv: int, d: int = 8, hidden: int = 24, ffn: int = 48, bias: bool = True) -> ModelArch:
    return ModelArch(model_type="qwen2", num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, num_heads=heads,
                     num_kv_heads=kv, head_dim=d, vocab_size=50, max_position_embeddings=64, rope_theta=1e4,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=bias, qk_norm=False)


def _hf(arch: ModelArch) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    shapes = {
        "q_proj.weight": (arch.num_heads * d, h), "k_proj.weight": (arch.num_kv_heads * d, h),
        "v_proj.weight": (arch.num_kv_heads * d, h), "o_proj.weight": (h, arch.num_heads * d),
        "q_proj.bias": (arch.num_heads * d,), "k_proj.bias": (arch.num_kv_heads * d,),
        "v_proj.bias": (arch.num_kv_heads * d,),
    }
    out = {f"model.layers.0.self_attn.{k}": torch.randn(s, generator=g) for k, s in shapes.items()}
    for k, s in {"gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}.items():
        out[f"model.layers.0.mlp.{k}.weight"] = torch.randn(s, generator=g)
    out["model.layers.0.input_layernorm.weight"] = torch.randn(h, generator=g)
    return out


def _reader(hf):
    def read(name, rows=None, cols=None):
        t = hf[name]
        if rows is not None:
            t = t[rows[0]:rows[1]]
        if cols is not None:
            t = t[:, cols[0]:cols[1]]
        return t.clone()
    return read


def _vllm_slice(hf, vname: str, j: int, tg: int) -> torch.Tensor:
    """What vLLM's loaders keep on generation TP rank j: each projection split evenly, fused in order."""
    def rows(t):
        n = t.shape[0] // tg
        return t[j * n:(j + 1) * n]

    base = vname.rsplit(".", 1)
    if ".qkv_proj." in vname:
        return torch.cat([rows(hf[vname.replace("qkv_proj", p)]) for p in ("q_proj", "k_proj", "v_proj")])
    if ".gate_up_proj." in vname:
        return torch.cat([rows(hf[vname.replace("gate_up_proj", p)]) for p in ("gate_proj", "up_proj")])
    if base[0].endswith(("o_proj", "down_proj")):
        t = hf[vname]
        n = t.shape[1] // tg
        return t[:, j * n:(j + 1) * n]
    return hf[vname]


MCORE = [
    "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "input_layernorm.weight",
]


# Megatron needs t | kv heads, so only those combinations exist.
COMBOS = [(heads, kv, t, tg) for heads, kv in [(4, 4), (8, 2), (8, 4), (16, 8)]
          for t, tg in [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2)] if kv % t == 0]


@pytest.mark.parametrize("heads,kv,t,tg", COMBOS)
def test_blocks_equal_vllm_slices(heads, kv, t, tg):
    arch = _arch(heads, kv)
    hf = _hf(arch)
    read = _reader(hf)
    m = t // tg
    for suffix in MCORE:
        rule = rule_for(f"decoder.layers.0.{suffix}", arch)
        shards = [hf_to_mcore_shard(rule, read, arch, r, t, padded_vocab=0) for r in range(t)]
        for j in range(tg):
            own = shards[j * m:(j + 1) * m]
            block = torch.empty(block_shape(rule, own[0].shape, m), dtype=own[0].dtype)
            write_block(rule, block, own, arch)
            expected = _vllm_slice(hf, vllm_name(rule), j, tg)
            assert torch.equal(block, expected), (suffix, j)
            dst = torch.full_like(expected, float("nan"))  # writing into an existing tensor fills every element
            write_block(rule, dst, shards[j * m:(j + 1) * m], arch)
            assert torch.equal(dst, expected)


def test_vllm_names():
    arch = _arch(4, 2)
    names = {vllm_name(rule_for(f"decoder.layers.0.{s}", arch, layer_offset=3)) for s in MCORE}
    assert names == {
        "model.layers.3.self_attn.qkv_proj.weight", "model.layers.3.self_attn.qkv_proj.bias",
        "model.layers.3.self_attn.o_proj.weight", "model.layers.3.mlp.gate_up_proj.weight",
        "model.layers.3.mlp.down_proj.weight", "model.layers.3.input_layernorm.weight",
    }


@pytest.mark.parametrize("vocab", [300, 512, 32000, 151936, 50257])
@pytest.mark.parametrize("t,tg", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 8), (8, 1)])
def test_vocab_rows_each_needed_row_once_from_its_owner(vocab, t, tg):
    rows = vllm_vocab_rows(vocab, tg)
    padded = -(-vocab // 64) * 64
    assert [(r.start, r.end) for r in rows] == [
        (min(j * padded // tg, vocab), min((j + 1) * padded // tg, vocab)) for j in range(tg)]
    assert all(r.partition_rows == padded // tg for r in rows)
    meg_padded = -(-vocab // (128 * t)) * 128 * t
    per = meg_padded // t
    plan = vocab_row_plan(meg_padded, t, t // tg, rows)
    for dst in range(t):
        need = rows[dst // (t // tg)]
        got = sorted((tr.start, tr.end) for tr in plan if tr.dst == dst)
        covered = [i for a, b in got for i in range(a, b)]
        assert covered == list(range(need.start, need.end))  # each row exactly once, in order
        for tr in plan:
            if tr.dst == dst:
                assert tr.src * per <= tr.start < tr.end <= (tr.src + 1) * per  # from the shard that owns it


@pytest.mark.parametrize("world,tp,pp,ep,etp,tg", [(8, 2, 1, 4, 1, 2), (8, 4, 1, 2, 2, 2), (4, 2, 1, 1, 2, 1),
                                                   (8, 2, 2, 2, 1, 1), (8, 4, 1, 1, 1, 4), (6, 3, 1, 3, 1, 3)])
def test_expert_plan_builds_vllm_expert_blocks(world, tp, pp, ep, etp, tg):
    """Every rank's vLLM expert tensors (fused w13 [E, 2f/tg, h] = gate rows then up rows of block j, w2
    [E, h, f/tg]), assembled from the plan's pieces out of the holders' Megatron shards, equal slices cut from the
    full HF tensors; each needed row comes exactly once, from the rank's own stage and expert-data-parallel replica;
    the rows a rank receives are the Pool's expert byte count."""
    from verl_mega.hybrid.convert import expert_dest_views, expert_plan, expert_source_views
    from verl_mega.models.weights import ExpertShard
    from verl_mega.parallel.placement import Placement

    E, h, f = 12, 5, 12
    arch = ModelArch(model_type="qwen3_moe", num_layers=pp, hidden_size=h, ffn_hidden_size=8, num_heads=2,
                     num_kv_heads=1, head_dim=4, vocab_size=50, max_position_embeddings=64, rope_theta=1e4,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=True, num_experts=E,
                     moe_topk=2, moe_ffn_hidden_size=f, moe_renormalize=True)
    pool = Placement.single(world, tp=tp, pp=pp, ep=ep, etp=etp, gen_tp=tg).pool("main")
    g = torch.Generator().manual_seed(1)
    hf = {}
    for e in range(E):
        for proj, shape in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))):
            hf[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = torch.randn(shape, generator=g)
    rules = [rule_for(f"decoder.layers.0.mlp.experts.weight{i}", arch) for i in (1, 2)]
    shards = {}
    for r in pool.ranks:
        c = pool.coords(r)
        which = ExpertShard(ep_rank=c["ep"], ep=ep, etp_rank=c["etp"], etp=etp)
        shards[r] = [hf_to_mcore_shard(rule, _reader(hf), arch, c["tp"], tp, 0, which) for rule in rules]
    fj = f // tg
    for stage in range(pp):
        plan = expert_plan(pool, stage, E, f)
        for dst in (r for r in pool.ranks if pool.coords(r)["pp"] == stage):
            c = pool.coords(dst)
            j = c["gen_tp"]
            w13, w2 = torch.full((E, 2 * fj, h), float("nan")), torch.full((E, h, fj), float("nan"))
            rows = []
            for piece in (q for q in plan if q.dst == dst):
                hc = pool.coords(piece.src)
                assert (hc["pp"], hc["edp"]) == (stage, c["edp"])
                views = expert_source_views(piece, *shards[piece.src], ep_rank=hc["ep"], etp_rank=hc["etp"],
                                            num_experts=E, ep=ep, etp=etp, width=f)
                for to, frm in zip(expert_dest_views(piece, w13, w2, gen_rank=j, width=f, gen_tp=tg), views):
                    to.copy_(frm)
                rows += [(piece.expert, x, piece.src != dst) for x in range(piece.lo, piece.hi)]
            want = [(e, x) for e in range(E) for x in range(j * fj, (j + 1) * fj)]
            assert sorted((e, x) for e, x, _ in rows) == want
            for e in range(E):
                sl = slice(j * fj, (j + 1) * fj)
                name = f"model.layers.0.mlp.experts.{e}."
                gate_up = torch.cat([hf[name + "gate_proj.weight"][sl], hf[name + "up_proj.weight"][sl]])
                assert torch.equal(w13[e], gate_up)
                assert torch.equal(w2[e], hf[name + "down_proj.weight"][:, sl])
            received = sum(moved for _, _, moved in rows) * 3 * h
            # Pool's count for one layer per stage, unit row bytes h: only this stage's layer is in the plan
            assert received == pool.expert_sync_bytes_per_rank(dst, num_layers=pp, num_experts=E, width=f,
                                                               row_bytes=h) - (pp - 1) * E * 3 * fj * h


def test_expert_vllm_names():
    arch = ModelArch(model_type="mixtral", num_layers=4, hidden_size=8, ffn_hidden_size=8, num_heads=2,
                     num_kv_heads=1, head_dim=4, vocab_size=50, max_position_embeddings=64, rope_theta=1e4,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=False, num_experts=4,
                     moe_topk=2, moe_ffn_hidden_size=8, moe_renormalize=True)
    from verl_mega.hybrid.convert import canonical_name, routed_name

    names = {vllm_name(rule_for(f"decoder.layers.1.mlp.{s}", arch, layer_offset=2))
             for s in ("router.weight", "experts.weight1", "experts.weight2")}
    block = "model.layers.3.block_sparse_moe"
    assert names == {f"{block}.gate.weight", f"{block}.experts.w13_weight", f"{block}.experts.w2_weight"}
    routed = "model.layers.3.block_sparse_moe.experts.routed_experts.w13_weight"
    assert routed_name(canonical_name(routed)) == routed and canonical_name(routed) in names
