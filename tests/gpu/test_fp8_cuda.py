"""FP8 on the GPU (Hopper): the W8A8 GEMM and its kernels against references, bf16 against FP8
logits, and the async engine with FP8 weights and an FP8 KV cache (sync/async, sanitizer)."""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tandem import LLM, SamplingParams
from tandem.attention import AttentionMetadata
from tandem.attention.torch_ref import decode_attention
from tandem.attention.triton_backend import TritonAttention
from tandem.model import fused, splitk
from tandem.quant import gemv
from tandem.quant import linear as fp8_linear
from tandem.quant.fp8 import dequantize, has_fp8_gemm, quantize_rows, quantize_tokens
from tandem.quant.linear import Fp8Linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not has_fp8_gemm(torch.device("cuda")),
        reason="needs a CUDA device with FP8 tensor cores (compute capability 9.0)",
    ),
]

E4M3 = torch.float8_e4m3fn
ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# Random tiny models are far more sensitive than trained ones. Measured on CPU with the W8A8
# arithmetic emulated (per-token quantization, dequantized operands, F.linear): against float32,
# bf16 alone keeps 96-97% of their top-1 picks (mean KL 0.002); FP8 weights and activations in
# bf16 against bf16 78-81% (KL 0.14-0.16), with the FP8 KV cache too 78-81% (KL 0.15-0.20); even
# the same FP8 arithmetic in bf16 against float32 keeps only 83-85%: a rounding difference
# flips e4m3 codes, and the tiny models amplify it. The bounds sit under those; a broken scale
# or layout drops top-1 to chance.
TINY_TOP1, TINY_KL = 0.72, 0.3


@torch.inference_mode()
def prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one prompt, teacher-forced through the engine's model
    and attention backend (eagerly; its KV cache from block 0)."""
    engine = llm.engine
    n, device = len(ids), engine.device
    blocks = -(-n // engine.block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        decode_only=False,
        query_start_loc_host=[0, n],
        seq_lens_host=[n],
    )
    ids_t, positions = torch.tensor(ids, device=device), torch.arange(n, device=device)
    hidden = engine.model(ids_t, positions, engine.kv_caches, meta, engine.attend)
    return engine.model.compute_logits(hidden).float().cpu()


def agreement(reference: torch.Tensor, ours: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || ours) in nats) over rows of logits."""
    top1 = (reference.argmax(-1) == ours.argmax(-1)).float().mean().item()
    kl = F.kl_div(ours.log_softmax(-1), reference.log_softmax(-1), log_target=True,
                  reduction="none").sum(-1).mean().item()  # fmt: skip
    return top1, kl


def prompt_ids(vocab: int, count: int = 4, length: int = 200) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(count)]


def logits_of(model: str, prompts: list[list[int]], **engine_args) -> torch.Tensor:
    llm = LLM(model, max_model_len=512, num_blocks=64, max_num_seqs=8, **engine_args)
    try:
        return torch.cat([prefill_logits(llm, ids) for ids in prompts])
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_logits_agree_with_bf16_on_tiny_models(make_tiny, arch, kv_cache_dtype):
    folder = str(make_tiny(arch))
    prompts = prompt_ids(600)
    bf16 = logits_of(folder, prompts, dtype="bfloat16")
    fp8 = logits_of(folder, prompts, dtype="bfloat16", quantization="fp8",
                    kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    top1, kl = agreement(bf16, fp8)
    print(f"{arch} kv={kv_cache_dtype}: top-1 {top1:.4f}, mean KL {kl:.4f}")
    assert top1 >= TINY_TOP1 and kl <= TINY_KL


def emulated_w8a8(layer: Fp8Linear, x: torch.Tensor, add_bias: bool = True) -> torch.Tensor:
    """The FP8 arithmetic in float32: per-token quantization, dequantized operands, F.linear."""
    q, scale = quantize_rows(x.float().reshape(-1, layer.in_features))
    weight = dequantize(layer.weight, layer.weight_scale, torch.float32, layer.group_size)
    bias = layer.bias.float() if add_bias and layer.bias is not None else None
    y = F.linear(q.float() * scale, weight, bias)
    return y.view(*x.shape[:-1], layer.out_features).to(x.dtype)


def test_fp8_logits_agree_with_bf16_at_the_llama_3_8b_shape():
    # Dummy weights. The issue asks for top-1 >= 97%, which random weights do not allow: their
    # logits (std 6 over 128K-152K ids) leave the top two 1.1 apart on average, and random
    # layers compound the FP8 error. Measured on CPU, qwen3-0.6b dummy, W8A8 emulated in float32
    # against float32: top-1 53%, mean KL 0.53 nats. The bounds are under that; printed numbers
    # go to BENCHMARKS.md. (A trained checkpoint is where the 97% belongs.)
    prompts = prompt_ids(128000, count=2, length=256)
    args = {"load_format": "dummy", "dtype": "bfloat16", "gpu_memory_utilization": 0.5}
    bf16 = logits_of("llama-3-8b", prompts, **args)
    fp8 = logits_of("llama-3-8b", prompts, quantization="fp8", kv_cache_dtype="fp8", **args)
    top1, kl = agreement(bf16, fp8)
    print(f"llama-3-8b: top-1 {top1:.4f}, mean KL {kl:.4f}")
    assert top1 >= 0.4 and kl <= 1.0


def test_w8a8_linear_is_close_to_the_dequantized_product_and_runs_the_fp8_gemm():
    g = torch.Generator(device="cuda").manual_seed(0)
    layer = Fp8Linear(4096, 1024, bias=True).cuda()
    w = torch.randn(1024, 4096, device="cuda", generator=g) * 0.02
    q, scale = quantize_rows(w)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    layer.bias.data = torch.randn(1024, device="cuda", generator=g).bfloat16()  # model dtype
    assert fp8_linear.prepare(layer, torch.bfloat16, torch.device("cuda")) == "w8a8"
    for rows in (1, 4, 7, 64, 300):
        x = torch.randn(rows, 4096, device="cuda", generator=g).bfloat16()
        expected = emulated_w8a8(layer, x.float())
        if rows <= gemv.MAX_ROWS:  # the matrix-vector kernel: W8A16, x as it is
            weight = dequantize(layer.weight, layer.weight_scale, torch.float32)
            expected = F.linear(x.float(), weight, layer.bias.float())
        out = layer(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_per_token_quantization_kernel_matches_torch_on_cuda():
    x = torch.randn(33, 5000, device="cuda") * 3
    x[5] = 0.0
    q, scale = quantize_tokens(x.bfloat16())
    q_ref, scale_ref = quantize_rows(x.bfloat16())
    torch.testing.assert_close(scale, scale_ref)
    differ = (q.float() != q_ref.float()).float().mean().item()
    assert differ < 1e-3  # Triton's float32 division is not IEEE: a rare tie rounds the other way
    torch.testing.assert_close(q.float(), q_ref.float(), atol=0, rtol=0.13)


@pytest.mark.parametrize("rows", [1, 32, 64])  # past 64 rows the plan leaves this shape to F.linear
def test_fp8_split_k_matches_the_dequantized_product_in_bf16(rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, scale = quantize_rows(torch.randn(4096, 14336, device="cuda", generator=g) * 0.02)
    x = torch.randn(rows, 14336, device="cuda", generator=g).bfloat16()
    tiles = splitk.plan(rows, 4096, 14336, x.device)
    assert tiles is not None
    partials = splitk.linear_partials(x, q, weight_scale=scale)
    expected = x.float() @ (q.float() * scale).T
    torch.testing.assert_close(partials.sum(0), expected, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_rope_qk_kernel_stores_e4m3_k_v_as_the_torch_version(qk_norm):
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, heads, kv_heads, dim = 37, 32, 8, 128
    q = torch.randn(tokens, heads, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(tokens, kv_heads, dim, device="cuda", generator=g).bfloat16() * 30
    v = torch.randn(tokens, kv_heads, dim, device="cuda", generator=g).bfloat16()
    positions = torch.randint(0, 1000, (tokens,), device="cuda", generator=g)
    cos_sin = torch.randn(1024, dim, device="cuda", generator=g)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:tokens]
    caches = [torch.zeros(2, 65, 16, kv_heads, dim, dtype=E4M3, device="cuda") for _ in range(2)]
    norms = ()
    if qk_norm:  # the k norm rounds to bf16 before the rotary, whatever the cache's dtype
        weights = torch.rand(2, dim, device="cuda", generator=g).bfloat16() + 0.5
        norms = (weights[0], weights[1], 1e-6)
    outs = []
    for cache, kernels in zip(caches, (True, False), strict=True):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fused, "KERNELS", kernels)
            out = fused.rope_qk(q, k, v, positions, cos_sin, cache, slots, *norms, k_scale=0.5,
                                v_scale=0.25)  # fmt: skip
            outs.append(out)
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)
    a, b = (c.flatten(1, 2)[:, slots].float() for c in caches)
    close = (a - b).abs() <= 0.07 * b.abs() + 2e-3  # within one e4m3 step (2^-9 subnormal)
    assert close.float().mean() > 0.999


# 256 rows: the large-batch tiles (block_n 64, 2 warps, 2 stages); 8: the default; 1: one sequence's
@pytest.mark.parametrize(("batch", "context"), [(256, 1024), (8, 2000), (1, 4096)])
def test_triton_decode_over_an_fp8_cache_at_llama_3_8b_sizes(batch, context):
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    blocks = batch * context // block_size
    codes = torch.randn(2, blocks + 1, block_size, kv_heads, head_dim, device="cuda") * 50
    cache = codes.clamp(-448, 448).to(E4M3)
    values = cache.float() * torch.tensor([0.02, 0.05], device="cuda").view(2, 1, 1, 1, 1)
    tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, -1)
    lens = torch.randint(context // 2, context + 1, (batch,), device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True)
    backend = TritonAttention(heads, kv_heads, head_dim, batch, torch.device("cuda"))
    out = backend(q, cache, meta, head_dim**-0.5, k_scale=0.02, v_scale=0.05)
    expected = decode_attention(q.float(), values, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def generate(folder, async_batching: bool, temperature: float) -> list[list[int]]:
    llm = LLM(str(folder), dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8",
              max_model_len=256, max_num_batched_tokens=32, num_blocks=256,
              async_batching=async_batching)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    vocab = llm.engine.model_config.vocab_size
    lengths, max_tokens = [3, 41, 7, 18, 29, 1, 60, 5], [24, 9, 30, 16, 24, 12, 20, 33]
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
               for n in lengths]  # fmt: skip
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(max_tokens)]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    assert llm.engine.kv_caches[0].dtype == E4M3
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_async_equals_sync_with_fp8_weights_and_kv_cache(make_tiny, arch):
    for temperature in (0.0, 1.0):
        sync = generate(make_tiny(arch), False, temperature)
        assert generate(make_tiny(arch), True, temperature) == sync


SANITIZED_FP8_RUN = textwrap.dedent(
    """
    import sys
    from tandem import LLM, SamplingParams
    from tandem.model.tiny import make_tiny_model
    folder = make_tiny_model(sys.argv[1], "llama")
    for graphs in (False, True):
        llm = LLM(str(folder), dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8",
                  max_model_len=128, max_num_batched_tokens=16, num_blocks=12, cuda_graphs=graphs)
        prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(6)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        print("ok", graphs, sum(len(o.outputs[0].token_ids) for o in outs))
    """
)


def test_async_loop_with_fp8_is_clean_under_the_stream_sanitizer(run_sanitized):
    assert run_sanitized(SANITIZED_FP8_RUN).count("ok") == 2


def test_fused_norm_and_silu_and_mul_store_quantize_tokens_of_their_output_bit_for_bit():
    """At a Llama-3-8B decode step's 32 rows: the add + RMSNorm (split-K partials and a
    residual in) and SiLU * up quantizing as they store equal the unfused kernels followed by
    quantize_tokens, codes and scales."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, hidden, inter = 32, 4096, 14336
    parts = torch.randn(4, rows, hidden, device="cuda", generator=g)
    residual = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    weight = (1 + 0.2 * torch.randn(hidden, device="cuda", generator=g)).bfloat16()
    outs = []
    for fp8_out in (True, False):
        outs.append(fused.add_rms_norm(parts, residual.clone(), weight, 1e-5, fp8_out=fp8_out))
    (got, summed), (out, unfused_summed) = outs
    codes, scale = quantize_tokens(out)
    assert torch.equal(summed, unfused_summed) and torch.equal(got.scale, scale)
    assert torch.equal(got.values.view(torch.uint8), codes.view(torch.uint8))
    gate_up = (torch.randn(rows, 2 * inter, device="cuda", generator=g) * 3).bfloat16()
    got = fused.silu_and_mul(gate_up, fp8_out=True)
    codes, scale = quantize_tokens(fused.silu_and_mul(gate_up))
    assert got.dtype == torch.bfloat16 and torch.equal(got.scale, scale)
    assert torch.equal(got.values.view(torch.uint8), codes.view(torch.uint8))


def fused_quant_run(folder, monkeypatch, on: bool) -> tuple[list[list[int]], torch.Tensor]:
    """(greedy tokens of 8 requests, prefill logits of one prompt) with FP8 weights, the
    activation quantization fused into the norms and SiLU * up or not."""
    monkeypatch.setenv("TANDEM_FP8_FUSED_QUANT", "1" if on else "0")
    llm = LLM(str(folder), dtype="bfloat16", quantization="fp8", max_model_len=256,
              max_num_batched_tokens=64, num_blocks=128)  # fmt: skip
    try:
        fused_norms = [layer.input_layernorm.quantize_out for layer in llm.engine.model.layers]
        assert all(fused_norms) if on else not any(fused_norms)
        vocab = llm.engine.model_config.vocab_size
        g = torch.Generator().manual_seed(2)
        prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
                   for n in (3, 41, 7, 18, 29, 1, 60, 5)]  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        logits = prefill_logits(llm, prompts[6]["prompt_token_ids"] * 2)  # 120 rows
        return [o.outputs[0].token_ids for o in outs], logits
    finally:
        llm.shutdown()
        del llm
        gc.collect()


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_activation_quantization_gives_the_unfused_tokens_and_logits(
    make_tiny, monkeypatch, arch
):
    """TANDEM_FP8_FUSED_QUANT=0 against the default: decode steps of 2-8 rows (CUDA graphs),
    chunks of up to 64 and a 120-row prefill give the same greedy tokens and the same logits
    bit for bit."""
    folder = make_tiny(arch)
    tokens, logits = fused_quant_run(folder, monkeypatch, on=True)
    unfused_tokens, unfused_logits = fused_quant_run(folder, monkeypatch, on=False)
    assert tokens == unfused_tokens
    assert torch.equal(logits, unfused_logits)


def test_v_tiles_of_an_fp8_cache_widen_to_float16_exactly():
    """Every finite e4m3 value through the attention kernels' widening of V tiles: its value,
    or its value / 256 where the kernels widen by bits (`triton_kernels._v_factor` says which,
    and the products take the 256 back)."""
    import triton
    import triton.language as tl

    from tandem.attention import triton_kernels as tk

    @triton.jit
    def widen(x_ptr, out_ptr, factor_ptr):
        rows, cols = tl.arange(0, 16)[:, None], tl.arange(0, 16)[None, :]
        x = tl.load(x_ptr + rows * 16 + cols)
        q = tl.zeros((16, 16), tl.float16)
        tl.store(out_ptr + rows * 16 + cols, tk._cache_tile_as(x, q))
        tl.store(factor_ptr, tk._v_factor(x_ptr, q))

    codes = torch.arange(256, dtype=torch.uint8, device="cuda")
    x = codes.view(E4M3)
    out = torch.empty(256, dtype=torch.float16, device="cuda")
    factor = torch.empty(1, dtype=torch.float32, device="cuda")
    widen[(1,)](x, out, factor)
    finite = ~x.float().isnan()
    assert finite.sum() == 254  # 0x7f and 0xff are e4m3's NaNs, never stored
    expected = x.float()[finite] / factor.item()
    assert factor.item() in (1.0, 256.0)
    torch.testing.assert_close(out.float()[finite], expected, atol=0, rtol=0)
