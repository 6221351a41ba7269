"""What the weight-transfer backends share: the engine argument, the announced tensors, the
calls' info dicts parsed with errors naming their fields, packed buffers, and `WeightReceiver`,
one engine rank's end of a transfer."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

BACKENDS = ("nccl", "ipc")
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's defaults: both sides must agree
DEFAULT_PACKED_NUM_BUFFERS = 2

NamedTensor = tuple[str, torch.Tensor]


@dataclass
class WeightTransferConfig:
    """`LLM(..., weight_transfer_config={"backend": "nccl"})`: lets a trainer send weights."""

    backend: str = "nccl"  # "nccl": broadcasts; "ipc": CUDA memory on the engine's own GPU
    # "ipc" over HTTP: unpickle `ipc_handles_pickled` (vLLM's VLLM_ALLOW_INSECURE_SERIALIZATION)
    allow_pickled_handles: bool = False

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"weight_transfer_config.backend must be one of {list(BACKENDS)}, "
                f"got {self.backend!r}"
            )
        if not isinstance(self.allow_pickled_handles, bool):
            raise ValueError(
                "weight_transfer_config.allow_pickled_handles must be true or false, "
                f"got {self.allow_pickled_handles!r}"
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
    """A packed uint8 buffer's tensors, as views of it where their bytes are aligned for their
    dtype (copies where not: a 2-byte tensor of odd length puts the next one off a 4-byte
    boundary)."""
    pieces = buffer.split([spec.num_bytes for spec in chunk])
    return [
        (spec.name, aligned(piece, spec.dtype.itemsize).view(spec.dtype).view(spec.shape))
        for spec, piece in zip(chunk, pieces, strict=True)
    ]


def aligned(piece: torch.Tensor, itemsize: int) -> torch.Tensor:
    return piece if piece.storage_offset() % itemsize == 0 else piece.clone()


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


class WeightReceiver(ABC):
    """One engine rank's end of a transfer: the calls' infos parsed and checked, the tensors
    received. `active` between start_weight_update and finish_weight_update."""

    def __init__(self, config: WeightTransferConfig, device: torch.device, rank: int, tp_size: int):
        self.config, self.device, self.rank, self.tp_size = config, device, rank, tp_size
        self.active = False

    @abstractmethod
    def parse_init(self, init_info: Any) -> Any:
        """init_info's fields, checked (ValueError naming a bad one)."""

    @abstractmethod
    def join(self, info: Any) -> None:
        """Get ready to receive (meet the trainer, where the backend has a group)."""

    @abstractmethod
    def parse_update(self, update_info: Any) -> Any:
        """update_info's fields, checked; its `.specs` the announced tensors (the engine checks
        `active` after, so that a refused update still takes them: `drain`)."""

    @abstractmethod
    def receive(
        self, info: Any, stream: torch.cuda.Stream | None = None
    ) -> Iterator[list[NamedTensor]]:
        """The announced tensors, a list at a time. The caller may copy out of each on `stream`
        (CUDA) without waiting: what a list holds stays valid until the work queued on
        `stream` by the time the next list is asked for has run; the iterator waits for the
        last list's work before it ends."""

    @abstractmethod
    def drain(self, info: Any) -> None:
        """Take the announced tensors and drop them (an update that fails its check), so the
        trainer is not left waiting."""

    def check_active(self) -> None:
        if not self.active:
            raise RuntimeError("start_weight_update must be called before update_weights")

    def placeholders(self, info: Any) -> list[NamedTensor]:
        """The announced tensors without their data, to check names and shapes against the
        model before any arrives."""
        return [
            (spec.name, torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
            for spec in info.specs
        ]
