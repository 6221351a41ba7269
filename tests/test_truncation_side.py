"""vLLM's `truncation_side` with `truncate_prompt_tokens`: "left" keeps a prompt's last k
tokens, "right" its first k; left out, a generation keeps its last and a pooled input its
first (vLLM's tokenizer's side for each kind of model). Each cut is checked by what the model
read: the kept ids sent on their own give the same tokens, vector or score."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.server.app import build_app
from test_bad_input import transformers_greedy
from test_pooling import classifiers, normalized, reference  # noqa: F401 (a fixture)
from test_prompt_embeds import encoded, random_embeds, transformers_greedy_of_embeds
from test_scoring import hf_logit, hf_pair, sigmoid

MAX_LEN = 128
PROMPT = "Our scheduler reads the queue, admits requests and frees their blocks"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
QUERY, DOCUMENT = "Where is the cache?", "The KV cache is paged into blocks of sixteen tokens."
GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def folder(make_tiny) -> Path:
    return make_tiny("llama")


@pytest.fixture(scope="module")
def client(folder):
    llm = AsyncLLM.from_model(str(folder), max_model_len=MAX_LEN, block_size=8)
    with TestClient(build_app(llm, "tiny")) as client:
        yield client
    llm.shutdown()


def hf_ids(folder: Path, text: str) -> list[int]:
    return AutoTokenizer.from_pretrained(folder)(text)["input_ids"]


def completion(client: TestClient, **fields) -> dict:
    answer = client.post("/v1/completions", json={**GREEDY, **fields})
    assert answer.status_code == 200, answer.text
    return answer.json()


def embedding(client: TestClient, path: str, **fields) -> dict:
    answer = client.post(path, json=fields)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_completion_reads_its_first_k_tokens_on_the_right_and_its_last_k_on_the_left(
    client, folder
):
    """A text prompt is tokenized whole, then cut. (Left out, vLLM's tokenizer cuts a text
    and keeps its BOS: token ids alone are checked then.)"""
    ids = hf_ids(folder, PROMPT)
    cuts = [("right", PROMPT, ids[:5]), ("left", PROMPT, ids[-5:])]
    cuts += [(side, ids, kept) for side, _, kept in cuts] + [(None, ids, ids[-5:])]
    for side, prompt, kept in cuts:
        answer = completion(client, prompt=prompt, truncate_prompt_tokens=5, truncation_side=side)
        [choice] = answer["choices"]
        assert answer["usage"]["prompt_tokens"] == 5
        assert choice["prompt_token_ids"] == kept, (side, prompt)
        [direct] = completion(client, prompt=kept)["choices"]
        assert choice["token_ids"] == direct["token_ids"]
        assert choice["token_ids"] == transformers_greedy(folder, tuple(kept), 4)


def test_a_chat_reads_the_first_k_tokens_of_its_rendered_prompt_on_the_right(client, folder):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    for side, kept in (("right", ids[:6]), ("left", ids[-6:])):
        body = {**GREEDY, "messages": MESSAGES, "truncate_prompt_tokens": 6}
        answer = client.post("/v1/chat/completions", json={**body, "truncation_side": side})
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] == 6
        assert answer.json()["prompt_token_ids"] == kept
        [direct] = completion(client, prompt=kept)["choices"]
        assert answer.json()["choices"][0]["token_ids"] == direct["token_ids"]


def test_minus_one_on_the_right_keeps_the_first_tokens_that_leave_room_for_max_tokens(client):
    ids = list(range(3, 3 + 2 * MAX_LEN))
    answer = completion(client, prompt=ids, truncate_prompt_tokens=-1, truncation_side="right")
    assert answer["choices"][0]["prompt_token_ids"] == ids[: MAX_LEN - 4]


def test_every_route_takes_left_or_right_and_any_other_side_is_a_400_naming_it(client):
    """(/classify, which needs a classifier, takes them in the cross-encoder's test.)"""
    cut = {"truncate_prompt_tokens": 3}
    bodies = {
        "/v1/completions": {"prompt": PROMPT, "max_tokens": 1, **cut},
        "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 1, **cut},
        "/v1/embeddings": {"input": PROMPT, **cut},
        "/pooling": {"input": PROMPT, **cut},
        "/classify": {"input": PROMPT, **cut},
        "/score": {"text_1": QUERY, "text_2": DOCUMENT, **cut},
        "/rerank": {"query": QUERY, "documents": [DOCUMENT], **cut},
    }
    for path, body in bodies.items():
        for side in ("left", "right", None):
            answer = client.post(path, json={**body, "truncation_side": side})
            assert answer.status_code == 200 or path == "/classify", (path, side, answer.text)
        for side in ("middle", "LEFT", 1):
            answer = client.post(path, json={**body, "truncation_side": side})
            assert answer.status_code == 400, (path, side, answer.text)
            error = answer.json()["error"]
            assert error["param"] == "truncation_side" and "'left' or 'right'" in error["message"]


def test_an_embedded_input_keeps_its_first_k_tokens_unless_the_side_is_left(client, folder):
    ids = hf_ids(folder, PROMPT)
    for path in ("/v1/embeddings", "/pooling"):
        for side, kept in ((None, ids[:5]), ("right", ids[:5]), ("left", ids[-5:])):
            for given in (PROMPT, ids):
                answer = embedding(
                    client, path, input=given, truncate_prompt_tokens=5, truncation_side=side
                )
                [data] = answer["data"]
                vector = data["embedding" if path == "/v1/embeddings" else "data"]
                assert answer["usage"]["prompt_tokens"] == 5
                want = normalized(reference(str(folder), tuple(kept)))
                np.testing.assert_allclose(vector, want, rtol=1e-4, atol=1e-5)


def test_an_embedding_model_s_score_and_rerank_cut_each_text_on_the_side_asked(client, folder):
    """Each text is embedded alone (a bi-encoder): its cut ids' embeddings give the score."""
    for side in (None, "right", "left"):
        kept = []
        for text in (QUERY, DOCUMENT):
            ids = hf_ids(folder, text)
            kept.append(ids[-6:] if side == "left" else ids[:6])
        a, b = (normalized(reference(str(folder), tuple(k))) for k in kept)
        cut = {"truncate_prompt_tokens": 6, "truncation_side": side}
        score = embedding(client, "/score", text_1=QUERY, text_2=DOCUMENT, **cut)
        assert score["data"][0]["score"] == pytest.approx(float(a @ b), abs=1e-5)
        assert score["usage"]["prompt_tokens"] == 12
        rerank = embedding(client, "/rerank", query=QUERY, documents=[DOCUMENT], **cut)
        assert rerank["results"][0]["relevance_score"] == pytest.approx(float(a @ b), abs=1e-5)


def test_a_cross_encoder_cuts_the_whole_pair_on_the_side_asked(classifiers):  # noqa: F811
    """As vLLM's: with a side named, the pair is tokenized whole and its ids cut there (the
    special tokens go with the tokens cut); /classify's inputs are cut the same way."""
    folder, model = classifiers[1]
    pair = hf_pair(folder, QUERY, DOCUMENT)
    ids = hf_ids(folder, PROMPT)
    llm = AsyncLLM.from_model(folder, max_model_len=64)
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            for side, cut in (("left", slice(-9, None)), ("right", slice(9))):
                fields = {"truncate_prompt_tokens": 9, "truncation_side": side}
                score = embedding(client, "/score", text_1=QUERY, text_2=DOCUMENT, **fields)
                want = sigmoid(hf_logit(model, pair[cut]))
                assert score["data"][0]["score"] == pytest.approx(want, rel=1e-4)
                assert score["usage"]["prompt_tokens"] == 9
                [data] = embedding(client, "/classify", input=PROMPT, **fields)["data"]
                assert data["probs"][0] == pytest.approx(sigmoid(hf_logit(model, ids[cut])), 1e-4)
    finally:
        llm.shutdown()


def test_a_cross_encoder_refuses_add_special_tokens_false(classifiers):  # noqa: F811
    """Its pair template's special tokens are how it reads a pair: a ValueError, not ignored."""
    llm = LLM(classifiers[1][0], max_model_len=64)
    with pytest.raises(ValueError, match="pair template, special tokens included"):
        llm.score(QUERY, DOCUMENT, tokenization_kwargs={"add_special_tokens": False})


def test_prompt_embeds_keep_their_first_k_embeddings_on_the_right(folder):
    """/v1/completions' prompt_embeds (usage counts the kept ones) and LLM.generate's."""
    embeds = random_embeds(folder, 10, seed=3)
    cuts = (("right", embeds[:4]), ("left", embeds[-4:]))
    llm = AsyncLLM.from_model(str(folder), max_model_len=64, enable_prompt_embeds=True)
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            for side, kept in cuts:
                fields = {"truncate_prompt_tokens": 4, "truncation_side": side}
                answer = completion(client, prompt_embeds=encoded(embeds), **fields)
                assert answer["usage"]["prompt_tokens"] == 4
                want = transformers_greedy_of_embeds(folder, kept, 4)
                assert answer["choices"][0]["token_ids"] == want
    finally:
        llm.shutdown()
    offline = LLM(str(folder), max_model_len=64, enable_prompt_embeds=True)
    for side, kept in cuts:
        params = SamplingParams(
            temperature=0, max_tokens=4, truncate_prompt_tokens=4, truncation_side=side
        )
        [out] = offline.generate({"prompt_embeds": embeds}, params, use_tqdm=False)
        assert out.outputs[0].token_ids == transformers_greedy_of_embeds(folder, kept, 4)


def test_offline_pooling_keeps_the_first_k_tokens_and_sampling_params_take_a_side(folder):
    """LLM.embed's truncate_prompt_tokens keeps the first tokens, as vLLM's pooling tokenizer
    does; SamplingParams(truncation_side=...) cuts a generation's prompt on that side."""
    llm = LLM(str(folder), max_model_len=MAX_LEN, block_size=8)
    ids = list(range(10, 40))
    [cut] = llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=6, use_tqdm=False)
    assert cut.prompt_token_ids == ids[:6]
    want = normalized(reference(str(folder), tuple(ids[:6])))
    np.testing.assert_allclose(cut.outputs.embedding, want, rtol=1e-4, atol=1e-5)
    for side, kept in (("right", ids[:6]), ("left", ids[-6:]), (None, ids[-6:])):
        params = SamplingParams(
            temperature=0, max_tokens=3, truncate_prompt_tokens=6, truncation_side=side
        )
        [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        assert out.prompt_token_ids == kept
        assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(kept), 3)
    with pytest.raises(ValueError, match="truncation_side must be 'left', 'right' or None"):
        SamplingParams(truncate_prompt_tokens=6, truncation_side="middle")


def test_tokenization_kwargs_name_the_side_offline_as_vllm_s(folder):
    """vLLM's LLM and AsyncLLM take the side in tokenization_kwargs: generate, embed."""
    import asyncio

    llm = LLM(str(folder), max_model_len=MAX_LEN, block_size=8)
    ids = list(range(10, 40))
    params = SamplingParams(temperature=0, max_tokens=3)
    for side, kept in (("right", ids[:6]), ("left", ids[-6:])):
        kwargs = {"truncate_prompt_tokens": 6, "truncation_side": side}
        [out] = llm.generate(
            {"prompt_token_ids": ids}, params, use_tqdm=False, tokenization_kwargs=kwargs
        )
        assert out.prompt_token_ids == kept
        assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(kept), 3)
        [vector] = llm.embed({"prompt_token_ids": ids}, use_tqdm=False, tokenization_kwargs=kwargs)
        want = normalized(reference(str(folder), tuple(kept)))
        np.testing.assert_allclose(vector.outputs.embedding, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="truncation_side is 'left' in the SamplingParams"):
        llm.generate(
            {"prompt_token_ids": ids},
            SamplingParams(truncation_side="left"),
            tokenization_kwargs={"truncation_side": "right"},
        )
    with pytest.raises(ValueError, match="truncation_side must be 'left', 'right' or None"):
        llm.generate({"prompt_token_ids": ids}, tokenization_kwargs={"truncation_side": "up"})

    async def first_ids() -> list[int]:
        engine = AsyncLLM.from_model(str(folder), max_model_len=MAX_LEN, block_size=8)
        try:
            kwargs = {"truncate_prompt_tokens": 6, "truncation_side": "right"}
            stream = engine.generate(
                {"prompt_token_ids": ids}, params, "r", tokenization_kwargs=kwargs
            )
            return [out.prompt_token_ids async for out in stream][-1]
        finally:
            engine.shutdown()

    assert asyncio.run(first_ids()) == ids[:6]


def test_tokenization_kwargs_add_special_tokens_and_truncation_as_vllm_reads_them(folder):
    """vLLM's other tokenization_kwargs: add_special_tokens=False reads a text without the
    tokenizer's BOS (generate, embed, AsyncLLM's generate and encode), True gives a chat's
    rendered text one; transformers' truncation=True cuts to max_length, as
    truncate_prompt_tokens does (-1 without it). The ids are transformers' tokenizer's."""
    import asyncio

    hf = AutoTokenizer.from_pretrained(folder, truncation_side="left")
    bare, whole = hf(PROMPT, add_special_tokens=False).input_ids, hf(PROMPT).input_ids
    assert whole[1:] == bare  # the tokenizer adds a BOS
    llm = LLM(str(folder), max_model_len=MAX_LEN, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=3)
    no_bos = {"add_special_tokens": False}
    [out] = llm.generate(PROMPT, params, use_tqdm=False, tokenization_kwargs=no_bos)
    assert out.prompt_token_ids == bare and out.prompt == PROMPT
    assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(bare), 3)
    [vector] = llm.embed(PROMPT, use_tqdm=False, tokenization_kwargs=no_bos)
    want = normalized(reference(str(folder), tuple(bare)))
    np.testing.assert_allclose(vector.outputs.embedding, want, rtol=1e-4, atol=1e-5)
    template = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    [chat] = llm.chat(MESSAGES, params, use_tqdm=False,
                      tokenization_kwargs={"add_special_tokens": True})  # fmt: skip
    assert chat.prompt_token_ids == hf(template).input_ids
    cut = {"truncation": True, "max_length": 5}
    [out] = llm.generate(PROMPT, params, use_tqdm=False, tokenization_kwargs=cut)
    assert out.prompt_token_ids == hf(PROMPT, truncation=True, max_length=5).input_ids
    for bad, words in (
        ({"max_length": 5}, "max_length cuts prompts with truncation=True"),
        ({"truncation": "only_second"}, "truncation must be"),
        ({"add_special_tokens": "no"}, "add_special_tokens must be True or False"),
        ({"padding": "max_length"}, "tokenization_kwargs takes"),
    ):
        with pytest.raises(ValueError, match=words):
            llm.generate(PROMPT, params, use_tqdm=False, tokenization_kwargs=bad)

    async def streamed() -> tuple[list[int], list[float]]:
        engine = AsyncLLM.from_model(str(folder), max_model_len=MAX_LEN, block_size=8)
        try:
            stream = engine.generate(PROMPT, params, "r", tokenization_kwargs=no_bos)
            ids = [out.prompt_token_ids async for out in stream][-1]
            pooled = engine.encode(PROMPT, None, "e", tokenization_kwargs=no_bos)
            return ids, [out async for out in pooled][-1].outputs.embedding
        finally:
            engine.shutdown()

    ids, embedding = asyncio.run(streamed())
    assert ids == bare
    np.testing.assert_allclose(embedding, want, rtol=1e-4, atol=1e-5)


def test_a_text_cut_without_a_side_keeps_its_special_tokens_as_vllm_s_tokenizer(folder, tmp_path):
    """Where no side is named vLLM's tokenizer cuts a text itself (transformers'
    truncation=True): a generation keeps its BOS and last tokens, and a last-token embedder
    whose tokenizer appends EOS keeps that EOS with the first tokens, the token it pools."""
    import json
    import shutil

    from transformers import AutoTokenizer

    appends = Path(shutil.copytree(folder, tmp_path / "appends_eos"))
    spec = json.loads((appends / "tokenizer.json").read_text())
    template = spec["post_processor"]["processors"][1]
    template["single"] = [
        {"Sequence": {"id": "A", "type_id": 0}},
        {"SpecialToken": {"id": "<|end_of_text|>", "type_id": 0}},
    ]
    template["special_tokens"] = {
        "<|end_of_text|>": {"id": "<|end_of_text|>", "ids": [641], "tokens": ["<|end_of_text|>"]}
    }
    (appends / "tokenizer.json").write_text(json.dumps(spec))
    for model, side, pooled in ((folder, "left", False), (appends, "right", True)):
        hf = AutoTokenizer.from_pretrained(model, truncation_side=side)
        want = hf(PROMPT, truncation=True, max_length=5)["input_ids"]
        whole = hf(PROMPT)["input_ids"]
        assert len(want) == 5 and want != (whole[:5] if side == "right" else whole[-5:])
        llm = LLM(str(model), max_model_len=MAX_LEN, block_size=8)
        if pooled:
            [out] = llm.embed(PROMPT, truncate_prompt_tokens=5, use_tqdm=False)
            assert out.prompt_token_ids == want and want[-1] == 641
            vector = normalized(reference(str(model), tuple(want)))
            np.testing.assert_allclose(out.outputs.embedding, vector, rtol=1e-4, atol=1e-5)
        else:
            params = SamplingParams(temperature=0, max_tokens=3, truncate_prompt_tokens=5)
            [out] = llm.generate(PROMPT, params, use_tqdm=False)
            assert out.prompt_token_ids == want and want[0] == 640
            assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(want), 3)
        del llm
