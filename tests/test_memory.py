"""KV cache sizing on a GPU (memory.py), with the device's memory figures stated: vLLM's
start-up check that the memory asked for is free, the blocks left after the largest step, and
an error that names where the memory went."""

from __future__ import annotations

import pytest
import torch

from tandem import memory
from tandem.config import EngineConfig
from tandem.kv_cache import bytes_per_block
from test_swap import llama_8b

GIB = 1 << 30
CUDA = torch.device("cuda")


def sized(monkeypatch, *, free, total, reserved, allocated, peak, utilization=0.9, **engine):
    """num_kv_blocks on a device with these figures (bytes), for a model of 1 GiB of weights
    (`engine`: more EngineConfig arguments)."""
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated)
    monkeypatch.setattr(memory, "peak_step_memory", lambda *args: peak)
    model = torch.nn.Linear(GIB // 4 // 4096, 4096, bias=False, device="meta")  # float32: 1 GiB
    config = EngineConfig("x", gpu_memory_utilization=utilization, **engine)
    return memory.num_kv_blocks(config, llama_8b(), torch.bfloat16, CUDA, 8192, model, None)


def test_the_kv_cache_takes_what_the_utilization_allows_past_the_largest_step(monkeypatch):
    """... and past the IO slots' logprob buffers: two slots x (8,192 prompt rows x (1 + 2 x 20)
    + 256 sampled rows x 2 x 20) x 4 bytes at the defaults, the whole vocabulary's for
    max_logprobs=-1."""
    per_block = bytes_per_block(llama_8b(), 16, torch.bfloat16)  # 2 MiB
    logprobs = 2 * (8192 * 41 + 256 * 40) * 4
    got = sized(monkeypatch, free=78 * GIB, total=80 * GIB, reserved=1 * GIB, allocated=1 * GIB,
                peak=3 * GIB)  # fmt: skip
    assert got == (int(80 * GIB * 0.9) - 3 * GIB - logprobs) // per_block
    # another process holds 30 GiB: half the device is still this engine's to take
    got = sized(monkeypatch, free=48 * GIB, total=80 * GIB, reserved=1 * GIB, allocated=1 * GIB,
                peak=3 * GIB, utilization=0.5)  # fmt: skip
    assert got == (40 * GIB - 3 * GIB - logprobs) // per_block
    vocab = llama_8b().vocab_size
    whole = 2 * (512 * (1 + 2 * vocab) + 256 * 2 * vocab) * 4
    got = sized(monkeypatch, free=78 * GIB, total=80 * GIB, reserved=1 * GIB, allocated=1 * GIB,
                peak=3 * GIB, max_logprobs=-1, max_num_batched_tokens=512)  # fmt: skip
    assert got == (int(80 * GIB * 0.9) - 3 * GIB - whole) // per_block


def test_memory_other_processes_hold_is_named_before_anything_is_measured(monkeypatch):
    with pytest.raises(ValueError) as error:
        sized(monkeypatch, free=30 * GIB, total=80 * GIB, reserved=1 * GIB, allocated=1 * GIB,
              peak=3 * GIB)  # fmt: skip
    message = str(error.value)
    assert "gpu_memory_utilization=0.9 asks for 72.0 GiB" in message
    assert "only 30.0 GiB are free" in message and "other processes" in message


def test_no_room_names_the_weights_the_step_and_what_this_process_held_besides(monkeypatch):
    # this process's other engine holds 70 GiB (its memory is this process's: the check passes)
    with pytest.raises(ValueError) as error:
        sized(monkeypatch, free=9 * GIB, total=80 * GIB, reserved=71 * GIB, allocated=71 * GIB,
              peak=73 * GIB)  # fmt: skip
    message = str(error.value)
    assert "allows 72.0 GiB" in message and "weights take 1.0 GiB" in message
    assert "largest step 2.0 GiB more" in message
    assert "held 70.0 GiB besides (another engine that was not shut down?)" in message
    # alone, the same shortfall names no other holder
    with pytest.raises(ValueError, match="no memory left for the KV cache") as error:
        sized(monkeypatch, free=78 * GIB, total=80 * GIB, reserved=1 * GIB, allocated=1 * GIB,
              peak=80 * GIB)  # fmt: skip
    assert "besides" not in str(error.value)
