"""Penalties, logit_bias, allowed_token_ids and bad_words (penalties.py) against independent
references: transformers' repetition processor, OpenAI's presence/frequency formula, and a greedy
loop over transformers' logits that applies the same processors."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.engine import Engine
from tandem.io_slot import IOSlot
from tandem.penalties import (
    PenaltyState,
    apply_dense,
    bad_word_token_ids,
    check_request,
    fill_step_inputs,
    state_bytes,
)
from tandem.request import Request
from tandem.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

NUM_STEPS = 32
TIE = 1e-4
PROMPT_LENGTHS = [5, 23, 9, 14, 1, 31, 12, 7]


# ---- the device state, step by step ---------------------------------------------------------


def slot_with_step(
    vocab: int, tokens: list[list[int]], prompt_lens: list[int], starts: list[int], rows: list[int]
) -> IOSlot:
    """An IO slot holding a step: row i feeds tokens[i] from position starts[i]; `rows` are the
    state rows (the scratch row, 8, for a row without state)."""
    slot = IOSlot(0, 64, 8, 4, torch.device("cpu"))
    x = slot.np_in
    n = len(tokens)
    lengths = [len(t) for t in tokens]
    flat = np.concatenate(tokens)
    x["input_ids"][: len(flat)] = flat
    x["carry_index"][: len(flat)] = -1
    x["positions"][: len(flat)] = np.concatenate(
        [np.arange(s, s + k) for s, k in zip(starts, lengths, strict=True)]
    )
    x["logits_indices"][:n] = np.cumsum(lengths) - 1
    # outputs known once the step is fed: the index of the one it samples
    x["sample_positions"][:n] = np.maximum(np.array(starts) + lengths - prompt_lens, 0)
    seq_of_token = np.repeat(np.arange(n), lengths)
    fill_step_inputs(
        x,
        np.array(rows),
        seq_of_token,
        x["positions"][: len(flat)],
        np.array(prompt_lens),
        np.array(starts) + lengths,
        (np.zeros(n), np.zeros(n), np.ones(n)),
    )
    return slot


def set_penalties(slot: IOSlot, presence: list, frequency: list, repetition: list) -> None:
    x = slot.np_in
    n = len(presence)
    x["presence_penalty"][:n] = presence
    x["frequency_penalty"][:n] = frequency
    x["repetition_penalty"][:n] = repetition


def update(state: PenaltyState, slot: IOSlot, num_tokens: int, num_seqs: int) -> None:
    state.update(slot.dev_in, slot.dev_in["input_ids"][:num_tokens])


def make_request(prompt: list[int], **params) -> Request:
    return Request("r", prompt, SamplingParams(**params), 0)


def test_penalties_match_transformers_repetition_and_openais_presence_frequency_formula():
    vocab, g = 50, torch.Generator().manual_seed(0)
    state = PenaltyState(8, vocab, 64, torch.device("cpu"))
    prompts = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (7, 4)]
    outputs = [torch.randint(0, 20, (12,), generator=g).tolist() for _ in prompts]
    requests = [make_request(p, repetition_penalty=1.7) for p in prompts]
    state.admit([3, 5], requests)
    # the prompts in one step (row 1's in two chunks), then the outputs, a few per step as a
    # resumed request re-feeds them, and one per step as decode feeds them
    update(state, slot_with_step(vocab, prompts, [7, 4], [0, 0], [3, 5]), 11, 2)
    fed = 0
    for size in (3, 1, 5, 1, 1, 1):
        chunk = [out[fed : fed + size] for out in outputs]
        starts = [len(p) + fed for p in prompts]
        slot = slot_with_step(vocab, chunk, [7, 4], starts, [3, 5])
        update(state, slot, 2 * size, 2)
        fed += size
    assert fed == len(outputs[0])

    presence, frequency, repetition = [0.6, -1.5], [0.3, 2.0], [1.7, 0.8]
    slot = slot_with_step(vocab, [[0], [0]], [7, 4], [0, 0], [3, 5])
    set_penalties(slot, presence, frequency, repetition)
    logits = torch.randn(2, vocab, generator=g) * 3
    ours = state.apply(logits, slot.dev_in, 2)

    for i in range(2):
        everything = torch.tensor([prompts[i] + outputs[i]])
        processor = transformers.RepetitionPenaltyLogitsProcessor(repetition[i])
        expected = processor(everything, logits[i : i + 1].clone())[0]
        counts = torch.zeros(vocab)
        for token, count in Counter(outputs[i]).items():
            counts[token] = count
        # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        expected = expected - counts * frequency[i] - (counts > 0).float() * presence[i]
        torch.testing.assert_close(ours[i], expected, rtol=0, atol=1e-6)


def test_rows_without_state_read_the_scratch_row_and_keep_their_logits_bitwise():
    vocab = 40
    state = PenaltyState(8, vocab, 64, torch.device("cpu"))
    state.admit([2], [make_request([1, 2, 3], presence_penalty=1.0)])
    slot = slot_with_step(vocab, [[1, 2, 3], [4, 5, 6, 7]], [3, 4], [0, 0], [2, 8])
    update(state, slot, 7, 2)
    for _ in range(3):  # the scratch row fills up with whatever rows without state feed it
        slot = slot_with_step(vocab, [[9], [9]], [3, 4], [3, 4], [2, 8])
        update(state, slot, 2, 2)
    set_penalties(slot, [1.0, 0.0], [0.0, 0.0], [1.0, 1.0])
    logits = torch.randn(2, vocab)
    logits[1, 3] = float("-inf")
    ours = state.apply(logits, slot.dev_in, 2)
    assert torch.equal(ours[1], logits[1])
    assert ours[0, 9] == logits[0, 9] - 1.0 and torch.equal(ours[0, :9], logits[0, :9])


def test_logit_bias_and_allowed_token_ids_by_construction():
    vocab = 30
    state = PenaltyState(8, vocab, 64, torch.device("cpu"))
    requests = [
        make_request([1], logit_bias={4: 2.5, 7: -100.0, 29: 0.25}),
        make_request([1], allowed_token_ids=[3, 11, 12], logit_bias={11: 1.0}),
    ]
    state.admit([0, 1], requests)
    slot = slot_with_step(vocab, [[1], [1]], [1, 1], [0, 0], [0, 1])
    update(state, slot, 2, 2)
    set_penalties(slot, [0.0, 0.0], [0.0, 0.0], [1.0, 1.0])
    logits = torch.randn(2, vocab)
    ours = state.apply(logits, slot.dev_in, 2)

    expected = logits.clone()
    expected[0, [4, 7, 29]] += torch.tensor([2.5, -100.0, 0.25])
    expected[1] = float("-inf")
    expected[1, [3, 11, 12]] = logits[1, [3, 11, 12]] + torch.tensor([0.0, 1.0, 0.0])
    assert torch.equal(ours, expected)


def test_a_row_taken_again_starts_from_a_clean_state():
    vocab = 30
    state = PenaltyState(8, vocab, 64, torch.device("cpu"))
    state.admit([4], [make_request([5, 6], allowed_token_ids=[1], bad_words=[])])
    slot = slot_with_step(vocab, [[5, 6, 7, 7]], [2], [0], [4])
    update(state, slot, 4, 1)
    state.admit([4], [make_request([8], frequency_penalty=1.0)])
    slot = slot_with_step(vocab, [[8, 9]], [1], [0], [4])
    update(state, slot, 2, 1)
    set_penalties(slot, [0.0], [1.0], [1.0])
    logits = torch.zeros(1, vocab)
    expected = torch.zeros(1, vocab)
    expected[0, 9] = -1.0  # only this request's one output; no ban, no count of 7
    assert torch.equal(state.apply(logits, slot.dev_in, 1), expected)


def test_a_bad_word_of_several_tokens_is_banned_only_right_after_its_prefix_in_the_outputs():
    vocab = 30
    state = PenaltyState(8, vocab, 64, torch.device("cpu"))
    request = make_request([5, 6])
    request.bad_words_token_ids = [[5, 6, 7], [9]]  # the prompt ends in 5, 6: outputs only count
    state.admit([1], [request])
    slot = slot_with_step(vocab, [[5, 6]], [2], [0], [1])
    update(state, slot, 2, 1)
    set_penalties(slot, [0.0], [0.0], [1.0])
    banned = []
    for output in (5, 6, 1, 5, 6):
        slot = slot_with_step(vocab, [[output]], [2], [2 + len(banned)], [1])
        set_penalties(slot, [0.0], [0.0], [1.0])
        update(state, slot, 1, 1)
        logits = state.apply(torch.zeros(1, vocab), slot.dev_in, 1)[0]
        assert logits[9] == float("-inf")
        banned.append(bool(logits[7] == float("-inf")))
    assert banned == [False, True, False, False, True]


def test_bad_words_are_tokenized_alone_and_after_a_space(make_tiny):
    tokenizer = Tokenizer.from_dir(make_tiny("llama"))
    sequences = bad_word_token_ids(tokenizer, ["hello world", " the"])
    alone = tokenizer.encode("hello world", add_special_tokens=False)
    spaced = tokenizer.encode(" hello world", add_special_tokens=False)
    assert sequences[0] == alone
    assert (spaced in sequences) == (spaced[0] != alone[0] and len(spaced) == len(alone))
    assert tokenizer.encode("the", add_special_tokens=False) in sequences


def test_state_memory_at_256_rows_and_a_152k_vocabulary_is_as_documented():
    meta = torch.device("meta")
    state = PenaltyState(256, 151_936, 8192, meta)
    tensors = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert allocated == state_bytes(256, 151_936, 8192) == 121_369_912  # docs/ARCHITECTURE.md
    assert state.counts.dtype == torch.int16 and state.flags.dtype == torch.uint8


# ---- end to end against transformers --------------------------------------------------------


class ReferenceProcessors(transformers.LogitsProcessor):
    """What penalties.py does, written directly over transformers' logits and input ids."""

    def __init__(self, params: SamplingParams, prompt_len: int, bad_words: list[list[int]]):
        self.params, self.prompt_len, self.bad_words = params, prompt_len, bad_words
        self.bans = 0  # bad words of several tokens that banned something

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        p, scores = self.params, scores.clone()
        outputs = input_ids[0, self.prompt_len :].tolist()
        if p.allowed_token_ids is not None:
            kept = scores[0, p.allowed_token_ids]
            scores[0] = float("-inf")
            scores[0, p.allowed_token_ids] = kept
        for word in self.bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(outputs) and outputs[len(outputs) - len(prefix) :] == prefix:
                scores[0, word[-1]] = float("-inf")
                self.bans += len(prefix) > 0
        for token, bias in (p.logit_bias or {}).items():
            scores[0, token] += bias
        scores = transformers.RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(
            input_ids, scores
        )
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.long), minlength=scores.shape[1])
        return scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def penalized_params(vocab: int, bad_word: str) -> list[SamplingParams]:
    g = torch.Generator().manual_seed(4)
    allowed = torch.randperm(vocab, generator=g)[:40].tolist()
    greedy = dict(temperature=0, max_tokens=NUM_STEPS, ignore_eos=True)
    return [
        SamplingParams(**greedy),
        SamplingParams(**greedy, repetition_penalty=1.6),
        SamplingParams(**greedy, presence_penalty=1.5, frequency_penalty=0.7),
        SamplingParams(**greedy, frequency_penalty=-0.4, repetition_penalty=0.7),
        SamplingParams(**greedy, logit_bias={allowed[0]: 4.0, allowed[1]: -100.0}),
        SamplingParams(**greedy, allowed_token_ids=allowed[:7]),
        SamplingParams(**greedy, bad_words=[bad_word], repetition_penalty=1.1),
        SamplingParams(
            **greedy,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            repetition_penalty=1.3,
            logit_bias={allowed[2]: 3.0},
            allowed_token_ids=allowed,
        ),
    ]


@functools.cache
def reference(folder: str) -> tuple[list, list[tuple[list[int], torch.Tensor, int, bool]]]:
    """The params, and per request transformers' greedy (tokens, processed scores, bad-word bans,
    whether the processors changed a token)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    tokenizer = Tokenizer.from_dir(folder)
    vocab = model.config.vocab_size

    def generate(ids: list[int], processors: ReferenceProcessors | None):
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NUM_STEPS,
            do_sample=False,
            logits_processor=transformers.LogitsProcessorList([processors] if processors else []),
            output_scores=True,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=vocab - 1,
        )
        tokens = out.sequences[0, len(ids) :].tolist()
        changed = tokens != torch.cat(out.logits).argmax(dim=-1).tolist()
        return tokens, torch.cat(out.scores), changed

    # the bad word: two outputs that the run without it produces and that read back as them
    without = penalized_params(vocab, "unused")[6]
    without.bad_words = []
    ids = prompts(vocab)[6]
    tokens, _, _ = generate(ids, ReferenceProcessors(without, len(ids), []))
    pairs = [
        tokenizer.decode(tokens[i : i + 2], skip_special_tokens=True)
        for i in range(len(tokens) - 1)
    ]
    found = (
        p for i, p in enumerate(pairs) if tokens[i : i + 2] in bad_word_token_ids(tokenizer, [p])
    )
    bad_word = next(found)
    params = penalized_params(vocab, bad_word)
    results = []
    for ids, p in zip(prompts(vocab), params, strict=True):
        processors = ReferenceProcessors(p, len(ids), bad_word_token_ids(tokenizer, p.bad_words))
        tokens, scores, changed = generate(ids, processors)
        results.append((tokens, scores, processors.bans, changed))
    return params, results


def assert_same_greedy(ours: list[int], theirs: list[int], scores: torch.Tensor) -> None:
    """Equal tokens, except that the sequences may part where the processed top-2 tie."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            top2 = scores[i].topk(2).values
            assert top2[0] - top2[1] < TIE, f"token {i}: ours {a}, reference {b} ({top2.tolist()})"
            return


def run_pieces_eagerly(monkeypatch) -> None:
    monkeypatch.setattr(Engine, "_use_piecewise", lambda self: True)


@pytest.mark.parametrize(
    ("async_batching", "pieces"), [(False, False), (True, True)], ids=["sync-whole", "async-pieces"]
)
def test_greedy_with_every_processor_matches_a_reference_loop_over_transformers_logits(
    make_tiny, monkeypatch, async_batching, pieces
):
    if pieces:
        run_pieces_eagerly(monkeypatch)
    folder = str(make_tiny("llama"))
    params, expected = reference(folder)
    llm = LLM(
        folder,
        max_model_len=80,
        block_size=8,
        num_blocks=16,  # 128 slots for 8 requests of up to 63 tokens: forces preemption
        max_num_batched_tokens=16,  # chunked prefill
        async_batching=async_batching,
    )
    vocab = llm.engine.model_config.vocab_size
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False
    )

    assert llm.engine.scheduler.num_preemptions > 0
    assert expected[6][2] > 0, "the bad word never banned anything: the test would not bite"
    assert all(changed for _, _, _, changed in expected[1:]), "a processor changed no token"
    for out, (tokens, scores, _, _) in zip(outputs, expected, strict=True):
        assert_same_greedy(out.outputs[0].token_ids, tokens, scores)


def sampled_tokens(folder: str, async_batching: bool, num_blocks: int) -> list[list[int]]:
    llm = LLM(
        folder,
        max_model_len=80,
        block_size=8,
        num_blocks=num_blocks,
        max_num_batched_tokens=16,
        async_batching=async_batching,
    )
    vocab = llm.engine.model_config.vocab_size
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=0.9 if i % 3 == 0 else 1.0,  # some steps filter too
            seed=i,
            max_tokens=NUM_STEPS,
            ignore_eos=True,
            presence_penalty=0.5 * (i % 2),
            frequency_penalty=0.5,
            repetition_penalty=1.1 if i != 2 else 1.0,
        )
        for i in range(len(PROMPT_LENGTHS))
    ]
    params[4] = SamplingParams(temperature=1.0, seed=4, max_tokens=NUM_STEPS, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outputs]


def test_seeded_sampling_with_penalties_is_the_same_sync_async_pieces_and_preempted(
    make_tiny, monkeypatch
):
    folder = str(make_tiny("llama"))
    roomy = sampled_tokens(folder, async_batching=False, num_blocks=80)
    assert sampled_tokens(folder, async_batching=True, num_blocks=16) == roomy
    run_pieces_eagerly(monkeypatch)
    assert sampled_tokens(folder, async_batching=True, num_blocks=16) == roomy


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {3: float("nan")}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"3": 1.0}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [1, -2]),
        ("bad_words", [""]),
        ("bad_words", [" "]),
    ],
)
def test_out_of_range_processor_fields_are_value_errors_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_a_logit_bias_past_100_is_clamped_as_vllms_server_clamps_it():
    """vLLM's offline params take any bias; a ban written -1e9 or -inf stays one (-100)."""
    params = SamplingParams(logit_bias={3: -1e9, 4: float("-inf"), 5: 250, 6: 7.5})
    assert params.logit_bias == {3: -100.0, 4: -100.0, 5: 100.0, 6: 7.5}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logit_bias", {10**6: 1.0}),
        ("allowed_token_ids", [0, 10**6]),
        ("logit_bias", {i: 1.0 for i in range(1025)}),
    ],
)
def test_token_ids_the_model_lacks_are_value_errors_naming_the_field(make_tiny, field, value):
    llm = LLM(str(make_tiny("llama")), max_model_len=64, num_blocks=16)
    with pytest.raises(ValueError, match=field):
        llm.engine.make_request("r", SamplingParams(**{field: value}), prompt_token_ids=[1, 2])
    out = llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("count_dtype", [torch.int16, torch.int32])
def test_the_fused_kernel_equals_the_torch_ops_it_replaces(count_dtype):
    from tandem.penalties_kernel import apply_penalties

    g = torch.Generator().manual_seed(5)
    seqs, rows, vocab = 5, 9, 3000  # two blocks per row, the second partial
    logits = torch.randn(seqs, vocab, generator=g) * 4
    logits[0, :7] = float("-inf")
    counts = torch.randint(0, 3, (rows, vocab), generator=g).to(count_dtype)
    flags = torch.randint(0, 4, (rows, vocab), generator=g).to(torch.uint8)
    state_rows = torch.tensor([8, 0, 3, 3, 6], dtype=torch.int32)
    presence = torch.tensor([0.0, 0.5, -1.5, 2.0, 0.25])
    frequency = torch.tensor([0.0, 0.5, 1.0, -2.0, 0.0])
    repetition = torch.tensor([1.0, 1.1, 0.6, 1.9, 3.0])
    index = state_rows.long()
    expected = apply_dense(logits, counts[index], flags[index], presence, frequency, repetition)
    fused = logits.clone()
    apply_penalties(fused, counts, flags, state_rows, presence, frequency, repetition)
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(fused.isinf(), expected.isinf())


def test_bad_words_tokenized_past_the_models_vocabulary_are_a_value_error():
    """A tokenizer may know more ids than the model has logits (added special tokens): such a
    bad word is refused when the request is made, not met by the step's scatter."""
    params = SamplingParams(bad_words=["<|extra|>"])
    with pytest.raises(ValueError, match="704"):
        check_request(params, [[705]], vocab_size=704)
    check_request(params, [[703], [5, 703]], vocab_size=704)
