"""The "ipc" backend: a trainer on the engine's own GPU hands over CUDA IPC handles of its
tensors, or of one packed buffer, and the engine copies from that memory; nothing travels but
the handles. Each handle is keyed by the GPU's UUID, so with tensor parallelism every rank finds
the copy on its own device (a trainer of several ranks gathers theirs)."""

from __future__ import annotations

import base64
import dataclasses
import pickle
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from tandem.weight_transfer.common import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    NamedTensor,
    TensorSpec,
    WeightReceiver,
    parse,
    tensor_specs,
    unpack,
)

HTTP_TIMEOUT_S = 300
DEVICE_ARG = 6  # the device index in torch's rebuild_cuda_tensor arguments


@dataclass
class IPCWeightTransferInitInfo:
    """Nothing to set up: handles need no group."""


@dataclass
class IPCWeightTransferUpdateInfo:
    """The tensors of one `update_weights` call and where they lie (vLLM's fields)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    # per tensor (or, packed, for the one buffer): GPU UUID -> torch's rebuild_cuda_tensor args
    ipc_handles: list[dict[str, tuple]] | dict[str, tuple] | None = None
    ipc_handles_pickled: str | None = None  # base64 of the pickled ipc_handles (HTTP)
    tensor_sizes: list[int] | None = None  # packed: each tensor's bytes in the buffer
    packed: bool = False

    def __post_init__(self) -> None:
        self.specs = tensor_specs(self.names, self.dtype_names, self.shapes)
        if self.ipc_handles_pickled is not None and self.ipc_handles is not None:
            raise ValueError("update_info takes ipc_handles or ipc_handles_pickled, not both")
        if self.packed:
            if not isinstance(self.ipc_handles, dict | None):
                raise ValueError("a packed update_info's ipc_handles is one {uuid: handle} dict")
            sizes = [spec.num_bytes for spec in self.specs]
            if self.tensor_sizes != sizes:
                raise ValueError(
                    f"update_info.tensor_sizes must be the tensors' bytes, {sizes}, "
                    f"got {self.tensor_sizes!r:.80}"
                )
        elif self.ipc_handles is not None and not (
            isinstance(self.ipc_handles, list) and len(self.ipc_handles) == len(self.specs)
        ):
            raise ValueError(
                "update_info.ipc_handles must be a list of one {uuid: handle} dict per tensor"
            )

    def handles(self, allow_pickled: bool) -> list[dict[str, tuple]] | dict[str, tuple]:
        if self.ipc_handles is not None:
            return self.ipc_handles
        if self.ipc_handles_pickled is None:
            raise ValueError("update_info needs ipc_handles or ipc_handles_pickled")
        if not allow_pickled:
            raise ValueError(
                "ipc_handles_pickled is unpickled only with weight_transfer_config="
                '{"backend": "ipc", "allow_pickled_handles": true}: unpickling runs code the '
                "sender chose, so allow it only where the trainer is trusted"
            )
        return pickle.loads(base64.b64decode(self.ipc_handles_pickled))


@dataclass
class IPCTrainerSendWeightsArgs:
    """The trainer's side of a send (vLLM's fields)."""

    # "http" (POST url/update_weights), "ray" (llm_handle.update_weights.remote), or a callable
    # given the IPCWeightTransferUpdateInfo
    send_mode: str | Callable[[IPCWeightTransferUpdateInfo], None]
    llm_handle: Any = None  # a Ray actor handle, or a list of them
    url: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES

    def __post_init__(self) -> None:
        if callable(self.send_mode):
            return
        if self.send_mode not in ("http", "ray"):
            raise ValueError(
                f"send_mode must be 'http', 'ray' or a callable, got {self.send_mode!r}"
            )
        if self.send_mode == "http" and self.url is None:
            raise ValueError("send_mode 'http' needs url")
        if self.send_mode == "ray" and self.llm_handle is None:
            raise ValueError("send_mode 'ray' needs llm_handle")


class IPCReceiver(WeightReceiver):
    """An engine rank's end: it opens the handles of its own GPU."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        if self.device.type != "cuda":
            raise ValueError(
                "weight_transfer_config backend 'ipc' shares CUDA memory between processes on "
                f"one GPU; this engine runs on {self.device.type} (use backend 'nccl')"
            )
        self.index = (
            self.device.index if self.device.index is not None else torch.cuda.current_device()
        )
        # every rank's GPU (rank r runs on GPU r with tensor parallelism): rank 0 checks that
        # each handle names them all before any rank opens one
        ranks = range(self.tp_size) if self.tp_size > 1 else [self.index]
        self.uuids = [gpu_uuid(i) for i in ranks]

    def parse_init(self, init_info: Any) -> IPCWeightTransferInitInfo:
        return parse(IPCWeightTransferInitInfo, init_info, "init_info")

    def join(self, info: IPCWeightTransferInitInfo) -> None:
        pass

    def parse_update(self, update_info: Any) -> IPCWeightTransferUpdateInfo:
        info = parse(IPCWeightTransferUpdateInfo, update_info, "update_info")
        info.ipc_handles = info.handles(self.config.allow_pickled_handles)
        info.ipc_handles_pickled = None
        handles = [info.ipc_handles] if info.packed else info.ipc_handles
        for index, handle in enumerate(handles):
            missing = [u for u in self.uuids if not isinstance(handle, dict) or u not in handle]
            if missing:
                raise ValueError(
                    f"update_info.ipc_handles[{index}] has no handle for the engine's GPU(s) "
                    f"{missing}; it holds {list(handle) if isinstance(handle, dict) else handle!r:.200}"
                )
        return info

    def drain(self, info: IPCWeightTransferUpdateInfo) -> None:
        pass  # the trainer waits for our answer only

    def receive(
        self, info: IPCWeightTransferUpdateInfo, stream: torch.cuda.Stream | None = None
    ) -> Iterator[list[NamedTensor]]:
        """The trainer's tensors, or its packed buffer's, in its memory, each opened and checked
        against what was announced before any is handed out. The trainer may reuse that memory
        once `update_weights` has returned, so the copies are waited for before then."""
        try:
            if info.packed:
                buffer = self._open(info.ipc_handles).view(-1)
                size = sum(info.tensor_sizes)
                if buffer.dtype != torch.uint8 or buffer.numel() < size:
                    raise ValueError(
                        f"the packed buffer holds {buffer.numel()} {buffer.dtype} values; the "
                        f"tensors announced take {size} bytes"
                    )
                yield unpack(buffer.narrow(0, 0, size), info.specs)
                return
            tensors = [self._open(handle) for handle in info.ipc_handles]
            for spec, tensor in zip(info.specs, tensors, strict=True):
                if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
                    raise ValueError(
                        f"the tensor shared for {spec.name!r} is {tensor.dtype} "
                        f"{tuple(tensor.shape)}; announced: {spec.dtype} {spec.shape}"
                    )
            for spec, tensor in zip(info.specs, tensors, strict=True):
                yield [(spec.name, tensor)]
        finally:
            if stream is not None:
                stream.synchronize()

    def _open(self, handle: dict[str, tuple]) -> torch.Tensor:
        args = list(handle[gpu_uuid(self.index)])
        args[DEVICE_ARG] = self.index  # the trainer's index of the GPU may differ from ours
        return rebuild_cuda_tensor(*args)


def gpu_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class IPCWeightTransferEngine:
    """The trainer's side (vLLM's names): `trainer_send_weights` shares (name, tensor) pairs on
    the trainer's GPU and sends their handles to the engine."""

    @staticmethod
    def trainer_send_weights(
        iterator: Iterable[NamedTensor], trainer_args: IPCTrainerSendWeightsArgs | dict
    ) -> None:
        """All the pairs in one `update_weights` call; with `packed`, a buffer of
        `packed_buffer_size_bytes` a call, reused for each (a tensor must fit in it). Call it
        between start_weight_update and finish_weight_update. A trainer of several ranks
        (torch.distributed) calls it on every rank with the same pairs; rank 0 sends."""
        if isinstance(trainer_args, dict):
            trainer_args = IPCTrainerSendWeightsArgs(**trainer_args)
        uuid = gpu_uuid(torch.cuda.current_device())
        if trainer_args.packed:
            _send_packed(iter(iterator), trainer_args, uuid)
        else:
            _send_each(iter(iterator), trainer_args, uuid)


def _send_each(pairs: Iterator[NamedTensor], args: IPCTrainerSendWeightsArgs, uuid: str) -> None:
    kept, specs, handles = [], [], []
    for name, tensor in pairs:
        # on this GPU (its handle's key), kept until the engine has copied it
        tensor = tensor.detach().to(torch.cuda.current_device()).contiguous()
        kept.append(tensor)
        specs.append(TensorSpec(name, tensor.dtype, tuple(tensor.shape)))
        handles.append({uuid: reduce_tensor(tensor)[1]})
    _send(args, specs, _merged(handles))
    _after_send()


def _send_packed(pairs: Iterator[NamedTensor], args: IPCTrainerSendWeightsArgs, uuid: str) -> None:
    buffer = torch.empty(args.packed_buffer_size_bytes, dtype=torch.uint8, device="cuda")
    handle = {uuid: reduce_tensor(buffer)[1]}
    specs: list[TensorSpec] = []
    used = 0
    for name, tensor in pairs:
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)  # copied to the buffer
        if flat.numel() > buffer.numel():
            raise ValueError(
                f"tensor {name!r} has {flat.numel()} bytes, more than packed_buffer_size_bytes="
                f"{buffer.numel()}"
            )
        if used + flat.numel() > buffer.numel():
            _flush(args, specs, handle)
            specs, used = [], 0
        buffer.narrow(0, used, flat.numel()).copy_(flat)
        specs.append(TensorSpec(name, tensor.dtype, tuple(tensor.shape)))
        used += flat.numel()
    if specs:
        _flush(args, specs, handle)


def _flush(args: IPCTrainerSendWeightsArgs, specs: list[TensorSpec], handle: dict) -> None:
    torch.cuda.current_stream().synchronize()  # the buffer is written before the engine reads
    _send(args, specs, _merged([handle])[0], packed=True)
    _after_send()


def _merged(handles: list[dict[str, tuple]]) -> list[dict[str, tuple]]:
    """Each tensor's handles from every trainer rank, by GPU, on rank 0 (one rank: as given)."""
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return handles
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, handles)
    return [{k: v for rank in gathered for k, v in rank[i].items()} for i in range(len(handles))]


def _after_send() -> None:
    dist = torch.distributed
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # no rank frees or refills its tensors before the engine has copied them
    torch.cuda.ipc_collect()


def _send(args: IPCTrainerSendWeightsArgs, specs: list[TensorSpec], handles: Any, packed=False):
    dist = torch.distributed
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    info = IPCWeightTransferUpdateInfo(
        names=[spec.name for spec in specs],
        dtype_names=[str(spec.dtype).removeprefix("torch.") for spec in specs],
        shapes=[list(spec.shape) for spec in specs],
        ipc_handles=handles,
        tensor_sizes=[spec.num_bytes for spec in specs] if packed else None,
        packed=packed,
    )
    if callable(args.send_mode):
        args.send_mode(info)
    elif args.send_mode == "ray":
        import ray

        llms = args.llm_handle if isinstance(args.llm_handle, list) else [args.llm_handle]
        request = {"update_info": dataclasses.asdict(info)}
        ray.get([llm.update_weights.remote(request) for llm in llms])
    else:
        fields = dataclasses.asdict(info)
        fields["ipc_handles"] = None
        fields["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode()
        body = {"update_info": {k: v for k, v in fields.items() if v is not None}}
        url = f"{args.url.rstrip('/')}/update_weights"
        httpx.post(url, json=body, timeout=HTTP_TIMEOUT_S).raise_for_status()
