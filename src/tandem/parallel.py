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

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.config import OLMO, ModelConfig, cdiv

STORE_TIMEOUT_S = 600  # how long a rank > 0 tries to reach rank 0's rendezvous store


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
    if cfg.architecture in OLMO:
        raise ValueError(
            f"{cfg.architecture} runs with tensor_parallel_size=1: its q and k norms span every "
            "attention head, which tensor parallelism splits across ranks"
        )
    rules = [
        (cfg.num_heads % size == 0, f"num_attention_heads={cfg.num_heads}"),
        (
            cfg.num_kv_heads % size == 0 or size % cfg.num_kv_heads == 0,
            f"num_key_value_heads={cfg.num_kv_heads}",
        ),
        (cfg.intermediate_size % size == 0, f"intermediate_size={cfg.intermediate_size}"),
        (
            cfg.moe_intermediate_size % size == 0,
            f"moe_intermediate_size={cfg.moe_intermediate_size}",
        ),
        (
            cfg.shared_expert_intermediate_size % size == 0,
            f"shared_expert_intermediate_size={cfg.shared_expert_intermediate_size}",
        ),
    ]
    for ok, what in rules:
        if not ok:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {what}")


def shard_config(cfg: ModelConfig, tp: TensorParallel) -> ModelConfig:
    """The shapes one rank holds: its heads, KV heads and slice of the MLP (of every expert, the
    shared one too)."""
    return replace(
        cfg,
        num_heads=tp.heads(cfg.num_heads)[1],
        num_kv_heads=tp.kv_heads(cfg.num_kv_heads)[1],
        intermediate_size=cfg.intermediate_size // tp.size,
        moe_intermediate_size=cfg.moe_intermediate_size // tp.size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp.size,
    )


def shard_tensor(
    hf_name: str, tensor: torch.Tensor, cfg: ModelConfig, tp: TensorParallel
) -> torch.Tensor:
    """This rank's slice of a checkpoint tensor (`cfg` is the whole model's shape)."""
    if tp.size == 1:
        return tensor
    leaf = hf_name.split(".")[-2]
    d = cfg.head_dim
    q_rows = [d * x for x in tp.heads(cfg.num_heads)]
    kv_rows = [d * x for x in tp.kv_heads(cfg.num_kv_heads)]
    if leaf == "q_proj":
        return rows(hf_name, tensor, *q_rows)
    if leaf in ("k_proj", "v_proj"):
        return rows(hf_name, tensor, *kv_rows)
    if leaf == "o_proj":
        return input_columns(hf_name, tensor, *q_rows, cfg.q_size)
    # an expert's MLP is sliced as a dense one, by its own intermediate size
    inter = intermediate_size_of(hf_name, cfg)
    if leaf in ("gate_proj", "up_proj"):
        return rows(hf_name, tensor, *tp.part(inter))
    if leaf == "down_proj":
        return input_columns(hf_name, tensor, *tp.part(inter), inter)
    if leaf in ("qkv_proj", "gate_up_proj") and tensor.numel() > 1:
        # the stacked parameters' own names (an engine's named_parameters): each part's slice
        sizes, slices = (
            ([cfg.q_size, cfg.kv_size, cfg.kv_size], [q_rows, kv_rows, kv_rows])
            if leaf == "qkv_proj"
            else ([inter, inter], [tp.part(inter)] * 2)
        )
        if tensor.shape[0] != sum(sizes):
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has {tensor.shape[0]} rows, expected {sum(sizes)}"
            )
        parts = tensor.split(sizes)
        return torch.cat([rows(hf_name, p, *s) for p, s in zip(parts, slices, strict=True)])
    if leaf in ("embed_tokens", "lm_head"):
        first, count = tp.part(cfg.vocab_size)
        return rows(hf_name, tensor, first, max(0, min(count, cfg.vocab_size - first)))
    return tensor


def rows(hf_name: str, tensor: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Rows [first, first + count) of a column-parallel tensor; a ValueError naming it when it
    has fewer (a wrong shape)."""
    if tensor.dim() == 0 or first + count > tensor.shape[0]:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}: too few rows for "
            f"this rank's [{first}, {first + count})"
        )
    return tensor.narrow(0, first, count)


def input_columns(
    hf_name: str, tensor: torch.Tensor, first: int, count: int, width: int
) -> torch.Tensor:
    """Input columns [first, first + count) of `width` of a row-parallel projection's tensor,
    whose columns cover the width in equal units: the weight's own columns, 4-bit codes' words
    of 8, a scale's groups. A bias, and a scale of one column (one per row), stay whole."""
    if tensor.dim() != 2 or tensor.shape[1] == 1:
        return tensor
    unit = width // tensor.shape[1]
    if not unit or unit * tensor.shape[1] != width:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}: its "
            f"{tensor.shape[1]} columns cover no {width} input features in equal groups"
        )
    if first % unit or count % unit:
        raise ValueError(
            f"checkpoint tensor {hf_name!r} ({tensor.shape[1]} columns for {width} input "
            f"features) cannot be split at input feature {first} of this rank: choose a "
            "tensor_parallel_size that splits its groups whole"
        )
    return tensor.narrow(1, first // unit, count // unit)


def intermediate_size_of(name: str, cfg: ModelConfig) -> int:
    """The intermediate size of the MLP a tensor or parameter `name` belongs to: a routed
    expert's, the shared expert's or the dense MLP's."""
    if ".experts." in name:
        return cfg.moe_intermediate_size
    if ".shared_expert." in name:
        return cfg.shared_expert_intermediate_size
    return cfg.intermediate_size


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(
    rank: int, size: int, port: int, device: torch.device, check: Callable[[], None]
) -> None:
    """Join the ranks' process group; rank 0 waits for the others while `check` finds them alive,
    so a rank that dies before it joins raises here rather than leave rank 0 waiting forever."""
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
    timeout = timedelta(seconds=STORE_TIMEOUT_S)
    store = dist.TCPStore(
        "127.0.0.1", port, size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    store.add("ranks_arrived", 1)
    while store.add("ranks_arrived", 0) < size:
        check()
        time.sleep(0.02)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)
    if device.type == "cpu":
        share_cores(size)


# rank 0's torch threads before share_cores, given back by leave_process_group
_threads_before: list[int] = []


def share_cores(size: int) -> None:
    """CPU ranks on one host split its cores: torch's threads in each rank would otherwise
    oversubscribe them (two ranks of two threads each on two cores ran the greedy
    tensor-parallel tests 1.4x slower). OMP_NUM_THREADS, where set, is left to decide."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    _threads_before.append(torch.get_num_threads())
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))


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
    if _threads_before:
        torch.set_num_threads(_threads_before.pop())
