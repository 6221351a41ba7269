"""CPU/GPU timeline recording: CPU phases with perf_counter_ns, GPU phases with CUDA timing events.

Device times come from events recorded around each stream's work and read back only once the
step's outputs have arrived (its events are complete then), so tracing adds no synchronization
to the loop. Device times are placed on the host clock through one reference event recorded
while the device was idle.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np
import torch

# "mask": a step's sampling launched after the host read the step before (its structured-output
# token masks filled first, where it has them; or its logits processors read output ids)
CPU_PHASES = ("schedule", "build", "launch", "wait", "process", "mask")
GPU_STREAMS = ("h2d", "compute", "d2h")
# the compute stream waiting for a step's token masks, within its compute span (masked steps)
MASK_WAIT = "mask_wait"
STEP_LANES = (*GPU_STREAMS, MASK_WAIT)  # event pairs a slot records per step
GPU_LANES = (*GPU_STREAMS, "swap", MASK_WAIT)  # swap copies (swap.py) on a stream of their own


class IntervalLog:
    """Preallocated (kind, step, start_ns, end_ns) rows, doubled when full."""

    def __init__(self, capacity: int = 1 << 14):
        self.rows = np.zeros((capacity, 4), dtype=np.int64)
        self.size = 0

    def add(self, kind: int, step: int, start_ns: int, end_ns: int) -> None:
        if self.size == len(self.rows):
            self.rows = np.concatenate([self.rows, np.zeros_like(self.rows)])
        self.rows[self.size] = (kind, step, start_ns, end_ns)
        self.size += 1

    def view(self) -> np.ndarray:
        return self.rows[: self.size]


class StepEvents:
    """Timing events around one slot's H2D copy, compute, D2H copy, and mask wait."""

    def __init__(self):
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * len(STEP_LANES))]

    def start(self, stream_index: int) -> None:
        self.events[2 * stream_index].record()

    def end(self, stream_index: int) -> None:
        self.events[2 * stream_index + 1].record()


class SwapEvents:
    """Timing events around one batch of swap copies on the swap stream."""

    def __init__(self):
        self.begin = torch.cuda.Event(enable_timing=True)
        self.finish = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.begin.record()

    def end(self) -> None:
        self.finish.record()


class Timeline:
    recording = True

    def __init__(self, cuda: bool):
        self.cpu = IntervalLog()
        self.gpu = IntervalLog()
        # (step, launch_ns, num_seqs, num_tokens, context_tokens, attention_pairs) per launch
        self.steps: list[tuple[int, ...]] = []
        self.cuda = cuda
        self.slot_events = [StepEvents(), StepEvents()] if cuda else []
        self.overhead_ns = 0
        # (host_ns, bytes_out, bytes_in) per batch of swap copies, and the batches whose
        # device times are not read yet, with their index in `swaps`
        self.swaps: list[tuple[int, int, int]] = []
        self.unread_swaps: list[tuple[int, SwapEvents]] = []
        if cuda:
            torch.cuda.synchronize()
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()
            torch.cuda.synchronize()
            self.reference_ns = time.perf_counter_ns()

    @contextmanager
    def phase(self, name: str, step: int):
        start = time.perf_counter_ns()
        try:
            yield
        finally:
            end = time.perf_counter_ns()
            self.cpu.add(CPU_PHASES.index(name), step, start, end)
            self.overhead_ns += time.perf_counter_ns() - end

    def record_step(self, step: int, work: tuple[int, int, int, int]) -> None:
        """A launched step and its work, as `roofline.step_work` counts it."""
        self.steps.append((step, time.perf_counter_ns(), *work))

    def swap_events(self) -> SwapEvents:
        return SwapEvents()

    def record_swap(self, num_bytes: tuple[int, int], events: SwapEvents | None) -> None:
        """A batch of swap copies just enqueued: (bytes out, bytes in), and its device events."""
        if events is not None:
            self.unread_swaps.append((len(self.swaps), events))
        self.swaps.append((time.perf_counter_ns(), *num_bytes))

    def _read_swaps(self) -> None:
        """Swap batches done on the device: onto the swap lane, tagged with their batch index."""
        while self.unread_swaps and self.unread_swaps[0][1].finish.query():
            index, events = self.unread_swaps.pop(0)
            begin_ms = self.reference.elapsed_time(events.begin)
            end_ms = self.reference.elapsed_time(events.finish)
            self.gpu.add(
                GPU_LANES.index("swap"),
                index,
                self.reference_ns + int(begin_ms * 1e6),
                self.reference_ns + int(end_ms * 1e6),
            )

    def read_gpu(self, slot_index: int, step: int, masked: bool = False) -> None:
        """After a step's D2H copy completed: turn its slot's events into host-clock intervals
        (`masked`: the step waited for token masks, so its mask-wait events are its own)."""
        if not self.cuda:
            return
        start = time.perf_counter_ns()
        events = self.slot_events[slot_index].events
        for i, lane in enumerate(STEP_LANES if masked else GPU_STREAMS):
            begin_ms = self.reference.elapsed_time(events[2 * i])
            end_ms = self.reference.elapsed_time(events[2 * i + 1])
            self.gpu.add(
                GPU_LANES.index(lane),
                step,
                self.reference_ns + int(begin_ms * 1e6),
                self.reference_ns + int(end_ms * 1e6),
            )
        self._read_swaps()
        self.overhead_ns += time.perf_counter_ns() - start

    def to_chrome_trace(self, metadata: dict) -> dict:
        """Chrome trace JSON: process 1 holds a lane per CPU phase, process 2 a lane per stream."""
        starts = [int(log.view()[:, 2].min()) for log in (self.cpu, self.gpu) if log.size]
        t0 = min(starts, default=0)
        events = [_metadata("process_name", pid, 0, name) for pid, name in ((1, "CPU"), (2, "GPU"))]
        events += [
            _metadata("thread_name", pid, tid, name)
            for pid, names in ((1, CPU_PHASES), (2, GPU_LANES))
            for tid, name in enumerate(names)
        ]
        for pid, log, names in ((1, self.cpu, CPU_PHASES), (2, self.gpu, GPU_LANES)):
            for kind, step, start, end in log.view().tolist():
                args = {"step": step} if names[kind] != "swap" else self._swap_args(step)
                events.append({
                    "ph": "X", "pid": pid, "tid": kind, "name": names[kind], "ts": (start - t0) / 1e3,
                    "dur": (end - start) / 1e3, "args": args,
                })  # fmt: skip
        for index, (host_ns, bytes_out, bytes_in) in enumerate(self.swaps):
            events.append({
                "ph": "C", "pid": 1, "tid": 0, "name": "swap", "ts": (host_ns - t0) / 1e3,
                "args": {"batch": index, "bytes_out": bytes_out, "bytes_in": bytes_in},
            })  # fmt: skip
        for step, launch_ns, num_seqs, num_tokens, context_tokens, pairs in self.steps:
            events.append({
                "ph": "C", "pid": 1, "tid": 0, "name": "batch", "ts": (launch_ns - t0) / 1e3,
                "args": {"num_seqs": num_seqs, "num_tokens": num_tokens, "step": step,
                         "context_tokens": context_tokens, "attention_pairs": pairs},
            })  # fmt: skip
        return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}

    def _swap_args(self, index: int) -> dict:
        _, bytes_out, bytes_in = self.swaps[index]
        return {"batch": index, "bytes_out": bytes_out, "bytes_in": bytes_in}

    def save(self, path: str | Path, metadata: dict) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace(metadata)))


def _metadata(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}}


class NoEvents:
    def start(self, stream_index: int = 0) -> None:
        pass

    def end(self, stream_index: int = 0) -> None:
        pass


class NoTimeline:
    """Stands in for Timeline when tracing is off; every hook does nothing."""

    recording = False

    def __init__(self):
        self.slot_events = (NoEvents(), NoEvents())

    def phase(self, name: str, step: int):
        return nullcontext()

    def record_step(self, step: int, work: tuple[int, int, int, int] | None) -> None:
        pass

    def swap_events(self) -> NoEvents:
        return NoEvents()

    def record_swap(self, num_bytes: tuple[int, int], events: object) -> None:
        pass

    def read_gpu(self, slot_index: int, step: int, masked: bool = False) -> None:
        pass
