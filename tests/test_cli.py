"""The `tandem` command: make-tiny-model, generate and chat print what the LLM API returns."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tandem import LLM, SamplingParams
from tandem.cli import main

ENGINE_ARGS = {"max_model_len": 128, "block_size": 8}
CLI_ENGINE_ARGS = ["--max-model-len", "128", "--block-size", "8"]
RESULT_LINE = re.compile(r"^--- prompt: (.*)\n(.*)  \[(\w+), (\d+) tokens\]$", re.MULTILINE)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("cli") / "tiny-qwen2"
    with pytest.MonkeyPatch.context() as patch:
        captured = io.StringIO()
        patch.setattr(sys, "stdout", captured)
        main(["make-tiny-model", str(out_dir), "--arch", "qwen2"])
    assert captured.getvalue().strip() == str(out_dir)
    return out_dir


@cache
def reference_llm(folder: Path) -> LLM:
    return LLM(str(folder), **ENGINE_ARGS)


def expected_greedy(folder: Path, prompt: str, max_tokens: int) -> tuple[str, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    [out] = reference_llm(folder).generate(prompt, params, use_tqdm=False)
    return out.outputs[0].text, len(out.outputs[0].token_ids)


def assistant_replies(out: str) -> list[str]:
    """The replies `tandem chat` printed; a reply may itself span lines."""
    return [reply.removesuffix("\n") for reply in re.split(r"^assistant: ", out, flags=re.M)[1:]]


def test_make_tiny_model_writes_a_qwen2_checkpoint_folder(tiny_dir):
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert '"Qwen2ForCausalLM"' in (tiny_dir / "config.json").read_text()


def test_generate_prints_the_greedy_completion_of_each_prompt(tiny_dir, capsys):
    main(["generate", str(tiny_dir), "hello", "--max-tokens", "5", "--quiet", *CLI_ENGINE_ARGS])
    out, err = capsys.readouterr()
    [(prompt, text, reason, num_tokens)] = RESULT_LINE.findall(out)
    expected_text, expected_num = expected_greedy(tiny_dir, "hello", 5)
    assert (prompt, text, int(num_tokens)) == ("'hello'", repr(expected_text), expected_num)
    assert reason in ("length", "stop")
    assert re.search(rf"^1 requests, {expected_num} tokens in [\d.]+ s", out, re.MULTILINE)
    assert "generate:" not in err  # --quiet: no progress bar


def test_generate_prints_every_prompt_in_order(tiny_dir, capsys):
    prompts = ["hello", "The cat reads", "日本"]
    main(["generate", str(tiny_dir), *prompts, "--max-tokens", "3", "--quiet", *CLI_ENGINE_ARGS])
    results = RESULT_LINE.findall(capsys.readouterr().out)
    assert [prompt for prompt, *_ in results] == [repr(p) for p in prompts]
    for (_, text, _, _), prompt in zip(results, prompts, strict=True):
        assert text == repr(expected_greedy(tiny_dir, prompt, 3)[0])


def test_installed_console_script_generates_in_a_real_process(tiny_dir):
    script = shutil.which("tandem", path=str(Path(sys.executable).parent))
    assert script is not None, "the tandem console script is not installed next to python"
    result = subprocess.run(
        [script, "generate", str(tiny_dir), "hello", "--max-tokens", "5", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    [(prompt, text, _, num_tokens)] = RESULT_LINE.findall(result.stdout)
    expected_text, expected_num = expected_greedy(tiny_dir, "hello", 5)
    assert (prompt, text, int(num_tokens)) == ("'hello'", repr(expected_text), expected_num)


@pytest.mark.parametrize(
    ("bad_args", "named"),
    [
        (["--top-p", "2"], "top_p"),
        (["--temperature", "-1"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--block-size", "24"], "block_size"),
        (["--max-model-len", "4096"], "max_model_len"),
    ],
)
def test_generate_with_a_bad_value_exits_non_zero_naming_it(tiny_dir, capsys, bad_args, named):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_dir), "hello", "--quiet", *bad_args])
    message = exit_info.value.code
    assert message not in (0, None)
    assert isinstance(message, str) and message.startswith("tandem: error:")
    assert named in message
    assert RESULT_LINE.search(capsys.readouterr().out) is None


def test_generate_with_a_trace_path_that_is_a_directory_exits_with_a_clean_error(
    tiny_dir, tmp_path, capsys
):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_dir), "hello", "--quiet", "--trace", str(tmp_path)])
    message = exit_info.value.code
    assert isinstance(message, str) and message.startswith("tandem: error:")
    assert str(tmp_path) in message
    assert RESULT_LINE.search(capsys.readouterr().out) is None  # refused before generating


@pytest.mark.parametrize("command", ["throughput", "serve"])
def test_bench_output_in_a_missing_directory_is_refused_before_the_run(
    tiny_dir, tmp_path, capsys, command
):
    target = tmp_path / "no-such-dir" / "report.json"
    model = ["--model", str(tiny_dir)] if command == "throughput" else []
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", command, *model, "--num-prompts", "2", "--output-json", str(target)])
    message = exit_info.value.code
    assert isinstance(message, str) and "does not exist" in message
    assert "tok/s" not in capsys.readouterr().out


def test_generate_with_an_unknown_model_exits_non_zero_listing_presets(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tmp_path / "nothing-here"), "hello"])
    assert "presets:" in str(exit_info.value.code)


def test_generate_with_an_unknown_dtype_is_an_argparse_usage_error(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", str(tiny_dir), "hello", "--dtype", "float8"])
    assert exit_info.value.code == 2
    assert "--dtype" in capsys.readouterr().err


def test_chat_answers_each_line_of_stdin_with_the_conversation_so_far(
    tiny_dir, capsys, monkeypatch
):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there\nWhat is 日本?\n"))
    main(["chat", str(tiny_dir), "--max-tokens", "6", *CLI_ENGINE_ARGS])
    replies = assistant_replies(capsys.readouterr().out)
    assert len(replies) == 2 and all(replies)

    llm = reference_llm(tiny_dir)
    params = SamplingParams(temperature=0, max_tokens=6)
    messages = [{"role": "user", "content": "Hi there"}]
    first = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    messages += [
        {"role": "assistant", "content": first},
        {"role": "user", "content": "What is 日本?"},
    ]
    second = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    assert replies == [first, second]


def test_a_chat_message_the_engine_refuses_is_dropped_and_the_chat_goes_on(
    tiny_dir, capsys, monkeypatch
):
    """A line past max_model_len was the chat's end (the error, exit 1); now it is named and
    dropped, and the next line is answered as if it had not been sent."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("word " * 200 + "\nHi there\n"))
    main(["chat", str(tiny_dir), "--max-tokens", "6", *CLI_ENGINE_ARGS])
    out = capsys.readouterr()
    assert "max_model_len is 128" in out.err and "that message was dropped" in out.err
    params = SamplingParams(temperature=0, max_tokens=6)
    alone = [{"role": "user", "content": "Hi there"}]
    expected = reference_llm(tiny_dir).chat(alone, params, use_tqdm=False)[0].outputs[0].text
    assert assistant_replies(out.out) == [expected]


def test_quick_chat_answers_one_message_under_the_system_prompt(tiny_dir, capsys, monkeypatch):
    """-q (vLLM's --quick): one message answered, stdin never read; --system-prompt is
    --system's vLLM spelling."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("never read\n"))
    main(["chat", str(tiny_dir), "--max-tokens", "6", "--system-prompt", "Be brief.", "-q",
          "Hi there", *CLI_ENGINE_ARGS])  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    params = SamplingParams(temperature=0, max_tokens=6)
    reply = reference_llm(tiny_dir).chat(messages, params, use_tqdm=False)[0].outputs[0].text
    assert capsys.readouterr().out == f"{reply}\n"


def test_chat_stops_at_an_empty_line(tiny_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi there\n\nnever read\n"))
    main(["chat", str(tiny_dir), "--max-tokens", "2", *CLI_ENGINE_ARGS])
    assert len(assistant_replies(capsys.readouterr().out)) == 1


# ---- the parser: version, help, mistakes --------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(Path(__file__).parents[1] / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "tandem.cli", *args], capture_output=True,
                          text=True, env=env, timeout=120)  # fmt: skip


def test_version_is_the_package_version(capsys):
    import importlib.metadata

    import tandem

    assert tandem.__version__ == importlib.metadata.version("tandem")
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"tandem {tandem.__version__}"


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("make-tiny-model", "generate", "chat", "serve", "bench", "trace"):
        assert re.search(rf"^\s+{command}\s+\S", out, re.M), (command, out)


def every_parser():
    """(name, parser) for the top-level parser and every subcommand, nested ones included."""
    import argparse

    from tandem.cli import build_parser

    pending = [("tandem", build_parser())]
    while pending:
        name, parser = pending.pop()
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending += [(f"{name} {sub}", p) for sub, p in action.choices.items()]


def test_every_flag_has_help_that_shows_its_default():
    import argparse

    for name, parser in every_parser():
        assert parser.allow_abbrev is False, name
        help_text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                continue
            flag = action.option_strings[-1] if action.option_strings else action.dest
            assert action.help, f"{name} {flag} has no help"
            if action.default not in (None, argparse.SUPPRESS, [], "") and action.option_strings:
                shown = " ".join(str(action.default).split())
                assert f"default: {shown}" in help_text, f"{name} {flag}: default not shown"


def test_a_misspelt_flag_prints_the_subcommands_usage(tiny_dir):
    result = run_cli("generate", str(tiny_dir), "hi", "--max-tokns", "3")
    assert result.returncode == 2
    assert result.stderr.startswith("usage: tandem generate")
    assert "tandem generate: error: unrecognized arguments: --max-tokns 3" in result.stderr


def test_abbreviated_flags_are_refused(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", str(tiny_dir), "hi", "--max-tok", "3"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --max-tok" in capsys.readouterr().err


def test_serve_on_a_port_past_65535_is_a_one_line_error(tiny_dir):
    result = run_cli("serve", str(tiny_dir), "--port", "99999")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "tandem: error: --port 99999: a port is in 0-65535"
    ]


def test_serve_takes_the_model_as_vllm_s_option_too(tiny_dir):
    result = run_cli("serve", "--model", str(tiny_dir), "--port", "99999")
    assert result.stderr.strip().splitlines() == [
        "tandem: error: --port 99999: a port is in 0-65535"
    ]  # past the parser, as with MODEL given before the flags
    result = run_cli("serve", str(tiny_dir), "--model", str(tiny_dir), "--port", "99999")
    assert "a port is in 0-65535" in result.stderr


def test_serve_takes_vllm_s_deployment_flags_that_ask_for_tandem_s_behaviour():
    from tandem.cli import build_parser, engine_kwargs, server_options

    parser = build_parser()
    plain = parser.parse_args(["serve", "m"])
    flags = ["--enable-chunked-prefill", "--disable-log-requests", "--disable-uvicorn-access-log"]
    args = parser.parse_args(["serve", "m", *flags, "--enable-prompt-tokens-details"])
    assert engine_kwargs(args) == engine_kwargs(plain)
    assert server_options(args, ()) == server_options(plain, ())
    assert (
        not server_options(args, ()).enable_log_requests and not server_options(args, ()).access_log
    )
    args = parser.parse_args(["serve", "m", "--access-log", "--enable-log-requests"])
    assert server_options(args, ()).access_log and server_options(args, ()).enable_log_requests
    args = parser.parse_args(["serve", "m", "--access-log", "--disable-uvicorn-access-log"])
    assert not server_options(args, ()).access_log  # the last one given wins


def parsed(argv: list[str]):
    """argv as main reads it: --config expanded, MODEL or --model resolved."""
    from tandem import config_file
    from tandem.cli import build_parser, resolve_model, subcommand

    parser = build_parser()
    args = parser.parse_args(config_file.expand(argv, subcommand(parser, argv)))
    resolve_model(args)
    return args


def test_a_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: some/model\nmax_num_seqs: 7\nmax-model-len: 512\nenable_prefix_caching: false\n"
        "api_key: [a, b]\nenable_log_requests: true\naccess_log: false\n"
        "compilation_config: {cudagraph_mode: NONE}\nport: 8001\n"
    )
    args = parsed(["serve", "--config", str(config), "--max-num-seqs", "9"])
    assert (args.model, args.max_num_seqs, args.max_model_len, args.port) == (
        "some/model",
        9,
        512,
        8001,
    )
    assert args.enable_prefix_caching is False and args.api_key == ["a", "b"]
    assert args.enable_log_requests is True and args.access_log is False
    assert args.compilation_config == {"cudagraph_mode": "NONE"}
    config.write_text("model: some/model\nmax_num_seqs: 7\nserved_model_name: -dashed-\n")
    args = parsed(["run-batch", f"--config={config}", "-i", "in", "-o", "out"])
    assert (args.model, args.max_num_seqs, args.served_model_name) == (
        "some/model",
        7,
        ["-dashed-"],
    )


def test_a_model_given_first_wins_over_the_config_files_and_no_list_takes_it(tmp_path):
    """vLLM's: the file's flags follow a MODEL given first, so a list the file ends with
    (api_key) stops before it, and the file's own model gives way."""
    config = tmp_path / "serve.yaml"
    config.write_text("model: file/model\nmax_num_seqs: 7\napi_key: [key-a]\n")
    args = parsed(["serve", "cli/model", "--config", str(config), "--port", "8002"])
    assert (args.model, args.api_key, args.max_num_seqs, args.port) == (
        "cli/model",
        ["key-a"],
        7,
        8002,
    )
    config.write_text("api_key: [key-a, key-b]\n")  # the README's form, last in the file
    args = parsed(["serve", "cli/model", "--config", str(config)])
    assert (args.model, args.api_key) == ("cli/model", ["key-a", "key-b"])


def test_vllm_api_key_in_the_environment_is_the_key_unless_the_flag_gives_one(monkeypatch):
    from tandem.cli import build_parser, server_options

    monkeypatch.setenv("VLLM_API_KEY", "secret")
    parser = build_parser()
    assert server_options(parser.parse_args(["serve", "m"]), ()).api_key == "secret"
    flagged = parser.parse_args(["serve", "m", "--api-key", "mine"])
    assert server_options(flagged, ()).api_key == ("mine",)
    monkeypatch.delenv("VLLM_API_KEY")
    assert server_options(parser.parse_args(["serve", "m"]), ()).api_key is None


def test_flags_spelt_with_underscores_and_vllms_short_flags_parse(tiny_dir):
    from tandem.cli import build_parser, dashed

    argv = ["serve", "m", "--max_num_seqs", "8", "--max_model_len=64", "-tp", "2", "-pp", "1"]
    args = build_parser().parse_args([dashed(a) for a in argv])
    assert (args.max_num_seqs, args.max_model_len, args.tensor_parallel_size) == (8, 64, 2)
    assert dashed("--chat_template=a_b") == "--chat-template=a_b"  # the value is kept
    result = run_cli("serve", str(tiny_dir), "--max_num_seqs", "0", "--device", "cpu")
    assert "max_num_seqs" in result.stderr  # reached the engine's check: the flag was read


@pytest.mark.parametrize(
    ("text", "words"),
    [("max_num_seqs: [1\n", "no YAML"), ("- a\n- b\n", "a mapping of flag names"),
     ("model: m\nmax_num_seq: 4\n", "unrecognized arguments: --max-num-seq=4"),
     ("config: other.yaml\n", "cannot name another")],
)  # fmt: skip
def test_a_bad_config_file_is_a_one_line_error(tmp_path, text, words):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    result = run_cli("serve", "--config", str(config), "--port", "99999")
    assert result.returncode in (1, 2) and words in result.stderr.strip().splitlines()[-1]


def test_no_chunked_prefill_is_a_one_line_error_naming_it(tiny_dir):
    result = run_cli("serve", str(tiny_dir), "--no-enable-chunked-prefill", "--device", "cpu")
    assert result.returncode == 1
    assert "enable_chunked_prefill=False is not supported" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["serve"], "required: model (MODEL or --model MODEL)"),
        (["serve", "a", "--model", "b"], "two models given: 'a' and --model 'b'"),
        (["run-batch", "-i", "in", "-o", "out"], "required: model (MODEL or --model MODEL)"),
    ],
)
def test_serve_and_run_batch_need_one_model(argv, words, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: tandem {argv[0]}") and words in err


def test_enforce_eager_reaches_the_engine_as_vllms_flag():
    from tandem.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(
        ["generate", "m", "x", "--enforce-eager", "--trust-remote-code"]
    )
    assert engine_kwargs(args)["enforce_eager"] is engine_kwargs(args)["trust_remote_code"] is True
    args = build_parser().parse_args(["serve", "m"])
    assert engine_kwargs(args)["enforce_eager"] is False


@pytest.mark.parametrize(
    ("text", "value"),
    [("4096", 4096), ("32k", 32000), ("1K", 1024), ("25.6k", 25600), ("1m", 10**6),
     ("16.1k", 16100), ("32.7k", 32700)],
)  # fmt: skip
def test_max_model_len_takes_vllms_human_readable_lengths(text, value):
    from tandem.cli import build_parser

    assert build_parser().parse_args(["serve", "m", "--max-model-len", text]).max_model_len == value


@pytest.mark.parametrize("text", ["auto", "AUTO", "-1"])
def test_vllms_fit_to_the_kv_cache_is_minus_one(text):
    """vLLM's --max-model-len auto / -1: the longest the KV cache holds (test_engine_args.py)."""
    from tandem.cli import build_parser

    assert build_parser().parse_args(["serve", "m", "--max-model-len", text]).max_model_len == -1


@pytest.mark.parametrize("text", ["1.5", "0.0001k", "k", "nank", "infk"])
def test_a_length_that_is_no_whole_number_is_a_usage_error(text):
    result = run_cli("serve", "m", "--max-model-len", text)
    assert result.returncode == 2 and "--max-model-len" in result.stderr
