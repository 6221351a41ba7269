"""Split-K partial sums of the o and down projections, and the norm that adds them up."""

from __future__ import annotations

import pytest
import torch

from tandem.model import fused, splitk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 dots are wrong in Triton's interpreter: float16 stands in for it on CPU
DTYPES = [torch.float32, torch.bfloat16 if DEVICE.type == "cuda" else torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [(1, 64, 64), (5, 100, 96), (33, 64, 160), (60, 128, 256)],
)
def test_partials_add_up_to_the_product(dtype, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(out_features, in_features, generator=g) / 8).to(dtype).to(DEVICE)
    partials = splitk.linear_partials(x, weight)
    splits = splitk.plan(rows, out_features, in_features, DEVICE).splits
    assert partials.shape == (splits, rows, out_features) and partials.dtype == torch.float32
    expected = x.double() @ weight.double().T
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(partials.sum(0).double(), expected, atol=tol, rtol=tol)


def test_past_64_rows_only_matrices_that_leave_sms_idle_are_split(monkeypatch):
    """On 132 SMs: Qwen3-0.6B's o and down at 128 and 256 rows split (one program per SM, the
    sweep's best shapes); Llama-3-8B's o at 256 rows fills the device with output tiles alone."""
    monkeypatch.setattr(splitk, "num_sms", lambda device: 132)
    assert splitk.plan(256, 1024, 3072, DEVICE) == splitk.SplitTiles(64, 64, 128, 2, 4, 4)
    assert splitk.plan(128, 1024, 2048, DEVICE) == splitk.SplitTiles(64, 64, 128, 4, 4, 4)
    assert splitk.plan(64, 1024, 2048, DEVICE).num_stages == 3  # up to 64 rows: as before
    assert splitk.plan(256, 4096, 4096, DEVICE) is None
    assert splitk.plan(128, 4096, 14336, DEVICE) is None


def test_plan_splits_the_input_evenly_and_leaves_wide_steps_to_the_library():
    for rows, out_features, in_features in [(1, 64, 4096), (32, 4096, 14336), (64, 1024, 3072)]:
        tiles = splitk.plan(rows, out_features, in_features, DEVICE)
        assert in_features % (tiles.block_k * tiles.splits) == 0
        assert tiles.block_m >= min(rows, 16)
    assert splitk.plan(splitk.MAX_ROWS + 1, 64, 64, DEVICE) is None
    assert splitk.plan(4, 64, 24, DEVICE) is None  # no 16-128 tile divides 24 features
    x = torch.randn(4, 24, device=DEVICE)
    weight = torch.randn(8, 24, device=DEVICE)
    torch.testing.assert_close(splitk.linear_partials(x, weight), x @ weight.T)  # F.linear's


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("parts", "rows", "hidden"), [(3, 6, 96), (4, 1, 4096), (4, 32, 4096)])
def test_norm_adds_the_partials_as_the_rounded_product(dtype, parts, rows, hidden, monkeypatch):
    """The kernel and the torch version both take the partials' sum rounded to the model dtype
    as the x they add to the residual (4096 columns: Llama-3-8B's decode rows, 16 warps)."""
    g = torch.Generator().manual_seed(0)
    partials = torch.randn(parts, rows, hidden, generator=g).to(DEVICE)
    residual = torch.randn(rows, hidden, generator=g).to(dtype).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    x = partials.sum(0).to(dtype)
    expected_out, expected_sum = fused.add_rms_norm(x, residual.clone(), weight, 1e-6)
    for kernels in (False, True):
        monkeypatch.setattr(fused, "use_kernels", lambda t, on=kernels: on)
        out, summed = fused.add_rms_norm(partials, residual.clone(), weight, 1e-6)
        assert out.dtype == summed.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(summed, expected_sum, atol=tol, rtol=tol)
        torch.testing.assert_close(out, expected_out, atol=tol, rtol=tol)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real sizes in bf16 need a GPU")
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"),
    [
        (1, 4096, 4096),
        (32, 4096, 14336),
        (64, 1024, 3072),
        (64, 1024, 2048),
        (128, 1024, 2048),
        (256, 1024, 3072),
    ],
)
def test_partials_at_llama_and_qwen_decode_sizes_in_bfloat16(rows, out_features, in_features):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(
        out_features, in_features, device="cuda", dtype=torch.bfloat16, generator=g
    )
    expected = x.float() @ weight.float().T
    torch.testing.assert_close(
        splitk.linear_partials(x, weight).sum(0), expected, atol=0.05, rtol=1e-3
    )


@pytest.mark.parametrize(("slices", "rows", "out_features", "in_features"),
                         [(2, 72, 96, 256), (4, 130, 64, 512), (8, 65, 48, 1024)])  # fmt: skip
def test_blas_slices_are_the_products_of_input_feature_slices(
    slices, rows, out_features, in_features
):
    g = torch.Generator().manual_seed(slices)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = torch.randn(rows, in_features, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(out_features, in_features, generator=g) / 8).to(dtype).to(DEVICE)
    parts = splitk.blas_slices(x, weight, slices)
    assert parts.shape == (slices, rows, out_features) and parts.dtype == torch.float32
    part = in_features // slices
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    for s in range(slices):
        features = slice(s * part, (s + 1) * part)
        expected = x[:, features].double() @ weight[:, features].double().T
        torch.testing.assert_close(parts[s].double(), expected, atol=tol, rtol=tol)


def test_blas_slices_for_down_projections_whose_cublas_tiles_leave_sms_idle(monkeypatch):
    """On 132 SMs, past 64 rows where split-K's plan declines: Llama-3-8B's down (4096 outputs
    of 14336 features) takes two slices while twice cuBLAS's 128 x 128 output tiles fit one
    wave; its o (as many features as outputs) keeps cuBLAS's product."""
    monkeypatch.setattr(splitk, "num_sms", lambda device: 132)
    monkeypatch.setattr(splitk, "BLAS_SLICES", None)
    count = splitk.blas_slice_count
    bf16 = torch.bfloat16
    assert count(256, 4096, 14336, bf16, DEVICE) == 2  # 64 tiles
    assert count(128, 4096, 14336, torch.float16, DEVICE) == 2
    assert count(256, 4096, 4096, bf16, DEVICE) == 0  # o
    assert count(256, 8192, 28672, bf16, DEVICE) == 0  # 128 tiles fill the device alone
    assert count(64, 4096, 14336, bf16, DEVICE) == 0  # split-K's rows
    assert count(splitk.MAX_ROWS + 1, 4096, 14336, bf16, DEVICE) == 0
    assert count(256, 4096, 14336, torch.float32, DEVICE) == 0
    assert count(256, 64, 8200, bf16, DEVICE) == 0  # halves not of whole 64-feature steps
    monkeypatch.setattr(splitk, "BLAS_SLICES", 4)  # TANDEM_BLAS_SLICES
    assert count(256, 4096, 4096, bf16, DEVICE) == 4
    assert count(64, 4096, 4096, bf16, DEVICE) == 0
    monkeypatch.setattr(splitk, "BLAS_SLICES", 0)
    assert count(256, 4096, 14336, bf16, DEVICE) == 0


def test_residual_product_takes_split_k_then_blas_slices_then_the_fallback(monkeypatch):
    monkeypatch.setattr(splitk, "num_sms", lambda device: 132)
    monkeypatch.setattr(splitk, "BLAS_SLICES", None)
    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
    calls = []

    def fallback(x):
        calls.append(x.shape)
        return x.float() @ weight.float().T

    weight = (torch.randn(2048, 4096, generator=g) / 8).to(dtype).to(DEVICE)
    assert splitk.plan(256, 2048, 4096, DEVICE) is None  # its output tiles fill the SMs
    for rows, parts in [(256, 2), (32, None), (512, 1)]:
        x = torch.randn(rows, 4096, generator=g).to(dtype).to(DEVICE)
        out = splitk.residual_product(x, weight, fallback)
        if parts is None:  # split-K's own partials
            assert out.shape[1:] == (rows, 2048) and out.shape[0] > 1
        elif parts == 1:
            assert out.shape == (rows, 2048) and calls == [x.shape]
        else:
            assert out.shape == (parts, rows, 2048)
        expected = x.double() @ weight.double().T
        got = out.sum(0) if out.dim() == 3 else out
        torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=2e-3)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="cuBLAS's float32 outputs of bf16 need a GPU")
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"), [(256, 4096, 14336), (128, 4096, 14336)]
)
def test_residual_product_at_llama_decode_sizes_in_bfloat16(rows, out_features, in_features):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(
        out_features, in_features, device="cuda", dtype=torch.bfloat16, generator=g
    )
    out = splitk.residual_product(x, weight, lambda x: None)
    assert out.dim() == 3 and out.dtype == torch.float32  # slices, on the H200's 132 SMs
    expected = x.float() @ weight.float().T
    torch.testing.assert_close(out.sum(0), expected, atol=0.05, rtol=1e-3)
