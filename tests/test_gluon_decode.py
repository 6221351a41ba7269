"""The Gluon decode kernels (attention/gluon_decode.py) on the CPU: its reorderings of the
products' summed dimensions against the plain products. The kernel has no interpreter: its
sm_90 code is checked in tests/test_triton_sass.py, its outputs on the GPU in
tests/gpu/test_gluon_decode_cuda.py."""

from __future__ import annotations

import pytest
import torch

from tandem.attention import gluon_decode


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_the_plan_reorders_both_sides_of_each_product_alike(block_n):
    """One tile through the kernel's reorderings (q's dims by q_dims, K's and V's tiles and the
    probabilities by their shapes and orders, the output back through out_dims) gives the
    scores q K^T and the output p V of the plain products, in float64."""
    p = gluon_decode.plan(block_n)
    dims, rows = gluon_decode.HEAD_DIM, gluon_decode.ROWS
    g = torch.Generator().manual_seed(block_n)
    q, k, v = (
        torch.randn(n, dims, generator=g, dtype=torch.float64) for n in (rows, block_n, block_n)
    )
    assert sorted(p.q_dims) == sorted(p.out_dims) == list(range(dims))

    kt = k.reshape(p.k_shape).permute(p.k_order).reshape(dims, block_n)
    scores = q[:, list(p.q_dims)] @ kt
    torch.testing.assert_close(scores, q @ k.T, atol=1e-12, rtol=1e-12)

    probs = torch.softmax(scores, dim=1)
    operand = probs.reshape(p.p_shape).permute(p.p_order).reshape(rows, block_n)
    v_operand = v.reshape(p.v_shape).permute(p.v_order).reshape(block_n, dims)
    out = torch.empty(rows, dims, dtype=torch.float64)
    out[:, list(p.out_dims)] = operand @ v_operand
    torch.testing.assert_close(out, probs @ v, atol=1e-12, rtol=1e-12)
    # a wrong order on one side is caught: the probabilities in the scores' own key order
    wrong = torch.empty_like(out)
    wrong[:, list(p.out_dims)] = probs @ v_operand
    assert not torch.allclose(wrong, probs @ v)
