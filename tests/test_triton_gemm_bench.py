"""benchmarks/triton_gemm.py's stream-K kernel over TMA, its three forms of the runs, in the
interpreter against a float64 product: the benchmark's kernels stay correct between GPU calls."""

from __future__ import annotations

import pytest
import torch

from benchmark_script import import_benchmark

triton_gemm = import_benchmark("triton_gemm")


@pytest.mark.parametrize("form", ["while", "flattened", "last"])
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
def test_tma_stream_k_equals_the_product(rows, out_features, in_features, programs, form):
    if torch.cuda.is_available():
        pytest.skip("interpreter test (on a GPU: benchmarks/triton_gemm.py checks each way)")
    g = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=g).half()
    weight = (torch.randn(out_features, in_features, generator=g) / 8).half()
    out = torch.zeros(rows, out_features, dtype=torch.float16)
    flat, last = form != "while", form == "last"
    triton_gemm.tma_streamk(x, weight, out, 32, 4, 2, programs, flat, bk=16, last=last)
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)


def test_the_timeline_report_reads_phases_from_the_stamps():
    """Two programs' stamps (ns; 0 where a program did not get that far): each phase's min /
    median / max µs, and the programs by their end, latest first."""
    base = 1_000_000
    first = [base, base + 50_000, base + 60_000, base + 61_000, base + 70_000, base + 72_000,
             0, 0, base + 72_500, 3]  # fmt: skip
    second = [base + 2_000, base + 52_000, base + 65_000, base + 80_000, 0, 0, 0, 0,
              base + 80_500, 7]  # fmt: skip
    lines = triton_gemm.timeline_report(torch.tensor([first, second]), "while")
    assert lines[0].startswith("  while: 2 programs on 2 SMs; µs min/median/max: ")
    cells = dict(cell.split(" ", 1) for cell in lines[0].split(": ", 2)[2].split(" | "))
    assert cells["start"] == "0.0/0.0/2.0 (2)"
    assert cells["rounds"] == "50.0/50.0/50.0 (2)"
    assert cells["finish1"] == "1.0/1.0/15.0 (2)"  # torch's median of two: the lower
    assert cells["loop2"] == "9.0/9.0/9.0 (1)" and "loop3" not in cells
    assert cells["end"] == "72.5/72.5/80.5 (2)"
    assert lines[1].startswith("    program 1 (SM 7): 2.0 52.0 65.0 80.0 - - - - 80.5")


def test_the_last_to_finish_a_tile_leaves_its_counters_at_zero():
    """A second launch (a graph replay) over new rows finds every tile's slot counters back at
    0 and stores the new product."""
    if torch.cuda.is_available():
        pytest.skip("interpreter test")
    g = torch.Generator().manual_seed(5)
    weight = (torch.randn(64, 160, generator=g) / 8).half()
    out = torch.zeros(256, 64, dtype=torch.float16)
    for _ in range(2):
        x = torch.randn(256, 160, generator=g).half()
        programs = triton_gemm.tma_streamk(x, weight, out, 32, 4, 2, 3, True, bk=16, last=True)
        torch.testing.assert_close(
            out.double(), x.double() @ weight.double().T, atol=2e-2, rtol=2e-2
        )
    counts = triton_gemm.workspace(programs, 32, x.device, 2 * 3, 2 * 2)[1]
    assert counts.tolist() == [0] * 4  # slots taken, slots filled: 2 tiles split over 3 runs
