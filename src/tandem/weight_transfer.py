"""Weights from a trainer in another process, taken as vLLM's weight-transfer engines take them.

The trainer and every tensor-parallel rank of the engine join a process group of their own
(backend "nccl": NCCL on CUDA, gloo on CPU). The trainer is its rank 0 and hosts the
rendezvous; rank r of the engine is its rank `rank_offset + r`. For each update the trainer
tells the engine which tensors come (`update_weights({"update_info": {names, dtype_names,
shapes, packed}})`) and broadcasts them, one by one or packed into byte buffers of
`packed_buffer_size_bytes` (a buffer takes tensors until their bytes pass that size).

Every name and shape is checked against the model before a byte arrives. A bad one is raised
only after the tensors announced have been received and dropped, so the trainer's broadcasts
complete and the weights stay as they were. Between `start_weight_update` and
`finish_weight_update` the engine takes no step, so no step reads a half-updated model.

Trainer side, with vLLM's class and method names so a trainer switches by its imports:
`NCCLWeightTransferEngine.trainer_init(init_info)` returns the group and
`NCCLWeightTransferEngine.trainer_send_weights(pairs, {"group": group, "packed": True})`
broadcasts the tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

BACKENDS = ("nccl",)
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's defaults: both sides must agree
DEFAULT_PACKED_NUM_BUFFERS = 2
TIMEOUT_S = 300  # how long a member waits for the others at the rendezvous and in a broadcast

NamedTensor = tuple[str, torch.Tensor]


@dataclass
class WeightTransferConfig:
    """`LLM(..., weight_transfer_config={"backend": "nccl"})`: lets a trainer send weights."""

    backend: str = "nccl"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"weight_transfer_config.backend must be one of {list(BACKENDS)}, "
                f"got {self.backend!r}"
            )


def as_config(value: Any) -> WeightTransferConfig | None:
    """The engine argument as a WeightTransferConfig: None, one already, a dict of its fields,
    or an object with a `backend` (vLLM's WeightTransferConfig)."""
    if value is None or isinstance(value, WeightTransferConfig):
        return value
    if isinstance(value, dict):
        return parse(WeightTransferConfig, value, "weight_transfer_config")
    if isinstance(getattr(value, "backend", None), str):
        return WeightTransferConfig(backend=value.backend)
    raise ValueError(
        f'weight_transfer_config must be None or like {{"backend": "nccl"}}, got {value!r:.80}'
    )


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
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return self.dtype.itemsize * int(torch.Size(self.shape).numel())


def tensor_specs(names: Any, dtype_names: Any, shapes: Any) -> list[TensorSpec]:
    """The announced tensors; ValueError naming the first malformed field."""
    for field, value in (("names", names), ("dtype_names", dtype_names), ("shapes", shapes)):
        if not isinstance(value, list | tuple):
            raise ValueError(f"update_info.{field} must be a list, got {value!r:.80}")
    if not len(names) == len(dtype_names) == len(shapes):
        raise ValueError(
            "update_info.names, dtype_names and shapes must be of one length, got "
            f"{len(names)}, {len(dtype_names)} and {len(shapes)}"
        )
    specs = []
    for index, (name, dtype_name, shape) in enumerate(zip(names, dtype_names, shapes, strict=True)):
        if not isinstance(name, str):
            raise ValueError(f"update_info.names[{index}] must be a string, got {name!r:.80}")
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"update_info.dtype_names[{index}] ({name!r}) must name a floating-point torch "
                f"dtype such as 'bfloat16', got {dtype_name!r}"
            )
        is_shape = isinstance(shape, list | tuple) and all(
            isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shape
        )
        if not is_shape:
            raise ValueError(
                f"update_info.shapes[{index}] ({name!r}) must be a list of sizes >= 0, "
                f"got {shape!r:.80}"
            )
        specs.append(TensorSpec(name, dtype, tuple(shape)))
    return specs


def parse(cls: type, fields: Any, what: str) -> Any:
    """`cls(**fields)`, with a ValueError naming an unknown or missing field."""
    if not isinstance(fields, dict):
        raise ValueError(f"{what} must be a JSON object, got {fields!r:.80}")
    known = [f.name for f in dataclasses.fields(cls)]
    if unknown := sorted(set(fields) - set(known)):
        raise ValueError(f"{what} has unknown fields {unknown}; it takes {known}")
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing := [name for name in required if name not in fields]:
        raise ValueError(f"{what} is missing {missing}")
    return cls(**fields)


def check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be an integer {bound}, got {value!r}")


def request_field(request: Any, field: str) -> dict | None:
    """The info dict of vLLM's request shapes: {field: {...}} or an object with `.field`
    (WeightTransferInitRequest / WeightTransferUpdateRequest); None for anything else."""
    if isinstance(request, dict):
        if field in request:
            if set(request) != {field}:
                raise ValueError(
                    f"a weight-transfer request takes only {field!r}, got {sorted(request)}"
                )
            return request[field]
        return None
    info = getattr(request, field, None)
    return info if isinstance(info, dict) else None


def required_field(request: Any, field: str) -> dict:
    """`request_field`, where the request must be one: TypeError otherwise."""
    info = request_field(request, field)
    if info is None:
        raise TypeError(
            f"expected {{{field!r}: {{...}}}} or an object with .{field}, got {request!r:.80}"
        )
    return info


def packed_chunks(specs: list[TensorSpec], buffer_size_bytes: int) -> list[list[TensorSpec]]:
    """The tensors of each packed broadcast: consecutive tensors until their bytes pass
    `buffer_size_bytes`, the one that passes it included (as the trainer packs them)."""
    chunks: list[list[TensorSpec]] = []
    chunk: list[TensorSpec] = []
    total = 0
    for spec in specs:
        chunk.append(spec)
        total += spec.num_bytes
        if total > buffer_size_bytes:
            chunks.append(chunk)
            chunk, total = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


def unpack(buffer: torch.Tensor, chunk: list[TensorSpec]) -> list[NamedTensor]:
    """A packed uint8 buffer's tensors, as views of it."""
    pieces = buffer.split([spec.num_bytes for spec in chunk])
    return [
        (spec.name, piece.view(spec.dtype).view(spec.shape))
        for spec, piece in zip(chunk, pieces, strict=True)
    ]


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


class WeightReceiver:
    """One engine rank's end of the transfer: the group it joined and the update under way."""

    def __init__(self, config: WeightTransferConfig, device: torch.device, rank: int, tp_size: int):
        self.config, self.device, self.rank, self.tp_size = config, device, rank, tp_size
        self.group: TransferGroup | None = None
        self.active = False  # between start_weight_update and finish_weight_update

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
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights")
        return info

    def placeholders(self, info: NCCLWeightTransferUpdateInfo) -> list[NamedTensor]:
        """The announced tensors without their data, to check names and shapes against the
        model before any arrives."""
        return [
            (spec.name, torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
            for spec in info.specs
        ]

    def receive(
        self, info: NCCLWeightTransferUpdateInfo, stream: torch.cuda.Stream | None = None
    ) -> Iterator[list[NamedTensor]]:
        """The announced tensors as they arrive, a tensor or a packed buffer at a time. The
        caller may copy out of each list on `stream` (CUDA) without waiting: a tensor is freed,
        and a packed buffer reused `packed_num_buffers` lists later, only after the work queued
        on `stream` by the time the next list was asked for; the last list's work is waited
        for before the iterator ends."""
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


def update_info_for(
    pairs: Iterable[NamedTensor],
    packed: bool = False,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
) -> dict[str, Any]:
    """The `update_info` that announces `pairs` (their names, dtype names and shapes)."""
    pairs = list(pairs)
    info: dict[str, Any] = {
        "names": [name for name, _ in pairs],
        "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in pairs],
        "shapes": [list(tensor.shape) for _, tensor in pairs],
        "packed": packed,
    }
    if packed:
        info["packed_buffer_size_bytes"] = packed_buffer_size_bytes
    return info
