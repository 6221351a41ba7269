"""The decoder's fused Triton ops (used on CUDA) against their torch versions (used on CPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.model import fused

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] if DEVICE.type == "cpu" else [torch.bfloat16, torch.float16]


def reference(fn, *args):
    """The torch version: the same function on CPU tensors."""
    out = fn(*(a.cpu() if isinstance(a, torch.Tensor) else a for a in args))
    return tuple(o.to(DEVICE) for o in out) if isinstance(out, tuple) else out.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 1000, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(dtype, hidden, with_residual):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=g) * 3).to(dtype).to(DEVICE)
    residual = torch.randn(7, hidden, generator=g).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    kernel_residual = residual.clone() if with_residual else None
    out, summed = fused._add_rms_norm_triton(x, kernel_residual, weight, 1e-6)
    expected_out, expected_summed = reference(fused.add_rms_norm, x, residual, weight, 1e-6)
    if with_residual:  # both write the sum over the residual they were given
        assert summed.data_ptr() == kernel_residual.data_ptr()
        if DEVICE.type == "cpu":
            assert expected_summed.data_ptr() == residual.data_ptr()
    torch.testing.assert_close(summed, expected_summed, atol=0, rtol=0)
    torch.testing.assert_close(
        out, expected_out, atol=1e-5, rtol=1e-3 if dtype == torch.float32 else 1e-2
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [32, 160, 1500])
def test_silu_and_mul_matches_torch(dtype, inter):
    g = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=g) * 4).to(dtype).to(DEVICE)
    out = fused._silu_and_mul_triton(gate_up)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, reference(fused.silu_and_mul, gate_up), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 4, 16), (3, 1, 64), (8, 2, 128), (4, 2, 96), (2, 1, 80)]
)
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_qk_matches_torch_and_stores_k_v_at_their_slots(
    dtype, heads, kv_heads, head_dim, with_norm
):
    """q as the torch version makes it; rotated k and v at each token's slot; slot -1: nothing."""
    g = torch.Generator().manual_seed(heads * head_dim + with_norm)
    tokens, max_position, blocks, block_size = 6, 40, 4, 4
    # q, k, v as the engine sees them: views into the stacked qkv output
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = (torch.randn(tokens, q_size + 2 * kv_size, generator=g) * 3).to(dtype).to(DEVICE)
    q, k, v = (x.view(tokens, -1, head_dim) for x in qkv.split([q_size, kv_size, kv_size], dim=-1))
    angles = torch.rand(max_position, head_dim // 2, generator=g) * 50
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).to(DEVICE)
    positions = torch.tensor([0, 39, 7, 7, 12, 3], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([6, 7, -1, 0, 13, 2], dtype=torch.int64, device=DEVICE)
    weights = [
        (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype).to(DEVICE) if with_norm else None
        for _ in range(2)
    ]
    cache = torch.zeros(2, blocks + 1, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE)
    q_out = fused._rope_qk_triton(q, k, v, positions, cos_sin, cache, slots, *weights, 1e-6)
    expected = torch.zeros_like(cache).cpu()
    q_ref = fused.rope_qk(
        *(x.cpu() for x in (q, k, v, positions, cos_sin)), expected, slots.cpu(),
        *(None if w is None else w.cpu() for w in weights), 1e-6,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 4e-3
    torch.testing.assert_close(q_out, q_ref.to(DEVICE), atol=tol, rtol=tol)
    # the torch version parks slot -1 in the spare last block; the kernel writes nothing for it
    torch.testing.assert_close(cache[:, :-1], expected[:, :-1].to(DEVICE), atol=tol, rtol=tol)
    assert not cache[:, -1].any()
    into = torch.empty_like(q_out)  # the pieces of a step hand q over in a fixed buffer
    assert (
        fused._rope_qk_triton(q, k, v, positions, cos_sin, cache, slots, *weights, 1e-6, into)
        is into
    )
    assert torch.equal(into, q_out)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_every_kernel_gives_the_torch_tokens(make_tiny, arch, monkeypatch):
    """The fused ops, the in-kernel K/V store, one-split decode and the chunked sampler, wired
    through the whole engine (interpreted on CPU), against the torch ops: the same tokens."""
    from tandem import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(3 + 5 * i, 20 + 9 * i))} for i in range(3)]
    params = [
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=5, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=5, ignore_eos=True),
    ]
    tokens = {}
    for kernels in (False, True):
        monkeypatch.setattr(fused, "use_kernels", lambda x, on=kernels: on)
        llm = LLM(str(make_tiny(arch)), attention_backend="triton", max_model_len=128,
                  num_blocks=32, max_num_batched_tokens=24)  # fmt: skip
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[kernels] = [o.outputs[0].token_ids for o in outputs]
    assert tokens[True] == tokens[False]


def test_norm_warps_grow_with_the_row_only_where_rows_are_few():
    """Decode rows (fewer than the SMs; 8 in the interpreter) get 8 columns per thread, 4 to 16
    warps; a prefill chunk's rows keep 4 warps each."""
    cpu = torch.device("cpu")
    assert fused.num_sms(cpu) == 8
    blocks = (64, 1024, 2048, 4096, 8192)
    assert [fused.norm_warps(block, 8, cpu) for block in blocks] == [4, 4, 8, 16, 16]
    assert fused.norm_warps(4096, 9, cpu) == 4
