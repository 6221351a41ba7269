"""The server's flags beyond the engine's (vLLM's): chats (--chat-template, a file or the template
itself; --trust-request-chat-template for a request's own chat_template; --response-role;
--default-chat-template-kwargs), checked against transformers' rendering of the template; HTTP
(CORS, a preflight answered before the API key is asked; --root-path; --disable-fastapi-docs;
TLS over a real `tandem serve` process; --uvicorn-log-level); bad values refused before
serving."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import httpx
import pytest
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.cli import build_parser, engine_kwargs, main, server_options
from tandem.server.app import build_app
from tandem.server.lifecycle import uvicorn_config
from tandem.server.options import ServerOptions
from tandem.tokenizer import Tokenizer, content_format
from test_serve_process import process
from test_server import running

# reads a variable the server's defaults set and a request may override
TEMPLATE = (
    "{% for m in messages %}[{{ tone }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}bot:{% endif %}"
)
OTHER_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
# a fixed KV cache, so that the module's engines fit side by side on a GPU
KV_CACHE = {"kv_cache_memory_bytes": 32 << 20}


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@pytest.fixture(scope="module")
def llm(folder):
    llm = AsyncLLM.from_model(folder, max_model_len=128, **KV_CACHE)
    yield llm
    llm.shutdown()


def transformers_ids(folder: str, template: str, messages=MESSAGES, **variables) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False, **variables
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def client_of(llm, **options) -> TestClient:
    return TestClient(build_app(llm, "tiny", options=ServerOptions(**options)))


def test_the_server_s_template_role_and_default_variables(llm, folder):
    options = {"chat_template": TEMPLATE, "response_role": "bot"}
    with client_of(llm, default_chat_template_kwargs={"tone": "calm"}, **options) as client:
        tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert tokens == transformers_ids(folder, TEMPLATE, tone="calm")
        given = {"messages": MESSAGES, "chat_template_kwargs": {"tone": "loud"}}
        assert client.post("/tokenize", json=given).json()["tokens"] == transformers_ids(
            folder, TEMPLATE, tone="loud"
        )  # the request's variables over the server's
        body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
        rendered = client.post("/v1/chat/completions/render", json=body).json()
        assert rendered["token_ids"] == tokens
        answer = client.post("/v1/chat/completions", json=body).json()
        assert answer["choices"][0]["message"]["role"] == "bot"
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            first = next(line for line in r.iter_lines() if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "bot"
        beams = {**body, "use_beam_search": True, "n": 2}
        answer = client.post("/v1/chat/completions", json=beams).json()
        assert {c["message"]["role"] for c in answer["choices"]} == {"bot"}


def test_a_request_s_template_needs_the_server_s_trust(llm, folder):
    body = {"messages": MESSAGES, "chat_template": OTHER_TEMPLATE}
    with client_of(llm) as client:
        for path in ("/tokenize", "/v1/chat/completions"):
            answer = client.post(path, json={**body, "max_tokens": 2} if "chat" in path else body)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "chat_template"
        model_s = Tokenizer.from_dir(folder).apply_chat_template(
            MESSAGES, add_generation_prompt=True, tokenize=False
        )
        tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        assert tokens == Tokenizer.from_dir(folder).encode(model_s, add_special_tokens=False)
    with client_of(llm, chat_template=TEMPLATE, trust_request_chat_template=True) as client:
        tokens = client.post("/tokenize", json=body).json()["tokens"]
        assert tokens == transformers_ids(
            folder, OTHER_TEMPLATE
        )  # the request's, over the server's
        broken = client.post("/tokenize", json={**body, "chat_template": "{% for %}"})
        assert broken.status_code == 400 and broken.json()["error"]["param"] == "messages"
        # a template whose own logic fails (the sandbox's range limit): a 400, not a 500
        endless = "{% for i in range(10**9) %}x{% endfor %}"
        for path in ("/tokenize", "/v1/chat/completions"):
            request = {**body, "chat_template": endless}
            answer = client.post(
                path, json={**request, "max_tokens": 2} if "chat" in path else request
            )
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
            assert "chat template failed on the messages" in answer.json()["error"]["message"]


def test_the_cli_reads_a_template_file_or_the_template_itself(tmp_path, folder):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    parser = build_parser()
    for value in (str(path), TEMPLATE):
        args = parser.parse_args(["serve", folder, "--chat-template", value])
        assert args.chat_template == TEMPLATE
        assert "chat_template" not in engine_kwargs(args)  # the server's, not the engine's
    args = parser.parse_args(["serve", folder, "--default-chat-template-kwargs", '{"tone": "x"}'])
    assert args.default_chat_template_kwargs == {"tone": "x"}
    for flags in (
        ["--chat-template", str(tmp_path / "missing.jinja")],  # neither a file nor a template
        ["--default-chat-template-kwargs", "[1]"],
        ["--default-chat-template-kwargs", "{nope"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", folder, *flags])


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"chat_template": "{% for %}"}, "does not compile"),
        ({"response_role": ""}, "response_role"),
        ({"default_chat_template_kwargs": [1]}, "JSON object"),
    ],
)
def test_bad_chat_options_are_refused_before_serving(options, match):
    with pytest.raises(ValueError, match=match):
        ServerOptions(**options).validate()


# ---- HTTP ---------------------------------------------------------------------------------------

PREFLIGHT = {"Origin": "https://ui.example", "Access-Control-Request-Method": "POST"}


def test_any_origin_by_default_and_a_preflight_needs_no_api_key(llm):
    with client_of(llm, api_key="k") as client:
        preflight = client.options("/v1/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        refused = client.get("/v1/models", headers={"Origin": "https://ui.example"})
        assert refused.status_code == 401  # the key is still asked of the request itself
        assert refused.headers["access-control-allow-origin"] == "*"
        headers = {"Origin": "https://ui.example", "Authorization": "Bearer k"}
        assert client.get("/v1/models", headers=headers).status_code == 200


def test_any_of_several_api_keys_is_taken(llm):
    with client_of(llm, api_key=("old-key", "new-key")) as client:  # vLLM's list: rotation
        for key in ("old-key", "new-key"):
            answer = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200
        for key in ("other", "old-keynew-key", ""):
            answer = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 401
        assert client.get("/ping").status_code == 200
    for keys in ("", (), ("k", "")):
        with pytest.raises(ValueError, match="api_key"):
            ServerOptions(api_key=keys).validate()


def test_request_id_headers_echo_the_clients_id_or_make_one(llm):
    with client_of(llm) as client:  # off by default, as vLLM's
        assert "x-request-id" not in client.get("/v1/models").headers
    with client_of(llm, enable_request_id_headers=True) as client:
        mine = client.get("/v1/models", headers={"X-Request-Id": "trace-7"})
        assert mine.headers["x-request-id"] == "trace-7"
        made = [client.get("/ping").headers["x-request-id"] for _ in range(2)]
        assert len(set(made)) == 2 and all(len(i) == 32 for i in made)
        body = {"prompt": "Hi", "max_tokens": 2}
        answer = client.post("/v1/completions", json=body, headers={"X-Request-Id": "r-1"})
        assert answer.headers["x-request-id"] == "r-1" and answer.json()["id"] == "cmpl-r-1"
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            assert len(stream.headers["x-request-id"]) == 32  # a stream's headers too
            assert "data: [DONE]" in list(stream.iter_lines())


def test_only_the_allowed_origins(llm):
    allowed = "https://a.example"
    with client_of(llm, allowed_origins=(allowed,), allow_credentials=True) as client:
        ok = client.options("/v1/completions", headers={**PREFLIGHT, "Origin": allowed})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == allowed
        assert ok.headers["access-control-allow-credentials"] == "true"
        other = client.options("/v1/completions", headers=PREFLIGHT)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_docs_and_the_root_path(llm):
    """--root-path is the app's, as vLLM sets it: behind a proxy that keeps its prefix
    (/api/v1/models) and one that strips it (/v1/models) the routes answer alike."""
    options = ServerOptions(root_path="/api", uvicorn_log_level="debug")
    app = build_app(llm, "tiny", options=options)
    config = uvicorn_config(app, "127.0.0.1", 8000, options)  # what `serve` runs
    assert config.log_level == "debug"
    with running(app) as url:
        for path in ("/v1/models", "/api/v1/models", "/docs", "/api/docs"):
            assert httpx.get(f"{url}{path}").status_code == 200, path
        assert httpx.get(f"{url}/openapi.json").json()["servers"] == [{"url": "/api"}]
    with client_of(llm, disable_fastapi_docs=True) as client:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert client.get(path).status_code == 404
        assert client.get("/v1/models").status_code == 200


class StampMiddleware:
    """An ASGI middleware class, as --middleware takes one: stamps every HTTP response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        async def stamped(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-stamp", b"class")]
            await send(message)

        await self.app(scope, receive, stamped if scope["type"] == "http" else send)


async def refuse_teapots(request, call_next):
    """A function middleware (FastAPI's @app.middleware("http")): answers before the server."""
    if request.headers.get("x-teapot"):
        return JSONResponse({"teapot": True}, status_code=418)
    return await call_next(request)


NOT_MIDDLEWARE = 42


def test_middleware_classes_and_functions_wrap_the_server_as_vllm_s(llm):
    """--middleware (vLLM's): each runs outside the server's own, the API key's too."""
    paths = ("test_server_flags.StampMiddleware", "test_server_flags.refuse_teapots")
    with client_of(llm, middleware=paths, api_key="k") as client:
        models = client.get("/v1/models", headers={"Authorization": "Bearer k"})
        assert models.status_code == 200 and models.headers["x-stamp"] == "class"
        refused = client.get("/v1/models")  # no key: the server's 401, stamped
        assert refused.status_code == 401 and refused.headers["x-stamp"] == "class"
        teapot = client.get("/v1/models", headers={"x-teapot": "1"})
        assert teapot.status_code == 418 and teapot.json() == {"teapot": True}
    args = build_parser().parse_args(["serve", "m", "--middleware", paths[0], "--middleware",
                                      paths[1]])  # fmt: skip
    assert server_options(args, ()).middleware == paths


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("no_such_module.Middleware", "cannot import it"),
        ("test_server_flags.Missing", "cannot import it"),
        ("test_server_flags.NOT_MIDDLEWARE", "a middleware class or an async function"),
        ("Middleware", "import paths such as package.module.name"),
    ],
)
def test_a_middleware_that_is_none_is_refused_naming_the_flag(llm, path, match):
    with pytest.raises(ValueError, match=match):
        build_app(llm, "tiny", options=ServerOptions(middleware=(path,)))


def test_the_log_config_file_is_uvicorn_s_logging_config(llm, tmp_path):
    """--log-config-file (vLLM's): a JSON dictConfig that uvicorn configures its logging by;
    a file that is no JSON object is refused before serving."""
    config = {"version": 1, "disable_existing_loggers": False,
              "formatters": {"plain": {"format": "tandem-test %(message)s"}},
              "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "plain"}},
              "loggers": {"uvicorn": {"handlers": ["out"], "level": "INFO"}}}  # fmt: skip
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    options = ServerOptions(log_config_file=str(path))
    options.validate()
    assert uvicorn_config(build_app(llm, "tiny", options=options), "h", 1, options).log_config == (
        config
    )
    assert uvicorn_config(build_app(llm, "tiny"), "h", 1, ServerOptions()).log_config != config
    for text in ("{not json", "[1, 2]"):
        path.write_text(text)
        with pytest.raises(ValueError, match="--log-config-file"):
            options.validate()
    with pytest.raises(ValueError, match="--log-config-file"):
        ServerOptions(log_config_file=str(tmp_path / "none.json")).validate()


def test_tls_serves_https_with_the_certificate(folder, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
         cert, "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    trusted = ssl.create_default_context(cafile=str(cert))
    command = [sys.executable, "-m", "tandem.cli", "serve", folder, "--port", "PORT",
               "--max-model-len", "128", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
               "--uvicorn-log-level", "warning"]  # fmt: skip
    with process(command, "https", trusted) as (proc, url):
        assert httpx.get(f"{url}/v1/models", verify=trusted).status_code == 200
        with pytest.raises(httpx.TransportError):  # plain http is not spoken
            httpx.get(url.replace("https", "http") + "/health")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "Uvicorn running" not in proc.stdout.read()  # info lines off at "warning"


def outward_address() -> str | None:
    """This machine's address on its network (not loopback), None where it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: it picks the outgoing address
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def test_serve_listens_on_every_interface_without_host(folder):
    """vLLM's --host default binds every interface, not loopback alone."""
    address = outward_address()
    if address is None:
        pytest.skip("this machine has no address beside loopback")
    command = [sys.executable, "-m", "tandem.cli", "serve", folder, "--port", "PORT",
               "--max-model-len", "128"]  # fmt: skip
    with process(command) as (proc, url):
        outward = url.replace("127.0.0.1", address)
        assert httpx.get(f"{outward}/v1/models").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"ssl_certfile": "/no/cert.pem", "ssl_keyfile": "/no/key.pem"}, "is not a file"),
        ({"ssl_cert_reqs": 3}, "ssl_cert_reqs"),
        ({"uvicorn_log_level": "loud"}, "uvicorn_log_level"),
        ({"allowed_origins": "https://a.example"}, "allowed_origins"),
        ({"h11_max_header_count": 0}, "h11_max_header_count must be a positive int"),
        ({"enable_ssl_refresh": True}, "--enable-ssl-refresh reloads --ssl-certfile"),
        ({"h11_max_incomplete_event_size": True}, "h11_max_incomplete_event_size must be"),
        ({"uds": "/tmp/t.sock", "ssl_keyfile": __file__, "ssl_certfile": __file__}, "--uds"),
    ],
)
def test_bad_http_options_are_refused_before_serving(options, match):
    with pytest.raises(ValueError, match=match):
        ServerOptions(**options).validate()


def test_a_key_without_its_certificate_is_refused(tmp_path):
    key = tmp_path / "key.pem"
    key.write_text("x")
    with pytest.raises(ValueError, match="both --ssl-certfile and --ssl-keyfile"):
        ServerOptions(ssl_keyfile=str(key)).validate()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--allowed-origins", "https://a.example"], "not JSON"),
        (["--allowed-origins", '{"a": 1}'], "JSON list of strings"),
        (["--data-parallel-size", "2", "--root-path", "/api"], "--root-path"),
    ],
)
def test_bad_http_flags_end_the_command_with_one_line(folder, flags, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["serve", folder, *flags])
    said = f"{capsys.readouterr().err}{exit.value.code}"  # argparse's line, or main's
    assert message in said, said


# ---- requests: logging, usage, token ids ---------------------------------------------------------


def test_requests_are_logged_with_their_prompt_cut_to_max_log_len(llm, caplog):
    prompt = "A prompt long enough to be cut"
    body = {"prompt": prompt, "max_tokens": 2, "seed": 4}
    with client_of(llm) as client:  # off by default
        with caplog.at_level("INFO", logger="uvicorn.error"):
            assert client.post("/v1/completions", json=body).status_code == 200
        assert not [r for r in caplog.records if "received request" in r.getMessage()]
    logged = client_of(llm, enable_log_requests=True, max_log_len=8)
    with logged as client, caplog.at_level("INFO", logger="uvicorn.error"):
        assert client.post("/v1/completions", json=body).status_code == 200
    [line] = [r.getMessage() for r in caplog.records if "received request" in r.getMessage()]
    ids = Tokenizer.from_dir(llm.engine.config.model).encode(prompt)
    assert f"prompt {prompt[:8]!r}" in line and f"prompt_token_ids {ids[:8]}" in line
    assert "seed=4" in line and prompt[:9] not in line


@pytest.mark.parametrize("stream", [False, True])
def test_outputs_are_logged_as_each_choice_finishes_with_enable_log_outputs(llm, caplog, stream):
    """vLLM's --enable-log-outputs: a line per finished choice, text and ids cut as prompts are;
    without --enable-log-requests it is refused, as vLLM's."""
    body = {"prompt": "Log what comes", "max_tokens": 12, "n": 2, "seed": 4,
            "ignore_eos": True, "stream": stream}  # fmt: skip
    options = {"enable_log_requests": True, "max_log_len": 3}
    with client_of(llm, **options) as client, caplog.at_level("INFO", logger="uvicorn.error"):
        assert client.post("/v1/completions", json=body).status_code == 200
        assert not [r for r in caplog.records if "generated response" in r.getMessage()]
    logging_outputs = client_of(llm, **options, enable_log_outputs=True)
    with logging_outputs as client, caplog.at_level("INFO", logger="uvicorn.error"):
        response = client.post("/v1/completions", json=body)
    texts = ["", ""]  # each choice's whole text, as the client read it
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line[6:7] == "{"]
    for choice in (
        c for event in (events if stream else [response.json()]) for c in event["choices"]
    ):
        texts[choice["index"]] += choice["text"]
    said = [r.getMessage() for r in caplog.records if "generated response" in r.getMessage()]
    lines = [line for line in said if "(streaming delta)" not in line]
    assert len(lines) == 2  # one a choice
    logged = {line.split("output ")[1].split(", output_token_ids")[0] for line in lines}
    assert logged == {repr(text[:3]) for text in texts}
    assert all("finish_reason length" in line for line in lines)
    # a stream's outputs each a line too (vLLM's --enable-log-deltas, on by default), of each
    # choice, each with its new tokens
    deltas = [line for line in said if "(streaming delta)" in line]
    requests = {line.split(" ")[2].rstrip(":") for line in lines}
    assert {line.split(" ")[2] for line in deltas} == (requests if stream else set())
    assert all(line.split("output_token_ids [")[1] != "]" for line in deltas)
    assert not stream or len(deltas) >= 2 * 2  # outputs of several tokens each, in 12 tokens
    caplog.clear()
    quiet = client_of(llm, **options, enable_log_outputs=True, enable_log_deltas=False)
    with quiet as client, caplog.at_level("INFO", logger="uvicorn.error"):
        assert client.post("/v1/completions", json=body).status_code == 200
    assert not [r for r in caplog.records if "(streaming delta)" in r.getMessage()]
    with pytest.raises(ValueError, match="--enable-log-outputs needs --enable-log-requests"):
        ServerOptions(enable_log_outputs=True).validate()


def test_forced_usage_ends_every_stream_and_token_ids_name_every_logprob(llm):
    body = {"prompt": "Hi", "max_tokens": 3, "stream": True, "logprobs": 1}
    options = {"enable_force_include_usage": True, "return_tokens_as_token_ids": True}
    with (
        client_of(llm, **options) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and not chunks[-1]["choices"]
    tokens = [
        t for c in chunks[:-1] for choice in c["choices"] for t in choice["logprobs"]["tokens"]
    ]
    assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens)
    with client_of(llm) as client, client.stream("POST", "/v1/completions", json=body) as r:
        plain = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" not in c or c["usage"] is None for c in plain)
    assert not any(
        t.startswith("token_id:")
        for c in plain
        for ch in c["choices"]
        for t in ch["logprobs"]["tokens"]
    )


def test_a_negative_max_log_len_is_refused():
    with pytest.raises(ValueError, match="max_log_len"):
        ServerOptions(max_log_len=-1).validate()


# ---- chat_template_content_format ---------------------------------------------------------------

# takes a message's content as OpenAI's list of parts only
PARTS_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}[{{ p['text'] }}]"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
         {"role": "assistant", "content": "Hello"}]  # fmt: skip


def transformers_text(folder: str, template: str, messages) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (PARTS_TEMPLATE, "openai"),
        ("{% for m in messages %}{% set c = m.content %}{% for p in c %}{% endfor %}{% endfor %}",
         "string"),  # vLLM's detection follows no variable set from a message's content
        (TEMPLATE, "string"),
        ("{% for m in messages %}{% for w in m.content.split(' ') %}{% endfor %}{% endfor %}",
         "string"),  # a loop over what the string makes: the template takes a string
    ],
)  # fmt: skip
def test_auto_reads_from_the_template_whether_it_loops_over_content(source, expected):
    assert content_format(source) == expected
    assert content_format(source, "string") == "string"
    with pytest.raises(ValueError, match="chat_template_content_format"):
        content_format(source, "parts")


def test_a_template_that_loops_over_parts_gets_parts_as_transformers_gives_them(llm, folder):
    """auto finds the loop: each message's content goes to the template as OpenAI's parts (a
    string made one part), offline and served; "string" would join them."""
    openai_form = [
        PARTS[0], {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]}
    ]  # fmt: skip
    want = transformers_text(folder, PARTS_TEMPLATE, openai_form)
    assert "[Hi][there]" in want and "[Hello]" in want
    offline = LLM(folder, max_model_len=128, **KV_CACHE)
    params = SamplingParams(max_tokens=1)
    [out] = offline.chat(PARTS, params, use_tqdm=False, chat_template=PARTS_TEMPLATE)
    assert out.prompt == want
    [joined] = offline.chat(
        PARTS, params, use_tqdm=False, chat_template=PARTS_TEMPLATE,
        chat_template_content_format="string",
    )  # fmt: skip
    # the template walks the joined string's characters, which have no ['text']
    assert joined.prompt == "user:" + "[]" * len("Hi\nthere") + "assistant:[][][][][]assistant:"
    with client_of(llm, chat_template=PARTS_TEMPLATE) as client:
        tokens = client.post("/tokenize", json={"messages": PARTS}).json()["tokens"]
    assert tokens == Tokenizer.from_dir(folder).encode(want, add_special_tokens=False)


def test_every_server_option_is_a_serve_flag_with_its_default(folder):
    args = build_parser().parse_args(["serve", folder])
    assert {f.name for f in fields(ServerOptions)} <= set(vars(args))
    assert server_options(args, ()) == ServerOptions()
    flags = ["serve", folder, "--drain-timeout", "5", "--allowed-origins", '["https://a"]']
    options = server_options(build_parser().parse_args(flags), ())
    assert (options.drain_timeout_s, options.allowed_origins) == (5.0, ("https://a",))


def vllm_tokenizer_info(folder: str) -> dict:
    """vLLM's /tokenizer_info answer built from transformers' tokenizer: its init_kwargs without
    file paths, objects as their text (an added token's content), with its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    kwargs = {
        name: getattr(value, "content", value)
        for name, value in tokenizer.init_kwargs.items()
        if name not in ("vocab_file", "merges_file", "is_local", "local_files_only", "backend")
    }  # transformers' own loading flags left out: no file holds them
    added = {str(i): token.content for i, token in kwargs.pop("added_tokens_decoder").items()}
    return {**kwargs, "added_tokens_decoder": added, "chat_template": tokenizer.chat_template}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-serialized-tokens"])
def test_tokenizer_info_answers_the_settings_transformers_reads(make_tiny, arch, tmp_path):
    """--enable-tokenizer-info-endpoint: GET /tokenizer_info answers what transformers reads
    from the tokenizer's files (its tokenizer_config.json settings, added tokens by id, chat
    template; a token the file writes as an AddedToken object, as its text) and the class the
    file names; a server's own --chat-template replaces the model's. Off (the default) the
    route is a 404."""
    folder = str(make_tiny(arch.removesuffix("-serialized-tokens")))
    if arch.endswith("-serialized-tokens"):
        folder = shutil.copytree(folder, tmp_path / "model")
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config["bos_token"] = {"__type": "AddedToken", "content": config["bos_token"],
                               "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True}  # fmt: skip
        config_file.write_text(json.dumps(config))
        folder = str(folder)
    args = build_parser().parse_args(["serve", folder, "--enable-tokenizer-info-endpoint"])
    options = server_options(args, ())
    assert options.enable_tokenizer_info_endpoint
    llm = AsyncLLM.from_model(folder, max_model_len=64, **KV_CACHE)
    try:
        with client_of(llm) as client:
            assert client.get("/tokenizer_info").status_code == 404
        with TestClient(build_app(llm, "tiny", options=options)) as client:
            info = client.get("/tokenizer_info").json()
        with client_of(llm, enable_tokenizer_info_endpoint=True, chat_template=TEMPLATE) as client:
            served = client.get("/tokenizer_info").json()
    finally:
        llm.shutdown()
    want = vllm_tokenizer_info(folder)
    assert {name: info.get(name) for name in want} == want
    config = json.loads(Path(folder, "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == config["tokenizer_class"]
    assert served["chat_template"] == TEMPLATE


def test_dev_mode_serves_server_info_and_the_cache_resets(llm, monkeypatch):
    """Under VLLM_SERVER_DEV_MODE=1: GET /server_info answers the engine's settings (as text, or
    as JSON with config_format=json), the VLLM_ variables set (none holding a key) and the
    TANDEM_ switches, and the machine's software as torch's collect_env reports it;
    /reset_mm_cache and /reset_encoder_cache answer 200. Outside dev mode each is a 404."""
    import torch

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv("VLLM_API_KEY_FILE", "secret")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    monkeypatch.setenv("TANDEM_PDL", "0")
    options = server_options(build_parser().parse_args(["serve", "tiny"]), ())
    with client_of(llm) as client:
        assert client.get("/server_info").status_code == 404
        assert client.post("/reset_mm_cache").status_code == 404
    with TestClient(build_app(llm, "tiny", options=options)) as client:
        text = client.get("/server_info").json()
        as_json = client.get("/server_info", params={"config_format": "json"}).json()
        bad = client.get("/server_info", params={"config_format": "yaml"})
        resets = [client.post(path) for path in ("/reset_mm_cache", "/reset_encoder_cache")]
    config = llm.engine.config
    assert text["vllm_config"] == str(config)
    assert as_json["vllm_config"]["model"] == config.model
    assert as_json["vllm_config"]["max_model_len"] == config.max_model_len
    assert text["vllm_env"] == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    assert text["tandem_env"]["TANDEM_PDL"] == "False"
    assert text["system_env"]["torch_version"] == torch.__version__
    assert bad.status_code == 400
    assert [(r.status_code, r.content) for r in resets] == [(200, b"")] * 2
    monkeypatch.setattr(llm.engine.config, "hf_token", "hf_secret")
    with TestClient(build_app(llm, "tiny", options=options)) as client:
        for config_format in ("text", "json"):
            info = client.get("/server_info", params={"config_format": config_format})
            assert "hf_secret" not in info.text and "<hidden>" in info.text


TOOLS_TEMPLATE = (
    "{% if tools %}[{{ tools | length }} tools] {% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)
TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("exclude", [False, True])
def test_tool_choice_none_renders_without_the_tools_when_the_server_excludes_them(
    llm, folder, exclude
):
    """--exclude-tools-when-tool-choice-none: a chat with tool_choice "none" is rendered as if
    it had no tools; "required" keeps them either way."""
    messages = [{"role": "user", "content": "Hi"}]
    options = {"chat_template": TOOLS_TEMPLATE, "exclude_tools_when_tool_choice_none": exclude}
    with client_of(llm, **options) as client:
        ids = {
            choice: client.post("/v1/chat/completions/render", json={
                "messages": messages, "tools": [TOOL], "tool_choice": choice,
                "add_generation_prompt": False,
            }).json()["token_ids"]
            for choice in ("none", "required")
        }  # fmt: skip
    tokenizer = Tokenizer.from_dir(folder)
    with_tools = tokenizer.encode("[1 tools] user: Hi\n", add_special_tokens=False)
    without = tokenizer.encode("user: Hi\n", add_special_tokens=False)
    assert ids == {"none": without if exclude else with_tools, "required": with_tools}


def test_too_many_or_too_large_headers_are_a_431(llm):
    """--h11-max-header-count and --h11-max-incomplete-event-size: past either the request is
    a 431 naming the flag, before the API key is asked; within them it is served."""
    many = {f"x-extra-{i}": "1" for i in range(300)}
    large = {"x-large": "a" * 5000}
    with client_of(llm, api_key="k") as client:
        crowded = client.get("/v1/models", headers=many)
        assert client.get("/v1/models", headers=large).status_code == 401  # within 4 MiB
    assert crowded.status_code == 431
    assert "--h11-max-header-count" in crowded.json()["error"]["message"]
    with client_of(llm, h11_max_header_count=400, h11_max_incomplete_event_size=4096) as client:
        assert client.get("/v1/models", headers=many).status_code == 200
        oversized = client.get("/v1/models", headers=large)
    assert oversized.status_code == 431
    assert "--h11-max-incomplete-event-size" in oversized.json()["error"]["message"]


def test_error_answers_log_their_stack_with_log_error_stack(llm, caplog, monkeypatch):
    """--log-error-stack (on under VLLM_SERVER_DEV_MODE, as vLLM's): an error answer is logged
    with its exception's stack trace; off, it is not."""
    body = {"prompt": "Hi", "max_tokens": -1}
    for log_stack in (False, True):
        caplog.clear()
        with (
            caplog.at_level("ERROR", logger="tandem"),
            client_of(llm, log_error_stack=log_stack) as client,
        ):
            assert client.post("/v1/completions", json=body).status_code == 400
        logged = [r for r in caplog.records if "POST /v1/completions answered 400" in r.message]
        assert len(logged) == log_stack
        assert all(r.exc_info is not None for r in logged)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    assert server_options(build_parser().parse_args(["serve", "tiny"]), ()).log_error_stack


def served(llm, options: ServerOptions):
    """`tandem serve`'s uvicorn config of `options` over the app, run on a thread (running)."""
    return running(None, uvicorn_config(build_app(llm, "tiny", options=options), "127.0.0.1", 0,
                                        options))  # fmt: skip


def test_uds_serves_on_a_unix_socket(llm, tmp_path):
    socket_path = str(tmp_path / "tandem.sock")
    with served(llm, ServerOptions(uds=socket_path)) as served_at:
        assert served_at == socket_path
        with httpx.Client(transport=httpx.HTTPTransport(uds=socket_path)) as client:
            models = client.get("http://tandem/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]


def test_the_access_log_leaves_out_the_quiet_endpoints(llm):
    """--disable-access-log-for-endpoints: the access log has no line for those paths (their
    queries aside), and one for each other request."""
    import logging

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    options = ServerOptions(access_log=True, disable_access_log_for_endpoints="/health, /metrics")
    server = served(llm, options)  # its config set uvicorn's logging up: the handler after it
    keep = Keep()
    logging.getLogger("uvicorn.access").addHandler(keep)
    try:
        with server as url:
            for path in ("/health", "/metrics?x=1", "/v1/models", "/health"):
                httpx.get(f"{url}{path}")
    finally:
        logging.getLogger("uvicorn.access").removeHandler(keep)
    assert len(lines) == 1 and '"GET /v1/models HTTP/1.1" 200' in lines[0]


def test_ssl_ciphers_set_the_tls_context_s_suites(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    self_signed(key, cert, "127.0.0.1")
    suite = "ECDHE-RSA-AES256-GCM-SHA384"
    options = ServerOptions(ssl_keyfile=str(key), ssl_certfile=str(cert), ssl_ciphers=suite)
    config = uvicorn_config(None, "127.0.0.1", 0, options)
    config.load()
    tls12 = [c["name"] for c in config.ssl.get_ciphers() if c["protocol"] == "TLSv1.2"]
    assert tls12 == [suite]


def fingerprints(client, stream_options: dict | None = None) -> tuple[object, list]:
    """A whole chat answer's system_fingerprint, and each chunk's of the same request streamed
    (absent: "-")."""
    body = {"messages": MESSAGES, "max_tokens": 3, "n": 2}
    whole = client.post("/v1/chat/completions", json=body).json()["system_fingerprint"]
    streamed = {
        **body,
        "stream": True,
        **({"stream_options": stream_options} if stream_options else {}),
    }
    with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    return whole, [(c.get("system_fingerprint", "-"), bool(c["choices"]) and
                    c["choices"][0]["finish_reason"] is not None) for c in chunks]  # fmt: skip


def test_system_fingerprint_names_the_version_and_the_engine_s_settings(llm, folder):
    """--fingerprint-mode full (the default): tandem-<version>-<hash8>, the hash of the engine's
    settings (the same for an engine of the same settings, another for other settings); on a
    stream, each choice's last chunk carries it, or the usage chunk alone when one ends it.
    custom: --fingerprint-value; none: null, and no chunk carries it."""
    import re

    from tandem import __version__

    with client_of(llm) as client:
        whole, chunks = fingerprints(client)
        _, with_usage = fingerprints(client, {"include_usage": True})
    assert re.fullmatch(rf"tandem-{re.escape(__version__)}-[0-9a-f]{{8}}", whole)
    assert [f for f, last in chunks if last] == [whole, whole]  # one last chunk per choice
    assert all(f == "-" for f, last in chunks if not last)
    assert [f for f, _ in with_usage if f != "-"] == [whole] and with_usage[-1][0] == whole
    same = AsyncLLM.from_model(folder, max_model_len=128, **KV_CACHE)
    other = AsyncLLM.from_model(folder, max_model_len=96, **KV_CACHE)
    try:
        found = []
        for engine in (same, other):
            with client_of(engine) as client:
                found.append(fingerprints(client)[0])
    finally:
        same.shutdown()
        other.shutdown()
    assert found[0] == whole and found[1] != whole
    with client_of(llm, fingerprint_mode="custom", fingerprint_value="build-7") as client:
        assert fingerprints(client)[0] == "build-7"
    with client_of(llm, fingerprint_mode="none") as client:
        whole, chunks = fingerprints(client)
    assert whole is None and all(f == "-" for f, _ in chunks)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"fingerprint_mode": "short"}, "fingerprint_mode must be one of"),
        ({"fingerprint_mode": "custom"}, "--fingerprint-value goes with"),
        ({"fingerprint_value": "x"}, "--fingerprint-value goes with"),
    ],
)
def test_bad_fingerprint_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        ServerOptions(**options).validate()


def test_per_request_metrics_time_an_answer_of_one_choice(llm):
    """--enable-per-request-metrics: an answer of one choice carries vLLM's "metrics", whose
    times add up within the request's own wall time and agree with each other (the mean gap is
    the generation time over the gaps, the rate the tokens over the time from admission); a
    stream's ride on its usage chunk. Several choices, or the flag off: none."""
    import time

    body = {"prompt": "Hi", "max_tokens": 6, "ignore_eos": True}
    with client_of(llm, enable_per_request_metrics=True) as client:
        began = time.perf_counter()
        answer = client.post("/v1/completions", json=body).json()
        wall_ms = (time.perf_counter() - began) * 1000
        several = client.post("/v1/completions", json={**body, "n": 2}).json()
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=streamed) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]  # fmt: skip
    with client_of(llm) as client:
        plain = client.post("/v1/completions", json=body).json()
    metrics = answer["metrics"]
    tokens = answer["usage"]["completion_tokens"]
    assert tokens == 6 and all(v is not None and v >= 0 for v in metrics.values())
    first, generation = metrics["time_to_first_token_ms"], metrics["generation_time_ms"]
    assert metrics["queue_time_ms"] + first + generation <= wall_ms
    assert metrics["mean_itl_ms"] == pytest.approx(generation / (tokens - 1))
    assert metrics["tokens_per_second"] == pytest.approx(tokens / ((first + generation) / 1000))
    assert "metrics" not in several and "metrics" not in plain
    assert [set(c["metrics"]) for c in chunks if "metrics" in c] == [set(metrics)]
    assert "metrics" in chunks[-1] and chunks[-1]["choices"] == []


def self_signed(key: Path, cert: Path, name: str) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out",
         cert, "-days", "1", "-subj", f"/CN={name}"],
        check=True, capture_output=True,
    )  # fmt: skip


def test_ssl_refresh_serves_the_new_certificate_once_its_files_change(llm, tmp_path):
    """--enable-ssl-refresh: the running server reads the certificate files again when they
    change, and a new connection gets the new certificate; without it, the first stays."""
    import threading
    import time

    from tandem.server.lifecycle import Server

    served_certificates, originals = {}, {}
    for refresh in (True, False):
        key, cert = tmp_path / f"key-{refresh}.pem", tmp_path / f"cert-{refresh}.pem"
        self_signed(key, cert, "first")
        originals[refresh] = cert.read_text()
        options = ServerOptions(ssl_keyfile=str(key), ssl_certfile=str(cert),
                                enable_ssl_refresh=refresh)  # fmt: skip
        app = build_app(llm, "tiny", options=options)
        server = Server(uvicorn_config(app, "127.0.0.1", 0, options), llm, app.state.serving,
                        options)  # fmt: skip
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline
                time.sleep(0.01)
            address = server.servers[0].sockets[0].getsockname()[:2]
            first = ssl.get_server_certificate(address)
            self_signed(tmp_path / "new-key.pem", tmp_path / "new-cert.pem", "second")
            for new, old in (("new-key.pem", key), ("new-cert.pem", cert)):
                os.replace(tmp_path / new, old)
            time.sleep(2.5)  # the files are looked at every second
            served_certificates[refresh] = (first, ssl.get_server_certificate(address))
        finally:
            server.should_exit = True
            thread.join(timeout=10)
    der = ssl.PEM_cert_to_DER_cert
    for refresh, (first, then) in served_certificates.items():
        assert der(first) == der(originals[refresh])
        now = (tmp_path / f"cert-{refresh}.pem").read_text()  # the second certificate
        assert (
            der(then) == der(now if refresh else originals[refresh]) and now != originals[refresh]
        )


def test_one_server_s_flags_are_named_only_where_set():
    """Ray Serve's replicas (--data-parallel-size) take none of one uvicorn server's flags:
    those set are named, a flag left off (False, None) is not."""
    assert ServerOptions().one_server_only() == []
    options = ServerOptions(enable_ssl_refresh=True, uds="/tmp/s", ssl_ciphers="HIGH")
    assert options.one_server_only() == ["--ssl-ciphers", "--uds", "--enable-ssl-refresh"]
