"""Weights broadcast by a trainer process (vLLM's weight-transfer calls): A's engine, sent B's
tensors over the trainer's gloo group, generates what a fresh engine on B does."""

from __future__ import annotations

import asyncio
import base64
import pickle
import re
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tandem import LLM, SamplingParams
from tandem.async_llm import AsyncLLM
from tandem.parallel import free_port
from tandem.server.app import build_app
from tandem.weight_transfer import (
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferUpdateInfo,
    NCCLWeightTransferEngine,
    update_info_for,
)
from tandem.weight_transfer.common import TensorSpec, packed_chunks, tensor_specs, unpack
from test_server import running
from test_weight_update import ENGINE_ARGS, GREEDY, PROMPTS, tokens_and_logprobs

TRANSFER = {"weight_transfer_config": {"backend": "nccl"}}
JOIN_S = 60  # a trainer thread still waiting after this is stuck in a broadcast no one joined


@pytest.fixture(scope="module")
def fresh(checkpoints) -> dict[str, list]:
    return {path: tokens_and_logprobs(LLM(path, **ENGINE_ARGS)) for path in checkpoints}


def state_of(folder: str) -> list[tuple[str, torch.Tensor]]:
    state = load_file(f"{folder}/model.safetensors")
    return [(name, state[name]) for name in sorted(state)]


class Trainer:
    """The trainer's side, on threads of this process: its group and its broadcasts."""

    def __init__(self, world_size: int = 2):
        self.init_info = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": world_size,
        }
        self.group = None

    def join(self, engine_side) -> None:
        """The trainer's and the engine's halves of the rendezvous, at once."""
        thread = threading.Thread(target=self._init)
        thread.start()
        engine_side({"init_info": self.init_info})
        thread.join(JOIN_S)
        assert self.group is not None

    def _init(self) -> None:
        self.group = NCCLWeightTransferEngine.trainer_init(self.init_info)

    def send(self, pairs, **args) -> threading.Thread:
        """Broadcast `pairs` on a thread (the engine receives them meanwhile)."""
        thread = threading.Thread(
            target=NCCLWeightTransferEngine.trainer_send_weights,
            args=(iter(pairs), {"group": self.group, **args}),
        )
        thread.start()
        return thread


def send_update(llm, trainer: Trainer, pairs, info=None, **args) -> None:
    """vLLM's sequence: start, update (announce + broadcast), finish."""
    llm.start_weight_update()
    sender = trainer.send(pairs, **args)
    try:
        llm.update_weights({"update_info": info or update_info_for(pairs, **args)})
    finally:
        sender.join(JOIN_S)
        assert not sender.is_alive(), "the trainer's broadcast never completed"
    llm.finish_weight_update()


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"packed": True},  # one buffer of 1 GiB: every tensor in it
        {"packed": True, "packed_buffer_size_bytes": 40_000},  # many buffers, tensors split evenly
        {"packed": True, "packed_buffer_size_bytes": 100},  # each tensor alone, past the size
    ],
    ids=["one-by-one", "packed-whole", "packed-40kB", "packed-tiny"],
)
def test_broadcast_weights_then_generate_equals_a_fresh_engine_on_them(checkpoints, fresh, args):
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS, **TRANSFER)
    assert tokens_and_logprobs(llm) == fresh[a]
    hits = llm.engine.scheduler.cache.num_hit_tokens
    trainer = Trainer()
    trainer.join(llm.init_weight_transfer_engine)
    send_update(llm, trainer, state_of(b), **args)
    assert tokens_and_logprobs(llm) == fresh[b]
    assert llm.engine.scheduler.cache.num_hit_tokens == hits  # A's cached KV was forgotten
    send_update(llm, trainer, state_of(a), **args)  # the group serves every later update
    assert tokens_and_logprobs(llm) == fresh[a]


def test_an_update_may_come_in_several_calls(checkpoints, fresh):
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS, **TRANSFER)
    trainer = Trainer()
    trainer.join(llm.init_weight_transfer_engine)
    state = state_of(b)
    llm.start_weight_update()
    for part in (state[:5], state[5:]):
        sender = trainer.send(part, packed=True)
        llm.update_weights({"update_info": update_info_for(part, packed=True)})
        sender.join(JOIN_S)
    llm.finish_weight_update()
    assert tokens_and_logprobs(llm) == fresh[b]


def test_packed_buffers_cut_where_the_trainer_cuts_them():
    """The engine's chunks (from the announced sizes) are the trainer's broadcasts."""
    specs = [TensorSpec(f"t{i}", torch.float32, (size,)) for i, size in enumerate([3, 5, 1, 8, 2])]

    class Recorder:
        def __init__(self):
            self.sizes = []

        def broadcast(self, tensor, src=0, stream=None):
            self.sizes.append(tensor.numel())

    for limit in (1, 12, 20, 32, 36, 76, 1000):
        recorder = Recorder()
        pairs = [(s.name, torch.zeros(s.shape)) for s in specs]
        NCCLWeightTransferEngine.trainer_send_weights(
            pairs, {"group": recorder, "packed": True, "packed_buffer_size_bytes": limit}
        )
        chunks = packed_chunks(specs, limit)
        assert recorder.sizes == [sum(s.num_bytes for s in chunk) for chunk in chunks]
        assert [s.name for chunk in chunks for s in chunk] == [s.name for s in specs]
        # a buffer takes tensors until it passes the limit: all but its last stay within it
        assert all(sum(s.num_bytes for s in chunk[:-1]) <= limit for chunk in chunks)


@pytest.mark.parametrize("packed", [False, True])
def test_a_bad_name_or_shape_raises_once_the_broadcast_is_drained(checkpoints, fresh, packed):
    """The trainer's broadcast completes (no hang), nothing is copied, and the group and the
    update stay usable: the corrected update then goes in."""
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS, **TRANSFER)
    trainer = Trainer()
    trainer.join(llm.init_weight_transfer_engine)
    state = state_of(b)
    bad = [*state[:-1], ("model.layers.0.self_attn.q_proj.weight", torch.zeros(3, 3)), state[-1]]
    llm.start_weight_update()
    sender = trainer.send(bad, packed=packed)
    with pytest.raises(ValueError, match=r"q_proj\.weight"):
        llm.update_weights({"update_info": update_info_for(bad, packed=packed)})
    sender.join(JOIN_S)
    assert not sender.is_alive()
    sender = trainer.send(state, packed=packed)
    llm.update_weights({"update_info": update_info_for(state, packed=packed)})
    sender.join(JOIN_S)
    llm.finish_weight_update()
    assert tokens_and_logprobs(llm) == fresh[b]


@pytest.mark.parametrize("refusal", ["not started", "asleep", "no such expert"])
def test_a_refused_update_takes_its_broadcast_so_the_next_reads_its_own(
    checkpoints, fresh, refusal
):
    """Whatever refuses an update (no start_weight_update, weights asleep, a name of no
    parameter found late), its tensors are taken and dropped: the next update, sent as the
    error asks, gets its own bytes, not the refused one's (they were read as its own)."""
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS, **TRANSFER)
    trainer = Trainer()
    trainer.join(llm.init_weight_transfer_engine)
    state = state_of(b)
    refused = [(name, torch.full_like(t, 7.0)) for name, t in state]
    if refusal == "no such expert":  # an index past the model's experts: not an IndexError
        refused.append(("model.layers.0.mlp.experts.99.down_proj.weight", torch.zeros(3, 3)))
    if refusal == "asleep":
        llm.sleep(level=1)
    if refusal != "not started":
        llm.start_weight_update()
    sender = trainer.send(refused)
    with pytest.raises((RuntimeError, ValueError), match=r"start_weight_update|wake_up|no place"):
        llm.update_weights({"update_info": update_info_for(refused)})
    sender.join(JOIN_S)
    assert not sender.is_alive()
    if refusal == "asleep":
        llm.wake_up()
    if refusal == "not started":
        llm.start_weight_update()
    sender = trainer.send(state)
    llm.update_weights({"update_info": update_info_for(state)})
    sender.join(JOIN_S)
    llm.finish_weight_update()
    assert tokens_and_logprobs(llm) == fresh[b]


def test_no_step_runs_between_start_and_finish(checkpoints, fresh):
    """A generate running on another thread waits out the update, then finishes; one started
    meanwhile on the updating thread is an error, not a wait for itself."""
    a, b = checkpoints
    llm = LLM(a, **ENGINE_ARGS, **TRANSFER)
    trainer = Trainer()
    trainer.join(llm.init_weight_transfer_engine)
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    results = []
    running = threading.Thread(target=lambda: results.append(llm.generate(PROMPTS, long)))
    running.start()
    while llm.engine.num_steps < 3:
        time.sleep(0.001)
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="finish_weight_update"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    steps = llm.engine.num_steps
    time.sleep(0.3)
    assert llm.engine.num_steps == steps and not results  # held
    state = state_of(b)
    sender = trainer.send(state)
    llm.update_weights(request={"update_info": update_info_for(state)})  # vLLM's keyword
    sender.join(JOIN_S)
    assert llm.engine.num_steps == steps
    llm.finish_weight_update()
    running.join(JOIN_S)
    assert [len(o.outputs[0].token_ids) for o in results[0]] == [100] * len(PROMPTS)
    assert tokens_and_logprobs(llm) == fresh[b]


def test_calls_out_of_order_or_unconfigured_are_clear_errors(checkpoints):
    a, _ = checkpoints
    plain = LLM(a, **ENGINE_ARGS)
    with pytest.raises(RuntimeError, match="weight_transfer_config"):
        plain.start_weight_update()
    llm = LLM(a, **ENGINE_ARGS, **TRANSFER)
    info = update_info_for(state_of(a)[:1])
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine"):
        llm.update_weights({"update_info": info})
    trainer = Trainer()
    trainer.join(llm.init_weight_transfer_engine)
    sender = trainer.send(state_of(a)[:1])
    with pytest.raises(RuntimeError, match="start_weight_update"):
        llm.update_weights({"update_info": info})
    sender.join(JOIN_S)
    assert not sender.is_alive()  # the refused update's broadcast was taken
    with pytest.raises(RuntimeError, match="without start_weight_update"):
        llm.finish_weight_update()
    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="finish_weight_update first"):
        llm.start_weight_update()
    llm.finish_weight_update()
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    ("update_info", "error"),
    [
        ({"names": ["x"], "dtype_names": ["float32"]}, r"missing \['shapes'\]"),
        ({"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]], "pakced": True}, "pakced"),
        ({"names": ["x", "y"], "dtype_names": ["float32"], "shapes": [[1]]}, "one length"),
        ({"names": ["x"], "dtype_names": ["int64"], "shapes": [[1]]}, r"dtype_names\[0\]"),
        ({"names": ["x"], "dtype_names": ["float32"], "shapes": [[-1]]}, r"shapes\[0\]"),
        ({"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]], "packed": "yes"}, "packed"),
        (
            {"names": [], "dtype_names": [], "shapes": [], "packed_buffer_size_bytes": 0},
            "packed_buffer_size_bytes",
        ),
    ],
)
def test_a_malformed_update_info_is_a_value_error_naming_the_field(checkpoints, update_info, error):
    llm = LLM(checkpoints[0], **ENGINE_ARGS, **TRANSFER)
    Trainer().join(llm.init_weight_transfer_engine)
    llm.start_weight_update()
    with pytest.raises(ValueError, match=error):
        llm.update_weights({"update_info": update_info})


@pytest.mark.parametrize(
    ("init_info", "error"),
    [
        ({"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}, "rank_offset"),
        ({"master_address": "h", "master_port": 0, "rank_offset": 1, "world_size": 2}, "port"),
        ({"master_address": "h", "master_port": 9, "rank_offset": 0, "world_size": 2}, "offset"),
        ({"master_address": "h", "master_port": 9, "rank_offset": 2, "world_size": 2}, "no group"),
    ],
)
def test_a_malformed_init_info_is_a_value_error(checkpoints, init_info, error):
    llm = LLM(checkpoints[0], **ENGINE_ARGS, **TRANSFER)
    with pytest.raises(ValueError, match=error):
        llm.init_weight_transfer_engine({"init_info": init_info})
    with pytest.raises(TypeError, match="init_info"):
        llm.init_weight_transfer_engine(init_info)


@pytest.mark.parametrize(
    ("config", "error"),
    [({"backend": "rdma"}, "backend"), ({"backnd": "nccl"}, "backnd"), ("nccl", "backend")],
)
def test_a_bad_weight_transfer_config_is_a_value_error(checkpoints, config, error):
    with pytest.raises(ValueError, match=error):
        LLM(checkpoints[0], **ENGINE_ARGS, weight_transfer_config=config)


def test_tensor_specs_read_torch_dtype_names():
    specs = tensor_specs(["w"], ["bfloat16"], [[2, 3]])
    assert specs == [TensorSpec("w", torch.bfloat16, (2, 3))]
    assert specs[0].num_bytes == 12


def test_two_ranks_each_receive_the_broadcast_and_take_their_shards(checkpoints, fresh):
    """Tensor parallelism (gloo): both ranks join the trainer's group (world size 3) and copy
    their slices of each tensor."""
    a, b = checkpoints
    llm = LLM(a, tensor_parallel_size=2, **ENGINE_ARGS, **TRANSFER)
    try:
        trainer = Trainer(world_size=3)
        trainer.join(llm.init_weight_transfer_engine)
        send_update(llm, trainer, state_of(b), packed=True, packed_buffer_size_bytes=40_000)
        updated = tokens_and_logprobs(llm)
        bad = [("model.nonsense", torch.zeros(3))]
        llm.start_weight_update()
        sender = trainer.send(bad)
        with pytest.raises(ValueError, match="nonsense"):  # rank 1 drained it too, and lives
            llm.update_weights({"update_info": update_info_for(bad)})
        sender.join(JOIN_S)
        llm.finish_weight_update()
        again = tokens_and_logprobs(llm)
    finally:
        llm.shutdown()
    assert [t for t, _ in updated] == [t for t, _ in fresh[b]]
    assert [t for t, _ in again] == [t for t, _ in updated]  # (cache hits: logprobs may differ)


def test_async_llm_takes_an_update_while_a_request_waits(checkpoints, fresh):
    a, b = checkpoints

    async def scenario() -> list[int]:
        llm = AsyncLLM.from_model(a, **ENGINE_ARGS, **TRANSFER)
        try:
            trainer = Trainer()
            thread = threading.Thread(target=trainer._init)
            thread.start()
            await llm.init_weight_transfer_engine({"init_info": trainer.init_info})
            thread.join(JOIN_S)
            await llm.start_weight_update()
            late = asyncio.ensure_future(final(llm.generate(PROMPTS[0], GREEDY, "late")))
            await asyncio.sleep(0.2)
            assert not late.done()  # held until the update finishes
            state = state_of(b)
            sender = trainer.send(state)
            await llm.update_weights(request={"update_info": update_info_for(state)})
            sender.join(JOIN_S)
            await llm.finish_weight_update()
            return await asyncio.wait_for(late, JOIN_S)
        finally:
            llm.shutdown()

    assert asyncio.run(scenario()) == fresh[b][0][0]


async def final(stream) -> list[int]:
    outputs = [output async for output in stream]
    return outputs[-1].outputs[0].token_ids


@pytest.fixture(scope="module")
def server(checkpoints) -> Iterator[tuple[str, AsyncLLM]]:
    llm = AsyncLLM.from_model(checkpoints[0], **ENGINE_ARGS, **TRANSFER)
    with running(build_app(llm, "tiny")) as url:
        yield url, llm
    llm.shutdown()


def test_the_server_takes_vllms_weight_transfer_routes(server, checkpoints, fresh):
    url, _ = server
    _, b = checkpoints
    client = httpx.Client(base_url=url, timeout=JOIN_S)
    assert client.get("/get_world_size").json() == {"world_size": 1}
    trainer = Trainer()
    trainer.join(lambda body: client.post("/init_weight_transfer_engine", json=body))
    assert client.post("/start_weight_update").json() == {"message": "Weight update started"}
    state = state_of(b)
    sender = trainer.send(state, packed=True)
    body = {"update_info": update_info_for(state, packed=True)}
    assert client.post("/update_weights", json=body).json() == {"message": "Weights updated"}
    sender.join(JOIN_S)
    assert client.post("/finish_weight_update").status_code == 200
    answer = client.post(
        "/v1/completions",
        json={
            "model": "tiny",
            "prompt": PROMPTS[0]["prompt_token_ids"],
            "max_tokens": 12,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ).json()
    assert answer["choices"][0]["token_ids"] == fresh[b][0][0]


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        ("/update_weights", {}, "update_info"),
        ("/update_weights", {"update_info": {"names": ["x"]}}, "missing"),
        ("/init_weight_transfer_engine", {"init_info": {"master_port": 1}}, "missing"),
        ("/finish_weight_update", None, "without start_weight_update"),
    ],
)
def test_the_server_answers_a_bad_weight_transfer_call_with_a_400(server, path, body, error):
    url, _ = server
    response = httpx.post(f"{url}{path}", json=body, timeout=JOIN_S)
    assert response.status_code == 400, response.text
    assert error in response.text


def test_the_ipc_backend_needs_cuda(checkpoints):
    with pytest.raises(ValueError, match="CUDA memory"):
        LLM(checkpoints[0], **ENGINE_ARGS, weight_transfer_config={"backend": "ipc"})


SPECS = {"names": ["w", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], [3]]}


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"ipc_handles": [{}], "ipc_handles_pickled": "x"}, "not both"),
        ({"ipc_handles": [{}]}, "one {uuid: handle} dict per tensor"),
        ({"ipc_handles": {}, "packed": True, "tensor_sizes": [12, 4]}, "tensor_sizes"),
        ({"ipc_handles": [{}], "packed": True, "tensor_sizes": [12, 12]}, "one {uuid: handle}"),
    ],
)
def test_a_malformed_ipc_update_info_is_a_value_error(fields, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        IPCWeightTransferUpdateInfo(**SPECS, **fields)


def test_pickled_ipc_handles_are_read_only_where_the_config_allows():
    handles = [{"GPU-1": ("args",)}, {"GPU-1": ("more",)}]
    pickled = base64.b64encode(pickle.dumps(handles)).decode()
    info = IPCWeightTransferUpdateInfo(**SPECS, ipc_handles_pickled=pickled)
    with pytest.raises(ValueError, match="allow_pickled_handles"):
        info.handles(allow_pickled=False)
    assert info.handles(allow_pickled=True) == handles
    with pytest.raises(ValueError, match="needs ipc_handles"):
        IPCWeightTransferUpdateInfo(**SPECS).handles(allow_pickled=True)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"send_mode": "grpc"}, "send_mode"),
        ({"send_mode": "http"}, "url"),
        ({"send_mode": "ray"}, "llm_handle"),
    ],
)
def test_the_ipc_trainers_send_mode_is_checked(args, error):
    with pytest.raises(ValueError, match=error):
        IPCTrainerSendWeightsArgs(**args)


def test_packed_tensors_off_their_alignment_are_copied_not_misviewed():
    """A bf16 tensor of odd length puts the next float32 off a 4-byte boundary."""
    specs = tensor_specs(["a", "b"], ["bfloat16", "float32"], [[3], [2]])
    a, b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16), torch.tensor([4.5, -1.25])
    buffer = torch.cat([a.view(torch.uint8), b.view(torch.uint8)])
    (_, got_a), (_, got_b) = unpack(buffer, specs)
    assert torch.equal(got_a, a) and torch.equal(got_b, b)
