"""Model shape (from a Hugging Face config.json) and engine settings, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

PREEMPTION_MODES = ("recompute", "swap", "auto")

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
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

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict; raises ValueError for what tandem cannot run."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or hf.get('model_type')!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(
                f"unsupported hidden_act {act!r} in config.json; only 'silu' is supported"
            )
        if hf.get("mlp_bias"):
            raise ValueError("unsupported mlp_bias=true in config.json")
        window = hf.get("sliding_window")
        uses_window = hf.get("use_sliding_window", arch == "MistralForCausalLM")
        if window is not None and uses_window and window < hf.get("max_position_embeddings", 0):
            raise ValueError(
                f"sliding-window attention (sliding_window={window}) is not supported; "
                "use a checkpoint without it"
            )
        num_heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        legacy_scaling = hf.get("rope_scaling")
        if legacy_scaling:
            rope.update(legacy_scaling)
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope type {rope_type!r}; supported: 'default', 'llama3'")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(hf.get("attention_bias") or False)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling={"rope_type": rope_type, **rope} if rope_type != "default" else None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            eos_token_ids=eos_ids,
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameters of the weights a forward pass reads (the LM head counted once)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        attn += (self.q_size + 2 * self.kv_size if self.qkv_bias else 0) + (
            h if self.o_proj_bias else 0
        )
        mlp = 3 * h * self.intermediate_size
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + 2 * h + (2 * d if self.qk_norm else 0)) + embed + h


@dataclass
class EngineConfig:
    """Settings of one engine; `validate` turns user mistakes into ValueErrors naming the field."""

    model: str
    device: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    seed: int = 0
    attention_backend: str | None = None  # "triton" on CUDA, "torch" elsewhere
    async_batching: bool = True
    cuda_graphs: bool | None = None
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    # how a request gives up its KV blocks when they run out (swap.py): "recompute" frees them,
    # "swap" copies them to `swap_space` GiB of pinned host memory, "auto" picks per request
    preemption_mode: str = "auto"
    swap_space: float = 4.0

    def validate(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("block_size", self.block_size, 1)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)
        utilization = self.gpu_memory_utilization
        is_number = isinstance(utilization, int | float) and not isinstance(utilization, bool)
        if not is_number or not 0.0 < utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be a number in (0, 1], got {utilization!r}"
            )
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}"
            )
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        space = self.swap_space
        if not isinstance(space, int | float) or isinstance(space, bool) or not space >= 0:
            raise ValueError(f"swap_space must be a number of GiB >= 0, got {space!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in (None, "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be None, 'cpu' or 'cuda', got {self.device!r}")
        if self.attention_backend not in (None, "torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}"
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

    def resolve_attention_backend(self, model_config: ModelConfig, device: torch.device) -> str:
        if self.attention_backend is not None:
            return self.attention_backend
        d = model_config.head_dim
        usable = device.type == "cuda" and d >= 16 and d & (d - 1) == 0
        return "triton" if usable else "torch"

    def resolve_max_model_len(self, model_config: ModelConfig) -> int:
        limit = model_config.max_position_embeddings
        if self.max_model_len is None:
            return limit
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={limit}"
            )
        if self.max_model_len < 2:
            raise ValueError(
                "max_model_len must be >= 2 (one prompt token and one output token), "
                f"got {self.max_model_len}"
            )
        return self.max_model_len


def check_int(name: str, value: Any, low: int, note: str = "") -> None:
    """Raise a ValueError naming `name` unless `value` is an int >= `low`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        note = f" {note}" if note else ""
        raise ValueError(f"{name} must be an integer >= {low}{note}, got {value!r}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """E.g. 5 -> 8, 8 -> 8, 1 -> 1. Host launch math uses these, not triton.cdiv and
    triton.next_power_of_2: those are constexpr functions, about 2 µs a call on the host."""
    return 1 << (n - 1).bit_length()
