"""The architectures beyond Llama's family against transformers (fp32, tiny random checkpoints):
Qwen3-MoE and Mixtral (routed experts), Gemma 2 and 3 (sliding and full layers, soft caps,
scaled embeddings, GeGLU, extra norms), Phi-3 (fused weights, head_dim 48, longrope, a window),
Phi-4-mini's Phi-3 (partial rotary), SmolLM3 (a layer without position embedding), OLMo 2 and 3
(norms after the sublayers, q and k normed whole; OLMo 3's windows and full-layer YaRN), Granite
(its four multipliers), GLM-4 (sandwich norms, half of each head rotating in neighbouring pairs),
Seed-OSS (an o bias apart), ERNIE 4.5 (neighbouring rotary pairs), Mistral with a sliding window. Prompts are longer than
every window."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from tandem import LLM, SamplingParams, envs
from tandem.config import MOE, SUPPORTED_ARCHITECTURES, ModelConfig
from tandem.model import fused, fused_moe, moe
from tandem.model.tiny import ARCH_CONFIGS
from test_engine_vs_transformers import (
    MAX_TOKENS,
    PROMPT_LENGTHS,
    assert_same_greedy,
    prompts,
    reference,
    run_pieces_eagerly,
)

transformers = pytest.importorskip("transformers")

NEW_ARCHS = [
    "qwen2_moe", "qwen3_moe", "mixtral", "gemma2", "gemma3", "phi3", "phi4_mini", "smollm3",
    "olmo2", "olmo3", "granite", "glm4", "seed_oss", "ernie4_5", "mistral_sliding",
]  # fmt: skip
WINDOWED = {"gemma2": 16, "gemma3": 16, "phi3": 32, "olmo3": 16, "mistral_sliding": 24}


def test_the_prompts_reach_past_every_window():
    longest = max(PROMPT_LENGTHS)
    assert all(longest > window for window in WINDOWED.values())
    assert all(ARCH_CONFIGS[arch]["sliding_window"] == w for arch, w in WINDOWED.items())


@pytest.mark.parametrize(
    ("arch", "pieces"),
    [(arch, False) for arch in NEW_ARCHS]
    + [("qwen3_moe", True), ("gemma3", True), ("olmo3", True)],
)
def test_greedy_matches_transformers_with_chunked_prefill_and_preemption(
    make_tiny, monkeypatch, arch, pieces
):
    if pieces:
        run_pieces_eagerly(monkeypatch)
    folder = str(make_tiny(arch))
    llm = LLM(
        folder,
        max_model_len=96,
        block_size=8,
        num_blocks=14,  # 112 token slots for 6 requests of up to 71 tokens: forces preemption
        max_num_batched_tokens=16,  # below the longest prompt: forces chunked prefill
    )
    vocab = llm.engine.model_config.vocab_size
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts(vocab)], params, use_tqdm=False
    )
    assert llm.engine.scheduler.num_preemptions > 0
    for out, (tokens, logits) in zip(outputs, reference(folder), strict=True):
        assert_same_greedy(out.outputs[0].token_ids, tokens, logits)


@pytest.mark.parametrize(
    "arch", ["granite", "olmo3", "phi4_mini", "smollm3", "glm4", "seed_oss", "ernie4_5"]
)
def test_prompt_logprobs_equal_transformers(make_tiny, arch):
    """What greedy tokens cannot show (Granite's logits_scaling leaves every argmax alone): each
    prompt position's logprob against transformers' log-softmax, past the windows."""
    assert_prompt_logprobs_equal_transformers(str(make_tiny(arch)))


def assert_prompt_logprobs_equal_transformers(folder: str) -> None:
    config = json.loads((Path(folder) / "config.json").read_text())
    ids = max(prompts(ModelConfig.from_hf(config).vocab_size), key=len)
    llm = LLM(folder, max_model_len=96, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    [out] = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    ours = torch.tensor([next(iter(entry.values())) for entry in out.prompt_logprobs[1:]])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    theirs = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def test_gemma3_leaves_attn_logit_softcapping_unapplied_as_transformers(make_tiny, tmp_path):
    """Gemma 3's config keeps the field, but its attention caps nothing (vLLM's neither)."""
    folder = shutil.copytree(make_tiny("gemma3"), tmp_path / "gemma3-capped")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": 0.5}))
    assert_prompt_logprobs_equal_transformers(str(folder))


def test_yarn_serves_past_max_position_embeddings_as_transformers(make_tiny, tmp_path):
    """As vLLM: YaRN of factor 2 over an original length of 64 serves 128 positions; prompts
    of up to 71 tokens, past max_position_embeddings, score as transformers scores them."""
    folder = shutil.copytree(make_tiny("llama"), tmp_path / "yarn")
    config = json.loads((folder / "config.json").read_text())
    config |= {"max_position_embeddings": 64, "rope_scaling": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    assert LLM(str(folder)).engine.max_model_len == 128
    assert_prompt_logprobs_equal_transformers(str(folder))


def edited(make_tiny, tmp_path, arch: str, **fields) -> str:
    """A copy of the tiny `arch` checkpoint with config.json's `fields` set (None: left out)."""
    folder = shutil.copytree(make_tiny(arch), tmp_path / f"{arch}-edited")
    config = json.loads((folder / "config.json").read_text()) | fields
    config = {key: value for key, value in config.items() if value is not None}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("multiplier", [None, 1.0])
def test_granite_without_an_attention_multiplier_scales_by_one_as_transformers(
    make_tiny, tmp_path, multiplier
):
    """Granite's softmax scale is attention_multiplier itself, 1.0 when left out (it was
    head_dim ** -0.5 there)."""
    folder = edited(make_tiny, tmp_path, "granite", attention_multiplier=multiplier)
    assert_prompt_logprobs_equal_transformers(folder)


@pytest.mark.parametrize("arch", ["glm4", "seed_oss", "ernie4_5", "granite"])
def test_a_stray_sliding_window_windows_nothing_where_transformers_reads_none(
    make_tiny, tmp_path, arch
):
    """These architectures' transformers code has no window: the field is not read (it
    windowed five layers in six over the 41-token prompt)."""
    assert_prompt_logprobs_equal_transformers(edited(make_tiny, tmp_path, arch, sliding_window=20))


def test_a_window_as_wide_as_the_positions_stays_when_yarn_serves_past_them(make_tiny, tmp_path):
    """A window of max_position_embeddings (32) is no window only when no sequence is longer;
    YaRN of factor 4 serves 128 positions, and the 41-token prompt is windowed as transformers
    windows it."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    folder = edited(
        make_tiny, tmp_path, "mistral_sliding", sliding_window=32, max_position_embeddings=32,
        rope_scaling=rope,
    )  # fmt: skip
    assert LLM(folder).engine.model_config.sliding_window == 32
    assert_prompt_logprobs_equal_transformers(folder)


# config.json's bare shape; the mixtures' expert fields too
SIZES = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 256}  # fmt: skip
EXPERTS = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 32}  # fmt: skip


@pytest.mark.parametrize("arch", list(SUPPORTED_ARCHITECTURES))
def test_a_config_that_leaves_fields_out_reads_as_transformers_fills_them_in(arch):
    """transformers' config class fills what config.json leaves out with its own defaults
    (Mixtral's rope_theta, Gemma's head_dim 256, GLM-4's half rotary...): the bare fields give
    the model that the filled-in ones do. EOS ids aside: the engine reads them from
    generation_config.json or the tokenizer where config.json has none."""
    model_type = {"gemma3": "gemma3_text"}.get(SUPPORTED_ARCHITECTURES[arch])
    bare = {**SIZES, **(EXPERTS if arch in MOE else {}), "architectures": [arch]}
    filled = transformers.AutoConfig.for_model(
        model_type or SUPPORTED_ARCHITECTURES[arch], **bare
    ).to_dict()
    theirs = dataclasses.replace(ModelConfig.from_hf({**filled, "architectures": [arch]}),
                                 eos_token_ids=())  # fmt: skip
    assert ModelConfig.from_hf(bare) == theirs


@pytest.mark.parametrize(
    ("arch", "fields"),
    [
        ("Glm4ForCausalLM", {}),
        ("Glm4ForCausalLM", {"attention_bias": False}),
        ("SeedOssForCausalLM", {}),
        ("SeedOssForCausalLM", {"attention_out_bias": True}),
        ("Qwen2MoeForCausalLM", {"qkv_bias": False}),
        ("LlamaForCausalLM", {"attention_bias": True}),
    ],
)
def test_attention_biases_are_where_transformers_builds_them(arch, fields):
    bare = {**SIZES, **(EXPERTS if arch in MOE else {}), "architectures": [arch], **fields}
    config = transformers.AutoConfig.for_model(SUPPORTED_ARCHITECTURES[arch], **bare,
                                               pad_token_id=0)  # fmt: skip
    attention = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].self_attn
    ours = ModelConfig.from_hf(bare)
    assert ours.qkv_bias == (attention.q_proj.bias is not None)
    assert ours.o_proj_bias == (attention.o_proj.bias is not None)


def test_phi3_past_its_original_length_takes_the_long_factors_as_transformers(make_tiny, tmp_path):
    """max_model_len past original_max_position_embeddings (64 here): the long factors rotate
    every position. transformers rotates a prompt longer than 64 the same way, so prompts of 70
    and 90 tokens generate its tokens, with chunked prefill; a max_model_len within 64 would give
    the short factors (tests/test_rope.py), and other tokens."""
    folder = shutil.copytree(make_tiny("phi3"), tmp_path / "phi3-long")
    config = json.loads((folder / "config.json").read_text())
    config["original_max_position_embeddings"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, config["vocab_size"], (n,), generator=g).tolist() for n in (70, 90)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(str(folder), max_model_len=128, block_size=8, max_num_batched_tokens=32)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    for out, prompt in zip(outputs, ids, strict=True):
        hf = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=10, do_sample=False, output_logits=True, return_dict_in_generate=True,
            eos_token_id=None, pad_token_id=config["vocab_size"] - 1,
        )  # fmt: skip
        theirs = hf.sequences[0, len(prompt) :].tolist()
        assert_same_greedy(out.outputs[0].token_ids, theirs, [s[0] for s in hf.logits])


@pytest.mark.parametrize("arch", ["mistral_sliding", "gemma2"])
def test_the_window_changes_the_tokens(make_tiny, tmp_path, arch):
    """Without its window the same checkpoint gives other tokens: the tests above see it."""
    folder = shutil.copytree(make_tiny(arch), tmp_path / arch)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "sliding_window": None}))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = prompts(config["vocab_size"])[1]  # 41 tokens
    tokens = []
    for path in (make_tiny(arch), folder):
        llm = LLM(str(path), max_model_len=96, num_blocks=32)
        tokens.append(llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False))
    assert tokens[0][0].outputs[0].token_ids != tokens[1][0].outputs[0].token_ids


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_router_matches_transformers_router_outputs_on_random_inputs(make_tiny, arch):
    folder = make_tiny(arch)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    cfg = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    layer = model.model.layers[0].mlp
    router = layer.gate
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    _, hf_weights, hf_ids = router(x)
    weights, ids = moe.route(x @ router.weight.T, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float())
    # and the whole block: the experts' weighted sum
    ours = moe.SparseMoeBlock(cfg, moe.TensorParallel())
    ours.gate.weight.data.copy_(router.weight)
    ours.experts.gate_up_proj.data.copy_(layer.experts.gate_up_proj)
    ours.experts.down_proj.data.copy_(layer.experts.down_proj)
    if arch == "qwen2_moe":  # and the shared expert, scaled by its gate
        shared = layer.shared_expert
        ours.shared_expert.gate_up_proj.weight.data.copy_(
            torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        )
        ours.shared_expert.down_proj.weight.data.copy_(shared.down_proj.weight)
        ours.shared_expert_gate.weight.data.copy_(layer.shared_expert_gate.weight)
        gated = torch.sigmoid(x @ layer.shared_expert_gate.weight.T) * shared(x)
        assert gated.abs().mean() > 0.1 * layer(x[None])[0].abs().mean()  # a share that counts
    torch.testing.assert_close(ours(x), layer(x[None])[0], atol=1e-5, rtol=1e-5)


def random_experts(tokens, hidden, inter, experts, top_k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = moe.route(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "experts", "top_k"),
    [(1, 64, 32, 8, 2), (7, 48, 40, 4, 2), (40, 64, 32, 16, 4), (5, 32, 24, 8, 8)],
)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_moe_kernel_matches_the_torch_experts(
    dtype, tokens, hidden, inter, experts, top_k, act
):
    """Triton grouped GEMMs (interpreted on CPU): one token, ragged shapes that no tile divides,
    experts with no token, every expert routed (top_k == experts)."""
    x, w13, w2, weights, ids = random_experts(tokens, hidden, inter, experts, top_k, dtype)
    got = fused_moe.fused_experts(x, w13, w2, weights, ids, act)
    expected = fused_moe.fused_experts_torch(x.float(), w13.float(), w2.float(), weights, ids, act)
    tol = 2e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_align_by_expert_puts_each_pair_once_in_its_experts_blocks():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (23, 3), generator=g)
    blocks = fused_moe.align_by_expert(ids, 6, block_m=4)
    num_pairs, used = ids.numel(), int(blocks.num_rows)
    pairs = blocks.sorted_pairs[:used]
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    assert (blocks.sorted_pairs[used:] == num_pairs).all()
    assert used % 4 == 0 and blocks.sorted_pairs.numel() == fused_moe.max_sorted_rows(69, 6, 4)
    experts_of_rows = blocks.block_expert.repeat_interleave(4)[:used]
    flat = ids.flatten()
    rows = (pairs < num_pairs).nonzero().flatten()
    assert torch.equal(experts_of_rows[rows], flat[pairs[rows].long()].int())
    assert (experts_of_rows[:-1] <= experts_of_rows[1:]).all()  # runs in expert order


@pytest.mark.parametrize(
    "arch",
    [
        "qwen2_moe",
        "qwen3_moe",
        "phi3",
        "gemma2",
        "phi4_mini",
        "smollm3",
        "olmo3",
        "granite",
        "glm4",
        "ernie4_5",
    ],
)
def test_engine_with_triton_kernels_gives_the_torch_tokens(make_tiny, arch, monkeypatch):
    """The Triton path (fused MoE, padded head size 48, windows and soft caps in the attention
    kernels; partial rotary and unrotated layers through the rotary kernels, OLMo's whole-width
    q and k norms, Granite's scales), interpreted on CPU through the whole engine, against the
    torch path."""
    # 41 and 18 tokens: past every window
    requests = [
        {"prompt_token_ids": list(range(5, 46))},
        {"prompt_token_ids": list(range(100, 118))},
    ]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for kernels in (False, True):
        monkeypatch.setattr(fused, "use_kernels", lambda x, on=kernels: on)
        llm = LLM(str(make_tiny(arch)), attention_backend="triton" if kernels else "torch",
                  max_model_len=64, num_blocks=16, max_num_batched_tokens=32)  # fmt: skip
        tokens[kernels] = [
            o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)
        ]
    assert tokens[True] == tokens[False]


def test_moe_tiles_setting_parses_four_ints_and_rejects_anything_else():
    assert envs.parse_moe_tiles("") is None
    assert envs.parse_moe_tiles("128,64,8,4") == (128, 64, 8, 4)
    for bad in ("64,64,4", "64,48,4,3", "64,64,3,3", "64,64,4,0", "a,b,c,d"):
        with pytest.raises(ValueError, match="TANDEM_MOE_TILES"):
            envs.parse_moe_tiles(bad)
