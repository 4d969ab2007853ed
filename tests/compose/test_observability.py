"""compose/observability: Prometheus scrapes what the services serve, and every dashboard query names a metric
blockd or the gateway really exports (read from their own registries, not from a list written here)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
import zmq.asyncio
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from blockd import protocol as p
from blockd.metrics import BlockdMetrics
from blockd.pool import BlockPool, PoolSpec
from executor import protocol as ep
from gateway.executors import ExecutorLink
from gateway.metrics import GatewayMetrics
from tests.compose.test_compose import COMPOSE_DIR, GPU, load_compose, needs_compose, parse_service

OBSERVABILITY = COMPOSE_DIR / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "dashboards" / "pagedkv.json"
PROMETHEUS = OBSERVABILITY / "prometheus.yml"
DATASOURCES = OBSERVABILITY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = OBSERVABILITY / "grafana" / "provisioning" / "dashboards" / "pagedkv.yml"
# A metric name in a query: our two prefixes, as PromQL writes them.
METRIC = re.compile(r"\b(?:blockd|pagedkv)_[a-z0-9_]+\b")


def _sample_names(registry: Any) -> set[str]:
    text = generate_latest(registry).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def exported() -> set[str]:
    """Every series name blockd and the gateway serve on /metrics, each metric observed once."""
    blockd = BlockdMetrics()
    pool = BlockPool(PoolSpec("executor-0", 8, 4, "m", 1))
    stats = p.PersistenceStats(True, "ok", "redis://redis:6379/0", 0.0, 0.1, 0, 0, 0)
    blockd.update({"executor-0": pool}, stats)
    blockd.requests.labels("step", "ok").inc()
    blockd.request_seconds.labels("step").observe(1e-4)
    blockd.expired_pools.inc()

    link = ExecutorLink("tcp://executor-0:5560", zmq.asyncio.Context.instance())
    link.load = ep.LoadReport(
        pool_id="executor-0",
        running=1,
        waiting=0,
        free_blocks=7,
        num_blocks=8,
        kv_utilization=0.125,
        preemptions=0,
        steps=3,
    )
    gateway = GatewayMetrics([link], lambda: 0)
    gateway.requests.labels("/v1/completions", "200").inc()
    gateway.routed.labels("tcp://executor-0:5560", "prefix").inc()
    return _sample_names(blockd.registry) | _sample_names(gateway.registry)


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[tuple[str, str]]:
    return [(panel["title"], target["expr"]) for panel in dashboard()["panels"] for target in panel["targets"]]


def test_every_query_names_exported_metrics() -> None:
    names = exported()
    assert queries(), "the dashboard has no queries"
    for title, expr in queries():
        used = METRIC.findall(expr)
        assert used, f"{title}: {expr!r} names no pagedkv or blockd metric"
        unknown = [name for name in used if name not in names]
        assert not unknown, f"{title}: {expr!r} names {unknown}, which nothing exports (exported: {sorted(names)})"


def test_the_dashboard_shows_what_operators_ask_for() -> None:
    used = {name for _, expr in queries() for name in METRIC.findall(expr)}
    needed = {
        "requests": "pagedkv_gateway_requests_total",
        "TTFT percentiles": "pagedkv_gateway_time_to_first_token_seconds_bucket",
        "ITL percentiles": "pagedkv_gateway_inter_token_latency_seconds_bucket",
        "KV utilisation per executor": "pagedkv_executor_kv_utilization",
        "prefix hit rate": "pagedkv_gateway_cached_prompt_tokens_total",
        "preemptions": "pagedkv_executor_preemptions_total",
        "blockd step latency": "blockd_request_seconds_bucket",
        "persistence lag": "blockd_persistence_lag_seconds",
        "persistence state": "blockd_persistence_degraded",
    }
    missing = {what: name for what, name in needed.items() if name not in used}
    assert not missing, f"no panel shows {missing}"
    for _, expr in queries():
        for quantile in re.findall(r"histogram_quantile\(([0-9.]+)", expr):
            assert 0 < float(quantile) < 1


def test_panels_use_the_provisioned_datasource_and_the_provider_finds_the_file() -> None:
    (source,) = yaml.safe_load(DATASOURCES.read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    board = dashboard()
    assert board["uid"] and len({panel["id"] for panel in board["panels"]}) == len(board["panels"])
    for panel in board["panels"]:
        for ref in [panel["datasource"], *(t["datasource"] for t in panel["targets"])]:
            assert ref == {"type": "prometheus", "uid": source["uid"]}, panel["title"]
    (provider,) = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == "/var/lib/grafana/dashboards"


@needs_compose
def test_prometheus_scrapes_the_ports_the_services_serve_metrics_on() -> None:
    compose = load_compose(GPU, ("observability",))
    services = compose["services"]
    assert {"prometheus", "grafana"} <= set(services)
    assert "prometheus" not in load_compose()["services"], "the dashboards are optional (profile observability)"
    blockd = parse_service("blockd", services["blockd"])[0].params
    gateway = parse_service("gateway", services["gateway"])[0].params
    assert blockd["metrics_host"] == "0.0.0.0", "blockd's metrics must be reachable from the prometheus container"
    serving = {("blockd", blockd["metrics_port"]), ("gateway", gateway["port"])}
    targets = {
        (host, int(port))
        for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
        for static in job["static_configs"]
        for host, port in (target.split(":") for target in static["targets"])
    }
    assert targets == serving
    # The files compose mounts are the ones checked here.
    mounts = {
        (name, Path(v["source"]), v["target"])
        for name in ("prometheus", "grafana")
        for v in services[name]["volumes"]
        if v["type"] == "bind"
    }
    assert mounts == {
        ("prometheus", PROMETHEUS, "/etc/prometheus/prometheus.yml"),
        ("grafana", OBSERVABILITY / "grafana" / "provisioning", "/etc/grafana/provisioning"),
        ("grafana", DASHBOARD.parent, "/var/lib/grafana/dashboards"),
    }


@pytest.mark.parametrize("path", [PROMETHEUS, DATASOURCES, PROVIDERS])
def test_config_files_are_yaml(path: Path) -> None:
    assert isinstance(yaml.safe_load(path.read_text()), dict)
