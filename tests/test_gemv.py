"""The decode GEMV kernel (norm / SiLU * up folded into the matmul) against the torch ops it
replaces, computed in float32 from the same inputs (CPU: Triton's interpreter, fp16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.model import fused, gemv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float16] if DEVICE.type == "cpu" else [torch.bfloat16, torch.float16]
TOL = {torch.float16: 1e-2, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def one_tile_shape(monkeypatch):
    monkeypatch.setattr(gemv, "AUTOTUNE", False)  # on a GPU, tuning would compile every config


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setattr(gemv, "ENABLED", True)
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)


def rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 48, 64), (5, 100, 200), (17, 16, 96), (64, 33, 40), (130, 20, 48)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_torch(kernels_on, dtype, rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * n + k)
    x, w = rand(g, rows, k, dtype=dtype), rand(g, n, k, dtype=dtype, scale=k**-0.5)
    bias = rand(g, n, dtype=dtype) if with_bias else None
    assert gemv.use_gemv(x, w)
    expected = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    close(gemv.linear(x, w, bias), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "k"), [(1, 48, 64), (7, 100, 200), (32, 64, 72), (100, 40, 64)]
)
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_linear_matches_add_rms_norm_then_linear(kernels_on, dtype, rows, n, k, with_residual):
    g = torch.Generator().manual_seed(rows + n + k + with_residual)
    x = rand(g, rows, k, dtype=dtype, scale=3.0)
    residual = rand(g, rows, k, dtype=dtype) if with_residual else None
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    w, bias = rand(g, n, k, dtype=dtype, scale=k**-0.5), rand(g, n, dtype=dtype)
    y, summed = gemv.norm_linear(x, residual, norm, 1e-6, w, bias)
    expected_summed = x if residual is None else (x.float() + residual.float()).to(dtype)
    torch.testing.assert_close(summed, expected_summed, atol=0, rtol=0)  # every row and column
    s = expected_summed.float()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()
    close(y, F.linear(normed, w.float(), bias.float()), dtype)


def test_norm_linear_normalizes_before_the_norm_weight_as_torch_does(kernels_on):
    """fp16: a residual value of 30,000 times a norm weight of 4 is past fp16's range; the norm
    must divide by the RMS first, as add_rms_norm does, or the row turns to inf."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 64, generator=g).half()
    x[0, 3] = 30_000.0
    norm = torch.ones(64, dtype=torch.float16)
    norm[3] = 4.0
    w = (torch.randn(32, 64, generator=g) * 64**-0.5).half()
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).half().float() * 4.0 ** (
        torch.arange(64) == 3
    )
    y, _ = gemv.norm_linear(x.to(DEVICE), None, norm.to(DEVICE), 1e-6, w.to(DEVICE))
    close(y, F.linear(normed, w.float()).to(DEVICE), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "n", "inter"), [(1, 64, 96), (9, 40, 160), (64, 16, 48), (70, 32, 32)]
)
def test_silu_linear_matches_silu_and_mul_then_linear(kernels_on, dtype, rows, n, inter):
    g = torch.Generator().manual_seed(rows * inter + n)
    gate_up = rand(g, rows, 2 * inter, dtype=dtype, scale=3.0)
    w = rand(g, n, inter, dtype=dtype, scale=inter**-0.5)
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(gemv.silu_linear(gate_up, w), F.linear(F.silu(gate) * up, w.float()), dtype)


def test_large_batches_float32_and_strided_weights_keep_torch(monkeypatch):
    monkeypatch.setattr(gemv, "ENABLED", True)
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    w = torch.randn(32, 64, dtype=torch.float16)
    assert gemv.use_gemv(torch.zeros(gemv.MAX_ROWS, 64, dtype=torch.float16), w)
    assert not gemv.use_gemv(torch.zeros(gemv.MAX_ROWS + 1, 64, dtype=torch.float16), w)
    assert not gemv.use_gemv(torch.zeros(4, 64), w.float())
    assert not gemv.use_gemv(torch.zeros(4, 32, dtype=torch.float16), w.t())
    monkeypatch.setattr(gemv, "ENABLED", False)
    assert not gemv.use_gemv(torch.zeros(4, 64, dtype=torch.float16), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_with_the_gemv_kernel_gives_the_tokens_of_torch_matmuls(
    make_tiny, arch, monkeypatch
):
    """Every decode matmul through the kernel (qwen2: with q/k/v biases), the whole engine in
    fp16, against the same engine with torch matmuls: the same greedy tokens."""
    from tandem import LLM, SamplingParams

    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    prompts = [{"prompt_token_ids": list(range(3 + 5 * i, 20 + 9 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens, calls = {}, []
    launch = gemv._launch
    monkeypatch.setattr(gemv, "_launch", lambda *a, **kw: calls.append(a[0]) or launch(*a, **kw))
    for enabled in (False, True):
        monkeypatch.setattr(gemv, "ENABLED", enabled)
        llm = LLM(str(make_tiny(arch)), dtype="float16", attention_backend="triton",
                  max_model_len=128, num_blocks=32, max_num_batched_tokens=24)  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[enabled] = [o.outputs[0].token_ids for o in outputs]
    assert tokens[True] == tokens[False]
    assert {gemv.PLAIN, gemv.NORM, gemv.SILU} <= set(calls)  # every kind ran


@pytest.mark.skipif(DEVICE.type != "cuda", reason="autotuning times configs on a GPU")
def test_autotuned_kernel_matches_torch(kernels_on, monkeypatch):
    monkeypatch.setattr(gemv, "AUTOTUNE", True)
    g = torch.Generator().manual_seed(0)
    gate_up = rand(g, 4, 2 * 512, dtype=torch.bfloat16, scale=3.0)
    w = rand(g, 256, 512, dtype=torch.bfloat16, scale=512**-0.5)
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(gemv.silu_linear(gate_up, w), F.linear(F.silu(gate) * up, w.float()), torch.bfloat16)
