"""The MoE routing and alignment Triton kernels (interpreted on CPU) against their torch
references and transformers' routers: `fused_topk` against `route` and the Qwen3-MoE and Mixtral
routers, `align_by_expert` against `align_by_expert_torch`, `fused_topk_align` (both in one
program) against the two kernels and the torch references, a whole MoE block run by the
kernels, its top_k partials summed by the add + RMSNorm after it, against transformers' block,
and a batch-1 step's fewer launches (`moe_one_token`) against the launches they replace."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tandem.config import ModelConfig
from tandem.model import fused, fused_moe, moe, moe_one_token, moe_shared, splitk
from tandem.model.decoder import RMSNorm
from tandem.model.moe_routing import ONE_PROGRAM_MAX_PAIRS, fused_topk, fused_topk_align, route

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter  # noqa: E402

HIDDEN = 32


def hf_router(arch: str, num_experts: int, top_k: int, renormalize: bool, seed: int):
    if arch == "mixtral":  # always renormalises
        config = transformers.MixtralConfig(
            hidden_size=HIDDEN, num_local_experts=num_experts, num_experts_per_tok=top_k
        )
        router = MixtralTopKRouter(config)
    else:
        config = transformers.Qwen3MoeConfig(
            hidden_size=HIDDEN,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=renormalize,
        )
        router = Qwen3MoeTopKRouter(config)
    router.weight.data = torch.randn(
        num_experts, HIDDEN, generator=torch.Generator().manual_seed(seed)
    )
    return router


@pytest.mark.parametrize(
    ("arch", "renormalize"), [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)]
)
@pytest.mark.parametrize(("num_experts", "top_k"), [(60, 4), (128, 8), (8, 2)])
@pytest.mark.parametrize("tokens", [1, 19])
def test_fused_topk_matches_route_and_transformers_routers(
    arch, renormalize, num_experts, top_k, tokens
):
    """fp32, 60 experts (not a power of two), one token and a part-filled last program."""
    router = hf_router(arch, num_experts, top_k, renormalize, seed=tokens + num_experts)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    logits, hf_weights, hf_ids = router(x)
    weights, ids = fused_topk(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (tokens, top_k) and weights.is_contiguous()
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-5)
    ref_weights, ref_ids = route(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)
    if renormalize:
        torch.testing.assert_close(weights.sum(1), torch.ones(tokens))


def test_fused_topk_in_float16_picks_logits_equal_to_torchs_picks():
    """fp16 logits tie often; where they do, any of the tied experts is right."""
    logits = torch.randn(9, 60, generator=torch.Generator().manual_seed(1)).half()
    weights, ids = fused_topk(logits, 8, renormalize=True)
    ref_weights, ref_ids = route(logits, 8, renormalize=True)
    assert torch.equal(logits.gather(1, ids.long()), logits.gather(1, ref_ids))
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


def test_fused_topk_takes_the_lowest_expert_among_equal_logits():
    logits = torch.tensor([[0.0] * 6, [1.0, 3.0, 3.0, 0.0, 3.0, 1.0]])
    weights, ids = fused_topk(logits, 4, renormalize=False)
    assert ids.tolist() == [[0, 1, 2, 3], [1, 2, 4, 0]]
    torch.testing.assert_close(weights[0], torch.full((4,), 1 / 6))
    torch.testing.assert_close(weights[1], logits[1].softmax(0)[[1, 2, 4, 0]])


def assert_same_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    got = fused_moe.align_by_expert(ids, num_experts, block_m)
    expected = fused_moe.align_by_expert_torch(ids, num_experts, block_m)
    for name, a, b in zip(fused_moe.ExpertBlocks._fields, got, expected, strict=True):
        assert torch.equal(a, b), name


def random_ids(tokens: int, num_experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Each token's top_k distinct experts, as a router gives them."""
    scores = torch.rand(tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    return scores.topk(top_k, dim=1).indices.int()


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k"),
    [(1, 128, 8), (1, 60, 4), (13, 8, 2), (32, 128, 8), (50, 60, 8)],
)
def test_align_kernel_matches_the_torch_alignment(block_m, tokens, num_experts, top_k):
    """One token, empty experts (most of 128 at one token), Qwen3-30B's 32-token step, 400
    pairs over 25 programs of a decode step's chunk."""
    assert_same_blocks(random_ids(tokens, num_experts, top_k), num_experts, block_m)


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_kernel_with_one_hot_expert_and_unrouted_experts(block_m):
    ids = torch.full((70, 2), 3, dtype=torch.int32)  # 140 pairs, one expert: nine programs
    ids[::5, 1] = 6
    assert_same_blocks(ids, 8, block_m)
    assert_same_blocks(ids.long(), 8, block_m)  # the torch router's int64 ids


def test_align_kernel_counts_past_one_scan():
    """1,280 pairs: more than one histogram step (ALIGN_SCAN) and twenty programs."""
    assert fused_moe.align_chunk_and_scan(160 * 8) == (fused_moe.ALIGN_CHUNK, 1024)
    assert_same_blocks(random_ids(160, 16, 8, seed=2), 16, 16)


@pytest.mark.parametrize(("num_experts", "block_m"), [(128, 16), (6, 4), (3, 16)])
def test_sorted_rows_bound_holds_and_is_reached(num_experts, block_m):
    """Every expert's run fits in `max_sorted_rows`; one pair on each of min(pairs, experts)
    experts, or as many runs one pair past a whole block as there are, fills it."""
    for num_pairs in range(1, 40):
        max_rows = fused_moe.max_sorted_rows(num_pairs, num_experts, block_m)
        spread = torch.arange(num_pairs) % num_experts
        rows = fused_moe.align_by_expert_torch(spread, num_experts, block_m).num_rows.item()
        assert rows <= max_rows
        if num_pairs <= num_experts:  # a block per pair
            assert rows == max_rows == num_pairs * block_m
        worst = 0
        for runs in range(1, min(num_pairs, num_experts) + 1):  # pairs split over `runs` experts
            counts = [num_pairs // runs + (i < num_pairs % runs) for i in range(runs)]
            worst = max(worst, sum(-(-c // block_m) for c in counts))
        assert worst * block_m <= max_rows


def assert_routes_as_the_two_kernels(logits: torch.Tensor, top_k: int, renormalize: bool):
    """`fused_topk_align` against `fused_topk` then `align_by_expert` (bit for bit) and against
    the torch alignment of its ids; returns its weights and ids."""
    num_pairs, num_experts = logits.shape[0] * top_k, logits.shape[1]
    block_m = fused_moe.block_m_for(num_pairs, num_experts)
    weights, ids, blocks = fused_topk_align(logits, top_k, renormalize, block_m)
    ref_weights, ref_ids = fused_topk(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    kernels = fused_moe.align_by_expert(ref_ids, num_experts, block_m)
    torch_blocks = fused_moe.align_by_expert_torch(ids, num_experts, block_m)
    for name, got, a, b in zip(fused_moe.ExpertBlocks._fields, blocks, kernels, torch_blocks,
                               strict=True):  # fmt: skip
        assert torch.equal(got, a) and torch.equal(got, b), name
    return weights, ids


AT_THE_BOUND = ONE_PROGRAM_MAX_PAIRS // 8  # Qwen3-30B's tokens at the bound, top 8


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(
    ("num_experts", "top_k", "tokens"),
    # Qwen3-30B's 128 / top 8 and Mixtral's 8 / top 2: one token, the most pairs one program
    # takes, and a token more (the two kernels)
    [(128, 8, 1), (128, 8, AT_THE_BOUND), (128, 8, AT_THE_BOUND + 1), (8, 2, 1), (8, 2, 32),
     (8, 2, ONE_PROGRAM_MAX_PAIRS // 2 + 1), (60, 4, 7)],
)  # fmt: skip
def test_fused_topk_align_matches_the_two_kernels_and_torch(
    num_experts, top_k, tokens, renormalize
):
    g = torch.Generator().manual_seed(tokens + num_experts)
    logits = torch.randn(tokens, num_experts, generator=g)
    weights, ids = assert_routes_as_the_two_kernels(logits, top_k, renormalize)
    ref_weights, ref_ids = route(logits, top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("num_experts", "top_k", "tokens"), [(128, 8, 1), (128, 8, AT_THE_BOUND), (8, 2, 32)]
)
def test_fused_topk_align_takes_the_lowest_expert_among_equal_logits(num_experts, top_k, tokens):
    """Logits of four values, in float16 too: ties everywhere."""
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randint(0, 4, (tokens, num_experts), generator=g).float()
    lowest_first = torch.sort(-logits, dim=1, stable=True).indices[:, :top_k]
    for dtype in (torch.float32, torch.float16):
        weights, ids = assert_routes_as_the_two_kernels(logits.to(dtype), top_k, True)
        assert torch.equal(ids.long(), lowest_first)
        expected = logits.softmax(1).gather(1, lowest_first)
        torch.testing.assert_close(weights, expected / expected.sum(1, keepdim=True))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sixteen_bit_logits_route_by_int32_keys_as_torch_sorts_them(dtype):
    """16-bit logits route by int32 keys (the logit's bits over the expert): the picks equal a
    stable sort's, among signed values, infinities, the largest finite one and -0.0 == 0.0
    ties (the lower expert first), and the weights torch's softmax of the same logits."""
    largest = torch.finfo(dtype).max
    values = torch.tensor([-0.0, 0.0, -1.5, 1.5, -3.0, 2.0, float("-inf"), largest, -2.0, 1e-3])
    g = torch.Generator().manual_seed(1)
    logits = values[torch.randint(0, len(values), (19, 60), generator=g)].to(dtype)
    weights, ids = fused_topk(logits, 6, renormalize=False)
    picks = torch.sort(-logits.float(), dim=1, stable=True).indices[:, :6]
    assert torch.equal(ids.long(), picks)
    expected = logits.float().softmax(1).gather(1, picks)
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)


def tiny_moe_block(make_tiny, arch: str, tp=None):
    """(transformers' MoE block of layer 0, ours with its weights, the config), fp32."""
    folder = make_tiny(arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    layer = model.model.layers[0].mlp
    ours = moe.SparseMoeBlock(cfg, tp or moe.TensorParallel())
    ours.gate.weight.data.copy_(layer.gate.weight)
    ours.experts.gate_up_proj.data.copy_(layer.experts.gate_up_proj)
    ours.experts.down_proj.data.copy_(layer.experts.down_proj)
    if arch == "qwen2_moe":  # the shared expert and its gate
        shared = layer.shared_expert
        ours.shared_expert.gate_up_proj.weight.data.copy_(
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        )
        ours.shared_expert.down_proj.weight.data.copy_(shared.down_proj.weight)
        ours.shared_expert_gate.weight.data.copy_(layer.shared_expert_gate.weight)
    return layer, ours, cfg


@pytest.mark.parametrize("tokens", [1, 11])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_block_by_the_kernels_matches_transformers_block(make_tiny, monkeypatch, arch, tokens):
    """Routing, alignment and both grouped GEMMs interpreted (at one token the routing inside
    GEMM 1), against transformers (fp32): on one device the block's output is its top_k
    partials, which sum to transformers' output; with a shared expert (Qwen2-MoE) the output
    itself, joined in one launch (`moe_shared`)."""
    layer, ours, cfg = tiny_moe_block(make_tiny, arch)
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    x = torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours(x)
        if arch == "qwen2_moe":
            assert got.shape == (tokens, cfg.hidden_size)
        else:
            assert got.shape == (cfg.num_experts_per_tok, tokens, cfg.hidden_size)
            got = got.sum(0)
        torch.testing.assert_close(got, layer(x[None])[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "top_k", "hidden", "parts"), [(1, 4, 96, 3), (5, 2, 1100, 0)])
def test_shared_join_equals_the_sum_the_gate_and_the_scale_in_torch(
    dtype, tokens, top_k, hidden, parts
):
    """`join_shared` (interpreted): routed.sum(1) + sigmoid(x . gate) * shared, the shared
    product given as float32 split-K slices or as itself, rounded where torch's ops round;
    hidden sizes that no block divides, and one past a block (two column programs)."""
    g = torch.Generator().manual_seed(tokens)
    routed = torch.randn(tokens, top_k, hidden, generator=g).to(dtype)
    shape = (parts, tokens, hidden) if parts else (tokens, hidden)
    shared = torch.randn(shape, generator=g).to(torch.float32 if parts else dtype)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate = (torch.randn(1, hidden, generator=g) / hidden**0.5).to(dtype)
    got = moe_shared.join_shared(routed, shared, x, gate)
    # the block's torch path: the slices summed into the product, then torch's ops in x's dtype
    product = shared.sum(0).to(dtype) if parts else shared
    want = routed.sum(1) + torch.sigmoid(torch.nn.functional.linear(x, gate)) * product
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the reference itself: the sum, the gate and the scale as the block's torch path has them
    full = shared.sum(0) if parts else shared.float()
    direct = routed.float().sum(1) + torch.sigmoid(x.float() @ gate.float().T) * full.float()
    torch.testing.assert_close(want.float(), direct, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("slices", [False, True])
@pytest.mark.parametrize(("num_experts", "top_k"), [(128, 8), (8, 2), (60, 4)])
def test_one_tokens_routing_inside_gate_up_equals_the_three_launches(
    num_experts, top_k, slices, renormalize, dtype
):
    """A batch-1 step's two launches (`routed_expert_outputs`: each GEMM 1 program routes the
    token itself) against `fused_topk_align` then `expert_outputs`: the same experts, the same
    alignment for GEMM 2, the same weights and outputs; from logits or the router's split-K
    slices, in float32 and float16 (interpreted)."""
    g = torch.Generator().manual_seed(num_experts + top_k)
    hidden, inter = 64, 32
    x = torch.randn(1, hidden, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / 8).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) / 8).to(dtype)
    router = (torch.randn(num_experts, hidden, generator=g) / 4).to(dtype)
    logits = splitk.linear_partials(x, router) if slices else x @ router.T
    assert logits.dim() == (3 if slices else 2)
    got = moe_one_token.routed_expert_outputs(x, w13, w2, logits, top_k, renormalize)
    block_m = fused_moe.block_m_for(top_k, num_experts)
    weights, ids, blocks = fused_topk_align(logits, top_k, renormalize, block_m, dtype)
    want = fused_moe.expert_outputs(x, w13, w2, weights, blocks, block_m)
    assert got.shape == want.shape == (1, top_k, hidden) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    # and against torch's experts from torch's routing of the same product
    product = logits.sum(0).to(dtype) if slices else logits
    ref_weights, ref_ids = route(product.float(), top_k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    ref = fused_moe.fused_experts_torch(x.float(), w13.float(), w2.float(), ref_weights, ref_ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().sum(1), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_partials_through_add_rms_norm_equal_the_torch_experts_then_the_torch_norm(
    make_tiny, monkeypatch, arch, tokens, dtype
):
    """The sum over top_k folded into the residual add + RMSNorm after the block: the same
    normed rows and residual stream as `fused_experts_torch`, then the norm in torch."""
    _, ours, cfg = tiny_moe_block(make_tiny, arch)
    ours.to(dtype)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(dtype)
    residual = torch.randn(tokens, cfg.hidden_size, generator=g).to(dtype)
    norm_weight = (1 + torch.randn(cfg.hidden_size, generator=g) / 4).to(dtype)
    eps = cfg.rms_norm_eps
    with torch.no_grad():
        weights, ids = route(ours.gate(x), cfg.num_experts_per_tok, cfg.norm_topk_prob)
        w13, w2 = ours.experts.gate_up_proj, ours.experts.down_proj
        y = fused_moe.fused_experts_torch(x, w13, w2, weights, ids, cfg.hidden_act)
        expected_normed, expected_summed = fused.add_rms_norm(y, residual.clone(), norm_weight, eps)
        monkeypatch.setattr(fused, "use_kernels", lambda x: True)
        partials = ours(x)
        assert partials.dtype == dtype
        normed, summed = fused.add_rms_norm(partials, residual.clone(), norm_weight, eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(summed, expected_summed, atol=tol, rtol=tol)
    torch.testing.assert_close(normed, expected_normed, atol=tol, rtol=tol)


def test_moe_block_sums_its_partials_itself_under_tensor_parallelism(make_tiny, monkeypatch):
    """All-reduce needs each rank's summed output: [tokens, hidden], not partials."""
    reduced = []
    tp = SimpleNamespace(size=2, all_reduce=lambda y: reduced.append(y) or y)
    layer, ours, cfg = tiny_moe_block(make_tiny, "qwen3_moe", tp)
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = ours(x)
        assert len(reduced) == 1 and reduced[0] is out and out.shape == (5, cfg.hidden_size)
        torch.testing.assert_close(out, layer(x[None])[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_experts", "top_k", "tokens"), [(128, 8, 1), (128, 8, 19), (8, 2, 5)])
def test_routing_adds_up_the_routers_split_k_slices(num_experts, top_k, tokens, dtype):
    """The router's product as float32 split-K slices (`splitk.linear_partials`, interpreted):
    one launch (up to the bound) or two (past it) route as from the product in `dtype`, the
    slices' sum rounded once; and as torch's route of F.linear's product."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 256, generator=g).to(dtype)
    router = (torch.randn(num_experts, 256, generator=g) / 16).to(dtype)
    parts = splitk.linear_partials(x, router)
    assert parts.dim() == 3 and parts.shape[0] > 1 and parts.dtype == torch.float32
    product = parts[0].clone()
    for part in parts[1:]:  # the slices' sum in order, rounded once
        product += part
    product = product.to(dtype)
    block_m = fused_moe.block_m_for(tokens * top_k, num_experts)
    weights, ids, blocks = fused_topk_align(parts, top_k, True, block_m, dtype)
    ref_weights, ref_ids, ref_blocks = fused_topk_align(product, top_k, True, block_m)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)
    for got, want in zip(blocks, ref_blocks, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(fused_topk(parts, top_k, True, dtype)[1], ref_ids)
    torch_weights, torch_ids = route(
        torch.nn.functional.linear(x.float(), router.float()), top_k, True
    )
    assert torch.equal(ids.long(), torch_ids)
    torch.testing.assert_close(weights, torch_weights, atol=2e-3, rtol=2e-3)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # the interpreter's max over NaN logits
@pytest.mark.parametrize(("num_experts", "top_k"), [(128, 8), (8, 2)])
def test_one_tokens_alignment_gives_each_pair_a_run_even_from_nan_logits(num_experts, top_k):
    """A batch-1 step aligns by the ranks of its token's experts. NaN logits name one expert
    several times; each pair still gets a run of its own, of a real expert, and none is lost."""
    logits = torch.full((1, num_experts), float("nan"))
    block_m = fused_moe.block_m_for(top_k, num_experts)
    _, ids, blocks = fused_topk_align(logits, top_k, True, block_m)
    assert int(ids.max()) < num_experts
    assert int(blocks.num_rows) == top_k * block_m == blocks.sorted_pairs.numel()
    runs = blocks.sorted_pairs.view(top_k, block_m)
    assert sorted(runs[:, 0].tolist()) == list(range(top_k))  # every pair starts one run
    assert bool((runs[:, 1:] == top_k).all())  # the rest is padding
    assert torch.equal(blocks.block_expert, ids[0][runs[:, 0].long()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slices", [False, True])
@pytest.mark.parametrize("num_experts", [128, 60])
def test_norm_inside_the_routers_launch_equals_the_norm_then_the_router(num_experts, slices, dtype):
    """`norm_and_router` (interpreted): the normed row, the sum and the router's slices equal
    the add + RMSNorm kernel's then the split-K product's, from o's split-K slices or its
    product, and leave the residual stream as it was."""
    g = torch.Generator().manual_seed(num_experts)
    hidden = 256
    x = torch.randn(1, hidden, generator=g).to(dtype)
    o_weight = (torch.randn(hidden, hidden, generator=g) / 16).to(dtype)
    attended = splitk.linear_partials(x, o_weight) if slices else x @ o_weight.T
    residual = torch.randn(1, hidden, generator=g).to(dtype)
    norm_weight = (1 + torch.randn(hidden, generator=g) / 4).to(dtype)
    router = (torch.randn(num_experts, hidden, generator=g) / 16).to(dtype)
    before = residual.clone()
    normed, summed, logits = moe_one_token.norm_and_router(
        attended, residual, norm_weight, 1e-6, router
    )
    assert torch.equal(residual, before)
    want_normed, want_summed = fused._add_rms_norm_triton(
        attended, before.clone(), norm_weight, 1e-6
    )
    want_logits = splitk.linear_partials(want_normed, router)
    assert torch.equal(summed, want_summed)
    tol = 0 if dtype == torch.float32 else 1e-3  # float16: one rounding of 1 / rms may differ
    torch.testing.assert_close(normed, want_normed, atol=tol, rtol=tol)
    assert logits.shape == want_logits.shape and logits.dtype == torch.float32
    torch.testing.assert_close(logits, want_logits, atol=tol, rtol=tol)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_moe_block_after_attention_at_one_token_equals_the_norm_then_the_block(
    make_tiny, monkeypatch, arch
):
    """The layer's seam (`SparseMoeBlock.after_attention`, interpreted): at one token the norm
    inside the router's launch and the routing inside GEMM 1 give the block's partials and the
    residual stream that the add + RMSNorm, then `forward`, give; past one token it declines."""
    _, ours, cfg = tiny_moe_block(make_tiny, arch)
    monkeypatch.setattr(fused, "use_kernels", lambda x: True)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.data = (
        1 + torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(4)) / 4
    )
    g = torch.Generator().manual_seed(3)
    o_weight = torch.randn(cfg.hidden_size, cfg.hidden_size, generator=g) / 8
    for tokens in (1, 2):
        x = torch.randn(tokens, cfg.hidden_size, generator=g)
        attended = splitk.linear_partials(x, o_weight)
        start = torch.randn(tokens, cfg.hidden_size, generator=g)
        with torch.no_grad():
            residual = start.clone()
            got = ours.after_attention(attended, residual, norm)
            if tokens > 1:
                assert got is None and torch.equal(residual, start)
                continue
            want_residual = start.clone()
            normed, _ = fused.add_rms_norm(attended, want_residual, norm.weight, norm.eps)
            want = ours(normed)
        shape = (
            (1, cfg.hidden_size)
            if arch == "qwen2_moe"
            else (cfg.num_experts_per_tok, 1, cfg.hidden_size)
        )
        assert got.shape == want.shape == shape
        assert torch.equal(residual, want_residual)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
