"""vLLM's profiler_config: torch.profiler between `LLM.start_profile()` and `stop_profile()`, one
trace file per rank (open it in Perfetto), or the CUDA profiler's capture range for Nsight
Systems (`nsys profile --capture-range=cudaProfilerApi`). tandem's own step timeline is
`--trace` (profiler.py)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

import torch

PROFILERS = ("torch", "cuda")
FILE_PREFIX = re.compile(r"[\w.-]+")  # a trace file's name prefix: no folders
# option -> its default (vLLM's names and defaults)
TORCH_OPTIONS = {
    "torch_profiler_record_shapes": False,
    "torch_profiler_with_memory": False,
    "torch_profiler_with_stack": True,
    "torch_profiler_with_flops": False,
    "torch_profiler_use_gzip": True,
}


def checked_config(config: Any) -> dict[str, Any] | None:
    """The config with its defaults filled in; a ValueError naming what is wrong with it."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise ValueError(f"profiler_config must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - {"profiler", "torch_profiler_dir", *TORCH_OPTIONS})
    if unknown:
        raise ValueError(f"profiler_config has unknown keys {unknown}")
    config = {"profiler": None, "torch_profiler_dir": "", **TORCH_OPTIONS, **config}
    if config["profiler"] not in PROFILERS:
        raise ValueError(
            f"profiler_config's profiler must be one of {PROFILERS}, got {config['profiler']!r}"
        )
    where = config["torch_profiler_dir"]
    if config["profiler"] == "torch" and not (isinstance(where, str) and os.path.isabs(where)):
        raise ValueError(
            f"profiler_config's torch_profiler_dir must be an absolute path, got {where!r}"
        )
    for name in TORCH_OPTIONS:
        if not isinstance(config[name], bool):
            raise ValueError(f"profiler_config's {name} must be True or False")
    return config


class Profile:
    """One rank's profiler, started and stopped between steps."""

    def __init__(self, config: dict[str, Any], rank: int, device: torch.device):
        self.config, self.rank, self.device = config, rank, device
        self.running: torch.profiler.profile | bool | None = None  # the torch profile, or True
        self.prefix: str | None = None  # the trace's file name before "_tp<rank>" (vLLM's)

    def start(self, profile_prefix: str | None = None) -> None:
        """`profile_prefix` (vLLM's): the trace file is `<prefix>_tp<rank>.pt.trace.json`."""
        if self.running is not None:
            raise RuntimeError("the profiler is already running: stop_profile() first")
        if profile_prefix is not None and not (
            isinstance(profile_prefix, str) and FILE_PREFIX.fullmatch(profile_prefix)
        ):
            raise ValueError(
                "profile_prefix must be a file name's start (letters, digits, '.', '_', '-'), "
                f"got {profile_prefix!r}"
            )
        self.prefix = profile_prefix
        if self.config["profiler"] == "cuda":
            torch.cuda.profiler.start()
            self.running = True
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        option = self.config.get
        self.running = torch.profiler.profile(
            activities=activities,
            record_shapes=option("torch_profiler_record_shapes"),
            profile_memory=option("torch_profiler_with_memory"),
            with_stack=option("torch_profiler_with_stack"),
            with_flops=option("torch_profiler_with_flops"),
        )
        self.running.start()

    def stop(self) -> str | None:
        """The trace file written (None for the CUDA profiler, whose capture nsys keeps)."""
        running, self.running = self.running, None
        if running is None:
            raise RuntimeError("the profiler is not running: start_profile() first")
        if running is True:
            torch.cuda.profiler.stop()
            return None
        running.stop()
        folder = Path(self.config["torch_profiler_dir"])
        folder.mkdir(parents=True, exist_ok=True)
        suffix = ".gz" if self.config["torch_profiler_use_gzip"] else ""
        name = (
            f"tandem-rank{self.rank}-{time.time_ns()}"
            if self.prefix is None
            else (f"{self.prefix}_tp{self.rank}")
        )
        path = folder / f"{name}.pt.trace.json{suffix}"
        running.export_chrome_trace(str(path))
        return str(path)
