"""vLLM's `compilation_config`, read for what it says about CUDA graphs.

tandem compiles no model with torch.compile (its kernels are its own), so of vLLM's
compilation options only the CUDA-graph ones take effect:

- `cudagraph_mode`: "NONE" (every step eager), "FULL_DECODE_ONLY" (whole graphs for decode
  steps, the rest eager), "PIECEWISE" (pieces for every step, no whole graphs), and "FULL" or
  "FULL_AND_PIECEWISE" (tandem's default: whole graphs for decode steps, pieces for the rest;
  a mixed or prefill step is never one whole graph here). `use_cudagraph: false` (older) is
  "NONE".
- `cudagraph_capture_sizes`: the row counts of the decode graphs (a decode step replays the
  next size up; one larger than the largest runs as pieces); `max_cudagraph_capture_size`
  caps them (the default sizes up to it, without a list).

The compile options (`mode`, `level`, `backend`, `use_inductor`, ...) are taken for vLLM's
signature without effect, as `trust_remote_code` is; any other key is a ValueError. vLLM's
`-O3` is the level alone (an int), taken likewise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# cudagraph_mode -> (whole decode graphs, pieces)
MODES = {
    "NONE": (False, False),
    "FULL_DECODE_ONLY": (True, False),
    "PIECEWISE": (False, True),
    "FULL": (True, True),
    "FULL_AND_PIECEWISE": (True, True),
}
# vLLM's options of torch.compile and its passes: taken, without effect here
COMPILE_KEYS = {
    "level", "mode", "backend", "use_inductor", "custom_ops", "splitting_ops", "compile_sizes",
    "inductor_compile_config", "inductor_passes", "pass_config", "cache_dir", "debug_dump_path",
    "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "full_cuda_graph", "use_inductor_graph_partition",
    "compile_cache_save_format", "local_cache_dir",
}  # fmt: skip
GRAPH_KEYS = {
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
    "use_cudagraph",
}


@dataclass(frozen=True)
class GraphPlan:
    decode_graphs: bool = True  # decode steps replay whole graphs
    pieces: bool = True  # the other steps replay pieces (piecewise.py)
    capture_sizes: tuple[int, ...] | None = None  # the decode graphs' rows; None: tandem's
    max_capture_size: int | None = None

    def sizes(self, max_rows: int, default: list[int]) -> list[int]:
        """The decode graphs' row counts for at most `max_rows` rows (`default`: tandem's)."""
        if not self.decode_graphs:
            return []
        sizes = self.capture_sizes if self.capture_sizes is not None else tuple(default)
        limit = min(max_rows, self.max_capture_size or max_rows)
        kept = sorted({s for s in sizes if s <= limit})
        if self.capture_sizes is None and kept and kept[-1] < limit:
            kept.append(limit)  # tandem's sizes end at the most rows a decode step has
        return kept


def with_graph_sizes(config: Any, **given: Any) -> Any:
    """`config` with vLLM's top-level graph arguments (cudagraph_capture_sizes,
    max_cudagraph_capture_size) put in as its keys; one given both ways must agree."""
    given = {key: value for key, value in given.items() if value is not None}
    if not given:
        return config
    if isinstance(config, str):
        graph_plan(config)  # a ValueError where it is no JSON
        config = json.loads(config)
    if config is None or (isinstance(config, int) and not isinstance(config, bool)):
        config = {} if config is None else {"level": config}
    if not isinstance(config, dict):
        return config  # graph_plan names its type
    for key, value in given.items():
        if key in config and config[key] != value:
            raise ValueError(
                f"{key}={value!r} contradicts compilation_config's {key}={config[key]!r}"
            )
    return {**config, **given}


def graph_plan(config: Any) -> GraphPlan:
    """The CUDA-graph plan of a `compilation_config`: a dict, its JSON text, or a level (an
    int, vLLM's -O); None is tandem's default. A ValueError naming what is wrong."""
    if config is None or (isinstance(config, int) and not isinstance(config, bool)):
        return GraphPlan()
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except json.JSONDecodeError:
            message = f"compilation_config must be JSON or a level, got {config!r:.80}"
            raise ValueError(message) from None
        return graph_plan(config)
    if not isinstance(config, dict):
        raise ValueError(
            f"compilation_config must be a dict (or its JSON, or a level), got "
            f"{type(config).__name__}"
        )
    unknown = sorted(set(config) - COMPILE_KEYS - GRAPH_KEYS)
    if unknown:
        raise ValueError(f"compilation_config has unknown keys {unknown}")
    mode = config.get("cudagraph_mode")
    if mode is None:
        mode = "NONE" if config.get("use_cudagraph") is False else "FULL_AND_PIECEWISE"
    if not isinstance(mode, str) or mode.upper() not in MODES:
        raise ValueError(
            f"compilation_config.cudagraph_mode must be one of {list(MODES)}, got {mode!r}"
        )
    decode_graphs, pieces = MODES[mode.upper()]
    sizes = config.get("cudagraph_capture_sizes")
    if sizes is not None and (
        not isinstance(sizes, list | tuple)
        or not sizes
        or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
    ):
        raise ValueError(
            "compilation_config.cudagraph_capture_sizes must be a non-empty list of row counts "
            f"(ints >= 1), got {sizes!r:.80}"
        )
    largest = config.get("max_cudagraph_capture_size")
    if largest is not None and (
        not isinstance(largest, int) or isinstance(largest, bool) or largest < 1
    ):
        raise ValueError(
            f"compilation_config.max_cudagraph_capture_size must be an int >= 1, got {largest!r}"
        )
    return GraphPlan(decode_graphs, pieces, None if sizes is None else tuple(sizes), largest)
