"""A step cut into pieces at its attentions (piecewise.py) computes what the whole forward does.

On CPU the pieces run eagerly, uncaptured: these tests check the cut, the buffers handed from
piece to piece and the padding; tests/gpu checks the captured graphs against the same pieces
run eagerly."""

from __future__ import annotations

import itertools

import pytest
import torch

from tandem.attention import AttentionMetadata
from tandem.attention.torch_ref import torch_attention
from tandem.config import ModelConfig
from tandem.io_slot import carry_over
from tandem.kv_cache import allocate_kv_cache
from tandem.model.decoder import Decoder
from tandem.model.loader import read_hf_config
from tandem.piecewise import PiecewiseGraphs, bucket_for, token_buckets

BLOCK_SIZE = 8


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 512, 513, 3000, 8192, 20000])
def test_buckets_cover_every_count_and_pad_little_where_matmuls_cost(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        bucket = bucket_for(buckets, n)
        assert bucket >= n
        if n > 512:
            assert bucket <= n * 1.125 + 1  # an eighth more rows at most
        else:
            assert bucket <= max(2 * n, 16)
    assert bucket_for(buckets, max_tokens + 1) is None


def random_decoder(arch: str, make_tiny) -> Decoder:
    cfg = ModelConfig.from_hf(read_hf_config(str(make_tiny(arch)))[0])
    torch.manual_seed(0)
    model = Decoder(cfg, 256).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pieces_with_padding_compute_the_whole_forward_and_store_the_same_kv(make_tiny, arch):
    """A step with two decodes (one carried over from the previous step) and two prompt
    chunks, padded from 16 to 32 tokens: the real rows' hidden states and the cache match the
    unpadded whole forward; padding rows write only the cache's spare block."""
    model = random_decoder(arch, make_tiny)
    cfg = model.cfg
    num_blocks = 12
    g = torch.Generator().manual_seed(1)
    caches = allocate_kv_cache(cfg, num_blocks, BLOCK_SIZE, torch.float32, torch.device("cpu"))
    for cache in caches:  # the decodes' earlier context
        cache.copy_(torch.randn(cache.shape, generator=g))
    whole_caches = [c.clone() for c in caches]
    before = [c.clone() for c in caches]

    query_lens, seq_lens = [1, 1, 5, 9], [20, 7, 5, 12]  # the last prompt has 3 cached tokens
    tables = torch.arange(4 * 3, dtype=torch.int32).view(4, 3)  # 3 blocks per sequence
    num_tokens, bucket = sum(query_lens), 32
    starts = [0, *itertools.accumulate(query_lens)]
    positions = torch.cat(
        [torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)]
    ).int()
    seq_of_token = torch.repeat_interleave(torch.arange(4), torch.tensor(query_lens))
    slot_mapping = (
        tables[seq_of_token, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    )
    pad = bucket - num_tokens
    inputs = {
        "input_ids": torch.cat([torch.randint(1, cfg.vocab_size, (num_tokens,), generator=g),
                                torch.zeros(pad, dtype=torch.long)]).int(),
        "carry_index": torch.full((bucket,), -1, dtype=torch.int32),
        "positions": torch.cat([positions, torch.zeros(pad, dtype=torch.int32)]),
        "slot_mapping": torch.cat([slot_mapping.int(), torch.full((pad,), -1, dtype=torch.int32)]),
    }  # fmt: skip
    inputs["input_ids"][1], inputs["carry_index"][1] = 0, 1  # the previous step's second row
    prev_sampled = torch.tensor([3, cfg.vocab_size - 2], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.long(),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        decode_only=False,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
        seq_order=torch.tensor([0, 1], dtype=torch.int32),
    )

    with torch.inference_mode():
        ids = carry_over(
            inputs["input_ids"][:num_tokens], inputs["carry_index"][:num_tokens], prev_sampled
        )
        assert ids[1] == cfg.vocab_size - 2
        whole = model(ids, positions, whole_caches, meta, torch_attention)
        pieces = PiecewiseGraphs(model, caches, torch_attention, 64, torch.device("cpu"))
        hidden = pieces.forward(0, inputs, prev_sampled, bucket, num_tokens, meta)

    assert hidden.shape == (bucket, cfg.hidden_size)
    torch.testing.assert_close(hidden[:num_tokens], whole, atol=1e-5, rtol=1e-5)
    for cache, whole_cache, start in zip(caches, whole_caches, before, strict=True):
        assert not torch.equal(whole_cache, start)  # the step stored its K/V
        torch.testing.assert_close(cache[:, :num_blocks], whole_cache[:, :num_blocks], atol=1e-5, rtol=1e-5)  # fmt: skip
