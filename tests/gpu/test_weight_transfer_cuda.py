"""Weights from a trainer process, into an engine with CUDA graphs and async batching: over
NCCL from a trainer on GPU 1 (NCCL takes one rank per device, so that needs two), and as CUDA
IPC handles from a trainer on the engine's own GPU, through a callable and over HTTP."""

from __future__ import annotations

import dataclasses
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
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
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


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
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


def bf16_pairs(folder: str, device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    state = load_file(f"{folder}/model.safetensors", device=device)
    return [(name, state[name].to(torch.bfloat16)) for name in sorted(state)]


def ipc_trainer(folder: str, packed: bool, url: str | None, pipe) -> None:
    """The trainer's process on the engine's GPU: B's tensors shared by IPC handles, sent through
    the pipe (a callable send mode) or to the server at `url`."""
    from tandem.weight_transfer import IPCWeightTransferEngine

    def through_pipe(info) -> None:
        pipe.send(dataclasses.asdict(info))
        assert pipe.recv() == "copied"

    args = {"send_mode": "http", "url": url} if url else {"send_mode": through_pipe}
    # a small buffer: several packed calls, the buffer reused for each
    sizes = {"packed_buffer_size_bytes": 1 << 20} if packed else {}
    IPCWeightTransferEngine.trainer_send_weights(
        iter(bf16_pairs(folder, "cuda")), {**args, "packed": packed, **sizes}
    )
    pipe.send("done")


def start_ipc_trainer(folder: str, packed: bool, url: str | None = None):
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=ipc_trainer, args=(folder, packed, url, theirs))
    process.start()
    return process, ours


@pytest.mark.parametrize("packed", [False, True])
def test_a_trainer_on_the_same_gpu_shares_its_tensors_by_ipc_handles(checkpoints, packed):
    a, b = checkpoints
    on_b = tokens(LLM(b, **ENGINE_ARGS))
    llm = LLM(a, **ENGINE_ARGS, weight_transfer_config={"backend": "ipc"})
    assert tokens(llm) != on_b
    llm.init_weight_transfer_engine({"init_info": {}})
    llm.start_weight_update()
    process, pipe = start_ipc_trainer(b, packed)
    calls = 0
    try:
        while (message := pipe.recv() if pipe.poll(120) else "timeout") not in ("done", "timeout"):
            llm.update_weights({"update_info": message})
            pipe.send("copied")
            calls += 1
        assert message == "done"
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()
    llm.finish_weight_update()
    assert calls == 1 or (packed and calls > 1)
    assert tokens(llm) == on_b


def test_ipc_handles_over_http_need_the_configs_consent(checkpoints):
    pytest.importorskip("uvicorn")
    from tandem.async_llm import AsyncLLM
    from tandem.server.app import build_app
    from test_server import running

    a, b = checkpoints
    on_b = tokens(LLM(b, **ENGINE_ARGS))
    config = {"backend": "ipc", "allow_pickled_handles": True}
    llm = AsyncLLM.from_model(a, **ENGINE_ARGS, weight_transfer_config=config)
    try:
        with running(build_app(llm, "tiny")) as url:
            import httpx

            assert httpx.post(f"{url}/start_weight_update").status_code == 200
            process, pipe = start_ipc_trainer(b, packed=True, url=url)
            assert pipe.poll(120) and pipe.recv() == "done"
            process.join(60)
            assert httpx.post(f"{url}/finish_weight_update").status_code == 200
            prompt = PROMPTS[0]["prompt_token_ids"]
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    finally:
        llm.shutdown()
    assert answer["choices"][0]["token_ids"] == on_b[0]
