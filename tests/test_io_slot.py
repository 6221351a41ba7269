"""The IO slots' inputs that graph capture's warm-ups run on (IOSlot.reset_device)."""

from __future__ import annotations

import numpy as np
import torch

from tandem.io_slot import IOSlot


def test_reset_inputs_are_a_decode_step_of_padding_rows_after_any_step():
    max_tokens, max_seqs, max_blocks = 64, 8, 4
    slot = IOSlot(0, max_tokens, max_seqs, max_blocks, torch.device("cpu"), lora=True)
    x = slot.host_in.numpy()
    for values in x.values():  # what rows of earlier steps may have left
        values[...] = 7
    x["seq_lens"][:] = 0
    x["seq_order"][:] = 0
    slot.dev_out["sampled"].fill_(5)

    slot.reset_device()

    x = slot.dev_in.numpy()
    # every row a sequence of one key at position 0: the fused-rotary decode kernel rotates its
    # query at seq_len - 1, which must index the rotary table (zeroed rows gave -1)
    np.testing.assert_array_equal(x["seq_lens"], np.ones(max_seqs))
    assert (x["seq_lens"] - 1 >= 0).all()
    np.testing.assert_array_equal(x["seq_order"], np.arange(max_seqs))  # each row its own
    np.testing.assert_array_equal(x["logits_indices"], np.arange(max_seqs))
    # no token writes KV or takes a carried token or an adapter
    np.testing.assert_array_equal(x["slot_mapping"], np.full(max_tokens, -1))
    np.testing.assert_array_equal(x["carry_index"], np.full(max_tokens, -1))
    np.testing.assert_array_equal(x["lora_slots"], np.full(max_tokens, -1))
    np.testing.assert_array_equal(x["positions"], np.zeros(max_tokens))
    np.testing.assert_array_equal(x["input_ids"], np.zeros(max_tokens))
    # block tables, lengths and the rest name nothing outside the cache: zeros
    assert not x["block_tables"].any() and not x["query_start_loc"].any()
    np.testing.assert_array_equal(x["temperature"], np.zeros(max_seqs))
    assert not slot.dev_out["sampled"].any()
