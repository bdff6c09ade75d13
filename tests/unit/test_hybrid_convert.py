"""Megatron shards → vLLM generation blocks, against slices cut directly from the full HF tensors."""

from __future__ import annotations

import pytest
import torch

from verl_mega.hybrid.convert import block_shape, vllm_name, vllm_vocab_rows, vocab_row_plan, write_block
from verl_mega.models.arch import expert_sync_bytes_per_rank
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
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    rows = vllm_vocab_rows(vocab, tg)
    padded = pad_vocab_size(vocab, 64)
    vllms = [VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, j, tg) for j in range(tg)]
    assert [(r.start, r.end) for r in rows] == [(i.org_vocab_start_index, i.org_vocab_end_index) for i in vllms]
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


@pytest.mark.parametrize("world,tp,pp,ep,etp,tg,gen_ep", [(8, 2, 1, 4, 1, 2, 1), (8, 4, 1, 2, 2, 2, 1),
                                                          (4, 2, 1, 1, 2, 1, 1), (8, 2, 2, 2, 1, 1, 1),
                                                          (8, 4, 1, 1, 1, 4, 1), (6, 3, 1, 3, 1, 3, 1),
                                                          (8, 2, 1, 4, 1, 2, 4), (8, 2, 1, 2, 2, 1, 2),
                                                          (16, 4, 2, 4, 1, 2, 4), (8, 1, 1, 8, 1, 1, 8)])
def test_expert_plan_builds_vllm_expert_blocks(world, tp, pp, ep, etp, tg, gen_ep):
    """Every rank's vLLM expert tensors, assembled from the plan's pieces out of the holders' Megatron shards, equal
    slices cut from the full HF tensors: with gen_ep = 1 the fused w13 [E, 2f/tg, h] (gate rows then up rows of block
    j) and w2 [E, h, f/tg]; with expert-parallel generation w13 [E/gen_ep, 2f, h] and w2 [E/gen_ep, h, f] of the
    experts vLLM's own expert map (``determine_expert_map``) gives the rank's EP rank — no rank receives an expert it
    does not serve. Each needed row comes exactly once, from the rank's own stage and expert-data-parallel replica;
    the rows a rank receives are the Pool's expert byte count."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    from verl_mega.hybrid.convert import expert_dest_views, expert_plan, expert_source_views
    from verl_mega.models.weights import ExpertShard
    from verl_mega.parallel.placement import Placement

    E, h, f = 24, 5, 12
    arch = ModelArch(model_type="qwen3_moe", num_layers=pp, hidden_size=h, ffn_hidden_size=8, num_heads=4,
                     num_kv_heads=4, head_dim=4, vocab_size=50, max_position_embeddings=64, rope_theta=1e4,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=True, num_experts=E,
                     moe_topk=2, moe_ffn_hidden_size=f, moe_renormalize=True)
    pool = Placement.single(world, tp=tp, pp=pp, ep=ep, etp=etp, gen_tp=tg, gen_ep=gen_ep).pool("main")
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
    for stage in range(pp):
        plan = expert_plan(pool, stage, E, f)
        for dst in (r for r in pool.ranks if pool.coords(r)["pp"] == stage):
            c = pool.coords(dst)
            if gen_ep > 1:  # vLLM's placement of experts over its EP ranks, whole width
                _, expert_map, _ = determine_expert_map(gen_ep, c["gen_ep"], E)
                local = {int(e): int(expert_map[e]) for e in range(E) if int(expert_map[e]) >= 0}
                width = range(f)
            else:
                local, width = {e: e for e in range(E)}, range(c["gen_tp"] * f // tg, (c["gen_tp"] + 1) * f // tg)
            e0, _, r0, _ = pool.expert_slice(dst, E, f)
            w13 = torch.full((len(local), 2 * len(width), h), float("nan"))
            w2 = torch.full((len(local), h, len(width)), float("nan"))
            rows = []
            for piece in (q for q in plan if q.dst == dst):
                hc = pool.coords(piece.src)
                assert (hc["pp"], hc["edp"]) == (stage, c["edp"])
                views = expert_source_views(piece, *shards[piece.src], ep_rank=hc["ep"], etp_rank=hc["etp"],
                                            num_experts=E, ep=ep, etp=etp, width=f)
                for to, frm in zip(expert_dest_views(piece, w13, w2, first_expert=e0, first_row=r0,
                                                     rows=len(width)), views):
                    to.copy_(frm)
                rows += [(piece.expert, x, piece.src != dst) for x in range(piece.lo, piece.hi)]
            assert sorted((e, x) for e, x, _ in rows) == [(e, x) for e in sorted(local) for x in width]
            sl = slice(width[0], width[-1] + 1)
            for e, le in local.items():
                name = f"model.layers.0.mlp.experts.{e}."
                gate_up = torch.cat([hf[name + "gate_proj.weight"][sl], hf[name + "up_proj.weight"][sl]])
                assert torch.equal(w13[le], gate_up)
                assert torch.equal(w2[le], hf[name + "down_proj.weight"][:, sl])
            received = sum(moved for _, _, moved in rows) * 3 * h
            # the byte model's count for this stage's one MoE layer, unit row bytes h
            assert received == expert_sync_bytes_per_rank(pool, dst, num_layers=1, own_layers=1, num_experts=E,
                                                          width=f, row_bytes=h)


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


@pytest.mark.parametrize("t,tg,q_lora", [(4, 2, 16), (2, 2, None), (4, 1, 16), (2, 1, None)])
def test_mla_blocks_equal_vllm_slices(t, tg, q_lora):
    """Multi-head latent attention: generation block j of q_b_proj (or q_proj), kv_b_proj (heads, column blocks) and
    o_proj (row blocks) built from m = t/tg Megatron shards, and the latent down projections written whole into
    vLLM's fused_qkv_a_proj = [q_a; kv_a] (kv_a_proj_with_mqa on its own without a query bottleneck), equal the rows
    vLLM keeps, cut from the full HF tensors."""
    from verl_mega.hybrid.convert import vllm_slot

    heads, h, r, rope, nope, v = 4, 24, 12, 4, 6, 5
    arch = ModelArch(model_type="deepseek_v3", num_layers=1, hidden_size=h, ffn_hidden_size=8, num_heads=heads,
                     num_kv_heads=heads, head_dim=nope + rope, vocab_size=50, max_position_embeddings=64,
                     rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=False, qkv_bias=False, qk_norm=False,
                     q_lora_rank=q_lora, kv_lora_rank=r, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v)
    g = torch.Generator().manual_seed(0)
    p = "model.layers.0.self_attn."
    hf = {p + "kv_a_proj_with_mqa.weight": torch.randn(r + rope, h, generator=g),
          p + "kv_b_proj.weight": torch.randn(heads * (nope + v), r, generator=g),
          p + "o_proj.weight": torch.randn(h, heads * v, generator=g)}
    if q_lora:
        hf[p + "q_a_proj.weight"] = torch.randn(q_lora, h, generator=g)
        hf[p + "q_b_proj.weight"] = torch.randn(heads * (nope + rope), q_lora, generator=g)
    else:
        hf[p + "q_proj.weight"] = torch.randn(heads * (nope + rope), h, generator=g)
    suffixes = ["linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"] + \
        (["linear_q_down_proj", "linear_q_up_proj"] if q_lora else ["linear_q_proj"])
    m = t // tg
    for j in range(tg):
        built = {}
        for suffix in suffixes:
            rule = rule_for(f"decoder.layers.0.self_attention.{suffix}.weight", arch)
            shards = [hf_to_mcore_shard(rule, _reader(hf), arch, i, t, 0) for i in range(j * m, (j + 1) * m)]
            if rule.kind == "replicated":
                shards = shards[:1]
            name, first, rows = vllm_slot(rule, arch)
            shape = block_shape(rule, shards[0].shape, len(shards))
            dst = built.setdefault(name, torch.full((rows or shape[0], *shape[1:]), float("nan")))
            write_block(rule, dst[first:first + shape[0]], shards, arch)
        heads_j = slice(j * heads // tg, (j + 1) * heads // tg)

        def by_heads(name, per_head, heads_j=heads_j):
            return hf[name].view(heads, per_head, -1)[heads_j].reshape(-1, hf[name].shape[1])

        want = {p + "kv_b_proj.weight": by_heads(p + "kv_b_proj.weight", nope + v),
                p + "o_proj.weight": hf[p + "o_proj.weight"].view(h, heads, v)[:, heads_j].reshape(h, -1)}
        if q_lora:
            want[p + "fused_qkv_a_proj.weight"] = torch.cat([hf[p + "q_a_proj.weight"],
                                                            hf[p + "kv_a_proj_with_mqa.weight"]])
            want[p + "q_b_proj.weight"] = by_heads(p + "q_b_proj.weight", nope + rope)
        else:
            want[p + "kv_a_proj_with_mqa.weight"] = hf[p + "kv_a_proj_with_mqa.weight"]
            want[p + "q_proj.weight"] = by_heads(p + "q_proj.weight", nope + rope)
        assert built.keys() == want.keys()
        for name, tensor in want.items():
            assert torch.equal(built[name], tensor), name
