"""The FP8 KV cache: e4m3 values with per-tensor scales, stored by the decoder, read by the
torch reference and the Triton kernels (CPU: Triton's interpreter), and sized as such."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem import LLM, SamplingParams, memory
from tandem.attention import AttentionMetadata, triton_backend
from tandem.attention.torch_ref import decode_attention, prefill_attention, write_kv
from tandem.config import ModelConfig
from tandem.kv_cache import bytes_per_block
from tandem.model import fused
from tandem.model.loader import read_hf_config
from tandem.roofline import ModelCost, roofline_summary

E4M3 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.25, 0.5


def reference_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """The value an e4m3 cache with this scale gives back: round(x / scale) * scale, saturated."""
    return (x.float() / scale).clamp(-448, 448).to(E4M3).float() * scale


def fp8_cache(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, seed: int = 0):
    """(an e4m3 cache [2, blocks + 1, block, heads, dim] of random codes, the float32 values it
    holds with K_SCALE and V_SCALE)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks + 1, block_size, kv_heads, head_dim)
    cache = (torch.randn(shape, generator=g) * 40).clamp(-448, 448).to(E4M3)
    values = cache.float() * torch.tensor([K_SCALE, V_SCALE]).view(2, 1, 1, 1, 1)
    return cache, values


def test_the_k_v_store_quantizes_with_each_scale_and_parks_padding_in_the_spare_slot():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 16, generator=g) * 200, torch.randn(5, 2, 16, generator=g)
    cache = torch.zeros(2, 4 + 1, 4, 2, 16, dtype=E4M3)
    slots = torch.tensor([3, 0, 9, -1, 15])
    write_kv(cache, k, v, slots, K_SCALE, V_SCALE)
    flat = cache.flatten(1, 2).float()
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]] * K_SCALE, reference_e4m3(k[keep], K_SCALE))
    assert torch.equal(flat[1, slots[keep]] * V_SCALE, reference_e4m3(v[keep], V_SCALE))
    assert torch.equal(flat[0, -1] * K_SCALE, reference_e4m3(k[3], K_SCALE))  # the spare slot
    assert flat[0, 1].abs().sum() == 0  # untouched slots stay zero
    assert flat[0].abs().max() == 448  # 200-sigma keys saturate instead of turning into NaN


def decode_case(seq_lens, block_size=8, kv_heads=2, group=2, head_dim=32, dtype=torch.float32):
    num_blocks = 24
    cache, values = fp8_cache(num_blocks, block_size, kv_heads, head_dim)
    g = torch.Generator().manual_seed(1)
    tables = torch.randperm(num_blocks, generator=g)[: len(seq_lens) * 6].view(len(seq_lens), 6)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g).to(dtype)
    meta = AttentionMetadata(lens, lens, lens, tables.to(torch.int32), decode_only=True)
    return q, cache, values, meta


def test_torch_decode_over_an_fp8_cache_equals_attention_over_its_values():
    q, cache, values, meta = decode_case([1, 17, 40])
    scale = 32**-0.5
    ours = decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale, (K_SCALE, V_SCALE))
    expected = decode_attention(q, values, meta.block_tables, meta.seq_lens, scale)
    assert torch.equal(ours, expected)


def prefill_case(cached, new, dtype=torch.float32, kv_heads=2, group=2, head_dim=32):
    seq_lens = [c + n for c, n in zip(cached, new, strict=True)]
    cache, values = fp8_cache(24, 8, kv_heads, head_dim)
    tables = torch.randperm(24, generator=torch.Generator().manual_seed(3))[:18].view(3, 6)
    tables = tables[: len(seq_lens)].to(torch.int32)
    starts = np.concatenate([[0], np.cumsum(new)]).tolist()
    q = torch.randn(starts[-1], kv_heads * group, head_dim).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        decode_only=False,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
    )
    return q, cache, values, meta


def test_torch_prefill_over_an_fp8_cache_equals_attention_over_its_values():
    q, cache, values, meta = prefill_case([0, 9, 20], [13, 1, 7])
    ours = prefill_attention(q, cache, meta, 0.2, (K_SCALE, V_SCALE))
    assert torch.equal(ours, prefill_attention(q, values, meta, 0.2))


@pytest.mark.parametrize("splits", [1, 3])
def test_triton_decode_reads_fp8_k_v_and_applies_their_scales(splits):
    q, cache, values, meta = decode_case([1, 17, 40], dtype=torch.float16)
    backend = triton_backend.TritonAttention(4, 2, 32, 8, q.device, num_splits=splits)
    out = backend(q, cache, meta, 32**-0.5, k_scale=K_SCALE, v_scale=V_SCALE)
    expected = decode_attention(q.float(), values, meta.block_tables, meta.seq_lens, 32**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_triton_prefill_reads_fp8_k_v_and_applies_their_scales():
    q, cache, values, meta = prefill_case([0, 9, 20], [13, 1, 7], dtype=torch.float16)
    backend = triton_backend.TritonAttention(4, 2, 32, 8, q.device)
    out = backend(q, cache, meta, 0.2, k_scale=K_SCALE, v_scale=V_SCALE)  # a decode row first
    expected = prefill_attention(q.float(), values, meta, 0.2)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def tiny_config(folder) -> ModelConfig:
    return ModelConfig.from_hf(read_hf_config(str(folder))[0])


def test_fp8_blocks_are_a_quarter_of_float32_and_the_cache_holds_four_times_the_blocks(
    make_tiny, monkeypatch
):
    cfg = tiny_config(make_tiny("llama"))
    assert bytes_per_block(cfg, 16, E4M3) * 2 == bytes_per_block(cfg, 16, torch.bfloat16)
    per_fp32_block = bytes_per_block(cfg, 8, torch.float32)
    monkeypatch.setattr(memory, "CPU_KV_CACHE_BYTES", 40 * per_fp32_block)  # the budget binds
    blocks = {}
    for kv_cache_dtype in ("auto", "fp8"):
        llm = LLM(str(make_tiny("llama")), max_model_len=64, block_size=8, max_num_seqs=64,
                  kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        blocks[kv_cache_dtype] = llm.engine.num_blocks
        dtypes = {cache.dtype for cache in llm.engine.kv_caches}
        assert dtypes == {E4M3 if kv_cache_dtype == "fp8" else torch.float32}
    assert blocks == {"auto": 40, "fp8": 160}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_engine_with_an_fp8_cache_equals_a_float32_cache_holding_the_reference_quantization(
    make_tiny, monkeypatch, arch
):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox", "def add(a, b):", "Hello there", "Our scheduler reads"]
    folder = str(make_tiny(arch))
    llm = LLM(folder, max_model_len=64, block_size=8, kv_cache_dtype="fp8")
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    def store_reference_e4m3(cache, k, v, slots, k_scale=1.0, v_scale=1.0):
        assert cache.dtype == torch.float32
        write_kv(cache, reference_e4m3(k, k_scale), reference_e4m3(v, v_scale), slots)

    monkeypatch.setattr(fused, "write_kv", store_reference_e4m3)
    llm = LLM(folder, max_model_len=64, block_size=8)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == expected


def test_checkpoint_kv_scales_apply_to_an_fp8_cache_only(make_tiny, tmp_path):
    source = make_tiny("llama")
    folder = tmp_path / "with-kv-scales"
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    tensors = load_file(source / "model.safetensors")
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5 + i)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([2.0])
    save_file(tensors, folder / "model.safetensors", {"format": "pt"})
    assert json.loads((folder / "config.json").read_text()).get("quantization_config") is None
    for kv_cache_dtype, expected in (("fp8", [(0.5, 2.0), (1.5, 2.0)]), ("auto", [(1.0, 1.0)] * 2)):
        llm = LLM(str(folder), max_model_len=64, kv_cache_dtype=kv_cache_dtype)
        layers = llm.engine.model.layers
        assert [(la.self_attn.k_scale, la.self_attn.v_scale) for la in layers] == expected
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def with_tensors(source, folder, extra: dict) -> str:
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    save_file({**load_file(source / "model.safetensors"), **extra}, folder / "model.safetensors")
    return str(folder)


def test_kv_scales_by_vllm_s_other_names_and_per_head_ones_refused(make_tiny, tmp_path):
    """Older llm-compressor checkpoints name them k_proj/v_proj.output_scale and AutoFP8's one
    kv_scale sets both (vLLM reads each so); a scale per KV head (compressed-tensors'
    "attn_head") is a ValueError under an FP8 cache, as vLLM's, not its first head's value."""
    source = make_tiny("llama")
    named = with_tensors(source, tmp_path / "named", {
        "model.layers.0.self_attn.k_proj.output_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([0.75]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(3.0),
    })  # fmt: skip
    layers = LLM(named, max_model_len=64, kv_cache_dtype="fp8").engine.model.layers
    assert [(la.self_attn.k_scale, la.self_attn.v_scale) for la in layers] == [
        (0.25, 0.75), (3.0, 3.0)
    ]  # fmt: skip
    per_head = with_tensors(source, tmp_path / "per-head", {
        "model.layers.0.self_attn.k_scale": torch.tensor([0.0005, 0.05]),
    })  # fmt: skip
    with pytest.raises(ValueError, match="KV cache scale per head"):
        LLM(per_head, max_model_len=64, kv_cache_dtype="fp8")
    LLM(per_head, max_model_len=64)  # a cache in the model dtype reads no scale


def test_roofline_counts_fp8_weights_and_kv_at_one_byte(make_tiny):
    cfg = tiny_config(make_tiny("llama"))
    bf16, fp8 = ModelCost.of(cfg, 2), ModelCost.of(cfg, 2, linear_bytes=1, kv_bytes=1)
    lm_head = cfg.vocab_size * cfg.hidden_size
    assert fp8.weight_bytes == (bf16.weight_bytes - 2 * lm_head) // 2 + 2 * lm_head
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.embed_row_bytes == bf16.embed_row_bytes
    work = np.array([[4, 4, 400, 400]])
    summary = roofline_summary(cfg, 2, work, linear_bytes=1, kv_bytes=1)
    assert (
        summary["bytes"]
        == fp8.weight_bytes + 4 * fp8.embed_row_bytes + 404 * fp8.kv_bytes_per_token
    )
