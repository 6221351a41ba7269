"""The new architectures and kernels on CUDA: the fused MoE routing, alignment and grouped GEMMs
and padded attention head sizes in bf16 at real shapes, MoE decode in CUDA graphs, each new tiny architecture with
graphs on against graphs off and against transformers."""

from __future__ import annotations

import pytest
import torch
from test_cuda_engine import (
    assert_greedy_matches_transformers,
    assert_tokens_match_transformers,
    generate,
)

from tandem import LLM, SamplingParams
from tandem.attention import AttentionMetadata
from tandem.attention.torch_ref import decode_attention, prefill_attention
from tandem.attention.triton_backend import TritonAttention
from tandem.model import fused, fused_moe, moe_one_token, moe_routing, splitk

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW_ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3", "mistral_sliding"]
CUDA = torch.device("cuda")


def qwen3_30b_experts(tokens: int, seed: int = 0):
    """One Qwen3-30B-A3B MoE layer's shapes: hidden 2048, 128 experts of 768, top 8, bf16."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    hidden, inter, experts = 2048, 768, 128
    x = torch.randn(tokens, hidden, generator=g, device=CUDA).bfloat16()
    w13 = (
        torch.randn(experts, 2 * inter, hidden, generator=g, device=CUDA) * hidden**-0.5
    ).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=CUDA) * inter**-0.5).bfloat16()
    logits = torch.randn(tokens, experts, generator=g, device=CUDA)
    weights, ids = moe_routing.route(logits, 8, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens", [1, 32, 300, 2048])
def test_fused_moe_in_bfloat16_at_qwen3_30b_shapes(tokens):
    x, w13, w2, weights, ids = qwen3_30b_experts(tokens)
    got = fused_moe.fused_experts(x, w13, w2, weights, ids)
    # the reference gathers each (token, expert) pair's weights: 64 tokens at a time, so 2048
    # tokens do not need 192 GiB (routing is per token, so the slices are exact)
    w13, w2 = w13.float(), w2.float()
    expected = torch.cat([
        fused_moe.fused_experts_torch(x[i : i + 64].float(), w13, w2, weights[i : i + 64],
                                      ids[i : i + 64])
        for i in range(0, tokens, 64)
    ])  # fmt: skip
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    """Fixed shapes, no host sync: captured once, replayed on other inputs and routes."""
    x, w13, w2, weights, ids = qwen3_30b_experts(32)
    fused_moe.fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_experts(x, w13, w2, weights, ids)
    for seed in (1, 2):
        x2, _, _, weights2, ids2 = qwen3_30b_experts(32, seed)
        x.copy_(x2), weights.copy_(weights2), ids.copy_(ids2)
        graph.replay()
        expected = fused_moe.fused_experts(x2, w13, w2, weights2, ids2)
        torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 32, 2048])
def test_fused_topk_matches_route_at_qwen3_30b_shape(dtype, renormalize, tokens):
    """128 experts, top 8. bf16 logits tie often, and torch's topk of the probabilities may
    take either of two experts whose logits differ by an ulp: so the picked logits are compared
    with the 8 largest (exactly), the experts are 8 distinct ones, and the weights are torch's."""
    g = torch.Generator(device=CUDA).manual_seed(tokens)
    logits = (torch.randn(tokens, 128, generator=g, device=CUDA) * 2).to(dtype)
    weights, ids = moe_routing.fused_topk(logits, 8, renormalize)
    ref_weights, _ = moe_routing.route(logits, 8, renormalize)
    assert torch.equal(logits.gather(1, ids.long()), logits.topk(8, dim=1).values)
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("tokens", [1, 32, 2048, 8192])
@pytest.mark.parametrize("skewed", [False, True])
def test_align_kernel_matches_the_torch_alignment_at_qwen3_30b_shape(tokens, skewed):
    """Random routes, and skewed ones (every token on experts 0-7: one run per expert, most
    experts empty)."""
    g = torch.Generator(device=CUDA).manual_seed(tokens)
    scores = torch.rand(tokens, 128, generator=g, device=CUDA)
    if skewed:
        scores[:, :8] += 1
    ids = scores.topk(8, dim=1).indices.int()
    block_m = fused_moe.block_m_for(ids.numel(), 128)
    got = fused_moe.align_by_expert(ids, 128, block_m)
    expected = fused_moe.align_by_expert_torch(ids, 128, block_m)
    for name, a, b in zip(fused_moe.ExpertBlocks._fields, got, expected, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 8, 32, 33, 2048])
def test_fused_topk_align_equals_the_two_kernels_bit_for_bit(dtype, renormalize, tokens):
    """Up to 8 tokens (64 pairs) one program, past it the two kernels; bf16 logits tie often
    (the lowest expert wins in both)."""
    g = torch.Generator(device=CUDA).manual_seed(tokens)
    logits = (torch.randn(tokens, 128, generator=g, device=CUDA) * 2).to(dtype)
    block_m = fused_moe.block_m_for(tokens * 8, 128)
    weights, ids, blocks = moe_routing.fused_topk_align(logits, 8, renormalize, block_m)
    ref_weights, ref_ids = moe_routing.fused_topk(logits, 8, renormalize)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    expected = fused_moe.align_by_expert(ref_ids, 128, block_m)
    for name, a, b in zip(fused_moe.ExpertBlocks._fields, blocks, expected, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("tokens", [1, 8, 32, 300])
def test_routing_from_the_routers_split_k_slices_at_qwen3_30b_shape(tokens):
    """The router's product as float32 split-K slices (decode sizes; at 300 tokens F.linear's
    product itself) routes as the bf16 product the slices' sum in order rounds to: the same
    experts and blocks, bit for bit, and the same weights up to float32 rounding (the kernel's
    softmax sums float32 tiles in another register layout than bf16 ones), and that product is
    the router's."""
    g = torch.Generator(device=CUDA).manual_seed(tokens)
    x = torch.randn(tokens, 2048, generator=g, device=CUDA).bfloat16()
    router = (torch.randn(128, 2048, generator=g, device=CUDA) * 2048**-0.5).bfloat16()
    parts = splitk.linear_partials(x, router)
    assert parts.dim() == (3 if tokens <= splitk.MAX_ROWS else 2)
    product = parts
    if parts.dim() == 3:
        product = parts[0].clone()
        for part in parts[1:]:
            product += part
        product = product.bfloat16()
    block_m = fused_moe.block_m_for(tokens * 8, 128)
    got = moe_routing.fused_topk_align(parts, 8, True, block_m, torch.bfloat16)
    expected = moe_routing.fused_topk_align(product, 8, True, block_m)
    for a, b in zip(got[1:2] + tuple(got[2]), expected[1:2] + tuple(expected[2]), strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(got[0], expected[0], atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(product, x @ router.T, atol=2e-2, rtol=2e-2)


def test_one_tokens_routing_inside_gate_up_replays_as_the_three_launches():
    """A batch-1 step's experts in two launches (`routed_expert_outputs`), from the router's
    split-K slices, at Qwen3-30B's shapes in bf16, captured once and replayed on other inputs
    and router weights: as eagerly, bit for bit, and as the routing launch then the grouped
    GEMMs, the same experts and outputs within a float32 rounding of the weights."""
    x, w13, w2, _, _ = qwen3_30b_experts(1)
    router = torch.randn(128, 2048, device=CUDA).bfloat16() / 32

    def two_launches():
        return moe_one_token.routed_expert_outputs(
            x, w13, w2, splitk.linear_partials(x, router), 8, True
        )

    def three_launches():
        logits = splitk.linear_partials(x, router)
        block_m = fused_moe.block_m_for(8, 128)
        weights, _, blocks = moe_routing.fused_topk_align(logits, 8, True, block_m, x.dtype)
        return fused_moe.expert_outputs(x, w13, w2, weights, blocks, block_m)

    two_launches()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = two_launches()
    for seed in (1, 2, 3):
        g = torch.Generator(device=CUDA).manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=g, device=CUDA))
        router.copy_(torch.randn(router.shape, generator=g, device=CUDA) / 32)
        graph.replay()
        assert torch.equal(out, two_launches())
        expected = three_launches()
        # (another expert in a slot would differ by the whole output)
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("tokens", [1, 32, 64])
def test_moe_block_replays_in_a_cuda_graph_with_new_logits(tokens):
    """The block as the model runs it on one device (routing and alignment, one launch up to
    32 tokens; the grouped GEMMs; their top_k partials summed by the add + RMSNorm after it),
    captured once from router logits and replayed on other inputs and logits: the same output
    as eagerly, bit for bit, and as the experts summed by torch then the norm, within bf16."""
    x, w13, w2, _, _ = qwen3_30b_experts(tokens)
    logits = torch.randn(tokens, 128, device=CUDA).bfloat16()
    start = torch.randn(tokens, 2048, device=CUDA).bfloat16()  # the residual stream
    residual, norm_weight = start.clone(), torch.rand(2048, device=CUDA).bfloat16() + 0.5
    block_m = fused_moe.block_m_for(tokens * 8, 128)

    def layer():
        residual.copy_(start)
        weights, _, blocks = moe_routing.fused_topk_align(logits, 8, True, block_m)
        pairs = fused_moe.expert_outputs(x, w13, w2, weights, blocks, block_m)
        return fused.add_rms_norm(pairs.transpose(0, 1), residual, norm_weight, 1e-6)

    layer()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = layer()
    for seed in (1, 2):
        g = torch.Generator(device=CUDA).manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=g, device=CUDA))
        logits.copy_(torch.randn(logits.shape, generator=g, device=CUDA))
        graph.replay()
        replayed = normed.clone(), summed.clone()
        eager = layer()
        for a, b in zip(replayed, eager, strict=True):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
        weights, ids = moe_routing.fused_topk(logits, 8, renormalize=True)  # ties as ours
        y = fused_moe.fused_experts(x, w13, w2, weights, ids)  # the sum over top_k in torch
        expected = fused.add_rms_norm(y, start.clone(), norm_weight, 1e-6)
        for a, b in zip(replayed, expected, strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim", [80, 96, 112, 256])
@pytest.mark.parametrize("window", [None, 1000])
def test_padded_head_sizes_in_bfloat16(head_dim, window):
    """Decode (batch 16, contexts to 4K) and prefill (2 x 700 tokens after 300 cached)."""
    heads, kv_heads, block_size, batch, context = 32, 8, 16, 16, 4096
    blocks = batch * context // block_size
    cache = torch.randn(2, blocks + 1, block_size, kv_heads, head_dim, device=CUDA).bfloat16()
    tables = torch.randperm(blocks, device=CUDA).to(torch.int32).view(batch, -1)
    lens = torch.randint(context // 2, context + 1, (batch,), device=CUDA, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device=CUDA).bfloat16()
    backend = TritonAttention(heads, kv_heads, head_dim, batch, CUDA)
    out = torch.empty_like(q)
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True)
    backend.decode(q, out, cache, meta, head_dim**-0.5, sliding_window=window)
    expected = decode_attention(
        q.float(), cache.float(), tables, lens, head_dim**-0.5, sliding_window=window
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)

    starts, seq_lens = [0, 700, 1400], [1000, 1000]
    q = torch.randn(1400, heads, head_dim, device=CUDA).bfloat16()
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1400, dtype=torch.int64, device=CUDA),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=CUDA),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=CUDA),
        block_tables=tables[:2],
        decode_only=False,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
    )
    out = torch.empty_like(q)
    backend.prefill(q, out, cache, meta, head_dim**-0.5, sliding_window=window)
    expected = prefill_attention(
        q.float(), cache.float(), meta, head_dim**-0.5, sliding_window=window
    )
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_graphs_on_equal_graphs_off_in_float32(make_tiny, arch):
    eager = generate(make_tiny(arch), cuda_graphs=False)
    assert generate(make_tiny(arch), cuda_graphs=True) == eager


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_async_bfloat16_equals_sync(make_tiny, arch):
    sync = generate(make_tiny(arch), "bfloat16", async_batching=False)
    assert generate(make_tiny(arch), "bfloat16", async_batching=True) == sync


@pytest.mark.parametrize("arch", NEW_ARCHS)
def test_cuda_matches_transformers_greedy(make_tiny, arch):
    assert_greedy_matches_transformers(make_tiny(arch), attn_implementation="eager")


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_one_sequence_moe_decode_matches_transformers_greedy(make_tiny, arch):
    """Batch-1 decode steps, graphed and async (`moe_one_token`: the post-attention norm inside
    the router's launch, the routing inside GEMM 1), against transformers' greedy tokens in
    float32, up to where their top-2 logits tie."""
    transformers = pytest.importorskip("transformers")
    folder = make_tiny(arch)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, num_blocks=64)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    ).cuda()
    g = torch.Generator().manual_seed(5)
    for length in (1, 23):
        prompt = torch.randint(0, model.config.vocab_size, (length,), generator=g).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        ours = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        assert_tokens_match_transformers(model, prompt, 40, ours)
