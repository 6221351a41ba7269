"""Tiny random Hugging Face checkpoints (config, safetensors, byte-level BPE tokenizer) for tests."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BpeTokenizer

from tandem.config import GEMMA, OLMO, ModelConfig, cdiv

BOS, EOS, IM_START, IM_END = "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]
NUM_MERGED_TOKENS = 640  # byte alphabet plus merges; the special tokens come after
VOCAB_PADDING = 64  # config.json's vocab_size is the tokenizer's size rounded up to this
LOGIT_STD = 6.0  # std of the logits at init, so greedy picks are far from ties
# o_proj and down_proj write into the residual stream; a large gain there keeps a tied model's input
# embedding from dominating its own logits (greedy output would then repeat one token).
RESIDUAL_GAIN = 6.0

CHAT_TEMPLATE = """{{- bos_token | default('') }}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}
{{- raise_exception('unknown role ' + message['role'] + '; use system, user or assistant') }}
{%- endif %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Pre-tokenizer regexes of the two tokenizer.json families: Llama-3 groups digits by three, Qwen
# splits every digit.
LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

COMMON_CONFIG: dict[str, Any] = {
    "hidden_act": "silu",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "max_position_embeddings": 1024,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "float32",
}
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA, untied, llama3 rope scaling, a Llama-3 style tokenizer that prepends BOS
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    # MQA, untied, no sliding window
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # bias on q/k/v only, tied, GQA, a Qwen style tokenizer (NFC, no BOS)
    "qwen2": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
    },
    # q_norm/k_norm, head_dim 32 != 64 / 4, tied
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": True,
    },
    # a sliding window shorter than the test prompts, on every layer
    "mistral_sliding": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 24,
        "tie_word_embeddings": False,
    },
    # 8 experts, top 2 renormalised, q/k norms, a dense layer between two MoE layers
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # 8 experts, top 2 not renormalised, a shared expert with its gate, q/k/v biases, a dense
    # layer after two MoE layers
    "qwen2_moe": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [2],
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "qkv_bias": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # 4 experts, top 2 (always renormalised), GQA
    "mixtral": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "intermediate_size": 48,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
    },
    # sliding and full layers alternating, attention and final soft caps, GeGLU,
    # query_pre_attn_scalar != head_dim (untied: a tied tiny Gemma, its embeddings scaled up in
    # the stream, repeats the last token greedily; tying is covered by qwen2 and qwen3)
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"],
        "model_type": "gemma2",
        "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 15.0,
        "sliding_window": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
    # q/k norms, a local rope base on sliding layers, linear rope scaling on full ones
    "gemma3": {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_activation": "gelu_pytorch_tanh",
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "tie_word_embeddings": False,
    },
    # fused qkv and gate_up weights, head_dim 48 (not a power of two), longrope (its short factors
    # up to max_model_len 256; a test lowers the original length to reach the long), a window
    "phi3": {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "hidden_size": 96,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 256,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0 + 0.02 * i for i in range(24)],
            "long_factor": [1.0 + 0.5 * i for i in range(24)],
        },
        "sliding_window": 32,
        "tie_word_embeddings": False,
    },
}
# Phi-4-mini's shape of Phi-3: three quarters of each head rotates, tied embeddings, longrope
# over the rotary dimensions (18 of 24 pairs), no window
ARCH_CONFIGS["phi4_mini"] = ARCH_CONFIGS["phi3"] | {
    "partial_rotary_factor": 0.75,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0 + 0.02 * i for i in range(18)],
        "long_factor": [1.0 + 0.5 * i for i in range(18)],
    },
    "sliding_window": None,
    "tie_word_embeddings": True,
}
# SmolLM3: Llama's layers, tied embeddings, and a layer without position embedding
# (no_rope_layers 0) among ones with
ARCH_CONFIGS["smollm3"] = ARCH_CONFIGS["llama"] | {
    "architectures": ["SmolLM3ForCausalLM"],
    "model_type": "smollm3",
    "num_hidden_layers": 3,
    "no_rope_layers": [1, 0, 1],
    "rope_theta": 5000000.0,
    "rope_scaling": None,
    "use_sliding_window": False,
    "tie_word_embeddings": True,
}
# OLMo 2: norms on the attention's and MLP's outputs, none on their inputs; q and k normed whole
ARCH_CONFIGS["olmo2"] = ARCH_CONFIGS["llama"] | {
    "architectures": ["Olmo2ForCausalLM"],
    "model_type": "olmo2",
    "rope_scaling": None,
}
# OLMo 3: three sliding layers to a full one, YaRN on the full ones only
ARCH_CONFIGS["olmo3"] = ARCH_CONFIGS["olmo2"] | {
    "architectures": ["Olmo3ForCausalLM"],
    "model_type": "olmo3",
    "num_hidden_layers": 4,
    "sliding_window": 16,
    "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.2,
    },
}
# Granite: Llama's layers with a softmax scale, an embedding multiplier, what each sublayer
# adds scaled, and the logits divided
ARCH_CONFIGS["granite"] = ARCH_CONFIGS["llama"] | {
    "architectures": ["GraniteForCausalLM"],
    "model_type": "granite",
    "rope_scaling": None,
    "attention_multiplier": 0.2,
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "logits_scaling": 4.0,
}
# GLM-4: norms before and after each sublayer, half of each head rotating in neighbouring
# pairs, q/k/v biases, gate and up fused
ARCH_CONFIGS["glm4"] = ARCH_CONFIGS["llama"] | {
    "architectures": ["Glm4ForCausalLM"],
    "model_type": "glm4",
    "head_dim": 16,
    "partial_rotary_factor": 0.5,
    "attention_bias": True,
    "rope_theta": 10000.0,
    "rope_scaling": None,
}
# Seed-OSS: Llama's layers with q/k/v biases and an o bias apart
ARCH_CONFIGS["seed_oss"] = ARCH_CONFIGS["llama"] | {
    "architectures": ["SeedOssForCausalLM"],
    "model_type": "seed_oss",
    "head_dim": 16,
    "attention_bias": True,
    "attention_out_bias": True,
    "rope_scaling": None,
}
# ERNIE 4.5: Llama's layers, every dimension rotating in neighbouring pairs, tied embeddings
ARCH_CONFIGS["ernie4_5"] = ARCH_CONFIGS["llama"] | {
    "architectures": ["Ernie4_5ForCausalLM"],
    "model_type": "ernie4_5",
    "head_dim": 16,
    "use_bias": False,
    "rope_scaling": None,
    "tie_word_embeddings": True,
}
QWEN_STYLE = {"qwen2", "qwen3", "qwen2_moe", "qwen3_moe"}
# per-expert tensor names of each MoE family: (block, gate, up, down)
EXPERT_NAMES = {
    "Qwen2MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
}

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. It's a sentence that uses every letter.",
    "We'll meet at the café at 10:30, won't we? I'd rather be early than late; they're never on time.",
    "A naïve approach to caching is to keep everything in memory until the machine runs out of it.",
    "日本 is the name of Japan in Japanese, and 東京 is its capital. Ünïcödé text needs care: 🙂 ✓.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5\n",
    "Prices rose 3.5% in 2023, from $1,234.56 to $1,277.77 per unit (see table 12-B).",
    "Résumé, jalapeño, façade and über are borrowed words; Zürich and São Paulo are cities.",
    '{"name": "tandem", "version": [0, 1, 0], "tags": ["llm", "inference"]}',
    "Line one\nLine two\n\n\tIndented with a tab\n    indented with spaces\r\nWindows line end",
]
# a generated sentence picks one phrase from each of these, in order
SENTENCE_PARTS = [
    "the model|a small engine|our scheduler|the old server|every request|the cat|she|they",
    "reads|writes|caches|samples|sends|finds|keeps|moves|builds|checks|prints|ignores",
    "the tokens|a batch of prompts|two blocks|the answer|ten numbers|a long story|some café au lait",
    "quickly.|before noon.|on the GPU.|in 12 steps.|with care!|again?|without a sound.|for 1000 users.",
]


def make_tiny_model(out_dir: str | Path, arch: str, seed: int = 0) -> Path:
    """Write a complete random Hugging Face checkpoint folder of a tiny `arch` model; return its path."""
    if arch not in ARCH_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {sorted(ARCH_CONFIGS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    qwen_style = arch in QWEN_STYLE
    tokenizer = train_tokenizer(qwen_style)
    tokenizer.save(str(out / "tokenizer.json"))
    token_id = tokenizer.token_to_id
    eos_ids = [token_id(EOS), token_id(IM_END)]
    size = tokenizer.get_vocab_size()
    config = {
        **COMMON_CONFIG,
        **ARCH_CONFIGS[arch],
        "vocab_size": cdiv(size, VOCAB_PADDING) * VOCAB_PADDING,
        "bos_token_id": token_id(BOS),
        "eos_token_id": eos_ids if arch == "llama" else token_id(IM_END),
        "pad_token_id": token_id(EOS),
    }
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json", {"bos_token_id": token_id(BOS), "eos_token_id": eos_ids}
    )
    write_json(out / "tokenizer_config.json", tokenizer_config(qwen_style))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    save_file(
        dict(random_weights(config, seed, torch.float32)),
        out / "model.safetensors",
        {"format": "pt"},
    )
    return out


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_tiny_lora(
    out_dir: str | Path,
    base: str | Path,
    rank: int = 8,
    seed: int = 0,
    targets: tuple[str, ...] = LORA_TARGETS,
    alpha: float | None = None,
) -> Path:
    """Write a random LoRA adapter of model `base` (a checkpoint folder or a preset) as PEFT
    saves one (adapter_config.json, adapter_model.safetensors); its delta is about half the
    size of a weight."""
    from tandem.model.loader import read_hf_config  # it imports the decoder

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (shape, _, _) in weight_specs(
        ModelConfig.from_hf(read_hf_config(str(base))[0])
    ).items():
        module = name.removesuffix(".weight")
        leaf = module.rpartition(".")[2]
        if ".layers." not in name or ".expert" in name or leaf not in targets:
            continue  # the decoder layers' projections, not a MoE block's experts
        rows, cols = shape
        a = torch.randn(rank, cols, generator=generator) * cols**-0.5
        b = torch.randn(rows, rank, generator=generator) * 0.5 * rank**-0.5
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank if alpha is None else alpha,
        "target_modules": list(targets),
        "bias": "none",
        "base_model_name_or_path": str(base),
    }
    write_json(out / "adapter_config.json", config)
    save_file(tensors, out / "adapter_model.safetensors", {"format": "pt"})
    return out


def random_weights(
    hf_config: dict[str, Any], seed: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights under Hugging Face names for a config.json dict, made on `device` one
    tensor at a time (a sharded load keeps only its slice of each). Drawn in float32 and then
    rounded, so a bf16 model is its float32 twin with every weight rounded."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, (shape, std, mean) in weight_specs(ModelConfig.from_hf(hf_config)).items():
        tensor = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        yield name, tensor.mul_(std).add_(mean).to(dtype)


def weight_specs(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], float, float]]:
    # name -> (shape, std, mean); matrices get std 1/sqrt(fan_in) so activations stay O(1)
    h, vocab = cfg.hidden_size, cfg.vocab_size
    q, kv, d = cfg.q_size, cfg.kv_size, cfg.head_dim
    embed_std = LOGIT_STD / h**0.5
    gemma = cfg.architecture in GEMMA
    olmo = cfg.architecture in OLMO

    def matrix(rows: int, cols: int, gain: float = 1.0) -> tuple[tuple[int, ...], float, float]:
        return (rows, cols), gain * cols**-0.5, 0.0

    def norm(size: int, gain: float = 1.0) -> tuple[tuple[int, ...], float, float]:
        # Gemma stores w of its (1 + w) norms
        return (size,), 0.1, gain - 1.0 if gemma else gain

    specs = {"model.embed_tokens.weight": ((vocab, h), embed_std, 0.0)}
    for i in range(cfg.num_layers):
        layer = f"model.layers.{i}"
        attn = f"{layer}.self_attn"
        if cfg.architecture == "Phi3ForCausalLM":
            specs[f"{attn}.qkv_proj.weight"] = matrix(q + 2 * kv, h)
        else:
            specs |= {
                f"{attn}.q_proj.weight": matrix(q, h),
                f"{attn}.k_proj.weight": matrix(kv, h),
                f"{attn}.v_proj.weight": matrix(kv, h),
            }
        specs[f"{attn}.o_proj.weight"] = matrix(h, q, RESIDUAL_GAIN)
        if cfg.qkv_bias:
            specs |= {
                f"{attn}.{p}_proj.bias": ((n,), 0.1, 0.0)
                for p, n in (("q", q), ("k", kv), ("v", kv))
            }
        if cfg.o_proj_bias:
            specs[f"{attn}.o_proj.bias"] = ((h,), 0.1, 0.0)
        if cfg.qk_norm:
            specs |= {f"{attn}.q_norm.weight": norm(d), f"{attn}.k_norm.weight": norm(d)}
        specs |= mlp_specs(cfg, i, matrix)
        if olmo:  # norms on the attention's and the MLP's outputs; q and k normed whole
            specs |= {
                f"{attn}.q_norm.weight": norm(q),
                f"{attn}.k_norm.weight": norm(kv),
                f"{layer}.post_attention_layernorm.weight": norm(h, RESIDUAL_GAIN),
                f"{layer}.post_feedforward_layernorm.weight": norm(h, RESIDUAL_GAIN),
            }
            continue
        if cfg.architecture == "Glm4ForCausalLM":  # Gemma's four norms under its own names
            specs |= {
                f"{layer}.input_layernorm.weight": norm(h),
                f"{layer}.post_self_attn_layernorm.weight": norm(h, RESIDUAL_GAIN),
                f"{layer}.post_attention_layernorm.weight": norm(h),
                f"{layer}.post_mlp_layernorm.weight": norm(h, RESIDUAL_GAIN),
            }
            continue
        specs |= {
            f"{layer}.input_layernorm.weight": norm(h),
            f"{layer}.post_attention_layernorm.weight": norm(h, RESIDUAL_GAIN if gemma else 1.0),
        }
        if gemma:  # the post norms scale what a layer adds to the stream, as the gain does
            specs |= {
                f"{layer}.pre_feedforward_layernorm.weight": norm(h),
                f"{layer}.post_feedforward_layernorm.weight": norm(h, RESIDUAL_GAIN),
            }
    specs["model.norm.weight"] = norm(h)
    if not cfg.tie_word_embeddings:
        specs["lm_head.weight"] = ((vocab, h), embed_std, 0.0)
    if cfg.num_labels:
        specs["score.weight"] = matrix(cfg.num_labels, h)
    return specs


def mlp_specs(cfg: ModelConfig, i: int, matrix) -> dict[str, tuple[tuple[int, ...], float, float]]:
    """Layer i's MLP: dense (Phi-3's gate and up fused), or a router and its experts (and
    Qwen2-MoE's shared expert with its gate)."""
    h, ffn = cfg.hidden_size, cfg.intermediate_size
    if cfg.is_moe_layer(i):
        block, gate, up, down = EXPERT_NAMES[cfg.architecture]
        prefix, inter = f"model.layers.{i}.{block}", cfg.moe_intermediate_size
        specs = {f"{prefix}.gate.weight": matrix(cfg.num_experts, h, 4.0)}  # spread routing
        for e in range(cfg.num_experts):
            specs |= {
                f"{prefix}.experts.{e}.{gate}.weight": matrix(inter, h),
                f"{prefix}.experts.{e}.{up}.weight": matrix(inter, h),
                f"{prefix}.experts.{e}.{down}.weight": matrix(h, inter, RESIDUAL_GAIN),
            }
        if shared := cfg.shared_expert_intermediate_size:
            specs |= {
                f"{prefix}.shared_expert.gate_proj.weight": matrix(shared, h),
                f"{prefix}.shared_expert.up_proj.weight": matrix(shared, h),
                f"{prefix}.shared_expert.down_proj.weight": matrix(h, shared, RESIDUAL_GAIN),
                f"{prefix}.shared_expert_gate.weight": matrix(1, h),
            }
        return specs
    mlp = f"model.layers.{i}.mlp"
    down = {f"{mlp}.down_proj.weight": matrix(h, ffn, RESIDUAL_GAIN)}
    if cfg.architecture in ("Phi3ForCausalLM", "Glm4ForCausalLM"):  # gate and up fused
        return {f"{mlp}.gate_up_proj.weight": matrix(2 * ffn, h)} | down
    return {
        f"{mlp}.gate_proj.weight": matrix(ffn, h),
        f"{mlp}.up_proj.weight": matrix(ffn, h),
    } | down


def train_tokenizer(qwen_style: bool) -> BpeTokenizer:
    """A byte-level BPE trained on the built-in corpus, special tokens after the merged ones."""
    tokenizer = BpeTokenizer(models.BPE(ignore_merges=not qwen_style))
    split = pre_tokenizers.Split(Regex(QWEN_SPLIT if qwen_style else LLAMA3_SPLIT), "isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    byte_level = processors.ByteLevel(trim_offsets=False)
    if qwen_style:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.post_processor = byte_level
    else:
        prepend_bos = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0",
            pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
            special_tokens=[(BOS, NUM_MERGED_TOKENS)],
        )
        tokenizer.post_processor = processors.Sequence([byte_level, prepend_bos])
    trainer = trainers.BpeTrainer(
        vocab_size=NUM_MERGED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    assert tokenizer.get_vocab_size() == NUM_MERGED_TOKENS, "corpus too small for the merges"
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    assert tokenizer.token_to_id(BOS) == NUM_MERGED_TOKENS
    return tokenizer


def corpus() -> list[str]:
    """A few KB of varied text: the paragraphs plus generated sentences, the same every call."""
    rng = random.Random(0)
    phrases = [part.split("|") for part in SENTENCE_PARTS]
    sentences = [" ".join(rng.choice(options) for options in phrases) for _ in range(300)]
    sentences = [sentence[0].upper() + sentence[1:] for sentence in sentences]
    return PARAGRAPHS * 4 + [" ".join(sentences[i : i + 5]) for i in range(0, len(sentences), 5)]


def tokenizer_config(qwen_style: bool) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None if qwen_style else BOS,
        "eos_token": IM_END if qwen_style else EOS,
        "pad_token": EOS if qwen_style else None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": COMMON_CONFIG["max_position_embeddings"],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
