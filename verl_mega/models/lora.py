"""LoRA adapters on our Megatron-Core layer spec.

Each targeted HF projection (``q_proj`` … ``down_proj``) gets its own pair: ``A`` [r, in] and ``B`` [out, r], and the
layer computes ``W·x + (alpha/r)·B·A·dropout(x)``. Megatron fuses projections (``linear_qkv`` holds q, k and v
interleaved per query group; ``linear_fc1`` holds ``[gate_r; up_r]``), so a fused linear carries one pair per HF part
and interleaves their outputs the way its weight interleaves the rows.

Tensor parallelism splits each pair the way its base weight is split:

* column-parallel base (``linear_qkv``, ``linear_fc1``: output rows split): ``A`` whole on every TP rank, ``B``'s
  rows split like the base's. The rank computes ``A·x`` on its own input (its sequence chunk with sequence
  parallelism), then the r-wide result is all-gathered over the sequence (SP) or its gradient all-reduced (no SP),
  and ``B`` produces this rank's output rows.
* row-parallel base (``linear_proj``, ``linear_fc2``: input columns split): ``A``'s columns split like the base's,
  ``B`` whole. The partial ``A_r·x_r`` (r wide) is summed over TP (reduce-scatter over the sequence with SP).

Only r-wide activations cross ranks. Parameters whose gradient each TP rank sees for its own tokens only (``A`` of a
column-parallel layer and ``B`` of a row-parallel one, under SP) are tagged ``sequence_parallel``, so mcore's
``finalize_model_grads`` sums their gradients over TP, as it does for the norms. Pipeline and context parallelism need
nothing: adapters live with their layer and act per token.

The base weights are frozen in the training dtype (``requires_grad=False``): Megatron's DDP gives them no gradient
buffer and its optimizer no fp32 master copy and no Adam state. :func:`adapters_off` runs the base model (the
reference policy); :meth:`LoRALinear.merged_weight` is what the weight sync and the export read (``W + s·B·A``, this
rank's shard, computed locally: B is split like W and A is whole, or the reverse).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)

#: HF projection names a LoRA may target, by the mcore linear that holds them (in the order of its fused rows)
PARTS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "mlp.linear_fc1": ("gate_proj", "up_proj"),
    "mlp.linear_fc2": ("down_proj",),
}
HF_TARGETS = tuple(p for parts in PARTS.values() for p in parts)
#: where each HF projection sits in an HF decoder layer (PEFT adapter names)
HF_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
INITS = ("kaiming", "gaussian")


@dataclass(frozen=True, kw_only=True)
class LoRASpec:
    """What the layers need to know (from ``model.lora``): rank, alpha, dropout, the HF projections targeted, the
    initialisation of ``A`` (``B`` starts at zero, so training starts from the base model) and its seed."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = HF_TARGETS
    init: str = "kaiming"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"model.lora.rank={self.rank} must be at least 1")
        bad = sorted(set(self.targets) - set(HF_TARGETS))
        if bad or not self.targets:
            raise ValueError(f"model.lora.target_modules: {bad or 'none'} not among {list(HF_TARGETS)} (or "
                             f"all-linear)")
        if self.init not in INITS:
            raise ValueError(f"model.lora.init={self.init!r} must be one of {INITS}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def resolve_targets(target_modules: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """``all-linear`` or HF names → the HF projections, in :data:`HF_TARGETS` order."""
    names = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
    if "all-linear" in names:
        return HF_TARGETS
    return tuple(t for t in HF_TARGETS if t in names)


def _tag(param: torch.nn.Parameter, *, parallel_dim: int | None, sequence_parallel: bool) -> None:
    """mcore's attributes: TP-split params carry ``tensor_model_parallel`` (grad-norm counting, checkpoints);
    replicated ones whose gradient is per token chunk carry ``sequence_parallel``."""
    param.tensor_model_parallel = parallel_dim is not None
    param.partition_dim = -1 if parallel_dim is None else parallel_dim
    param.partition_stride = 1
    param.sequence_parallel = sequence_parallel and parallel_dim is None


class LoRALinear:
    """Mixin over mcore's column/row-parallel linear: the adapters of the HF parts it holds, by part name
    (``lora_a_<part>``, ``lora_b_<part>``). Parts not targeted carry no parameters and contribute zeros."""

    lora: LoRASpec | None
    lora_parts: tuple[str, ...]  # every HF part of the fused weight, in row order
    lora_enabled: bool = True

    def _setup_lora(self, lora: LoRASpec | None, parts: tuple[str, ...], sizes: tuple[int, ...], groups: int,
                    in_size: int, out_size: int, *, column: bool) -> None:
        self.lora, self.lora_parts, self.lora_sizes, self.lora_groups = lora, parts, sizes, groups
        self.lora_column = column
        self.lora_enabled = True
        if lora is None:
            return
        dtype = self.config.params_dtype
        device = self.weight.device
        sp = self.config.sequence_parallel
        for part, size in zip(parts, sizes):
            if part not in lora.targets:
                continue
            rows = size * groups if column else out_size
            a = torch.nn.Parameter(torch.zeros(lora.rank, in_size, dtype=dtype, device=device))
            b = torch.nn.Parameter(torch.zeros(rows, lora.rank, dtype=dtype, device=device))
            _tag(a, parallel_dim=None if column else 1, sequence_parallel=sp)
            _tag(b, parallel_dim=0 if column else None, sequence_parallel=sp)
            self.register_parameter(f"lora_a_{part}", a)
            self.register_parameter(f"lora_b_{part}", b)

    @property
    def adapted(self) -> tuple[str, ...]:
        """The HF parts that carry adapters."""
        return tuple(p for p in self.lora_parts if hasattr(self, f"lora_a_{p}"))

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.lora.dropout
        return F.dropout(x, p=p, training=True) if p and self.training else x

    def _assemble(self, per_part: list[torch.Tensor | None], lead: tuple[int, ...], like: torch.Tensor
                  ) -> torch.Tensor:
        """Per-part outputs [..., groups·size_p] (None: zeros) → the fused layout [..., groups·Σsize]."""
        g = self.lora_groups
        blocks = [(t if t is not None else like.new_zeros(*lead, g * s)).reshape(*lead, g, s)
                  for t, s in zip(per_part, self.lora_sizes)]
        return torch.cat(blocks, dim=-1).reshape(*lead, -1)

    def lora_delta(self, x: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to this rank's output, for this rank's input ``x``."""
        parts = self.adapted
        x = self._dropout(x)
        h = torch.cat([F.linear(x, getattr(self, f"lora_a_{p}")) for p in parts], dim=-1)  # [.., n·r]
        group = self.tp_group
        sp = self.config.sequence_parallel
        if self.lora_column:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group) if sp \
                else copy_to_tensor_model_parallel_region(h, group=group)
            outs = dict(zip(parts, (F.linear(hp, getattr(self, f"lora_b_{p}"))
                                    for hp, p in zip(h.split(self.lora.rank, dim=-1), parts))))
            delta = self._assemble([outs.get(p) for p in self.lora_parts], tuple(h.shape[:-1]), h)
        else:
            h = reduce_scatter_to_sequence_parallel_region(h, group=group) if sp \
                else reduce_from_tensor_model_parallel_region(h, group=group)
            delta = sum(F.linear(hp, getattr(self, f"lora_b_{p}"))
                        for hp, p in zip(h.split(self.lora.rank, dim=-1), parts))
        return delta * self.lora.scale

    @torch.no_grad()
    def weight_delta(self) -> torch.Tensor:
        """``s·B·A`` in this rank's shard of the base weight's layout, in fp32."""
        parts = self.adapted
        if self.lora_column:
            prods = {p: getattr(self, f"lora_b_{p}").float() @ getattr(self, f"lora_a_{p}").float() for p in parts}
            in_size = self.weight.shape[1]
            g = self.lora_groups
            blocks = [(prods[p] if p in prods else self.weight.new_zeros(g * s, in_size, dtype=torch.float32))
                      .reshape(g, s, in_size) for p, s in zip(self.lora_parts, self.lora_sizes)]
            delta = torch.cat(blocks, dim=1).reshape(-1, in_size)
        else:
            delta = sum(getattr(self, f"lora_b_{p}").float() @ getattr(self, f"lora_a_{p}").float() for p in parts)
        return delta * self.lora.scale

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """This rank's shard of ``W + s·B·A`` in the base weight's dtype (summed in fp32, rounded once)."""
        if not self.adapted:
            return self.weight.data
        return (self.weight.data.float() + self.weight_delta()).to(self.weight.dtype)

    def _sharded(self, prefix: str, sharded_offsets, metadata, axes: dict[str, int]) -> dict:
        """mcore's sharded state dict of the layer, with the TP-split adapters (``B`` of a column-parallel layer,
        ``A`` of a row-parallel one) split along the same dim as the base weight; the others replicated."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        for p in self.adapted:
            axes[f"lora_b_{p}" if self.lora_column else f"lora_a_{p}"] = 0 if self.lora_column else 1
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                   sharded_offsets, tp_group=self.tp_group,
                                                   dp_cp_group=metadata["dp_cp_group"])


class LoRAColumnParallelLinear(LoRALinear, ColumnParallelLinear):
    """``linear_qkv`` / ``linear_fc1`` with adapters. ``fused``: ``qkv`` or ``fc1`` (how the HF parts' rows are laid
    out in this rank's shard)."""

    def __init__(self, input_size: int, output_size: int, *, config, lora: LoRASpec | None = None,
                 fused: str = "qkv", **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        tp = self.tp_group.size()
        if fused == "qkv":
            groups, d = config.num_query_groups // tp, config.kv_channels
            qpg = config.num_attention_heads // config.num_query_groups
            parts, sizes = PARTS["self_attention.linear_qkv"], (qpg * d, d, d)
        else:
            groups, parts = 1, PARTS["mlp.linear_fc1"]
            sizes = (self.output_size_per_partition // 2,) * 2
        if groups * sum(sizes) != self.output_size_per_partition:
            raise ValueError(f"LoRA on {fused}: {groups}×{sizes} rows ≠ the shard's {self.output_size_per_partition}")
        self._setup_lora(lora, parts, sizes, groups, input_size, self.output_size_per_partition, column=True)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output=None):
        out, bias = super().forward(input_, weight, runtime_gather_output)
        if self.lora is None or not self.lora_enabled or not self.adapted:
            return out, bias
        if self.gather_output or runtime_gather_output:
            raise ValueError("LoRA: a column-parallel linear that gathers its output is not supported")
        return out + self.lora_delta(input_).to(out.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 0, "bias": 0})  # as mcore's, + adapters


class LoRARowParallelLinear(LoRALinear, RowParallelLinear):
    """``linear_proj`` / ``linear_fc2`` with adapters. ``part``: the HF projection it holds."""

    def __init__(self, input_size: int, output_size: int, *, config, lora: LoRASpec | None = None,
                 part: str = "o_proj", **kwargs) -> None:
        super().__init__(input_size, output_size, config=config, **kwargs)
        self._setup_lora(lora, (part,), (output_size,), 1, self.input_size_per_partition, output_size,
                         column=False)

    def forward(self, input_: torch.Tensor):
        out, bias = super().forward(input_)
        if self.lora is None or not self.lora_enabled or not self.adapted:
            return out, bias
        return out + self.lora_delta(input_).to(out.dtype), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return self._sharded(prefix, sharded_offsets, metadata, {"weight": 1})  # as mcore's, + adapters


# ---------------------------------------------------------------------------------------------- model-level helpers
def is_lora_param(name: str) -> bool:
    return name.rpartition(".")[2].startswith("lora_")


def lora_layers(module: torch.nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, m in module.named_modules():
        if isinstance(m, LoRALinear) and m.lora is not None and m.adapted:
            yield name, m


def has_adapters(modules: list[torch.nn.Module]) -> bool:
    return any(True for m in modules for _ in lora_layers(m))


def freeze_base(modules: list[torch.nn.Module]) -> None:
    """Only the adapters train: every other parameter is frozen in place, in its dtype. A frozen linear's output
    gradient is handed to its backward with row-major strides (:func:`_fold_frozen_grad`)."""
    for m in modules:
        for name, p in m.named_parameters():
            p.requires_grad_(is_lora_param(name))
        for layer in m.modules():  # (an output layer tied to the embedding holds no weight: it is frozen too)
            if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)) \
                    and (layer.weight is None or not layer.weight.requires_grad) \
                    and not getattr(layer, "_folds_frozen_grad", False):
                layer.register_forward_hook(_fold_frozen_grad)
                layer._folds_frozen_grad = True


def _row_major(grad: torch.Tensor) -> torch.Tensor:
    """The same gradient with row-major strides: a view when its memory already is (only a size-1 dim's stride
    differs), a copy otherwise."""
    return grad.reshape(-1, grad.shape[-1]).view(grad.shape) if grad.dim() > 2 else grad


def _fold_frozen_grad(module: torch.nn.Module, args, output) -> None:
    """mcore runs a frozen linear through ``LinearWithFrozenWeight``, whose backward is ``torch.matmul(grad_output,
    weight)``. torch folds a 3-D ``grad_output`` into one GEMM only when its leading strides are row-major; the output
    layer's gradient arrives as the transpose of [b, s, V] (GPTModel returns ``logits.transpose(0, 1)``), so matmul
    ran s matrix-vector products, each reading the whole [V, h] weight: 0.92 s per 4,096-token micro-batch at
    Qwen2.5-7B's vocabulary on an H200, 86 % of a LoRA step's device time."""
    out = output[0] if isinstance(output, tuple) else output
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.register_hook(_row_major)


@contextlib.contextmanager
def adapters_off(modules: list[torch.nn.Module]):
    """Run the base model: the reference policy of a LoRA actor, with no second copy of the weights."""
    layers = [layer for m in modules for _, layer in lora_layers(m)]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True


def effective_weight(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The value the rollout and an HF export see for parameter ``name`` of ``module``: the merged ``W + s·B·A``
    for an adapted linear's weight (unless its adapters are off: :func:`adapters_off`), the parameter itself
    otherwise."""
    owner, _, leaf = name.rpartition(".")
    if leaf == "weight" and owner:
        try:
            m = module.get_submodule(owner)
        except AttributeError:
            return tensor.data
        if isinstance(m, LoRALinear) and m.lora is not None and m.adapted and m.lora_enabled:
            return m.merged_weight()
    return tensor.data


def _generator(seed: int, layer: int, part: str) -> torch.Generator:
    """A generator per (seed, global layer, part): the initial adapters do not depend on the layout."""
    digest = hashlib.sha256(f"{seed}:{layer}:{part}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


@torch.no_grad()
def init_adapters(chunks: list[torch.nn.Module], spec: LoRASpec) -> None:
    """``A`` as PEFT initialises it (``kaiming``: Kaiming-uniform with a=√5; ``gaussian``: N(0, 1/r)), drawn whole on
    the host from a generator of (seed, global layer, part) and sliced to this rank's columns; ``B`` = 0."""
    for chunk in chunks:
        offset = chunk.stage_layout.layer_offset
        for i, layer in enumerate(chunk.decoder.layers):
            for _, m in lora_layers(layer):
                for part in m.adapted:
                    a, b = getattr(m, f"lora_a_{part}"), getattr(m, f"lora_b_{part}")
                    full_in = a.shape[1] * (1 if m.lora_column else m.tp_group.size())
                    gen = _generator(spec.seed, offset + i, part)
                    if spec.init == "gaussian":
                        full = torch.randn(spec.rank, full_in, generator=gen) / spec.rank
                    else:  # torch's kaiming_uniform_(a=√5) on [r, in]: bound = 1/√in
                        bound = 1.0 / math.sqrt(full_in)
                        full = torch.rand(spec.rank, full_in, generator=gen) * 2 * bound - bound
                    if not m.lora_column:
                        r, w = m.tp_group.rank(), a.shape[1]
                        full = full[:, r * w:(r + 1) * w]
                    a.copy_(full.to(a.dtype))
                    b.zero_()


def spec_from_config(lora_cfg, seed: int) -> LoRASpec | None:
    """``model.lora`` (a :class:`~verl_mega.config.model.LoRAConfig`) → the layers' spec; None when disabled."""
    if not lora_cfg.enabled:
        return None
    return LoRASpec(rank=lora_cfg.rank, alpha=lora_cfg.alpha, dropout=lora_cfg.dropout,
                    targets=resolve_targets(lora_cfg.target_modules), init=lora_cfg.init, seed=seed)


# ---------------------------------------------------------------------------------------------- PEFT adapter export
def _tp_cat(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    import torch.distributed as dist

    n = group.size()
    if n == 1:
        return t.detach().clone()
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.detach().contiguous(), group=group)
    return torch.cat(out, dim=dim)


def _adapters(chunks: list[torch.nn.Module]) -> Iterator[tuple[str, LoRALinear, str]]:
    """(PEFT module name, layer, part) of every adapter on this rank."""
    for chunk in chunks:
        offset = chunk.stage_layout.layer_offset
        for i, layer in enumerate(chunk.decoder.layers):
            for _, m in lora_layers(layer):
                for part in m.adapted:
                    yield f"base_model.model.model.layers.{offset + i}.{HF_MODULE[part]}.{part}", m, part


@torch.no_grad()
def adapter_tensors(chunks: list[torch.nn.Module], groups, *, attr: str | None = None) -> dict[str, torch.Tensor]:
    """Every adapter of the model as PEFT names it (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A
    .weight`` [r, in], ``…lora_B.weight`` [out, r]), whole (gathered over TP, then over the pipeline stages), on the
    host, on every rank (``attr="main_grad"``: their gradients). Collective over the model-parallel ranks. Adapters
    are small: they travel as objects."""
    import torch.distributed as dist

    mine: dict[str, torch.Tensor] = {}
    for name, m, part in _adapters(chunks):
        a, b = (getattr(m, f"lora_{x}_{part}") for x in "ab")
        a, b = (t if attr is None else getattr(t, attr) for t in (a, b))
        a = a.detach().clone() if m.lora_column else _tp_cat(a, m.tp_group, 1)
        b = _tp_cat(b, m.tp_group, 0) if m.lora_column else b.detach().clone()
        mine[f"{name}.lora_A.weight"] = a.cpu()
        mine[f"{name}.lora_B.weight"] = b.cpu()
    if groups.size("pp") == 1:
        return mine
    stages: list = [None] * groups.size("pp")
    dist.all_gather_object(stages, mine, group=groups["pp"])
    return {k: v for stage in stages for k, v in stage.items()}


@torch.no_grad()
def load_adapter_tensors(chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor]) -> int:
    """Whole adapters named as PEFT names them → this rank's shards (the inverse of :func:`adapter_tensors`; no
    communication). Returns how many tensors were loaded; every adapter of the model must be given."""
    n = 0
    for name, m, part in _adapters(chunks):
        for x, peft in (("a", "lora_A"), ("b", "lora_B")):
            key = f"{name}.{peft}.weight"
            if key not in tensors:
                raise KeyError(f"adapter tensor {key} is missing")
            param, full = getattr(m, f"lora_{x}_{part}"), tensors[key]
            split = (x == "b") if m.lora_column else (x == "a")
            if split:
                full = full.chunk(m.tp_group.size(), dim=0 if x == "b" else 1)[m.tp_group.rank()]
            if tuple(full.shape) != tuple(param.shape):
                raise ValueError(f"adapter tensor {key}: shape {tuple(full.shape)}, this rank's shard is "
                                 f"{tuple(param.shape)}")
            param.copy_(full.to(param.dtype))
            n += 1
    return n


def peft_config(spec: LoRASpec, base_model: str | None) -> dict:
    """``adapter_config.json`` for the ``peft`` library (a LoRA for a causal LM)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": sorted(spec.targets), "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "base_model_name_or_path": base_model}


def write_peft_adapter(out_dir, tensors: dict[str, torch.Tensor], spec: LoRASpec, base_model: str | None = None
                       ) -> None:
    """A PEFT adapter directory: ``adapter_config.json`` + ``adapter_model.safetensors``."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(peft_config(spec, base_model), indent=2))


def read_peft_adapter(adapter_dir) -> tuple[LoRASpec, dict[str, torch.Tensor]]:
    """A PEFT LoRA adapter directory → its spec and tensors (for the merge tool)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file

    adapter_dir = Path(adapter_dir)
    cfg_file = adapter_dir / "adapter_config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} is missing; point at a PEFT LoRA adapter directory")
    cfg = json.loads(cfg_file.read_text())
    per_module = [key for key in ("rank_pattern", "alpha_pattern") if cfg.get(key)]
    if (cfg.get("peft_type") != "LORA" or cfg.get("use_rslora") or cfg.get("use_dora") or cfg.get("fan_in_fan_out")
            or per_module):  # each changes the scale or the layout of some modules: one alpha / r would be wrong
        raise ValueError(f"{cfg_file}: only plain LoRA adapters (no rsLoRA, DoRA, fan_in_fan_out, rank_pattern or "
                         f"alpha_pattern) can be merged; merge this one with peft's merge_and_unload()")
    targets = cfg["target_modules"]
    spec = LoRASpec(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), dropout=float(cfg.get("lora_dropout", 0)),
                    targets=resolve_targets("all-linear" if targets == "all-linear" else targets))
    return spec, load_file(str(adapter_dir / "adapter_model.safetensors"))


def merge_into_hf(tensors: Iterator[tuple[str, torch.Tensor]], adapter: dict[str, torch.Tensor], spec: LoRASpec
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of the base model, each targeted projection's weight replaced by ``W + s·B·A`` (summed in fp32,
    rounded once to the weight's dtype). Every adapter must be used."""
    used = set()
    for name, w in tensors:
        key = f"base_model.model.{name.removesuffix('.weight')}"
        a, b = adapter.get(f"{key}.lora_A.weight"), adapter.get(f"{key}.lora_B.weight")
        if name.endswith(".weight") and a is not None and b is not None:
            used |= {f"{key}.lora_A.weight", f"{key}.lora_B.weight"}
            w = (w.float() + spec.scale * (b.float() @ a.float())).to(w.dtype)
        yield name, w
    unused = sorted(set(adapter) - used)
    if unused:
        raise ValueError(f"adapter tensor {unused[0]} (and {len(unused) - 1} more) matches no weight of the base "
                         f"model; the adapter belongs to another model")


def lora_spec_of(modules: list[torch.nn.Module]) -> LoRASpec:
    """The spec the model's adapters were built with."""
    return next(layer.lora for m in modules for _, layer in lora_layers(m))
