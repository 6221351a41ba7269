"""vLLM's score API (scoring.py): `LLM.score` and the server's /score and /rerank. A classifier of
one label scores each pair as transformers' tokenizer pairs it and its model scores it; any
other model by the cosine similarity of transformers' last-token hidden states; bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tandem import LLM, PoolingParams
from tandem.async_llm import AsyncLLM
from tandem.server.app import build_app
from test_pooling import classifiers, normalized, reference  # noqa: F401 (a fixture)
from test_server import running

QUERY = "Where is the cache?"
DOCUMENTS = ["The KV cache is paged.", "Bananas are yellow.", "Blocks hold sixteen tokens each."]


def sigmoid(x: float) -> float:
    return 1 / (1 + np.exp(-x))


def hf_pair(folder: str, first: str, second: str) -> list[int]:
    """transformers' tokenizer's ids of a text pair (a cross-encoder's input)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)(text=first, text_pair=second)["input_ids"]


def hf_logit(model: torch.nn.Module, ids: list[int]) -> float:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, 0].item()


@pytest.fixture(scope="module")
def cross_encoder(classifiers):  # noqa: F811 (the fixture imported above)
    return classifiers[1]


def test_a_cross_encoder_scores_each_pair_as_transformers_pairs_and_scores_it(cross_encoder):
    folder, model = cross_encoder
    llm = LLM(folder, max_model_len=64)
    outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)  # 1:N
    assert len(outs) == 3 and all(out.finished for out in outs)
    for out, document in zip(outs, DOCUMENTS, strict=True):
        ids = hf_pair(folder, QUERY, document)
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(sigmoid(hf_logit(model, ids)), rel=1e-4)
    queries = [QUERY, "Which fruit?", "How many tokens?"]
    raw = llm.score(queries, DOCUMENTS, pooling_params=PoolingParams(use_activation=False))
    for out, query, document in zip(raw, queries, DOCUMENTS, strict=True):  # N:N
        assert out.outputs.score == pytest.approx(
            hf_logit(model, hf_pair(folder, query, document)), abs=1e-4
        )
    [one] = llm.score(QUERY, DOCUMENTS[0], use_tqdm=False)  # 1:1
    assert one.outputs.score == pytest.approx(outs[0].outputs.score, rel=1e-6)
    assert not llm.engine.has_unfinished()


def test_truncate_prompt_tokens_cuts_a_pair_as_transformers_truncation_does(cross_encoder):
    """vLLM tokenizes a pair with truncation=True, max_length=k: the longer text is cut first,
    the special tokens and the query kept (the last k of the joined pair lost the query)."""
    from transformers import AutoTokenizer

    folder, model = cross_encoder
    llm = LLM(folder, max_model_len=64)
    document = DOCUMENTS[0] + " and then some more words to cut away"
    for keep in (10, 14, 64):
        [out] = llm.score(QUERY, document, truncate_prompt_tokens=keep, use_tqdm=False)
        want = AutoTokenizer.from_pretrained(folder)(
            text=QUERY, text_pair=document, truncation=True, max_length=keep
        )["input_ids"]
        assert out.prompt_token_ids == want and len(want) <= keep
        assert out.outputs.score == pytest.approx(sigmoid(hf_logit(model, want)), rel=1e-4)
        pooled = PoolingParams(truncate_prompt_tokens=keep)  # vLLM's other place for it
        [same] = llm.score(QUERY, document, pooling_params=pooled, use_tqdm=False)
        assert same.prompt_token_ids == want
    [whole] = llm.score(QUERY, document, truncate_prompt_tokens=-1, use_tqdm=False)
    assert whole.prompt_token_ids == hf_pair(folder, QUERY, document)
    for keep in (2**64 - 1, 2**64):  # past the tokenizer's usize: the engine's own refusal
        with pytest.raises(ValueError, match="greater than max_model_len"):
            llm.score(QUERY, document, truncate_prompt_tokens=keep, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_use_sep_token_false_joins_the_two_texts(cross_encoder, tmp_path):
    """vLLM's "LLM as reranker": config.json's use_sep_token false reads query + document."""
    folder, model = cross_encoder
    joined = Path(shutil.copytree(folder, tmp_path / "joined"))
    config = json.loads((joined / "config.json").read_text())
    (joined / "config.json").write_text(json.dumps({**config, "use_sep_token": False}))
    from transformers import AutoTokenizer

    [out] = LLM(str(joined), max_model_len=64).score(QUERY, DOCUMENTS[:1], use_tqdm=False)
    ids = AutoTokenizer.from_pretrained(folder)(QUERY + DOCUMENTS[0])["input_ids"]
    assert out.prompt_token_ids == ids
    assert out.outputs.score == pytest.approx(sigmoid(hf_logit(model, ids)), rel=1e-4)


def test_other_models_score_by_the_cosine_of_the_two_embeddings(make_tiny):
    """1:N embeds the one query once (vLLM's N + 1 prompts; it was embedded N times)."""
    folder = str(make_tiny("llama"))
    llm = LLM(folder, max_model_len=64, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    computed = llm.engine.stats().num_prompt_tokens
    outs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    every = [QUERY, *DOCUMENTS]
    assert llm.engine.stats().num_prompt_tokens - computed == sum(
        len(tokenizer.encode(text)) for text in every
    )
    query = normalized(reference(folder, tuple(tokenizer.encode(QUERY))))
    for out, document in zip(outs, DOCUMENTS, strict=True):
        ids = tokenizer.encode(document)
        assert out.outputs.score == pytest.approx(
            query @ normalized(reference(folder, tuple(ids))), abs=1e-5
        )
        pad = [] if tokenizer.pad_token_id is None else [tokenizer.pad_token_id]
        assert out.prompt_token_ids == tokenizer.encode(QUERY) + pad + ids  # as vLLM's


@pytest.mark.parametrize(
    ("data_1", "data_2", "error", "match"),
    [
        (["a", "b"], ["c", "d", "e"], ValueError, "1:1, 1:N or N:N"),
        ([], ["c"], ValueError, "at least one text"),
        ("a", [], ValueError, "at least one text"),
        ("a", [1, 2], TypeError, "data_2 must be a text or a list of texts"),
        ({"prompt": "a"}, "b", TypeError, "data_1 must be"),
    ],
)
def test_bad_pairs_are_typed_errors_and_the_engine_goes_on(
    cross_encoder, data_1, data_2, error, match
):
    llm = LLM(cross_encoder[0], max_model_len=64)
    with pytest.raises(error, match=match):
        llm.score(data_1, data_2, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    assert llm.score("a", "b", use_tqdm=False)[0].finished


def test_a_classifier_of_several_labels_has_no_score(classifiers):  # noqa: F811
    llm = LLM(classifiers[3][0], max_model_len=64)
    with pytest.raises(ValueError, match=r"3 labels.*classify"):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    with pytest.raises(TypeError, match="PoolingParams"):
        LLM(classifiers[1][0], max_model_len=64).score("a", "b", pooling_params={"x": 1})


def test_the_server_s_score_and_rerank_answer_what_llm_score_does(classifiers):  # noqa: F811
    folder = classifiers[1][0]
    want = [o.outputs.score for o in LLM(folder, max_model_len=64).score(QUERY, DOCUMENTS)]
    llm = AsyncLLM.from_model(folder, max_model_len=64)
    try:
        with running(build_app(llm, "reranker")) as url:
            for path in ("/score", "/v1/score"):
                body = httpx.post(
                    f"{url}{path}", json={"text_1": QUERY, "text_2": DOCUMENTS}
                ).json()
                assert body["model"] == "reranker" and body["object"] == "list"
                assert [d["index"] for d in body["data"]] == [0, 1, 2]
                np.testing.assert_allclose([d["score"] for d in body["data"]], want, rtol=1e-5)
                tokens = sum(len(hf_pair(folder, QUERY, d)) for d in DOCUMENTS)
                assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
            order = sorted(range(3), key=lambda i: -want[i])
            for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
                request = {"model": "reranker", "query": QUERY, "documents": DOCUMENTS, "top_n": 2}
                body = httpx.post(f"{url}{path}", json=request).json()
                assert [r["index"] for r in body["results"]] == order[:2]
                assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
                for result in body["results"]:
                    assert result["document"] == {"text": DOCUMENTS[result["index"]]}
                    assert result["relevance_score"] == pytest.approx(
                        want[result["index"]], rel=1e-5
                    )
            every = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCUMENTS})
            assert [r["index"] for r in every.json()["results"]] == order  # top_n 0: all
            for path, request in (  # vLLM's priority and request_id, taken
                ("/rerank", {"query": QUERY, "documents": DOCUMENTS}),
                ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
            ):
                tagged = {**request, "priority": 0, "request_id": "abc"}
                answer = httpx.post(f"{url}{path}", json=tagged).json()
                assert answer["id"].endswith("-abc"), answer
            cut = {"query": QUERY, "documents": DOCUMENTS, "truncate_prompt_tokens": 10}
            short = LLM(folder, max_model_len=64).score(QUERY, DOCUMENTS, truncate_prompt_tokens=10)
            answer = httpx.post(f"{url}/rerank", json=cut).json()  # cut as LLM.score cuts them
            assert answer["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in short)
            for result in answer["results"]:
                assert result["relevance_score"] == pytest.approx(
                    short[result["index"]].outputs.score, rel=1e-5
                )
            for path, request, param in [
                ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                ("/score", {"text_1": "a", "text_2": []}, "text_2"),
                ("/rerank", {"query": "a", "documents": []}, "documents"),
                ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
                (
                    "/rerank",
                    {"query": "a", "documents": ["b"], "return_documents": False},
                    "return_documents",
                ),
                ("/score", {"text_1": "a", "text_2": "b", "model": "other"}, "model"),
                (
                    "/rerank",
                    {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 2**64},
                    "documents",  # the engine's refusal of the documents' requests
                ),
            ]:
                answer = httpx.post(f"{url}{path}", json=request)
                assert answer.status_code in (400, 404), answer.text
                assert answer.json()["error"]["param"] == param
            assert (
                httpx.post(f"{url}/score", json={"text_1": "a", "text_2": "b"}).status_code == 200
            )
    finally:
        llm.shutdown()


def test_a_classifier_of_several_labels_is_a_400_from_the_score_route(classifiers):  # noqa: F811
    llm = AsyncLLM.from_model(classifiers[3][0], max_model_len=64)
    try:
        with running(build_app(llm, "m")) as url:
            answer = httpx.post(f"{url}/rerank", json={"query": "a", "documents": ["b"]})
            assert answer.status_code == 400 and "classify" in answer.json()["error"]["message"]
    finally:
        llm.shutdown()
