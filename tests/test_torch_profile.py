"""vLLM's profiler_config with LLM.start_profile / stop_profile: a torch.profiler trace of the steps
between them, one file per rank; bad settings and calls out of order are clear errors."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.cli import build_parser, engine_kwargs


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


@pytest.mark.parametrize("use_gzip", [True, False])
def test_the_trace_between_start_and_stop_holds_the_steps_ops(folder, tmp_path, use_gzip):
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path),
              "torch_profiler_use_gzip": use_gzip, "torch_profiler_with_stack": False}  # fmt: skip
    llm = LLM(folder, max_model_len=64, profiler_config=config)
    llm.start_profile()
    llm.generate("Profile this", SamplingParams(max_tokens=4), use_tqdm=False)
    [path] = llm.stop_profile()
    assert path.startswith(str(tmp_path)) and path.endswith(".gz" if use_gzip else ".json")
    opened = gzip.open if use_gzip else open
    with opened(path, "rt") as trace:
        events = json.load(trace)["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert any(name.startswith("aten::") for name in names)  # the model's torch ops ran in it
    llm.generate("not profiled", SamplingParams(max_tokens=2), use_tqdm=False)  # off again
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()


def test_a_profile_prefix_names_each_rank_s_trace_file_as_vllm_s(folder, tmp_path):
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path),
              "torch_profiler_use_gzip": False}  # fmt: skip
    llm = LLM(folder, max_model_len=64, profiler_config=config)
    for bad in ("../escape", "", 7):
        with pytest.raises(ValueError, match="profile_prefix must be"):
            llm.start_profile(bad)
    llm.start_profile(profile_prefix="step-7")  # the bad ones started nothing
    llm.generate("Profile this", SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stop_profile() == [str(tmp_path / "step-7_tp0.pt.trace.json")]
    llm.start_profile()  # no prefix: the default name again
    [path] = llm.stop_profile()
    assert path.startswith(str(tmp_path / "tandem-rank0-"))


def test_profiling_without_a_profiler_config_or_twice_is_a_runtime_error(folder, tmp_path):
    with pytest.raises(RuntimeError, match="profiler_config"):
        LLM(folder, max_model_len=64).start_profile()
    llm = LLM(folder, max_model_len=64,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path)})  # fmt: skip
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    assert len(llm.stop_profile()) == 1


@pytest.mark.parametrize(
    ("config", "message"),
    [({"profiler": "torch", "torch_profiler_dir": "relative/dir"}, "absolute path"),
     ({"profiler": "nsys"}, "one of"),
     ({"profiler": "torch", "torch_profiler_dir": "/tmp", "depth": 3}, "unknown keys"),
     ({"profiler": "torch", "torch_profiler_dir": "/tmp", "torch_profiler_with_flops": 1},
      "True or False"),
     ("torch", "must be a dict")],
)  # fmt: skip
def test_bad_profiler_configs_are_value_errors_naming_the_setting(folder, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(folder, profiler_config=config)


def test_the_cli_takes_vllm_s_profiler_config(folder):
    args = build_parser().parse_args(
        ["serve", folder, "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "/t"}']
    )
    assert engine_kwargs(args)["profiler_config"]["torch_profiler_dir"] == "/t"


def test_async_llm_profiles_between_its_steps_too(folder, tmp_path):
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path)}
    llm = AsyncLLM.from_model(folder, max_model_len=64, profiler_config=config)

    async def main():
        await llm.start_profile()
        async for _ in llm.generate("Profile", SamplingParams(max_tokens=3), "profiled"):
            pass
        return await llm.stop_profile()

    try:
        [path] = asyncio.run(main())
    finally:
        llm.shutdown()
    with gzip.open(path, "rt") as trace:
        assert json.load(trace)["traceEvents"]
