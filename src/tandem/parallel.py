"""Tensor parallelism: Megatron-style weight shards, one process per device.

Every rank runs the same engine loop (same scheduler, same batches, its own streams, slots and
graphs) on its shard of the model. Rank 0 owns the API: it forwards each request and abort
to the other ranks through a pipe, together with the order to take the next step, so all
ranks change their queues at the same step boundary. Sampled tokens are broadcast from rank 0
inside every step, so the ranks can never disagree on a token, and so never on a schedule.
Communication: an all-reduce after each row-parallel matmul (o_proj, down_proj) and after the
vocab-parallel embedding, an all-gather of the logits, a broadcast of the sampled ids.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.config import EngineConfig, ModelConfig, cdiv


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on every rank -> [rows, size * cols], rank r's columns r-th."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's values everywhere."""
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def min(self, value: int, device: torch.device) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def heads(self, num_heads: int) -> tuple[int, int]:
        """(first, count) of the query heads this rank computes."""
        count = num_heads // self.size
        return self.rank * count, count

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first, count) of this rank's KV heads; one shared head each when ranks outnumber them."""
        if num_kv_heads >= self.size:
            count = num_kv_heads // self.size
            return self.rank * count, count
        return self.rank * num_kv_heads // self.size, 1

    def part(self, size: int) -> tuple[int, int]:
        """(first, count) of this rank's equal share of `size` rows (padded up for the vocabulary)."""
        count = cdiv(size, self.size)
        return self.rank * count, count


def check_shardable(cfg: ModelConfig, size: int) -> None:
    if size == 1:
        return
    rules = [
        (cfg.num_heads % size == 0, f"num_attention_heads={cfg.num_heads}"),
        (
            cfg.num_kv_heads % size == 0 or size % cfg.num_kv_heads == 0,
            f"num_key_value_heads={cfg.num_kv_heads}",
        ),
        (cfg.intermediate_size % size == 0, f"intermediate_size={cfg.intermediate_size}"),
    ]
    for ok, what in rules:
        if not ok:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {what}")


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shapes one rank holds: its heads, KV heads and slice of the MLP."""
    return replace(
        cfg,
        num_heads=tp.heads(cfg.num_heads)[1],
        num_kv_heads=tp.kv_heads(cfg.num_kv_heads)[1],
        intermediate_size=cfg.intermediate_size // tp.size,
    )


def shard_tensor(
    hf_name: str, tensor: torch.Tensor, cfg: ModelConfig, tp: TensorParallel
) -> torch.Tensor:
    """This rank's slice of a checkpoint tensor (`cfg` is the whole model's shape)."""
    if tp.size == 1:
        return tensor
    leaf = hf_name.split(".")[-2]
    d = cfg.head_dim
    if leaf == "q_proj":
        first, count = tp.heads(cfg.num_heads)
        return tensor.narrow(0, first * d, count * d)
    if leaf in ("k_proj", "v_proj"):
        first, count = tp.kv_heads(cfg.num_kv_heads)
        return tensor.narrow(0, first * d, count * d)
    if leaf == "o_proj" and hf_name.endswith("weight"):
        first, count = tp.heads(cfg.num_heads)
        return tensor.narrow(1, first * d, count * d)
    if leaf in ("gate_proj", "up_proj"):
        first, count = tp.part(cfg.intermediate_size)
        return tensor.narrow(0, first, count)
    if leaf == "down_proj":
        first, count = tp.part(cfg.intermediate_size)
        return tensor.narrow(1, first, count)
    if leaf in ("embed_tokens", "lm_head"):
        first, count = tp.part(cfg.vocab_size)
        return tensor.narrow(0, first, max(0, min(count, cfg.vocab_size - first)))
    return tensor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, size: int, port: int, device: torch.device) -> None:
    # NVLink multicast stays off: on shared hosts it can take every GPU of the host down
    for name, value in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ.setdefault(name, value)
    if dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel process group is still open in this process: an earlier engine "
            "lost a rank on the GPU, and its NCCL group cannot be torn down; start a new process"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )


def rank0_check() -> Callable[[], None]:
    """For a rank > 0: a check that ends this process at once when rank 0's (its parent) is gone,
    rather than leave it waiting on the device for a collective rank 0 will never join."""
    parent = os.getppid()

    def check() -> None:
        if os.getppid() != parent:
            os._exit(1)

    return check


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


JOIN_TIMEOUT_S = 30  # shutdown: how long the other ranks get to leave before they are killed


class RankExited(RuntimeError):
    """A tensor-parallel rank's process is gone; the engine it belonged to cannot step again."""


class Workers:
    """Rank 0's handle on ranks 1..size-1: their processes and the pipes that drive them."""

    def __init__(self, config: EngineConfig, port: int):
        ctx = mp.get_context("spawn")
        self.pipes: list[multiprocessing.connection.Connection] = []
        self.processes = []
        for rank in range(1, config.tensor_parallel_size):
            ours, theirs = ctx.Pipe()
            process = ctx.Process(
                target=worker_main, args=(rank, config, port, theirs), daemon=True
            )
            process.start()
            self.pipes.append(ours)
            self.processes.append(process)

    def step(self, commands: list[tuple[Any, ...]]) -> None:
        """Apply `commands` (("add", request_id, params, prompt_token_ids), ("abort", id) or
        ("reset_prefix_cache",)), then step."""
        self.check()
        for pipe in self.pipes:
            try:
                pipe.send(("step", commands))
            except (BrokenPipeError, ConnectionResetError):
                self.check()  # it died since the check above
                raise

    def apply(self, commands: list[tuple[Any, ...]]) -> None:
        """Apply `commands` now, without a step (("call", method, args) runs an Engine method)."""
        self.check()
        for pipe in self.pipes:
            pipe.send(("apply", commands))

    def check(self) -> None:
        """Raise if a rank's process is gone: the others would wait for it at their next collective."""
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise RankExited(
                    f"tensor-parallel rank {rank} exited (exit code {process.exitcode}); "
                    "this engine cannot go on"
                )

    def alive(self) -> bool:
        return all(process.is_alive() for process in self.processes)

    def stop(self) -> None:
        for pipe, process in zip(self.pipes, self.processes, strict=True):
            # one that exits meanwhile has closed its pipe
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if process.is_alive():
                    pipe.send(("stop", []))

    def join(self) -> None:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():  # stuck in a collective that cannot complete: free its GPU
                process.kill()
                process.join()


def worker_main(
    rank: int, config: EngineConfig, port: int, pipe: multiprocessing.connection.Connection
) -> None:
    """A rank > 0: the same engine, stepped in lockstep with rank 0."""
    from tandem.engine import Engine

    engine = Engine(config, rank=rank, port=port)
    while True:
        try:
            order, commands = pipe.recv()
        except EOFError:  # rank 0 is gone: leave at once, without a shutdown whose device work
            os._exit(0)  # could wait forever on a collective rank 0 never joins
        if order == "stop":
            break
        for command in commands:
            if command[0] == "add":
                _, request_id, params, prompt_token_ids = command
                engine.enqueue(
                    engine.make_request(request_id, params, prompt_token_ids=prompt_token_ids)
                )
            elif command[0] == "reset_prefix_cache":
                engine.reset_prefix_cache()
            elif command[0] == "call":
                getattr(engine, command[1])(*command[2])
            else:
                engine.abort(command[1])
        if order == "step":
            engine.step()
    engine.shutdown()
