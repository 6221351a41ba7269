"""FP8 activation quantization fused into the add + RMSNorm and SiLU * up kernels (interpreted
on CPU): their e4m3 codes and scales against `fp8.quantize_rows` of the unfused output, the
`Fp8Rows` seam of `Fp8Linear`, and which norms and activations `prepare` has quantize."""

from __future__ import annotations

import functools

import pytest
import torch

from tandem.batch_invariant import make_batch_invariant
from tandem.config import ModelConfig
from tandem.model import fused
from tandem.model.decoder import MLP, Decoder
from tandem.model.tiny import ARCH_CONFIGS, COMMON_CONFIG
from tandem.parallel import TensorParallel, shard_config
from tandem.quant import fp8
from tandem.quant import linear as fp8_linear
from tandem.quant.checkpoint import Fp8Config
from tandem.quant.fp8 import Fp8Rows, _quantize_tokens_triton, quantize_rows
from tandem.quant.linear import Fp8Linear

E4M3 = torch.float8_e4m3fn
DTYPE = torch.float16  # the model dtype under the interpreter (its bf16 is unreliable)
WIDTHS = [64, 1000, 4096]
STEP = 2.0**-3


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def assert_same_rows(got: Fp8Rows, codes: torch.Tensor, scale: torch.Tensor) -> None:
    assert got.values.dtype == E4M3 and got.scale.shape == scale.shape
    assert torch.equal(got.scale, scale)
    assert torch.equal(bits(got.values), bits(codes))


def e4m3_values(rows: int, cols: int, seed: int) -> torch.Tensor:
    """[rows, cols] float32: random finite e4m3 values, signed, each row's first one 448 (its
    largest magnitude). Times a power of two they quantize with no rounding, so no rounding
    decides the codes (Triton's interpreter rounds some float32 -> e4m3 conversions wrongly,
    e.g. 126.3 -> 64; the GPU tests cover the device's rounding)."""
    codes = torch.randint(0, 256, (rows, cols), generator=torch.Generator().manual_seed(seed))
    values = codes.to(torch.uint8).view(E4M3).float()
    values = torch.where(values.isnan(), 0.0, values)
    values[:, 0] = 448.0
    return values


def norm_inputs(rows: int, hidden: int, mode: str, target: torch.Tensor):
    """(x, residual) whose sum, as the kernel forms it, is `target` exactly: x alone, x plus a
    residual, or two float32 split-K partials plus a residual."""
    if mode == "plain":
        return target.clone(), None
    if mode == "residual":
        return target / 2, target / 2
    return (target.float() / 4).expand(2, rows, hidden).contiguous(), target / 2


def exact_norm_rows(rows: int, hidden: int) -> torch.Tensor:
    """Rows of +-c (c a power of two) over their first hidden / f columns, zeros past them,
    f in 1, 4, 16 by row: RMSNorm makes the kept columns +-sqrt(f) exactly (eps 0), so each row
    has its own scale and norm * weight is exact."""
    g = torch.Generator().manual_seed(rows * hidden)
    factors = [f for f in (1, 4, 16) if hidden % f == 0]
    target = torch.zeros(rows, hidden)
    for r in range(rows):
        kept = hidden // factors[r % len(factors)]
        signs = torch.randint(0, 2, (kept,), generator=g) * 2 - 1
        target[r, :kept] = signs * 2.0 ** (r % 3 - 1)
    return target.to(DTYPE)


@pytest.mark.parametrize("mode", ["plain", "residual", "parts"])
@pytest.mark.parametrize("hidden", WIDTHS)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_fused_norm_quantizes_as_quantize_rows_of_the_torch_norm(rows, hidden, mode):
    weight = (e4m3_values(1, hidden, hidden)[0] * STEP).to(DTYPE)
    x, residual = norm_inputs(rows, hidden, mode, exact_norm_rows(rows, hidden))
    kernel_residual = None if residual is None else residual.clone()
    got, summed = fused._add_rms_norm_triton(x, kernel_residual, weight, 0.0, fp8_out=True)
    torch_residual = None if residual is None else residual.clone()
    out, torch_summed = fused.add_rms_norm(x.clone(), torch_residual, weight, 0.0)
    assert got.dtype == DTYPE and torch.equal(summed, torch_summed)
    codes, scale = quantize_rows(out)
    assert_same_rows(got, codes, scale)
    assert len(scale.unique()) == min(rows, 3 if hidden % 16 == 0 else 2)  # a scale per row
    torch_path, _ = fused.add_rms_norm(x.clone(), residual, weight, 0.0, fp8_out=True)
    assert_same_rows(torch_path, codes, scale)


@pytest.mark.parametrize("mode", ["plain", "residual", "parts"])
@pytest.mark.parametrize("hidden", WIDTHS)
def test_fused_norm_is_the_unfused_kernel_then_quantize_tokens_bit_for_bit(hidden, mode):
    """Random rows, eps > 0: whatever the interpreter's e4m3 rounding, the same codes as the
    unfused path's two kernels, and quantize_rows' scales."""
    g = torch.Generator().manual_seed(hidden)
    target = (torch.randn(5, hidden, generator=g) * 3).to(DTYPE)
    weight = (1 + 0.3 * torch.randn(hidden, generator=g)).to(DTYPE)
    x, residual = norm_inputs(5, hidden, mode, target)
    residuals = [None if residual is None else residual.clone() for _ in range(2)]
    got, _ = fused._add_rms_norm_triton(x, residuals[0], weight, 1e-6, fp8_out=True)
    out, _ = fused._add_rms_norm_triton(x, residuals[1], weight, 1e-6)
    codes, scale = _quantize_tokens_triton(out)
    assert_same_rows(got, codes, scale)
    assert torch.equal(scale, quantize_rows(out)[1])


def exact_gate_up(rows: int, inter: int) -> torch.Tensor:
    """gate 2^5-2^7 by row, where SiLU(gate) = gate in float32 (exp(-32) vanishes next to
    1), and up e4m3 values times a power of two: SiLU * up is exact, each row with its scale."""
    gate = (2.0 ** (5 + torch.arange(rows) % 3))[:, None].expand(rows, inter)
    up = e4m3_values(rows, inter, inter) * STEP
    return torch.cat([gate, up], dim=1).to(DTYPE)


@pytest.mark.parametrize(
    ("rows", "inter"), [(1, 64), (5, 64), (33, 64), (1, 1000), (5, 1000), (33, 1000),
                        (1, 4096), (5, 4096), (33, 4096), (2, 14336), (1, 16400)],
)  # fmt: skip
def test_fused_silu_and_mul_quantizes_as_quantize_rows_of_torch(rows, inter):
    """Up to 16,384 columns one program per row (14,336: Llama-3-8B); wider rows the plain
    kernel and quantize_tokens."""
    gate_up = exact_gate_up(rows, inter)
    got = fused._silu_and_mul_fp8_triton(gate_up)
    out = fused.silu_and_mul(gate_up)  # torch
    codes, scale = quantize_rows(out)
    assert got.dtype == DTYPE
    assert_same_rows(got, codes, scale)
    assert len(scale.unique()) == min(rows, 3)
    assert_same_rows(fused.silu_and_mul(gate_up, fp8_out=True), codes, scale)


@pytest.mark.parametrize("inter", WIDTHS)
def test_fused_silu_and_mul_is_the_unfused_kernel_then_quantize_tokens_bit_for_bit(inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=g) * 4).to(DTYPE)
    got = fused._silu_and_mul_fp8_triton(gate_up)
    out = fused._silu_and_mul_triton(gate_up)
    codes, scale = _quantize_tokens_triton(out)
    assert_same_rows(got, codes, scale)
    assert torch.equal(scale, quantize_rows(out)[1])


def w8a8_layer(out_features: int, in_features: int, bias: bool, seed: int) -> Fp8Linear:
    """A W8A8 layer in float32 (the flag forced: CPU has no FP8 GEMM), its weights random."""
    g = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(in_features, out_features, bias=bias)
    q, scale = quantize_rows(torch.randn(out_features, in_features, generator=g))
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    if bias:
        layer.bias.data.copy_(torch.randn(out_features, generator=g))
    layer.w8a8 = True
    return layer


@pytest.fixture
def quantize_calls(monkeypatch) -> list[int]:
    """Counts the layers' own quantizing launches (fp8.quantize_tokens), which run its Triton
    kernel, interpreted, as on CUDA (on CPU it would quantize in torch, which rounds to e4m3
    unlike the interpreter)."""
    calls = []

    def counted(x):
        calls.append(x.shape[0])
        return _quantize_tokens_triton(x)

    monkeypatch.setattr(fp8, "quantize_tokens", counted)
    return calls


@pytest.mark.parametrize("rows", [5, 40, 100])
def test_fp8_linear_given_fp8_rows_equals_it_given_the_rows_they_came_from(rows, quantize_calls):
    """Split-K over e4m3 x (interpreted) up to 64 rows, torch._scaled_mm past them; the o/down
    form's slices likewise. Given Fp8Rows the layer quantizes nothing itself."""
    g = torch.Generator().manual_seed(rows)
    layer = w8a8_layer(48, 256, bias=True, seed=rows)
    x = torch.randn(rows, 256, generator=g)
    x8 = Fp8Rows.of(x)
    quantize_calls.clear()
    assert torch.equal(layer(x8), layer(x))
    assert quantize_calls == [rows]  # the bf16 call's
    assert layer.takes_fp8_rows(rows)
    no_bias = w8a8_layer(48, 256, bias=False, seed=rows)
    if rows <= fp8_linear.SPLITK_W8A8_ROWS:
        assert no_bias.takes_fp8_rows(rows, residual=True)
        assert torch.equal(no_bias.residual_partials(x8), no_bias.residual_partials(x))
    else:  # split-K reads bf16 rows here (W8A16): they stay unquantized
        assert not no_bias.takes_fp8_rows(rows, residual=True)


def test_past_64_rows_the_residual_form_takes_fp8_rows_where_split_k_declines(quantize_calls):
    """1,024 outputs fill the interpreter's 8 SMs without splits, so the o/down form is the
    layer's own product (W8A8): it takes Fp8Rows."""
    layer = w8a8_layer(1024, 256, bias=False, seed=0)
    x = torch.randn(100, 256, generator=torch.Generator().manual_seed(1))
    assert layer.takes_fp8_rows(100, residual=True)
    quantize_calls.clear()
    assert torch.equal(layer.residual_partials(Fp8Rows.of(x)), layer.residual_partials(x))
    assert quantize_calls == [100, 100]  # Fp8Rows.of, then the bf16 call's own


def test_no_fp8_rows_at_one_row_or_for_w8a16():
    layer = w8a8_layer(48, 256, bias=False, seed=0)
    assert not layer.takes_fp8_rows(1) and not layer.takes_fp8_rows(1, residual=True)
    layer.w8a8 = False
    assert not layer.takes_fp8_rows(8) and not layer.takes_fp8_rows(8, residual=True)


def tiny_decoder(arch: str, tp: TensorParallel | None = None) -> Decoder:
    """A tiny `arch` decoder in float32 with FP8 projections, random weights."""
    hf = {**COMMON_CONFIG, **ARCH_CONFIGS[arch], "vocab_size": 128}
    cfg, tp = ModelConfig.from_hf(hf), tp or TensorParallel()
    model = Decoder(shard_config(cfg, tp), 64, tp, Fp8Config(True, "channel"))
    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            q, scale = quantize_rows(torch.randn(module.weight.shape, generator=g) * 0.2)
            module.weight.data.copy_(q)
            module.weight_scale.data.copy_(scale)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.copy_(1 + 0.2 * torch.randn(param.shape, generator=g))
    return model


def prepared(model: Decoder, monkeypatch, fp8_gemm: bool = True) -> Decoder:
    """`prepare` as on a GPU with FP8 tensor cores (the model's dtype aside)."""
    monkeypatch.setattr(fp8_linear, "has_fp8_gemm", lambda device: fp8_gemm)
    fp8_linear.prepare(model, torch.bfloat16, torch.device("cpu"))
    return model


def quantized_outputs(model: Decoder) -> dict[str, object]:
    """Every module of `model` that was told to quantize its output: name -> what asks."""
    return {
        name: module.quantize_out
        for name, module in model.named_modules()
        if getattr(module, "quantize_out", None) is not None
    }


def test_prepare_has_the_norms_and_swiglu_before_w8a8_layers_quantize(monkeypatch):
    model = prepared(tiny_decoder("llama"), monkeypatch)
    expected = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        expected[f"layers.{i}.input_layernorm"] = attn.qkv_proj.takes_fp8_rows
        expected[f"layers.{i}.post_attention_layernorm"] = mlp.gate_up_proj.takes_fp8_rows
        expected[f"layers.{i}.mlp"] = functools.partial(mlp.down_proj.takes_fp8_rows, residual=True)
    got = quantized_outputs(model)
    assert got.keys() == expected.keys()  # not the final norm (the LM head's input)
    for name, wanted in got.items():
        if isinstance(wanted, functools.partial):
            assert wanted.func == expected[name].func and wanted.keywords == {"residual": True}
        else:
            assert wanted == expected[name]


def test_a_moe_layer_quantizes_only_its_attention_input(monkeypatch):
    """The router reads the post-attention norm in the model dtype: that norm stays as is."""
    model = prepared(tiny_decoder("qwen3_moe"), monkeypatch)
    dense = [i for i, layer in enumerate(model.layers) if type(layer.mlp) is MLP]
    names = {f"layers.{i}.input_layernorm" for i in range(len(model.layers))}
    names |= {f"layers.{i}.{m}" for i in dense for m in ("post_attention_layernorm", "mlp")}
    assert set(quantized_outputs(model)) == names
    assert len(dense) < len(model.layers)


@pytest.mark.parametrize("case", ["gemma2", "tensor_parallel", "switched_off", "w8a16"])
def test_nothing_quantizes_outside_one_device_llama_style_w8a8(monkeypatch, case):
    if case == "switched_off":
        monkeypatch.setenv("TANDEM_FP8_FUSED_QUANT", "0")
    arch = "gemma2" if case == "gemma2" else "llama"
    tp = TensorParallel(0, 2) if case == "tensor_parallel" else None
    model = prepared(tiny_decoder(arch, tp), monkeypatch, fp8_gemm=case != "w8a16")
    assert quantized_outputs(model) == {}
    assert any(m.w8a8 for m in model.modules() if isinstance(m, Fp8Linear)) == (case != "w8a16")


def test_deterministic_mode_refuses_a_model_with_fused_quantization(monkeypatch):
    model = prepared(tiny_decoder("llama"), monkeypatch)
    assert quantized_outputs(model)
    with pytest.raises(ValueError, match="Fp8Linear"):
        make_batch_invariant(model)


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_a_layer_with_fused_quantization_computes_the_unfused_bits(
    monkeypatch, quantize_calls, rows
):
    """A Llama layer's norm -> qkv and o -> norm -> MLP with every kernel interpreted: the same
    bits with the fused quantization as without, and past one row one quantizing launch (the
    o projection's) in place of four."""
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    layer = prepared(tiny_decoder("llama"), monkeypatch).layers[0]
    g = torch.Generator().manual_seed(rows)
    x, attended = torch.randn(rows, 64, generator=g), torch.randn(rows, 64, generator=g)
    residual = torch.randn(rows, 64, generator=g)
    results, launches = {}, {}
    for fuse in (True, False):
        if not fuse:
            for module in (layer.input_layernorm, layer.post_attention_layernorm, layer.mlp):
                module.quantize_out = None
        quantize_calls.clear()
        h, stream = layer.input_layernorm.add_forward(x, residual.clone())
        qkv = layer.self_attn.qkv_proj(h)
        out, stream = layer.after_attention(attended, stream)
        results[fuse], launches[fuse] = (qkv, out, stream), len(quantize_calls)
    for with_fusion, without in zip(results[True], results[False], strict=True):
        assert torch.equal(with_fusion, without)
    assert (launches[True], launches[False]) == ((0, 0) if rows == 1 else (1, 4))
