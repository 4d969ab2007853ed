"""deploy/k8s: every overlay renders with `kubectl kustomize`, every object validates with kubernetes-validate
against a pinned Kubernetes version, checkov finds nothing (each skip is an annotation with its reason), and
the objects agree with each other and with the real CLIs (every flag and PAGEDKV_*/BLOCKD_* variable is one a
click option takes).

No cluster runs here: what a real one would add (scheduling on GPU nodes, the custom-metrics adapter behind the
HPA, the Prometheus Operator behind the ServiceMonitor, a CNI that enforces NetworkPolicies) is not tested.
`make test` installs kubernetes-validate and checkov first (`make k8s-tools`, into .venv-k8s) and says where.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.core import ParameterSource

from tests.compose.test_compose import CLI_ENV_PREFIXES, parse_argv

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("gpu", "cpu")
KUBERNETES_VERSION = "1.32.0"
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}  # not in Kubernetes' own schemas: checked here by hand


def _tools_dir() -> Path:
    given = os.environ.get("PAGEDKV_K8S_TOOLS")
    return Path(given) if given else ROOT / ".venv-k8s" / "bin"


def tool(name: str) -> str:
    if name == "kubectl":
        found = shutil.which("kubectl")
        if found is None:
            pytest.skip("kubectl is not installed (it renders the kustomize overlays)")
        return found
    path = _tools_dir() / name
    if not path.exists():
        pytest.skip(f"{name} is not in {_tools_dir()}: `make k8s-tools` installs it (make test does that first)")
    return str(path)


@functools.cache
def rendered_text(overlay: str) -> str:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"kubectl kustomize {overlay}:\n{result.stderr}"
    return result.stdout


def rendered(overlay: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(rendered_text(overlay)) if doc]


def objects(overlay: str, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in rendered(overlay) if o["kind"] == kind}


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def _written(overlay: str, tmp_path: Path) -> Path:
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(rendered_text(overlay))
    return path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_kubernetes(overlay: str, tmp_path: Path) -> None:
    validate = tool("kubernetes-validate")
    docs = rendered(overlay)
    core = [d for d in docs if (d["apiVersion"], d["kind"]) not in CRDS]
    assert len(core) >= 15 and {d["metadata"].get("namespace") for d in core if d["kind"] != "Namespace"} == {"pagedkv"}
    path = tmp_path / "core.yaml"
    path.write_text(yaml.safe_dump_all(core))
    result = subprocess.run(
        [validate, "--kubernetes-version", KUBERNETES_VERSION, "--strict", "--quiet", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkov_finds_nothing(overlay: str, tmp_path: Path) -> None:
    checkov = tool("checkov")
    path = _written(overlay, tmp_path)
    result = subprocess.run(
        [checkov, "--file", str(path), "--framework", "kubernetes", "--output", "json", "--quiet", "--compact"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"},
    )
    assert result.stdout.strip(), f"checkov said nothing:\n{result.stderr[-2000:]}"
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [
        f"{check['check_id']} {check['check_name']}: {check['resource']}"
        for r in reports
        for check in r.get("results", {}).get("failed_checks", [])
    ]
    assert not failed, "\n".join(failed)
    passed = sum(r.get("summary", {}).get("passed", 0) for r in reports)
    assert passed > 100, "checkov ran almost no checks"
    for r in reports:  # every skip carries its reason
        for check in r.get("results", {}).get("skipped_checks", []):
            assert len(check.get("suppress_comment") or "") > 30, check


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_commands_and_variables_reach_the_real_clis(overlay: str) -> None:
    for kind in ("Deployment", "StatefulSet"):
        for name, workload in objects(overlay, kind).items():
            if name == "redis":
                continue
            c = container(workload)
            env = env_of(c)
            argv = [a.replace("$(POD_NAME)", f"{name}-0") for a in c["args"]]
            ctx = parse_argv(argv, env)[0]  # raises click's own error for a flag or value it does not take
            for var, value in env.items():
                if var.startswith(CLI_ENV_PREFIXES):
                    alone = parse_argv([argv[0]], {var: value})[0]
                    took = [
                        p.name
                        for p in alone.command.params
                        if p.name and alone.get_parameter_source(p.name) is ParameterSource.ENVIRONMENT
                    ]
                    assert took, f"{overlay}/{name}: {var} is read by no option of {argv[0]}"
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{overlay}/{name} has no {probe}"
                command = c[probe].get("exec", {}).get("command")
                if command and command[0] == "blockd-cli":
                    parse_argv(command, {})
            assert c["resources"]["requests"] and c["resources"]["limits"], f"{overlay}/{name}: resources"
            if name == "executor":
                assert ctx.params["pool_id"] == "executor-0", "the pool id is the pod's name"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_topology_agrees(overlay: str) -> None:
    deployments, statefulsets = objects(overlay, "Deployment"), objects(overlay, "StatefulSet")
    blockd = deployments["blockd"]
    assert blockd["spec"]["replicas"] == 1 and blockd["spec"]["strategy"]["type"] == "Recreate"
    redis = statefulsets["redis"]
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {"mountPath": "/data", "name": "data"} in container(redis)["volumeMounts"]

    executor = statefulsets["executor"]
    replicas = executor["spec"]["replicas"]
    service = executor["spec"]["serviceName"]
    expected = [f"tcp://executor-{i}.{service}:5560" for i in range(replicas)]
    gateway = deployments["gateway"]
    assert env_of(container(gateway))["PAGEDKV_GATEWAY_EXECUTORS"].split(",") == expected, "one entry per executor pod"
    assert gateway["spec"]["replicas"] >= 2
    assert container(executor)["readinessProbe"]["tcpSocket"]["port"] == "zmq", "readiness is the executor's own"
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in container(executor)["env"]

    limits = container(executor)["resources"]["limits"]
    device = env_of(container(executor))["PAGEDKV_EXECUTOR_DEVICE"]
    if overlay == "gpu":
        assert limits["nvidia.com/gpu"] == 1 and device == "cuda"
    else:
        assert "nvidia.com/gpu" not in limits and device == "cpu"
        assert env_of(container(executor))["PAGEDKV_EXECUTOR_KV_CACHE_MEMORY"].endswith("iB")

    (hpa,) = objects(overlay, "HorizontalPodAutoscaler").values()
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "pagedkv_gateway_requests_in_flight"
    pdbs = objects(overlay, "PodDisruptionBudget")
    assert set(pdbs) == {"executor", "gateway"}


def _selects(policy_peer: dict[str, Any]) -> str | None:
    return policy_peer.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/name")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_only_the_gateway_be_reached_from_outside(overlay: str) -> None:
    policies = objects(overlay, "NetworkPolicy")
    deny = policies["default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    open_to_all = []
    for name, policy in policies.items():
        for rule in policy["spec"].get("ingress", []):
            if not rule.get("from"):
                open_to_all.append(name)
    assert open_to_all == ["gateway"], open_to_all

    def sources(name: str, port: int) -> set[str | None]:
        return {
            _selects(peer)
            for rule in policies[name]["spec"]["ingress"]
            if {"port": port} in rule.get("ports", [])
            for peer in rule["from"]
        }

    assert sources("blockd", 5557) == {"executor", "gateway"}
    assert sources("executor", 5560) == {"gateway"}
    assert sources("redis", 6379) == {"blockd"}
    services = objects(overlay, "Service")
    assert all(s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in services.values())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_named_ports(overlay: str) -> None:
    (monitor,) = objects(overlay, "ServiceMonitor").values()
    selected = monitor["spec"]["selector"]["matchExpressions"][0]["values"]
    services = objects(overlay, "Service")
    ports = {port["name"] for name in selected for port in services[name]["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
