"""The async CUDA path: streams, events, slots, graphs and carry-over against eager/sync runs."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tandem import LLM, SamplingParams, runner
from tandem.attention.triton_backend import LARGE_BATCH, leading_single_tokens
from tandem.bench import counting_jit_compiles
from tandem.piecewise import PiecewiseGraphs
from tandem.runner import Runner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENGTHS = [3, 41, 7, 18, 29, 1, 60, 5]
MAX_TOKENS = [24, 9, 30, 16, 24, 12, 20, 33]


def prompts(vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [
        {"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()}
        for n in PROMPT_LENGTHS
    ]


def generate(folder, dtype="float32", temperature=0.0, **engine_args) -> list[list[int]]:
    llm = LLM(
        str(folder),
        dtype=dtype,
        max_model_len=256,
        max_num_batched_tokens=32,
        num_blocks=256,
        **engine_args,
    )
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(MAX_TOKENS)
    ]
    outs = llm.generate(prompts(llm.engine.model_config.vocab_size), params, use_tqdm=False)
    assert llm.engine.allocator.num_free == llm.engine.num_blocks
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_async_equals_sync_on_cuda(make_tiny, arch, dtype):
    # Same steps in both modes (ignore_eos, fixed lengths), so the same kernels: exact equality.
    for temperature in (0.0, 1.0):
        sync = generate(make_tiny(arch), dtype, temperature, async_batching=False)
        assert generate(make_tiny(arch), dtype, temperature, async_batching=True) == sync


def test_startup_seconds_split_the_start_into_loading_and_graph_capture(make_tiny):
    """Engine.startup_seconds (tandem bench startup): the CUDA graphs' capture takes time of
    its own, and loading and capture fit within the whole; without graphs none is captured."""
    engine_args = {"max_model_len": 128, "num_blocks": 64}  # two engines side by side
    parts = LLM(str(make_tiny("llama")), **engine_args).engine.startup_seconds
    assert parts["graph_capture"] > 0 and parts["load"] > 0
    assert parts["load"] + parts["graph_capture"] <= parts["total"]
    eager = LLM(str(make_tiny("llama")), enforce_eager=True, **engine_args)
    assert eager.engine.startup_seconds["graph_capture"] == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_graphs_on_equals_graphs_off_in_float32(make_tiny, arch):
    eager = generate(make_tiny(arch), cuda_graphs=False)
    assert generate(make_tiny(arch), cuda_graphs=True) == eager


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_captured_pieces_equal_the_same_pieces_run_eagerly(make_tiny, monkeypatch, arch, dtype):
    """Steps with prefill replay their pieces' graphs, the attentions launched between them:
    the same kernels on the same padded shapes as the uncaptured pieces, so the same tokens,
    exactly (what the graphs read and write between pieces is in the fixed buffers)."""
    runs = []
    original = PiecewiseGraphs.forward

    def counted(self, *args):
        runs.append(bool(self.graphs))
        return original(self, *args)

    monkeypatch.setattr(PiecewiseGraphs, "forward", counted)
    for temperature in (0.0, 1.0):
        captured = generate(make_tiny(arch), dtype, temperature, cuda_graphs=True)
        assert runs and all(runs)
        runs.clear()
        with monkeypatch.context() as uncaptured:
            uncaptured.setattr(PiecewiseGraphs, "capture", lambda self, *args: None)
            eager = generate(make_tiny(arch), dtype, temperature, cuda_graphs=True)
        assert runs and not any(runs)
        runs.clear()
        assert captured == eager


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_matches_transformers_greedy(make_tiny, arch):
    assert_greedy_matches_transformers(make_tiny(arch))


def assert_greedy_matches_transformers(folder, **model_args) -> None:
    """Async graphed greedy tokens equal transformers' generate in float32 on the GPU, up to
    where their top-2 logits tie."""
    transformers = pytest.importorskip("transformers")
    ours = generate(folder, cuda_graphs=True, async_batching=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **model_args
    ).cuda()
    for p, n, tokens in zip(prompts(model.config.vocab_size), MAX_TOKENS, ours, strict=True):
        assert_tokens_match_transformers(model, p["prompt_token_ids"], n, tokens)


def assert_tokens_match_transformers(model, prompt: list[int], n: int, tokens: list[int]):
    """`tokens` equal transformers' greedy `n` tokens after `prompt`, up to where their top-2
    logits tie."""
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.vocab_size - 1,
        output_logits=True,
        return_dict_in_generate=True,
    )
    theirs = out.sequences[0, ids.shape[1] :].tolist()
    for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)):
        if a != b:
            top2 = out.logits[i][0].topk(2).values
            # Triton's float32 dots use TF32 (10-bit mantissa): ties are looser than on CPU
            assert top2[0] - top2[1] < 2e-2, f"token {i} differs without a tie"
            break


def test_bfloat16_graph_logprobs_close_to_eager(make_tiny):
    """Graphs pad the batch; the real rows' distributions stay within bf16 rounding of eager."""
    folder = make_tiny("llama")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    ids = prompts(704)[:4]
    outs = {}
    for graphs in (False, True):
        llm = LLM(
            str(folder), dtype="bfloat16", max_model_len=256, num_blocks=64, cuda_graphs=graphs
        )
        outs[graphs] = llm.generate(ids, params, use_tqdm=False)
    for a, b in zip(outs[False], outs[True], strict=True):
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        for token in first_a.keys() & first_b.keys():
            assert abs(first_a[token] - first_b[token]) < 0.05


def logprob_params() -> list[SamplingParams]:
    """Seeded sampling with each kind of logprobs beside rows without, and a penalized row."""
    kinds = [
        {"logprobs": 0},
        {"logprobs": 3},
        {},
        {"logprob_token_ids": [5, 9, 700]},
        {"logprobs": 1, "repetition_penalty": 1.3},
        {},
        {"logprobs": 0},
        {"logprobs": 2},
    ]
    return [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i, **kind)
            for i, (n, kind) in enumerate(zip(MAX_TOKENS, kinds, strict=True))]  # fmt: skip


def test_logprob_steps_replay_the_forward_graph_and_equal_eager_steps(
    make_tiny, monkeypatch, counted_waits
):
    """A decode step with logprobs replays its forward graph and samples eagerly from the graph's
    logits: in float32 the same tokens as an engine without graphs, the same logprobs (TF32
    rounding apart), and the step loop still waits only on d2h_done."""
    steps = []
    original = Runner._sample_step

    def recorded(self, batch):
        steps.append((batch.graphed, batch.sampling_graphed, batch.num_top_logprobs is not None))
        return original(self, batch)

    monkeypatch.setattr(Runner, "_sample_step", recorded)
    outs = {}
    for graphs in (False, True):
        llm = LLM(str(make_tiny("llama")), dtype="float32", max_model_len=256,
                  max_num_batched_tokens=32, num_blocks=256, cuda_graphs=graphs)  # fmt: skip
        counted_waits.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs[graphs] = llm.generate(prompts(704), logprob_params(), use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert sorted(counted_waits) == list(range(llm.engine.num_steps))
        assert llm.engine.allocator.num_free == llm.engine.num_blocks
    assert (True, False, True) in steps  # logprob steps on the forward graph
    assert (True, True, False) not in steps  # every step here has a logprob row
    for eager, graphed in zip(outs[False], outs[True], strict=True):
        a, b = eager.outputs[0], graphed.outputs[0]
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is None:
            continue
        for entry_a, entry_b, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert_entries_close(entry_a, entry_b, token, tolerance=2e-3)


def test_logprobs_of_the_whole_vocabulary_match_transformers_and_wait_only_on_d2h_done(
    make_tiny, counted_waits
):
    """max_logprobs=-1 on the async graphed engine: rows asking for 40 top ids and for every id
    (-1, with the prompt's too) beside rows asking for none or 0 get transformers' ids and
    log-softmax values (TF32 apart) from the slots' top-logprob buffers, and the step loop still
    waits only on d2h_done."""
    from transformers import AutoModelForCausalLM

    folder = str(make_tiny("llama"))
    llm = LLM(folder, dtype="float32", max_model_len=256, num_blocks=64, max_logprobs=-1)
    vocab = llm.engine.model_config.vocab_size
    kinds = [{"logprobs": 40}, {}, {"logprobs": -1, "prompt_logprobs": -1}, {"logprobs": 0}]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **k) for k in kinds]
    counted_waits.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = llm.generate(prompts(vocab)[:4], params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(counted_waits) == list(range(llm.engine.num_steps))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda()
    for out, kind in zip(outs, kinds, strict=True):
        prompt, tokens = out.prompt_token_ids, out.outputs[0].token_ids
        with torch.no_grad():
            rows = model(torch.tensor([prompt + tokens[:-1]]).cuda()).logits[0]
        rows = rows.double().log_softmax(-1).cpu()
        width = {None: None, 0: 0, 40: 40, -1: vocab}[kind.get("logprobs")]
        if width is None:
            assert out.outputs[0].logprobs is None
            continue
        for k, entry in enumerate(out.outputs[0].logprobs):
            row = rows[len(prompt) - 1 + k]
            assert len(entry) == width + (tokens[k] not in row.topk(width).indices.tolist())
            for token, value in entry.items():
                assert value.logprob == pytest.approx(row[token].item(), abs=2e-3)
        if "prompt_logprobs" in kind:
            for p in range(1, len(prompt)):
                entry = out.prompt_logprobs[p]
                assert len(entry) == vocab
                got = torch.tensor([entry[t].logprob for t in range(vocab)], dtype=torch.float64)
                torch.testing.assert_close(got, rows[p - 1], atol=2e-3, rtol=0)


def assert_entries_close(a: dict, b: dict, sampled: int, tolerance: float) -> None:
    """Two runs' logprob entries of one position (whose sampled token is `sampled`): the same
    ids with values within `tolerance` and the same ranks, but where rounding breaks a near-tie
    the other way (an id at the edge of the top ones, a rank one off)."""
    for token in a.keys() & b.keys():
        assert b[token].logprob == pytest.approx(a[token].logprob, abs=tolerance)
        rank_a, rank_b = a[token].rank, b[token].rank
        assert (rank_a is None) == (rank_b is None)
        assert rank_a is None or abs(rank_a - rank_b) <= 1
    for token in a.keys() ^ b.keys():  # among one run's top ones alone: tied with their last
        value = (a.get(token) or b.get(token)).logprob
        other = b if token in a else a
        last = min(v.logprob for t, v in other.items() if t != sampled)
        assert abs(last - value) <= tolerance


@pytest.mark.parametrize("library", ["cublas", "cublaslt"])
def test_graphs_capture_the_chosen_blas_and_eager_steps_keep_torchs(
    make_tiny, monkeypatch, library
):
    """Captured graphs run their matmuls through TANDEM_BLAS's library; eager steps (prefill)
    run under the caller's choice, which is back after capture."""
    monkeypatch.setattr(runner, "BLAS_LIBRARY", library)
    seen = []
    original = Runner._forward

    def recorded(self, *args, **kwargs):
        capturing = torch.cuda.is_current_stream_capturing()
        seen.append((capturing, torch.backends.cuda.preferred_blas_library()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "_forward", recorded)
    before = torch.backends.cuda.preferred_blas_library()
    generate(make_tiny("qwen3"), cuda_graphs=True)
    captured = {chosen for capturing, chosen in seen if capturing}
    assert captured == {torch.backends.cuda._BlasBackends[library]}
    assert (False, before) in seen  # an eager prefill step
    assert torch.backends.cuda.preferred_blas_library() == before


def test_step_loop_blocks_only_on_the_d2h_event(make_tiny, counted_waits):
    """Under sync debug mode "error", any synchronizing call in the loop raises; the one allowed
    wait (Runner.wait on d2h_done) runs with the check lifted and is counted."""
    llm = LLM(str(make_tiny("qwen3")), max_model_len=256, max_num_batched_tokens=32, num_blocks=64)
    waits = counted_waits
    params = [
        SamplingParams(temperature=t, top_p=0.9, max_tokens=20, seed=1) for t in (0.0, 1.0, 0.7)
    ]
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.generate(prompts(704)[:3], params, use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sorted(waits) == list(range(llm.engine.num_steps))


def test_a_workload_of_other_shapes_compiles_no_kernel_after_the_first(make_tiny):
    """Graph capture and one workload compile every Triton kernel the engine launches: eager steps
    of other shapes (mixed steps with other numbers of leading decodes, prompts chunked at other
    offsets, other batch sizes to sample) run without compiling, so no timed run pays for one."""
    llm = LLM(str(make_tiny("qwen3")), dtype="bfloat16", max_model_len=256,
              max_num_batched_tokens=32, num_blocks=256)  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    first = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=i)
             for i, n in enumerate(MAX_TOKENS)]  # fmt: skip
    llm.generate(prompts(vocab), first, use_tqdm=False)
    g = torch.Generator().manual_seed(2)
    lengths, max_tokens = [2, 50, 13, 33, 9, 70, 4, 21, 16, 47, 1, 38], [5, 17, 40, 3, 26, 11]
    other = [
        {"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lengths
    ]
    params = [SamplingParams(temperature=t, max_tokens=max_tokens[i % 6], ignore_eos=True, seed=i)
              for i, t in enumerate([0.0, 1.0] * 6)]  # fmt: skip
    with counting_jit_compiles() as compiles:
        llm.generate(other, params, use_tqdm=False)
    assert compiles == [0]


def test_steps_with_prefill_and_a_large_decode_batch_compile_no_kernel_after_a_warm_up(make_tiny):
    """Steps with prefill lead with their running requests' decode rows, which take the decode
    kernel without the rotary where the decode graphs of fewer than 128 rows take it with.
    Graph capture compiles it both ways, so after a warm-up of a few short requests (as `tandem
    bench` runs one: one step with prefill, then decodes) a batch that grows to 160 requests,
    its steps with prefill leading with a few to 159 decode rows, compiles nothing (small's first
    timed run compiled two kernels, 2026-12-02)."""
    llm = LLM(str(make_tiny("qwen3")), dtype="bfloat16", max_model_len=128, max_num_seqs=160,
              max_num_batched_tokens=256, num_blocks=1024)  # fmt: skip
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(3)

    def requests(count: int, length: int) -> list[dict]:
        ids = torch.randint(0, vocab, (count, length), generator=g).tolist()
        return [{"prompt_token_ids": row} for row in ids]

    warm = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=0)
    llm.generate(requests(4, 16), warm, use_tqdm=False)
    leading = []  # of each step with prefill: its leading decode rows
    build = llm.engine.builder.build

    def counting_build(*args, **kwargs):
        batch = build(*args, **kwargs)
        if not batch.decode_only:
            leading.append(leading_single_tokens(batch.query_start_loc))
        return batch

    llm.engine.builder.build = counting_build
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1)
    with counting_jit_compiles() as compiles:
        llm.generate(requests(160, 16), params, use_tqdm=False)
    met = [rows for rows in leading if rows]
    assert min(met) < 32 and max(met) >= LARGE_BATCH  # small batches to the large-batch tiles
    assert compiles == [0]


SANITIZED_RUN = textwrap.dedent(
    """
    import sys
    from tandem import LLM, SamplingParams
    from tandem.model.tiny import make_tiny_model
    folder = make_tiny_model(sys.argv[1], "llama")
    for graphs in (False, True):
        llm = LLM(str(folder), max_model_len=128, max_num_batched_tokens=16, num_blocks=12, cuda_graphs=graphs)
        prompts = [{"prompt_token_ids": list(range(3 + 7 * i, 20 + 9 * i))} for i in range(6)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        print("ok", graphs, sum(len(o.outputs[0].token_ids) for o in outs))
    """
)


def test_async_loop_is_clean_under_the_stream_sanitizer(run_sanitized):
    assert run_sanitized(SANITIZED_RUN).count("ok") == 2


@pytest.mark.parametrize(("batch", "context"), [(8, 2000), (64, 700), (1, 4096)])
def test_triton_decode_in_bfloat16_at_llama_3_8b_sizes(batch, context):
    from tandem.attention import AttentionMetadata
    from tandem.attention.torch_ref import decode_attention
    from tandem.attention.triton_backend import TritonAttention

    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    blocks = batch * -(-context // block_size)
    cache = torch.randn(
        2, blocks + 1, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16
    )
    tables = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, -1)
    lens = torch.randint(context // 2, context + 1, (batch,), device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    meta = AttentionMetadata(lens, lens, lens, tables, decode_only=True)
    TritonAttention(heads, kv_heads, head_dim, batch, torch.device("cuda")).decode(
        q, out, cache, meta, head_dim**-0.5
    )
    expected = decode_attention(q.float(), cache.float(), tables, lens, head_dim**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_bench_copy_rate_agrees_with_a_wall_clock_timed_copy():
    """The bench's event-timed copy rate against 20 copies timed with the wall clock."""
    import time

    from tandem.bench import copy_tb_per_s

    device = torch.device("cuda")
    rate = copy_tb_per_s(device)
    src = torch.empty(1 << 28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    wall = 2 * 20 * src.numel() / (time.perf_counter() - start) / 1e12
    assert 0.5 * wall < rate < 1.5 * wall
