"""The gateway's Prometheus metrics, in a registry of its own (so several gateways can live in one test process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from gateway.admission import Door
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
        # Speculative decoding (--speculative-config): draft tokens proposed and accepted (their ratio: the
        # acceptance rate).
        drafted = CounterMetricFamily(
            "pagedkv_executor_spec_proposed_tokens",
            "Draft tokens proposed by speculative decoding",
            labels=["executor"],
        )
        accepted = CounterMetricFamily(
            "pagedkv_executor_spec_accepted_tokens", "Draft tokens verification accepted", labels=["executor"]
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
                drafted.add_metric(name, link.load.spec_proposed_tokens)
                accepted.add_metric(name, link.load.spec_accepted_tokens)
        return [healthy, waiting, running, free, utilization, preemptions, drafted, accepted]


# vLLM's buckets for the per-request times.
_REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))


class _VllmExecutorCollector(Collector):
    """vLLM's engine gauges, summed over the executors in rotation, read at scrape time from their load reports."""

    def __init__(self, links: Sequence[ExecutorLink], model_name: str) -> None:
        self.links = links
        self.model_name = model_name

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        label = [self.model_name]
        loads = [link.load for link in self.links if link.healthy and link.load is not None]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests in model execution batches", labels=["model_name"]
        )
        running.add_metric(label, sum(load.running for load in loads))
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "Requests waiting to be processed", labels=["model_name"]
        )
        waiting.add_metric(label, sum(load.waiting for load in loads))
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent", labels=["model_name"]
        )
        blocks = sum(load.num_blocks for load in loads)
        used = sum(load.kv_utilization * load.num_blocks for load in loads)  # held by live sequences
        usage.add_metric(label, used / blocks if blocks else 0.0)
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions", "Preemptions, summed over the executors' reports", labels=["model_name"]
        )
        preemptions.add_metric(label, sum(load.preemptions for load in loads))
        spec = []
        for name, doc, field in (
            ("vllm:spec_decode_num_drafts", "Speculative drafts verified", "spec_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Speculative draft tokens proposed", "spec_proposed_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted", "spec_accepted_tokens"),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, sum(getattr(load, field) for load in loads))
            spec.append(family)
        return [running, waiting, usage, preemptions, *spec]


class _VllmMirror(Collector):
    """vLLM's names for what the gateway already counts per token (read at scrape time, so a token costs no
    second observation): tokens, prefix-cache tokens, time to first token, inter-token latency, end to end."""

    def __init__(self, metrics: GatewayMetrics, model_name: str) -> None:
        self.metrics = metrics
        self.model_name = model_name

    def collect(self) -> Iterable[CounterMetricFamily | HistogramMetricFamily]:
        m, label = self.metrics, [self.model_name]
        families: list[CounterMetricFamily | HistogramMetricFamily] = []
        for name, doc, counter in (
            ("vllm:prompt_tokens", "Prefill tokens processed", m.prompt_tokens),
            ("vllm:generation_tokens", "Generation tokens processed", m.generated_tokens),
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", m.prompt_tokens),
            ("vllm:prefix_cache_hits", "Prompt tokens the prefix cache supplied", m.cached_tokens),
        ):
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, counter._value.get())
            families.append(family)
        for name, doc, histogram in (
            ("vllm:time_to_first_token_seconds", "Time to first token", m.ttft),
            ("vllm:inter_token_latency_seconds", "Inter-token latency", m.itl),
            ("vllm:e2e_request_latency_seconds", "End-to-end request latency", m.e2e),
        ):
            buckets, total = [], 0.0
            for sample in next(iter(histogram.collect())).samples:
                if sample.name.endswith("_bucket"):
                    buckets.append((sample.labels["le"], sample.value))
                elif sample.name.endswith("_sum"):
                    total = sample.value
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, buckets, total)
            families.append(family)
        return families


class VllmMetrics:
    """The request metrics vLLM exports, under its names, with its `model_name` label (dashboards and autoscalers
    built for vLLM read them unchanged). Times are the gateway's: the queue time is from arrival to the request's
    submission to an executor, so any wait inside the executor counts as prefill."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, labels = registry, ["model_name"]

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.queue = histogram("vllm:request_queue_time_seconds", "Time in the queue", _REQUEST_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "Time in the prefill phase", _REQUEST_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds", "Time in the decode phase", _REQUEST_BUCKETS)
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "Time from submission to the last token", _REQUEST_BUCKETS
        )
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS
        )
        self._success = Counter(
            "vllm:request_success", "Finished choices by finish reason", ["model_name", "finished_reason"], registry=r
        )
        self._model_name = model_name

    def success(self, finished_reason: str, count: int = 1) -> None:
        self._success.labels(self._model_name, finished_reason).inc(count)


class GatewayMetrics:
    def __init__(
        self,
        links: Sequence[ExecutorLink],
        in_flight: Callable[[], int],
        model_name: str = "",
        door: Door | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VllmMetrics(r, model_name)
        r.register(_VllmExecutorCollector(links, model_name))
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
        self.routed_by_tier = Counter(
            "pagedkv_gateway_routed_by_tier",
            "Requests routed by where their prompt's K/V was on the executor chosen: device, host, disk (the dearest "
            "medium it loads from), other (a tier this gateway has no cost for) or recompute (none of it cached)",
            ["tier"],
            registry=r,
        )
        self.retries = Counter(
            "pagedkv_gateway_retried_requests",
            "Requests resubmitted elsewhere because their executor was lost",
            registry=r,
        )
        self.migrations = Counter(
            "pagedkv_gateway_migrations",
            "Times a generation's executor was lost mid-generation and its choices continued on another",
            registry=r,
        )
        self.failed_migrations = Counter(
            "pagedkv_gateway_failed_migrations",
            "Generations lost mid-generation that could not continue elsewhere: refused (structured output, output "
            "penalties, multi-token bad words), limit (--max-migrations), no_executor",
            ["reason"],
            registry=r,
        )
        self.refused = Counter(
            "pagedkv_gateway_refused_requests",
            "Requests refused at the door with 429, before any work: queue_full (--max-queued-sequences) or "
            "overloaded (--max-queue-delay)",
            ["reason"],
            registry=r,
        )
        if door is not None:
            wait = Gauge(
                "pagedkv_gateway_estimated_queue_seconds",
                "How long a request arriving now would wait for the work queued before it (the least loaded "
                "executor, at its measured throughput; 0 until measured)",
                registry=r,
            )
            wait.set_function(lambda: door.estimated_wait_s() or 0.0)
        self.queue_depth = Gauge("pagedkv_gateway_requests_in_flight", "Requests in flight at the gateway", registry=r)
        self.queue_depth.set_function(lambda: in_flight())
        hit_rate = Gauge(
            "pagedkv_gateway_prefix_cache_hit_rate",
            "Fraction of prompt tokens the prefix cache supplied, since start",
            registry=r,
        )
        hit_rate.set_function(self._hit_rate)
        r.register(_VllmMirror(self, model_name))
        r.register(_ExecutorCollector(links))

    def _hit_rate(self) -> float:
        prompt = self.prompt_tokens._value.get()
        return self.cached_tokens._value.get() / prompt if prompt else 0.0
