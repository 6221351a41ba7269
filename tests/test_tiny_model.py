"""Tiny random checkpoints load in transformers with the shapes and features each arch promises."""

from __future__ import annotations

import json
import time
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.model.tiny import make_tiny_model, random_weights

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# arch -> (layers, kv heads, head_dim, tied embeddings, q/k/v bias, q/k norm)
EXPECTED = {
    "llama": (2, 2, 16, False, False, False),
    "mistral": (2, 1, 16, False, False, False),
    "qwen2": (3, 2, 16, True, True, False),
    "qwen3": (2, 2, 32, True, False, True),
}
PROMPTS = ["The quick brown fox", "Hello, café 日本!", "def add(a, b):", "Our scheduler reads"]


@cache
def hf_model(folder: Path) -> Any:
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(folder / "model.safetensors", "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_tensor_with_nothing_missing_or_unexpected(make_tiny, arch):
    folder = make_tiny(arch)
    model, info = hf_model(folder)
    assert not any(info.values()), info
    parameters = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert parameters == checkpoint_shapes(folder)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_each_arch_has_its_promised_features(make_tiny, arch):
    layers, kv_heads, head_dim, tied, qkv_bias, qk_norm = EXPECTED[arch]
    folder = make_tiny(arch)
    model, _ = hf_model(folder)
    shapes = checkpoint_shapes(folder)
    attn = "model.layers.0.self_attn"
    assert model.config.num_hidden_layers == layers
    assert shapes[f"{attn}.q_proj.weight"] == (4 * head_dim, 64)
    assert shapes[f"{attn}.k_proj.weight"] == (kv_heads * head_dim, 64)
    assert shapes[f"{attn}.o_proj.weight"] == (64, 4 * head_dim)
    assert ("lm_head.weight" not in shapes) == tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    assert all((f"{attn}.{p}_proj.bias" in shapes) == qkv_bias for p in "qkv")
    assert f"{attn}.o_proj.bias" not in shapes
    assert shapes.get(f"{attn}.q_norm.weight") == ((head_dim,) if qk_norm else None)
    assert shapes.get(f"{attn}.k_norm.weight") == ((head_dim,) if qk_norm else None)


def test_llama_rope_scaling_changes_the_frequencies(make_tiny):
    model, _ = hf_model(make_tiny("llama"))
    assert model.config.rope_parameters["rope_type"] == "llama3"
    unscaled = 1.0 / 500000.0 ** (torch.arange(0, 16, 2) / 16)
    scaled = model.model.rotary_emb.inv_freq
    assert scaled[0] == unscaled[0]  # high frequencies are kept
    assert torch.allclose(scaled[-1], unscaled[-1] / 8)  # low ones are divided by the factor


@pytest.mark.parametrize("arch", ARCHS)
def test_config_uses_legacy_hub_format_and_covers_the_tokenizer(make_tiny, arch):
    folder = make_tiny(arch)
    config = read_json(folder / "config.json")
    assert "rope_theta" in config and "rope_parameters" not in config
    assert config["torch_dtype"] == "float32"
    assert config["max_position_embeddings"] == 1024
    assert config["vocab_size"] >= len(AutoTokenizer.from_pretrained(folder))
    assert isinstance(config["eos_token_id"], list) == (arch == "llama")
    assert isinstance(read_json(folder / "generation_config.json")["eos_token_id"], list)
    if arch == "mistral":
        assert config["sliding_window"] is None


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_logits_are_peaked_not_near_ties(make_tiny, arch):
    folder = make_tiny(arch)
    model, _ = hf_model(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gaps = []
    for prompt in PROMPTS:
        with torch.no_grad():
            logits = model(torch.tensor([tokenizer(prompt).input_ids])).logits[0]
        top2 = logits.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    assert torch.cat(gaps).mean() > 0.5


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_same_seed_writes_identical_files_quickly(tmp_path, arch):
    start = time.perf_counter()
    first = make_tiny_model(tmp_path / "a", arch, seed=3)
    assert time.perf_counter() - start < 2.0
    second = make_tiny_model(tmp_path / "b", arch, seed=3)
    other_seed = make_tiny_model(tmp_path / "c", arch, seed=4)
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)
    assert (first / "model.safetensors").read_bytes() != (
        other_seed / "model.safetensors"
    ).read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other_seed / "tokenizer.json").read_bytes()


def test_random_weights_follow_the_config_in_any_dtype(make_tiny):
    config = read_json(make_tiny("qwen3") / "config.json")
    weights = dict(random_weights(config, seed=0, dtype=torch.bfloat16))
    assert {n: tuple(t.shape) for n, t in weights.items()} == checkpoint_shapes(make_tiny("qwen3"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    again = dict(random_weights(config, seed=0, dtype=torch.bfloat16))
    assert all(torch.equal(weights[name], again[name]) for name in weights)


def test_unknown_arch_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown tiny arch 'gpt2'"):
        make_tiny_model(tmp_path, "gpt2")
