"""SamplingParams.logprob_token_ids (vLLM's): each output position's logprobs of exactly the
named ids and the sampled token, against transformers' log-softmax, beside requests that ask
for the top ids or nothing; its bad input; and the server's field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tandem import SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.sampling import MAX_LOGPROB_TOKEN_IDS
from tandem.server.app import build_app
from test_sampling import PROMPTS, assert_logprobs_match, folder, make_llm, reference_logprobs
from test_server import running

__all__ = ["folder"]  # the fixture, used by name

LABELS = [5, 17, 99, 3, 250]


def check_named(completion, named: list[int], folder: str, prompt_ids: list[int]) -> None:
    """Each entry holds the named ids (in their order) then the sampled token, with
    transformers' values; only the sampled token has a rank, its true one."""
    reference = reference_logprobs(folder, prompt_ids, completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids) > 0
    for step, (token, entry) in enumerate(
        zip(completion.token_ids, completion.logprobs, strict=True)
    ):
        assert list(entry) == [token, *[t for t in named if t != token]]  # vLLM's order
        assert_logprobs_match({t: e.logprob for t, e in entry.items()}, reference[step])
        rank = int((reference[step] >= reference[step][token]).sum())
        assert entry[token].rank == rank
        assert all(entry[t].rank is None for t in named if t != token)
    expected = sum(reference[i][t].item() for i, t in enumerate(completion.token_ids))
    assert completion.cumulative_logprob == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_named_ids_get_transformers_logprobs_beside_top_k_and_plain_requests(
    folder, async_batching
):
    llm = make_llm(folder, async_batching=async_batching)
    params = [
        SamplingParams(seed=3, temperature=1.5, max_tokens=10, logprob_token_ids=LABELS),
        SamplingParams(temperature=0, max_tokens=8, logprobs=3),  # the top 3
        SamplingParams(temperature=0, max_tokens=6),  # no logprobs
        SamplingParams(temperature=0, max_tokens=12, logprob_token_ids=[42, 7]),  # narrower
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    check_named(outs[0].outputs[0], LABELS, folder, outs[0].prompt_token_ids)
    check_named(outs[3].outputs[0], [42, 7], folder, outs[3].prompt_token_ids)
    top = outs[1].outputs[0]
    reference = reference_logprobs(folder, outs[1].prompt_token_ids, top.token_ids)
    for step, entry in enumerate(top.logprobs):
        assert set(entry) == set(reference[step].topk(3).indices.tolist())
        assert [e.rank for e in entry.values()] == [1, 2, 3]
    assert outs[2].outputs[0].logprobs is None


def test_named_ids_do_not_change_the_tokens(folder):
    llm = make_llm(folder)
    plain = SamplingParams(seed=11, temperature=1.0, max_tokens=16)
    named = SamplingParams(seed=11, temperature=1.0, max_tokens=16, logprob_token_ids=LABELS)
    a, b = llm.generate([PROMPTS[1]] * 2, [plain, named], use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_only_steps_with_rows_that_name_ids_plan_them_padded_to_the_widest():
    """The slot's buffers are written (and copied) only for steps with such rows; each row holds
    its ids then zeros, up to the step's widest list."""
    from types import SimpleNamespace

    import torch

    from tandem.token_logprobs import TokenLogprobBuffers, plan_rows

    def request(ids):
        logprobs = None if ids else 2  # a row with top-k logprobs, or none named
        return SimpleNamespace(params=SamplingParams(logprob_token_ids=ids, logprobs=logprobs))

    buffers = TokenLogprobBuffers(4, torch.device("cpu"))
    assert plan_rows([request(None), request(None)], buffers) is None
    step = plan_rows([request([7, 8, 9]), request(None), request([4])], buffers)
    assert (step.num_rows, step.width) == (3, 3)
    rows = buffers.np_ids[:9].reshape(3, 3).tolist()
    assert rows == [[7, 8, 9], [0, 0, 0], [4, 0, 0]]


def test_logprobs_becomes_the_count_of_named_ids():
    assert SamplingParams(logprob_token_ids=(4, 5, 6)).logprobs == 3
    assert SamplingParams(logprob_token_ids=[4, 5], logprobs=2).logprob_token_ids == [4, 5]
    assert SamplingParams(logprob_token_ids=[]).logprob_token_ids is None  # asks for nothing
    many = list(range(MAX_LOGPROB_TOKEN_IDS))
    assert SamplingParams(logprob_token_ids=many).logprobs == MAX_LOGPROB_TOKEN_IDS


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"logprob_token_ids": [1, 2], "logprobs": 3}, "logprobs must equal"),
        ({"logprob_token_ids": [1, -2]}, "logprob_token_ids"),
        ({"logprob_token_ids": [1, 2.5]}, "logprob_token_ids"),
        ({"logprob_token_ids": "12"}, "logprob_token_ids"),
        ({"logprob_token_ids": list(range(MAX_LOGPROB_TOKEN_IDS + 1))}, "1 to 128"),
    ],
)
def test_bad_logprob_token_ids_are_value_errors(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_an_id_outside_the_vocabulary_is_refused_and_the_others_run(folder):
    llm = make_llm(folder)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"outside the vocabulary \\(size {vocab}\\)"):
        llm.generate(PROMPTS[0], SamplingParams(logprob_token_ids=[1, vocab]), use_tqdm=False)
    [out] = llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, logprob_token_ids=[1]))
    completion = out.outputs[0]
    assert len(completion.logprobs) == 3
    assert all(
        set(e) == {1, t} for e, t in zip(completion.logprobs, completion.token_ids, strict=True)
    )


# ---- the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(folder) -> Iterator[str]:
    llm = AsyncLLM.from_model(folder, max_model_len=128)
    try:
        with running(build_app(llm, "tiny")) as served:
            yield served
    finally:
        llm.shutdown()


def post(url: str, route: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/{route}", json={"model": "tiny", **fields}, timeout=60)


def test_the_server_returns_the_named_ids_logprobs(url, folder):
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0.0, "return_token_ids": True}
    response = post(url, "completions", **body, logprobs=0, logprob_token_ids=[5, 17])
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    tokens = choice["token_ids"]
    reference = reference_logprobs(folder, [1, 2, 3, 4], tokens)
    by_id = post(url, "completions", **body, logprobs=0, logprob_token_ids=[5, 17],
                 return_tokens_as_token_ids=True).json()["choices"][0]["logprobs"]  # fmt: skip
    for step, top in enumerate(by_id["top_logprobs"]):
        assert set(top) == {"token_id:5", "token_id:17", f"token_id:{tokens[step]}"}
        for key, value in top.items():
            assert value == pytest.approx(reference[step][int(key[9:])].item(), abs=1e-4)
    chat = post(url, "chat/completions", messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4, temperature=0.0, logprobs=True, logprob_token_ids=[5, 17, 99],
                return_tokens_as_token_ids=True)  # fmt: skip
    assert chat.status_code == 200, chat.text
    for entry in chat.json()["choices"][0]["logprobs"]["content"]:
        assert [top["token"] for top in entry["top_logprobs"]] == [
            "token_id:5", "token_id:17", "token_id:99"
        ]  # fmt: skip


NAMED = {"prompt": "Hi", "logprobs": 1, "logprob_token_ids": [5]}


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        ("completions", {**NAMED, "logprobs": None}),
        ("completions", {**NAMED, "use_beam_search": True, "n": 2}),
        ("completions", {**NAMED, "echo": True, "max_tokens": 0}),
        ("completions", {**NAMED, "logprob_token_ids": [5, 10**9]}),  # outside the vocabulary
        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "logprob_token_ids": [5], "logprobs": False}),
    ],
)  # fmt: skip
def test_the_server_refuses_bad_logprob_token_ids_with_400(url, route, fields):
    response = post(url, route, **fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("logprob_token_ids", None)
    assert post(url, "completions", prompt="Hi", max_tokens=2).status_code == 200
