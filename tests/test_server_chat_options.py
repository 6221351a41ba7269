"""The server's chat flags (vLLM's): --chat-template (a file or the template itself),
--trust-request-chat-template for a request's own chat_template, --response-role and
--default-chat-template-kwargs; each checked against transformers' rendering of the template."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tandem.async_llm import AsyncLLM
from tandem.cli import build_parser
from tandem.server.app import build_app
from tandem.server.options import ServerOptions
from tandem.tokenizer import Tokenizer

# reads a variable the server's defaults set and a request may override
TEMPLATE = (
    "{% for m in messages %}[{{ tone }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}bot:{% endif %}"
)
OTHER_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@pytest.fixture(scope="module")
def llm(folder):
    llm = AsyncLLM.from_model(folder, max_model_len=128)
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


def test_the_cli_reads_a_template_file_or_the_template_itself(tmp_path, folder):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    parser = build_parser()
    for value in (str(path), TEMPLATE):
        args = parser.parse_args(["serve", folder, "--chat-template", value])
        assert args.chat_template == TEMPLATE
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
