"""vLLM's engine arguments max_logprobs, skip_tokenizer_init, disable_log_stats and
hf_overrides, and those taken for its signature (an RL framework's LLM(...) and generate(...)
calls run unchanged: lora_request and priority too), by LLM, AsyncLLM and the CLI."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tandem import LLM, EngineArgs, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.cli import build_parser, engine_kwargs, server_options
from tandem.config import UNUSED_VLLM_OPTIONS, EngineConfig
from tandem.metrics import LOG_INTERVAL_S, EngineStats, StatLogger
from tandem.model.loader import merged
from test_bad_input import transformers_greedy

# vLLM 0.26's EngineArgs fields, in its order (the private _api_process_* left out)
VLLM_ENGINE_ARGS = [
    "model", "enable_return_routed_experts", "model_weights", "served_model_name", "tokenizer",
    "hf_config_path", "runner", "convert", "skip_tokenizer_init", "enable_prompt_embeds",
    "tokenizer_mode", "trust_remote_code", "allowed_local_media_path", "allowed_media_domains",
    "download_dir", "safetensors_load_strategy", "safetensors_prefetch_num_threads",
    "safetensors_prefetch_block_size", "load_format", "config_format", "dtype",
    "kv_cache_dtype", "seed", "max_model_len", "cudagraph_capture_sizes",
    "max_cudagraph_capture_size", "ir_op_priority", "distributed_executor_backend",
    "pipeline_parallel_size", "master_addr", "master_port", "nnodes", "node_rank",
    "distributed_timeout_seconds", "cpu_distributed_timeout_seconds", "numa_bind",
    "numa_bind_nodes", "numa_bind_cpus", "device_ids", "tensor_parallel_size",
    "prefill_context_parallel_size", "decode_context_parallel_size", "dcp_comm_backend",
    "dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size", "data_parallel_size",
    "data_parallel_rank", "data_parallel_start_rank", "data_parallel_size_local",
    "data_parallel_address", "data_parallel_rpc_port", "data_parallel_hybrid_lb",
    "data_parallel_external_lb", "data_parallel_multi_port_external_lb",
    "data_parallel_backend", "enable_expert_parallel", "enable_ep_weight_filter",
    "moe_backend", "linear_backend", "all2all_backend", "enable_elastic_ep", "enable_dbo",
    "ubatch_size", "dbo_decode_token_threshold", "dbo_prefill_token_threshold",
    "disable_nccl_for_dp_synchronization", "eplb_config", "enable_eplb",
    "expert_placement_strategy", "max_parallel_loading_workers", "block_size",
    "enable_prefix_caching", "prefix_caching_hash_algo", "disable_sliding_window",
    "disable_cascade_attn", "offload_backend", "cpu_offload_gb", "cpu_offload_params",
    "offload_group_size", "offload_num_in_group", "offload_prefetch_step", "offload_params",
    "gpu_memory_utilization", "kv_cache_memory_bytes", "max_num_batched_tokens",
    "max_num_scheduled_tokens", "max_num_partial_prefills", "max_long_partial_prefills",
    "long_prefill_token_threshold", "max_num_seqs", "max_logprobs", "logprobs_mode",
    "use_fp64_gumbel", "disable_log_stats", "aggregate_engine_logging", "revision",
    "code_revision", "hf_token", "hf_overrides", "model_class_overrides", "tokenizer_revision",
    "quantization", "quantization_config", "allow_deprecated_quantization", "enforce_eager",
    "disable_custom_all_reduce", "language_model_only", "limit_mm_per_prompt",
    "enable_mm_embeds", "interleave_mm_strings", "media_io_kwargs", "mm_processor_kwargs",
    "mm_processor_cache_gb", "mm_processor_cache_type", "mm_shm_cache_max_object_size_mb",
    "mm_encoder_only", "mm_encoder_tp_mode", "mm_encoder_attn_backend",
    "mm_encoder_attn_dtype", "mm_encoder_fp8_scale_path", "mm_encoder_fp8_scale_save_path",
    "mm_encoder_fp8_scale_save_margin", "io_processor_plugin", "renderer_num_workers",
    "skip_mm_profiling", "video_pruning_rate", "mm_tensor_ipc", "mm_ipc_gpu_memory_gb",
    "enable_lora", "max_loras", "max_lora_rank", "default_mm_loras", "fully_sharded_loras",
    "max_cpu_loras", "lora_dtype", "lora_target_modules", "enable_tower_connector_lora",
    "specialize_active_lora", "enable_mixed_moe_lora_format", "enable_moe_shared_loras",
    "ray_workers_use_nsight", "num_gpu_blocks_override", "model_loader_extra_config",
    "ignore_patterns", "enable_chunked_prefill", "disable_chunked_mm_input",
    "scheduler_reserve_full_isl", "prefill_schedule_interval", "watermark",
    "disable_hybrid_kv_cache_manager", "structured_outputs_config", "reasoning_parser",
    "reasoning_parser_plugin", "speculative_config", "spec_method", "spec_model",
    "spec_tokens", "diffusion_config", "show_hidden_metrics_for_version",
    "otlp_traces_endpoint", "collect_detailed_traces", "kv_cache_metrics",
    "kv_cache_metrics_sample", "cudagraph_metrics", "enable_layerwise_nvtx_tracing",
    "enable_mfu_metrics", "enable_logging_iteration_details", "jit_monitor_mode",
    "jit_monitor_verbose", "enable_mm_processor_stats", "scheduling_policy", "scheduler_cls",
    "pooler_config", "compilation_config", "attention_config", "mamba_config", "kernel_config",
    "enable_flashinfer_autotune", "enable_bf16x3_router_gemm", "worker_cls",
    "worker_extension_cls", "profiler_config", "kv_transfer_config", "kv_events_config",
    "ec_transfer_config", "reasoning_config", "generation_config", "enable_sleep_mode",
    "enable_cumem_allocator", "override_generation_config", "model_impl",
    "override_attention_dtype", "attention_backend", "calculate_kv_scales",
    "kv_cache_dtype_skip_layers", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
    "mamba_block_size", "prefix_match_unit", "mamba_cache_mode", "mamba_backend",
    "enable_mamba_cache_stochastic_rounding", "mamba_cache_philox_rounds", "additional_config",
    "use_tqdm_on_load", "pt_load_map_location", "logits_processors", "async_scheduling",
    "stream_interval", "kv_sharing_fast_prefill", "optimization_level", "performance_mode",
    "kv_offloading_size", "kv_offloading_backend", "tokens_only", "shutdown_timeout",
    "weight_transfer_config", "fail_on_environ_validation", "gdn_prefill_backend",
]  # fmt: skip


@pytest.fixture(scope="module")
def folder(make_tiny) -> str:
    return str(make_tiny("llama"))


def test_requests_asking_more_top_ids_than_max_logprobs_are_value_errors(folder):
    llm = LLM(folder, max_model_len=64, max_logprobs=2)
    [out] = llm.generate("Hello", SamplingParams(max_tokens=3, logprobs=2), use_tqdm=False)
    assert all(len(entry) >= 2 for entry in out.outputs[0].logprobs)
    for fields in ({"logprobs": 3}, {"prompt_logprobs": 5}):
        with pytest.raises(ValueError, match=r"max_logprobs=2"):
            llm.generate("Hello", SamplingParams(max_tokens=3, **fields), use_tqdm=False)
    # named ids are not top ids: logprob_token_ids has a limit of its own
    named = SamplingParams(max_tokens=3, logprob_token_ids=[1, 2, 3, 4])
    [out] = llm.generate("Hello", named, use_tqdm=False)
    entry, sampled = out.outputs[0].logprobs[0], out.outputs[0].token_ids[0]
    assert next(iter(entry)) == sampled and set(entry) == {sampled, 1, 2, 3, 4}  # vLLM's order
    assert not llm.engine.has_unfinished()  # the refused requests left nothing behind


def reference_rows(folder: str, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab] float64: transformers' log-softmax after each of `ids` but the last."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids[:-1]])).logits[0].double().log_softmax(-1)


def assert_top(entry: dict, row: torch.Tensor, k: int) -> None:
    """A position's logprobs hold the top k ids of `row` (ranks 1..k) with its values."""
    top = {token: value for token, value in entry.items() if value.rank <= k}
    want = row.topk(k)
    assert set(top) == set(want.indices.tolist())
    for token, value in top.items():
        assert abs(value.logprob - row[token].item()) < 1e-4
        assert value.rank == int((row > row[token] + 1e-6).sum()) + 1


def test_max_logprobs_past_20_and_minus_1_return_the_top_ids_transformers_gives(folder):
    """vLLM's max_logprobs above 20, and -1 (the whole vocabulary, also what a request's -1
    asks for): the sampled positions' and the prompt's top ids and values are those of
    transformers' log-softmax, the whole vocabulary for -1."""
    llm = LLM(folder, max_model_len=64, max_logprobs=-1)
    vocab = llm.engine.model_config.vocab_size
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=-1, prompt_logprobs=50)
    [out] = llm.generate("Hello there", params, use_tqdm=False)
    prompt, tokens = out.prompt_token_ids, out.outputs[0].token_ids
    rows = reference_rows(folder, prompt + tokens)
    for k, entry in enumerate(out.outputs[0].logprobs):
        assert len(entry) == vocab and next(iter(entry)) == tokens[k]  # the sampled id first
        assert_top(entry, rows[len(prompt) - 1 + k], vocab)
    for p in range(1, len(prompt)):
        assert_top(out.prompt_logprobs[p], rows[p - 1], 50)
    wide = LLM(folder, max_model_len=64, max_logprobs=30)
    [out] = wide.generate("Hello there", SamplingParams(max_tokens=3, logprobs=30), use_tqdm=False)
    rows = reference_rows(folder, prompt + out.outputs[0].token_ids)
    for k, entry in enumerate(out.outputs[0].logprobs):
        assert_top(entry, rows[len(prompt) - 1 + k], 30)
    with pytest.raises(ValueError, match="logprobs asks for 31 top ids, more than max_logprobs"):
        wide.generate("Hello", SamplingParams(max_tokens=1, logprobs=31), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs asks for -1 top ids"):
        wide.generate("Hello", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)


def test_logprob_buffers_past_their_limit_are_a_value_error_naming_max_logprobs(
    folder, monkeypatch
):
    monkeypatch.setattr("tandem.io_slot.MAX_LOGPROB_BUFFER_BYTES", 4 << 20)
    with pytest.raises(ValueError, match=r"max_logprobs=-1 \(704 ids a position\) needs 90 MiB"):
        LLM(folder, max_model_len=64, max_logprobs=-1)
    LLM(folder, max_model_len=64, max_logprobs=20)  # 2.6 MiB


@pytest.mark.parametrize("bad", [-2, 2.5])
def test_max_logprobs_below_minus_1_or_not_an_int_is_a_value_error(folder, bad):
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(folder, max_logprobs=bad)


def test_llm_engine_and_model_config_are_vllm_s_names_for_the_engine_and_its_context(folder):
    """vLLM scripts read `llm.llm_engine.model_config.max_model_len`, `llm.model_config` and
    `llm.llm_engine.get_tokenizer()`: the context the engine serves (fitted to the KV cache for
    -1) and the model's tokenizer."""
    llm = LLM(folder, max_model_len=64)
    assert llm.llm_engine is llm.engine
    assert llm.llm_engine.model_config.max_model_len == llm.model_config.max_model_len == 64
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer() is not None
    fitted = LLM(folder, max_model_len=-1, num_blocks=5, block_size=8)
    assert fitted.model_config.max_model_len == fitted.engine.max_model_len == 5 * 8


def test_model_config_hf_config_reads_config_json_as_transformers_config_does(folder, tmp_path):
    """`llm.llm_engine.model_config.hf_config` (vLLM's): scripts read the model's shape from it
    (`num_hidden_layers`, `getattr(cfg, "num_experts", 0)`, a sub-config's fields), with
    hf_overrides in, as vLLM's has them."""
    from transformers import AutoConfig

    overrides = {"max_position_embeddings": 96}
    cfg = LLM(folder, max_model_len=64, hf_overrides=overrides).llm_engine.model_config.hf_config
    reference = AutoConfig.from_pretrained(folder, **overrides)
    for name in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                 "vocab_size", "max_position_embeddings", "model_type", "architectures"):  # fmt: skip
        assert getattr(cfg, name) == getattr(reference, name), name
    assert getattr(cfg, "num_experts", 0) == 0
    assert cfg.to_dict() == {**json.loads((Path(folder) / "config.json").read_text()), **overrides}
    nested = tmp_path / "nested"
    shutil.copytree(folder, nested)
    on_disk = json.loads((nested / "config.json").read_text())
    on_disk["text_config"] = {"hidden_size": on_disk["hidden_size"], "rope_scaling": None}
    (nested / "config.json").write_text(json.dumps(on_disk))
    text = LLM(str(nested), max_model_len=64).model_config.hf_config.text_config
    assert text.hidden_size == on_disk["hidden_size"] and text.rope_scaling is None


def test_the_tokenizer_s_name_or_path_is_what_the_engine_was_given_as_transformers(
    folder, tmp_path
):
    """`tok.name_or_path`: scripts tell model families by it."""
    from transformers import AutoTokenizer

    tokenizer = LLM(folder, max_model_len=64).get_tokenizer()
    assert tokenizer.name_or_path == AutoTokenizer.from_pretrained(folder).name_or_path == folder
    other = tmp_path / "tokenizer"
    shutil.copytree(folder, other)
    named = LLM(folder, max_model_len=64, tokenizer=str(other)).get_tokenizer().name_or_path
    assert named == str(other)


def test_skip_tokenizer_init_takes_token_ids_and_gives_token_ids_without_text(folder):
    llm = LLM(folder, max_model_len=64, skip_tokenizer_init=True)
    assert llm.engine.tokenizer is None
    ids = [5, 17, 300, 42]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert out.outputs[0].text == ""
    assert out.outputs[0].token_ids == transformers_greedy(folder, tuple(ids), 6)
    with pytest.raises(ValueError, match="skip_tokenizer_init=True"):
        llm.generate("text needs a tokenizer", params, use_tqdm=False)


def test_the_cli_takes_both_as_vllm_spells_them(folder):
    args = build_parser().parse_args(
        ["generate", folder, "a prompt", "--max-logprobs", "5", "--skip-tokenizer-init"]
    )
    kwargs = engine_kwargs(args)
    assert (kwargs["max_logprobs"], kwargs["skip_tokenizer_init"]) == (5, True)
    args = build_parser().parse_args(["serve", folder, "--tokens-only"])
    assert engine_kwargs(args)["tokens_only"] is True


def test_an_rl_framework_s_vllm_arguments_are_taken(folder):
    llm = LLM(folder, max_model_len=64, enable_sleep_mode=True, disable_custom_all_reduce=True,
              enable_chunked_prefill=True, disable_log_stats=True, enable_prefix_caching=True,
              skip_tokenizer_init=False, trust_remote_code=False, seed=0)  # fmt: skip
    [out] = llm.generate("Hello", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    assert llm.sleep(1) > 0 and llm.wake_up() is None  # sleep mode works whatever the flag


@pytest.mark.parametrize(
    ("args", "message"),
    [({"enable_chunked_prefill": False}, "always splits a prompt"),
     ({"enable_sleep_mode": "yes"}, "enable_sleep_mode must be True or False"),
     ({"async_scheduling": True, "async_batching": False}, "contradicts async_batching=False"),
     ({"async_scheduling": 1}, "async_scheduling must be True or False"),
     ({"pipeline_parallel_size": 2}, "tensor_parallel_size"),
     ({"pipeline_parallel_size": 0}, "pipeline_parallel_size"),
     ({"speculative_config": {"method": "ngram"}}, "speculative decoding")],
)  # fmt: skip
def test_values_tandem_cannot_honour_are_value_errors_saying_why(folder, args, message):
    with pytest.raises(ValueError, match=message):
        LLM(folder, **args)


@pytest.mark.parametrize("scheduling", [True, False])
def test_async_scheduling_is_vllm_s_name_for_async_batching(folder, scheduling):
    llm = LLM(folder, max_model_len=64, async_scheduling=scheduling, pipeline_parallel_size=1)
    assert llm.engine.async_batching is scheduling
    flags = ["--async-scheduling" if scheduling else "--no-async-scheduling"]
    args = build_parser().parse_args(["serve", folder, *flags, "--pipeline-parallel-size", "1"])
    assert engine_kwargs(args)["async_scheduling"] is scheduling


def test_the_cli_takes_vllm_s_flags_of_an_rl_or_serving_script(folder):
    args = build_parser().parse_args(
        ["serve", folder, "--enable-sleep-mode", "--disable-custom-all-reduce",
         "--disable-log-stats"]
    )  # fmt: skip
    kwargs = engine_kwargs(args)
    assert kwargs["enable_sleep_mode"] and kwargs["disable_custom_all_reduce"]
    assert kwargs["disable_log_stats"] is True
    assert engine_kwargs(build_parser().parse_args(["serve", folder]))["disable_log_stats"] is True


def test_the_stats_line_gives_the_rates_since_the_line_before(caplog):
    """vLLM's periodic stats line (disable_log_stats=False): throughputs and the prefix cache's
    hit rate since the line before, the requests and KV cache usage now."""
    logger = StatLogger(now=0.0)
    first = EngineStats(num_running=3, num_waiting=1, num_blocks=10, num_free_blocks=5,
                        num_prompt_tokens=100, num_generation_tokens=50,
                        prefix_cache_queries=80, prefix_cache_hits=20)  # fmt: skip
    second = replace(first, num_running=2, num_waiting=0, num_free_blocks=9,
                     num_prompt_tokens=160, num_generation_tokens=250,
                     prefix_cache_queries=100, prefix_cache_hits=35)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="tandem.metrics"):
        logger.maybe_log(lambda: first, now=LOG_INTERVAL_S - 1)  # not yet
        logger.maybe_log(lambda: first, now=LOG_INTERVAL_S)
        logger.maybe_log(lambda: second, now=3 * LOG_INTERVAL_S)
    assert [r.getMessage() for r in caplog.records] == [
        "prompt throughput 10.0 tokens/s, generation throughput 5.0 tokens/s, running 3, "
        "waiting 1 requests, KV cache usage 50.0%, prefix cache hit rate 25.0%",
        "prompt throughput 3.0 tokens/s, generation throughput 10.0 tokens/s, running 2, "
        "waiting 0 requests, KV cache usage 10.0%, prefix cache hit rate 75.0%",
    ]


def test_disable_log_stats_false_logs_from_the_engine_s_steps(folder, caplog):
    default = LLM(folder, max_model_len=64)
    assert default.engine.stat_logger is None  # the default: no lines
    del default  # one engine at a time: each takes most of a GPU's memory
    llm = LLM(folder, max_model_len=64, disable_log_stats=False)
    llm.engine.stat_logger.last_at = -LOG_INTERVAL_S  # the first step is due a line
    with caplog.at_level(logging.INFO, logger="tandem.metrics"):
        llm.generate("Paged attention", SamplingParams(max_tokens=4), use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "tandem.metrics"]
    assert len(lines) == 1 and lines[0].startswith("prompt throughput")


def test_hf_overrides_generate_what_the_changed_config_does(folder, tmp_path):
    """Against transformers reading a copy of the folder whose config.json has the change."""
    changed = Path(shutil.copytree(folder, tmp_path / "changed"))
    config = json.loads((changed / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (changed / "config.json").write_text(json.dumps(config))
    ids = (5, 17, 300, 42)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(folder, max_model_len=64, hf_overrides={"rms_norm_eps": 0.5})
    [out] = llm.generate({"prompt_token_ids": list(ids)}, params, use_tqdm=False)
    expected = transformers_greedy(changed, ids, 6)
    assert out.outputs[0].token_ids == expected
    assert expected != transformers_greedy(Path(folder), ids, 6)  # the change changes tokens


def test_hf_overrides_merge_into_nested_configs():
    config = {"text_config": {"rope_theta": 1.0, "vocab_size": 9}, "architectures": ["A"]}
    overrides = {"text_config": {"rope_theta": 2.0}, "architectures": ["B"], "new": 1}
    assert merged(config, overrides) == {
        "text_config": {"rope_theta": 2.0, "vocab_size": 9},
        "architectures": ["B"],
        "new": 1,
    }


@pytest.mark.parametrize("backend", [None, "mp", "uni", "external_launcher"])
def test_the_executor_backends_of_one_process_per_rank_are_taken(folder, backend):
    EngineConfig(folder, distributed_executor_backend=backend).validate()
    EngineConfig(folder, tokenizer_mode="hf", model_impl="vllm", hf_token=True).validate()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({"distributed_executor_backend": "ray"}, "tandem.ray"),
        ({"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 2},
         "caller's process"),
        ({"distributed_executor_backend": "threads"}, "distributed_executor_backend"),
        ({"tokenizer_mode": "mistral"}, "tokenizer.json"),
        ({"model_impl": "transformers"}, "model_impl"),
        ({"hf_overrides": lambda config: config}, "hf_overrides"),
        ({"hf_overrides": [("rope_theta", 1)]}, "hf_overrides"),
        ({"hf_token": ""}, "hf_token"),
        ({"scheduling_policy": "lottery"}, "'fcfs', 'priority'"),
        ({"runner": "draft"}, "runner must be one of"),
        ({"enable_expert_parallel": True}, "split by tensor parallelism"),
        ({"cpu_offload_gb": 4}, "stay in device memory"),
        ({"calculate_kv_scales": True}, "k_scale and v_scale"),
        ({"kv_transfer_config": {"kv_connector": "x"}}, "no KV cache moves"),
        ({"limit_mm_per_prompt": {"image": 1}}, "every count 0"),
        ({"disable_mm_preprocessor_cache": "yes"}, "disable_mm_preprocessor_cache must be True"),
        ({"convert": "classify"}, "score head"),
        ({"long_prefill_token_threshold": 512}, "chunks prompts by the step's token budget"),
        ({"max_num_partial_prefills": 4}, "chunks prompts"),
        ({"num_lookahead_slots": 2}, "no speculative decoding"),
        ({"mm_processor_kwargs": {"num_crops": 4}}, "text models alone"),
        ({"attention_config": {"backend": "x"}}, "attention_backend"),
        ({"disable_sliding_window": True}, "over their window"),
        ({"data_parallel_size": 2}, "--data-parallel-size"),
        ({"worker_extension_cls": "my.Extension"}, "does not import"),
        ({"served_model_name": "m"}, "--served-model-name"),
        ({"max_parallel_loading_workers": 0}, "positive int"),
        ({"use_tqdm_on_load": "yes"}, "True or False"),
        ({"prefix_caching_hash_algo": "md5"}, "blake2b"),
        ({"ignore_patterns": ["*.bin"]}, "original/"),
        ({"otlp_traces_endpoint": "http://collector:4317"}, "OpenTelemetry"),
        ({"enable_return_routed_experts": True}, "routing"),
        ({"offload_group_size": 8}, "stay in device memory"),
        ({"offload_params": {"gate_up_proj"}}, "stay in device memory"),
        ({"chat_template": "{{ messages }}"}, "LLM.chat takes chat_template per call"),
        ({"pooler_config": {"pooling_type": "MEAN"}}, "PoolingParams"),
        ({"quantization_config": {"activation_scheme": "dynamic"}}, "quantization names"),
        ({"spec_method": "ngram"}, "no speculative decoding"),
        ({"spec_tokens": 4}, "no speculative decoding"),
        ({"nnodes": 2}, "processes tandem starts on one machine"),
        ({"nnodes": True}, "processes tandem starts on one machine"),
        ({"distributed_timeout_seconds": 3600}, "default timeouts"),
        ({"device_ids": [2, 3]}, "CUDA_VISIBLE_DEVICES"),
        ({"decode_context_parallel_size": 2}, "no context parallelism"),
        ({"data_parallel_size_local": 2}, "--data-parallel-size"),
        ({"enable_eplb": True}, "split by tensor parallelism"),
        ({"eplb_config": {"window_size": 1000}}, "split by tensor parallelism"),
        ({"enable_dbo": True}, "micro-batches"),
        ({"kv_offloading_size": 8.0}, "preemption_mode"),
        ({"cpu_offload_params": {"experts"}}, "stay in device memory"),
        ({"mm_encoder_tp_mode": "data"}, "text models alone"),
        ({"mm_processor_cache_gb": 8}, "no multi-modal processor cache"),
        ({"language_model_only": 1}, "True or False"),
        ({"mamba_cache_dtype": "float32"}, "no Mamba"),
        ({"kv_cache_metrics": True}, "no KV cache residency metrics"),
        ({"collect_detailed_traces": ["all"]}, "OpenTelemetry"),
        ({"moe_backend": "triton"}, "its own kernels"),
        ({"kernel_config": {"moe_backend": "triton"}}, "its own kernels"),
        ({"optimization_level": 0}, "enforce_eager"),
        ({"use_fp64_gumbel": True}, "float32"),
        ({"hf_config_path": "other/config"}, "hf_overrides"),
        ({"scheduler_reserve_full_isl": 1}, "True or False"),
        ({"watermark": 0.01}, "no free blocks back"),
        ({"scheduler_cls": "my.Scheduler"}, "scheduling_policy"),
        ({"lora_dtype": "float32"}, "model's dtype"),
        ({"fully_sharded_loras": True}, "row-parallel"),
        ({"enable_cumem_allocator": True}, "caching allocator"),
        ({"shutdown_timeout": 30}, "--drain-timeout"),
        ({"renderer_num_workers": 0}, "int >= 1"),
        ({"disable_hybrid_kv_cache_manager": False}, "the same blocks"),
        ({"max_num_scheduled_tokens": 9000}, "exceeds max_num_batched_tokens=8192"),
        ({"tokens_only": "yes"}, "tokens_only must be True or False"),
    ],
)  # fmt: skip
def test_vllm_s_other_values_are_value_errors_saying_why(folder, args, words):
    with pytest.raises(ValueError, match=words):
        LLM(folder, **args)


def test_vllm_s_options_at_tandem_s_behaviour_generate_as_without_them(folder):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = LLM(folder, max_model_len=64).generate("Hi", params, use_tqdm=False)
    neutral = dict(
        enable_expert_parallel=False, cpu_offload_gb=0, calculate_kv_scales=False,
        kv_transfer_config=None, limit_mm_per_prompt={"image": 0, "video": 0},
        disable_mm_preprocessor_cache=True, max_num_partial_prefills=1,
        max_long_partial_prefills=1, long_prefill_token_threshold=0, num_lookahead_slots=0,
        mm_processor_kwargs=None, allowed_local_media_path="", allowed_media_domains=None,
        attention_config=None, enable_return_routed_experts=False, disable_sliding_window=False,
        data_parallel_size=1, worker_extension_cls="", served_model_name=None,
        max_parallel_loading_workers=4, use_tqdm_on_load=False, prefix_caching_hash_algo="xxhash",
        ignore_patterns=["original/**/*"], otlp_traces_endpoint=None,
        # vLLM's LLM(...) keywords at their defaults
        offload_group_size=0, offload_num_in_group=1, offload_prefetch_step=1,
        offload_params=None, chat_template=None, pooler_config=None, quantization_config=None,
        spec_method=None, spec_model=None, spec_tokens=None,
        # vLLM 0.26's EngineArgs fields at their defaults (a config object's as None or {})
        master_addr="127.0.0.1", master_port=29501, nnodes=1, node_rank=0, device_ids=None,
        distributed_timeout_seconds=None, decode_context_parallel_size=1,
        data_parallel_rank=None, data_parallel_backend="mp", enable_eplb=False, eplb_config={},
        enable_dbo=False, dbo_prefill_token_threshold=512, offload_backend="auto",
        cpu_offload_params=set(), kv_offloading_size=None, media_io_kwargs={},
        mm_encoder_tp_mode="weights", mm_encoder_fp8_scale_save_margin=1.5, mamba_config=None,
        mamba_cache_mode="none", mamba_backend="triton", kv_cache_metrics_sample=0.01,
        kernel_config=None, moe_backend="auto", performance_mode="balanced",
        safetensors_prefetch_block_size=16 * 2**20, kv_cache_dtype_skip_layers=[],
        lora_dtype="auto", worker_cls="auto", scheduler_cls=None, watermark=0.0,
        shutdown_timeout=0, model_weights="", prefix_match_unit=None,
        # and the values that ask for what tandem does
        language_model_only=True, mm_processor_cache_gb=0, optimization_level=3,
        disable_hybrid_kv_cache_manager=True, config_format="hf", safetensors_load_strategy="lazy",
        scheduler_reserve_full_isl=True, renderer_num_workers=4, code_revision="main",
        # vLLM's EngineArgs' None: the engine decides (tandem's defaults); no reasoning parser
        enable_prefix_caching=None, enable_chunked_prefill=None, max_num_seqs=None,
        max_num_batched_tokens=None, reasoning_parser="",
    )  # fmt: skip
    llm = LLM(folder, max_model_len=64, **neutral)
    got = llm.generate("Hi", params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    config = llm.engine.config
    assert (config.enable_prefix_caching, config.max_num_seqs) == (True, 256)
    assert (config.max_num_batched_tokens, config.reasoning_parser) == (8192, None)
    flags = ["--long-prefill-token-threshold", "0", "--max-num-partial-prefills", "1"]
    args = build_parser().parse_args(["serve", folder, *flags])
    assert engine_kwargs(args)["long_prefill_token_threshold"] == 0
    args = build_parser().parse_args(["serve", folder, "--enable-expert-parallel"])
    with pytest.raises(ValueError, match="enable_expert_parallel=True"):
        LLM(folder, **engine_kwargs(args))


def test_every_field_of_vllm_s_engine_args_is_tandem_s_or_taken_at_its_behaviour():
    """A vLLM script's EngineArgs(...) or LLM(...) keywords are never a TypeError: each is a
    setting of tandem's, or taken where it asks for what tandem does (UNUSED_VLLM_OPTIONS)."""
    known = {f.name for f in dataclasses.fields(EngineConfig)} | set(UNUSED_VLLM_OPTIONS)
    assert [name for name in VLLM_ENGINE_ARGS if name not in known] == []
    EngineArgs(model="m", master_port=29501, eplb_config={}, mamba_cache_mode="none").validate()
    with pytest.raises(ValueError, match=r"master_port=29600 is not supported: .* one machine"):
        EngineArgs(model="m", master_port=29600).validate()


def test_vllm_s_tokens_only_loads_no_tokenizer(folder):
    llm = LLM(folder, max_model_len=64, tokens_only=True)
    assert llm.engine.tokenizer is None and llm.engine.config.skip_tokenizer_init
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": [5, 17, 300]}, params, use_tqdm=False)
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 3


def test_vllm_s_max_num_scheduled_tokens_is_the_step_s_token_budget(folder):
    """Without speculative tokens a step schedules max_num_scheduled_tokens at most: the engine
    runs as with max_num_batched_tokens of that value (a 40-token prompt over three steps)."""
    llm = LLM(folder, max_model_len=64, max_num_scheduled_tokens=16)
    assert llm.engine.config.max_num_batched_tokens == 16
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want = LLM(folder, max_model_len=64, max_num_batched_tokens=16)
    prompt = {"prompt_token_ids": list(range(5, 45))}
    [got] = llm.generate(prompt, params, use_tqdm=False)
    [expected] = want.generate(prompt, params, use_tqdm=False)
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    args = build_parser().parse_args(["serve", folder, "--max-num-scheduled-tokens", "16"])
    assert engine_kwargs(args)["max_num_scheduled_tokens"] == 16


def test_vllm_s_shutdown_timeout_flag_is_tandem_serve_s_drain_timeout(folder):
    """vLLM's --shutdown-timeout: how long open requests go on after SIGTERM (0: none)."""
    args = build_parser().parse_args(["serve", folder, "--shutdown-timeout", "5"])
    assert server_options(args, ()).drain_timeout_s == 5.0
    assert "shutdown_timeout" not in engine_kwargs(args)  # the engine's field stays at 0


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        (["--limit-mm-per-prompt", '{"image": 0, "video": 0}'], None),
        (["--limit-mm-per-prompt", '{"image": 2}'], "limit_mm_per_prompt"),
        (["--disable-sliding-window"], "disable_sliding_window=True"),
        (["--calculate-kv-scales"], "calculate_kv_scales=True"),
        (["--kv-transfer-config", '{"kv_connector": "X"}'], "kv_transfer_config"),
        (["--worker-extension-cls", "test_weight_update.WeightSync"], None),
        (["--language-model-only"], None),
        (["--max-num-scheduled-tokens", "32"], None),
        (["--enable-eplb"], "enable_eplb=True"),
        (["--enable-dbo"], "enable_dbo=True"),
    ],
)
def test_vllm_s_serve_flags_at_tandem_s_behaviour_are_taken_and_others_say_why(
    folder, flags, refused
):
    """A vLLM command line with these flags parses: where the value asks for what tandem does it
    runs, else the engine's ValueError says why (not argparse's "unrecognized arguments")."""
    args = ["serve", folder, "--max-model-len", "64", *flags]
    kwargs = engine_kwargs(build_parser().parse_args(args))
    if refused is None:
        assert LLM(folder, **kwargs).generate("Hi", use_tqdm=False)
        return
    with pytest.raises(ValueError, match=f"{refused}.*is not supported: "):
        LLM(folder, **kwargs)


@pytest.mark.parametrize("fit", [-1, "auto"])
def test_max_model_len_minus_one_is_the_longest_the_kv_cache_holds_as_vllms(folder, fit):
    """vLLM's -1 / "auto": 12 blocks of 8 hold 96 tokens, fewer than the model's positions, so
    96 it is (a prompt of 96 is refused, 95 runs); a cache past them keeps the model's."""
    llm = LLM(folder, max_model_len=fit, num_blocks=12, block_size=8)
    assert llm.engine.max_model_len == 96
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="96"):
        llm.generate({"prompt_token_ids": [5] * 96}, params, use_tqdm=False)
    [out] = llm.generate({"prompt_token_ids": [5] * 95}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    roomy = LLM(folder, max_model_len=fit, num_blocks=4096, block_size=8)
    assert roomy.engine.max_model_len == LLM(folder, num_blocks=4096).engine.max_model_len


def test_vllm_s_pooling_runner_embeds_as_the_default_engine_does(folder):
    import torch

    plain = LLM(folder, max_model_len=64).embed(["Hello there"], use_tqdm=False)
    llm = LLM(folder, max_model_len=64, runner="pooling", convert="embed")
    [out] = llm.embed(["Hello there"], use_tqdm=False)
    torch.testing.assert_close(
        torch.as_tensor(out.outputs.embedding), torch.as_tensor(plain[0].outputs.embedding)
    )
    args = build_parser().parse_args(["serve", folder, "--runner", "pooling", "--convert", "embed"])
    assert (engine_kwargs(args)["runner"], engine_kwargs(args)["convert"]) == ("pooling", "embed")


@pytest.mark.parametrize(
    ("dtype", "want"),
    [("half", torch.float16), ("float", torch.float32), (torch.float16, torch.float16),
     (torch.bfloat16, torch.bfloat16), ("float32", torch.float32)],
)  # fmt: skip
def test_vllm_s_dtype_spellings_pick_the_dtype(folder, dtype, want):
    llm = LLM(folder, max_model_len=64, dtype=dtype)
    assert llm.engine.dtype == want and llm.engine.config.dtype in (
        "float16",
        "float32",
        "bfloat16",
    )
    assert {p.dtype for p in llm.engine.runner.model.parameters() if p.is_floating_point()} == {
        want
    }
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    assert len(llm.generate("Hi", params, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_vllm_s_safetensors_load_format_loads_the_checkpoint_as_auto(folder):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = LLM(folder, max_model_len=64).generate("Hi", params, use_tqdm=False)
    llm = LLM(folder, max_model_len=64, load_format="safetensors")
    assert llm.engine.config.load_format == "auto"
    got = llm.generate("Hi", params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="tandem reads safetensors"):
        LLM(folder, max_model_len=64, load_format="pt")


def test_the_cli_takes_vllm_s_model_flags(folder):
    args = build_parser().parse_args(
        ["generate", folder, "a prompt", "--hf-overrides", '{"rope_theta": 1000.0}', "--hf-token",
         "--distributed-executor-backend", "uni", "--tokenizer-mode", "hf", "--model-impl", "vllm"]
    )  # fmt: skip
    kwargs = engine_kwargs(args)
    assert kwargs["hf_overrides"] == {"rope_theta": 1000.0} and kwargs["hf_token"] is True
    assert kwargs["distributed_executor_backend"] == "uni"
    assert (kwargs["tokenizer_mode"], kwargs["model_impl"]) == ("hf", "vllm")


def test_generate_takes_vllm_s_lora_request_and_priority_at_their_defaults(folder):
    llm = LLM(folder, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = ["Hello there", "Paged attention"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = llm.generate(prompts, params, use_tqdm=False, lora_request=None, priority=[0, 0])
    assert [o.outputs[0].token_ids for o in got] == want
    assert llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False, lora_request=None)


@pytest.mark.parametrize(("priority", "error"), [([0, 1], ValueError), ([True, 0], TypeError)])
def test_a_priority_under_fcfs_is_refused_and_queues_nothing(folder, priority, error):
    llm = LLM(folder, max_model_len=64)
    params = SamplingParams(max_tokens=3)
    with pytest.raises(error, match="priority"):
        llm.generate(["Hello there", "Paged attention"], params, use_tqdm=False, priority=priority)
    with pytest.raises(error, match="priority"):
        llm.enqueue(["Hello there", "Paged attention"], params, priority=priority)
    assert not llm.engine.has_unfinished()


def test_async_generate_takes_lora_request_and_priority_at_their_defaults(folder):
    llm = AsyncLLM.from_model(folder, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def run(**options) -> list[int]:
        outs = [o async for o in llm.generate("Hello there", params, "r", **options)]
        return outs[-1].outputs[0].token_ids

    try:
        assert asyncio.run(run(lora_request=None, priority=0)) == asyncio.run(run())
        with pytest.raises(ValueError, match="scheduling_policy"):
            asyncio.run(run(priority=2))
        with pytest.raises(TypeError, match="LoRARequest"):
            asyncio.run(run(lora_request=object()))
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("config", "decode_graphs", "pieces", "sizes"),
    [
        (None, True, True, [1, 2, 4, 8, 16, 32, 40]),  # tandem's own sizes up to 40 rows
        (3, True, True, [1, 2, 4, 8, 16, 32, 40]),  # vLLM's -O3: a level, no effect
        ({"mode": 3, "backend": "inductor"}, True, True, [1, 2, 4, 8, 16, 32, 40]),
        ({"cudagraph_mode": "NONE"}, False, False, []),
        ({"use_cudagraph": False}, False, False, []),
        ({"cudagraph_mode": "FULL_DECODE_ONLY"}, True, False, [1, 2, 4, 8, 16, 32, 40]),
        ({"cudagraph_mode": "PIECEWISE"}, False, True, []),
        ({"cudagraph_mode": "full_and_piecewise", "cudagraph_capture_sizes": [64, 4, 1, 8, 4]},
         True, True, [1, 4, 8]),  # sorted, once each, none past the 40 rows a step may have
        ({"max_cudagraph_capture_size": 10}, True, True, [1, 2, 4, 8, 10]),
        ('{"cudagraph_capture_sizes": [2, 6], "max_cudagraph_capture_size": 4}', True, True, [2]),
    ],
)  # fmt: skip
def test_compilation_config_shapes_the_cuda_graphs(config, decode_graphs, pieces, sizes):
    from tandem.compilation import graph_plan
    from tandem.runner import graph_batch_sizes

    plan = graph_plan(config)
    assert (plan.decode_graphs, plan.pieces) == (decode_graphs, pieces)
    assert plan.sizes(40, graph_batch_sizes(40)) == sizes


def test_the_engine_captures_the_graphs_compilation_config_names(folder, monkeypatch):
    """The engine's graph sizes and pieces follow the plan (where it runs graphs at all: a
    CUDA device, not enforce_eager)."""
    from tandem.engine import Engine

    monkeypatch.setattr(Engine, "_use_cuda_graphs", lambda self: True)
    llm = LLM(folder, max_model_len=64, max_num_seqs=12, cuda_graphs=False)  # built on CPU
    engine = llm.engine
    assert engine._graph_sizes() == [1, 2, 4, 8, 12]
    engine.config.compilation_config = {"cudagraph_capture_sizes": [3, 6], "cudagraph_mode": "FULL"}
    assert engine._graph_sizes() == [3, 6] and engine._use_piecewise()
    engine.config.compilation_config = {"cudagraph_mode": "FULL_DECODE_ONLY"}
    assert engine._graph_sizes() == [1, 2, 4, 8, 12] and not engine._use_piecewise()
    engine.config.compilation_config = {"cudagraph_mode": "PIECEWISE"}
    assert engine._graph_sizes() == [] and engine._use_piecewise()


def test_vllm_s_top_level_graph_sizes_shape_the_graphs_as_their_compilation_config_keys(
    folder, monkeypatch
):
    from tandem.engine import Engine

    monkeypatch.setattr(Engine, "_use_cuda_graphs", lambda self: True)
    common = dict(max_model_len=64, max_num_seqs=12, cuda_graphs=False)  # built on CPU
    llm = LLM(folder, **common, cudagraph_capture_sizes=[3, 6])
    assert llm.engine._graph_sizes() == [3, 6]
    llm = LLM(folder, **common, max_cudagraph_capture_size=4, compilation_config=3)
    assert llm.engine._graph_sizes() == [1, 2, 4]
    assert llm.engine.config.compilation_config == {"level": 3, "max_cudagraph_capture_size": 4}
    config = '{"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 4}'
    llm = LLM(folder, **common, max_cudagraph_capture_size=4, compilation_config=config)
    assert llm.engine._graph_sizes() == [1, 2, 4] and not llm.engine._use_piecewise()
    with pytest.raises(ValueError, match="max_cudagraph_capture_size=8 contradicts"):
        LLM(folder, **common, max_cudagraph_capture_size=8, compilation_config=config)
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must be a non-empty list"):
        LLM(folder, **common, cudagraph_capture_sizes=[0])
    args = build_parser().parse_args(
        [
            "serve",
            folder,
            "--cudagraph-capture-sizes",
            "1",
            "8",
            "--max-cudagraph-capture-size",
            "8",
        ]
    )
    kwargs = engine_kwargs(args)
    assert (kwargs["cudagraph_capture_sizes"], kwargs["max_cudagraph_capture_size"]) == ([1, 8], 8)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"cudagraph_mode": "SOMETIMES"}, "cudagraph_mode must be one of"),
        ({"cudagraph_capture_sizes": [0, 4]}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes"),
        ({"max_cudagraph_capture_size": "8"}, "max_cudagraph_capture_size"),
        ({"cuda_graph_sizes": [4]}, "unknown keys ['cuda_graph_sizes']"),
        ("{not json", "JSON or a level"),
        ([4], "must be a dict"),
    ],
)
def test_bad_compilation_configs_are_value_errors(folder, config, words):
    with pytest.raises(ValueError) as error:
        LLM(folder, max_model_len=64, compilation_config=config)
    assert words in str(error.value)


def test_the_cli_takes_vllm_s_compilation_flags(folder):
    parser = build_parser()
    for flag, want in (
        (["-O3"], 3),
        (["-O", '{"cudagraph_mode": "PIECEWISE"}'], {"cudagraph_mode": "PIECEWISE"}),
        (["--compilation-config", '{"cudagraph_capture_sizes": [1, 2]}'],
         {"cudagraph_capture_sizes": [1, 2]}),
    ):  # fmt: skip
        args = parser.parse_args(["generate", folder, "x", *flag])
        assert engine_kwargs(args)["compilation_config"] == want
    args = parser.parse_args(
        ["generate", folder, "x", "--num-gpu-blocks-override", "12", "--kv-cache-memory-bytes", "9"]
    )
    kwargs = engine_kwargs(args)
    assert (kwargs["num_gpu_blocks_override"], kwargs["kv_cache_memory_bytes"]) == (12, 9)


def test_the_kv_cache_is_sized_by_vllm_s_block_count_or_bytes(folder):
    from tandem.kv_cache import bytes_per_block

    llm = LLM(folder, max_model_len=64, num_gpu_blocks_override=20)
    assert llm.engine.num_blocks == 20
    per_block = bytes_per_block(llm.engine.model.cfg, 16, llm.engine.kv_cache_dtype)
    llm = LLM(folder, max_model_len=64, kv_cache_memory_bytes=7 * per_block + 5)
    assert llm.engine.num_blocks == 7
    [out] = llm.generate("Hello", SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    for args, words in (
        ({"num_gpu_blocks_override": 20, "num_blocks": 21}, "give one of them"),
        ({"kv_cache_memory_bytes": 64, "num_blocks": 21}, "each size the KV cache"),
        ({"kv_cache_memory_bytes": 5}, "holds no KV block"),
        ({"kv_cache_memory_bytes": per_block}, "fewer than max_model_len"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
    ):
        with pytest.raises(ValueError, match=words):
            LLM(folder, max_model_len=64, **args)
