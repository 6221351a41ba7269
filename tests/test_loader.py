"""Checkpoint folders and presets: what loads, what it loads to, and what is refused with which message."""

from __future__ import annotations

import copy
import json
import re
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.config import SUPPORTED_ARCHITECTURES, ModelConfig
from tandem.model.loader import PRESETS_DIR, preset_names

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

PROMPTS = ["The quick brown fox", "Hello, café 日本!", "def add(a, b):", "Our scheduler reads"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
ENGINE_ARGS = {"max_model_len": 64, "block_size": 8}
# published parameter counts; Qwen3-0.6B's tied embedding is counted once
KNOWN_SIZES = {
    "llama-3-8b": 8.03e9,
    "llama-3.1-8b": 8.03e9,
    "llama-3-70b": 70.55e9,
    "mistral-7b": 7.25e9,
    "qwen2.5-0.5b": 0.494e9,
    "qwen2.5-7b": 7.62e9,
    "qwen3-0.6b": 0.596e9,
    "qwen3-8b": 8.19e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen1.5-moe-a2.7b": 14.3e9,
    "mixtral-8x7b": 46.7e9,
    "gemma-3-12b": 11.77e9,  # the text model of the 12.2B (vision included) release
    "phi-3-mini": 3.82e9,
    "phi-4-mini": 3.84e9,
    "smollm3-3b": 3.08e9,
    "olmo-2-7b": 7.30e9,
}


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def greedy_tokens(folder: Path | str, **engine_args: Any) -> list[list[int]]:
    llm = LLM(str(folder), **{**ENGINE_ARGS, **engine_args})
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@cache
def float32_greedy(folder: Path) -> list[tuple[list[int], list[float]]]:
    """Per prompt: float32 greedy tokens and, at each step, the gap between the top-2 logits."""
    params = SamplingParams(
        temperature=0, max_tokens=GREEDY.max_tokens, ignore_eos=True, logprobs=2
    )
    outputs = LLM(str(folder), **ENGINE_ARGS).generate(PROMPTS, params, use_tqdm=False)
    results = []
    for out in outputs:
        top2 = [sorted(step.values())[-2:] for step in out.outputs[0].logprobs]
        results.append((out.outputs[0].token_ids, [best - second for second, best in top2]))
    return results


def reference_tokens(folder: Path) -> list[list[int]]:
    return [tokens for tokens, _ in float32_greedy(folder)]


def copy_without_weights(source: Path, dest: Path) -> Path:
    return Path(shutil.copytree(source, dest, ignore=shutil.ignore_patterns("*.safetensors")))


def with_tensors(source: Path, dest: Path, edit) -> Path:
    """A copy of `source` whose single weight file holds `edit(tensors)`."""
    copy_without_weights(source, dest)
    tensors = edit(load_file(source / "model.safetensors"))
    save_file(tensors, dest / "model.safetensors", {"format": "pt"})
    return dest


def sharded(source: Path, dest: Path, num_shards: int = 2) -> Path:
    """Re-save `source`'s tensors round-robin into shards plus a model.safetensors.index.json."""
    copy_without_weights(source, dest)
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i in range(num_shards):
        shard = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[i::num_shards]  # q_proj and k_proj of a layer land in different shards
        save_file({n: tensors[n] for n in part}, dest / shard, {"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dest


# ---- sharded checkpoints ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sharded_checkpoint_gives_the_same_greedy_tokens_as_the_single_file(
    make_tiny, tmp_path, arch
):
    folder = make_tiny(arch)
    shards = sharded(folder, tmp_path / "sharded")
    assert not (shards / "model.safetensors").exists()
    assert greedy_tokens(shards) == reference_tokens(folder)


def test_our_sharded_folder_loads_in_transformers_with_identical_tensors(make_tiny, tmp_path):
    folder = make_tiny("llama")
    shards = sharded(folder, tmp_path / "sharded")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        shards, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    original = load_file(folder / "model.safetensors")
    state = model.state_dict()
    assert set(state) == set(original)
    assert all(torch.equal(state[name], original[name]) for name in original)


def test_folder_saved_by_transformers_in_many_shards_and_its_own_config_layout_loads(
    make_tiny, tmp_path
):
    folder = make_tiny("llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    saved = tmp_path / "saved"
    model.save_pretrained(saved, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(folder / name, saved / name)
    assert len(list(saved.glob("model-*.safetensors"))) > 2
    assert "rope_parameters" in read_json(saved / "config.json")
    assert greedy_tokens(saved) == reference_tokens(folder)


def test_index_decides_which_files_are_read_so_a_stray_safetensors_file_is_ignored(
    make_tiny, tmp_path
):
    folder = make_tiny("llama")
    shards = sharded(folder, tmp_path / "sharded")
    save_file({"stray.weight": torch.zeros(3)}, shards / "consolidated.safetensors")
    assert greedy_tokens(shards) == reference_tokens(folder)


def test_missing_shard_is_named(make_tiny, tmp_path):
    shards = sharded(make_tiny("llama"), tmp_path / "sharded")
    (shards / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors"):
        LLM(str(shards), **ENGINE_ARGS)


def test_folder_without_any_weights_says_so(make_tiny, tmp_path):
    bare = copy_without_weights(make_tiny("llama"), tmp_path / "bare")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        LLM(str(bare), **ENGINE_ARGS)


# ---- broken folders -----------------------------------------------------------------------------


def test_missing_config_json_is_named(make_tiny, tmp_path):
    folder = Path(shutil.copytree(make_tiny("llama"), tmp_path / "no-config"))
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LLM(str(folder), **ENGINE_ARGS)


BROKEN_FILES = {  # the file, its new bytes or the share of them kept (a cut download), the error
    "config_not_json": ("config.json", b"{bad json", "is not a readable JSON file"),
    "config_a_list": ("config.json", b"[]", "must hold a JSON object, got list"),
    "weights_header_cut": ("model.safetensors", 0.001, "is not a readable safetensors file"),
    "weights_data_cut": ("model.safetensors", 0.9, "is not a readable safetensors file"),
    "tokenizer_not_json": ("tokenizer.json", b"{", "is not a readable tokenizer"),
    "tokenizer_config_not_json": ("tokenizer_config.json", b"{", "is not a readable JSON file"),
    "generation_config_not_json": ("generation_config.json", b"no", "is not a readable JSON file"),
}


@pytest.mark.parametrize(("name", "change", "message"), BROKEN_FILES.values(), ids=BROKEN_FILES)
def test_a_broken_file_of_the_folder_is_a_value_error_naming_it(
    make_tiny, tmp_path, name, change, message
):
    path = Path(shutil.copytree(make_tiny("llama"), tmp_path / "broken")) / name
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * change)] if isinstance(change, float) else change)
    with pytest.raises(ValueError, match=f"{re.escape(name)} {message}"):
        LLM(str(path.parent), **ENGINE_ARGS)


def test_an_index_without_a_weight_map_is_named(make_tiny, tmp_path):
    shards = sharded(make_tiny("llama"), tmp_path / "sharded")
    (shards / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=r"index\.json has no weight_map"):
        LLM(str(shards), **ENGINE_ARGS)


def test_unknown_model_name_lists_the_presets(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder nor a preset") as error:
        LLM(str(tmp_path / "no-such-model"))
    assert all(name in str(error.value) for name in preset_names())


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.1.self_attn.k_proj.weight",  # one slice of a stacked q/k/v matrix
        "model.layers.0.mlp.up_proj.weight",  # one slice of the stacked gate/up matrix
        "model.norm.weight",
        "lm_head.weight",
    ],
)
def test_missing_weight_tensor_is_named_as_the_checkpoint_spells_it(make_tiny, tmp_path, name):
    def drop(tensors):
        del tensors[name]
        return tensors

    folder = with_tensors(make_tiny("llama"), tmp_path / "missing", drop)
    with pytest.raises(ValueError, match="lacks") as error:
        LLM(str(folder), **ENGINE_ARGS)
    assert re.search(rf"(^|[^.\w]){re.escape(name)}", str(error.value)), str(error.value)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.mlp.extra_proj.weight",
        "model.layers.2.self_attn.q_proj.weight",  # the tiny llama has layers 0 and 1
        "model.layers.0.self_attn.o_proj.bias",  # llama has no o_proj bias (a zero one
    ],  # is read past, as GPTQ-for-LLaMa wrote them: test_int4.py)
)
def test_unknown_extra_tensor_is_named(make_tiny, tmp_path, name):
    def add(tensors):
        return {**tensors, name: torch.ones(64)}

    folder = with_tensors(make_tiny("llama"), tmp_path / "extra", add)
    with pytest.raises(ValueError, match=re.escape(name)):
        LLM(str(folder), **ENGINE_ARGS)


@pytest.mark.parametrize(
    ("name", "bad_shape", "expected_shape"),
    [
        ("model.layers.0.mlp.up_proj.weight", (127, 64), (128, 64)),
        ("model.layers.1.self_attn.k_proj.weight", (64, 64), (32, 64)),
        ("model.embed_tokens.weight", (700, 64), (704, 64)),
    ],
)
def test_wrong_shape_names_the_tensor_and_both_shapes(
    make_tiny, tmp_path, name, bad_shape, expected_shape
):
    def reshape(tensors):
        return {**tensors, name: torch.zeros(bad_shape)}

    folder = with_tensors(make_tiny("llama"), tmp_path / "reshaped", reshape)
    with pytest.raises(ValueError, match=re.escape(name)) as error:
        LLM(str(folder), **ENGINE_ARGS)
    assert str(bad_shape) in str(error.value)
    assert str(expected_shape) in str(error.value)


# ---- configs tandem cannot run ------------------------------------------------------------------


def test_unsupported_architecture_lists_the_supported_ones(make_tiny, tmp_path):
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4).to_dict()
    gpt2["architectures"] = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        ModelConfig.from_hf(gpt2)
    assert all(arch in str(error.value) for arch in SUPPORTED_ARCHITECTURES)

    folder = Path(shutil.copytree(make_tiny("llama"), tmp_path / "gpt2"))
    (folder / "config.json").write_text(json.dumps(gpt2))
    with pytest.raises(ValueError, match=r"supported: .*LlamaForCausalLM"):
        LLM(str(folder), **ENGINE_ARGS)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"rope_scaling": {"rope_type": "mrope", "factor": 4.0}}, "rope type 'mrope'"),
        (
            {"rope_scaling": None, "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}},
            "rope type 'mrope'",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size"),
    ],
    ids=[
        "gelu",
        "mlp_bias",
        "mrope_legacy",
        "mrope_rope_parameters",
        "partial_rotary",
        "shared_expert",
    ],
)
def test_unsupported_features_are_named(make_tiny, edit, named):
    config = {**read_json(make_tiny("llama") / "config.json"), **edit}
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig.from_hf(config)


BAD_SHAPE_FIELDS = {  # config.json's change, the error; before: KeyError, TypeError, ZeroDivision
    "no_heads": ({"num_attention_heads": None}, "config.json needs num_attention_heads"),
    "no_vocab": ({"vocab_size": None}, "config.json needs vocab_size"),
    "heads_text": (
        {"num_attention_heads": "4"},
        "num_attention_heads must be an integer >= 1, got '4'",
    ),
    "heads_zero": (
        {"num_attention_heads": 0},
        "num_attention_heads must be an integer >= 1, got 0",
    ),
    "layers_negative": ({"num_hidden_layers": -1}, "num_hidden_layers must be an integer >= 1"),
    "eps_text": ({"rms_norm_eps": "x"}, "rms_norm_eps must be a number, got 'x'"),
    "kv_heads_no_divisor": (
        {"num_key_value_heads": 3},
        "(4) must be a multiple of its num_key_value_heads (3)",
    ),
    "architectures_text": ({"architectures": "LlamaForCausalLM"}, "architectures must be a list"),
}


@pytest.mark.parametrize(("edit", "message"), BAD_SHAPE_FIELDS.values(), ids=BAD_SHAPE_FIELDS)
def test_a_missing_or_bad_shape_field_is_a_value_error_naming_it(make_tiny, edit, message):
    config = {**read_json(make_tiny("llama") / "config.json"), **edit}
    config = {k: v for k, v in config.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_hf(config)


@pytest.mark.parametrize("model", [None, 5, ""])
def test_a_model_that_is_no_name_is_a_value_error(model):
    with pytest.raises(ValueError, match="model must name a model folder"):
        LLM(model, **ENGINE_ARGS)


def test_qwen2_moe_reads_its_shared_expert_routing_and_biases(make_tiny):
    """Qwen2-MoE: a shared expert, top k not renormalised, q/k/v biases and no o bias (its
    qkv_bias), the dense layers of mlp_only_layers."""
    config = read_json(make_tiny("qwen2_moe") / "config.json")
    parsed = ModelConfig.from_hf(config)
    assert parsed.shared_expert_intermediate_size == 48 and not parsed.norm_topk_prob
    assert parsed.qkv_bias and not parsed.o_proj_bias and not parsed.qk_norm
    assert parsed.moe_layers == (True, True, False)
    assert not ModelConfig.from_hf({**config, "qkv_bias": False}).qkv_bias


def test_mistral_with_a_sliding_window_windows_every_layer():
    config = read_json(PRESETS_DIR / "mistral-7b.json") | {"sliding_window": 4096}
    parsed = ModelConfig.from_hf(config)
    assert parsed.sliding_window == 4096 and parsed.sliding_layers == (True,) * 32


def test_a_window_wider_than_any_sequence_is_no_window():
    """Phi-4-mini's sliding_window (262,144) is past its max_position_embeddings (131,072): no
    layer is windowed, so the cascade decode still reads shared blocks once."""
    parsed = ModelConfig.from_hf(read_json(PRESETS_DIR / "phi-4-mini.json"))
    assert parsed.sliding_window is None and parsed.sliding_layers == ()
    assert (parsed.head_dim, parsed.rotary_dim) == (128, 96)  # partial_rotary_factor 0.75


def test_smollm3_leaves_every_fourth_layer_without_position_embedding():
    parsed = ModelConfig.from_hf(read_json(PRESETS_DIR / "smollm3-3b.json"))
    assert parsed.rope_layers == tuple((i + 1) % 4 != 0 for i in range(36))
    explicit = read_json(PRESETS_DIR / "smollm3-3b.json") | {"no_rope_layers": [1, 0] * 18}
    assert ModelConfig.from_hf(explicit).rope_layers == (True, False) * 18
    with pytest.raises(ValueError, match="no_rope_layers has 2 entries for 36 layers"):
        ModelConfig.from_hf(explicit | {"no_rope_layers": [1, 0]})
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(explicit | {"use_sliding_window": True, "sliding_window": 4096})


def test_olmo_runs_on_one_device():
    """Its q and k norms span every head, which ranks would split."""
    from tandem.parallel import check_shardable

    parsed = ModelConfig.from_hf(read_json(PRESETS_DIR / "olmo-2-7b.json"))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        check_shardable(parsed, 2)


def test_partial_rotary_is_refused_where_transformers_has_none():
    config = read_json(PRESETS_DIR / "llama-3-8b.json") | {"partial_rotary_factor": 0.5}
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        ModelConfig.from_hf(config)
    odd = read_json(PRESETS_DIR / "phi-4-mini.json") | {"partial_rotary_factor": 0.7}
    with pytest.raises(ValueError, match="even"):
        ModelConfig.from_hf(odd)


def test_qwen_with_use_sliding_window_is_refused_naming_the_field():
    config = read_json(PRESETS_DIR / "qwen2.5-7b.json") | {
        "use_sliding_window": True,
        "sliding_window": 4096,
    }
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(config)


# ---- presets and config layouts -----------------------------------------------------------------


def test_every_preset_has_a_known_size():
    assert set(preset_names()) == set(KNOWN_SIZES)


@pytest.mark.parametrize("name", sorted(KNOWN_SIZES))
def test_preset_parses_and_num_params_is_within_one_percent_of_the_published_size(name):
    cfg = ModelConfig.from_hf(read_json(PRESETS_DIR / f"{name}.json"))
    assert cfg.num_params() == pytest.approx(KNOWN_SIZES[name], rel=0.01)


@pytest.mark.parametrize("name", sorted(KNOWN_SIZES))
def test_num_params_equals_the_parameters_transformers_builds(name):
    hf = read_json(PRESETS_DIR / f"{name}.json")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**copy.deepcopy(hf))
        )
    assert ModelConfig.from_hf(hf).num_params() == model.num_parameters()


def transformers5_layout(legacy: dict[str, Any]) -> dict[str, Any]:
    """The config.json transformers 5 writes for a legacy one: rope_theta inside rope_parameters."""
    converted = transformers.AutoConfig.for_model(**copy.deepcopy(legacy)).to_dict()
    assert "rope_parameters" in converted and "rope_theta" not in converted
    assert "rope_scaling" not in converted
    return converted


@pytest.mark.parametrize("name", sorted(KNOWN_SIZES))
def test_legacy_and_transformers5_rope_layouts_parse_the_same_for_each_preset(name):
    legacy = read_json(PRESETS_DIR / f"{name}.json")
    assert "rope_theta" in legacy and "rope_parameters" not in legacy
    assert ModelConfig.from_hf(transformers5_layout(legacy)) == ModelConfig.from_hf(legacy)


def test_llama3_rope_scaling_parses_the_same_in_both_layouts(make_tiny):
    legacy = read_json(make_tiny("llama") / "config.json")
    new = {k: v for k, v in legacy.items() if k not in ("rope_theta", "rope_scaling")}
    new["rope_parameters"] = {"rope_theta": legacy["rope_theta"], **legacy["rope_scaling"]}
    parsed, parsed_new = ModelConfig.from_hf(legacy), ModelConfig.from_hf(new)
    assert parsed_new == parsed
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    assert ModelConfig.from_hf(transformers5_layout(legacy)) == parsed


def test_preset_without_dummy_load_format_is_refused_before_the_model_is_built(monkeypatch):
    def build_nothing(*args, **kwargs):
        raise AssertionError("the preset's full-size model was built before being refused")

    monkeypatch.setattr("tandem.model.loader.Decoder", build_nothing)
    with pytest.raises(ValueError, match="load_format='dummy'"):
        LLM("llama-3-70b")


# ---- dummy weights and dtypes -------------------------------------------------------------------


def parameters(llm: LLM) -> dict[str, torch.Tensor]:
    return dict(llm.engine.model.named_parameters())


def test_dummy_load_format_reads_no_weight_files_and_runs(make_tiny, tmp_path):
    bare = copy_without_weights(make_tiny("llama"), tmp_path / "bare")
    tokens = greedy_tokens(bare, load_format="dummy")
    assert [len(t) for t in tokens] == [GREEDY.max_tokens] * len(PROMPTS)


def test_dummy_weights_differ_from_the_checkpoint_weights(make_tiny):
    folder = str(make_tiny("llama"))
    real = parameters(LLM(folder, **ENGINE_ARGS))
    dummy = parameters(LLM(folder, load_format="dummy", **ENGINE_ARGS))
    assert {n: p.shape for n, p in dummy.items()} == {n: p.shape for n, p in real.items()}
    assert not any(torch.equal(dummy[name], real[name]) for name in real if "norm" not in name)


def test_dummy_weights_follow_the_engine_seed(make_tiny):
    folder = str(make_tiny("llama"))
    first = parameters(LLM(folder, load_format="dummy", seed=1, **ENGINE_ARGS))
    again = parameters(LLM(folder, load_format="dummy", seed=1, **ENGINE_ARGS))
    other = parameters(LLM(folder, load_format="dummy", seed=2, **ENGINE_ARGS))
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["embed_tokens.weight"], other["embed_tokens.weight"])


# float32 top-2 logit gaps below which a half-precision run may pick the other token
NEAR_TIE = {"float16": 0.1, "bfloat16": 0.5}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_runs_on_cpu_and_agrees_with_float32_on_the_first_tokens(
    make_tiny, arch, dtype
):
    folder = make_tiny(arch)
    llm = LLM(str(folder), dtype=dtype, **ENGINE_ARGS)
    assert {p.dtype for p in llm.engine.model.parameters()} == {getattr(torch, dtype)}
    assert all(cache.dtype == getattr(torch, dtype) for cache in llm.engine.kv_caches)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokens = [out.outputs[0].token_ids for out in outputs]
    assert [len(t) for t in tokens] == [GREEDY.max_tokens] * len(PROMPTS)

    num_agreeing = 0
    for ours, (reference, gaps) in zip(tokens, float32_greedy(folder), strict=True):
        parted = next((i for i in range(3) if ours[i] != reference[i]), None)
        if parted is None:
            num_agreeing += 1
        else:
            assert gaps[parted] < NEAR_TIE[dtype], f"parted at token {parted}, not at a near tie"
    assert num_agreeing >= len(PROMPTS) - 1
