"""compose/observability: the Grafana dashboard queries only metrics the services export, with their labels.

The exported names come from the services' own metric classes (blockd.metrics.BlockdMetrics and
gateway.metrics.GatewayMetrics, each with its own fresh CollectorRegistry), every labelled metric given a child
and an executor link with a load report, then rendered in Prometheus' text format and parsed back: exactly the
sample names and labels a scrape sees. Each PromQL expression of the dashboard is reduced to the metric names and
label names it uses, and every one must be among them. The blockd half is checked once more against a scrape of
a running blockd (the gateway's /metrics is scraped from a running gateway in tests/gateway/test_openai_api.py).
"""

from __future__ import annotations

import functools
import json
import re
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from blockd.client import PoolClient
from blockd.metrics import BlockdMetrics
from common.net import free_port
from executor import protocol as ep
from gateway.metrics import GatewayMetrics
from tests.support.processes import BlockdProcess
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
OBSERVABILITY = ROOT / "compose" / "observability"
DASHBOARD = OBSERVABILITY / "grafana" / "dashboards" / "pagedkv.json"
PROMETHEUS = OBSERVABILITY / "prometheus.yml"

# Labels Prometheus itself puts on every series (target labels), and the histogram bucket bound.
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "endpoint", "container"}
# What the dashboard must show (issue 13, item 4): a panel title for each.
TOPICS = {
    "requests": r"^Requests per second",
    "TTFT percentiles": r"^Time to first token$",
    "ITL percentiles": r"^Inter-token latency$",
    "KV utilisation per executor": r"^KV utilisation per executor$",
    "prefix hit rate": r"^Prefix cache hit rate$",
    "preemptions": r"^Preemptions",
    "blockd step latency": r"^blockd step latency$",
    "persistence lag": r"^Persistence lag$",
    "persistence state": r"^Persistence state$",
}
PROMQL_WORDS = {
    # aggregations, functions and keywords that may appear without a following "(" in our expressions
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
}  # fmt: skip


def _with_children(metrics: object) -> None:
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase) and value._labelnames:
            value.labels(*["x"] * len(value._labelnames))


@functools.cache
def exported() -> dict[str, set[str]]:
    """Sample name -> its label names, as a scrape of blockd and of a gateway with one executor sees them."""
    blockd = BlockdMetrics()
    _with_children(blockd)
    load = ep.LoadReport(
        pool_id="executor-0", running=1, waiting=2, free_blocks=3, num_blocks=8, kv_utilization=0.5,
        preemptions=4, steps=5,
    )  # fmt: skip
    link = SimpleNamespace(endpoint="tcp://executor-0.executor:5560", healthy=True, load=load)
    gateway = GatewayMetrics([link], lambda: 0)  # type: ignore[list-item]
    _with_children(gateway)
    names: dict[str, set[str]] = {}
    for registry in (blockd.registry, gateway.registry):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # collapsed rows keep theirs inside
    return out


def queries(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = [(f"panel {p['title']!r}", t["expr"]) for p in panels(board) for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable ${var['name']}", query))
    return found


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """The metric names and the label names an expression uses (for the subset of PromQL dashboards use)."""
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables: $__rate_interval, ${pool}
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels |= set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    expr = re.sub(r"\{[^}]*\}", "", expr)
    for grouping in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in grouping.split(",") if label.strip()}
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    label_values = re.fullmatch(r"\s*label_values\((\w+),\s*(\w+)\)\s*", expr)
    if label_values:
        return {label_values[1]}, {label_values[2]}
    metrics = set()
    for match in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(?!\w)(\s*\()?", expr):
        word, call = match[1], match[2]
        if call or word in PROMQL_WORDS:
            continue
        metrics.add(word)
    return metrics, labels


def test_the_expression_reader_finds_names_and_labels() -> None:
    metrics, labels = promql_names(
        'histogram_quantile(0.99, sum by (le, op) (rate(blockd_request_seconds_bucket{op="step"}[$__rate_interval])))'
    )
    assert metrics == {"blockd_request_seconds_bucket"} and labels == {"le", "op"}
    metrics, labels = promql_names('max by (pool) (blockd_pool_blocks_in_use{pool=~"$pool"}) / max(blockd_pool_blocks)')
    assert metrics == {"blockd_pool_blocks_in_use", "blockd_pool_blocks"} and labels == {"pool"}
    assert promql_names("label_values(blockd_pool_blocks, pool)") == ({"blockd_pool_blocks"}, {"pool"})


def test_every_query_names_an_exported_metric_and_its_labels() -> None:
    names = exported()
    problems = []
    for where, expr in queries(dashboard()):
        metrics, labels = promql_names(expr)
        if not metrics:
            problems.append(f"{where}: no metric in {expr!r}")
        for metric in sorted(metrics - names.keys()):
            problems.append(f"{where}: {metric} is not exported (by blockd or the gateway)")
        known = set().union(*(names.get(m, set()) for m in metrics)) | TARGET_LABELS
        for label in sorted(labels - known):
            problems.append(f"{where}: label {label!r} is on none of {sorted(metrics)}")
    assert not problems, "\n".join(problems)


def test_blockd_ops_named_in_queries_are_real_ops() -> None:
    from blockd import protocol as p

    ops = {cls.__struct_config__.tag for cls in p.Request.__subclasses__()}
    named = {op for _, expr in queries(dashboard()) for op in re.findall(r'\bop=~?"(\w+)"', expr)}
    assert named and named <= ops, named - ops


def _scrape(port: int) -> dict[str, set[str]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def test_a_real_blockd_exports_what_the_dashboard_asks_of_it(tmp_path: Path) -> None:
    """The same check against a scrape of a running blockd with one pool that has admitted a sequence."""
    port = free_port()
    daemon = BlockdProcess(["--no-persistence", "--metrics-port", str(port)], tmp_path / "blockd.log")
    daemon.start()
    try:
        pool = PoolClient(daemon.client(), pool_id="executor-0", num_blocks=16, block_size=8, model_id="tiny")
        pool.register()
        pool.admit("s", list(range(17)))

        def with_pools() -> dict[str, set[str]] | None:
            names = _scrape(port)
            return names if "blockd_pool_blocks_in_use" in names else None

        scraped = wait_for(with_pools, timeout_s=10, what="blockd's pool gauges")
    finally:
        daemon.kill9()
    used = [(where, *promql_names(expr)) for where, expr in queries(dashboard())]
    asked = {m for _, metrics, _ in used for m in metrics if m.startswith("blockd_")}
    assert asked, "the dashboard shows nothing of blockd"
    assert asked <= scraped.keys(), asked - scraped.keys()
    for where, metrics, labels in used:
        mine = metrics & asked
        if mine:
            known = set().union(*(scraped[m] for m in mine)) | TARGET_LABELS
            assert labels <= known, (where, labels - known)


def test_the_check_catches_a_metric_that_does_not_exist() -> None:
    assert "pagedkv_gateway_requests_total" in exported()
    assert promql_names("rate(pagedkv_gateway_request_total[5m])")[0] - exported().keys()
    assert "blockd_pool_blocks" in exported() and "executor" not in exported()["blockd_pool_blocks"]


@pytest.mark.parametrize("topic", TOPICS)
def test_the_dashboard_shows(topic: str) -> None:
    titled = [p for p in panels(dashboard()) if re.search(TOPICS[topic], p["title"])]
    assert titled and all(p.get("targets") for p in titled), topic


def test_the_dashboard_is_provisionable() -> None:
    board = dashboard()
    assert board["uid"] == "pagedkv" and board["title"] and isinstance(board["schemaVersion"], int)
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels(board):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
    # The provisioning files point at what compose mounts (see compose/observability/README.md).
    provider = yaml.safe_load((OBSERVABILITY / "grafana/provisioning/dashboards/pagedkv.yml").read_text())
    [entry] = provider["providers"]
    assert entry["type"] == "file" and entry["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((OBSERVABILITY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    [datasource] = source["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    readme = (OBSERVABILITY / "README.md").read_text()
    for path in ("/var/lib/grafana/dashboards", "/etc/grafana/provisioning", "/etc/prometheus/prometheus.yml"):
        assert path in readme


def test_prometheus_scrapes_the_ports_the_services_serve_metrics_on() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"blockd", "gateway"}
    targets = {name: [t for s in job["static_configs"] for t in s["targets"]] for name, job in jobs.items()}
    # The compose services: blockd serves metrics on --metrics-port, the gateway on its HTTP --port.
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())["services"]
    blockd, gateway = compose["blockd"]["command"], compose["gateway"]["command"]
    assert targets["blockd"] == [f"blockd:{blockd[blockd.index('--metrics-port') + 1]}"]
    assert blockd[blockd.index("--metrics-host") + 1] == "0.0.0.0"
    assert targets["gateway"] == [f"gateway:{gateway[gateway.index('--port') + 1]}"]
    assert jobs["gateway"].get("metrics_path", "/metrics") == "/metrics"
