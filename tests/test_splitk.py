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
