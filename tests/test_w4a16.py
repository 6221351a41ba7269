"""4-bit weight-only linear layers: the packing of int4 codes into int32 words, dequantization and
the W4A16 kernel (Triton's interpreter on CPU), against references written from the formulas."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tandem.quant import w4a16

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 dots are wrong in Triton's interpreter: float16 stands in for it on CPU
DTYPES = [torch.float32, torch.bfloat16 if DEVICE.type == "cuda" else torch.float16]


def reference_pack(q: np.ndarray) -> np.ndarray:
    """word = sum over c of q[c] << 4 * (c % 8), for the 8 codes c of each word."""
    words = np.zeros((q.shape[0], q.shape[1] // 8), dtype=np.uint32)
    for position in range(8):
        words |= q[:, position::8].astype(np.uint32) << np.uint32(4 * position)
    return words.view(np.int32)


def reference_unpack(packed: np.ndarray) -> np.ndarray:
    words = packed.view(np.uint32)
    q = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.uint8)
    for position in range(8):
        q[:, position::8] = (words >> np.uint32(4 * position)) & np.uint32(0xF)
    return q


def reference_weight(packed, scale, zero, group_size) -> np.ndarray:
    """[out, in] float64: w[n, c] = (q[n, c] - zero[n, c // g]) * scale[n, c // g]."""
    q = reference_unpack(packed.cpu().numpy()).astype(np.float64)
    columns = np.arange(q.shape[1]) // group_size
    s = scale.cpu().double().numpy()[:, columns]
    z = zero.cpu().numpy().astype(np.float64)[:, columns]
    return (q - z) * s


def assert_within_rounding(out, x, weight):
    """out equals x @ weight.T (weight float64 [out, in]) up to what rounding each weight and
    each output to x's dtype may cost: u * (|x| @ |w|.T) + 2u * |exact|, u its unit roundoff
    (float32: the tolerance of summing in another order)."""
    x = x.cpu().double().numpy()
    exact = x @ weight.T
    u = {torch.float32: 1e-6, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[out.dtype]
    bound = u * (np.abs(x) @ np.abs(weight).T) + 2 * u * np.abs(exact) + 1e-6
    error = np.abs(out.cpu().double().numpy() - exact)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert (error <= bound).all(), f"error {error[worst]} > bound {bound[worst]} at {worst}"


def random_int4(out_features, in_features, group_size, dtype, seed=0, device=DEVICE):
    """(packed, scale, zero) of random codes, zeros and scales; weights about 1/sqrt(in)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group_size
    q = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    zero = torch.randint(0, 16, (out_features, groups), generator=g, dtype=torch.uint8)
    scale = (0.5 + torch.rand(out_features, groups, generator=g)) / (4 * in_features**0.5)
    return w4a16.pack(q).to(device), scale.to(dtype).to(device), zero.to(device)


def test_pack_puts_code_c_in_bits_4_times_c_mod_8_of_word_c_div_8():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 15, 0, 0, 0, 0, 0, 0, 0, 15]], dtype=torch.uint8)
    # 0xF7654321 and 0xF0000000 (only the high nibble set), read as int32
    assert w4a16.pack(q).tolist() == [[0xF7654321 - (1 << 32), -(1 << 28)]]


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_pack_and_unpack_match_the_bit_formula_and_invert_each_other(dtype):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (37, 96), generator=g).to(dtype)
    q[:, 7::8] = 15  # every word's high nibble set: negative int32 words
    packed = w4a16.pack(q)
    assert packed.dtype == torch.int32 and packed.shape == (37, 12)
    assert (packed < 0).all()
    np.testing.assert_array_equal(packed.numpy(), reference_pack(q.numpy()))
    unpacked = w4a16.unpack(packed)
    assert unpacked.dtype == torch.uint8
    np.testing.assert_array_equal(unpacked.numpy(), reference_unpack(packed.numpy()))
    assert torch.equal(unpacked, q.to(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 128, 384])
def test_dequantize_is_codes_minus_zero_times_scale(dtype, group_size):
    packed, scale, zero = random_int4(48, 384, group_size, dtype, seed=group_size)
    w = w4a16.dequantize(packed, scale, zero, group_size, dtype)
    assert w.dtype == dtype and w.shape == (48, 384)
    # the float32 product rounded once to dtype
    expected = torch.from_numpy(reference_weight(packed, scale, zero, group_size)).to(dtype)
    torch.testing.assert_close(w.cpu(), expected, atol=0, rtol=0)


@pytest.fixture(
    params=[(True, 0), (False, 0), (True, 32), (False, 32)],
    ids=["lanes16", "float32", "planes-lanes16", "planes-float32"],
)
def unpacking(request, monkeypatch):
    """Each way the kernels may turn codes into weights (the same bits either way), with the
    K steps whole or a bit plane at a time (where the plan takes planes: up to 32 rows, inputs
    of whole 128-feature steps)."""
    monkeypatch.setattr(w4a16, "LANES16", request.param[0])
    monkeypatch.setattr(w4a16, "PLANES_ROWS", request.param[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
@pytest.mark.parametrize(
    ("out_features", "in_features", "group_size"),
    [(80, 256, 32), (200, 384, 128), (80, 384, 384)],  # 384: a scale per row
)
def test_kernel_matches_the_dequantized_product(
    unpacking, dtype, rows, out_features, in_features, group_size
):
    assert DEVICE.type == "cuda" or w4a16.INTERPRETED  # the kernel, not the CPU path
    packed, scale, zero = random_int4(out_features, in_features, group_size, dtype, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    x = x.to(dtype).to(DEVICE)
    out = w4a16.w4a16_linear(x, packed, scale, zero, group_size)
    assert out.dtype == dtype and out.shape == (rows, out_features)
    assert_within_rounding(out, x, reference_weight(packed, scale, zero, group_size))


@pytest.mark.parametrize("planes", [False, True])
@pytest.mark.parametrize("group_size", [32, 48])  # 48: scales per column of a step
def test_16_bit_lanes_and_float32_give_the_same_bits(monkeypatch, group_size, planes):
    """(128 + q) - (128 + z) is exact in bf16 (1024 in fp16), and times a scale of that dtype
    rounds once, as (q - z) * s in float32 rounded does: the two ways agree to the bit, in
    either kernel."""
    dtype = DTYPES[-1]
    monkeypatch.setattr(w4a16, "PLANES_ROWS", 32 if planes else 0)
    packed, scale, zero = random_int4(72, 384, group_size, dtype, seed=5)
    x = torch.randn(9, 384, generator=torch.Generator().manual_seed(5)).to(dtype).to(DEVICE)
    assert w4a16.plan(9, 72, 384, group_size, DEVICE).planes == planes
    outs = []
    for lanes in (True, False):
        monkeypatch.setattr(w4a16, "LANES16", lanes)
        outs.append(w4a16.w4a16_linear(x, packed, scale, zero, group_size))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "group_size"),
    [(5, 24, 96, 24), (2, 40, 72, 24), (20, 16, 40, 8)],
)
def test_groups_narrower_than_a_step_and_inputs_of_odd_eighths(
    unpacking, rows, out_features, in_features, group_size
):
    """Groups of 8 or 24 columns take a scale per column of the step; 40 and 72 input
    features end in a half step of 8 codes, masked."""
    dtype = DTYPES[-1]
    packed, scale, zero = random_int4(out_features, in_features, group_size, dtype, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(dtype).to(DEVICE)
    tiles = w4a16.plan(rows, out_features, in_features, group_size, DEVICE)
    assert group_size % tiles.block_k != 0
    out = w4a16.w4a16_linear(x, packed, scale, zero, group_size)
    assert_within_rounding(out, x, reference_weight(packed, scale, zero, group_size))


def test_float32_scales_with_float16_rows_and_strided_rows(unpacking):
    packed, scale, zero = random_int4(64, 128, 64, torch.float32)
    wide = torch.randn(6, 256, generator=torch.Generator().manual_seed(0)).half().to(DEVICE)
    x = wide[:, :128]  # rows 256 apart
    assert x.stride() == (256, 1)
    out = w4a16.w4a16_linear(x, packed, scale, zero, 64)
    expected = x.cpu().double().numpy() @ reference_weight(packed, scale, zero, 64).T
    torch.testing.assert_close(out.cpu().double(), torch.from_numpy(expected), atol=1e-2, rtol=1e-2)


def test_without_the_kernel_the_product_is_f_linear_of_the_dequantized_weight(monkeypatch):
    monkeypatch.setattr(w4a16, "INTERPRETED", False)
    packed, scale, zero = random_int4(24, 64, 32, torch.float32, device="cpu")
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    expected = x @ w4a16.dequantize(packed, scale, zero, 32, torch.float32).T
    torch.testing.assert_close(w4a16.w4a16_linear(x, packed, scale, zero, 32), expected)


def test_decode_rows_split_the_input_features_to_fill_the_device(monkeypatch):
    """On 132 SMs one row of Llama-3-8B's o projection (4096 x 4096, groups of 128) has 64
    output tiles: four splits of 128-feature steps; 256 rows fill it with tiles, unsplit."""
    monkeypatch.setattr(w4a16, "num_sms", lambda device: 132)
    tiles = w4a16.plan(1, 4096, 4096, 128, DEVICE)
    assert (tiles.block_m, tiles.block_n, tiles.block_k, tiles.splits) == (16, 64, 128, 4)
    assert w4a16.plan(1, 28672, 4096, 128, DEVICE).splits == 1  # 448 tiles
    assert w4a16.plan(256, 4096, 4096, 128, DEVICE).splits == 1
    for rows in (1, 16, 32, 64):
        tiles = w4a16.plan(rows, 4096, 14336, 128, DEVICE)
        assert 14336 % (tiles.block_k * tiles.splits) == 0 and tiles.splits > 1


def test_planes_take_rows_of_128_feature_steps_and_inputs_of_whole_steps(monkeypatch):
    """Up to PLANES_ROWS rows (at most 32: SHAPES' 128-feature steps) over inputs of whole
    128-feature steps take the planes kernel, whatever the group (32: a scale per word row); 64
    rows, or an input of 96 features, the whole-step kernel; PLANES_ROWS 0, none. By default up
    to 4 rows (faster than the whole-step kernel there on an H100, slower from 16)."""
    assert w4a16.plan(4, 256, 4096, 128, DEVICE).planes
    assert not w4a16.plan(5, 256, 4096, 128, DEVICE).planes
    monkeypatch.setattr(w4a16, "PLANES_ROWS", 32)
    for rows, in_features, group_size, planes in [
        (1, 4096, 128, True), (32, 4096, 32, True), (17, 384, 384, True),
        (64, 4096, 128, False), (3, 96, 32, False),
    ]:  # fmt: skip
        tiles = w4a16.plan(rows, 256, in_features, group_size, DEVICE)
        assert tiles.planes == planes, (rows, in_features, group_size)
        assert not planes or tiles.block_k == 128
    monkeypatch.setattr(w4a16, "PLANES_ROWS", 0)
    assert not w4a16.plan(1, 256, 4096, 128, DEVICE).planes


def test_shapes_that_do_not_fit_raise_value_error():
    packed, scale, zero = random_int4(16, 64, 32, torch.float32)
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="x must be"):  # in not a multiple of 8
        w4a16.w4a16_linear(torch.randn(2, 60, device=DEVICE), packed, scale, zero, 32)
    with pytest.raises(ValueError, match="group_size"):  # does not divide 64
        w4a16.w4a16_linear(x, packed, scale, zero, 24)
    with pytest.raises(ValueError, match="group_size"):  # not a multiple of 8
        w4a16.dequantize(packed, scale, zero, 4, torch.float32)
    with pytest.raises(ValueError, match="scale"):
        w4a16.w4a16_linear(x, packed, scale[:, :1], zero, 32)
    with pytest.raises(ValueError, match="zero"):
        w4a16.w4a16_linear(x, packed, scale, zero[:8], 32)
    with pytest.raises(ValueError, match="zero"):
        w4a16.w4a16_linear(x, packed, scale, zero.to(torch.int32), 32)
    with pytest.raises(ValueError, match="packed"):
        w4a16.w4a16_linear(x, packed.to(torch.int64), scale, zero, 32)
    with pytest.raises(ValueError, match="packed"):
        w4a16.unpack(packed.view(torch.float32))
    with pytest.raises(ValueError, match="multiple of 8"):
        w4a16.pack(torch.zeros(2, 12, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"0\.\.15"):
        w4a16.pack(torch.full((2, 8), 16))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real sizes in bf16 need a GPU")
@pytest.mark.parametrize("rows", [1, 16, 256])
def test_kernel_at_llama_qkv_size_in_bfloat16(unpacking, rows):
    packed, scale, zero = random_int4(6144, 4096, 128, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    out = w4a16.w4a16_linear(x, packed, scale, zero, 128)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 6144)
    assert_within_rounding(out, x, reference_weight(packed, scale, zero, 128))


def test_split_k_partials_sum_to_the_product(unpacking):
    """`partials=True` hands a split-K product's float32 slices to the norm that adds them:
    their sum is the summed product."""
    g = torch.Generator().manual_seed(3)
    out_features, in_features, group = 64, 512, 128
    q = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    scale = torch.rand(out_features, in_features // group, generator=g) / 8 + 0.01
    zero = torch.randint(
        0, 16, (out_features, in_features // group), generator=g, dtype=torch.uint8
    )
    x = torch.randn(2, in_features, generator=g).to(DEVICE)
    packed, scale, zero = w4a16.pack(q).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)
    tiles = w4a16.plan(2, out_features, in_features, group, x.device)
    assert tiles.splits > 1  # the interpreter's 8 SMs or a GPU's, 4 K steps
    slices = w4a16.w4a16_linear(x, packed, scale, zero, group, partials=True)
    assert slices.shape == (tiles.splits, 2, out_features) and slices.dtype == torch.float32
    product = w4a16.w4a16_linear(x, packed, scale, zero, group)
    torch.testing.assert_close(slices.sum(0), product, rtol=1e-5, atol=1e-5)
