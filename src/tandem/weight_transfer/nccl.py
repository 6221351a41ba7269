"""The "nccl" backend: the trainer and every tensor-parallel rank of the engine join a process
group of their own (NCCL on CUDA, gloo on CPU; a TCP store the trainer hosts as rank 0), and
the trainer broadcasts each announced tensor, or packed byte buffers of them."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.weight_transfer.common import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    NamedTensor,
    WeightReceiver,
    check_int,
    packed_chunks,
    parse,
    tensor_specs,
    unpack,
)

TIMEOUT_S = 300  # how long a member waits for the others at the rendezvous and in a broadcast


@dataclass
class NCCLWeightTransferInitInfo:
    """Where the trainer's group meets: its rank 0 (the trainer) listens on master_port."""

    master_address: str
    master_port: int
    rank_offset: int  # the group rank of the engine's tensor-parallel rank 0
    world_size: int  # the trainer and every rank of every engine in the group

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError(
                f"init_info.master_address must be a host name, got {self.master_address!r}"
            )
        check_int("init_info.master_port", self.master_port, 1, 65535)
        check_int("init_info.rank_offset", self.rank_offset, 1)
        check_int("init_info.world_size", self.world_size, 2)


@dataclass
class NCCLWeightTransferUpdateInfo:
    """The tensors of one `update_weights` call, in the order the trainer broadcasts them."""

    names: list[str]
    dtype_names: list[str]  # torch's names: "bfloat16", "float32", ...
    shapes: list[list[int]]
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def __post_init__(self) -> None:
        self.specs = tensor_specs(self.names, self.dtype_names, self.shapes)
        if not isinstance(self.packed, bool):
            raise ValueError(f"update_info.packed must be true or false, got {self.packed!r}")
        check_int("update_info.packed_buffer_size_bytes", self.packed_buffer_size_bytes, 1)
        check_int("update_info.packed_num_buffers", self.packed_num_buffers, 1)


@dataclass
class NCCLTrainerSendWeightsArgs:
    """The trainer's side of a broadcast (vLLM's fields)."""

    group: Any  # what `trainer_init` returned
    src: int = 0
    # each (name, tensor) pair -> the tensor sent (default: the tensor)
    post_iter_func: Callable[[NamedTensor], torch.Tensor] | None = None
    packed: bool = False
    stream: Any = None  # the CUDA stream of the broadcasts (default: the current one)
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    # the engine's buffers (its update_info's); taken for vLLM's signature: the trainer's
    # broadcasts are queued on NCCL's stream, each buffer kept until its broadcast has run
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


class TransferGroup:
    """A process group of its own, beside torch's default one (the tensor-parallel group): a
    TCP store that rank 0 hosts, and NCCL (CUDA) or gloo (CPU) over it."""

    def __init__(self, address: str, port: int, rank: int, world_size: int, device: torch.device):
        timeout = timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
        store = dist.PrefixStore("tandem-weight-transfer", store)
        self.rank, self.world_size, self.device = rank, world_size, device
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        """`tensor` from rank `src` into every member's `tensor` (vLLM's communicator's call)."""
        options = dist.BroadcastOptions()
        options.rootRank = src
        if stream is None:
            self.group.broadcast([tensor], options).wait()
            return
        with torch.cuda.stream(stream):
            self.group.broadcast([tensor], options).wait()


class NCCLReceiver(WeightReceiver):
    """An engine rank's end of the trainer's group."""

    group: TransferGroup | None = None

    def parse_init(self, init_info: Any) -> NCCLWeightTransferInitInfo:
        info = parse(NCCLWeightTransferInitInfo, init_info, "init_info")
        if info.rank_offset + self.tp_size > info.world_size:
            raise ValueError(
                f"init_info.world_size={info.world_size} leaves no group rank for the engine's "
                f"{self.tp_size} rank(s) from rank_offset={info.rank_offset}"
            )
        return info

    def join(self, info: NCCLWeightTransferInitInfo) -> None:
        """Meet the trainer (and this engine's other ranks) at its rendezvous."""
        if self.group is not None:
            raise RuntimeError("init_weight_transfer_engine was called already for this engine")
        rank = info.rank_offset + self.rank
        self.group = TransferGroup(
            info.master_address, info.master_port, rank, info.world_size, self.device
        )

    def parse_update(self, update_info: Any) -> NCCLWeightTransferUpdateInfo:
        info = parse(NCCLWeightTransferUpdateInfo, update_info, "update_info")
        if self.group is None:
            raise RuntimeError(
                "no weight transfer group: call init_weight_transfer_engine(...) first"
            )
        return info

    def drain(self, info: NCCLWeightTransferUpdateInfo) -> None:
        for _ in self.receive(info):
            pass

    def receive(
        self, info: NCCLWeightTransferUpdateInfo, stream: torch.cuda.Stream | None = None
    ) -> Iterator[list[NamedTensor]]:
        """A tensor or a packed buffer at a time, as broadcast; a buffer is reused
        `packed_num_buffers` lists later, once its copies on `stream` have run."""
        assert self.group is not None
        try:
            if not info.packed:
                for spec in info.specs:
                    tensor = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
                    self.group.broadcast(tensor)
                    yield [(spec.name, tensor)]
                    if stream is not None:
                        tensor.record_stream(stream)
                return
            chunks = packed_chunks(info.specs, info.packed_buffer_size_bytes)
            sizes = [sum(spec.num_bytes for spec in chunk) for chunk in chunks]
            count = min(info.packed_num_buffers, len(chunks))
            buffers = [
                torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(count)
            ]
            read: list[torch.cuda.Event | None] = [None] * count  # each buffer's copies done
            for index, (chunk, size) in enumerate(zip(chunks, sizes, strict=True)):
                slot = index % count
                if read[slot] is not None:
                    read[slot].synchronize()
                buffer = buffers[slot].narrow(0, 0, size)
                self.group.broadcast(buffer)
                yield unpack(buffer, chunk)
                if stream is not None:
                    read[slot] = stream.record_event()
        finally:
            if stream is not None:
                stream.synchronize()


class NCCLWeightTransferEngine:
    """The trainer's side (vLLM's names): `trainer_init` joins the group as its rank 0,
    `trainer_send_weights` broadcasts (name, tensor) pairs to the engines."""

    @staticmethod
    def trainer_init(init_info: NCCLWeightTransferInitInfo | dict) -> TransferGroup:
        if isinstance(init_info, dict):
            init_info = NCCLWeightTransferInitInfo(**{"rank_offset": 1, **init_info})
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        return TransferGroup(
            init_info.master_address, init_info.master_port, 0, init_info.world_size, device
        )

    @staticmethod
    def trainer_send_weights(
        iterator: Iterable[NamedTensor], trainer_args: NCCLTrainerSendWeightsArgs | dict
    ) -> None:
        """Broadcast each pair's tensor in order; with `packed`, consecutive tensors as one
        byte buffer until it passes `packed_buffer_size_bytes` (the engine cuts alike)."""
        if isinstance(trainer_args, dict):
            trainer_args = NCCLTrainerSendWeightsArgs(**trainer_args)
        args = trainer_args
        tensor_of = args.post_iter_func or (lambda pair: pair[1])
        group: TransferGroup = args.group
        if not args.packed:
            for pair in iterator:
                group.broadcast(tensor_of(pair).contiguous(), args.src, args.stream)
            return
        pending: list[torch.Tensor] = []
        total = 0
        for pair in iterator:
            flat = tensor_of(pair).detach().contiguous().view(-1).view(torch.uint8)
            pending.append(flat)
            total += flat.numel()
            if total > args.packed_buffer_size_bytes:
                group.broadcast(torch.cat(pending), args.src, args.stream)
                pending, total = [], 0
        if pending:
            group.broadcast(torch.cat(pending), args.src, args.stream)
