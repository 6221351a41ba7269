"""Model shape (from a Hugging Face config.json) and engine settings, validated once."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields, make_dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tandem.compilation import graph_plan, with_graph_sizes
from tandem.model.rope import ROPE_TYPES

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "GraniteForCausalLM": "granite",
    "Glm4ForCausalLM": "glm4",
    "SeedOssForCausalLM": "seed_oss",
    "Ernie4_5ForCausalLM": "ernie4_5",
}
# sequence classifiers (reward models): the decoder with a `score` matrix of num_labels rows
# in place of its LM head, read at the last token (pooling.py)
CLASSIFIERS = {
    arch.replace("ForCausalLM", "ForSequenceClassification"): arch
    for arch in SUPPORTED_ARCHITECTURES
}
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# norms after the attention and the MLP, q and k normed over all heads (model/olmo.py)
OLMO = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
MOE = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# architectures whose heads may rotate only their leading dimensions (partial_rotary_factor)
PARTIAL_ROTARY = ("Phi3ForCausalLM", "Glm4ForCausalLM")
# rotary pairs (2i, 2i + 1), GPT-J's layout, not halves (reordered at load: rope.rotary_rows)
INTERLEAVED_ROTARY = ("Glm4ForCausalLM", "Ernie4_5ForCausalLM")
# norms around each sublayer, before and after it (gemma.GemmaDecoderLayer's four; GLM-4 names
# them otherwise: hf_names)
SANDWICH = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Glm4ForCausalLM")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# architectures whose sliding_window (when set) applies to every layer
WINDOWED_EVERYWHERE = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
WINDOWED_LAYERS = (*GEMMA, "Olmo3ForCausalLM")  # sliding and full layers (layer_types)
# a sliding_window read only under use_sliding_window (refused)
QWEN_WINDOW_FLAG = (
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM",
)
GEMMA_DEFAULTS = {
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "sliding_window": 4096,
    "tie_word_embeddings": True,
}
# what a config.json that leaves a field out means, as transformers' config classes fill it in,
# where that differs from the fallbacks every architecture shares (rope_theta 10000,
# rms_norm_eps 1e-6, head_dim hidden_size / heads, no window, untied, 4096 positions)
CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"sliding_window": 4096, "max_position_embeddings": 131072},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768},
    "Qwen3ForCausalLM": {"head_dim": 128, "max_position_embeddings": 32768},
    "Qwen2MoeForCausalLM": {
        "shared_expert_intermediate_size": 5632, "max_position_embeddings": 32768,
    },
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768},
    "MixtralForCausalLM": {
        "rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    },
    "Gemma2ForCausalLM": {
        **GEMMA_DEFAULTS, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "max_position_embeddings": 8192,
    },
    "Gemma3ForCausalLM": {**GEMMA_DEFAULTS, "rope_theta": 1e6, "max_position_embeddings": 131072},
    "Phi3ForCausalLM": {"rms_norm_eps": 1e-5},
    "SmolLM3ForCausalLM": {
        "rope_theta": 2e6, "tie_word_embeddings": True, "max_position_embeddings": 32768,
    },
    "Olmo2ForCausalLM": {"rms_norm_eps": 1e-5, "max_position_embeddings": 2048},
    "Olmo3ForCausalLM": {
        "rms_norm_eps": 1e-5, "rope_theta": 5e5, "sliding_window": 4096,
        "max_position_embeddings": 2048,
    },
    "GraniteForCausalLM": {"max_position_embeddings": 2048},
    "Glm4ForCausalLM": {
        "head_dim": 128, "rms_norm_eps": 1.5625e-07, "partial_rotary_factor": 0.5,
        "attention_bias": True, "max_position_embeddings": 131072,
    },
    "SeedOssForCausalLM": {
        "head_dim": 128, "attention_bias": True, "attention_out_bias": False,
        "max_position_embeddings": 524288,
    },
    "Ernie4_5ForCausalLM": {
        "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 5e5, "tie_word_embeddings": True,
        "max_position_embeddings": 131072,
    },
}  # fmt: skip

PREEMPTION_MODES = ("recompute", "swap", "auto")
# vLLM's: first come, first served, or by each request's priority (lower first), then arrival
SCHEDULING_POLICIES = ("fcfs", "priority")
# what sample logprobs hold (vLLM's logprobs_mode): the model's own log-softmax or logits
# ("raw"), or those the sampler draws from ("processed": after penalties, bans, token masks,
# temperature and top-k/top-p/min-p)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# vLLM's values of these arguments that are tandem's behaviour (EngineConfig.check_vllm_choices)
EXECUTOR_BACKENDS = ("mp", "uni", "external_launcher")
# field -> (its values, the first the default; what tandem does whatever the value)
ONE_BEHAVIOUR = {
    "tokenizer_mode": (("auto", "hf"), "tandem reads the model's tokenizer.json (a fast one)"),
    "model_impl": (("auto", "vllm"), "the model code is the engine's own"),
    "runner": (("auto", "generate", "pooling"), "one engine both generates and pools"),
    "convert": (
        ("auto", "none", "embed"),
        "embed pools any model's last token, normalized; classify needs a checkpoint's own "
        "score head (*ForSequenceClassification)",
    ),
}

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# why options of vLLM's are refused at other values, where several share the reason
EXPERTS_BY_TENSOR_PARALLEL = (
    "a MoE model's experts are split by tensor parallelism, each over every rank"
)
WEIGHTS_IN_DEVICE = "the weights stay in device memory"
TEXT_ONLY = "tandem serves text models alone"
DATA_PARALLEL = "one LLM is one engine; tandem serve --data-parallel-size runs replicas (Ray)"
NO_TRACES = "tandem exports no OpenTelemetry traces"
STATS = "its stats are /metrics (tandem serve) and disable_log_stats=False's line every 10 s"

# vLLM 0.26's EngineArgs fields of what tandem does not have, by why another value is refused:
# each is taken at vLLM's default alone, EngineConfig's too (VllmDefaults). Where that is an empty
# dict, list or set, or a config object of vLLM's defaults, None or any empty one is taken (None
# the field's).
AT_VLLM_DEFAULTS: dict[str, dict[str, Any]] = {
    "an engine's tensor-parallel ranks are processes tandem starts on one machine, meeting on a "
    "free local port": {"master_addr": "127.0.0.1", "master_port": 29501, "nnodes": 1, "node_rank": 0},
    "tandem's ranks keep torch.distributed's default timeouts": {
        "distributed_timeout_seconds": None, "cpu_distributed_timeout_seconds": None,
    },
    "tandem binds its ranks to no NUMA node or CPU list": {
        "numa_bind": False, "numa_bind_nodes": None, "numa_bind_cpus": None,
    },
    "rank i runs on GPU i of those CUDA_VISIBLE_DEVICES shows (with one rank, device='cuda:N' "
    "picks the GPU)": {"device_ids": []},
    "an engine's ranks are tandem's own processes, not Ray workers": {
        "ray_workers_use_nsight": False,
    },
    "each rank runs tandem's engine (worker_extension_cls names methods collective_rpc may run "
    "on it)": {"worker_cls": "auto"},
    "tandem has no context parallelism: tensor parallelism splits the heads, each rank attending "
    "over whole sequences": {
        "prefill_context_parallel_size": 1, "decode_context_parallel_size": 1,
        "dcp_comm_backend": "ag_rs", "dcp_kv_cache_interleave_size": 1,
        "cp_kv_cache_interleave_size": 1,
    },
    DATA_PARALLEL: {
        "data_parallel_rank": None, "data_parallel_start_rank": None,
        "data_parallel_size_local": None, "data_parallel_address": None,
        "data_parallel_rpc_port": None, "data_parallel_hybrid_lb": False,
        "data_parallel_external_lb": False, "data_parallel_multi_port_external_lb": False,
        "data_parallel_backend": "mp", "disable_nccl_for_dp_synchronization": None,
        "aggregate_engine_logging": False,
    },
    EXPERTS_BY_TENSOR_PARALLEL: {
        "enable_ep_weight_filter": False, "all2all_backend": "allgather_reducescatter",
        "enable_elastic_ep": False, "enable_eplb": False, "eplb_config": {},
        "expert_placement_strategy": "linear",
    },
    "a step runs as one batch: tandem splits none into micro-batches to overlap (dual batch "
    "overlap)": {
        "enable_dbo": False, "ubatch_size": 0, "dbo_decode_token_threshold": 32,
        "dbo_prefill_token_threshold": 512,
    },
    WEIGHTS_IN_DEVICE: {"offload_backend": "auto", "cpu_offload_params": set()},
    "the KV cache stays in device memory (a preempted request's blocks may go to host memory: "
    "preemption_mode, swap_space)": {"kv_offloading_size": None, "kv_offloading_backend": "native"},
    TEXT_ONLY: {
        "enable_mm_embeds": False, "interleave_mm_strings": False, "media_io_kwargs": {},
        "mm_processor_cache_type": "lru", "mm_shm_cache_max_object_size_mb": 128,
        "mm_encoder_only": False, "mm_encoder_tp_mode": "weights", "mm_encoder_attn_backend": None,
        "mm_encoder_attn_dtype": None, "mm_encoder_fp8_scale_path": None,
        "mm_encoder_fp8_scale_save_path": None, "mm_encoder_fp8_scale_save_margin": 1.5,
        "skip_mm_profiling": False, "video_pruning_rate": None, "mm_tensor_ipc": "direct_rpc",
        "mm_ipc_gpu_memory_gb": 0, "disable_chunked_mm_input": False,
        "enable_tower_connector_lora": False, "default_mm_loras": None,
        "enable_mm_processor_stats": False, "ec_transfer_config": None,
    },
    "tandem runs no Mamba or other state-space or linear-attention layers: its models are "
    "attention decoders": {
        "mamba_config": {}, "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto",
        "mamba_block_size": None, "mamba_cache_mode": "none", "mamba_backend": "triton",
        "enable_mamba_cache_stochastic_rounding": False, "mamba_cache_philox_rounds": 0,
        "gdn_prefill_backend": None,
    },
    "no model of tandem's shares KV between layers": {"kv_sharing_fast_prefill": False},
    NO_TRACES: {"collect_detailed_traces": None},
    f"tandem has no hidden metrics: {STATS}": {"show_hidden_metrics_for_version": None},
    f"tandem has no KV cache residency metrics: {STATS}": {
        "kv_cache_metrics": False, "kv_cache_metrics_sample": 0.01,
    },
    f"tandem has no CUDA graph metrics: {STATS}": {"cudagraph_metrics": False},
    f"tandem has no MFU metrics: {STATS}": {"enable_mfu_metrics": False},
    f"tandem logs no line per step: {STATS}": {"enable_logging_iteration_details": False},
    "tandem marks no NVTX range per layer": {"enable_layerwise_nvtx_tracing": False},
    "tandem watches for no compilation after warmup": {
        "jit_monitor_mode": "warn", "jit_monitor_verbose": False,
    },
    "tandem runs its own kernels, none of vLLM's backends (attention_backend picks the "
    "attention's)": {
        "kernel_config": {}, "ir_op_priority": {}, "moe_backend": "auto", "linear_backend": "auto",
        "enable_flashinfer_autotune": None, "enable_bf16x3_router_gemm": None,
    },
    "tandem has one performance mode: compilation_config shapes its CUDA graphs, max_num_seqs and "
    "max_num_batched_tokens its batches": {"performance_mode": "balanced"},
    "tandem has no platform plugins to configure": {"additional_config": {}},
    "the attention runs in the model's dtype (kv_cache_dtype sets the cache's)": {
        "override_attention_dtype": None,
    },
    "tandem's Gumbel noise is float32 (sampling.gumbel_noise)": {"use_fp64_gumbel": False},
    "tandem loads the weights from `model` itself": {"model_weights": ""},
    "tandem reads config.json from the model's folder or repository (hf_overrides changes its "
    "fields)": {"hf_config_path": None},
    "tandem does not prefetch checkpoint files into the page cache": {
        "safetensors_prefetch_num_threads": 8, "safetensors_prefetch_block_size": 16 * 2**20,
    },
    "the weights load as tandem loads them (load_format: auto, safetensors or dummy)": {
        "model_loader_extra_config": {},
    },
    "tandem reads safetensors files alone, never a PyTorch checkpoint (.bin, .pt)": {
        "pt_load_map_location": "cpu",
    },
    "tandem runs its own quantizations alone (quantization: fp8, gptq, awq, compressed-tensors)": {
        "allow_deprecated_quantization": False,
    },
    "the model code is the engine's own": {"model_class_overrides": {}},
    "an FP8 KV cache (kv_cache_dtype) holds every layer's keys and values": {
        "kv_cache_dtype_skip_layers": [],
    },
    "tandem admits a request whenever its blocks fit, keeping no free blocks back": {
        "watermark": 0.0,
    },
    "tandem admits waiting requests at every step": {"prefill_schedule_interval": 1},
    "the scheduler is tandem's own (scheduling_policy: fcfs or priority)": {"scheduler_cls": None},
    "tandem's prefix cache matches whole blocks (block_size tokens)": {"prefix_match_unit": None},
    "tandem slices an adapter as its projection's weight: A of a row-parallel projection, B of "
    "the others": {"fully_sharded_loras": False},
    "adapters run in the model's dtype": {"lora_dtype": "auto"},
    "an adapter runs on every projection it has weights for": {"lora_target_modules": None},
    "tandem's decode graphs are captured with LoRA and without, not per count of active "
    "adapters": {"specialize_active_lora": False},
    "LoRA on a mixture of experts is not supported": {
        "enable_mixed_moe_lora_format": False, "enable_moe_shared_loras": False,
    },
    "tandem publishes no KV cache events": {"kv_events_config": None},
    "tandem's reasoning parsers are its own (reasoning_parser: qwen3, deepseek_r1)": {
        "reasoning_parser_plugin": None, "reasoning_config": None,
    },
    "tandem's models decode left to right (no diffusion language models)": {
        "diffusion_config": None,
    },
    "tandem loads no IO processor plugins": {"io_processor_plugin": None},
    "tandem validates no VLLM_* variables (a wrong TANDEM_* switch fails)": {
        "fail_on_environ_validation": False,
    },
    "tandem allocates through torch's caching allocator (sleep mode needs no other)": {
        "enable_cumem_allocator": False,
    },
    "an engine's shutdown waits for no open request (tandem serve --shutdown-timeout, its "
    "--drain-timeout, does)": {"shutdown_timeout": 0},
}  # fmt: skip


def is_vllm_default(default: Any) -> Callable[[Any], bool]:
    """Whether a value is `default`, of its kind (True is not 1); for an empty dict, list or set,
    whether it is None or any empty one."""
    if isinstance(default, dict | list | set):
        return lambda v: v is None or (isinstance(v, dict | list | set | tuple) and not v)
    return lambda v: isinstance(v, bool) == isinstance(default, bool) and v == default


# vLLM's options tandem takes only where they ask for its own behaviour: name -> (whether a
# value does, why another is refused)
UNUSED_VLLM_OPTIONS: dict[str, tuple[Any, str]] = {
    "enable_chunked_prefill": (
        lambda v: v is True,
        "tandem always splits a prompt longer than a step's token budget "
        "(max_num_batched_tokens) over steps",
    ),
    "speculative_config": (lambda v: v is None, "tandem has no speculative decoding"),
    "enable_expert_parallel": (lambda v: v is False, EXPERTS_BY_TENSOR_PARALLEL),
    "cpu_offload_gb": (
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v == 0,
        f"{WEIGHTS_IN_DEVICE} (a quantization shrinks them)",
    ),
    "calculate_kv_scales": (
        lambda v: v is False,
        "an FP8 KV cache's scales are the checkpoint's k_scale and v_scale (1.0 without them)",
    ),
    "kv_transfer_config": (lambda v: v is None, "no KV cache moves between engines"),
    # vLLM's LLM(...) keywords at their defaults
    **{
        name: (is_vllm_default(default), WEIGHTS_IN_DEVICE)
        for name, default in [
            ("offload_group_size", 0),
            ("offload_num_in_group", 1),
            ("offload_prefetch_step", 1),
        ]
    },
    "offload_params": (lambda v: not v, WEIGHTS_IN_DEVICE),
    "chat_template": (
        lambda v: v is None,
        "LLM.chat takes chat_template per call, the server --chat-template",
    ),
    "pooler_config": (
        lambda v: v is None,
        "pooling is set per call by PoolingParams (normalize, use_activation, dimensions)",
    ),
    "quantization_config": (
        lambda v: v is None,
        "quantization names the scheme; a checkpoint's own settings are read from its config",
    ),
    **{
        name: (lambda v: v is None, "tandem has no speculative decoding")
        for name in ("spec_method", "spec_model", "spec_tokens")
    },
    # vLLM's scheduler options at their defaults: prompts chunked by the step's token budget
    # alone, no speculative lookahead
    **{
        name: (is_vllm_default(default), why)
        for name, default, why in [
            ("max_num_partial_prefills", 1, "tandem chunks prompts by the step's token budget"),
            ("max_long_partial_prefills", 1, "tandem chunks prompts by the step's token budget"),
            ("long_prefill_token_threshold", 0, "tandem chunks prompts by the step's token budget"),
            ("num_lookahead_slots", 0, "tandem has no speculative decoding"),
        ]
    },
    "limit_mm_per_prompt": (
        lambda v: v is None or (isinstance(v, dict) and not any(v.values())),
        "tandem serves text models: a prompt holds no images, audio or video (every count 0)",
    ),
    **{
        name: (lambda v: v is None or v == {} or v == "", TEXT_ONLY)
        for name in ("mm_processor_kwargs", "allowed_local_media_path", "allowed_media_domains")
    },
    "attention_config": (
        lambda v: v is None,
        "tandem picks its attention with attention_backend (triton, torch)",
    ),
    "enable_return_routed_experts": (lambda v: v is False, "no MoE routing is returned"),
    "disable_sliding_window": (
        lambda v: v is False,
        "a windowed model's layers attend over their window, as the checkpoint was trained",
    ),
    "data_parallel_size": (is_vllm_default(1), DATA_PARALLEL),
    "served_model_name": (
        lambda v: v is None,
        "an LLM serves no names; tandem serve --served-model-name names the server's model",
    ),
    # how vLLM loads and keys, which changes no output: tandem's way serves each
    "max_parallel_loading_workers": (
        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
        "a count of workers (a positive int) or None; the weights load as tandem loads them",
    ),
    "use_tqdm_on_load": (lambda v: isinstance(v, bool), "it is True or False"),
    "prefix_caching_hash_algo": (
        lambda v: v in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"),
        "vLLM's algorithms are sha256, sha256_cbor, xxhash and xxhash_cbor; tandem keys blocks "
        "by blake2b for each",
    ),
    "ignore_patterns": (
        lambda v: v in (None, [], "", "original/**/*", ["original/**/*"]),
        "tandem reads a checkpoint's config, tokenizer and safetensors files alone (never "
        "original/), so only vLLM's default pattern is taken",
    ),
    "otlp_traces_endpoint": (lambda v: v is None, NO_TRACES),
    **{
        name: (is_vllm_default(default), why)
        for why, defaults in AT_VLLM_DEFAULTS.items()
        for name, default in defaults.items()
    },
    # vLLM's defaults, and the values that ask for what tandem does
    "language_model_only": (
        lambda v: isinstance(v, bool),
        f"it is True or False: {TEXT_ONLY}, as True asks",
    ),
    "mm_processor_cache_gb": (
        lambda v: v in (0, 4) and not isinstance(v, bool),
        f"{TEXT_ONLY}: there is no multi-modal processor cache to size (0 and vLLM's 4 taken)",
    ),
    "disable_hybrid_kv_cache_manager": (
        lambda v: v is None or v is True,
        "every layer, sliding or full, keeps a sequence's whole KV in the same blocks, as True asks",
    ),
    "optimization_level": (
        lambda v: v in (2, 3) and not isinstance(v, bool),
        "tandem's CUDA graphs are vLLM's -O2's (-O3 is the same): whole graphs of decode steps, "
        "pieces of the others; compilation_config's cudagraph_mode or enforce_eager=True choose "
        "others",
    ),
    "config_format": (
        lambda v: v in ("auto", "hf"),
        "tandem reads the model's config.json (Hugging Face's format), not Mistral's params.json",
    ),
    "safetensors_load_strategy": (
        lambda v: v in (None, "lazy"),
        "tandem memory-maps each safetensors file as it reads it (vLLM's 'lazy')",
    ),
    # taken where they change no output
    "scheduler_reserve_full_isl": (
        lambda v: isinstance(v, bool),
        "it is True or False; tandem admits a request once the blocks of its first chunk fit "
        "whatever it is (which moves when a request starts, never its tokens)",
    ),
    "renderer_num_workers": (
        lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
        "a count of threads (an int >= 1); tandem serve tokenizes on asyncio's thread pool "
        "whatever it is",
    ),
    "code_revision": (
        lambda v: v is None or isinstance(v, str),
        "None or a revision (a str): tandem runs no code from a checkpoint, at any revision",
    ),
}

# max_model_len's vLLM value (or "auto") for the longest the KV cache holds, the model's at most
FIT_TO_CACHE = -1

# vLLM's EngineArgs leave these None for the engine to choose: tandem's defaults then
ENGINE_CHOOSES = (
    "enable_prefix_caching", "enable_chunked_prefill", "max_num_seqs", "max_num_batched_tokens",
)  # fmt: skip

# vLLM's other spellings of a dtype: its "half" and "float", and torch dtypes themselves
DTYPE_ALIASES: dict[Any, str] = {
    "half": "float16",
    "float": "float32",
    **{dtype: name for name, dtype in DTYPES.items()},
}


# vLLM's `quantization` values for int4 checkpoints -> the format (quant_method) each reads
# ("gptq_marlin", "awq_marlin": vLLM's kernel choices for the same checkpoints)
INT4_QUANTIZATIONS = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
                      "compressed-tensors": "compressed-tensors"}  # fmt: skip
QUANTIZATIONS = ("fp8", *INT4_QUANTIZATIONS)

# "fp8" is e4m3 (as vLLM's default "fp8"); None: the model's dtype
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


class HFConfig(SimpleNamespace):
    """A config.json read by attribute, as transformers' config is (`cfg.num_hidden_layers`,
    `getattr(cfg, "num_experts", 0)`): a sub-config (a `*_config` object, e.g. a multimodal
    model's `text_config`) likewise, every other value as the JSON has it."""

    def __init__(self, values: dict[str, Any] | None = None):  # None: pickle's, then filled
        super().__init__(**{
            key: HFConfig(value) if key.endswith("_config") and isinstance(value, dict) else value
            for key, value in (values or {}).items()
        })  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The JSON's dict again (transformers' name)."""
        return {
            key: value.to_dict() if isinstance(value, HFConfig) else value
            for key, value in vars(self).items()
        }


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    hidden_act: str = "silu"  # "silu" or "gelu_tanh" (GeGLU)
    # per layer: attends over the last sliding_window tokens only ("sliding_attention" layers)
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3's sliding layers: default rope at this base
    # Gemma
    query_pre_attn_scalar: float | None = None  # the softmax scale is its inverse square root
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (num_experts 0: dense); moe_layers[i]: layer i's MLP is the experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[bool, ...] = ()
    # Qwen2-MoE: a dense expert every token takes, scaled by sigmoid(its gate) (0: none)
    shared_expert_intermediate_size: int = 0
    # a sequence classifier's labels (CLASSIFIERS); 0 for a generative model
    num_labels: int = 0
    # the leading dimensions of a head that rotate (partial_rotary_factor; 0: all head_dim);
    # the loader reorders q and k so that they rotate as a full-width table (rope.py)
    rotary_dim: int = 0
    # GLM-4: the rotary pairs are neighbours (2i, 2i + 1), not halves; reordered likewise
    rotary_interleaved: bool = False
    # per layer: whether its q and k rotate (SmolLM3's no_rope_layers: a layer of 0 has no
    # position embedding); empty: every layer's do
    rope_layers: tuple[bool, ...] = ()
    # Granite's multipliers (None: 1): the softmax scale (for head_dim ** -0.5; Granite's
    # always set, 1.0 when its config leaves it out), the embeddings',
    # what each attention and MLP adds to the residual stream (folded into the o and down
    # projections at load: hf_names), and the logits' divisor
    attention_multiplier: float | None = None
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    # the context the engine serves (vLLM's model_config.max_model_len): set by the engine once
    # it is known (a length fitted to the KV cache too); None in a config read from a file
    max_model_len: int | None = None
    # vLLM's model_config.hf_config: config.json as read (hf_overrides merged in), by attribute
    hf_config: HFConfig | None = field(default=None, compare=False, repr=False)
    # vLLM's model_config.model and .dtype: the folder, preset or Hub id the engine loaded, and
    # its weights' dtype; set by the engine, as max_model_len
    model: str | None = None
    dtype: torch.dtype | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict; raises ValueError for what tandem cannot run, naming the
        field (a field that changes the math and is not implemented is never ignored)."""
        archs = hf.get("architectures") or []
        if not isinstance(archs, list):  # a bare name would be read letter by letter
            raise ValueError(f"config.json's architectures must be a list, got {archs!r:.80}")
        classifier = next((CLASSIFIERS[a] for a in archs if a in CLASSIFIERS), None)
        arch = classifier or next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hf = {**CONFIG_DEFAULTS.get(arch, {}), **hf}
        refuse_unimplemented(hf, arch)
        act_field = "hidden_activation" if arch in GEMMA else "hidden_act"
        act = hf.get(act_field) or hf.get("hidden_act") or "silu"
        if act not in ACTIVATIONS or (arch not in GEMMA and act != "silu"):
            raise ValueError(
                f"unsupported {act_field} {act!r} in config.json; supported: "
                + ("'gelu_pytorch_tanh', " if arch in GEMMA else "")
                + "'silu'"
            )
        num_heads = size_field(hf, "num_attention_heads")
        num_layers = size_field(hf, "num_hidden_layers")
        hidden_size = size_field(hf, "hidden_size")
        head_dim = size_field(hf, "head_dim", hidden_size // num_heads)
        rotary_dim = rotary_dim_of(hf, head_dim)
        rope_theta, rope_scaling, rope_local_theta = parse_rope(hf, arch, rotary_dim)
        positions = position_limit(arch, hf.get("max_position_embeddings", 4096), rope_scaling)
        window, sliding_layers = parse_window(hf, arch, num_layers, positions)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        # Qwen2: q, k and v biases and no o bias (Qwen2-MoE: unless qkv_bias=false; GLM-4:
        # unless attention_bias=false)
        qkv_bias_only = (
            arch == "Qwen2ForCausalLM"
            or (arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True)))
            or (arch == "Glm4ForCausalLM" and bool(hf["attention_bias"]))
        )
        attention_bias = bool(hf.get("attention_bias") or False)
        # Seed-OSS: the o projection's bias apart (attention_out_bias)
        o_bias = hf.get("attention_out_bias", attention_bias and not qkv_bias_only)
        gemma = arch in GEMMA
        return cls(
            architecture=arch,
            vocab_size=size_field(hf, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=size_field(hf, "intermediate_size", 0),  # 0: every layer MoE
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=kv_heads(hf, num_heads),
            head_dim=head_dim,
            rms_norm_eps=number_field(hf, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            # a classifier has no LM head: the embeddings stand in for the token it samples
            tie_word_embeddings=bool(classifier or hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias_only or attention_bias,
            o_proj_bias=bool(o_bias),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            eos_token_ids=eos_ids,
            hidden_act=ACTIVATIONS[act],
            sliding_window=window,
            sliding_layers=sliding_layers,
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma else None,
            # Gemma 3 keeps the field but caps no attention (transformers', vLLM's)
            attn_logit_softcapping=(
                hf.get("attn_logit_softcapping") if arch == "Gemma2ForCausalLM" else None
            ),
            final_logit_softcapping=hf.get("final_logit_softcapping") if gemma else None,
            **parse_moe(hf, arch, num_layers),
            num_labels=(len(hf.get("id2label") or {}) or int(hf.get("num_labels", 2)))
            if classifier
            else 0,
            rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
            rotary_interleaved=arch in INTERLEAVED_ROTARY,
            rope_layers=parse_rope_layers(hf, arch, num_layers),
            **parse_multipliers(hf, arch),
            hf_config=HFConfig(hf),
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def num_params(self) -> int:
        """Parameters of the weights a forward pass reads (the LM head counted once; every
        expert of a mixture counted)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size if self.qkv_bias else 0) + (
            h if self.o_proj_bias else 0
        )
        norms = (4 if self.architecture in SANDWICH else 2) * h + (2 * d if self.qk_norm else 0)
        if self.architecture in OLMO:  # q and k normed whole
            norms += self.q_size + self.kv_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        total = embed + h
        for layer in range(self.num_layers):
            if self.is_moe_layer(layer):
                mlp = 3 * h * self.moe_intermediate_size * self.num_experts + h * self.num_experts
                if self.shared_expert_intermediate_size:
                    mlp += 3 * h * self.shared_expert_intermediate_size + h
            else:
                mlp = 3 * h * self.intermediate_size
            total += attn + mlp + norms
        return total


def size_field(hf: dict[str, Any], name: str, default: int | None = None) -> int:
    """config.json's `name`, an integer >= 1 (`default` where it is absent, null or 0); a
    ValueError naming the field otherwise, before any shape is computed from it."""
    value = hf.get(name)
    if value is None and default is None:
        raise ValueError(f"config.json needs {name}, an integer >= 1")
    if value is None or (value == 0 and default is not None):
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"config.json's {name} must be an integer >= 1, got {value!r}")
    return value


def kv_heads(hf: dict[str, Any], num_heads: int) -> int:
    """num_key_value_heads (num_heads where absent): each serves a whole group of query heads."""
    num_kv_heads = size_field(hf, "num_key_value_heads", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"config.json's num_attention_heads ({num_heads}) must be a multiple of its "
            f"num_key_value_heads ({num_kv_heads})"
        )
    return num_kv_heads


def number_field(hf: dict[str, Any], name: str, default: float) -> float:
    """config.json's `name`, a finite number (`default` where it is absent); a ValueError naming
    the field otherwise."""
    value = hf.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"config.json's {name} must be a number, got {value!r}")
    return float(value)


def refuse_unimplemented(hf: dict[str, Any], arch: str) -> None:
    """ValueError naming the first config.json field that changes the math in a way tandem
    does not implement."""
    if hf.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias=true in config.json")
    if hf.get("use_bias"):  # ERNIE 4.5's, which puts biases in the MLP too
        raise ValueError("unsupported use_bias=true in config.json (biases in the MLP)")
    partial = partial_rotary_factor(hf)
    if partial != 1.0 and arch not in PARTIAL_ROTARY:
        raise ValueError(
            f"unsupported partial_rotary_factor={partial} in config.json for {arch}; only 1.0 "
            f"(partial rotary: {', '.join(PARTIAL_ROTARY)})"
        )
    if hf.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention=true in config.json")
    if hf.get("shared_expert_intermediate_size") and arch != "Qwen2MoeForCausalLM":
        raise ValueError(f"unsupported shared_expert_intermediate_size (shared experts) for {arch}")
    kinds = set(hf.get("layer_types") or ())
    if kinds - {"sliding_attention", "full_attention"}:
        raise ValueError(f"unsupported layer_types {sorted(kinds)} in config.json")


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    rope = {**(hf.get("rope_parameters") or {}), **(hf.get("rope_scaling") or {})}
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    return 1.0 if partial is None else float(partial)


def rotary_dim_of(hf: dict[str, Any], head_dim: int) -> int:
    """The dimensions of each head that rotate: the first head_dim * partial_rotary_factor
    (Phi-4-mini: 0.75), an even number whose rest is even too (`hf_names.rotary_order`)."""
    dim = int(head_dim * partial_rotary_factor(hf))
    if not 0 < dim <= head_dim or dim % 2 or (head_dim - dim) % 2:
        raise ValueError(
            f"partial_rotary_factor={partial_rotary_factor(hf)} of head_dim {head_dim} leaves "
            f"{dim} rotary dimensions; an even number with an even rest is supported"
        )
    return dim


def parse_rope(
    hf: dict[str, Any], arch: str, rotary_dim: int
) -> tuple[float, dict[str, Any] | None, float | None]:
    """(rope_theta, rope_scaling with its rope_type or None, Gemma 3's local theta or None) from
    either layout: legacy rope_theta + rope_scaling, or transformers 5's rope_parameters (per
    layer type for Gemma 3)."""
    params = dict(hf.get("rope_parameters") or {})
    local_theta = None
    if arch in ("Gemma3ForCausalLM", "Olmo3ForCausalLM"):
        # sliding layers: default rope at their own base (OLMo 3: the full layers' base)
        default_local = 10000.0 if arch == "Gemma3ForCausalLM" else hf.get("rope_theta", 500000.0)
        if "full_attention" in params or "sliding_attention" in params:
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ValueError("unsupported rope_type for sliding_attention layers: only default")
            local_theta = float(local.get("rope_theta", default_local))
            params = dict(params.get("full_attention") or {})
        else:
            local_theta = float(hf.get("rope_local_base_freq", default_local))
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    if hf.get("rope_scaling"):
        params.update(hf["rope_scaling"])
    params.pop("partial_rotary_factor", None)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi-3's names for it, as transformers reads them
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(map(repr, ROPE_TYPES))}"
        )
    if rope_type == "default":
        return theta, None, local_theta
    max_position = hf.get("max_position_embeddings", 4096)
    if rope_type in ("yarn", "longrope", "llama3"):  # transformers': the top-level field first
        if hf.get("original_max_position_embeddings") is not None:  # (Phi-3 keeps it there)
            params["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
        params.setdefault("original_max_position_embeddings", max_position)
    if params.get("factor") is None and rope_type in ("yarn", "longrope"):
        params["factor"] = max_position / params["original_max_position_embeddings"]
    needed = {
        "linear": ("factor",),
        "dynamic": ("factor",),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
        "longrope": ("short_factor", "long_factor"),
    }.get(rope_type, ())
    for key in needed:
        if params.get(key) is None:
            raise ValueError(f"rope type {rope_type!r} needs rope_scaling.{key} in config.json")
    for key in ("short_factor", "long_factor") if rope_type == "longrope" else ():
        if not isinstance(params[key], list) or len(params[key]) != rotary_dim // 2:
            raise ValueError(
                f"rope_scaling.{key} must list {rotary_dim // 2} numbers (half the rotary "
                f"dimensions), got {params[key]!r:.80}"
            )
    return theta, {"rope_type": rope_type, **params}, local_theta


def parse_multipliers(hf: dict[str, Any], arch: str) -> dict[str, float | None]:
    """Granite's four multipliers, those that are not 1 (as floats; the attention's always,
    being the softmax scale); {} for other models."""
    if arch != "GraniteForCausalLM":
        return {}
    names = ("attention_multiplier", "embedding_multiplier", "residual_multiplier")
    values = {name: hf.get(name, 1.0) for name in (*names, "logits_scaling")}
    for name, value in values.items():
        if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive number in config.json, got {value!r}")
    scales = {name: None if value == 1 else float(value) for name, value in values.items()}
    # the softmax scale itself (1.0 by default), not a factor on head_dim ** -0.5
    scales["attention_multiplier"] = float(values["attention_multiplier"])
    return scales


def parse_rope_layers(hf: dict[str, Any], arch: str, num_layers: int) -> tuple[bool, ...]:
    """SmolLM3's layers that rotate q and k: `no_rope_layers` (1: rotary, 0: none), else every
    `no_rope_layer_interval`-th layer without (transformers' default); () for the others."""
    if arch != "SmolLM3ForCausalLM":
        return ()
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = hf.get("no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(flags) < num_layers:
        raise ValueError(
            f"no_rope_layers has {len(flags)} entries for {num_layers} layers in config.json"
        )
    return tuple(bool(flag) for flag in flags[:num_layers])


def parse_window(
    hf: dict[str, Any], arch: str, num_layers: int, positions: int
) -> tuple[int | None, tuple[bool, ...]]:
    """(sliding_window or None, which layers use it); `positions`: the longest sequence the
    model serves (`position_limit`). Only the architectures whose transformers code windows
    read the field: a stray `sliding_window` elsewhere (GLM-4, Granite, ...) windows nothing."""
    if arch not in (*WINDOWED_EVERYWHERE, *WINDOWED_LAYERS, *QWEN_WINDOW_FLAG):
        return None, ()
    window = hf.get("sliding_window")
    if arch in QWEN_WINDOW_FLAG:
        if window is not None and hf.get("use_sliding_window"):
            raise ValueError(
                f"unsupported use_sliding_window=true (sliding_window={window}) for {arch}; "
                "use a checkpoint without it"
            )
        return None, ()
    if window is None:
        return None, ()
    if arch in WINDOWED_EVERYWHERE:
        if window >= positions:
            return None, ()  # wider than any sequence (Phi-4-mini's 262,144): no window at all
        layers = (True,) * num_layers
    else:  # Gemma, OLMo 3: alternating sliding and full layers
        kinds = hf.get("layer_types")
        if kinds is None:
            default = {"Gemma2ForCausalLM": 2, "Olmo3ForCausalLM": 4}.get(arch, 6)
            pattern = hf.get("sliding_window_pattern", default)
            kinds = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)
            ]
        if len(kinds) != num_layers:
            raise ValueError(
                f"layer_types lists {len(kinds)} layers, num_hidden_layers={num_layers}"
            )
        layers = tuple(kind == "sliding_attention" for kind in kinds)
    return int(window), layers


def parse_moe(hf: dict[str, Any], arch: str, num_layers: int) -> dict[str, Any]:
    if arch not in MOE:
        return {}
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, Mixtral's name
    num_experts = size_field(hf, "num_local_experts", 0) or size_field(hf, "num_experts", 0)
    if not num_experts:
        raise ValueError(f"{arch} needs num_experts (or num_local_experts) in config.json")
    if arch == "MixtralForCausalLM":
        inter = size_field(hf, "intermediate_size")
        norm_topk_prob, moe_layers = True, (True,) * num_layers
    else:
        inter = size_field(hf, "moe_intermediate_size")
        norm_topk_prob = bool(hf.get("norm_topk_prob", False))
        step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    top_k = size_field(hf, "num_experts_per_tok")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts} (the experts)")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": inter,
        "norm_topk_prob": norm_topk_prob,
        "moe_layers": moe_layers,
        "shared_expert_intermediate_size": hf.get("shared_expert_intermediate_size") or 0,
    }


# EngineConfig's fields of AT_VLLM_DEFAULTS: keyword-only, left out of its repr
VllmDefaults = make_dataclass(
    "VllmDefaults",
    [
        (name, Any, field(default=None if isinstance(default, dict | list | set) else default,
                          kw_only=True, repr=False))
        for defaults in AT_VLLM_DEFAULTS.values()
        for name, default in defaults.items()
    ],
    namespace={"__module__": __name__},
)  # fmt: skip


@dataclass
class EngineConfig(VllmDefaults):
    """Settings of one engine; `validate` turns user mistakes into ValueErrors naming the field."""

    # a model folder, a preset name (random weights), or a Hugging Face Hub repository id
    model: str
    # a folder or Hub repository with the tokenizer.json to use (vLLM's `tokenizer`): default,
    # the model's own
    tokenizer: str | None = None
    # vLLM's: a Hub model's branch, tag or commit (None: its default branch), the tokenizer's
    # (when it is a Hub repository), and where downloads go (None: the Hub's cache)
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    # vLLM's: the Hub's token for private or gated repositories (True: the saved login's)
    hf_token: bool | str | None = None
    # vLLM's: fields merged into the model's config.json as it is read (a dict merges into a
    # nested config)
    hf_overrides: dict | None = None
    # vLLM's, taking the values that are tandem's behaviour (the others are ValueErrors saying
    # why): ranks are processes the engine starts on this machine ("mp"; "uni" and
    # "external_launcher" run one in the caller's process, as tensor_parallel_size=1 does), the
    # tokenizer is tokenizer.json's fast one, the model code is the engine's own, and one engine
    # generates and pools (LLM.embed, LLM.classify) whatever `runner` and `convert` say
    distributed_executor_backend: str | None = None
    tokenizer_mode: str = "auto"
    model_impl: str = "auto"
    runner: str = "auto"
    convert: str = "auto"
    # vLLM's: "fcfs" (first come, first served) or "priority" (each request's priority, lower
    # first, then arrival; the least important running request is the one preempted)
    scheduling_policy: str = "fcfs"
    device: str | None = None
    dtype: str = "auto"  # vLLM's "half" and "float" and torch dtypes too: a DTYPES name once valid
    # None: the model's; FIT_TO_CACHE (-1, or vLLM's "auto"): the longest the KV cache holds
    max_model_len: int | str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_blocks: int | None = None
    num_gpu_blocks_override: int | None = None  # vLLM's name for num_blocks
    # vLLM's: the KV cache's size in bytes, in place of sizing it from gpu_memory_utilization
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    seed: int | None = 0  # None: vLLM's default of 0, one seed on every rank
    attention_backend: str | None = None  # "triton" on CUDA, "torch" elsewhere
    async_batching: bool = True
    cuda_graphs: bool | None = None
    enforce_eager: bool = False  # vLLM's name for cuda_graphs=False: every step runs eagerly
    # vLLM's: each decode row reads its whole context, no block once per group of rows
    disable_cascade_attn: bool = False
    # vLLM's: its CUDA-graph options shape the graphs (compilation.py), the rest are taken
    compilation_config: dict | int | str | None = None
    # vLLM's top-level spellings of two of its keys, put into it by validate
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    # taken for vLLM's signature: tandem runs no code from a checkpoint, whatever its value
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    # LoRA adapters (lora/adapters.py): up to max_loras in one step, each of rank <=
    # max_lora_rank; max_cpu_loras adapters kept read in host memory (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # prompts given as embeddings ({"prompt_embeds": tensor}; prompt_embeds.py), vLLM's flag
    enable_prompt_embeds: bool = False
    # custom logits processors, vLLM's: LogitsProcessor subclasses or their "module:Class"
    # names (logits_processors.py)
    logits_processors: list | None = None
    # "fp8": FP8 weights of a bf16 checkpoint, made at load; "gptq", "awq", "compressed-tensors"
    # (and vLLM's "gptq_marlin", "awq_marlin"): the checkpoint's int4 format, checked against it
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # "fp8" (e4m3, per-tensor scales): half a bf16 cache's bytes
    # bit-identical tokens and logprobs whatever else is batched (batch_invariant.py)
    deterministic: bool = False
    # how a request gives up its KV blocks when they run out (swap.py): "recompute" frees them,
    # "swap" copies them to `swap_space` GiB of pinned host memory, "auto" picks per request
    preemption_mode: str = "auto"
    swap_space: float = 4.0
    # the model's recommended sampling defaults (generation_config.py): "auto" from its
    # generation_config.json, "vllm" none, or a folder holding one; override: fields on top
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # lets a trainer process send weights (weight_transfer/): {"backend": "nccl" or "ipc"}
    weight_transfer_config: Any = None
    # "qwen3" or "deepseek_r1" (reasoning.py): a structured-output grammar starts after the
    # thinking; the server splits the thinking into message.reasoning
    reasoning_parser: str | None = None
    # vLLM's engine-wide grammar options (structured.py's StructuredOutputsConfig): a dict, its
    # JSON or None; its reasoning_parser is the one above
    structured_outputs_config: Any = None
    # one of LOGPROBS_MODES: what sample logprobs hold (prompt logprobs stay raw_logprobs)
    logprobs_mode: str = "raw_logprobs"
    # the most top ids a request's logprobs or prompt_logprobs may ask for (vLLM's; -1: the
    # whole vocabulary): the width of the slots' logprob buffers (`logprobs_width`)
    max_logprobs: int = 20
    # vLLM's: a stream (AsyncLLM, the server) sends a request's tokens once this many have come,
    # the first token and the last at once; 1: every step's
    stream_interval: int = 1
    # no tokenizer loaded (vLLM's): prompts come as token ids, outputs carry no text
    skip_tokenizer_init: bool = False
    # taken for vLLM's signature, whatever their values: sleep mode needs no allocator of its
    # own here (LLM.sleep always works), and tensor parallelism all-reduces through NCCL alone
    enable_sleep_mode: bool = False
    disable_custom_all_reduce: bool = False
    # vLLM's, with only the value that is tandem's behaviour: long prompts are always split over
    # steps
    enable_chunked_prefill: bool = True
    # vLLM's name for async_batching (None: async_batching decides)
    async_scheduling: bool | None = None
    # vLLM's, with only the values tandem runs: one pipeline stage, no speculative decoding
    # (UNUSED_VLLM_OPTIONS)
    pipeline_parallel_size: int = 1
    speculative_config: dict | None = None
    # vLLM's, taken at the values that ask for what tandem does (UNUSED_VLLM_OPTIONS says why)
    enable_expert_parallel: bool = False
    cpu_offload_gb: float = 0
    calculate_kv_scales: bool = False
    kv_transfer_config: dict | None = None
    offload_group_size: int = 0
    offload_num_in_group: int = 1
    offload_prefetch_step: int = 1
    offload_params: set | None = None
    chat_template: str | None = None
    pooler_config: Any = None
    quantization_config: Any = None
    spec_method: str | None = None
    spec_model: str | None = None
    spec_tokens: int | None = None
    limit_mm_per_prompt: dict | None = None  # a text model's: None, or every count 0
    disable_mm_preprocessor_cache: bool = False  # no effect: tandem has no multi-modal inputs
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    num_lookahead_slots: int = 0
    mm_processor_kwargs: dict | None = None
    allowed_local_media_path: str = ""
    allowed_media_domains: list | None = None
    attention_config: dict | None = None
    enable_return_routed_experts: bool = False
    disable_sliding_window: bool = False
    data_parallel_size: int = 1
    # vLLM's: "package.module.Class", whose methods collective_rpc may name (rpc.py)
    worker_extension_cls: str | None = ""
    served_model_name: str | list | None = None
    max_parallel_loading_workers: int | None = None
    use_tqdm_on_load: bool = True
    prefix_caching_hash_algo: str = "sha256"
    ignore_patterns: str | list | None = None
    otlp_traces_endpoint: str | None = None
    # vLLM's, taken at its defaults and at the values that ask for what tandem does
    # (UNUSED_VLLM_OPTIONS)
    language_model_only: bool = False
    mm_processor_cache_gb: float = 4
    disable_hybrid_kv_cache_manager: bool | None = None
    optimization_level: int = 2
    config_format: str = "auto"
    safetensors_load_strategy: str | None = None
    scheduler_reserve_full_isl: bool = True
    renderer_num_workers: int = 1
    code_revision: str | None = None
    # vLLM's: True loads no tokenizer (skip_tokenizer_init=True)
    tokens_only: bool = False
    # vLLM's: the most tokens a step schedules (None: max_num_batched_tokens, which vLLM keeps
    # it below for speculative tokens, tandem drafting none): a smaller value becomes
    # max_num_batched_tokens, the step's token budget
    max_num_scheduled_tokens: int | None = None
    # False: a line of stats every 10 s of stepping, on the "tandem.metrics" logger (vLLM's)
    disable_log_stats: bool = True
    # vLLM's AsyncEngineArgs field: AsyncLLM logs each request it adds and each abort (INFO, on
    # the "tandem.async_llm" logger; `tandem serve --enable-log-requests` its prompts too)
    enable_log_requests: bool = False
    # vLLM's: {"profiler": "torch", "torch_profiler_dir": "/abs/dir", ...} lets
    # LLM.start_profile()/stop_profile() run torch.profiler ("cuda": the CUDA profiler's range)
    profiler_config: dict | None = None

    def check_structured_outputs_config(self) -> None:
        """Read structured_outputs_config; its reasoning_parser (vLLM keeps the engine's there)
        becomes reasoning_parser, or must agree with it."""
        from tandem.structured import StructuredOutputsConfig

        config = StructuredOutputsConfig.of(self.structured_outputs_config)
        if config.reasoning_parser:
            if self.reasoning_parser not in (None, config.reasoning_parser):
                raise ValueError(
                    f"structured_outputs_config.reasoning_parser={config.reasoning_parser!r} "
                    f"contradicts reasoning_parser={self.reasoning_parser!r}"
                )
            self.reasoning_parser = config.reasoning_parser
        self.structured_outputs_config = config

    def check_vllm_only_values(self) -> None:
        """vLLM's arguments that name a tandem behaviour, or that tandem runs at one value."""
        if self.async_scheduling is not None:
            check_bools(self, "async_scheduling")
            if self.async_scheduling and not self.async_batching:
                raise ValueError(
                    "async_scheduling=True (vLLM's name for async_batching) contradicts "
                    "async_batching=False"
                )
            self.async_batching = self.async_scheduling
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        if self.pipeline_parallel_size > 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} is not supported: split a "
                "model over GPUs with tensor_parallel_size, or serve replicas with "
                "--data-parallel-size"
            )
        for name, (neutral, why) in UNUSED_VLLM_OPTIONS.items():
            value = getattr(self, name)
            if not neutral(value):
                raise ValueError(f"{name}={value!r} is not supported: {why}")
        check_bools(self, "disable_mm_preprocessor_cache", "tokens_only")
        if self.tokens_only:
            self.skip_tokenizer_init = True
        scheduled = self.max_num_scheduled_tokens
        if scheduled is not None:
            check_int("max_num_scheduled_tokens", scheduled, 1)
            if scheduled > self.max_num_batched_tokens:
                raise ValueError(
                    f"max_num_scheduled_tokens={scheduled} exceeds max_num_batched_tokens="
                    f"{self.max_num_batched_tokens}, the most tokens a step's buffers hold"
                )
            self.max_num_batched_tokens = scheduled

    def logprobs_width(self, vocab_size: int) -> int:
        """The most top ids a position returns: max_logprobs, the whole vocabulary for -1."""
        return vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)

    def validate(self) -> None:
        from tandem.reasoning import check_parser
        from tandem.sampling import check_seed
        from tandem.torch_profile import checked_config
        from tandem.weight_transfer import as_config  # torch.distributed, only when validating

        for name in ENGINE_CHOOSES:  # None: vLLM's "the engine decides"
            if getattr(self, name) is None:
                setattr(self, name, next(f.default for f in fields(self) if f.name == name))
        if self.reasoning_parser == "":  # vLLM's default: none
            self.reasoning_parser = None
        if not isinstance(self.model, str | os.PathLike) or not str(self.model):
            raise ValueError(
                "model must name a model folder, a Hub repository or a preset, got "
                f"{self.model!r:.80}"
            )
        self.weight_transfer_config = as_config(self.weight_transfer_config)
        self.check_structured_outputs_config()
        check_parser(self.reasoning_parser)
        if self.seed is None:
            self.seed = 0
        check_seed(self.seed)
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("stream_interval", self.stream_interval, 1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks_override is not None:
            check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
            if self.num_blocks not in (None, self.num_gpu_blocks_override):
                raise ValueError(
                    "num_gpu_blocks_override is vLLM's name for num_blocks: give one of them"
                )
            self.num_blocks = self.num_gpu_blocks_override
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1)
        if self.kv_cache_memory_bytes is not None:
            check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
            if self.num_blocks is not None:
                raise ValueError("kv_cache_memory_bytes and num_blocks each size the KV cache")
        if isinstance(self.max_model_len, str) and self.max_model_len.lower() == "auto":
            self.max_model_len = FIT_TO_CACHE
        if self.max_model_len not in (None, FIT_TO_CACHE):
            check_int("max_model_len", self.max_model_len, 1, "or -1 (fit to the KV cache)")
        utilization = self.gpu_memory_utilization
        is_number = isinstance(utilization, int | float) and not isinstance(utilization, bool)
        if not is_number or not 0.0 < utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}"
            )
        check_bools(
            self, "enable_prefix_caching", "deterministic", "trust_remote_code", "enforce_eager",
            "skip_tokenizer_init", "enable_sleep_mode", "disable_custom_all_reduce",
            "enable_chunked_prefill", "disable_log_stats", "disable_cascade_attn",
            "enable_log_requests",
        )  # fmt: skip
        self.check_lora()
        self.compilation_config = with_graph_sizes(
            self.compilation_config,
            cudagraph_capture_sizes=self.cudagraph_capture_sizes,
            max_cudagraph_capture_size=self.max_cudagraph_capture_size,
        )
        graph_plan(self.compilation_config)  # a ValueError naming a bad key or value
        if self.enforce_eager and self.cuda_graphs:
            raise ValueError(
                "enforce_eager=True runs no CUDA graphs: it contradicts cuda_graphs=True"
            )
        if self.deterministic and self.tensor_parallel_size > 1:
            raise ValueError(
                "deterministic=True runs on one device: the all-reduce of tensor_parallel_size > 1 "
                "sums in an order that follows the batch size"
            )
        for name in ("tokenizer", "revision", "tokenizer_revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        self.check_vllm_choices()
        check_int("max_logprobs", self.max_logprobs, -1, "(-1: the whole vocabulary)")
        self.profiler_config = checked_config(self.profiler_config)
        self.check_vllm_only_values()
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                f"got {self.scheduling_policy!r}"
            )
        space = self.swap_space
        if (
            not isinstance(space, int | float)
            or isinstance(space, bool)
            or not 0 <= space < float("inf")
        ):
            raise ValueError(f"swap_space must be a finite number of GiB >= 0, got {space!r}")
        tokenizer = self.tokenizer and Path(self.tokenizer).expanduser()
        if tokenizer and tokenizer.is_dir() and not (tokenizer / "tokenizer.json").is_file():
            raise ValueError(
                f"tokenizer must be a folder with a tokenizer.json, got {self.tokenizer!r}"
            )
        if self.load_format == "safetensors":  # vLLM's: what tandem's "auto" reads
            self.load_format = "auto"
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(
                f"load_format must be 'auto' (or 'safetensors': tandem reads safetensors files) "
                f"or 'dummy', got {self.load_format!r}"
            )
        if isinstance(self.dtype, str | torch.dtype):
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be 'auto', one of {sorted(DTYPES)} or vLLM's 'half' or 'float', got "
                f"{self.dtype!r}"
            )
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be None, 'cpu' or 'cuda', got {self.device!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be None or one of {list(QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        if not isinstance(self.generation_config, str):
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder, "
                f"got {self.generation_config!r}"
            )
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}"
            )

    def check_lora(self) -> None:
        check_bools(self, "enable_lora", "enable_prompt_embeds")
        if self.enable_prompt_embeds and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_prompt_embeds=True runs on one device: tensor_parallel_size must be 1"
            )
        if self.logits_processors is not None and not isinstance(
            self.logits_processors, (list, tuple)
        ):
            raise TypeError(
                "logits_processors is a list of LogitsProcessor subclasses or their names, "
                f"got {self.logits_processors!r:.80}"
            )
        check_int("max_loras", self.max_loras, 1)
        check_int("max_lora_rank", self.max_lora_rank, 1)
        if self.max_cpu_loras is not None:
            check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras, "(max_loras)")
        if self.enable_lora and self.quantization is not None:
            raise ValueError(
                "enable_lora=True runs adapters on unquantized weights: drop quantization"
            )
        if self.enable_lora and self.deterministic:
            raise ValueError(
                "enable_lora=True with deterministic=True is not supported: the adapters' "
                "products are not batch-invariant"
            )

    def check_vllm_choices(self) -> None:
        """vLLM's arguments that tandem takes for one behaviour: the other values, ValueErrors."""
        token = self.hf_token
        if (
            token is not None
            and not isinstance(token, bool)
            and not (isinstance(token, str) and token)
        ):
            raise ValueError(f"hf_token must be a non-empty string, a bool or None, got {token!r}")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(
                "hf_overrides must be a dict of config.json fields (a callable is not taken: "
                f"tandem reads the config as a dict), got {type(self.hf_overrides).__name__}"
            )
        backend = self.distributed_executor_backend
        if backend not in (None, "ray", *EXECUTOR_BACKENDS):
            raise ValueError(
                f"distributed_executor_backend must be None or one of {EXECUTOR_BACKENDS}, "
                f"got {backend!r}"
            )
        if backend == "ray":
            raise ValueError(
                "distributed_executor_backend='ray' is not supported: tandem runs tensor-parallel "
                "ranks as processes of its own on one machine (None or 'mp'); Ray spreads "
                "engines for data parallelism instead (tandem.ray, --data-parallel-size)"
            )
        if backend in ("uni", "external_launcher") and self.tensor_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend={backend!r} runs one rank in the caller's process: "
                "with tensor_parallel_size > 1 tandem starts its ranks itself (None or 'mp')"
            )
        for name, (values, behaviour) in ONE_BEHAVIOUR.items():
            if getattr(self, name) not in values:
                raise ValueError(
                    f"{name} must be one of {values} ({behaviour}), got {getattr(self, name)!r}"
                )

    def resolve_device(self, rank: int = 0) -> torch.device:
        """The device of tensor-parallel rank `rank` (GPU `rank` on CUDA)."""
        cuda = torch.cuda.is_available()
        if self.device is None:
            device = torch.device("cuda" if cuda else "cpu")
        elif self.device.startswith("cuda") and not cuda:
            raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
        else:
            device = torch.device(self.device)
        if device.type == "cuda" and self.tensor_parallel_size > 1:
            if self.tensor_parallel_size > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} needs that many GPUs; "
                    f"torch sees {torch.cuda.device_count()}"
                )
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        return device

    def resolve_dtype(self, model_config: ModelConfig, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(model_config.torch_dtype or "", torch.bfloat16)

    def resolve_kv_cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model computing in `dtype`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or dtype

    def resolve_attention_backend(self, model_config: ModelConfig, device: torch.device) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        usable = device.type == "cuda" and 16 <= model_config.head_dim <= 256  # padded tiles
        return "triton" if usable else "torch"

    def resolve_max_model_len(self, model_config: ModelConfig) -> int:
        """The engine's max_model_len, as vLLM derives it: rope scaling stretches the model's
        positions (linear: by its factor; yarn: the original length times it), and longrope
        defaults to its original length, where the short factors hold."""
        rope = model_config.rope_scaling or {}
        kind = rope.get("rope_type")
        limit = position_limit(
            model_config.architecture, model_config.max_position_embeddings, rope
        )
        if self.max_model_len in (None, FIT_TO_CACHE):  # the cache may shorten the latter
            if kind == "longrope":
                return min(limit, rope["original_max_position_embeddings"])
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's {limit} positions "
                f"(max_position_embeddings={model_config.max_position_embeddings}"
                + (f", {kind} rope scaling" if kind else "")
                + ")"
            )
        if self.max_model_len < 2:
            raise ValueError(
                "max_model_len must be >= 2 (one prompt token and one output token), "
                f"got {self.max_model_len}"
            )
        return self.max_model_len


def position_limit(arch: str, max_position_embeddings: int, rope: dict | None) -> int:
    """The longest sequence the model serves, as vLLM derives it: rope scaling stretches its
    positions (linear: by its factor; yarn: the original length times it)."""
    rope = rope or {}
    kind = rope.get("rope_type")
    if arch == "Gemma3ForCausalLM":
        kind = None  # its max_position_embeddings counts its linear factor (vLLM's note)
    if kind == "linear":
        return int(max_position_embeddings * rope["factor"])
    if kind == "yarn":
        return int(rope["original_max_position_embeddings"] * rope["factor"])
    return max_position_embeddings


def check_int(name: str, value: Any, low: int, note: str = "") -> None:
    """Raise a ValueError naming `name` unless `value` is an int >= `low`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        note = f" {note}" if note else ""
        raise ValueError(f"{name} must be an integer >= {low}{note}, got {value!r}")


def check_bools(obj: Any, *names: str) -> None:
    """Raise a ValueError naming the first of `names` whose value on `obj` is not a bool."""
    check_flags(**{name: getattr(obj, name) for name in names})


def check_flags(**flags: Any) -> None:
    """Raise a ValueError naming the first of `flags` that is not a bool."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """E.g. 5 -> 8, 8 -> 8, 1 -> 1. Host launch math uses these, not triton.cdiv and
    triton.next_power_of_2: those are constexpr functions, about 2 µs a call on the host."""
    return 1 << (n - 1).bit_length()


# vLLM's names for an engine's settings: `LLM.from_engine_args(EngineArgs(model=..., ...))` and
# `AsyncLLM.from_engine_args(AsyncEngineArgs(...))` read as they do in vLLM
EngineArgs = AsyncEngineArgs = EngineConfig
