"""The gateway's Prometheus metrics, in a registry of its own (so several gateways can live in one test process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.executors import ExecutorLink

disable_created_metrics()  # the *_created series double the output and nobody graphs them

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _ExecutorCollector(Collector):
    """Per-executor gauges read at scrape time from the links' latest load reports."""

    def __init__(self, links: Sequence[ExecutorLink]) -> None:
        self.links = links

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        healthy = GaugeMetricFamily(
            "pagedkv_executor_healthy", "1 while the executor is in rotation", labels=["executor"]
        )
        waiting = GaugeMetricFamily(
            "pagedkv_executor_waiting_requests", "Requests queued at the executor", labels=["executor"]
        )
        running = GaugeMetricFamily(
            "pagedkv_executor_running_requests", "Requests being generated", labels=["executor"]
        )
        free = GaugeMetricFamily("pagedkv_executor_free_blocks", "Free KV blocks", labels=["executor"])
        utilization = GaugeMetricFamily(
            "pagedkv_executor_kv_utilization", "KV blocks held by live sequences", labels=["executor"]
        )
        # The executor's own count since it started (a restart starts it again at 0, as a counter may).
        preemptions = CounterMetricFamily(
            "pagedkv_executor_preemptions",
            "Preemptions at the executor: a running sequence gave its KV blocks back, to be recomputed later",
            labels=["executor"],
        )
        for link in self.links:
            name = [link.endpoint]
            healthy.add_metric(name, 1.0 if link.healthy else 0.0)
            if link.load is not None:
                waiting.add_metric(name, link.load.waiting)
                running.add_metric(name, link.load.running)
                free.add_metric(name, link.load.free_blocks)
                utilization.add_metric(name, link.load.kv_utilization)
                preemptions.add_metric(name, link.load.preemptions)
        return [healthy, waiting, running, free, utilization, preemptions]


class GatewayMetrics:
    def __init__(self, links: Sequence[ExecutorLink], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pagedkv_gateway_requests", "Finished HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "pagedkv_gateway_time_to_first_token_seconds",
            "From request arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedkv_gateway_inter_token_latency_seconds",
            "Between successive tokens of one choice",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedkv_gateway_request_duration_seconds",
            "From arrival to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter("pagedkv_gateway_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("pagedkv_gateway_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            "pagedkv_gateway_cached_prompt_tokens", "Prompt tokens the prefix cache supplied", registry=r
        )
        self.routed = Counter(
            "pagedkv_gateway_routed_requests", "Requests sent to each executor", ["executor", "policy"], registry=r
        )
        self.retries = Counter(
            "pagedkv_gateway_retried_requests",
            "Requests resubmitted elsewhere because their executor was lost",
            registry=r,
        )
        self.queue_depth = Gauge("pagedkv_gateway_requests_in_flight", "Requests in flight at the gateway", registry=r)
        self.queue_depth.set_function(lambda: in_flight())
        hit_rate = Gauge(
            "pagedkv_gateway_prefix_cache_hit_rate",
            "Fraction of prompt tokens the prefix cache supplied, since start",
            registry=r,
        )
        hit_rate.set_function(self._hit_rate)
        r.register(_ExecutorCollector(links))

    def _hit_rate(self) -> float:
        prompt = self.prompt_tokens._value.get()
        return self.cached_tokens._value.get() / prompt if prompt else 0.0
