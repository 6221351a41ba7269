"""benchmarks/triton_gemm.py's stream-K kernel over TMA, both forms of its runs, in the
interpreter against a float64 product: the benchmark's kernels stay correct between GPU calls."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# on the path only while it imports (it imports gemm.py beside it): a folder of scripts named
# kernels, gemm, ... must not stand in for packages later tests import
sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
try:
    import triton_gemm
finally:
    sys.path.pop(0)


@pytest.mark.parametrize("flat", [False, True], ids=["while", "flattened"])
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "programs"),
    [
        (256, 64, 64, 3),  # 2 tiles over 3 programs: all runs
        (200, 96, 48, 8),  # runs of one K step
        (129, 128, 80, 3),  # a round of whole tiles, then runs
        (256, 32, 16, 8),  # one K step: one program
        (256, 64, 160, 3),  # runs across the seam of two tiles
        (256, 224, 32, 3),  # two rounds, then one tile over three programs
    ],
)
def test_tma_stream_k_equals_the_product(rows, out_features, in_features, programs, flat):
    if torch.cuda.is_available():
        pytest.skip("interpreter test (on a GPU: benchmarks/triton_gemm.py checks each way)")
    g = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=g).half()
    weight = (torch.randn(out_features, in_features, generator=g) / 8).half()
    out = torch.zeros(rows, out_features, dtype=torch.float16)
    triton_gemm.tma_streamk(x, weight, out, 32, 4, 2, programs, flat, bk=16)
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
