"""Preemption by swap: a preempted request's KV blocks wait in pinned host memory, not recomputed.

Two halves. `SwapManager` is host bookkeeping the scheduler calls: which host block holds which
of a swapped request's blocks, with reference counts, and the ordered list of copies that
follows. `Swapper` owns the host pool and runs those copies on the device.

A swapped request holds no device blocks, only host blocks (`Request.host_blocks`, one per
block of its table). A block that a running request still holds (prefix caching shares full
blocks) is not copied: it stays on the device, and the swapped request reserves a host block
for it. Should its device block be reused before the request resumes, the allocator's reuse
hook copies it out first, into the reserved block. Requests that share a block share its
host block too, so it is copied once each way: the first to resume copies it in and the
others take that device block while it lasts.

Order on CUDA (one swap stream): a batch of copies waits for every step launched before it
(they wrote the blocks it reads and read the blocks it overwrites), and the next step's
compute waits for the batch (it reuses the blocks copied out and reads those copied in).
The copies of one batch run in the order the scheduler made them, so a host block freed by
one copy and refilled by a later one is read first. On CPU they run at once, in program order.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch

from tandem.config import ModelConfig
from tandem.kv_cache import BlockAllocator
from tandem.request import Request

# The rates `auto` weighs a victim by. Stated, not measured here: pinned copies over a PCIe
# Gen5 x16 link reach about 25 GB/s each way; an 8B-class prefill on an H200 runs at about
# 400 TFLOP/s (40% of its bf16 dense peak).
PCIE_BYTES_PER_S = 25e9
RECOMPUTE_FLOPS_PER_S = 400e12
SWAP_CHUNK_BYTES = 64 << 20  # device staging per copy batch: bounds the swap's extra memory


def host_memory_available() -> int:
    """Bytes of host memory the kernel can still hand out (MemAvailable), else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_swap_space(swap_space: float, num_bytes: int) -> None:
    """At start-up: `swap_space` GiB must be within the host's memory, and the `num_bytes` of
    it the pool takes (no more than every sequence's blocks) within what the host has left."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if swap_space * 2**30 > total:
        raise ValueError(
            f"swap_space={swap_space} GiB is more than this host's {total / 2**30:.1f} GiB of "
            "memory; lower swap_space or use preemption_mode='recompute'"
        )
    available = host_memory_available()
    if num_bytes > available:
        raise ValueError(
            f"swap_space={swap_space} GiB ({num_bytes / 2**30:.2f} GiB used) is more than the "
            f"{available / 2**30:.2f} GiB of host memory available to pin; lower swap_space or "
            "use preemption_mode='recompute'"
        )


def recompute_flops(cfg: ModelConfig, num_tokens: int) -> float:
    """A prefill of `num_tokens`: 2 FLOPs per weight per token, plus causal attention
    (QK^T and PV: 2 * num_tokens^2 / 2 pairs * q_size * 2 FLOPs per layer)."""
    return 2.0 * cfg.num_params() * num_tokens + 2.0 * cfg.num_layers * cfg.q_size * num_tokens**2


class HostBlockPool:
    """Host block ids with reference counts; a block is free exactly when its count is zero."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = np.zeros(num_blocks, dtype=np.int32)

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def take(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"host block {block} is free"
        self.ref_counts[block] += 1

    def free(self, block: int) -> bool:
        """Drop one reference; True when that was the last."""
        assert self.ref_counts[block] > 0, f"host block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block]:
            return False
        self.free_blocks.append(block)
        return True


@dataclass(frozen=True)
class SwapCopy:
    out: bool  # device -> host, else host -> device
    device_block: int
    host_block: int


class SwapManager:
    """The scheduler's side of swapping: decides per victim and records the copies."""

    def __init__(
        self,
        allocator: BlockAllocator,
        num_host_blocks: int,
        mode: str = "recompute",
        bytes_per_block: int = 0,
        cfg: ModelConfig | None = None,
    ):
        self.allocator = allocator
        self.host = HostBlockPool(num_host_blocks)
        self.mode = mode
        self.bytes_per_block = bytes_per_block
        self.cfg = cfg
        # a host block reserved for a device block that still holds its data, both ways
        self.host_of: dict[int, int] = {}
        self.device_of: dict[int, int] = {}
        self.on_host: set[int] = set()  # host blocks whose data was copied out
        self.copies: list[SwapCopy] = []  # made since the last `take_copies`, in order
        self.num_swapped_out = 0  # requests, over the engine's life

    def watch_reuse(self) -> None:
        """Hook the allocator's reuse call (keeping the hook it had): a device block a swapped
        request still needs is copied out before its new owner writes it."""
        before = self.allocator.on_reuse

        def reuse(block: int) -> None:
            self._copy_out_before_reuse(block)
            before(block)

        self.allocator.on_reuse = reuse

    def should_swap(self, request: Request) -> bool:
        """Swap (rather than recompute) this victim: by the mode, the host room and, for
        `auto`, whichever costs less time: its bytes over PCIe, out and back, or its prefill.
        Never one whose penalties count its tokens as the steps feed them (penalties.py): it
        rebuilds that state only by recomputing."""
        if (
            self.mode == "recompute"
            or request.params.needs_token_history
            or self._host_blocks_needed(request) > self.host.num_free
        ):
            return False
        if self.mode == "swap":
            return True
        num_bytes = 2 * len(request.block_table) * self.bytes_per_block
        flops = recompute_flops(self.cfg, request.num_computed_tokens)
        return num_bytes / PCIE_BYTES_PER_S < flops / RECOMPUTE_FLOPS_PER_S

    def _host_blocks_needed(self, request: Request) -> int:
        return sum(block not in self.host_of for block in request.block_table)

    def swap_out(self, request: Request) -> None:
        """Give the request a host block per device block; copy those no running request
        shares. Its device blocks are then freed by the caller."""
        host_blocks = []
        for block in request.block_table:
            host_block = self.host_of.get(block)
            if host_block is not None:  # another swapped request reserved it: share
                self.host.take(host_block)
            elif self.allocator.ref_counts[block] > 1:  # a running request holds it: it stays
                host_block = self.host.allocate()
                self.host_of[block], self.device_of[host_block] = host_block, block
            else:
                host_block = self.host.allocate()
                self._copy(SwapCopy(True, block, host_block))
            host_blocks.append(host_block)
        request.host_blocks = host_blocks
        self.num_swapped_out += 1

    def device_blocks_needed(self, request: Request) -> int:
        """Free device blocks a swap-in uses up: new ones, and cached ones taken back."""
        resident = [self.device_of[h] for h in request.host_blocks if h in self.device_of]
        new = len(request.host_blocks) - len(resident)
        return new + self.allocator.num_free_among(resident)

    def swap_in(self, request: Request) -> list[int]:
        """The request's device block table again; copies in what is only on the host."""
        resident = [self.device_of[h] for h in request.host_blocks if h in self.device_of]
        self.allocator.take(resident)  # before allocating, so none of them is reused
        new = iter(self.allocator.allocate(len(request.host_blocks) - len(resident)))
        table = []
        for host_block in request.host_blocks:
            block = self.device_of.get(host_block)
            if block is None:
                block = next(new)
                self._copy(SwapCopy(False, block, host_block))
                if self.host.ref_counts[host_block] > 1:  # others still need it: share
                    self.host_of[block], self.device_of[host_block] = host_block, block
            table.append(block)
        self.release(request)
        return table

    def release(self, request: Request) -> None:
        """Drop the request's host blocks (it resumed, finished or was aborted)."""
        for host_block in request.host_blocks:
            if self.host.free(host_block):
                self.on_host.discard(host_block)
                block = self.device_of.pop(host_block, None)
                if block is not None:
                    del self.host_of[block]
        request.host_blocks = []

    def take_copies(self) -> list[SwapCopy]:
        copies, self.copies = self.copies, []
        return copies

    def _copy(self, copy: SwapCopy) -> None:
        if copy.out:
            self.on_host.add(copy.host_block)
        self.copies.append(copy)

    def _copy_out_before_reuse(self, block: int) -> None:
        """A device block a swapped request still needs is about to be overwritten."""
        host_block = self.host_of.pop(block, None)
        if host_block is None:
            return
        del self.device_of[host_block]
        if host_block not in self.on_host:
            self._copy(SwapCopy(True, block, host_block))


class Swapper:
    """The host pool and the copies, on their own stream on CUDA.

    host pool: [num_host_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], pinned
    on CUDA, so each host block is one contiguous run and neighbouring ids copy together.
    """

    def __init__(self, kv_caches: list[torch.Tensor], num_host_blocks: int, device: torch.device):
        self.kv_caches = kv_caches  # per layer [2, num_blocks + 1, block_size, kv_heads, head_dim]
        self.device = device
        self.cuda = device.type == "cuda"
        block_shape = kv_caches[0].shape[2:]
        self.pool = torch.empty(
            (num_host_blocks, len(kv_caches), 2, *block_shape),
            dtype=kv_caches[0].dtype,
            pin_memory=self.cuda,
        )
        self.bytes_per_block = self.pool[0].numel() * self.pool.element_size()
        self.chunk = max(1, SWAP_CHUNK_BYTES // max(self.bytes_per_block, 1))
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.done = torch.cuda.Event()
        self.unfenced = False  # copies the next step must wait for
        self.bytes_out = 0
        self.bytes_in = 0

    def run(self, copies: list[SwapCopy], after: torch.cuda.Stream | None, timeline) -> None:
        """Enqueue the copies in order, after all work on `after` (the compute stream)."""
        if not copies:
            return
        if not self.cuda:
            self._run_batches(copies)
            timeline.record_swap(self._count(copies), None)
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_stream(after)
            events = timeline.swap_events()
            events.start()
            self._run_batches(copies)
            events.end()
            self.done.record()
        self.unfenced = True
        timeline.record_swap(self._count(copies), events)

    def fence(self, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait for the copies enqueued since the last fence."""
        if self.unfenced:
            stream.wait_event(self.done)
            self.unfenced = False

    def _count(self, copies: list[SwapCopy]) -> tuple[int, int]:
        num_out = sum(c.out for c in copies)
        out, into = num_out * self.bytes_per_block, (len(copies) - num_out) * self.bytes_per_block
        self.bytes_out += out
        self.bytes_in += into
        return out, into

    def _run_batches(self, copies: list[SwapCopy]) -> None:
        for out, run in groupby(copies, key=lambda c: c.out):
            run = list(run)
            for start in range(0, len(run), self.chunk):
                chunk = run[start : start + self.chunk]
                device_blocks = [c.device_block for c in chunk]
                host_blocks = [c.host_block for c in chunk]
                if out:
                    self._copy_out(device_blocks, host_blocks)
                else:
                    self._copy_in(host_blocks, device_blocks)

    def _index(self, blocks: list[int]) -> torch.Tensor:
        """[n] int64 on the device, copied from pinned memory without a host wait."""
        index = torch.tensor(blocks, dtype=torch.int64)
        if not self.cuda:
            return index
        return index.pin_memory().to(self.device, non_blocking=True)

    def _copy_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        index = self._index(device_blocks)
        # [2, num_layers, n, ...] -> [n, num_layers, 2, block_size, kv_heads, head_dim]
        staged = torch.stack([raw(c).index_select(1, index) for c in self.kv_caches], dim=1)
        staged = staged.permute(2, 1, 0, 3, 4, 5).contiguous()
        for first, count, host_first in _runs(host_blocks):
            raw(self.pool)[host_first : host_first + count].copy_(
                staged[first : first + count], non_blocking=True
            )

    def _copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        # [n, num_layers, 2, block_size, kv_heads, head_dim] on the device
        staged = torch.empty(
            (len(host_blocks), *self.pool.shape[1:]), dtype=self.pool.dtype, device=self.device
        )
        for first, count, host_first in _runs(host_blocks):
            staged[first : first + count].copy_(
                self.pool[host_first : host_first + count], non_blocking=True
            )
        index = self._index(device_blocks)
        for layer, cache in enumerate(self.kv_caches):
            raw(cache).index_copy_(1, index, raw(staged[:, layer].transpose(0, 1)))


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 cache's bytes as uint8 (torch indexes no float8 tensor on the CPU); others as
    they are. The swap copies bytes either way."""
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor


def _runs(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(position, length, first block) of each run of consecutive ids.
    E.g. [4, 5, 6, 9, 2, 3] -> [(0, 3, 4), (3, 1, 9), (4, 2, 2)]."""
    runs, position = [], 0
    for _, group in groupby(enumerate(blocks), key=lambda pair: pair[1] - pair[0]):
        group = list(group)
        runs.append((position, len(group), group[0][1]))
        position += len(group)
    return runs
