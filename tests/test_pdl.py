"""Programmatic dependent launch: where it is used, and (on Hopper) that a kernel launched with
it reads what the kernel before it wrote, eagerly and inside a replayed CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tandem import pdl
from tandem.model import fused


def test_the_interpreter_and_the_switch_launch_plainly(monkeypatch):
    assert pdl.launch_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.launch_args(torch.device("cuda")) == {"PDL": False}


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.skipif(not HOPPER, reason="PDL needs a Hopper or newer GPU")
def test_a_kernel_launched_with_pdl_reads_the_gemm_output_before_it():
    """Each replay writes a new product with cuBLAS and normalizes it at once with the Triton
    kernel: a kernel that read before the GEMM finished would see the last replay's rows."""
    assert pdl.launch_args(torch.device("cuda"))["PDL"]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.empty(64, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=g) / 64
    norm = torch.ones(4096, device="cuda", dtype=torch.bfloat16)

    def step():
        return fused._add_rms_norm_triton(x @ w, None, norm, 1e-6)[0]

    x.normal_(generator=g)
    step()  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(20):
        x.normal_(generator=g)
        graph.replay()
        h = (x @ w).float()
        expected = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(step(), expected, atol=2e-2, rtol=2e-2)
