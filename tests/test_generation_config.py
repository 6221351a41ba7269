"""The model's recommended sampling defaults (generation_config.json), as vLLM applies them: to
`LLM.generate` without SamplingParams and to the fields a server request leaves out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.cli import build_parser
from tandem.generation_config import sampling_defaults
from tandem.server.app import build_app

ENGINE_ARGS = {"max_model_len": 256, "block_size": 8}
PROMPT = "Our scheduler reads"
# a creator's recommendation; top_k 50 and repetition_penalty 1.0 are transformers' defaults
RECOMMENDED = {
    "temperature": 0.0,
    "top_p": 0.9,
    "top_k": 50,
    "repetition_penalty": 1.0,
    "max_new_tokens": 5,
    "do_sample": True,
}


def with_generation_config(folder: Path, out: Path, config: dict) -> Path:
    shutil.copytree(folder, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return out


@pytest.fixture(scope="module")
def recommended(make_tiny, tmp_path_factory) -> Path:
    return with_generation_config(
        make_tiny("llama"), tmp_path_factory.mktemp("gen") / "tiny", RECOMMENDED
    )


def test_only_the_sampling_fields_that_differ_from_transformers_defaults_count(recommended):
    assert sampling_defaults(recommended) == {"temperature": 0.0, "top_p": 0.9, "max_tokens": 5}
    assert sampling_defaults(recommended, "vllm") == {}
    assert sampling_defaults(None) == {}  # a preset with dummy weights has no folder
    assert sampling_defaults(Path("/nowhere"), str(recommended)) == sampling_defaults(recommended)
    assert sampling_defaults(recommended, override={"top_k": 20, "max_new_tokens": 7}) == {
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 7,
    }


def test_an_override_ignores_other_keys_and_a_null_drops_the_models_default(recommended):
    """As vLLM's get_diff_sampling_param: do_sample and max_tokens are no sampling fields of a
    generation config; temperature null leaves SamplingParams' own temperature."""
    override = {"temperature": None, "top_k": 20, "do_sample": False, "max_tokens": 3}
    assert sampling_defaults(recommended, override=override) == {
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 5,
    }
    llm = LLM(str(recommended), override_generation_config=override, **ENGINE_ARGS)
    try:
        defaults = SamplingParams(top_p=0.9, top_k=20, max_tokens=5)
        assert llm.get_default_sampling_params() == defaults
        [output] = llm.generate(PROMPT, use_tqdm=False)[0].outputs
        assert len(output.token_ids) == 5  # the model's max_new_tokens, not the override's 3
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("generation_config", "override", "match"),
    [
        ("greedy", None, "generation_config must be"),
        ("auto", [("temperature", 0.5)], "override_generation_config takes a dict"),
        ("auto", {"temperature": -1.0}, "sampling defaults"),
    ],
)
def test_bad_generation_configs_are_value_errors(recommended, generation_config, override, match):
    with pytest.raises(ValueError, match=match):
        sampling_defaults(recommended, generation_config, override)


def test_a_config_file_that_is_not_a_json_object_is_a_value_error(tmp_path):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        sampling_defaults(tmp_path)


def test_generate_without_params_samples_with_the_models_defaults(recommended):
    llm = LLM(str(recommended), **ENGINE_ARGS)
    assert llm.get_default_sampling_params() == SamplingParams(
        temperature=0.0, top_p=0.9, max_tokens=5
    )
    greedy = SamplingParams(temperature=0.0, top_p=0.9, max_tokens=5)
    want = llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids == want
    llm.shutdown()
    neutral = LLM(str(recommended), generation_config="vllm", **ENGINE_ARGS)
    assert neutral.get_default_sampling_params() == SamplingParams()
    neutral.shutdown()


def test_the_server_fills_the_fields_a_request_leaves_out_with_the_models_defaults(recommended):
    offline = LLM(str(recommended), **ENGINE_ARGS)
    greedy = SamplingParams(temperature=0.0, top_p=0.9, max_tokens=5)
    want = offline.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].text
    offline.shutdown()
    llm = AsyncLLM.from_model(str(recommended), **ENGINE_ARGS)
    try:
        with TestClient(build_app(llm, "tiny")) as client:
            answer = client.post("/v1/completions", json={"prompt": PROMPT}).json()
            assert answer["choices"][0]["text"] == want  # greedy, 5 tokens: the model's
            assert answer["usage"]["completion_tokens"] == 5
            # a field the request gives wins over the model's default
            body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
            assert (
                client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 2
            )
            chat = {"messages": [{"role": "user", "content": "Hi"}]}
            assert (
                client.post("/v1/chat/completions", json=chat).json()["usage"]["completion_tokens"]
                <= 5
            )
    finally:
        llm.shutdown()


def test_the_command_line_takes_the_generation_config_flags():
    args = build_parser().parse_args(
        [
            "serve",
            "m",
            "--generation-config",
            "vllm",
            "--override-generation-config",
            '{"top_k": 5}',
        ]
    )
    assert (args.generation_config, args.override_generation_config) == ("vllm", {"top_k": 5})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--override-generation-config", "[1]"])
