"""The Gluon FP8 decode kernel (attention/fp8_decode.py) on the CPU: its reorderings of the
products' summed dimensions against the plain products, and its sm_90 code (Triton's wheel
carries ptxas and cuobjdump; the kernel has no interpreter, so it runs only on the GPU:
tests/gpu/test_fp8_decode_cuda.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import triton

from tandem.attention import fp8_decode

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_the_plan_reorders_both_sides_of_each_product_alike(block_n):
    """One tile through the kernel's reorderings (q's dims by q_dims, K's and V's tiles and the
    probabilities by their shapes and orders, the output back through out_dims) gives the
    scores q K^T and the output p V of the plain products, in float64."""
    p = fp8_decode.plan(block_n)
    dims, rows = fp8_decode.HEAD_DIM, fp8_decode.ROWS
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


# compiled in a fresh interpreter, outside the CPU suite's TRITON_INTERPRET
COMPILE = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from tandem.attention import fp8_decode as f

    out, stages = sys.argv[1], int(sys.argv[2])
    p, kernel = f.plan(), f.fp8_decode_kernel
    constants = dict(GROUP=2, NUM_KV_HEADS=8, HEAD_DIM=f.HEAD_DIM, ROWS=f.ROWS, BLOCK_SIZE=16,
                     BLOCK_N=f.BLOCK_N, STAGES=stages, ORDERED=True, PDL=True,
                     K_LAYOUT=p.k_layout, V_LAYOUT=p.v_layout, K_SHAPE=p.k_shape,
                     K_ORDER=p.k_order, P_SHAPE=p.p_shape, P_ORDER=p.p_order,
                     V_SHAPE=p.v_shape, V_ORDER=p.v_order)
    types = dict(q_ptr="*bf16", out_ptr="*bf16", cache_ptr="*fp8e4nv", scale="fp32",
                 v_scale="fp32", kv_half_stride="i64")
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "*i32" if n.endswith("_ptr")
                 else "i32") for n in names}
    aligned = [n for n in names if n.endswith("_ptr") or n in ("block_table_stride", "kv_half_stride")]
    source = GluonASTSource(
        fn=kernel, signature=signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1))
    open(out, "wb").write(compiled.asm["cubin"])
    """
)


@pytest.mark.skipif(
    not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(),
    reason="needs the ptxas and cuobjdump of Triton's NVIDIA backend",
)
@pytest.mark.parametrize("stages", [3, 4])
def test_the_kernel_reads_its_tiles_in_wide_loads_with_copies_in_flight(stages, tmp_path):
    """sm_90 code at small's shape (16 heads over 8 KV heads, blocks of 16 keys): no register
    spills; no shared-memory stores but the copies (the reorderings move no data); each tile's
    K and V read by 16-byte loads (8 each: 32 keys x 128 bytes over 32 threads); and the key
    loop waits with STAGES - 2 copy groups still in flight."""
    cubin = tmp_path / "fp8_decode.cubin"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "PYTHONPATH": str(Path(__file__).parents[1] / "src"),
    }
    subprocess.run([sys.executable, "-c", COMPILE, str(cubin), str(stages)], env=env, check=True,
                   timeout=300)  # fmt: skip

    def cuobjdump(flag: str) -> str:
        command = [str(BIN / "cuobjdump"), flag, str(cubin)]
        return subprocess.run(command, capture_output=True, text=True, check=True).stdout

    assert re.search(r"LOCAL:0\b", cuobjdump("-res-usage"))
    sass = cuobjdump("-sass")
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass)
    assert not [op for op in ops if op.startswith("STS")]
    assert ops.count("LDS.128") == 16
    assert not [op for op in ops if op.startswith("LDS") and op != "LDS.128" and op != "LDS"]
    waits = re.findall(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", sass)
    assert int(waits[0], 16) == stages - 2
