"""Prometheus metrics: engine gauges and counters read at scrape time, request histograms (latency,
its phases, sizes)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.async_llm import AsyncLLM, StreamOutput
from tandem.metrics import HELP, Gauge, engine_metrics

# up to vLLM's largest buckets (2,560 s to a first token, 7,680 s a request): a queue that long
# still reads as its percentiles, not as +Inf
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                   20.48, 40.96, 81.92, 163.84, 640.0, 2560.0)  # fmt: skip
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
               1920.0, 7680.0)  # fmt: skip
# vLLM's, for the phases of a request (queued, prefill, decode, inference)
PHASE_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    found, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(found)
            found.append(step * scale)
        scale *= 10


class EngineCollector(Collector):
    """The engine thread's latest EngineStats as gauges and counters (`metrics.engine_metrics`:
    the names `LLM.get_metrics` gives too), each labelled with the served model's name, as
    vLLM labels its own."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.llm = llm
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for metric in engine_metrics(self.llm.stats):
            family = families.get(metric.name)
            if family is None:
                kind = GaugeMetricFamily if isinstance(metric, Gauge) else CounterMetricFamily
                family = families[metric.name] = kind(
                    metric.name, HELP[metric.name], labels=["model_name", *metric.labels]
                )
            family.add_metric([self.model_name, *metric.labels.values()], metric.value)
        yield from families.values()


class ServerMetrics:
    """One registry per server, so several servers can live in one process (tests); every
    metric labelled `model_name` (the first served name), as vLLM's."""

    def __init__(self, llm: AsyncLLM, model_name: str):
        self.max_model_len = llm.max_model_len
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(llm, model_name))

        def histogram(name: str, what: str, buckets: tuple[float, ...]):
            family = Histogram(name, what, ["model_name"], buckets=buckets, registry=self.registry)
            return family.labels(model_name)

        self.time_to_first_token = histogram(
            "tandem_time_to_first_token_seconds",
            "From request arrival to its first token",
            LATENCY_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "tandem_inter_token_latency_seconds",
            "Between consecutive tokens of a request",
            LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "tandem_e2e_request_latency_seconds",
            "From request arrival to its last token",
            E2E_BUCKETS,
        )
        self.queue_time = histogram(
            "tandem_request_queue_time_seconds",
            "From request arrival to its first admission",
            PHASE_BUCKETS,
        )
        self.prefill_time = histogram(
            "tandem_request_prefill_time_seconds",
            "From a request's first admission to its first token",
            PHASE_BUCKETS,
        )
        self.decode_time = histogram(
            "tandem_request_decode_time_seconds",
            "From a request's first token to its last",
            PHASE_BUCKETS,
        )
        self.inference_time = histogram(
            "tandem_request_inference_time_seconds",
            "From a request's first admission to its last token",
            PHASE_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "tandem_request_time_per_output_token_seconds",
            "A request's decode time over its tokens after the first",
            TPOT_BUCKETS,
        )
        tokens = buckets_1_2_5(self.max_model_len)
        self.prompt_tokens = histogram(
            "tandem_request_prompt_tokens", "Prompt tokens of a finished request", tokens
        )
        self.generation_tokens = histogram(
            "tandem_request_generation_tokens", "Tokens a finished request generated", tokens
        )
        self.max_tokens = histogram(
            "tandem_request_params_max_tokens", "A finished request's max_tokens", tokens
        )
        self.n = histogram(
            "tandem_request_params_n", "A call's n (sequences per prompt)", N_BUCKETS
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LatencyTracker:
    """Feeds one engine request's outputs into the request histograms, as vLLM times a request's
    phases: queued until its first admission, prefill until its first token, decode until its
    last."""

    def __init__(self, metrics: ServerMetrics, arrival: float, max_tokens: int | None):
        self.metrics = metrics
        self.arrival = arrival
        self.max_tokens = max_tokens  # None: up to max_model_len
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.scheduled_time: float | None = None  # its first admission, once finished
        self.num_output_tokens = 0  # once finished

    def observe(self, output: StreamOutput) -> None:
        if output.token_ids:
            if self.last_token_time is None:
                self.first_token_time = output.time
                self.metrics.time_to_first_token.observe(output.time - self.arrival)
            else:  # one gap per token, as vLLM's per step: an output may carry several
                # (stream_interval), each its share of the time since the last
                gap = (output.time - self.last_token_time) / len(output.token_ids)
                for _ in output.token_ids:
                    self.metrics.inter_token_latency.observe(gap)
            self.last_token_time = output.time
        if output.finished:
            self.finish(output)

    def finish(self, output: StreamOutput) -> None:
        metrics = self.metrics
        metrics.e2e_request_latency.observe(output.time - self.arrival)
        metrics.prompt_tokens.observe(output.num_prompt_tokens)
        metrics.generation_tokens.observe(output.num_output_tokens)
        room = metrics.max_model_len - output.num_prompt_tokens
        metrics.max_tokens.observe(room if self.max_tokens is None else min(room, self.max_tokens))
        scheduled = self.scheduled_time = output.scheduled_time
        self.num_output_tokens = output.num_output_tokens
        if scheduled is None:
            return  # aborted before its first admission: it had no phases
        metrics.queue_time.observe(max(0.0, scheduled - self.arrival))
        if self.first_token_time is None or self.last_token_time is None:
            return  # no token (aborted, or a pooling request)
        decode = self.last_token_time - self.first_token_time
        metrics.prefill_time.observe(self.first_token_time - scheduled)
        metrics.decode_time.observe(decode)
        metrics.inference_time.observe(self.last_token_time - scheduled)
        if output.num_output_tokens > 1:
            metrics.time_per_output_token.observe(decode / (output.num_output_tokens - 1))

    def timing(self) -> dict[str, float | None]:
        """vLLM's per-request metrics of the finished request (--enable-per-request-metrics), in
        ms: queued until its first admission, from there to its first token, first to last
        token and their mean gap; and its tokens per second from its admission on. None where
        it had no such phase."""
        scheduled, first, last, n = (
            self.scheduled_time, self.first_token_time, self.last_token_time,
            self.num_output_tokens,
        )  # fmt: skip
        tokens = scheduled is not None and first is not None and last is not None
        return {
            "time_to_first_token_ms": (first - scheduled) * 1000 if tokens else None,
            "generation_time_ms": (last - first) * 1000 if tokens else None,
            "queue_time_ms": (scheduled - self.arrival) * 1000 if scheduled is not None else None,
            "mean_itl_ms": (last - first) / (n - 1) * 1000 if tokens and n > 1 else None,
            "tokens_per_second": n / (last - scheduled) if tokens and last > scheduled else None,
        }
