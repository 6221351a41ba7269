"""vLLM's terminal clients of a running server: `tandem chat` without a MODEL (a conversation)
and `tandem complete` (prompts), each answer streamed from a real server on a local port and
checked against the same request answered whole; `tandem collect-env`."""

from __future__ import annotations

import io
import sys

import httpx
import pytest

from tandem.async_llm import AsyncLLM
from tandem.cli import main
from tandem.server.app import build_app
from test_server import running

API_KEY = "sk-test"
# greedy, so that a streamed answer and the same request answered whole agree
ENGINE_ARGS = {
    "max_model_len": 256,
    "kv_cache_memory_bytes": 32 << 20,  # beside other engines on a GPU
    "override_generation_config": {"temperature": 0, "max_new_tokens": 8},
}


@pytest.fixture(scope="module")
def url(make_tiny):
    llm = AsyncLLM.from_model(str(make_tiny("qwen2")), **ENGINE_ARGS)
    with running(build_app(llm, ["tiny", "tiny-alias"], api_key=API_KEY)) as root:
        yield f"{root}/v1"
    llm.shutdown()


def answered(url: str, path: str, body: dict) -> dict:
    response = httpx.post(
        f"{url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    )
    assert response.status_code == 200, response.text
    return response.json()


def run(argv: list[str], monkeypatch, capsys, stdin: str = "") -> str:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    main(argv)
    return capsys.readouterr().out


def test_chat_with_a_server_carries_the_conversation(url, monkeypatch, capsys):
    """Each stdin line is a user message; every request holds the conversation so far (the
    system prompt, the earlier messages and replies), as the whole answers to the same
    requests show."""
    out = run(["chat", "--url", url, "--api-key", API_KEY, "--system-prompt", "Be brief."],
              monkeypatch, capsys, stdin="Hi there\nAnd then?\n")  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}]
    replies = []
    for line in ("Hi there", "And then?"):
        messages.append({"role": "user", "content": line})
        body = {"model": "tiny", "messages": messages}
        reply = answered(url, "/chat/completions", body)["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    assert replies[0] and replies[1]
    assert out == (
        "Using model: tiny\nPlease enter a message for the chat model:\n"
        f"> {replies[0]}\n> {replies[1]}\n> \n"
    )


def test_quick_chat_answers_one_message_and_stats_count_the_tokens(url, monkeypatch, capsys):
    """-q answers one message and exits; --model-name picks a served name; --stats prints the
    time to the first token and the tokens per second by the server's usage count."""
    argv = ["chat", "--url", url, "--api-key", API_KEY, "--model-name", "tiny-alias", "-q", "Hi",
            "--stats"]  # fmt: skip
    out = run(argv, monkeypatch, capsys)
    whole = answered(url, "/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "Hi"}]})  # fmt: skip
    reply, tokens = whole["choices"][0]["message"]["content"], whole["usage"]["completion_tokens"]
    lines = out.splitlines()
    assert lines[:2] == ["Using model: tiny-alias", reply]
    assert lines[2].startswith("TTFT: ") and lines[2].endswith(" ms")
    assert lines[3].startswith("TPS:") and f"({tokens} tokens in " in lines[3]


def test_complete_streams_each_prompt_s_completion(url, monkeypatch, capsys):
    """Each stdin line is completed on its own, at most --max-tokens tokens."""
    argv = ["complete", "--url", url, "--api-key", API_KEY, "--max-tokens", "6"]
    out = run(argv, monkeypatch, capsys, stdin="Once upon\nThe fox\n")
    texts = [
        answered(url, "/completions", {"model": "tiny", "prompt": p, "max_tokens": 6})
        ["choices"][0]["text"]
        for p in ("Once upon", "The fox")
    ]  # fmt: skip
    assert out == (
        f"Using model: tiny\nPlease enter a prompt to complete:\n> {texts[0]}\n> {texts[1]}\n> \n"
    )
    quick = run([*argv, "-q", "The fox"], monkeypatch, capsys)
    assert quick == f"Using model: tiny\n{texts[1]}\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--api-key", "wrong"], "/models: 401"),
        (["--model-name", "nope"], "/chat/completions: 404"),
        (["--temperature", "0.5"], "--temperature: with no MODEL the server's settings answer"),
    ],
)
def test_a_bad_key_model_or_engine_flag_ends_the_chat_with_one_line(url, monkeypatch, capsys,
                                                                    argv, message):  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        run(["chat", "--url", url, "--api-key", API_KEY, *argv, "-q", "Hi"], monkeypatch, capsys)
    assert message in str(exit_.value)


def test_an_unreachable_server_or_a_model_with_server_flags_is_one_line(make_tiny):
    with pytest.raises(SystemExit) as exit_:
        main(["complete", "--url", "http://127.0.0.1:9/v1", "-q", "Hi"])
    assert str(exit_.value).startswith("tandem: error: http://127.0.0.1:9/v1/models: ")
    with pytest.raises(SystemExit) as exit_:
        main(["chat", str(make_tiny("qwen2")), "--url", "http://127.0.0.1:9/v1", "-q", "Hi"])
    assert "--url: a running server's; MODEL is loaded here" in str(exit_.value)


def test_collect_env_reports_torch_and_tandem(capsys):
    import torch

    from tandem import __version__

    main(["collect-env"])
    out = capsys.readouterr().out
    assert f"PyTorch version: {torch.__version__}" in out
    assert out.rstrip().endswith(f"tandem version: {__version__}")


def test_a_message_the_server_refuses_is_dropped_and_the_chat_goes_on(url, monkeypatch, capsys):
    """A message past max_model_len is a 400: said on stderr, left out of the conversation, and
    the next message is answered as if it had not been sent."""
    long_line = "word " * 300
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{long_line}\nHi there\n"))
    main(["chat", "--url", url, "--api-key", API_KEY])
    out, err = capsys.readouterr()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}]}
    reply = answered(url, "/chat/completions", body)["choices"][0]["message"]["content"]
    assert out.endswith(f":\n> > {reply}\n> \n")  # the refused message's prompt answered by none
    assert "/chat/completions: 400 " in err and "that message was dropped" in err
