"""Prometheus metrics: engine gauges and counters read at scrape time, request latency histograms."""

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

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LatencyTracker:
    """Feeds one engine request's outputs into the latency histograms."""

    def __init__(self, metrics: ServerMetrics, arrival: float):
        self.metrics = metrics
        self.arrival = arrival
        self.last_token_time: float | None = None

    def observe(self, output: StreamOutput) -> None:
        if output.token_ids:
            if self.last_token_time is None:
                self.metrics.time_to_first_token.observe(output.time - self.arrival)
            else:  # one gap per token, as vLLM's per step: an output may carry several
                # (stream_interval), each its share of the time since the last
                gap = (output.time - self.last_token_time) / len(output.token_ids)
                for _ in output.token_ids:
                    self.metrics.inter_token_latency.observe(gap)
            self.last_token_time = output.time
        if output.finished:
            self.metrics.e2e_request_latency.observe(output.time - self.arrival)
