"""Weights broadcast by a trainer process over NCCL: the trainer on GPU 1, the engine on GPU 0
with CUDA graphs and async batching. NCCL takes one rank per device, so this needs two."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection

import pytest
import torch
from safetensors.torch import load_file

from tandem import LLM, SamplingParams
from tandem.parallel import free_port
from tandem.weight_transfer import update_info_for

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

ENGINE_ARGS = {"max_model_len": 256, "block_size": 16, "dtype": "bfloat16", "num_blocks": 64}
TRANSFER = {"weight_transfer_config": {"backend": "nccl"}}
PROMPTS = [
    {"prompt_token_ids": [(5 * i + 3 * j) % 200 + 3 for j in range(20 + i)]} for i in range(6)
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def trainer(
    init_info: dict, folder: str, packed: bool, done: multiprocessing.connection.Connection
):
    """The trainer's process: its group on GPU 1, then B's tensors in bf16 from there."""
    from tandem.weight_transfer import NCCLWeightTransferEngine

    torch.cuda.set_device(1)
    group = NCCLWeightTransferEngine.trainer_init(init_info)
    state = load_file(f"{folder}/model.safetensors", device="cuda:1")
    pairs = [(name, state[name].to(torch.bfloat16)) for name in sorted(state)]
    NCCLWeightTransferEngine.trainer_send_weights(iter(pairs), {"group": group, "packed": packed})
    torch.cuda.synchronize()
    done.send("sent")


@pytest.mark.parametrize("packed", [False, True])
def test_a_trainer_on_another_gpu_broadcasts_weights_under_captured_graphs(checkpoints, packed):
    a, b = checkpoints
    on_b = tokens(LLM(b, **ENGINE_ARGS))
    llm = LLM(a, **ENGINE_ARGS, **TRANSFER)
    assert tokens(llm) != on_b
    init_info = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
    }
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=trainer, args=(init_info, b, packed, theirs))
    process.start()
    try:
        llm.init_weight_transfer_engine({"init_info": init_info})
        llm.start_weight_update()
        state = load_file(f"{b}/model.safetensors")
        pairs = [(name, state[name].to(torch.bfloat16)) for name in sorted(state)]
        llm.update_weights({"update_info": update_info_for(pairs, packed=packed)})
        llm.finish_weight_update()
        assert ours.poll(60) and ours.recv() == "sent"
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()
    assert tokens(llm) == on_b
