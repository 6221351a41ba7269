"""Models and tokenizers named by a Hugging Face Hub repository id (vLLM's `LLM("org/name")`),
with `revision`, `tokenizer_revision` and `download_dir`: read from a Hub cache laid out as
huggingface_hub lays it out, offline (conftest sets HF_HUB_OFFLINE)."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub
import pytest

from tandem import LLM, SamplingParams
from tandem.cli import build_parser, engine_kwargs

ENGINE_ARGS = {"max_model_len": 64, "device": "cpu"}
MAIN, V2 = "a" * 40, "b" * 40  # two commits of the repository


def cache_repo(cache: Path, repo_id: str, commits: dict[str, tuple[str, Path]]) -> None:
    """Lay out `repo_id` in a Hub cache: per commit hash, (its ref name, the folder it holds)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    for commit, (ref, folder) in commits.items():
        shutil.copytree(folder, repo / "snapshots" / commit)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def cache(make_tiny, tmp_path_factory) -> Path:
    """org/tiny: main is the tiny Llama, tag v2 the tiny Qwen3; org/tok: the Llama's tokenizer."""
    cache = tmp_path_factory.mktemp("hub")
    llama, qwen3 = make_tiny("llama"), make_tiny("qwen3")
    cache_repo(cache, "org/tiny", {MAIN: ("main", llama), V2: ("v2", qwen3)})
    tokenizer = tmp_path_factory.mktemp("tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(llama / name, tokenizer / name)
    cache_repo(cache, "org/tok", {MAIN: ("main", tokenizer)})
    config_only = tmp_path_factory.mktemp("config-only")
    shutil.copy(llama / "config.json", config_only / "config.json")
    cache_repo(cache, "org/config-only", {MAIN: ("main", config_only)})
    return cache


def greedy(llm: LLM) -> tuple[list[int], str]:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate(["Paged attention"], params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, out.text


def test_a_hub_repository_generates_what_its_folder_does(cache, make_tiny):
    from_hub = LLM("org/tiny", download_dir=str(cache), **ENGINE_ARGS)
    assert from_hub.engine.model_config.architecture == "LlamaForCausalLM"
    assert greedy(from_hub) == greedy(LLM(str(make_tiny("llama")), **ENGINE_ARGS))
    assert from_hub.engine.config.model == "org/tiny"  # the name served and reported


@pytest.mark.parametrize("revision", ["v2", V2])
def test_revision_takes_a_tag_or_a_commit(cache, make_tiny, revision):
    llm = LLM("org/tiny", revision=revision, download_dir=str(cache), **ENGINE_ARGS)
    assert llm.engine.model_config.architecture == "Qwen3ForCausalLM"
    assert greedy(llm) == greedy(LLM(str(make_tiny("qwen3")), **ENGINE_ARGS))


def test_the_tokenizer_from_its_own_repository(cache, make_tiny):
    llm = LLM(str(make_tiny("llama")), tokenizer="org/tok", download_dir=str(cache), **ENGINE_ARGS)
    assert llm.engine.tokenizer is not None
    assert greedy(llm) == greedy(LLM(str(make_tiny("llama")), **ENGINE_ARGS))


def test_tokenizer_revision_reads_the_model_s_repository_at_that_revision(cache, make_tiny):
    llm = LLM(
        str(make_tiny("qwen3")), tokenizer="org/tiny", tokenizer_revision="main",
        download_dir=str(cache), **ENGINE_ARGS,
    )  # fmt: skip
    llama = LLM(str(make_tiny("llama")), **ENGINE_ARGS).engine.tokenizer
    assert llm.engine.tokenizer.encode("Paged attention") == llama.encode("Paged attention")


def test_only_what_the_engine_reads_is_fetched(cache, make_tiny, monkeypatch):
    """Configs, tokenizer files and the chat template always; the safetensors unless the
    weights are random."""
    asked = []

    def snapshot_download(repo_id, **kwargs):
        asked.append((repo_id, kwargs))
        return str(make_tiny("llama"))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    LLM("org/other", revision="r1", download_dir="/d", hf_token="hf_x", **ENGINE_ARGS)
    LLM("org/other", load_format="dummy", **ENGINE_ARGS)
    (repo, real), (_, dummy) = asked
    assert repo == "org/other" and (real["revision"], real["cache_dir"]) == ("r1", "/d")
    assert (real["token"], dummy["token"]) == ("hf_x", None)
    assert {"*.json", "*.jinja", "*.safetensors"} <= set(real["allow_patterns"])
    assert {"*.json", "*.jinja"} <= set(dummy["allow_patterns"])
    assert "*.safetensors" not in dummy["allow_patterns"] and dummy["revision"] is None


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("org/missing", {}, "could not fetch the Hugging Face Hub repository 'org/missing'"),
        ("org/tiny", {"revision": "v9"}, "at revision 'v9'"),
        ("./no/such/folder", {}, "no such folder"),
    ],
)
def test_a_model_that_cannot_be_found_is_a_file_not_found_error(cache, name, args, message):
    with pytest.raises(FileNotFoundError, match=message) as error:
        LLM(name, download_dir=str(cache), **args, **ENGINE_ARGS)
    assert "llama-3-8b" in str(error.value)  # the presets listed


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("/no/such/tokenizer", "no such folder"),
        ("org/missing", "could not fetch the Hugging Face Hub repository 'org/missing'"),
        ("org/config-only", "has no tokenizer.json"),
    ],
)
def test_a_tokenizer_that_cannot_be_found_is_a_file_not_found_error(
    cache, make_tiny, name, message
):
    with pytest.raises(FileNotFoundError, match=message):
        LLM(str(make_tiny("llama")), tokenizer=name, download_dir=str(cache), **ENGINE_ARGS)


def test_random_weights_need_only_the_repository_s_config(cache):
    llm = LLM("org/config-only", load_format="dummy", download_dir=str(cache), **ENGINE_ARGS)
    assert llm.engine.tokenizer is None  # the repository has none: token-id prompts
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [5, 9, 11]}], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("field", ["revision", "tokenizer_revision", "download_dir", "tokenizer"])
@pytest.mark.parametrize("value", ["", 3])
def test_bad_names_are_value_errors_naming_the_field(make_tiny, field, value):
    with pytest.raises(ValueError, match=field):
        LLM(str(make_tiny("llama")), **{field: value}, **ENGINE_ARGS)


def test_the_cli_takes_vllm_s_flags():
    args = build_parser().parse_args(
        ["generate", "org/tiny", "hi", "--revision", "v2", "--tokenizer-revision", "t1",
         "--download-dir", "/models"]
    )  # fmt: skip
    kwargs = engine_kwargs(args)
    assert (kwargs["revision"], kwargs["tokenizer_revision"]) == ("v2", "t1")
    assert kwargs["download_dir"] == "/models"
