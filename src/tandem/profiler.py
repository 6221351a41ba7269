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

CPU_PHASES = ("schedule", "build", "launch", "wait", "process")
GPU_STREAMS = ("h2d", "compute", "d2h")


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
    """Timing events around one slot's H2D copy, compute and D2H copy."""

    def __init__(self):
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * len(GPU_STREAMS))]

    def start(self, stream_index: int) -> None:
        self.events[2 * stream_index].record()

    def end(self, stream_index: int) -> None:
        self.events[2 * stream_index + 1].record()


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

    def read_gpu(self, slot_index: int, step: int) -> None:
        """After a step's D2H copy completed: turn its slot's events into host-clock intervals."""
        if not self.cuda:
            return
        start = time.perf_counter_ns()
        events = self.slot_events[slot_index].events
        for i in range(len(GPU_STREAMS)):
            begin_ms = self.reference.elapsed_time(events[2 * i])
            end_ms = self.reference.elapsed_time(events[2 * i + 1])
            self.gpu.add(
                i,
                step,
                self.reference_ns + int(begin_ms * 1e6),
                self.reference_ns + int(end_ms * 1e6),
            )
        self.overhead_ns += time.perf_counter_ns() - start

    def to_chrome_trace(self, metadata: dict) -> dict:
        """Chrome trace JSON: process 1 holds a lane per CPU phase, process 2 a lane per stream."""
        starts = [int(log.view()[:, 2].min()) for log in (self.cpu, self.gpu) if log.size]
        t0 = min(starts, default=0)
        events = [_metadata("process_name", pid, 0, name) for pid, name in ((1, "CPU"), (2, "GPU"))]
        events += [
            _metadata("thread_name", pid, tid, name)
            for pid, names in ((1, CPU_PHASES), (2, GPU_STREAMS))
            for tid, name in enumerate(names)
        ]
        for pid, log, names in ((1, self.cpu, CPU_PHASES), (2, self.gpu, GPU_STREAMS)):
            for kind, step, start, end in log.view().tolist():
                events.append({
                    "ph": "X", "pid": pid, "tid": kind, "name": names[kind], "ts": (start - t0) / 1e3,
                    "dur": (end - start) / 1e3, "args": {"step": step},
                })  # fmt: skip
        for step, launch_ns, num_seqs, num_tokens, context_tokens, pairs in self.steps:
            events.append({
                "ph": "C", "pid": 1, "tid": 0, "name": "batch", "ts": (launch_ns - t0) / 1e3,
                "args": {"num_seqs": num_seqs, "num_tokens": num_tokens, "step": step,
                         "context_tokens": context_tokens, "attention_pairs": pairs},
            })  # fmt: skip
        return {"traceEvents": events, "displayTimeUnit": "ms", "metadata": metadata}

    def save(self, path: str | Path, metadata: dict) -> None:
        Path(path).write_text(json.dumps(self.to_chrome_trace(metadata)))


def _metadata(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}}


class NoEvents:
    def start(self, stream_index: int) -> None:
        pass

    def end(self, stream_index: int) -> None:
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

    def read_gpu(self, slot_index: int, step: int) -> None:
        pass
