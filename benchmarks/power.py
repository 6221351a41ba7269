"""Timing under sustained load, where the board's power cap sets the clock.

A short replay times a kernel at the idle board's full clock (1,980 MHz on the H200). rollout's
decode steps run at the 700 W cap instead, at about 1,605 MHz (BENCHMARKS.md, session 41), so
what a kernel costs there is its energy: at the cap, time is energy over the cap. `sustained`
replays a graph of calls for seconds, after a second of the same load, and reports µs a call
beside the board's mean power (NVML's energy counter) and its SM clock.
Used by `blaslt_algos.py --sustain` and `profile_step.py --sustain`.
"""

from __future__ import annotations

import ctypes
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

NVML_CLOCK_SM = 1


class Board:
    """NVML's readings of one GPU, through libnvidia-ml (the driver's library)."""

    def __init__(self, index: int = 0):
        self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
        check(self.nvml.nvmlInit_v2(), "nvmlInit")
        self.handle = ctypes.c_void_p()
        check(
            self.nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self.handle)),
            "nvmlDeviceGetHandleByIndex",
        )

    def energy_j(self) -> float:
        """Energy drawn since the driver loaded, in joules."""
        millijoules = ctypes.c_ulonglong()
        status = self.nvml.nvmlDeviceGetTotalEnergyConsumption(
            self.handle, ctypes.byref(millijoules)
        )
        check(status, "nvmlDeviceGetTotalEnergyConsumption")
        return millijoules.value / 1e3

    def sm_clock_mhz(self) -> int:
        mhz = ctypes.c_uint()
        status = self.nvml.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM, ctypes.byref(mhz))
        check(status, "nvmlDeviceGetClockInfo")
        return mhz.value


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: NVML status {status}")


@dataclass
class Sustained:
    us: float  # a call, mean over the timed window
    watts: float  # the board's mean power over it
    mhz: float  # median SM clock, sampled every 50 ms

    @property
    def joules(self) -> float:  # a call
        return self.watts * self.us / 1e6

    def __str__(self) -> str:
        return (
            f"{self.us:8.1f} us {self.watts:5.0f} W {self.mhz:5.0f} MHz {self.joules * 1e3:7.3f} mJ"
        )


def sustained(
    fn: Callable[[], object], board: Board, seconds: float = 2.0, calls: int = 20
) -> Sustained:
    """fn (graph-safe) captured `calls` times in one CUDA graph and replayed for `seconds` after
    a second of the same load."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # one replay timed alone sets how many replays fill a window
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    per_replay_s = max(start.elapsed_time(end) / 1e3, 1e-6)

    def run(window: float, sample: bool) -> tuple[float, list[int], int]:
        """Replays for about `window` seconds, queued 50 ms at a time: the host waits for the
        batch before the one just queued, then samples the clock, so the device never idles."""
        replays = max(1, round(window / per_replay_s))
        batch = max(1, round(0.05 / per_replay_s))
        clocks, queued, before = [], 0, None
        start.record()
        while queued < replays:
            count = min(batch, replays - queued)
            for _ in range(count):
                graph.replay()
            queued += count
            done = torch.cuda.Event()
            done.record()
            if before is not None:
                before.synchronize()
                if sample:
                    clocks.append(board.sm_clock_mhz())
            before = done
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, clocks, replays

    run(1.0, sample=False)  # to the board's steady clock
    energy, wall = board.energy_j(), time.perf_counter()
    elapsed, clocks, replays = run(seconds, sample=True)
    watts = (board.energy_j() - energy) / (time.perf_counter() - wall)
    return Sustained(
        us=elapsed * 1e6 / (replays * calls),
        watts=watts,
        mhz=statistics.median(clocks) if clocks else float("nan"),
    )
