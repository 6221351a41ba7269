"""When a request stops: stop strings, EOS and stop tokens, min/max tokens and max_model_len, in both step modes.

Every stop criterion is picked from a greedy run's observed output, so each test knows exactly
where generation must end and cannot pass by never meeting its criterion.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.tokenizer import Tokenizer

PROMPT = "Our scheduler reads"
PROMPT_WITH_EOS = "The quick brown fox"  # the tiny llama's greedy output emits an EOS id
MAX_TOKENS = 32
MAX_MODEL_LEN = 128

modes = pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])


@dataclass
class Greedy:
    """A greedy run with EOS ignored: the tokens every stop test cuts short."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    tokenizer: Tokenizer

    def text(self, num_tokens: int) -> str:
        return self.tokenizer.decode(self.token_ids[:num_tokens], skip_special_tokens=True)

    def piece(self, index: int) -> str:
        return self.tokenizer.decode([self.token_ids[index]], skip_special_tokens=True)

    def first_index(self, token_id: int) -> int:
        return self.token_ids.index(token_id)


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def make_llm(folder: str | Path, async_batching: bool, **engine_args) -> LLM:
    return LLM(
        str(folder), async_batching=async_batching, max_model_len=MAX_MODEL_LEN, **engine_args
    )


def greedy(**overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": MAX_TOKENS, **overrides})


@pytest.fixture(scope="module")
def reference(folder) -> dict[str, Greedy]:
    llm = make_llm(folder, async_batching=False)
    outputs = llm.generate([PROMPT, PROMPT_WITH_EOS], greedy(ignore_eos=True), use_tqdm=False)
    return {
        out.prompt: Greedy(out.prompt_token_ids, out.outputs[0].token_ids, llm.get_tokenizer())
        for out in outputs
    }


def generate_one(llm: LLM, prompt: str, params: SamplingParams):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def eos_token_ids(folder: str | Path) -> list[int]:
    return json.loads((Path(folder) / "generation_config.json").read_text())["eos_token_id"]


def first_new_token(ref: Greedy, start: int) -> int:
    """Index of the first token at or after `start` that did not appear earlier in the output."""
    return next(
        i for i in range(start, len(ref.token_ids)) if ref.first_index(ref.token_ids[i]) == i
    )


def word_token(ref: Greedy) -> int:
    """Index of the first token whose text is a word of at least four ASCII letters."""
    return next(
        i
        for i in range(len(ref.token_ids))
        if (word := ref.piece(i).strip()).isascii() and word.isalpha() and len(word) >= 4
    )


def cut_at(ref: Greedy, stops: list[str]) -> tuple[int, str]:
    """(tokens up to the one whose text completes a stop string, the text before that string):
    of the strings that token completes, the first given wins, as in vLLM's check_stop_strings."""
    for num_tokens in range(1, len(ref.token_ids) + 1):
        text = ref.text(num_tokens)
        hits = [stop for stop in stops if stop in text]
        if hits:
            return num_tokens, text[: text.find(hits[0])]
    raise AssertionError(f"no stop string of {stops} in the greedy output")


# ---- stop strings -------------------------------------------------------------------------


@pytest.fixture
def stop_inside_a_token(reference) -> tuple[str, int]:
    """A stop string strictly inside one token's text, and that token's index."""
    ref = reference[PROMPT]
    k = word_token(ref)
    stop = ref.piece(k).strip()[1:-1]
    assert stop not in ref.text(k) and stop in ref.piece(k)
    return stop, k


@pytest.fixture
def stop_across_two_tokens(reference) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next's."""
    ref = reference[PROMPT]
    k = next(
        i
        for i in range(1, len(ref.token_ids))
        if (ref.piece(i - 1) + ref.piece(i)).isascii()
        and ref.piece(i - 1)[-1:].isalnum()
        and ref.piece(i)[:1].isalnum()
        and (ref.piece(i - 1)[-1] + ref.piece(i)[:2]) not in ref.text(i)
    )
    return ref.piece(k - 1)[-1] + ref.piece(k)[:2], k


@modes
def test_stop_string_inside_one_token_trims_the_text_before_it(
    folder, reference, stop_inside_a_token, async_batching
):
    stop, k = stop_inside_a_token
    ref = reference[PROMPT]
    out = generate_one(make_llm(folder, async_batching), PROMPT, greedy(stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: k + 1]
    assert out.text == ref.text(k + 1).split(stop)[0]
    assert out.text.endswith(ref.piece(k).strip()[0])  # the token's text up to the stop string


@modes
def test_stop_string_spanning_two_tokens_ends_at_the_second(
    folder, reference, stop_across_two_tokens, async_batching
):
    stop, k = stop_across_two_tokens
    ref = reference[PROMPT]
    out = generate_one(make_llm(folder, async_batching), PROMPT, greedy(stop=[stop]))
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: k + 1]
    assert out.text == ref.text(k + 1).split(stop)[0]


@modes
def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after_it(
    folder, reference, stop_inside_a_token, async_batching
):
    stop, k = stop_inside_a_token
    ref = reference[PROMPT]
    params = greedy(stop=[stop], include_stop_str_in_output=True)
    out = generate_one(make_llm(folder, async_batching), PROMPT, params)
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: k + 1]
    assert out.text == ref.text(k + 1).split(stop)[0] + stop
    assert not ref.text(k + 1).endswith(stop)  # the token's text went on past the stop string


@modes
def test_of_several_stop_strings_the_first_completed_wins_and_in_one_token_the_first_given(
    folder, reference, stop_inside_a_token, stop_across_two_tokens, async_batching
):
    ref = reference[PROMPT]
    (inside, k_inside), (across, k_across) = stop_inside_a_token, stop_across_two_tokens
    word = ref.piece(k_inside).strip()
    llm = make_llm(folder, async_batching)
    cases = [
        [inside, across],  # in different tokens
        [word[2:], word[:3]],  # in the same token: the first given, though the other starts first
    ]
    for stops in cases:
        num_tokens, text = cut_at(ref, stops)
        out = generate_one(llm, PROMPT, greedy(stop=stops))
        assert (out.token_ids, out.text, out.finish_reason) == (
            ref.token_ids[:num_tokens],
            text,
            "stop",
        ), stops
    assert cut_at(ref, cases[0])[0] == min(k_inside, k_across) + 1
    assert cut_at(ref, cases[1]) == (k_inside + 1, ref.text(k_inside + 1).split(word[2:])[0])


@modes
def test_of_stop_strings_that_start_at_one_place_the_first_given_wins(
    folder, reference, stop_inside_a_token, async_batching
):
    """As vLLM, which takes the first of the list that matches."""
    ref = reference[PROMPT]
    inside, k = stop_inside_a_token
    longer = inside + ref.piece(k).strip()[-1]  # one more letter: both start at one place
    llm = make_llm(folder, async_batching)
    before = ref.text(k + 1).split(inside)[0]
    for stops in ([longer, inside], [inside, longer]):
        out = generate_one(llm, PROMPT, greedy(stop=stops, include_stop_str_in_output=True))
        assert (out.text, out.stop_reason) == (before + stops[0], stops[0]), stops


# ---- EOS and stop tokens ------------------------------------------------------------------


@modes
def test_eos_ends_the_request_and_stays_in_token_ids_but_not_in_the_text(
    folder, reference, async_batching
):
    ref = reference[PROMPT_WITH_EOS]
    k = next(i for i, t in enumerate(ref.token_ids) if t in eos_token_ids(folder))
    out = generate_one(make_llm(folder, async_batching), PROMPT_WITH_EOS, greedy())
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: k + 1]
    assert out.text == ref.text(k)
    assert ref.tokenizer.decode(ref.token_ids[k : k + 1], skip_special_tokens=False) != ""


@modes
def test_ignore_eos_runs_past_eos_to_max_tokens(folder, reference, async_batching):
    ref = reference[PROMPT_WITH_EOS]
    assert set(ref.token_ids) & set(eos_token_ids(folder))
    out = generate_one(make_llm(folder, async_batching), PROMPT_WITH_EOS, greedy(ignore_eos=True))
    assert out.finish_reason == "length"
    assert out.token_ids == ref.token_ids


@pytest.mark.parametrize("as_list", [True, False], ids=["list", "int"])
@modes
def test_generation_config_eos_token_id_ends_the_request(
    folder, reference, tmp_path, as_list, async_batching
):
    ref = reference[PROMPT]
    k = first_new_token(ref, start=3)
    eos = ref.token_ids[k]
    variant = Path(shutil.copytree(folder, tmp_path / "model"))
    config = json.loads((variant / "generation_config.json").read_text())
    config["eos_token_id"] = [eos] if as_list else eos
    (variant / "generation_config.json").write_text(json.dumps(config))

    llm = make_llm(variant, async_batching)
    out = generate_one(llm, PROMPT, greedy())
    assert out.finish_reason == "stop"
    assert out.token_ids == ref.token_ids[: k + 1]
    assert generate_one(llm, PROMPT, greedy(ignore_eos=True)).token_ids == ref.token_ids


@pytest.mark.parametrize(
    ("file", "eos"),
    [
        ("generation_config.json", "x"),  # min_tokens' ban failed on int("x")
        ("generation_config.json", [2, -1]),  # ... and indexed the logits at -1
        ("config.json", 10**6),  # past the vocabulary
    ],
)
def test_an_eos_token_id_that_is_no_token_id_is_a_value_error_naming_the_file(
    folder, tmp_path, file, eos
):
    variant = Path(shutil.copytree(folder, tmp_path / "model"))
    config = json.loads((variant / file).read_text())
    config["eos_token_id"] = eos
    if file == "config.json":  # read only where the generation config names none
        (variant / "generation_config.json").unlink()
    (variant / file).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"{re.escape(file)}'s eos_token_id must be token ids"):
        make_llm(variant, True)


@modes
def test_stop_token_ids_end_the_request_even_with_ignore_eos(folder, reference, async_batching):
    ref = reference[PROMPT]
    k = first_new_token(ref, start=3)
    llm = make_llm(folder, async_batching)
    for ignore_eos in (False, True):
        params = greedy(stop_token_ids=[ref.token_ids[k]], ignore_eos=ignore_eos)
        out = generate_one(llm, PROMPT, params)
        assert out.finish_reason == "stop"
        assert out.token_ids == ref.token_ids[: k + 1]


@modes
def test_a_stop_tokens_text_is_left_out_with_or_without_stop_strings(
    folder, reference, async_batching
):
    ref = reference[PROMPT]
    k = word_token(ref)  # a stop token whose text is a plain word, so leaving it out shows
    assert ref.token_ids.index(ref.token_ids[k]) == k
    llm = make_llm(folder, async_batching)
    texts = []
    for stop in ([], ["a stop string that never appears"]):
        params = greedy(stop_token_ids=[ref.token_ids[k]], stop=stop)
        out = generate_one(llm, PROMPT, params)
        assert out.token_ids == ref.token_ids[: k + 1]
        texts.append(out.text)
    assert texts == [ref.text(k)] * 2


@modes
def test_include_stop_str_in_output_keeps_a_stop_tokens_text_as_vllm_does(
    folder, reference, async_batching
):
    ref = reference[PROMPT]
    k = word_token(ref)
    params = greedy(stop_token_ids=[ref.token_ids[k]], include_stop_str_in_output=True)
    out = generate_one(make_llm(folder, async_batching), PROMPT, params)
    assert out.token_ids == ref.token_ids[: k + 1] and out.finish_reason == "stop"
    assert out.text == ref.text(k + 1)


@modes
def test_stop_reason_names_the_stop_string_or_stop_token_and_none_for_the_eos_or_length(
    folder, reference, stop_inside_a_token, async_batching
):
    ref = reference[PROMPT]
    llm = make_llm(folder, async_batching)
    stop, _ = stop_inside_a_token
    assert generate_one(llm, PROMPT, greedy(stop=[stop])).stop_reason == stop
    token = ref.token_ids[first_new_token(ref, start=3)]
    assert generate_one(llm, PROMPT, greedy(stop_token_ids=[token])).stop_reason == token
    assert generate_one(llm, PROMPT, greedy(max_tokens=3)).stop_reason is None
    # vLLM's: None for the tokenizer's EOS, the id for generation_config's others
    primary = llm.get_tokenizer().eos_token_id
    by_eos = generate_one(llm, PROMPT_WITH_EOS, greedy())
    other = by_eos.token_ids[-1]
    assert other in eos_token_ids(folder) and other != primary  # the tiny llama's second EOS
    assert by_eos.finish_reason == "stop" and by_eos.stop_reason == other
    by_primary = generate_one(llm, PROMPT, greedy(allowed_token_ids=[primary]))
    assert by_primary.token_ids == [primary] and by_primary.stop_reason is None
    listed = generate_one(
        llm, PROMPT, greedy(allowed_token_ids=[primary], stop_token_ids=[primary])
    )
    assert listed.stop_reason is None  # EOS is checked first, as vLLM's check_stop
    ignored = greedy(allowed_token_ids=[primary], stop_token_ids=[primary], ignore_eos=True)
    assert generate_one(llm, PROMPT, ignored).stop_reason == primary


# ---- min_tokens, max_tokens and max_model_len ---------------------------------------------


@modes
def test_min_tokens_bans_a_stop_token_that_would_fire_earlier(folder, reference, async_batching):
    ref = reference[PROMPT]
    k = first_new_token(ref, start=2)
    stop_token, min_tokens = ref.token_ids[k], k + 4
    params = greedy(stop_token_ids=[stop_token], min_tokens=min_tokens)
    out = generate_one(make_llm(folder, async_batching), PROMPT, params)
    assert len(out.token_ids) >= min_tokens
    assert out.token_ids[:k] == ref.token_ids[:k]
    assert stop_token not in out.token_ids[:min_tokens]  # banned, not merely ignored
    assert out.finish_reason == "length" or out.token_ids[-1] == stop_token


def test_only_steps_with_a_banning_row_take_the_general_sampler(folder, reference, monkeypatch):
    """Bans are applied in the general sampler's steps (and graphs) alone: a step whose rows ban
    nothing takes the plain one, so it runs no ban."""
    ref = reference[PROMPT]
    stop_token = ref.token_ids[first_new_token(ref, start=2)]
    llm = make_llm(folder, async_batching=True)
    built = []
    build = llm.engine.builder.build

    def recording(plan, *args):
        batch = build(plan, *args)
        built.append((len(batch.requests), batch.use_filters))
        return batch

    monkeypatch.setattr(llm.engine.builder, "build", recording)
    params = [greedy(stop_token_ids=[stop_token], min_tokens=4, max_tokens=8), greedy(max_tokens=8)]
    llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    # both requests run together for 4 steps (outputs 0-3 are under min_tokens), then one
    # banning nothing, then the other alone
    assert [use for rows, use in built if rows == 2][:4] == [True] * 4
    assert not any(use for _, use in built[4:])


@modes
def test_min_tokens_bans_eos_under_ignore_eos_too(folder, reference, async_batching):
    """As vLLM: EOS is banned until min_tokens whether or not it would end the request."""
    eos = eos_token_ids(folder)[0]
    params = greedy(allowed_token_ids=[eos, 9], logit_bias={eos: 100.0}, ignore_eos=True,
                    min_tokens=4, max_tokens=6)  # fmt: skip
    out = generate_one(make_llm(folder, async_batching), PROMPT, params)
    assert out.token_ids == [9] * 4 + [eos] * 2


@modes
def test_min_tokens_bans_eos_that_would_fire_earlier(folder, reference, async_batching):
    ref = reference[PROMPT_WITH_EOS]
    eos = eos_token_ids(folder)
    k = next(i for i, t in enumerate(ref.token_ids) if t in eos)
    min_tokens = k + 3
    out = generate_one(
        make_llm(folder, async_batching), PROMPT_WITH_EOS, greedy(min_tokens=min_tokens)
    )
    assert len(out.token_ids) >= min_tokens
    assert out.token_ids[:k] == ref.token_ids[:k]
    assert not set(out.token_ids[:min_tokens]) & set(eos)
    assert out.finish_reason == "length" or out.token_ids[-1] in eos


@modes
def test_min_tokens_defers_a_stop_string_that_would_match_earlier(
    folder, reference, stop_inside_a_token, async_batching
):
    ref = reference[PROMPT]
    stop, k = stop_inside_a_token
    min_tokens = k + 4
    out = generate_one(
        make_llm(folder, async_batching), PROMPT, greedy(stop=[stop], min_tokens=min_tokens)
    )
    assert len(out.token_ids) >= min_tokens
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]


@modes
def test_a_stop_string_wholly_in_the_first_min_tokens_tokens_stops_nothing(
    folder, reference, stop_inside_a_token, async_batching
):
    """As vLLM: text of the first min_tokens tokens is not searched, also not by a longer stop
    string's window reaching back into it."""
    ref = reference[PROMPT]
    stop, k = stop_inside_a_token
    # as many tokens as keep the stop string in token k's text alone: at least one more
    n = max(n for n in range(k + 1, k + 8) if ref.text(n).count(stop) == 1)
    assert n > k + 1
    params = greedy(stop=[stop, "z" * 40], min_tokens=k + 1, max_tokens=n)
    out = generate_one(make_llm(folder, async_batching), PROMPT, params)
    assert out.token_ids == ref.token_ids[:n] and out.finish_reason == "length"
    assert out.text == ref.text(n)


def test_text_held_back_until_the_end_is_searched_for_stop_strings(folder):
    """A token that ends inside a character holds its text back until the request ends: the
    stop string in front of it is found then, and the text cut there."""
    llm = make_llm(folder, async_batching=False)
    tokenizer = llm.get_tokenizer()
    partial = next(  # a token whose text is a letter, then the first byte of a character
        t for t in tokenizer.encode("naïve façade", add_special_tokens=False)
        if tokenizer.decode([t]).endswith("\ufffd") and tokenizer.decode([t])[0].isalpha()
    )  # fmt: skip
    letter = tokenizer.decode([partial])[0]
    params = greedy(max_tokens=2, allowed_token_ids=[partial], stop=[letter])
    out = generate_one(llm, PROMPT, params)
    assert out.token_ids == [partial, partial]
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", letter)


@pytest.mark.parametrize("max_tokens", [1, 5, MAX_TOKENS])
@modes
def test_max_tokens_ends_the_request_with_exactly_that_many_tokens(
    folder, reference, max_tokens, async_batching
):
    ref = reference[PROMPT]
    out = generate_one(make_llm(folder, async_batching), PROMPT, greedy(max_tokens=max_tokens))
    assert out.finish_reason == "length"
    assert out.token_ids == ref.token_ids[:max_tokens]
    assert out.text == ref.text(max_tokens)


@modes
def test_max_model_len_ends_the_request_with_prompt_and_output_filling_it(
    folder, reference, async_batching
):
    ref = reference[PROMPT]
    max_model_len = len(ref.prompt_token_ids) + 12
    llm = LLM(folder, async_batching=async_batching, max_model_len=max_model_len)
    out = generate_one(llm, PROMPT, greedy(max_tokens=MAX_TOKENS))
    assert out.finish_reason == "length"
    assert len(ref.prompt_token_ids) + len(out.token_ids) == max_model_len
    assert out.token_ids == ref.token_ids[:12]


# ---- both modes together, and n -----------------------------------------------------------


def test_async_and_sync_agree_on_every_stop_condition_in_one_batch(
    folder, reference, stop_inside_a_token, stop_across_two_tokens
):
    ref = reference[PROMPT]
    k = first_new_token(ref, start=3)
    cases = [
        (PROMPT, greedy(stop=[stop_inside_a_token[0]])),
        (PROMPT, greedy(stop=[stop_across_two_tokens[0]], include_stop_str_in_output=True)),
        (PROMPT_WITH_EOS, greedy()),
        (PROMPT_WITH_EOS, greedy(min_tokens=28)),
        (PROMPT, greedy(stop_token_ids=[ref.token_ids[k]])),
        (PROMPT, greedy(stop_token_ids=[ref.token_ids[k]], min_tokens=k + 3)),
        (PROMPT, greedy(max_tokens=1)),
        (PROMPT, greedy(max_tokens=7, ignore_eos=True)),
        (PROMPT, SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS, stop=["e"])),
    ]
    prompts, params = zip(*cases, strict=True)
    results = {}
    for async_batching in (False, True):
        outputs = make_llm(folder, async_batching).generate(
            list(prompts), list(params), use_tqdm=False
        )
        results[async_batching] = [
            (c.token_ids, c.text, c.finish_reason) for out in outputs for c in out.outputs
        ]
    assert results[True] == results[False]
    assert {reason for _, _, reason in results[False]} == {"stop", "length"}


@modes
def test_n_returns_n_completions(folder, reference, async_batching):
    ref = reference[PROMPT]
    llm = make_llm(folder, async_batching)
    [greedy_out] = llm.generate([PROMPT], [greedy(max_tokens=8)], use_tqdm=False)
    [sampled_out] = llm.generate(
        [PROMPT], [SamplingParams(n=4, seed=1, max_tokens=8, ignore_eos=True)], use_tqdm=False
    )
    assert greedy_out.outputs[0].token_ids == ref.token_ids[:8]
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        greedy(n=3, max_tokens=8)  # n identical answers: vLLM's check
    assert [c.index for c in sampled_out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 8 for c in sampled_out.outputs)
    assert len({tuple(c.token_ids) for c in sampled_out.outputs}) == 4


def test_the_text_reads_as_after_the_prompt_with_or_without_stop_strings(folder, tmp_path):
    """A tokenizer whose decoder strips a decode's first space (Llama 2's, Mistral's): the
    output's text is what it adds to the prompt's, its leading space kept, whether or not a
    stop string makes the engine detokenize as it goes (as vLLM, which always does)."""
    stripping = tmp_path / "stripping"
    shutil.copytree(folder, stripping)
    spec = json.loads((stripping / "tokenizer.json").read_text())
    spec["decoder"] = {"type": "Sequence", "decoders": [
        spec["decoder"], {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}  # fmt: skip
    (stripping / "tokenizer.json").write_text(json.dumps(spec))
    llm = make_llm(stripping, async_batching=True)
    tokenizer = llm.get_tokenizer()
    [the] = tokenizer.encode(" the", add_special_tokens=False)
    prompt_ids = tokenizer.encode(PROMPT)
    whole = tokenizer.decode([*prompt_ids, the, the], skip_special_tokens=True)
    added = whole[len(tokenizer.decode(prompt_ids, skip_special_tokens=True)) :]
    assert added == " the the" and tokenizer.decode([the, the]) == "the the"  # the strip shows
    for stop in ([], ["never said"]):
        params = greedy(max_tokens=2, allowed_token_ids=[the], stop=stop)
        assert generate_one(llm, PROMPT, params).text == added
    # a prompt ending in a literal U+FFFD: the context stops before it, the space still kept
    odd = PROMPT + " \ufffd"
    odd_ids = tokenizer.encode(odd)
    whole = tokenizer.decode([*odd_ids, the, the], skip_special_tokens=True)
    added = whole[len(tokenizer.decode(odd_ids, skip_special_tokens=True)) :]
    assert added == " the the"
    for stop in ([], ["never said"]):
        params = greedy(max_tokens=2, allowed_token_ids=[the], stop=stop)
        assert generate_one(llm, odd, params).text == added
