"""4-bit weight-only checkpoints (W4A16): GPTQ, AWQ and compressed-tensors' pack-quantized
int4, read into `Int4Linear`'s one layout, and the layer that multiplies by them.

The layout (`w4a16`): an int32 [out, in / 8] of unsigned 4-bit codes, column c of a row in
bits 4 * (c % 8) of word c // 8; scales [out, groups] in the model dtype and zero points uint8
[out, groups], one per row and group of `group_size` input columns:
w[n, c] = (q[n, c] - zero[n, g]) * scale[n, g], g = c // group_size.

What each checkpoint stores (`quantization_config.quant_method`), per projection:
- "gptq": `qweight` int32 [in / 8, out] (codes packed down the input columns, the same bit order:
  its transpose is the layout), `qzeros` int32 [groups, out / 8], `scales` [groups, out] and
  `g_idx` [in]; `checkpoint_format` "gptq" (the default) stores each zero point less one,
  "gptq_v2" as it is. Act-order checkpoints (`desc_act`) group the input columns in another
  order, column c in group g_idx[c]: the codes' columns are put in group order at load and the
  layer gathers its input into that order (`Int4Linear.input_perm`).
- "awq" (version "gemm"): `qweight` int32 [in, out / 8] and `qzeros` [groups, out / 8], packed
  along the output columns with column 8j + AWQ_ORDER[i] in bits 4i of word j; `scales`
  [groups, out].
- "compressed-tensors", format "pack-quantized" (symmetric int4): `weight_packed` int32
  [out, in / 8] holding each signed code plus 8 (the layout, zero point 8), `weight_scale`
  [out, groups], `weight_shape`.
`load_format="dummy"` with `quantization="gptq"` (or "awq", "compressed-tensors") quantizes the
random weights here: symmetric, groups of 128 (one scale per row where 128 does not divide a
layer's input width).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.model_files import read_json
from tandem.quant import w4a16

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]
DUMMY_GROUP_SIZE = 128
# where older checkpoints keep their settings, config.json lacking a quantization_config
SEPARATE_CONFIGS = {
    "gptq": ("quantize_config.json",),
    "awq": ("quant_config.json", "quantize_config.json"),
}
# a projection's tensors in each format, by suffix -> our parameter's suffix
PARTS = {
    "gptq": {"qweight": "weight_packed", "qzeros": "weight_zero_point", "scales": "weight_scale"},
    "awq": {"qweight": "weight_packed", "qzeros": "weight_zero_point", "scales": "weight_scale"},
    "compressed-tensors": {"weight_packed": "weight_packed", "weight_scale": "weight_scale"},
}


@dataclass(frozen=True)
class Int4Config:
    """The int4 scheme of the decoder's linear layers (embeddings, norms, the LM head and
    mixture-of-experts blocks stay in the model dtype)."""

    method: str  # the checkpoint's layout: "gptq", "awq", "compressed-tensors" or "dummy"
    group_size: int | None  # input columns per scale; None: one scale per row
    zeros_less_one: bool = False  # GPTQ's first format stores each zero point less one
    act_order: bool = False  # GPTQ's desc_act: input columns grouped by g_idx, not in order


def int4_config(qc: dict[str, Any]) -> Int4Config | None:
    """The int4 scheme of a config.json's quantization_config; None where it is not int4.
    ValueError naming what is not supported."""
    method = qc.get("quant_method")
    if method == "gptq":
        return _gptq(qc)
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors" and _formats(qc) == {"pack-quantized"}:
        return _pack_quantized(qc)
    return None


def separate_config(folder: Path | None, method: str | None) -> dict[str, Any] | None:
    """The settings file an older GPTQ or AWQ checkpoint keeps beside its config.json (read
    where `quantization` names the method), as a quantization_config; None without one."""
    names = SEPARATE_CONFIGS.get(method or "", ())
    found = [folder / name for name in names if folder is not None and (folder / name).is_file()]
    if not found:
        return None
    return {**read_json(found[0]), "quant_method": method}


def dummy_config() -> Int4Config:
    return Int4Config("dummy", DUMMY_GROUP_SIZE)


def dummy_group_size(in_features: int) -> int | None:
    return DUMMY_GROUP_SIZE if in_features % DUMMY_GROUP_SIZE == 0 else None


def layer_factory(config: Int4Config) -> Callable[..., nn.Module]:
    """(in, out, bias=) -> an `Int4Linear` of the scheme's group size (random weights': by
    the layer's width)."""
    if config.method != "dummy":
        return functools.partial(
            Int4Linear, group_size=config.group_size, act_order=config.act_order
        )

    def make(in_features: int, out_features: int, bias: bool) -> Int4Linear:
        return Int4Linear(in_features, out_features, bias, dummy_group_size(in_features))

    return make


def _bits(qc: dict[str, Any], *names: str) -> None:
    bits = next((qc[name] for name in names if name in qc), None)
    if bits != 4:
        raise ValueError(
            f"quantization_config.{names[0]} is {bits!r}: only 4-bit weights are supported"
        )


def _group_size(value: Any, field: str) -> int | None:
    if value in (None, -1):
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 8:
        raise ValueError(
            f"quantization_config.{field} must be -1 or a positive multiple of 8, got {value!r}"
        )
    return value


def _gptq(qc: dict[str, Any]) -> Int4Config:
    _bits(qc, "bits")
    if qc.get("lm_head"):
        raise ValueError(
            "GPTQ checkpoints with a quantized LM head (lm_head=true) are not supported"
        )
    if qc.get("dynamic"):
        raise ValueError("GPTQ checkpoints with per-module overrides (dynamic) are not supported")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"GPTQ checkpoint_format {fmt!r} is not supported; supported: 'gptq', 'gptq_v2'"
        )
    size = _group_size(qc.get("group_size", -1), "group_size")
    # one group a row: the order of the columns changes nothing
    return Int4Config("gptq", size, fmt == "gptq", bool(qc.get("desc_act")) and size is not None)


def _awq(qc: dict[str, Any]) -> Int4Config:
    _bits(qc, "bits", "w_bit")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported; supported: 'gemm'")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ checkpoints without zero points (zero_point=false) are not supported")
    if qc.get("modules_to_not_convert"):
        raise ValueError(
            "AWQ checkpoints that leave modules unquantized (modules_to_not_convert "
            f"{qc['modules_to_not_convert']!r}) are not supported"
        )
    size = qc["group_size"] if "group_size" in qc else qc.get("q_group_size", -1)
    return Int4Config("awq", _group_size(size, "group_size"))


def _formats(qc: dict[str, Any]) -> set[str]:
    groups = (qc.get("config_groups") or {}).values()
    return {group.get("format") or qc.get("format") for group in groups}


def _pack_quantized(qc: dict[str, Any]) -> Int4Config:
    sizes = set()
    for group in qc["config_groups"].values():
        weights = group.get("weights") or {}
        if weights.get("type") != "int" or weights.get("num_bits") != 4:
            raise ValueError(
                f"compressed-tensors pack-quantized weights {weights!r}: only 4-bit int is supported"
            )
        if not weights.get("symmetric", True):
            raise ValueError(
                "compressed-tensors pack-quantized weights with zero points (symmetric=false) "
                "are not supported"
            )
        if weights.get("actorder") not in (None, False):
            raise ValueError(
                f"compressed-tensors actorder {weights['actorder']!r} is not supported"
            )
        if group.get("input_activations") is not None:
            raise ValueError(
                "compressed-tensors pack-quantized with quantized input_activations is not "
                "supported (4-bit weights with activations in the model dtype are)"
            )
        strategy = weights.get("strategy")
        if strategy == "group":
            sizes.add(_group_size(weights.get("group_size"), "group_size"))
        elif strategy == "channel":
            sizes.add(None)
        else:
            raise ValueError(
                f"compressed-tensors int4 weight strategy {strategy!r} is not supported; "
                "supported: 'group', 'channel'"
            )
    if len(sizes) != 1:
        raise ValueError(
            "compressed-tensors config_groups with different weight schemes; one int4 scheme "
            "for every linear layer is supported"
        )
    return Int4Config("compressed-tensors", sizes.pop())


def _unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [rows, n] -> uint8 [rows, 8n]: column 8j + AWQ_ORDER[i] from bits 4i of word
    j (`w4a16.unpack` reads the layout's plain order)."""
    place = [AWQ_ORDER.index(c) for c in range(8)]  # the nibble of each column
    shifts = torch.tensor([4 * i for i in place], dtype=torch.int32, device=words.device)
    values = (words.unsqueeze(-1) >> shifts) & 0xF  # [rows, n, 8]
    return values.reshape(words.shape[0], -1).to(torch.uint8)


def checkpoint_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], config: Int4Config
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in `Int4Linear`'s layout, under its parameter names (a
    projection's `weight_packed`, `weight_scale`, `weight_zero_point`, and with act-order its
    `input_perm`); other tensors as they are. ValueError for a g_idx the scheme does not take
    or a tensor that does not fit the layout."""
    if config.method == "dummy":
        yield from _quantized_at_load(tensors)
        return
    parts = PARTS[config.method]
    held: dict[str, dict[str, torch.Tensor]] = {}  # act-order: a projection's g_idx and qweight
    for name, tensor in tensors:
        module, _, kind = name.rpartition(".")
        if config.act_order and kind in ("g_idx", "qweight"):
            mine = held.setdefault(module, {})
            mine[kind] = tensor
            if len(mine) == 2:
                yield from _in_group_order(module, held.pop(module), config.group_size)
            continue
        if kind == "g_idx":
            _check_g_idx(name, tensor, config.group_size)
            continue
        if kind == "weight_shape":
            continue
        if config.method == "compressed-tensors" and kind == "weight_zero_point":
            # older compressed-tensors wrote a symmetric scheme's zero points: all 0 (signed);
            # the layer's own, 8, are made beside the scales below
            if tensor.any():
                raise ValueError(
                    f"checkpoint tensor {name!r} holds non-zero zero points: compressed-tensors "
                    "int4 is read as symmetric (zero points 0) only"
                )
            continue
        if kind not in parts:
            yield name, tensor
            continue
        target = f"{module}.{parts[kind]}"
        if tensor.dtype != torch.int32 and kind in ("qweight", "qzeros", "weight_packed"):
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; int32 expected")
        if kind == "scales":  # GPTQ's and AWQ's [groups, out]
            yield target, tensor.t().contiguous()
        elif config.method == "gptq":
            if kind == "qweight":
                yield target, tensor.t().contiguous()  # [out, in / 8]
            else:  # qzeros [groups, out / 8] -> [out, groups]
                zeros = w4a16.unpack(tensor).t().contiguous()
                yield target, zeros + 1 if config.zeros_less_one else zeros
        elif config.method == "awq":
            if kind == "qweight":
                yield target, w4a16.pack(_unpack_awq(tensor).t())
            else:
                yield target, _unpack_awq(tensor).t().contiguous()
        else:
            yield target, tensor
            if kind == "weight_scale":  # symmetric codes stored plus 8: every zero point is 8
                yield f"{module}.weight_zero_point", torch.full_like(tensor, 8, dtype=torch.uint8)

    if held:
        module, mine = next(iter(held.items()))
        lacking = "qweight" if "g_idx" in mine else "g_idx"
        raise ValueError(f"checkpoint lacks {module}.{lacking} (desc_act=true needs both)")


def _in_group_order(
    module: str, tensors: dict[str, torch.Tensor], group_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """An act-order projection's codes with their input columns in group order, and that order
    (`input_perm` [in] int32: column j of the layer is input column input_perm[j])."""
    g_idx = tensors["g_idx"].reshape(-1).long()
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], torch.arange(g_idx.numel()) // group_size):
        raise ValueError(
            f"checkpoint tensor {module}.g_idx does not put {group_size} input columns in "
            "each group"
        )
    codes = w4a16.unpack(tensors["qweight"].t().contiguous())  # [out, in]
    yield f"{module}.weight_packed", w4a16.pack(codes[:, perm])
    yield f"{module}.input_perm", perm.to(torch.int32)


def _check_g_idx(name: str, g_idx: torch.Tensor, group_size: int | None) -> None:
    columns = torch.arange(g_idx.numel(), device=g_idx.device)
    plain = columns // group_size if group_size else torch.zeros_like(columns)
    if not torch.equal(g_idx.reshape(-1).long(), plain):
        raise ValueError(
            f"checkpoint tensor {name!r} regroups the input columns (act-order) where "
            "quantization_config says desc_act=false"
        )


def quantize(weight: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, ...]:
    """[out, in] float -> (codes int32 [out, in / 8], scale [out, groups] in weight's dtype,
    zero uint8 [out, groups]): symmetric, each group's largest magnitude at code 8 +- 7."""
    out, cols = weight.shape
    size = group_size or cols
    groups = weight.float().reshape(out, cols // size, size)
    scale = (groups.abs().amax(dim=-1) / 7).clamp(min=torch.finfo(torch.float32).tiny)
    scale = scale.to(weight.dtype)  # the scale the layer multiplies by
    codes = (groups / scale.float()[..., None]).round().clamp(-8, 7) + 8
    packed = w4a16.pack(codes.reshape(out, cols).to(torch.uint8))
    return packed, scale, torch.full(scale.shape, 8, dtype=torch.uint8, device=weight.device)


def _quantized_at_load(
    tensors: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    from tandem.quant.checkpoint import is_linear_weight  # it imports us

    for name, tensor in tensors:
        if not is_linear_weight(name):
            yield name, tensor
            continue
        packed, scale, zero = quantize(tensor, dummy_group_size(tensor.shape[1]))
        module = name.removesuffix(".weight")
        yield f"{module}.weight_packed", packed
        yield f"{module}.weight_scale", scale
        yield f"{module}.weight_zero_point", zero


class Int4Linear(nn.Module):
    """y = x W^T + b with W stored as 4-bit codes, scales and zero points (the module's layout
    above), dequantized inside the product (`w4a16.w4a16_linear`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        group_size: int | None = None,
        act_order: bool = False,
    ):
        super().__init__()
        if in_features % w4a16.PACK or (group_size and in_features % group_size):
            raise ValueError(
                f"int4 weights need input features ({in_features}) divisible by 8 and by the "
                f"group size ({group_size})"
            )
        self.in_features, self.out_features = in_features, out_features
        self.group_size = group_size or in_features
        groups = in_features // self.group_size
        # [out, in / 8] int32, [out, groups] model dtype, [out, groups] uint8: the loader's
        self.weight_packed = nn.Parameter(
            torch.empty(out_features, in_features // w4a16.PACK, dtype=torch.int32),
            requires_grad=False,
        )
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        self.weight_zero_point = nn.Parameter(
            torch.empty(out_features, groups, dtype=torch.uint8), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.input_perm = None
        if act_order:  # [in] int32: the input column of each of the codes' columns
            self.input_perm = nn.Parameter(
                torch.empty(in_features, dtype=torch.int32), requires_grad=False
            )
            # stacked q/k/v (gate/up) share their input: one order for the stack (the loader)
            self.input_perm.whole = True

    @property
    def bytes_per_weight(self) -> float:
        """Bytes read per weight, its scale and zero point shared out (the roofline's)."""
        scale = self.weight_scale.element_size() + self.weight_zero_point.element_size()
        return 0.5 + scale / self.group_size

    def forward(self, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        y = self._product(x.reshape(-1, self.in_features))
        if add_bias and self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def residual_partials(self, x: torch.Tensor) -> torch.Tensor:
        """The o or down projection on one device, without a bias (`decoder.to_residual`):
        [rows, out], or a split-K product's float32 partial sums [splits, rows, out] that the
        next add + RMSNorm adds up."""
        return self._product(x, partials=True)

    def _product(self, rows: torch.Tensor, partials: bool = False) -> torch.Tensor:
        if self.input_perm is not None:
            rows = rows.index_select(1, self.input_perm)
        return w4a16.w4a16_linear(
            rows.contiguous(), self.weight_packed, self.weight_scale, self.weight_zero_point,
            self.group_size, partials,
        )  # fmt: skip
