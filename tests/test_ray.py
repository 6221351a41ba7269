"""tandem on Ray, with a local Ray of two CPUs shared by every test here.

Ray Data over two engine actors must give what one in-process engine gives for the same seeds:
greedy outputs do not depend on the batch, and seeded sampling does not depend on what else runs.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest

pytest.importorskip("ray.data")
pytest.importorskip("ray.serve")

import ray
import ray.data

from tandem import LLM, SamplingParams
from tandem.ray import generate

ENGINE_ARGS = {"max_model_len": 256, "block_size": 8, "num_blocks": 128, "device": "cpu"}
RUN_BATCH_ARGS = {"max_model_len": 256, "block_size": 8, "num_blocks": 128, "max_num_seqs": 4}
PROMPTS = ["The engine", "Once upon a time", "café au lait", "KV blocks", "A scheduler", "Ray"]


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def row_params(i: int) -> dict:
    if i % 2 == 0:
        return {"max_tokens": 12, "temperature": 0.0}
    return {"max_tokens": 10 + i, "temperature": 0.8, "top_k": 20, "seed": 1000 + i}


def test_ray_data_over_two_actors_matches_one_engine(local_ray, folder):
    rows = [{"prompt": p, "sampling_params": row_params(i)} for i, p in enumerate(PROMPTS)]
    rows.append(
        {
            "prompt_token_ids": [5, 6, 7, 8],
            "sampling_params": {"max_tokens": 6, "temperature": 0.0, "logprobs": 2},
        }
    )
    rows.append({"prompt": "bad", "sampling_params": {"temperature": -1.0}})
    rows.append({"prompt": "bad", "sampling_params": {"tempreature": 1.0}})
    ds = ray.data.from_items(rows, override_num_blocks=4)
    out = generate(ds, folder, concurrency=2, batch_size=2, **ENGINE_ARGS).take_all()
    assert len(out) == len(rows)

    llm = LLM(folder, **ENGINE_ARGS)
    good = rows[: len(PROMPTS) + 1]
    prompts = [r.get("prompt") or {"prompt_token_ids": r["prompt_token_ids"]} for r in good]
    params = [SamplingParams(**r["sampling_params"]) for r in good]
    expected = llm.generate(prompts, params, use_tqdm=False)
    by_prompt = {}
    for row in out:
        key = (
            row["prompt"] if row.get("prompt_token_ids") is None else tuple(row["prompt_token_ids"])
        )
        by_prompt.setdefault(key, []).append(row)
    for r, want in zip(good, expected, strict=True):
        key = r["prompt"] if "prompt" in r else tuple(r["prompt_token_ids"])
        (got,) = by_prompt[key]
        completion = want.outputs[0]
        assert got["error"] is None
        assert list(got["generated_token_ids"]) == completion.token_ids
        assert got["generated_text"] == completion.text
        assert got["finish_reason"] == completion.finish_reason
        assert got["num_prompt_tokens"] == len(want.prompt_token_ids)
    (with_logprobs,) = by_prompt[(5, 6, 7, 8)]
    want_logprobs = expected[-1].outputs[0].logprobs
    assert [list(e["token_ids"]) for e in with_logprobs["logprobs"]] == [
        list(e) for e in want_logprobs
    ]
    bad = by_prompt["bad"]
    assert sorted(b["error"].split(" ")[0] for b in bad) == ["sampling_params:", "temperature"]
    assert all(b["generated_token_ids"] is None for b in bad)


def objects(*values):
    """A numpy object column, as Ray Data hands a batch's cells over."""
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def test_rows_logit_bias_from_json_and_the_callers_max_tokens_none(folder):
    """A JSON row's logit_bias keys are text, and Arrow gives each row the other rows' keys as
    None: the biases hold as given. The caller's max_tokens=None runs to the context's end (it
    was taken for an unset cell: 16 tokens)."""
    from tandem.ray.data import LLMPredictor

    prompts = objects(np.full(200, 5), np.full(200, 6))
    biases = objects(
        {"logit_bias": {"5": 100.0, "7": None}}, {"logit_bias": {"5": None, "7": 100.0}}
    )
    defaults = {"max_tokens": None, "temperature": 0}
    predictor = LLMPredictor(folder, sampling_params=defaults, **ENGINE_ARGS)
    try:
        out = asyncio.run(predictor({"prompt_token_ids": prompts, "sampling_params": biases}))
    finally:
        predictor.llm.shutdown()
    assert out["error"] == [None, None]
    left = ENGINE_ARGS["max_model_len"] - 200
    assert out["generated_token_ids"] == [[5] * left, [7] * left]


def test_a_batch_of_mixed_rows_comes_back_as_plain_columns_each_bad_row_on_its_own(folder):
    """Ray Data hands a batch over as numpy object columns; one holding an id array on one row
    and None on the next is a column Arrow cannot type (write_json then failed in every retry),
    so every column comes back as Python lists. A row whose sampling_params is no dict fails
    alone, with its error."""
    import pyarrow as pa

    from tandem.ray.data import LLMPredictor

    batch = {
        "prompt_token_ids": objects(np.array([5, 6, 7]), None, None),
        "prompt": objects(None, "The engine", "bad"),
        "sampling_params": objects({"max_tokens": 3}, {"max_tokens": 2}, '{"max_tokens": 2}'),
    }
    predictor = LLMPredictor(folder, **ENGINE_ARGS)
    try:
        out = asyncio.run(predictor(batch))
    finally:
        predictor.llm.shutdown()
    assert out["prompt_token_ids"] == [[5, 6, 7], None, None]
    pa.table({k: v for k, v in out.items() if k != "sampling_params"})  # typed, as Arrow needs
    assert [len(ids or []) for ids in out["generated_token_ids"]] == [3, 2, 0]
    assert out["error"][:2] == [None, None]
    assert "sampling_params must be a dict" in out["error"][2]


# ---- tandem run-batch --data-parallel-size 2 ------------------------------------------------


def test_run_batch_over_two_engines_resumes_and_answers_every_line_once(
    local_ray, folder, tmp_path
):
    from tandem.run_batch import run_batch
    from test_run_batch import MODEL, check_answers, interrupted_copy, read_output, write_batch

    batch = write_batch(tmp_path / "requests.jsonl")
    engine_args = {**RUN_BATCH_ARGS, "device": "cpu"}  # 4 seqs: batches of one request
    one = tmp_path / "one.jsonl"
    run_batch(str(batch), str(one), folder, engine_args, 1, MODEL, quiet=True)
    out = tmp_path / "two.jsonl"
    kept = interrupted_copy(one, out, num_kept=3)
    run_batch(str(batch), str(out), folder, engine_args, 2, MODEL, quiet=True)
    lines = read_output(out)
    check_answers(lines, folder)
    assert [line["id"] for line in lines[:2]] == [line["id"] for line in kept[1:]]


# ---- tandem serve --data-parallel-size 2 ----------------------------------------------------

MAX_STOP_STRINGS = 2  # the replicas' --max-stop-strings
SERVE_ARGS = {"max_model_len": 1024, "block_size": 8, "num_blocks": 512, "device": "cpu"}
LONG = {"max_tokens": 900, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def service(local_ray, folder):
    from ray import serve

    from tandem.ray.serve import build_serve_app
    from tandem.server.options import ServerOptions

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    options = ServerOptions(max_stop_strings=MAX_STOP_STRINGS)
    app = build_serve_app(
        folder, SERVE_ARGS, 2, "tiny", options, health_check_period_s=1.0, num_ingress_replicas=1
    )
    serve.run(app, name="tandem", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=f"{service}/v1", api_key="none", max_retries=0, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_of(client, prompt: str) -> str:
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=2)
    return raw.headers["x-tandem-replica"]


def test_two_replicas_answer_the_openai_client_as_one_engine(client, folder):
    llm = LLM(folder, **SERVE_ARGS)
    for prompt in PROMPTS[:3]:
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        [want] = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert got.choices[0].text == want.outputs[0].text
    messages = [{"role": "user", "content": "Name a cache."}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    stream = client.completions.create(
        model="tiny", prompt="Ray", max_tokens=6, temperature=0, stream=True
    )
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    [want] = llm.generate("Ray", SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert streamed == want.outputs[0].text


def test_every_replica_serves_with_the_server_options(client):
    """`tandem serve --data-parallel-size N`'s server flags hold in each replica's app."""
    stop = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    for prompt in PROMPTS[:4]:  # prompts of different prefixes: both replicas, as routed
        with pytest.raises(openai.BadRequestError, match="stop"):
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2, stop=stop)
    ok = client.completions.create(model="tiny", prompt="x", max_tokens=2, stop=stop[:-1])
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_stored_response_is_read_from_the_replica_that_stored_it(service):
    """/v1/responses: previous_response_id, GET and DELETE reach the replica whose store holds
    the response (with two replicas, a random one would miss it half the time)."""
    body = {"model": "tiny", "max_output_tokens": 2, "temperature": 0.0}
    first = httpx.post(f"{service}/v1/responses", json={**body, "input": "Hi"}, timeout=60)
    owner, previous = first.headers["x-tandem-replica"], first.json()["id"]
    for turn in range(6):  # each turn a new conversation prefix: routed by the id alone
        follow = {**body, "input": f"Turn {turn} " * 8, "previous_response_id": previous}
        answer = httpx.post(f"{service}/v1/responses", json=follow, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-tandem-replica"] == owner
        previous = answer.json()["id"]
    assert httpx.get(f"{service}/v1/responses/{previous}", timeout=60).json()["id"] == previous
    assert httpx.delete(f"{service}/v1/responses/{previous}", timeout=60).status_code == 200
    assert httpx.get(f"{service}/v1/responses/{previous}", timeout=60).status_code == 404
    long = {**body, "input": "Go on.", "max_output_tokens": 64, "ignore_eos": True}
    queued = httpx.post(f"{service}/v1/responses", json={**long, "background": True}, timeout=60)
    cancel = f"{service}/v1/responses/{queued.json()['id']}/cancel"
    for _ in range(4):  # the replica that runs it answers every time (elsewhere: a 404)
        answer = httpx.post(cancel, timeout=60)
        assert answer.status_code in (200, 400), answer.text  # 400: it had ended already
        assert answer.headers["x-tandem-replica"] == queued.headers["x-tandem-replica"]


def test_requests_sharing_a_prefix_go_to_one_replica(client):
    prefixes = [f"Shared system prompt number {i}, long enough to fill a block. " for i in range(6)]
    for prefix in prefixes:
        replicas = {replica_of(client, prefix + question) for question in ("Why?", "How?", "Who?")}
        assert len(replicas) == 1


def test_routes_on_the_engine_as_a_whole_are_broadcast():
    from tandem.ray.serve import ENGINE_ROUTES
    from tandem.server.admin import admin_router

    assert {route.path for route in admin_router(None).routes} - ENGINE_ROUTES == {
        "/get_world_size"
    }


def test_a_weight_update_reaches_every_replica(service, folder, tmp_path_factory):
    """/update_weights_from_path runs on each replica (it reached one of the two): requests
    answered by either replica come from the new weights; a bad path is one 400."""
    from tandem.model.tiny import make_tiny_model

    other = str(make_tiny_model(tmp_path_factory.mktemp("other"), "llama", seed=1))
    greedy = SamplingParams(max_tokens=6, temperature=0)
    prompts = [f"Question {i}: which weights answer?" for i in range(12)]
    want = [o.outputs[0].text for o in LLM(other, **SERVE_ARGS).generate(prompts, greedy, False)]
    update = f"{service}/update_weights_from_path"
    answer = httpx.post(update, json={"path": other}, timeout=120)
    try:
        assert answer.status_code == 200 and answer.json() == {"updated": True}, answer.text
        assert len(set(answer.headers["x-tandem-replica"].split(","))) == 2
        replicas = set()
        for prompt, text in zip(prompts, want, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            got = httpx.post(f"{service}/v1/completions", json=body, timeout=60)
            assert got.json()["choices"][0]["text"] == text
            replicas.add(got.headers["x-tandem-replica"])
        assert len(replicas) == 2
        bad = httpx.post(update, json={"path": "/no/such/checkpoint"}, timeout=60)
        assert bad.status_code == 400 and "/no/such/checkpoint" in bad.text
    finally:
        assert httpx.post(update, json={"path": folder}, timeout=120).status_code == 200


def test_a_replica_killed_mid_request_fails_its_requests_and_the_service_goes_on(client, service):
    """A streamed request on the killed replica ends with an error event, a plain one with a
    503. The plain one is sent beside the stream and given the time of a few more streamed
    tokens to arrive; on a machine so loaded that it reached the service only after the kill,
    it is answered by the other replica instead, which loses nothing either."""
    prompt = "A request whose replica dies. " * 4
    sent = threading.Event()
    blocking: list[httpx.Response] = []
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 900, "temperature": 0,
            "ignore_eos": True}  # fmt: skip

    def non_streaming() -> None:
        hooks = {"request": [lambda request: sent.set()]}
        with httpx.Client(timeout=60, event_hooks=hooks) as http:
            blocking.append(http.post(f"{service}/v1/completions", json=body))

    thread = threading.Thread(target=non_streaming)
    with client.completions.with_streaming_response.create(
        model="tiny", prompt=prompt, stream=True, **LONG
    ) as response:
        name = response.headers["x-tandem-replica"]
        before = engine_replicas()
        assert name in before and len(before) == 2
        chunks = iter(response.parse())
        next(chunks)  # the stream runs on that replica now
        thread.start()
        assert sent.wait(30)
        for _ in range(20):  # the plain request's way to the replica, while tokens stream
            next(chunks)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        with pytest.raises(openai.APIError, match="replica"):
            for _ in chunks:
                pass
    thread.join(timeout=60)
    [answer] = blocking
    if answer.status_code == 200:  # it arrived after the kill: the other replica took it
        assert answer.headers["x-tandem-replica"] != name
        assert answer.json()["choices"][0]["finish_reason"] == "length"
    else:
        assert answer.status_code == 503, answer.text
        assert "replica" in answer.text

    for prefix in ("After the crash", prompt, "Still here"):
        answer = client.completions.create(model="tiny", prompt=prefix, max_tokens=3)
        assert answer.choices[0].finish_reason in ("length", "stop")
    # a new replica starts its engine: past a minute on a loaded 2-core CI machine
    deadline = time.monotonic() + 180
    for i in itertools.count():  # until a request is answered by the replica that replaced it
        assert time.monotonic() < deadline, "Ray Serve did not replace the dead replica"
        if replica_of(client, f"Question {i}: who answers?") not in before:
            break
        time.sleep(0.2)


def engine_replicas() -> set[str]:
    from ray.util import list_named_actors

    actors = list_named_actors(all_namespaces=True)
    return {a["name"] for a in actors if "#EngineReplica#" in a["name"]}


def test_serve_with_data_parallel_size_hands_its_server_flags_to_the_replicas(folder, monkeypatch):
    from tandem import cli
    from tandem.ray import serve as ray_serve

    calls = []
    monkeypatch.setattr(ray_serve, "serve_data_parallel", lambda *args: calls.append(args))
    argv = ["serve", folder, "--data-parallel-size", "2", "--max-stop-strings", "3"]
    cli.main([*argv, "--tool-call-parser", "hermes", "--api-key", "k", "k2"])
    [(model, _, size, _, _, _, options)] = calls
    assert (model, size) == (folder, 2)
    assert (options.max_stop_strings, options.api_keys(), options.tool_call_parser) == (
        3,
        ("k", "k2"),
        "hermes",
    )
