"""How many KV blocks: as asked, from a CPU budget, or from device memory left after a peak step."""

from __future__ import annotations

import itertools

import torch

from tandem.attention import AttentionBackend, AttentionMetadata
from tandem.config import FIT_TO_CACHE, EngineConfig, ModelConfig, cdiv
from tandem.io_slot import logprob_buffer_bytes
from tandem.kv_cache import allocate_kv_cache, bytes_per_block
from tandem.model.decoder import Decoder
from tandem.sampling import SamplingTensors, sample

CPU_KV_CACHE_BYTES = 2 << 30


def num_kv_blocks(
    config: EngineConfig,
    cfg: ModelConfig,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    model: Decoder,
    attend: AttentionBackend,
) -> int:
    """Blocks of `kv_cache_dtype` (an FP8 cache's are half a bf16 cache's bytes); they must hold
    `max_model_len` tokens unless the engine fits its length to them (FIT_TO_CACHE), then 2."""
    per_block = bytes_per_block(cfg, config.block_size, kv_cache_dtype)
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = config.kv_cache_memory_bytes // per_block
        if num_blocks == 0:
            raise ValueError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} holds no KV block "
                f"({per_block} bytes each)"
            )
    elif device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        free, total = torch.cuda.mem_get_info(device)
        wanted = int(total * config.gpu_memory_utilization)
        check_free(config.gpu_memory_utilization, wanted, free, torch.cuda.memory_reserved(device))
        # the weights, and whatever else this process holds
        held = torch.cuda.memory_allocated(device)
        peak = peak_step_memory(config, cfg, kv_cache_dtype, device, max_model_len, model, attend)
        width = config.logprobs_width(cfg.vocab_size)  # the IO slots' logprob buffers come later
        budget = (
            wanted
            - peak
            - logprob_buffer_bytes(width, config.max_num_batched_tokens, config.max_num_seqs)
        )
        if budget < per_block:
            weights = sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))
            raise ValueError(
                no_room_message(config.gpu_memory_utilization, wanted, weights, held, peak)
            )
        num_blocks = budget // per_block
    else:
        wanted = cdiv(max_model_len, config.block_size) * config.max_num_seqs
        num_blocks = min(wanted, CPU_KV_CACHE_BYTES // per_block)
    needed = 2 if config.max_model_len == FIT_TO_CACHE else max_model_len
    if num_blocks * config.block_size < needed:
        raise ValueError(
            f"the KV cache holds {num_blocks * config.block_size} tokens, fewer than "
            f"max_model_len={max_model_len}; lower max_model_len or raise num_blocks / "
            "gpu_memory_utilization"
        )
    return num_blocks


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def check_free(utilization: float, wanted: int, free: int, reserved: int) -> None:
    """vLLM's start-up check: the memory gpu_memory_utilization asks for must be free, or held by
    this process already (`reserved`: its other engines, its tensors)."""
    if free + reserved < wanted:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {gib(wanted)} of the device, but only "
            f"{gib(free)} are free (and {gib(reserved)} this process's): other processes hold the "
            "rest; lower gpu_memory_utilization or free the device"
        )


def no_room_message(utilization: float, wanted: int, weights: int, held: int, peak: int) -> str:
    """Why no KV block fits in `wanted` bytes: the weights, the largest step, and what this
    process held besides this engine's weights (another engine not shut down, say)."""
    besides = held - weights
    others = (
        f", and this process held {gib(besides)} besides (another engine that was not shut down?)"
        if besides >= 1 << 30
        else ""
    )
    return (
        f"no memory left for the KV cache: gpu_memory_utilization={utilization} allows "
        f"{gib(wanted)}; the model's weights take {gib(weights)}, its largest step "
        f"{gib(peak - held)} more{others}; raise gpu_memory_utilization or lower "
        "max_num_batched_tokens"
    )


@torch.inference_mode()
def peak_step_memory(
    config: EngineConfig,
    cfg: ModelConfig,
    kv_cache_dtype: torch.dtype,
    device: torch.device,
    max_model_len: int,
    model: Decoder,
    attend: AttentionBackend,
) -> int:
    """Peak device memory (weights included) of a forward pass plus filtered sampling at the
    largest step: max_num_batched_tokens prompt tokens, then max_num_seqs rows of logits (and
    their float32 copy, as penalties.py makes)."""
    num_tokens = config.max_num_batched_tokens
    seq_len = min(num_tokens, max_model_len - 1)
    # E.g. 10 tokens, sequences of at most 4 -> [4, 4, 2]
    seq_lens = [seq_len] * (num_tokens // seq_len) + [num_tokens % seq_len] * (
        num_tokens % seq_len > 0
    )
    blocks_per_seq = cdiv(seq_len, config.block_size)
    num_seqs = len(seq_lens)
    kv_caches = allocate_kv_cache(
        cfg, num_seqs * blocks_per_seq, config.block_size, kv_cache_dtype, device
    )
    starts = [0, *itertools.accumulate(seq_lens)]
    slots_per_seq = blocks_per_seq * config.block_size
    meta = AttentionMetadata(
        slot_mapping=torch.cat(
            [torch.arange(n) + i * slots_per_seq for i, n in enumerate(seq_lens)]
        ).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32, device=device).view(
            num_seqs, -1
        ),
        decode_only=False,
        query_start_loc_host=starts,
        seq_lens_host=seq_lens,
    )
    ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=device)
    positions = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
    hidden = model(ids, positions, kv_caches, meta, attend)
    rows = torch.arange(config.max_num_seqs, device=device) % num_tokens
    logits = model.compute_logits(hidden[rows])
    penalized = logits.to(torch.float32, copy=True)  # a penalized step samples from a copy
    ones = torch.ones(config.max_num_seqs, device=device)
    sample(
        penalized,
        SamplingTensors(ones, ones.int(), ones * 0.9, ones * 0.1, ones.int(), ones.int()),
        use_filters=True,
    )
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del kv_caches, hidden, logits, penalized
    torch.cuda.empty_cache()
    return peak
