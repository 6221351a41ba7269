"""FP8 weights: checkpoints in the compressed-tensors and "fp8" (block-scale) formats, and
quantization at load, against transformers running the dequantized weights in fp32."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams
from tandem.model import splitk
from tandem.model.loader import check_fp8
from tandem.parallel import TensorParallel
from tandem.quant import gemv
from tandem.quant.checkpoint import Fp8Config
from tandem.quant.fp8 import _quantize_tokens_triton, quantize_rows
from tandem.quant.linear import Fp8Linear

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

E4M3 = torch.float8_e4m3fn
LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)  # fmt: skip  (Phi-3's and GLM-4's fused ones)
PROMPT_LENGTHS = [3, 21, 9, 1]
MAX_TOKENS = 12
TIE = 1e-4
CHANNEL = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}
TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "weight" and parts[-2] in LINEARS


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A reference block quantization's scales: [ceil(rows / r), ceil(cols / c)], each block's
    largest magnitude mapped to 448."""
    r, c = block
    rows, cols = w.shape
    scales = torch.empty(-(-rows // r), -(-cols // c))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            scales[i, j] = w[i * r : (i + 1) * r, j * c : (j + 1) * c].abs().max() / 448
    return scales


def quantized(w: torch.Tensor, layout: str, block: tuple[int, int] | None):
    """(e4m3 weight, its scale as the format stores it, the dequantized float32 weight)."""
    w = w.float()
    if layout == "tensor":
        scale = w.abs().max() / 448
        full = scale.expand_as(w)
    elif layout == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448  # [rows, 1]
        full = scale.expand_as(w)
    else:
        scale = block_scales(w, block)
        full = torch.kron(scale, torch.ones(block))[: w.shape[0], : w.shape[1]]
    q = (w / full).clamp(-448, 448).to(E4M3)
    return q, scale, q.float() * full


def quantization_config(layout: str, method: str, block) -> dict:
    if method == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}  # fmt: skip
    weights = {**CHANNEL, "strategy": layout}
    if layout == "block":
        weights["block_structure"] = list(block)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": TOKEN}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group},
            "ignore": ["lm_head"]}  # fmt: skip


def write_fp8(
    source: Path, dest: Path, layout: str, method: str = "compressed-tensors", block=None
) -> tuple[Path, Path]:
    """(the FP8 checkpoint, its dequantized float32 twin for transformers) of `source`."""
    tensors = load_file(source / "model.safetensors")
    fp8, plain = {}, {}
    scale_name = "weight_scale_inv" if method == "fp8" else "weight_scale"
    for name, w in tensors.items():
        if is_linear(name):
            q, scale, dequantized = quantized(w, layout, block)
            fp8[name], fp8[name.replace("weight", scale_name)] = q, scale.contiguous()
            plain[name] = dequantized
        else:
            fp8[name] = plain[name] = w
    folders = dest / "fp8", dest / "dequantized"
    for folder, weights in zip(folders, (fp8, plain), strict=True):
        shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        save_file(weights, folder / "model.safetensors", {"format": "pt"})
    edit_config(folders[0], quantization_config=quantization_config(layout, method, block))
    return folders


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@functools.cache
def transformers_greedy(folder: str) -> list[tuple[list[int], list[torch.Tensor]]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    results = []
    for ids in prompts(model.config.vocab_size):
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=None,
            pad_token_id=model.config.vocab_size - 1,
        )
        results.append((out.sequences[0, len(ids) :].tolist(), [s[0] for s in out.logits]))
    return results


def tandem_greedy(folder: Path, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), max_model_len=64, block_size=8, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    vocab = llm.engine.model_config.vocab_size
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def assert_greedy_matches(ours: list[list[int]], reference_folder: Path) -> None:
    """Equal tokens, except that a sequence may part where transformers' top-2 logits tie."""
    for tokens, (theirs, logits) in zip(
        ours, transformers_greedy(str(reference_folder)), strict=True
    ):
        for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)):
            if a != b:
                top2 = logits[i].topk(2).values
                assert top2[0] - top2[1] < TIE, f"token {i}: ours {a}, transformers {b}"
                break


def assert_fp8_linears(llm: LLM) -> None:
    layer = llm.engine.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(linear, Fp8Linear) and linear.weight.dtype == E4M3
    assert llm.engine.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize(
    "arch,layout",
    [("llama", "channel"), ("qwen2", "tensor"), ("qwen3", "channel"), ("mistral", "tensor"),
     ("phi3", "tensor"), ("glm4", "tensor")],  # a fused matrix's one scale: each part's
)  # fmt: skip
def test_compressed_tensors_checkpoint_matches_transformers_on_dequantized_weights(
    make_tiny, tmp_path, arch, layout
):
    fp8, dequantized = write_fp8(make_tiny(arch), tmp_path, layout)
    tokens, llm = tandem_greedy(fp8)
    assert_fp8_linears(llm)
    assert_greedy_matches(tokens, dequantized)


@pytest.mark.parametrize(
    "method,block",
    [("fp8", (128, 128)), ("fp8", (32, 48)), ("compressed-tensors", (16, 32))],
    ids=["fp8-128x128", "fp8-partial-blocks", "compressed-tensors-block"],
)
def test_block_scale_checkpoint_matches_transformers_on_dequantized_weights(
    make_tiny, tmp_path, method, block
):
    # the tiny shapes (64 hidden, 128 MLP, 32-row k/v) split into several blocks, some partial
    fp8, dequantized = write_fp8(make_tiny("llama"), tmp_path, "block", method, block)
    tokens, llm = tandem_greedy(fp8)
    assert_fp8_linears(llm)
    assert llm.engine.model.layers[0].mlp.down_proj.weight_scale.shape == (64, -(-128 // block[1]))
    assert_greedy_matches(tokens, dequantized)


def test_quantization_fp8_at_load_matches_transformers_on_per_channel_quantized_weights(
    make_tiny, tmp_path
):
    source = make_tiny("qwen3")
    _, dequantized = write_fp8(source, tmp_path, "channel")
    tokens, llm = tandem_greedy(source, quantization="fp8")
    assert_fp8_linears(llm)
    assert_greedy_matches(tokens, dequantized)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])  # Qwen2-MoE: a shared expert too
def test_quantization_fp8_of_a_moe_model_quantizes_all_but_its_experts(make_tiny, tmp_path, arch):
    """As the decoder holds them: attention in FP8, the experts and the shared expert in the
    model dtype (every MoE model was refused, its experts quantized for FP8 places)."""
    source = make_tiny(arch)
    tensors = load_file(source / "model.safetensors")
    experts = ("experts", "shared_expert")
    plain = {
        name: quantized(w, "channel", None)[2]
        if is_linear(name) and not set(experts) & set(name.split("."))
        else w
        for name, w in tensors.items()
    }
    assert any("shared_expert." in n for n in plain) == (arch == "qwen2_moe")
    twin = tmp_path / "dequantized"
    shutil.copytree(source, twin, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(plain, twin / "model.safetensors", {"format": "pt"})
    tokens, llm = tandem_greedy(source, quantization="fp8")
    assert isinstance(llm.engine.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert_greedy_matches(tokens, twin)


def test_quantization_fp8_works_with_dummy_weights_and_warns_of_w8a16_on_the_cpu(make_tiny, caplog):
    tokens, llm = tandem_greedy(make_tiny("llama"), quantization="fp8", load_format="dummy")
    assert "dequantized for each matmul (W8A16)" in caplog.text
    assert not llm.engine.model.layers[0].mlp.gate_up_proj.w8a8
    assert_fp8_linears(llm)
    scale = llm.engine.model.layers[0].self_attn.qkv_proj.weight_scale
    assert scale.shape == (128, 1) and bool((scale > 0).all())
    assert all(len(t) == MAX_TOKENS for t in tokens)


def test_an_fp8_checkpoints_shapes_with_dummy_weights_quantize_them_per_channel(
    make_tiny, tmp_path
):
    fp8, _ = write_fp8(make_tiny("llama"), tmp_path, "block", "fp8", (32, 32))
    tokens, llm = tandem_greedy(fp8, load_format="dummy")
    assert_fp8_linears(llm)
    assert llm.engine.model.layers[0].mlp.down_proj.weight_scale.shape == (64, 1)
    assert all(len(t) == MAX_TOKENS for t in tokens)


def rewrite(folder: Path, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", {"format": "pt"})


def test_unknown_quant_method_is_rejected_by_name(make_tiny, tmp_path):
    fp8, _ = write_fp8(make_tiny("llama"), tmp_path, "channel")
    edit_config(fp8, quantization_config={"quant_method": "bitsandbytes", "bits": 4})
    with pytest.raises(
        ValueError, match=r"quant_method 'bitsandbytes'.*'awq', 'compressed-tensors', 'fp8', 'gptq'"
    ):
        LLM(str(fp8), max_model_len=64)


@pytest.mark.parametrize(
    "group,message",
    [
        ({"format": "marlin-24"}, "format 'marlin-24'.*'pack-quantized'"),
        ({"format": "pack-quantized"}, "only 4-bit int"),
        ({"weights": {**CHANNEL, "strategy": "group"}}, "strategy 'group'"),
        ({"weights": {**CHANNEL, "num_bits": 4}}, "only 8-bit float"),
        ({"weights": {**CHANNEL, "strategy": "block"}}, "block_structure must be two"),
    ],
)
def test_unsupported_compressed_tensors_schemes_are_rejected(make_tiny, tmp_path, group, message):
    fp8, _ = write_fp8(make_tiny("llama"), tmp_path, "channel")
    config = quantization_config("channel", "compressed-tensors", None)
    config["config_groups"]["group_0"].update(group)
    edit_config(fp8, quantization_config=config)
    with pytest.raises(ValueError, match=message):
        LLM(str(fp8), max_model_len=64)


def test_scale_of_the_wrong_shape_is_rejected_naming_the_tensor(make_tiny, tmp_path):
    fp8, _ = write_fp8(make_tiny("llama"), tmp_path, "channel")
    name = "model.layers.1.self_attn.k_proj.weight_scale"
    rewrite(fp8, lambda t: t.update({name: torch.ones(16, 1)}))
    with pytest.raises(ValueError, match=rf"{name}.*shape \(16, 1\).*\(32, 1\)"):
        LLM(str(fp8), max_model_len=64)


def test_block_scale_of_the_wrong_shape_is_rejected(make_tiny, tmp_path):
    fp8, _ = write_fp8(make_tiny("llama"), tmp_path, "block", "fp8", (32, 32))
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"
    rewrite(fp8, lambda t: t.update({name: torch.ones(4, 4)}))  # 128 x 64 in 32 x 32: [4, 2]
    with pytest.raises(ValueError, match=r"up_proj.weight_scale.*\(4, 4\).*\(4, 2\)"):
        LLM(str(fp8), max_model_len=64)


def test_a_layer_left_unquantized_in_an_fp8_checkpoint_is_rejected(make_tiny, tmp_path):
    fp8, _ = write_fp8(make_tiny("llama"), tmp_path, "channel")
    name = "model.layers.0.mlp.gate_proj.weight"
    rewrite(fp8, lambda t: t.update({name: t[name].float()}))
    with pytest.raises(ValueError, match=f"{name}.*torch.float32 where torch.float8_e4m3fn"):
        LLM(str(fp8), max_model_len=64)


def test_fp8_weights_with_float16_say_what_is_supported(make_tiny, tmp_path):
    with pytest.raises(ValueError, match=r"'bfloat16'.*'float32'.*float16 is not supported"):
        LLM(str(make_tiny("llama")), max_model_len=64, quantization="fp8", dtype="float16")


@pytest.mark.parametrize("field,value", [("quantization", "int4"), ("kv_cache_dtype", "fp8_e5m2")])
def test_unknown_quantization_settings_are_rejected(make_tiny, field, value):
    with pytest.raises(ValueError, match=field):
        LLM(str(make_tiny("llama")), max_model_len=64, **{field: value})


@pytest.mark.parametrize("groups", [1, 3])
def test_w8a16_linear_equals_f_linear_over_the_dequantized_weight_exactly(groups):
    g = torch.Generator().manual_seed(0)
    layer = Fp8Linear(96, 40, bias=True, group_size=None if groups == 1 else 32)
    w = torch.randn(40, 96, generator=g)
    scale = torch.rand(40, groups, generator=g) + 0.1
    layer.weight.data.copy_((w * 10).clamp(-448, 448).to(E4M3))
    layer.weight_scale.data.copy_(scale)
    layer.bias.data.copy_(torch.randn(40, generator=g))
    x = torch.randn(5, 96, generator=g)
    full = scale.repeat_interleave(32 if groups > 1 else 96, dim=1)
    expected = F.linear(x, layer.weight.float() * full, layer.bias)
    assert torch.equal(layer(x), expected)


def exact_e4m3_rows(rows: int, cols: int, step: float) -> torch.Tensor:
    """Rows of e4m3 values times `step` (a power of two), each row's largest magnitude 448:
    x / scale is exact in e4m3, so no rounding decides the codes (Triton's interpreter rounds
    float32 -> e4m3 wrongly, e.g. 124.3 -> 64; the GPU tests cover the device's rounding)."""
    codes = torch.randint(0, 256, (rows, cols), generator=torch.Generator().manual_seed(0))
    values = codes.to(torch.uint8).view(E4M3).float()
    values = torch.where(values.isnan(), 0.0, values)
    values[:, 0] = 448.0
    return values * step


def test_per_token_quantization_kernel_matches_torch():
    # Triton's interpreter on CPU; CUDA runs the same kernel for every W8A8 matmul
    x = exact_e4m3_rows(7, 200, 2.0**-3)
    x[3] = 0.0  # an all-zero token keeps a finite scale
    q, scale = _quantize_tokens_triton(x)
    q_ref, scale_ref = quantize_rows(x)
    assert torch.equal(scale, scale_ref) and scale[0].item() == 2.0**-3
    assert torch.equal(q.float(), q_ref.float())
    assert torch.equal(q.float() * scale, x)


def test_fp8_split_k_partials_equal_the_dequantized_product(monkeypatch):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    q, scale = quantize_rows(w)
    x = torch.randn(5, 256, generator=g)
    partials = splitk.linear_partials(x, q, weight_scale=scale)
    assert partials.dim() == 3 and partials.shape[0] > 1
    expected = x @ (q.float() * scale).T
    torch.testing.assert_close(partials.sum(0), expected, atol=1e-4, rtol=1e-4)
    grouped = torch.ones(64, 2)  # block scales: split-K leaves them to the layer's own matmul
    assert splitk.linear_partials(x, q, weight_scale=grouped, fallback=lambda x: "layer") == "layer"


def tp_tokens(folder: Path, tensor_parallel_size: int, **engine_args) -> list[list[int]]:
    llm = LLM(str(folder), max_model_len=64, block_size=8,
              tensor_parallel_size=tensor_parallel_size, **engine_args)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        vocab = llm.engine.model_config.vocab_size
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False
        )
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_two_ranks_with_fp8_weights_give_the_tokens_of_one(make_tiny):
    # rows are quantized before sharding, so each rank holds the one-device weights' slices
    # (an FP8 checkpoint's per-channel scales shard through the same names)
    source = make_tiny("qwen2")
    assert tp_tokens(source, 2, quantization="fp8") == tp_tokens(source, 1, quantization="fp8")


def test_block_scales_with_tensor_parallelism_are_rejected():
    block = Fp8Config(quantize_at_load=False, strategy="block", block=(128, 128))
    with pytest.raises(ValueError, match="block weight scales and tensor_parallel_size"):
        check_fp8(block, torch.bfloat16, TensorParallel(0, 2))
    check_fp8(
        Fp8Config(quantize_at_load=True, strategy="channel"), torch.bfloat16, TensorParallel(0, 2)
    )


@pytest.mark.parametrize("rows, out_features, in_features", [(1, 40, 1024), (3, 18, 300)])
def test_fp8_matrix_vector_kernel_equals_the_dequantized_product(rows, out_features, in_features):
    """Interpreted on CPU in float32: whole K steps and a ragged last one, a partial tile of
    weight rows, and more than one input row (benchmarks time those)."""
    g = torch.Generator().manual_seed(4)
    q, scale = quantize_rows(torch.randn(out_features, in_features, generator=g))
    x = torch.randn(rows, in_features, generator=g)
    out = gemv.fp8_gemv(x, q, scale, gemv.GemvTiles(block_n=16, block_k=256))
    expected = x.double() @ (q.double() * scale.double()).T
    torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="contiguous"):
        gemv.fp8_gemv(torch.zeros(rows, 2 * in_features)[:, ::2], q, scale)


def test_fp8_split_k_with_e4m3_activations_equals_the_product_of_both_dequantized():
    """W8A8 in the split-K kernel (interpreted on CPU): e4m3 x with a scale per row."""
    g = torch.Generator().manual_seed(5)
    q, scale = quantize_rows(torch.randn(64, 512, generator=g))
    xq, x_scale = quantize_rows(torch.randn(5, 512, generator=g))
    partials = splitk.linear_partials(xq, q, weight_scale=scale, x_scale=x_scale)
    assert partials.dim() == 3 and partials.shape[0] > 1
    expected = (xq.double() * x_scale.double()) @ (q.double() * scale.double()).T
    torch.testing.assert_close(partials.sum(0).double(), expected, atol=1e-4, rtol=1e-4)


def test_e4m3_inputs_step_over_256_features_where_they_divide():
    """The same bytes a step as 128 bfloat16 features; other widths as a bfloat16 input's."""
    device = torch.device("cpu")
    for in_features, fp8_step in ((4096, 256), (14336, 256), (384, 128), (96, 32)):
        assert splitk.plan(32, 4096, in_features, device, fp8_input=True).block_k == fp8_step
        assert splitk.plan(32, 4096, in_features, device).block_k == min(fp8_step, 128)


def test_w8a8_layer_at_decode_sizes_runs_the_triton_kernels_as_their_references():
    """Interpreted on CPU with the W8A8 flag forced: one row through the matrix-vector kernel
    (x as it is), 5 and 40 rows through split-K over e4m3 x (x quantized per token), and the
    o/down form's float32 slices adding up to the same product."""
    g = torch.Generator().manual_seed(6)
    layer = Fp8Linear(256, 48, bias=False)
    q, scale = quantize_rows(torch.randn(48, 256, generator=g))
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    layer.w8a8 = True
    weight = q.double() * scale.double()
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256, generator=g)
        xq, x_scale = quantize_rows(x)
        operand = x.double() if rows == 1 else xq.double() * x_scale.double()
        expected = operand @ weight.T
        torch.testing.assert_close(layer(x).double(), expected, atol=1e-4, rtol=1e-4)
        slices = layer.residual_partials(x)
        summed = slices.sum(0) if slices.dim() == 3 else slices
        torch.testing.assert_close(summed.double(), expected, atol=1e-4, rtol=1e-4)


def test_split_k_product_in_the_output_dtype_is_its_one_slice_rounded():
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(5, 256, generator=g), torch.randn(40, 256, generator=g)
    tiles = splitk.SplitTiles(16, 32, 64, splits=1)
    direct = splitk.linear_partials(x.half(), w.half(), tiles, out_dtype=torch.half)
    slices = splitk.linear_partials(x.half(), w.half(), tiles)
    assert direct.shape == (5, 40) and direct.dtype == torch.half
    assert torch.equal(direct, slices[0].half())
    with pytest.raises(ValueError, match="one split"):
        splitk.linear_partials(x, w, tiles._replace(splits=2), out_dtype=torch.half)
