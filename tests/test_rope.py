"""Rope scaling types against transformers' rope init functions and rotary embeddings."""

from __future__ import annotations

import copy

import pytest
import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.model.rope import RotaryEmbedding

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD_DIM, MAX_POSITION = 32, 512
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    "yarn_mscale": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2,
    },
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)],
        "long_factor": [1.5 + 0.3 * i for i in range(HEAD_DIM // 2)],
        "original_max_position_embeddings": 128,
    },
}  # fmt: skip


def hf_llama_config(scaling: dict) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 64,
        "hidden_size": 4 * HEAD_DIM,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITION,
        "rope_theta": 10000.0,
        "rope_scaling": scaling,
    }


def ours(hf: dict) -> torch.Tensor:
    cfg = ModelConfig.from_hf(hf)
    return RotaryEmbedding(cfg.head_dim, MAX_POSITION, cfg.rope_theta, cfg.rope_scaling).cos_sin


def transformers_cos_sin(hf: dict, positions: torch.Tensor, seq_len: int | None) -> torch.Tensor:
    """cos | sin of transformers' rope init function for the config at `seq_len`."""
    config = transformers.LlamaConfig(**copy.deepcopy(hf))  # it writes into rope_scaling
    rope_type = config.rope_parameters["rope_type"]
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    angles = torch.outer(positions.float(), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor


@pytest.mark.parametrize("name", ["linear", "yarn", "yarn_mscale"])
def test_static_scalings_match_transformers_init_functions(name):
    hf = hf_llama_config(SCALINGS[name])
    positions = torch.arange(MAX_POSITION)
    expected = transformers_cos_sin(hf, positions, None)
    torch.testing.assert_close(ours(hf), expected, atol=2e-5, rtol=1e-5)


def test_dynamic_ntk_equals_transformers_for_every_length_up_to_max_position():
    """transformers rescales only sequences longer than max_position_embeddings, which tandem
    never serves (max_model_len is bounded by it): below, its frequencies are the default ones."""
    hf = hf_llama_config(SCALINGS["dynamic"])
    positions = torch.arange(MAX_POSITION)
    for seq_len in (1, 100, MAX_POSITION):
        expected = transformers_cos_sin(hf, positions, seq_len)
        torch.testing.assert_close(ours(hf), expected, atol=2e-5, rtol=1e-5)
    longer = transformers_cos_sin(hf, positions, 2 * MAX_POSITION)
    assert not torch.allclose(longer, expected)  # the rescaling tandem does not reach


def test_longrope_takes_one_set_of_factors_by_the_longest_sequence_served():
    """max_model_len past original_max_position_embeddings (128): the long factors at every
    position, as transformers rotates a sequence longer than 128; within it, the short ones."""
    hf = hf_llama_config(SCALINGS["longrope"])
    cfg = ModelConfig.from_hf(hf)
    for max_position, seq_len in ((MAX_POSITION, 129), (128, 128), (64, 64)):
        table = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        expected = transformers_cos_sin(hf, torch.arange(max_position), seq_len)
        torch.testing.assert_close(table.cos_sin, expected, atol=2e-5, rtol=1e-5)
    short = transformers_cos_sin(hf, torch.arange(MAX_POSITION), 128)
    assert not torch.allclose(ours(hf)[1:], short[1:])  # the two sets of factors differ
    assert ours(hf).abs().max() > 1.0  # cos and sin scaled by the attention factor (factor 4)


def test_rotary_embedding_of_transformers_phi3_matches_short_and_long():
    """Phi-3's own rotary module with longrope: a sequence within 128 positions is rotated with
    our table for max_model_len 128, one past it with our table for a longer max_model_len."""
    hf = {
        **hf_llama_config(None),
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "original_max_position_embeddings": 128,
        "rope_scaling": {k: v for k, v in SCALINGS["longrope"].items() if "original" not in k},
    }
    hf["rope_scaling"]["type"] = hf["rope_scaling"].pop("rope_type")
    config = transformers.Phi3Config(**hf)
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    cfg = ModelConfig.from_hf(hf)
    half = HEAD_DIM // 2
    for length, max_model_len in ((100, 128), (200, MAX_POSITION)):
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(length)[None])
        expected = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)
        table = RotaryEmbedding(cfg.head_dim, max_model_len, cfg.rope_theta, cfg.rope_scaling)
        torch.testing.assert_close(table.cos_sin[:length], expected, atol=2e-5, rtol=1e-5)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize(
    ("scaling", "top_level"),
    [
        (SCALINGS["yarn"], 32),  # the top-level field wins over rope_scaling's, as transformers'
        ({**SCALINGS["longrope"], "factor": 4.0}, 256),
        ({**LLAMA3, "original_max_position_embeddings": 64}, 128),
        (LLAMA3, None),  # neither: max_position_embeddings
        (LLAMA3, 64),
    ],
    ids=["yarn", "longrope", "llama3", "llama3 without it", "llama3 top-level alone"],
)
def test_original_max_position_embeddings_is_read_as_transformers_reads_it(scaling, top_level):
    hf = hf_llama_config(scaling)
    if top_level is not None:
        hf["original_max_position_embeddings"] = top_level
    positions = torch.arange(MAX_POSITION)
    expected = transformers_cos_sin(hf, positions, MAX_POSITION)  # longrope: the long factors
    torch.testing.assert_close(ours(hf), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("scaling", "named"),
    [
        ({"rope_type": "su2", "factor": 2.0}, "rope type 'su2'"),
        ({"rope_type": "linear"}, "rope_scaling.factor"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 16}, "rope_scaling.long_factor"),
        (
            {**SCALINGS["longrope"], "long_factor": [1.0]},  # one number: no broadcast
            "rope_scaling.long_factor must list 16 numbers",
        ),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary"),
    ],
)
def test_rope_settings_tandem_cannot_apply_are_named(scaling, named):
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_hf(hf_llama_config(scaling))


@pytest.mark.parametrize(
    ("scaling", "default", "most"),
    [
        (None, MAX_POSITION, MAX_POSITION),
        ({"rope_type": "linear", "factor": 4.0}, 4 * MAX_POSITION, 4 * MAX_POSITION),
        (SCALINGS["yarn"], 64 * 8, 64 * 8),  # the original length times the factor
        (SCALINGS["longrope"], 128, MAX_POSITION),  # the original length by default
        ({**LLAMA3, "original_max_position_embeddings": 64}, MAX_POSITION, MAX_POSITION),
    ],
    ids=["none", "linear", "yarn", "longrope", "llama3"],
)
def test_max_model_len_counts_the_rope_scaling_as_vllm(scaling, default, most):
    cfg = ModelConfig.from_hf(hf_llama_config(scaling))
    assert EngineConfig("m").resolve_max_model_len(cfg) == default
    assert EngineConfig("m", max_model_len=most).resolve_max_model_len(cfg) == most
    with pytest.raises(ValueError, match=f"exceeds the model's {most} positions"):
        EngineConfig("m", max_model_len=most + 1).resolve_max_model_len(cfg)


def test_gemma3s_positions_already_count_its_linear_factor():
    """vLLM's exception: Gemma 3's max_position_embeddings (131,072) is its scaled length."""
    from tandem.model.tiny import ARCH_CONFIGS, COMMON_CONFIG

    hf = {**COMMON_CONFIG, **ARCH_CONFIGS["gemma3"], "vocab_size": 256,
          "max_position_embeddings": 512, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    assert EngineConfig("m").resolve_max_model_len(ModelConfig.from_hf(hf)) == 512
