"""4-bit weight-only checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized): each format's
tensors written here from its packing rule, loaded by tandem, against transformers running the
dequantized weights in float32; the formats' refusals; tensor parallelism."""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM
from tandem.quant.int4 import Int4Linear
from test_fp8_weights import (
    assert_greedy_matches,
    edit_config,
    is_linear,
    rewrite,
    tandem_greedy,
    tp_tokens,
)

pytest.importorskip("transformers")
pack_to_int32 = pytest.importorskip("compressed_tensors.compressors").pack_to_int32

GROUP = 32
AWQ_NIBBLE_COLUMNS = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word: column 8j + this
SHARED_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
                "up_proj": "gate_up"}  # fmt: skip


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 with the same bits (bit 31 the sign)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_down(q: torch.Tensor) -> torch.Tensor:
    """GPTQ's qweight: codes [in, out] -> int32 [in / 8, out], row 8i + b in bits 4b of row i."""
    q = q.to(torch.int64)
    words = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for b in range(8):
        words |= q[b::8] << (4 * b)
    return as_int32(words)


def pack_across(q: torch.Tensor, nibble_columns=tuple(range(8))) -> torch.Tensor:
    """codes [rows, cols] -> int32 [rows, cols / 8], column 8j + nibble_columns[i] in bits 4i."""
    q = q.to(torch.int64)
    words = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(nibble_columns):
        words |= q[:, column::8] << (4 * i)
    return as_int32(words)


def quantize_groups(w: torch.Tensor, symmetric: bool, group: int = GROUP):
    """A reference round-to-nearest quantization per `group` input columns: (codes [out, in] in
    0..15, scale [out, groups] float16, zero [out, groups] in 0..15, the dequantized float32
    weight)."""
    out, cols = w.shape
    g = w.float().reshape(out, cols // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).half()
        zero = torch.full(scale.shape, 8)
    else:
        low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((high - low) / 15).half()
        zero = (-low / scale.float()).round().clamp(0, 15).long()
    codes = (g / scale.float()[..., None]).round() + zero[..., None]
    codes = codes.clamp(0, 15).long()
    dequantized = (codes - zero[..., None]) * scale.float()[..., None]
    return codes.reshape(out, cols), scale, zero, dequantized.reshape(out, cols)


def input_order(module: str, columns: int) -> torch.Tensor:
    """A random order of a projection's input columns, the same for projections of one input
    (as act-order quantization orders them by the input's statistics)."""
    parent, _, leaf = module.rpartition(".")
    seed = zlib.crc32(f"{parent}.{SHARED_INPUT.get(leaf, leaf)}".encode())
    return torch.randperm(columns, generator=torch.Generator().manual_seed(seed))


def layer_tensors(name: str, w: torch.Tensor, fmt: str) -> tuple[dict, torch.Tensor]:
    """(a projection's tensors as format `fmt` stores them, its dequantized float32 weight)."""
    module = name.removesuffix(".weight")
    if fmt == "gptq_act":  # group k: input columns order[k * GROUP : (k + 1) * GROUP]
        order = input_order(module, w.shape[1])
        codes, scale, zero, dequantized = quantize_groups(w[:, order], symmetric=False)
        place = torch.argsort(order)  # column c's place in the order
        codes, dequantized = codes[:, place], dequantized[:, place]
        tensors = {
            "qweight": pack_down(codes.t()),
            "qzeros": pack_across(((zero - 1).t() & 0xF).contiguous()),
            "scales": scale.t().contiguous(),
            "g_idx": (place // GROUP).to(torch.int32),
        }
        return {f"{module}.{part}": t for part, t in tensors.items()}, dequantized
    group = w.shape[1] if fmt == "gptq_row" else GROUP  # one scale a row: group_size -1
    codes, scale, zero, dequantized = quantize_groups(w, fmt == "compressed-tensors", group)
    if fmt in ("gptq", "gptq_v2", "gptq_row"):
        stored_zero = zero if fmt == "gptq_v2" else zero - 1  # the first format's: less one
        tensors = {
            "qweight": pack_down(codes.t()),
            "qzeros": pack_across((stored_zero.t() & 0xF).contiguous()),
            "scales": scale.t().contiguous(),
            "g_idx": torch.arange(w.shape[1], dtype=torch.int32) // group,
        }
    elif fmt == "awq":
        tensors = {
            "qweight": pack_across(codes.t().contiguous(), AWQ_NIBBLE_COLUMNS),
            "qzeros": pack_across(zero.t().contiguous(), AWQ_NIBBLE_COLUMNS),
            "scales": scale.t().contiguous(),
        }
    else:  # signed codes, packed by compressed-tensors' own packer (which adds 8)
        tensors = {
            "weight_packed": pack_to_int32((codes - 8).to(torch.int8), 4),
            "weight_scale": scale.contiguous(),
            "weight_shape": torch.tensor(list(w.shape)),
        }
    assert scale.shape[1] == w.shape[1] // group
    return {f"{module}.{part}": t for part, t in tensors.items()}, dequantized


def quantization_config(fmt: str) -> dict:
    if fmt == "gptq_act":
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
                "sym": False}  # fmt: skip
    if fmt == "gptq_row":
        return {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False}
    if fmt in ("gptq", "gptq_v2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                "sym": False, "checkpoint_format": fmt}  # fmt: skip
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": GROUP}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}  # fmt: skip


def write_int4(source: Path, dest: Path, fmt: str) -> tuple[Path, Path]:
    """(the int4 checkpoint in format `fmt`, its dequantized float32 twin) of `source`."""
    quantized, plain = {}, {}
    for name, w in load_file(source / "model.safetensors").items():
        if is_linear(name):
            tensors, plain[name] = layer_tensors(name, w, fmt)
            quantized.update(tensors)
        else:
            quantized[name] = plain[name] = w
    folders = dest / fmt, dest / "dequantized"
    for folder, weights in zip(folders, (quantized, plain), strict=True):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(weights, folder / "model.safetensors", {"format": "pt"})
    edit_config(folders[0], quantization_config=quantization_config(fmt))
    return folders


def int4_layers(llm: LLM) -> list[Int4Linear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, Int4Linear)]


@pytest.mark.parametrize(
    "arch,fmt",
    [
        ("llama", "gptq"),
        ("qwen2", "gptq_v2"),
        ("llama", "awq"),
        ("qwen3", "awq"),
        ("llama", "compressed-tensors"),
        ("llama", "gptq_act"),
        ("qwen3", "gptq_row"),
        ("qwen2", "gptq_act"),
        ("mistral", "compressed-tensors"),
        # Granite scales its o and down projections: their scales carry it, not the codes
        ("granite", "gptq"),
        ("granite", "awq"),
        ("granite", "compressed-tensors"),
    ],
)
def test_int4_checkpoint_matches_transformers_on_dequantized_weights(
    make_tiny, tmp_path, arch, fmt
):
    int4, dequantized = write_int4(make_tiny(arch), tmp_path, fmt)
    tokens, llm = tandem_greedy(int4)
    layers = int4_layers(llm)
    assert len(layers) == 4 * llm.engine.model_config.num_layers  # qkv, o, gate_up, down
    assert layers[0].weight_packed.dtype == torch.int32
    assert_greedy_matches(tokens, dequantized)


def test_gptq_zero_biases_of_older_quantizers_are_read_past(make_tiny, tmp_path):
    """GPTQ-for-LLaMa wrote a zero bias for every projection (vLLM skips them); a bias that is
    not zero still has no place in a model without biases."""
    int4, dequantized = write_int4(make_tiny("llama"), tmp_path, "gptq")
    tensors = load_file(int4 / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".qweight")]:
        tensors[name.replace(".qweight", ".bias")] = torch.zeros(tensors[name].shape[1])
    save_file(tensors, int4 / "model.safetensors", {"format": "pt"})
    tokens, _ = tandem_greedy(int4)
    assert_greedy_matches(tokens, dequantized)
    tensors["model.layers.0.mlp.down_proj.bias"][0] = 1.0
    save_file(tensors, int4 / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match=r"down_proj\.bias' has no place"):
        tandem_greedy(int4)


def test_older_compressed_tensors_zero_points_of_a_symmetric_scheme_are_read_past(
    make_tiny, tmp_path
):
    """compressed-tensors before 2024 wrote a symmetric scheme's zero points (signed 0); they
    neither overwrite the layer's own (8) nor stop the load; non-zero ones are refused."""
    int4, dequantized = write_int4(make_tiny("llama"), tmp_path, "compressed-tensors")
    tensors = load_file(int4 / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        zeros = torch.zeros(tensors[name].shape, dtype=torch.int8)
        tensors[name.replace("weight_scale", "weight_zero_point")] = zeros
    save_file(tensors, int4 / "model.safetensors", {"format": "pt"})
    tokens, llm = tandem_greedy(int4)
    assert all(int(layer.weight_zero_point.min()) == 8 for layer in int4_layers(llm))
    assert_greedy_matches(tokens, dequantized)
    tensors["model.layers.0.mlp.down_proj.weight_zero_point"][0, 0] = 1
    save_file(tensors, int4 / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="non-zero zero points"):
        tandem_greedy(int4)


@pytest.mark.parametrize("arch", ["phi3", "glm4", "ernie4_5"])
def test_int4_checkpoints_of_fused_or_reordered_projections_are_refused(make_tiny, tmp_path, arch):
    """Their rows are split (Phi-3's fused q/k/v, GLM-4's gate/up) or reordered (partial or
    interleaved rotary) as they load, which packed int4 tensors do not allow."""
    folder = tmp_path / arch
    shutil.copytree(make_tiny(arch), folder)
    edit_config(folder, quantization_config=quantization_config("gptq"))
    with pytest.raises(ValueError, match=r"are not supported: its (fused|rotary)"):
        LLM(str(folder), max_model_len=64)


def test_the_layer_equals_its_dequantized_weights_product(make_tiny, tmp_path):
    """The loaded codes, zero points and scales are the ones written: the stacked q/k/v layer
    of the first decoder layer multiplies as the dequantized q, k and v weights do."""
    source = make_tiny("llama")
    int4, dequantized = write_int4(source, tmp_path, "gptq")
    llm = LLM(str(int4), max_model_len=64, block_size=8)
    plain = load_file(dequantized / "model.safetensors")
    qkv = torch.cat([plain[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    x = torch.randn(5, qkv.shape[1], generator=torch.Generator().manual_seed(0))
    layer = llm.engine.model.layers[0].self_attn.qkv_proj
    torch.testing.assert_close(layer(x), x @ qkv.t(), rtol=1e-5, atol=1e-5)


def test_dummy_weights_with_an_int4_quantization_run_int4_layers(make_tiny):
    # groups of 128 where every width divides, else one scale per row (the tiny model's 64)
    tokens, llm = tandem_greedy(make_tiny("llama"), load_format="dummy", quantization="awq")
    layers = int4_layers(llm)
    assert len(layers) == 8 and all(len(t) == 12 for t in tokens)
    assert [layer.group_size for layer in layers[:4]] == [64, 64, 64, 128]  # down: 128 wide
    bytes_per_weight = llm.engine.byte_sizes()["linear_bytes"]
    assert bytes_per_weight == 0.5 + (4 + 1) / 64  # a float32 scale and a zero point per row


def test_two_ranks_with_int4_weights_give_the_tokens_of_one(make_tiny, tmp_path):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "gptq")
    assert tp_tokens(int4, 2) == tp_tokens(int4, 1)


def test_groups_that_a_rank_would_split_are_refused(make_tiny, tmp_path):
    int4, _ = write_int4(make_tiny("qwen2"), tmp_path, "awq")  # 96 MLP columns: 48 a rank
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: down_proj has 48 input"):
        tp_tokens(int4, 2)


@pytest.mark.parametrize(
    "fmt,change,message",
    [
        ("gptq", {"bits": 8}, "only 4-bit"),
        ("gptq", {"lm_head": True}, "quantized LM head"),
        ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("gptq", {"group_size": 12}, "group_size must be -1 or a positive multiple of 8"),
        ("awq", {"version": "gemv"}, "AWQ version 'gemv'"),
        ("awq", {"zero_point": False}, "zero_point=false"),
        ("awq", {"modules_to_not_convert": ["mlp"]}, "modules_to_not_convert"),
    ],
)
def test_unsupported_int4_schemes_are_refused(make_tiny, tmp_path, fmt, change, message):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, fmt)
    edit_config(int4, quantization_config={**quantization_config(fmt), **change})
    with pytest.raises(ValueError, match=message):
        LLM(str(int4), max_model_len=64)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"symmetric": False}, "zero points"),
        ({"actorder": "group"}, "actorder 'group'"),
        ({"strategy": "tensor"}, "strategy 'tensor'"),
        ({"num_bits": 8}, "only 4-bit int"),
    ],
)
def test_unsupported_pack_quantized_schemes_are_refused(make_tiny, tmp_path, change, message):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "compressed-tensors")
    config = quantization_config("compressed-tensors")
    config["config_groups"]["group_0"]["weights"].update(change)
    edit_config(int4, quantization_config=config)
    with pytest.raises(ValueError, match=message):
        LLM(str(int4), max_model_len=64)


def test_act_order_gathers_each_layers_input_into_its_group_order(make_tiny, tmp_path):
    """The layer's input order puts each group's input columns together (in ascending order
    within a group), one order for q, k and v."""
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "gptq_act")
    llm = LLM(str(int4), max_model_len=64, block_size=8)
    attention = llm.engine.model.layers[1].self_attn
    for layer, module in [(attention.qkv_proj, "q_proj"), (attention.o_proj, "o_proj")]:
        order = input_order(f"model.layers.1.self_attn.{module}", 64).view(-1, GROUP)
        assert torch.equal(layer.input_perm.long().view(-1, GROUP), order.sort(dim=1).values)


def test_act_order_projections_of_one_input_in_different_orders_are_refused(make_tiny, tmp_path):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "gptq_act")
    name = "model.layers.0.mlp.up_proj"
    other, _ = layer_tensors(
        "model.layers.0.mlp.down_proj.weight", torch.randn(128, 64), "gptq_act"
    )
    rewrite(int4, lambda t: t.update({f"{name}.{p}": other[f"model.layers.0.mlp.down_proj.{p}"]
                                       for p in ("qweight", "qzeros", "scales", "g_idx")}))  # fmt: skip
    with pytest.raises(ValueError, match=rf"{name}.*differs.*gate_up_proj.input_perm"):
        LLM(str(int4), max_model_len=64)


@pytest.mark.parametrize("drop", ["g_idx", "qweight"])
def test_act_order_needs_both_the_codes_and_g_idx(make_tiny, tmp_path, drop):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "gptq_act")
    name = f"model.layers.1.self_attn.o_proj.{drop}"
    rewrite(int4, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=f"lacks {name}"):
        LLM(str(int4), max_model_len=64)


def test_act_order_on_two_ranks_is_refused(make_tiny, tmp_path):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "gptq_act")
    with pytest.raises(ValueError, match="desc_act=true run on one device"):
        tp_tokens(int4, 2)


def test_an_act_order_g_idx_is_refused_naming_the_tensor(make_tiny, tmp_path):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "gptq")
    name = "model.layers.1.mlp.down_proj.g_idx"
    rewrite(int4, lambda t: t.update({name: t[name].flip(0).contiguous()}))
    with pytest.raises(ValueError, match=f"{name}.*act-order.*desc_act=false"):
        LLM(str(int4), max_model_len=64)


def test_a_layer_left_in_floats_is_refused_naming_it(make_tiny, tmp_path):
    int4, dequantized = write_int4(make_tiny("llama"), tmp_path, "awq")
    plain = load_file(dequantized / "model.safetensors")
    module = "model.layers.0.mlp.up_proj"

    def edit(tensors):
        for part in ("qweight", "qzeros", "scales"):
            del tensors[f"{module}.{part}"]
        tensors[f"{module}.weight"] = plain[f"{module}.weight"]

    rewrite(int4, edit)
    with pytest.raises(ValueError, match=rf"{module}.weight"):
        LLM(str(int4), max_model_len=64)


@pytest.mark.parametrize(
    "args,message",
    [
        ({"quantization": "awq"}, "quantization='awq' does not match.*'gptq'"),
        ({"quantization": "fp8"}, "quantization='fp8' does not match"),
        ({"enable_lora": True}, "not FP8 or int4"),
        ({"deterministic": True}, "Int4Linear"),
    ],
)
def test_settings_int4_weights_cannot_take_are_refused(make_tiny, tmp_path, args, message):
    int4, _ = write_int4(make_tiny("llama"), tmp_path, "gptq")
    with pytest.raises(ValueError, match=message):
        LLM(str(int4), max_model_len=64, **args)


def test_int4_on_a_checkpoint_without_it_needs_dummy_weights(make_tiny):
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint quantized"):
        LLM(str(make_tiny("llama")), max_model_len=64, quantization="gptq")


def test_int4_mixture_of_experts_is_refused(make_tiny):
    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(str(make_tiny("qwen3_moe")), max_model_len=64, load_format="dummy", quantization="awq")


def test_update_weights_refuses_int4_layers(make_tiny, tmp_path):
    int4, dequantized = write_int4(make_tiny("llama"), tmp_path, "gptq")
    llm = LLM(str(int4), max_model_len=64)
    weights = load_file(dequantized / "model.safetensors")
    with pytest.raises(ValueError, match="int4 codes"):
        llm.update_weights(list(weights.items()))


def test_older_checkpoints_settings_file_is_read_where_quantization_names_it(make_tiny, tmp_path):
    int4, dequantized = write_int4(make_tiny("llama"), tmp_path, "awq")
    config = json.loads((int4 / "config.json").read_text())
    settings = config.pop("quantization_config")
    (int4 / "config.json").write_text(json.dumps(config))
    # AutoAWQ's own file and names: w_bit, q_group_size, "GEMM"
    (int4 / "quant_config.json").write_text(json.dumps(
        {"w_bit": 4, "q_group_size": settings["group_size"], "zero_point": True, "version": "GEMM"}
    ))  # fmt: skip
    (int4 / "quant_config.json").rename(int4 / "elsewhere.json")
    with pytest.raises(ValueError, match="quantization='awq' needs a checkpoint quantized"):
        LLM(str(int4), max_model_len=64, quantization="awq")
    (int4 / "elsewhere.json").rename(int4 / "quant_config.json")
    tokens, llm = tandem_greedy(int4, quantization="awq_marlin")
    assert len(int4_layers(llm)) == 8
    assert_greedy_matches(tokens, dequantized)
