"""The engine's counters and gauges: `Engine.stats()` snapshots them, `LLM.get_metrics()` returns
them as vLLM's metric objects, the server's /metrics exports the same names, and `StatLogger`
logs them every few seconds (disable_log_stats=False)."""

from __future__ import annotations

import logging
from collections import Counter as Tally
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine between two steps (read from any thread)."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0  # of requests that produced a first token
    num_generation_tokens: int = 0
    num_finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at admission
    prefix_cache_hits: int = 0  # of those, tokens found there

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass
class RequestCounts:
    """What the engine's requests have made so far, counted as their tokens are read back."""

    prompt_tokens: int = 0  # of requests that produced a first token
    generation_tokens: int = 0
    finished: Tally[str] = field(default_factory=Tally)  # by finish reason


@dataclass
class Metric:
    """vLLM's metric objects (`vllm.v1.metrics.reader`): a name and its labels."""

    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    """A count that only grows."""

    value: int


@dataclass
class Gauge(Metric):
    """A value that goes up and down."""

    value: float


# name -> what it measures, as /metrics describes it (the counters' samples get "_total")
HELP = {
    "tandem_num_requests_running": "Requests in the running batch",
    "tandem_num_requests_waiting": "Requests queued for admission (swapped-out ones too)",
    "tandem_kv_cache_usage_perc": "Fraction of KV cache blocks in use",
    "tandem_prompt_tokens": "Prompt tokens of requests that started",
    "tandem_generation_tokens": "Generated tokens",
    "tandem_num_preemptions": "Requests preempted for KV blocks",
    "tandem_prefix_cache_queries": "Tokens looked up in the prefix cache (first admissions)",
    "tandem_prefix_cache_hits": "Prompt tokens found in the prefix cache",
    "tandem_request_success": "Finished requests by finish reason",
}
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's, each counted from 0


def engine_metrics(stats: EngineStats) -> list[Metric]:
    """The snapshot as metrics, in HELP's order; finished requests one counter per reason."""
    return [
        Gauge("tandem_num_requests_running", {}, stats.num_running),
        Gauge("tandem_num_requests_waiting", {}, stats.num_waiting),
        Gauge("tandem_kv_cache_usage_perc", {}, stats.kv_cache_usage),
        Counter("tandem_prompt_tokens", {}, stats.num_prompt_tokens),
        Counter("tandem_generation_tokens", {}, stats.num_generation_tokens),
        Counter("tandem_num_preemptions", {}, stats.num_preemptions),
        Counter("tandem_prefix_cache_queries", {}, stats.prefix_cache_queries),
        Counter("tandem_prefix_cache_hits", {}, stats.prefix_cache_hits),
        *(
            Counter("tandem_request_success", {"finished_reason": reason}, count)
            for reason, count in sorted(
                {**dict.fromkeys(FINISH_REASONS, 0), **stats.num_finished}.items()
            )
        ),
    ]


LOG_INTERVAL_S = 10.0  # vLLM's


class StatLogger:
    """With disable_log_stats=False (vLLM's): every LOG_INTERVAL_S of stepping, one INFO line on
    the "tandem.metrics" logger with the throughputs since the line before, the requests running
    and waiting, the KV cache usage and the prefix cache's hit rate since the line before."""

    def __init__(self, now: float):
        self.last_at = now
        self.last = EngineStats()

    def maybe_log(self, stats: Callable[[], EngineStats], now: float) -> None:
        if now - self.last_at >= LOG_INTERVAL_S:
            self.log(stats, now)

    def log(self, stats: Callable[[], EngineStats], now: float) -> None:
        """The line now (vLLM's do_log_stats), over the time since the line before."""
        current, seconds = stats(), max(now - self.last_at, 1e-9)
        queried = current.prefix_cache_queries - self.last.prefix_cache_queries
        hits = current.prefix_cache_hits - self.last.prefix_cache_hits
        logger.info(
            "prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d, "
            "waiting %d requests, KV cache usage %.1f%%, prefix cache hit rate %.1f%%",
            (current.num_prompt_tokens - self.last.num_prompt_tokens) / seconds,
            (current.num_generation_tokens - self.last.num_generation_tokens) / seconds,
            current.num_running,
            current.num_waiting,
            100 * current.kv_cache_usage,
            100 * hits / queried if queried else 0.0,
        )
        self.last_at, self.last = now, current
