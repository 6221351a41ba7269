"""`tandem run-batch` on one engine: OpenAI batch lines in, response lines out, resumable.

Answers are checked against the offline `LLM` (greedy and seeded sampling do not depend on the
batch); bad lines against the error the HTTP server gives for the same body.
"""

from __future__ import annotations

import argparse
import codecs
import json
import runpy
import sys
from pathlib import Path

import httpx
import pytest

from tandem import LLM, SamplingParams
from tandem.batch_file import parse_line, read_batch_file, resume_output
from tandem.cli import main

ENGINE_ARGS = ["--max-model-len", "256", "--block-size", "8", "--num-blocks", "128"]
ENGINE_KWARGS = {"max_model_len": 256, "block_size": 8, "num_blocks": 128}
MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Name a cache."}]


def request(custom_id: str, body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


GOOD = {
    "greedy": ({"model": MODEL, "prompt": "The engine", "max_tokens": 8, "temperature": 0}, None),
    "seeded": ({"prompt": "Once upon", "max_tokens": 9, "temperature": 0.9, "seed": 7}, None),
    # "false" as text: no stream, as the server reads it
    "ids": ({"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "stream": "false"}, None),
    "chat": ({"messages": MESSAGES, "max_tokens": 6, "temperature": 0}, "/v1/chat/completions"),
    # vLLM's pooling urls of a batch file
    "embed": ({"input": "Name a cache."}, "/v1/embeddings"),
    "score": ({"text_1": "a cache", "text_2": ["a memory", "a cat"]}, "/v1/score"),
    "rerank": ({"query": "a cache", "documents": ["a memory", "a cat"]}, "/v1/rerank"),
}
BAD_BODIES = {  # custom_id -> (body, the param its 400 names)
    "negative-temperature": ({"prompt": "x", "temperature": -1}, "temperature"),
    "unsupported": ({"prompt": "x", "best_of": 3}, "best_of"),
    "other-model": ({"prompt": "x", "model": "gpt-4o"}, "model"),
    "no-prompt": ({"max_tokens": 3}, "prompt"),
    # bodies httpx's own JSON encoder refuses: they reach the app, which answers each alone
    "nan-temperature": ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    "lone-surrogate": ({"prompt": "a \ud800 b"}, "prompt"),
}
BAD_LINES = [  # (line, custom_id it keeps)
    (request("moderations", {"input": "x"}, url="/v1/moderations"), "moderations"),
    (
        json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}}),
        "get",
    ),
    (request("streamed", {"prompt": "x", "stream": True}), "streamed"),
    (request("streamed-text", {"prompt": "x", "stream": "true"}), "streamed-text"),
    ('{"custom_id": "torn", "method": ', None),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), None),
    ("[1, 2]", None),
    ("[" * 100_000, None),  # nested past the json decoder's recursion limit
]


def write_batch(path: Path) -> Path:
    lines = [request(cid, body, url or "/v1/completions") for cid, (body, url) in GOOD.items()]
    lines += [request(cid, body) for cid, (body, _) in BAD_BODIES.items()]
    lines += [line for line, _ in BAD_LINES]
    lines.insert(3, "")  # blank lines are no requests
    path.write_text("\n".join(lines) + "\n")
    return path


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


NUM_LINES = len(GOOD) + len(BAD_BODIES) + len(BAD_LINES)


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> Path:
    return write_batch(tmp_path_factory.mktemp("batch") / "requests.jsonl")


@pytest.fixture(scope="module")
def answered(folder, batch, tmp_path_factory) -> Path:
    """The batch answered by `tandem run-batch` from an empty output file."""
    out = tmp_path_factory.mktemp("batch") / "results.jsonl"
    argv = ["run-batch", folder, "-i", str(batch), "-o", str(out), "--quiet", *ENGINE_ARGS]
    main([*argv, "--served-model-name", MODEL, "--device", "cpu"])
    return out


def check_answers(lines: list[dict], folder: str) -> None:
    """Every line of the batch answered once: good ones as the offline LLM, bad ones as errors."""
    ids = [line["custom_id"] for line in lines]
    named = [i for i in ids if i is not None]
    assert len(lines) == NUM_LINES and len(named) == len(set(named))
    assert ids.count(None) == sum(cid is None for _, cid in BAD_LINES)
    by_id = {line["custom_id"]: line for line in lines if line["custom_id"] is not None}
    assert set(by_id) == set(GOOD) | set(BAD_BODIES) | {c for _, c in BAD_LINES if c}

    llm = LLM(folder, **ENGINE_KWARGS)
    for cid in ("greedy", "seeded", "ids"):
        body = GOOD[cid][0]
        prompt = body["prompt"]
        params = {k: body[k] for k in ("max_tokens", "temperature", "seed") if k in body}
        prompt = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        [want] = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs
        line = by_id[cid]
        assert line["error"] is None and line["response"]["status_code"] == 200
        choice = line["response"]["body"]["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (want.text, want.finish_reason)
        assert line["response"]["request_id"] == line["response"]["body"]["id"]
    [want_chat] = llm.chat(MESSAGES, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["content"] == want_chat.outputs[0].text
    [want_embedding] = llm.embed("Name a cache.", use_tqdm=False)
    embedding = by_id["embed"]["response"]["body"]["data"][0]["embedding"]
    assert embedding == pytest.approx(want_embedding.outputs.embedding, abs=1e-6)
    want_scores = [o.outputs.score for o in llm.score("a cache", ["a memory", "a cat"])]
    scores = [d["score"] for d in by_id["score"]["response"]["body"]["data"]]
    assert scores == pytest.approx(want_scores, abs=1e-6)
    ranked = by_id["rerank"]["response"]["body"]["results"]
    assert {r["index"]: r["relevance_score"] for r in ranked} == pytest.approx(
        dict(enumerate(want_scores)), abs=1e-6
    )

    for cid, (_, param) in BAD_BODIES.items():
        line = by_id[cid]
        # an unknown model is a 404 (model_not_found), as from the server; the rest 400s
        assert line["response"]["status_code"] == (404 if param == "model" else 400), line
        assert line["response"]["body"]["error"]["param"] == param
        assert line["error"]["message"] == line["response"]["body"]["error"]["message"]
    for line in lines:
        if line["custom_id"] is None or line["custom_id"] in {c for _, c in BAD_LINES}:
            assert line["response"] is None
            assert line["error"]["code"] == "invalid_batch_line"


def test_every_line_is_answered_once_good_ones_as_the_offline_llm(answered, folder):
    check_answers(read_output(answered), folder)


def test_bad_lines_say_which_line_and_what_is_wrong(batch):
    errors = [b["error"]["message"] for b in read_batch_file(batch).bad_lines]
    first_bad_line = len(GOOD) + len(BAD_BODIES) + 2  # after them and one blank line
    assert errors[0].startswith(f"line {first_bad_line}: url must be one of")
    assert any("is not valid JSON" in e for e in errors)
    assert any("custom_id must be a string" in e for e in errors)
    assert any("body.stream must be false" in e for e in errors)


def test_a_line_is_read_alone_whatever_its_bytes(tmp_path):
    """A "\r" inside a line is JSON whitespace, not a line end; a line that is not UTF-8 is a
    bad line of its own, not the end of the file."""
    good = request("cr", {"prompt": "x"}).replace('"method"', '\r"method"')
    path = tmp_path / "in.jsonl"
    path.write_bytes(good.encode() + b"\n" + b'{"custom_id": "\xff"}\n' + request("b", {}).encode())
    batch = read_batch_file(path)
    assert [r.custom_id for r in batch.requests] == ["cr", "b"]
    [bad] = batch.bad_lines
    assert bad["error"]["message"].startswith("line 2 is not UTF-8 text")


def test_a_file_that_starts_with_a_byte_order_mark_reads_its_first_line(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(codecs.BOM_UTF8 + (request("a", {}) + "\n" + request("b", {})).encode())
    batch = read_batch_file(path)
    assert [r.custom_id for r in batch.requests] == ["a", "b"] and not batch.bad_lines


def test_only_output_lines_count_as_finished_and_a_pipe_is_not_read_back(batch, tmp_path):
    """An output path holding request lines (the input itself, by mistake) answers nothing; a
    path that is no regular file (/dev/stdout) is not read before the run writes to it."""
    same = tmp_path / "same.jsonl"
    same.write_text(batch.read_text())
    assert resume_output(same).custom_ids == set()
    assert resume_output("/dev/null").custom_ids == set()


def test_repeated_custom_ids_reject_the_file(tmp_path):
    path = tmp_path / "twice.jsonl"
    path.write_text(request("a", {"prompt": "x"}) + "\n" + request("a", {"prompt": "y"}) + "\n")
    with pytest.raises(ValueError, match="custom_id must be unique; repeated: \\['a'\\]"):
        read_batch_file(path)


def test_a_well_formed_line_parses_to_its_request():
    parsed = parse_line(request("x", {"prompt": "hi"}), 1)
    assert (parsed.custom_id, parsed.url, parsed.body) == ("x", "/v1/completions", {"prompt": "hi"})


def interrupted_copy(answered: Path, path: Path, num_kept: int) -> list[dict]:
    """`answered` as a run killed mid-write would leave it, one kept line a server error."""
    lines = answered.read_text().splitlines(keepends=True)
    kept = [json.loads(line) for line in lines[:num_kept]]
    kept[0]["response"] = {"status_code": 500, "request_id": "r", "body": {"error": {}}}
    text = "".join(json.dumps(line) + "\n" for line in kept)
    path.write_text(text + lines[num_kept][: len(lines[num_kept]) // 2])
    return kept


def test_resume_answers_only_what_the_output_lacks(answered, batch, folder, tmp_path):
    out = tmp_path / "results.jsonl"
    kept = interrupted_copy(answered, out, num_kept=6)
    finished = resume_output(out)
    assert len(finished.custom_ids) + finished.num_id_less == 5  # the 500 and the torn line go
    assert out.read_text().endswith("\n")
    argv = ["run-batch", folder, "-i", str(batch), "-o", str(out), "--quiet", *ENGINE_ARGS]
    main([*argv, "--served-model-name", MODEL, "--device", "cpu"])
    lines = read_output(out)
    check_answers(lines, folder)
    assert [line["id"] for line in lines[:5]] == [line["id"] for line in kept[1:]]  # not redone
    assert kept[0]["id"] not in {line["id"] for line in lines}  # the 500 was asked again


def test_a_finished_output_is_left_as_it_is(answered, batch, folder, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    out.write_text(answered.read_text())
    main(["run-batch", folder, "-i", str(batch), "-o", str(out), "--quiet", *ENGINE_ARGS])
    assert out.read_text() == answered.read_text()
    printed = capsys.readouterr()  # on stderr: an output on stdout stays JSON lines
    assert "results.jsonl: 0 lines, 0 completion tokens" in printed.err and not printed.out


def test_the_model_may_be_given_as_vllm_s_model_option(answered, batch, folder, tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    out.write_text(answered.read_text())
    main(
        ["run-batch", "--model", folder, "-i", str(batch), "-o", str(out), "--quiet", *ENGINE_ARGS]
    )
    assert out.read_text() == answered.read_text()
    assert "results.jsonl: 0 lines, 0 completion tokens" in capsys.readouterr().err


def test_benchmark_batch_file_holds_the_bench_workloads_requests(tmp_path, monkeypatch):
    from tandem.bench import load_workload
    from tandem.config import ModelConfig
    from tandem.model.loader import read_hf_config

    path = tmp_path / "small.jsonl"
    argv = ["-o", str(path), "--model", "qwen3-0.6b", "--input-len", "50", "--output-len", "40"]
    argv += ["--range-ratio", "0.5", "--num-prompts", "5"]
    script = Path(__file__).parents[1] / "benchmarks" / "batch_requests.py"
    monkeypatch.setattr(sys, "argv", ["batch_requests.py", *argv])
    runpy.run_path(str(script), run_name="__main__")
    batch = read_batch_file(path)
    assert batch.bad_lines == []
    bench_args = argparse.Namespace(
        dataset="random", input_len=50, output_len=40, range_ratio=0.5, num_prompts=5, seed=0,
        shared_prefix_len=0, n=1,
    )  # fmt: skip
    cfg = ModelConfig.from_hf(read_hf_config("qwen3-0.6b")[0])
    workload = load_workload(bench_args, cfg, None)
    assert [r.body["prompt"] for r in batch.requests] == workload.prompts
    assert [r.body["max_tokens"] for r in batch.requests] == workload.output_lens
    assert all(r.body["ignore_eos"] for r in batch.requests)


@pytest.mark.parametrize("command", ["run-batch", "serve"])
def test_a_data_parallel_size_below_one_is_refused_before_any_engine(
    folder, batch, tmp_path, command
):
    argv = [command, folder, "--data-parallel-size", "0"]
    if command == "run-batch":
        argv += ["-i", str(batch), "-o", str(tmp_path / "out.jsonl")]
    with pytest.raises(SystemExit, match="--data-parallel-size must be >= 1, got 0"):
        main(argv)
    assert not (tmp_path / "out.jsonl").exists()


def test_lines_are_written_in_the_input_s_order(answered, batch):
    """As vLLM's: each output line at its input line's place, whatever finished first."""
    wanted = [*GOOD, *BAD_BODIES, *(cid for _, cid in BAD_LINES)]
    assert [line["custom_id"] for line in read_output(answered)] == wanted


def test_run_batch_takes_vllm_s_answer_flags(folder, tmp_path, monkeypatch, capfd):
    """Several served names (answers carry the first), the chat answer's role, request lines
    logged with their prompt cut to --max-log-len, and Prometheus metrics served at --url and
    --port while the batch runs."""
    from tandem.run_batch import OutputWriter
    from test_serve_process import free_port

    batch = tmp_path / "requests.jsonl"
    chat = {"model": "alias", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    lines = [
        request("chat", chat, url="/v1/chat/completions"),
        request("text", {"model": MODEL, "prompt": "The engine", "max_tokens": 3}),
    ]
    batch.write_text("\n".join(lines) + "\n")
    port, scraped = free_port(), []
    write = OutputWriter.write

    def scrape_then_write(self, line):
        if not scraped:  # the run's metrics, from its HTTP server, while it runs
            scraped.append(httpx.get(f"http://127.0.0.1:{port}/metrics").text)
        write(self, line)

    monkeypatch.setattr(OutputWriter, "write", scrape_then_write)
    out = tmp_path / "results.jsonl"
    main(["run-batch", folder, "-i", str(batch), "-o", str(out), "--quiet", *ENGINE_ARGS,
          "--served-model-name", MODEL, "alias", "--response-role", "bot",
          "--enable-log-requests", "--max-log-len", "4", "--enable-prompt-tokens-details",
          "--enable-force-include-usage", "--enable-metrics", "--url", "127.0.0.1",
          "--port", str(port)])  # fmt: skip
    answers = {line["custom_id"]: line["response"]["body"] for line in read_output(out)}
    assert [answers["chat"]["model"], answers["text"]["model"]] == [MODEL, MODEL]
    assert answers["chat"]["choices"][0]["message"]["role"] == "bot"
    assert "prompt 'The '" in capfd.readouterr().err
    assert f'tandem_kv_cache_usage_perc{{model_name="{MODEL}"}}' in scraped[0]
    with pytest.raises(httpx.TransportError):  # served while the batch runs only
        httpx.get(f"http://127.0.0.1:{port}/metrics")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "9000"], "--port: where --enable-metrics serves"),
        (["--enable-metrics", "--port", "70000"], "a port is in 0-65535"),
        (["--max-log-len", "-1"], "max_log_len must be"),
    ],
)
def test_bad_run_batch_flags_end_the_command_with_one_line(
    folder, batch, tmp_path, flags, message, capsys
):
    argv = ["run-batch", folder, "-i", str(batch), "-o", str(tmp_path / "out.jsonl"), *flags]
    with pytest.raises(SystemExit) as exit:
        main(argv)
    said = f"{capsys.readouterr().err}{exit.value.code}"
    assert message in said, said
    assert not (tmp_path / "out.jsonl").exists()


def test_output_tmp_dir_is_taken_and_a_local_output_file_is_written_in_place(folder, tmp_path):
    """vLLM's --output-tmp-dir stages an output URL's file before its upload; a local output
    file is written where -o says and the directory is left alone, as vLLM's run-batch does."""
    body = {"model": MODEL, "prompt": "The engine", "max_tokens": 6, "temperature": 0}
    batch = tmp_path / "requests.jsonl"
    batch.write_text(request("greedy", body) + "\n")
    staging = tmp_path / "staging"
    staging.mkdir()
    out = tmp_path / "results.jsonl"
    main(["run-batch", folder, "-i", str(batch), "-o", str(out), "--quiet", *ENGINE_ARGS,
          "--served-model-name", MODEL, "--output-tmp-dir", str(staging)])  # fmt: skip
    [line] = read_output(out)
    llm = LLM(folder, **ENGINE_KWARGS)
    params = SamplingParams(max_tokens=6, temperature=0)
    [want] = llm.generate("The engine", params, use_tqdm=False)[0].outputs
    assert line["response"]["body"]["choices"][0]["text"] == want.text
    assert list(staging.iterdir()) == []


@pytest.mark.parametrize("flag", ["-i", "-o"])
def test_a_url_input_or_output_is_refused_before_any_engine(folder, batch, tmp_path, flag, capsys):
    """vLLM's run-batch GETs an http(s) input and PUTs its output to one; tandem's says it reads
    and writes local files, with nothing written."""
    files = {"-i": str(batch), "-o": str(tmp_path / "out.jsonl")}
    files[flag] = "https://storage.example/batch.jsonl"
    argv = ["run-batch", folder, "-i", files["-i"], "-o", files["-o"]]
    with pytest.raises(SystemExit) as exit:
        main(argv)
    said = f"{capsys.readouterr().err}{exit.value.code}"
    assert (
        "https://storage.example/batch.jsonl: tandem's run-batch reads and writes local files"
        in said
    )
    assert not (tmp_path / "out.jsonl").exists()
