"""deploy/k8s: the Kubernetes manifests, rendered and checked with the real tools (no cluster runs here).

Each overlay is rendered by `kubectl kustomize`; every rendered object is validated by `kubernetes-validate`
(strict: an unknown field fails) against a pinned Kubernetes version, and scanned by `checkov`, which must find
nothing that is not skipped with a written reason. Then what the tools cannot know: every pagedkv command, flag
and environment variable is parsed by the real click command of the service, the endpoints, ports, names and
selectors agree across objects, the NetworkPolicies let exactly the intended peers in, and the executor's
readiness probe really asks an executor over its protocol.

The tools come from `make k8s-tools` (a dependency of `make test`): checkov and kubernetes-validate in their own
virtual environment (.venv-k8s, or $K8S_VENV), kubectl from the system. Where one is missing the tests that need
it skip, saying which and how to get it.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import click
import pytest
import yaml
import zmq
from click.core import ParameterSource

from common.auth import KeySet, Role, ServerAuth, generate
from executor import protocol as ep

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
README = K8S / "README.md"
OVERLAYS = ("gpu", "cpu", "gpu-tp", "gpu-shared-kv")
# The shared KV tier's component and the overlay made of gpu and it.
SHARED_KV_COMPONENT = K8S / "components" / "shared-kv"
SHARED_KV_OVERLAY = "gpu-shared-kv"
NAMESPACE = "pagedkv"
# The oldest Kubernetes the manifests are meant for (README says so); kubernetes-validate ships its schemas.
KUBERNETES_VERSION = "1.32.0"
TOOLS = Path(os.environ.get("K8S_VENV") or ROOT / ".venv-k8s") / "bin"
# Objects of custom resources have no schema in kubernetes-validate: they are left out of its run, each for the
# reason given, and checked by the tests named there instead.
CUSTOM_RESOURCES = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "the Prometheus Operator's CRD; no schema of it ships with "
    "kubernetes-validate: test_service_monitors_scrape_real_ports checks its selector, ports and paths",
}
SERVICE_SCRIPTS = ("blockd", "blockd-cli", "pagedkv-executor", "pagedkv-gateway")
# Variables with these names or prefixes are meant for a pagedkv CLI: each must reach an option of the command.
CLI_ENV_PREFIXES = ("PAGEDKV_", "BLOCKD_")
CLI_ENV_NAMES = ("REDIS_URL",)
SECRET_PLACEHOLDER = "0123456789abcdef"  # what a secretKeyRef resolves to while parsing

Obj = dict[str, Any]


# -------------------------------------------------------------------------------------------------- the tools


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip(
            "kubectl is not on PATH: `make k8s-tools` installs it with apt-get where a package source offers it "
            "(package kubectl); it renders the overlays (kubectl kustomize)"
        )
    return found


def tool(name: str) -> str:
    path = TOOLS / name
    if not path.is_file():
        pytest.skip(f"{path} is missing: run `make k8s-tools` (pip installs deploy/k8s/tools-requirements.txt there)")
    return str(path)


@functools.cache
def _render(overlay: str) -> tuple[str, list[Obj]]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"kubectl kustomize overlays/{overlay} failed:\n{done.stderr}"
    return done.stdout, [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def rendered(overlay: str) -> list[Obj]:
    return copy.deepcopy(_render(overlay)[1])


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def objs(overlay: str) -> list[Obj]:
    return rendered(overlay)


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def pod_spec(obj: Obj) -> Obj:
    return obj["spec"]["template"]["spec"]


def containers(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj in workloads(objs):
        for container in pod_spec(obj)["containers"]:
            yield obj, container


def argv(container: Obj) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


def container_of(objs: list[Obj], name: str) -> tuple[Obj, Obj]:
    [(obj, container)] = [(o, c) for o, c in containers(objs) if c["name"] == name]
    return obj, container


def _report(problems: list[str]) -> str:
    return "\n".join(f"  - {p}" for p in problems)


# ------------------------------------------------------------------------------------------ render and validate


def test_every_overlay_renders_the_whole_stack(objs: list[Obj]) -> None:
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for expected in [
        ("Namespace", NAMESPACE),
        ("StatefulSet", "redis"),
        ("Service", "redis"),
        ("Deployment", "blockd"),
        ("Service", "blockd"),
        ("StatefulSet", "executor"),
        ("Service", "executor"),
        ("Deployment", "gateway"),
        ("Service", "gateway"),
        ("HorizontalPodAutoscaler", "gateway"),
        ("PodDisruptionBudget", "gateway"),
        ("PodDisruptionBudget", "executor"),
        ("NetworkPolicy", "default-deny-ingress"),
        ("ServiceMonitor", "blockd"),
        ("ServiceMonitor", "gateway"),
        ("PersistentVolumeClaim", "model"),
    ]:
        assert expected in kinds, f"{expected} is not rendered"
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, f"{o['kind']}/{o['metadata']['name']}"
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pagedkv"


def _validate(objs: list[Obj], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all(objs, sort_keys=False))
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_object_validates_against_the_pinned_kubernetes(objs: list[Obj], tmp_path: Path) -> None:
    builtin = [o for o in objs if (o["apiVersion"], o["kind"]) not in CUSTOM_RESOURCES]
    custom = {(o["apiVersion"], o["kind"]) for o in objs} - {(o["apiVersion"], o["kind"]) for o in builtin}
    assert custom <= set(CUSTOM_RESOURCES)
    done = _validate(builtin, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # Each object passed by name: a kind without a schema (a warning, not a failure) would not.
    passed = re.findall(r"passed for resource (\S+) against version", out)
    expected = [f"{o['kind'].lower()}/{o['metadata']['name']}" for o in builtin]
    assert sorted(passed) == sorted(expected), out


def test_validation_is_strict_enough_to_catch_a_typo(tmp_path: Path) -> None:
    objs = rendered("gpu")
    gateway = find(objs, "Deployment", "gateway")
    gateway["spec"]["replica"] = gateway["spec"].pop("replicas")
    probe = pod_spec(find(objs, "StatefulSet", "executor"))["containers"][0]["readinessProbe"]
    probe["periodSecond"] = probe.pop("periodSeconds")
    done = _validate([o for o in objs if (o["apiVersion"], o["kind"]) not in CUSTOM_RESOURCES], tmp_path)
    assert done.returncode != 0
    assert "'replica' was unexpected" in done.stdout + done.stderr
    assert "'periodSecond' was unexpected" in done.stdout + done.stderr


def test_checkov_finds_nothing_unjustified(tmp_path: Path) -> None:
    for name in OVERLAYS:
        (tmp_path / f"{name}.yaml").write_text(_render(name)[0])
    done = subprocess.run(
        # --skip-download: the guidelines and severities need a Prisma Cloud account and the network.
        [
            tool("checkov"),
            "--directory",
            str(tmp_path),
            "--framework",
            "kubernetes",
            "--output",
            "json",
            "--skip-download",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "BC_API_KEY": "", "PRISMA_API_URL": ""},
    )
    report = json.loads(done.stdout)
    summary, results = report["summary"], report["results"]
    assert summary["parsing_errors"] == 0 and summary["resource_count"] > 0, summary
    assert summary["passed"] > 100, summary  # it really ran the Kubernetes checks
    # Offline, checkov reports no severities, so every failure counts, whatever its severity.
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']}" for c in results.get("failed_checks", [])]
    assert not failed, "checkov failures (fix, or skip with a reason):\n" + _report(failed)
    for skipped in results.get("skipped_checks", []):
        reason = skipped["check_result"].get("suppress_comment") or ""
        assert len(reason) > 30, f"{skipped['check_id']} on {skipped['resource']} is skipped without a reason"


# ------------------------------------------------------------------------------ commands, flags and variables


@functools.cache
def console_scripts() -> dict[str, str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@functools.cache
def load_script(script: str) -> click.Command:
    import importlib

    module_name, _, attr = console_scripts()[script].partition(":")
    command = getattr(importlib.import_module(module_name), attr)
    assert isinstance(command, click.Command)
    return command


def resolve_env(container: Obj, pod_name: str) -> dict[str, str]:
    """The container's environment as the kubelet makes it: $(VAR) of earlier variables expanded, the
    downward API filled in for a pod called `pod_name`, secrets replaced by a placeholder."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), str(var["value"])
            )
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            env[var["name"]] = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE}[field]
        elif "secretKeyRef" in source:
            env[var["name"]] = SECRET_PLACEHOLDER
        else:
            raise AssertionError(f"{container['name']}: {var['name']} comes from {source}, not handled here")
    return env


SECRETS_MOUNT = "/etc/pagedkv/"


@functools.cache
def secrets_standin() -> Path:
    """What the Secret volumes hold under /etc/pagedkv, made the way the README says (`pagedkv keys generate`),
    so options that want an existing file see one while parsing."""
    root = Path(tempfile.mkdtemp(prefix="pagedkv-k8s-test-"))
    generate(root / "keys")
    for path, text in (("api-keys/api-keys", "sk-test\n"), ("redis/password", "pw\n")):
        (root / path).parent.mkdir(parents=True)
        (root / path).write_text(text)
    (root / "deployment-secret").mkdir()
    (root / "deployment-secret" / "deployment-secret").write_text("secret\n")
    return root


def _on_host(value: str) -> str:
    if value.startswith(SECRETS_MOUNT):
        return str(secrets_standin() / value.removeprefix(SECRETS_MOUNT))
    return value


def parse(args: list[str], env: Mapping[str, str]) -> list[click.Context]:
    """Parse `args` (console script first) with the real click command under exactly `env`; paths under
    /etc/pagedkv/ (the Secret volumes) are read from secrets_standin()."""
    script, rest = args[0], [_on_host(a) for a in args[1:]]
    env = {k: _on_host(v) for k, v in env.items()}
    if script not in console_scripts():
        raise click.UsageError(f"{script!r} is not a console script of pyproject.toml")
    command = load_script(script)
    with mock.patch.dict(os.environ, env, clear=True):
        contexts = [command.make_context(script, rest)]
        while isinstance(command, click.Group):
            protected = getattr(contexts[-1], "_protected_args", None)  # click >= 8.2 keeps the name apart
            left = [*(contexts[-1].protected_args if protected is None else protected), *contexts[-1].args]
            name, sub, left = command.resolve_command(contexts[-1], left)
            assert sub is not None
            command = sub
            contexts.append(command.make_context(name or "", left, parent=contexts[-1]))
    return contexts


def _probes(container: Obj) -> Iterator[tuple[str, list[str]]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = (container.get(kind) or {}).get("exec", {}).get("command")
        if command:
            yield kind, command


def check_cli(objs: list[Obj]) -> list[str]:
    """Every container that runs a pagedkv command parses with the real CLI; each CLI variable in its environment
    is read by an option (ask click: set only it, see which option took it) and no flag overrides it; exec
    probes that run a console script parse too."""
    problems: list[str] = []
    for obj, container in containers(objs):
        args = argv(container)
        if not args or args[0] not in SERVICE_SCRIPTS:
            continue
        who = f"{obj['kind']}/{obj['metadata']['name']}"
        env = resolve_env(container, f"{obj['metadata']['name']}-0")
        try:
            ctx: click.Context | None = parse(args, env)[0]
        except (click.ClickException, click.exceptions.Exit) as exc:
            problems.append(f"{who}: {args!r} is refused: {exc}")
            ctx = None
        for var, value in env.items():
            if not (var.startswith(CLI_ENV_PREFIXES) or var in CLI_ENV_NAMES):
                continue
            try:
                alone = parse([args[0]], {var: value})[0]
            except click.ClickException as exc:
                problems.append(f"{who}: {var}={value!r} is refused by {args[0]}: {exc.format_message()}")
                continue
            options = [
                p.name
                for p in alone.command.params
                if p.name and alone.get_parameter_source(p.name) is ParameterSource.ENVIRONMENT
            ]
            if not options:
                problems.append(f"{who}: {var} is not read by any option of {args[0]}")
            for option in options:
                if ctx is not None and ctx.get_parameter_source(option) is not ParameterSource.ENVIRONMENT:
                    problems.append(f"{who}: {var} is overridden by a flag for {option!r} in the command")
        for kind, probe in _probes(container):
            if probe[0] in console_scripts():
                try:
                    parse(probe, env)
                except (click.ClickException, click.exceptions.Exit) as exc:
                    problems.append(f"{who}: {kind} {probe!r} is refused: {exc}")
    return problems


def test_commands_flags_and_variables_are_real_options(objs: list[Obj]) -> None:
    ran = {argv(c)[0] for _, c in containers(objs) if argv(c)}
    assert {"blockd", "pagedkv-executor", "pagedkv-gateway"} <= ran
    problems = check_cli(objs)
    assert not problems, "\n" + _report(problems)


def _env(objs: list[Obj], container: str) -> list[Obj]:
    return container_of(objs, container)[1].setdefault("env", [])


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (lambda o: _env(o, "gateway").append({"name": "PAGEDKV_GATEWAY_NOPE", "value": "1"}), "not read by any"),
        (lambda o: _env(o, "blockd").append({"name": "BLOCKD_LEASE", "value": "3"}), "BLOCKD_LEASE is not read"),
        (lambda o: _env(o, "gateway").append({"name": "PAGEDKV_GATEWAY_ROUTING", "value": "x"}), "is refused"),
        (lambda o: container_of(o, "executor")[1]["command"].extend(["--pool-id", "a"]), "overridden by a flag"),
        (lambda o: container_of(o, "blockd")[1]["command"].append("--lease-time"), "is refused"),
        (lambda o: container_of(o, "blockd")[1]["readinessProbe"]["exec"]["command"].append("--bad"), "readinessPro"),
    ],
)
def test_the_cli_check_catches_a_broken_manifest(breakage: Any, expected: str) -> None:
    objs = rendered("cpu")
    breakage(objs)
    problems = check_cli(objs)
    assert any(expected in p for p in problems), problems


# ------------------------------------------------------------------------------------------ the topology agrees


def _port(endpoint: str) -> tuple[str, int]:
    match = re.fullmatch(r"tcp://([^:/]+):(\d+)", endpoint)
    assert match, endpoint
    return match[1], int(match[2])


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def _service_port(objs: list[Obj], service: str, name: str) -> int:
    [port] = [p["port"] for p in find(objs, "Service", service)["spec"]["ports"] if p["name"] == name]
    return port


def _container_port(container: Obj, name: str) -> int:
    [port] = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def test_endpoints_ports_and_names_agree(objs: list[Obj]) -> None:
    blockd, blockd_c = container_of(objs, "blockd")
    executors, executor_c = container_of(objs, "executor")
    _, gateway_c = container_of(objs, "gateway")
    blockd_env = resolve_env(blockd_c, "blockd-0")
    executor_env = resolve_env(executor_c, "executor-0")
    gateway_env = resolve_env(gateway_c, "gateway-0")

    # blockd binds every interface on its zmq port; executors and gateways reach it through its Service.
    host, port = _port(_flag(argv(blockd_c), "--endpoint"))
    assert host == "0.0.0.0" and port == _container_port(blockd_c, "zmq") == _service_port(objs, "blockd", "zmq")
    for args in (argv(executor_c), argv(gateway_c)):
        assert _port(_flag(args, "--blockd")) == ("blockd", port)
    metrics_port = int(_flag(argv(blockd_c), "--metrics-port"))
    assert metrics_port == _container_port(blockd_c, "metrics") == _service_port(objs, "blockd", "metrics")
    assert _flag(argv(blockd_c), "--metrics-host") == "0.0.0.0"
    # blockd's Redis is the redis Service, with the password from the Secret redis reads too (as a file).
    redis_url = blockd_env["REDIS_URL"]
    assert redis_url == f"redis://redis:{_service_port(objs, 'redis', 'redis')}/0"
    [redis_password] = [v for v in pod_spec(blockd)["volumes"] if v["name"] == "redis-password"]
    assert redis_password["secret"]["secretName"] == "pagedkv-redis"
    assert redis_password["secret"]["items"] == [{"key": "password", "path": "password"}]
    assert blockd["spec"]["replicas"] == 1 and blockd["spec"]["strategy"] == {"type": "Recreate"}

    # Executors: pool id = pod name (downward API), one DNS name each through the headless Service.
    [pool] = [v for v in executor_c["env"] if v["name"] == "PAGEDKV_EXECUTOR_POOL_ID"]
    assert pool["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert executor_env["PAGEDKV_EXECUTOR_POOL_ID"] == "executor-0"
    host, executor_port = _port(_flag(argv(executor_c), "--bind"))
    assert host == "0.0.0.0" and executor_port == _container_port(executor_c, "zmq")
    service = find(objs, "Service", "executor")
    assert executors["spec"]["serviceName"] == "executor" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert _service_port(objs, "executor", "zmq") == executor_port
    # The gateway lists exactly the StatefulSet's pods.
    expected = [f"tcp://executor-{i}.executor:{executor_port}" for i in range(executors["spec"]["replicas"])]
    assert gateway_env["PAGEDKV_GATEWAY_EXECUTORS"].split(",") == expected

    # The gateway listens on its http port, which its Service and probes use.
    assert _flag(argv(gateway_c), "--host") == "0.0.0.0"
    assert int(_flag(argv(gateway_c), "--port")) == _container_port(gateway_c, "http")
    assert gateway_c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    # Executor and gateway read the same checkpoint from the same read-only volume.
    for container, var in ((executor_c, "PAGEDKV_EXECUTOR_MODEL"), (gateway_c, "PAGEDKV_GATEWAY_MODEL")):
        [mount] = [m for m in container["volumeMounts"] if m["name"] == "model"]
        assert mount["readOnly"] and resolve_env(container, "x-0")[var] == mount["mountPath"]


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_services_pdbs_and_the_hpa_point_at_real_workloads(objs: list[Obj]) -> None:
    pods = {o["metadata"]["name"]: o for o in workloads(objs)}
    for service in (o for o in objs if o["kind"] == "Service"):
        [target] = [
            w
            for w in pods.values()
            if _selects(service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
        ]
        names = {p["name"] for c in pod_spec(target)["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, f"Service/{service['metadata']['name']}: {port}"
    for pdb in (o for o in objs if o["kind"] == "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        targets = [w for w in pods.values() if _selects(selector, w["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, pdb["metadata"]["name"]
        assert targets[0]["spec"]["replicas"] > 1, "a PDB on one replica blocks every drain"
    hpa = find(objs, "HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] in gateway_metric_names()
    assert (
        hpa["spec"]["minReplicas"] >= 2
        and hpa["spec"]["minReplicas"]
        <= find(objs, "Deployment", "gateway")["spec"]["replicas"]
        <= hpa["spec"]["maxReplicas"]
    )


def gateway_metric_names() -> set[str]:
    """What the gateway's /metrics exposes (the HPA's metric must be one of them), from its own metrics class."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.metrics import GatewayMetrics

    text = generate_latest(GatewayMetrics([], lambda: 0).registry).decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def test_service_monitors_scrape_real_ports(objs: list[Obj]) -> None:
    services = [o for o in objs if o["kind"] == "Service"]
    monitors = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"blockd", "gateway"}
    for monitor in monitors:
        assert set(monitor["spec"]) == {"selector", "endpoints"}
        [service] = [
            s for s in services if _selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval"}, endpoint
            assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
            assert endpoint["path"] == "/metrics"
            assert re.fullmatch(r"\d+s", endpoint["interval"])


def test_executors_get_one_gpu_each_only_in_the_gpu_overlay(objs: list[Obj], overlay: str) -> None:
    _, executor_c = container_of(objs, "executor")
    env = resolve_env(executor_c, "executor-0")
    resources = executor_c["resources"]
    if overlay.startswith("gpu"):  # one GPU per rank of each executor's tensor-parallel group
        assert env["PAGEDKV_EXECUTOR_DEVICE"] == "cuda"
        ranks = int(env.get("PAGEDKV_EXECUTOR_TENSOR_PARALLEL_SIZE", "1"))
        assert resources["limits"]["nvidia.com/gpu"] == ranks == resources["requests"]["nvidia.com/gpu"]
        assert ranks == 1 or any(m["mountPath"] == "/dev/shm" for m in executor_c["volumeMounts"])  # for NCCL
    else:
        assert env["PAGEDKV_EXECUTOR_DEVICE"] == "cpu"
        assert "nvidia.com/gpu" not in yaml.safe_dump(objs)
    for obj, container in containers(objs):
        who = f"{obj['metadata']['name']}/{container['name']}"
        for key in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][key]), who
        assert container.get("readinessProbe") and container.get("livenessProbe"), who
    for obj in workloads(objs):
        # Service links would put BLOCKD_PORT, BLOCKD_SERVICE_HOST, ... where blockd's own variables live.
        assert pod_spec(obj)["enableServiceLinks"] is False, obj["metadata"]["name"]


# ------------------------------------------------------------------------------------------ the shared KV tier

_QUANTITY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def _quantity_bytes(quantity: str) -> int:
    """Bytes of a binary-suffixed Kubernetes quantity such as 512Gi (the only form the claims here use)."""
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", quantity)
    assert match, f"{quantity!r}: write storage sizes as N plus Ki, Mi, Gi or Ti"
    return int(match[1]) * _QUANTITY[match[2]]


def check_shared_kv(objs: list[Obj]) -> list[str]:
    """Where the executors run with the shared KV tier (--shared-kv-dir, as the executor parses its environment),
    the directory is the mount of a ReadWriteMany claim of this render, read-write, with --shared-kv-size set
    alongside (the executor's own check) and within the claim; only executors mount that claim."""
    from executor.main import _shared_size

    problems: list[str] = []
    executor, container = container_of(objs, "executor")
    params = parse(argv(container), resolve_env(container, "executor-0"))[0].params
    try:
        tier_bytes = _shared_size(params["shared_kv_dir"], params["shared_kv_size"])
    except click.ClickException as exc:
        return [f"executor: {exc.format_message()}"]
    if params["shared_kv_dir"] is None:
        return problems
    claims = {
        v["name"]: v["persistentVolumeClaim"] for v in pod_spec(executor)["volumes"] if "persistentVolumeClaim" in v
    }
    mounts = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == params["shared_kv_dir"]]
    if len(mounts) != 1 or mounts[0]["name"] not in claims:
        return [f"executor: --shared-kv-dir {params['shared_kv_dir']} is not the mount of a claim: {mounts}"]
    if mounts[0].get("readOnly") or claims[mounts[0]["name"]].get("readOnly"):
        problems.append("executor: the shared KV claim is mounted read-only")
    name = claims[mounts[0]["name"]]["claimName"]
    found = [o for o in objs if o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == name]
    if not found:
        return [*problems, f"executor: mounts the claim {name!r}, which this render does not make"]
    claim = found[0]["spec"]
    if claim["accessModes"] != ["ReadWriteMany"]:
        problems.append(f"claim {name}: {claim['accessModes']}; every executor pod mounts it: ReadWriteMany")
    if tier_bytes > _quantity_bytes(claim["resources"]["requests"]["storage"]):
        problems.append(
            f"claim {name}: {claim['resources']['requests']['storage']} cannot hold the tier's {tier_bytes}"
        )
    if params["tensor_parallel_size"] != 1:
        problems.append(
            f"executor: tensor-parallel size {params['tensor_parallel_size']}; the executor refuses KV tiers with it"
        )
    for obj in workloads(objs):
        users = [
            v for v in pod_spec(obj).get("volumes", []) if v.get("persistentVolumeClaim", {}).get("claimName") == name
        ]
        if users and obj is not executor:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']} mounts the executors' shared KV claim {name}")
    return problems


def test_the_shared_kv_overlay_mounts_one_rwx_claim_where_the_tier_is(overlay: str, objs: list[Obj]) -> None:
    assert check_shared_kv(objs) == [], _report(check_shared_kv(objs))
    _, container = container_of(objs, "executor")
    params = parse(argv(container), resolve_env(container, "executor-0"))[0].params
    if overlay != SHARED_KV_OVERLAY:  # the others run without it
        assert params["shared_kv_dir"] is None and params["shared_kv_size"] == "0", overlay
        assert "shared-kv" not in yaml.safe_dump(objs), overlay
        return
    assert params["shared_kv_dir"] == Path("/var/lib/pagedkv/shared-kv")
    claim = find(objs, "PersistentVolumeClaim", "shared-kv")["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"]
    # The class is the operator's to set (README): the cluster's default rarely offers ReadWriteMany.
    assert "storageClassName" not in claim
    executor = find(objs, "StatefulSet", "executor")
    # fsGroup's ownership change walks the whole volume on every start unless told to look at its root only.
    assert pod_spec(executor)["securityContext"]["fsGroupChangePolicy"] == "OnRootMismatch"
    # It is gpu and the component, nothing else.
    assert _without_shared_kv(objs) == rendered("gpu")


def _without_shared_kv(objs: list[Obj]) -> list[Obj]:
    out = [
        o for o in copy.deepcopy(objs) if (o["kind"], o["metadata"]["name"]) != ("PersistentVolumeClaim", "shared-kv")
    ]
    spec = pod_spec(find(out, "StatefulSet", "executor"))
    spec["securityContext"].pop("fsGroupChangePolicy")
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "shared-kv"]
    [container] = spec["containers"]
    container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] != "shared-kv"]
    container["env"] = [v for v in container["env"] if not v["name"].startswith("PAGEDKV_EXECUTOR_SHARED_KV_")]
    return out


def test_the_shared_kv_component_adds_to_the_cpu_overlay_too(tmp_path: Path) -> None:
    """A component, so any overlay of single-rank executors takes it: here cpu, in an overlay of the operator's."""
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(K8S / "overlays" / "cpu", tmp_path)],
                "components": [os.path.relpath(SHARED_KV_COMPONENT, tmp_path)],
            }
        )
    )
    done = subprocess.run([kubectl(), "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    objs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert check_shared_kv(objs) == [], _report(check_shared_kv(objs))
    _, container = container_of(objs, "executor")
    assert parse(argv(container), resolve_env(container, "executor-0"))[0].params["shared_kv_dir"] is not None
    assert check_cli(objs) == [], _report(check_cli(objs))


def _shared_kv_env(objs: list[Obj], name: str, value: str) -> None:
    [var] = [v for v in container_of(objs, "executor")[1]["env"] if v["name"] == name]
    var["value"] = value


def _shared_kv_claim(objs: list[Obj]) -> Obj:
    return find(objs, "PersistentVolumeClaim", "shared-kv")["spec"]


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (lambda o: _shared_kv_claim(o).update(accessModes=["ReadWriteOnce"]), "every executor pod mounts it"),
        (lambda o: _shared_kv_claim(o)["resources"]["requests"].update(storage="100Gi"), "cannot hold the tier's"),
        (lambda o: _shared_kv_env(o, "PAGEDKV_EXECUTOR_SHARED_KV_DIR", "/tmp/kv"), "is not the mount of a claim"),
        (lambda o: _shared_kv_env(o, "PAGEDKV_EXECUTOR_SHARED_KV_SIZE", "0"), "go together"),
        (
            lambda o: container_of(o, "executor")[1]["env"].append(
                {"name": "PAGEDKV_EXECUTOR_TENSOR_PARALLEL_SIZE", "value": "4"}
            ),
            "refuses KV tiers",
        ),
        (
            lambda o: pod_spec(find(o, "Deployment", "gateway"))["volumes"].append(
                {"name": "kv", "persistentVolumeClaim": {"claimName": "shared-kv"}}
            ),
            "Deployment/gateway mounts the executors' shared KV claim",
        ),
    ],
)
def test_the_shared_kv_check_catches_a_broken_manifest(breakage: Any, expected: str) -> None:
    objs = rendered(SHARED_KV_OVERLAY)
    breakage(objs)
    problems = check_shared_kv(objs)
    assert any(expected in p for p in problems), problems


def test_the_readme_explains_the_shared_kv_tier_and_its_overlay_renders(tmp_path: Path) -> None:
    """The README's overlay (the storage class and both sizes set) renders where the README puts it, and the
    tier still checks out."""
    readme = README.read_text()
    for needed in ("components/shared-kv", "overlays/gpu-shared-kv", "ReadWriteMany", "storageClassName"):
        assert needed in readme, f"README.md does not say {needed}"
    [example] = [b for b in re.findall(r"```yaml\n(.*?)```", readme, re.S) if "../gpu-shared-kv" in b]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(
        example.replace("../gpu-shared-kv", os.path.relpath(K8S / "overlays" / SHARED_KV_OVERLAY, mine))
    )
    done = subprocess.run([kubectl(), "kustomize", str(mine)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    objs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert check_shared_kv(objs) == [], _report(check_shared_kv(objs))
    claim = find(objs, "PersistentVolumeClaim", "shared-kv")["spec"]
    assert claim["storageClassName"] and claim["resources"]["requests"]["storage"] == "2Ti"
    _, container = container_of(objs, "executor")
    assert resolve_env(container, "executor-0")["PAGEDKV_EXECUTOR_SHARED_KV_SIZE"] == "1900GiB"


# ------------------------------------------------------------------------------------------ network policies


def _labels_of(objs: list[Obj]) -> dict[str, dict[str, str]]:
    return {w["metadata"]["name"]: w["spec"]["template"]["metadata"]["labels"] for w in workloads(objs)}


def allowed_sources(objs: list[Obj], target: str, port: int) -> set[str]:
    """Who may open `port` of `target`'s pods: workload names in the namespace, 'namespace:NAME' for another
    namespace, '*' for anyone. NetworkPolicies are additive: a pod selected by any policy takes only what some
    policy allows."""
    labels = _labels_of(objs)
    target_pod = find(objs, "StatefulSet" if target in ("redis", "executor") else "Deployment", target)
    ports = {p["name"]: p["containerPort"] for c in pod_spec(target_pod)["containers"] for p in c.get("ports", [])}
    policies = [
        o
        for o in objs
        if o["kind"] == "NetworkPolicy" and _selects(o["spec"]["podSelector"].get("matchLabels", {}), labels[target])
    ]
    assert policies, f"no NetworkPolicy selects {target}: everyone may reach it"
    sources: set[str] = set()
    for policy in policies:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"].get("ingress", []):
            rule_ports = {ports.get(p["port"], p["port"]) for p in rule.get("ports", [])}
            if rule_ports and port not in rule_ports:
                continue
            if "from" not in rule:
                sources.add("*")
            for peer in rule.get("from", []):
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    selector = peer["podSelector"].get("matchLabels", {})
                    sources |= {name for name, pod in labels.items() if _selects(selector, pod)}
                elif set(peer) == {"namespaceSelector"}:
                    sources.add("namespace:" + peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])
                else:
                    raise AssertionError(f"a peer this test does not model: {peer}")
    return sources


def test_network_policies_let_in_only_the_intended_peers(objs: list[Obj]) -> None:
    deny = find(objs, "NetworkPolicy", "default-deny-ingress")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    assert allowed_sources(objs, "gateway", 8000) == {"*"}
    assert allowed_sources(objs, "executor", 5560) == {"gateway"}
    assert allowed_sources(objs, "blockd", 5557) == {"executor", "gateway"}
    assert allowed_sources(objs, "blockd", 9100) == {"namespace:monitoring"}
    assert allowed_sources(objs, "redis", 6379) == {"blockd"}
    for target, port in (("blockd", 6379), ("redis", 5557), ("executor", 8000)):
        assert allowed_sources(objs, target, port) == set()
    # Only the gateway's Service is meant for the outside; none is a NodePort or LoadBalancer here.
    for service in (o for o in objs if o["kind"] == "Service"):
        assert service["spec"].get("type", "ClusterIP") == "ClusterIP"


# ------------------------------------------------------------------------------------------ secrets and probes


def test_every_secret_is_documented_with_how_to_make_it(objs: list[Obj]) -> None:
    readme = README.read_text()
    referenced: dict[str, bool] = {}  # name -> optional
    for obj in workloads(objs):
        spec = pod_spec(obj)
        for container in spec["containers"]:
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    referenced[ref["name"]] = referenced.get(ref["name"], True) and bool(ref.get("optional"))
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                name = volume["secret"]["secretName"]
                referenced[name] = referenced.get(name, True) and bool(volume["secret"].get("optional"))
    assert referenced.keys() >= {"pagedkv-redis", "pagedkv-gateway-api-keys"}
    assert referenced["pagedkv-redis"] is False  # Redis never runs without its password
    for name in referenced:
        assert re.search(rf"kubectl .*create secret generic {re.escape(name)}\b", readme), name
    for path in ("/etc/pagedkv/keys", "/etc/pagedkv/api-keys"):
        assert path in readme


def _mounts(obj: Obj, container: Obj) -> dict[str, tuple[str, bool]]:
    """mount path -> (Secret name, optional) of the container's Secret volumes."""
    volumes = {v["name"]: v["secret"] for v in pod_spec(obj).get("volumes", []) if "secret" in v}
    return {
        m["mountPath"]: (volumes[m["name"]]["secretName"], bool(volumes[m["name"]].get("optional")))
        for m in container.get("volumeMounts", [])
        if m["name"] in volumes
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_runs_with_keys_from_secrets(overlay: str) -> None:
    """CURVE keys in every pagedkv container (PAGEDKV_KEYS at its non-optional Secret), API keys at the gateway,
    blockd's deployment secret and Redis password from files, nothing --insecure."""
    objs = rendered(overlay)
    expected = {"blockd": "pagedkv-blockd-keys", "executor": "pagedkv-executor-keys", "gateway": "pagedkv-gateway-keys"}
    params = {}
    for component, secret in expected.items():
        obj, container = container_of(objs, component)
        mounts = _mounts(obj, container)
        assert mounts["/etc/pagedkv/keys"] == (secret, False), component
        env = resolve_env(container, f"{component}-0")
        assert env["PAGEDKV_KEYS"] == "/etc/pagedkv/keys", component
        assert "--insecure" not in argv(container) and "PAGEDKV_INSECURE" not in env, component
        params[component] = parse(argv(container), env)[0].params
        assert params[component]["keys_dir"] == secrets_standin() / "keys", component
        for _, probe in _probes(container):
            assert "PAGEDKV_KEYS" in probe[-1] or "/etc/pagedkv/keys" in probe, f"{component}: {probe} has no keys"
    gateway, gateway_c = container_of(objs, "gateway")
    assert _mounts(gateway, gateway_c)["/etc/pagedkv/api-keys"] == ("pagedkv-gateway-api-keys", False)
    assert params["gateway"]["api_key_files"] == (secrets_standin() / "api-keys" / "api-keys",)
    blockd, blockd_c = container_of(objs, "blockd")
    mounts = _mounts(blockd, blockd_c)
    assert mounts["/etc/pagedkv/redis"] == ("pagedkv-redis", False)
    assert mounts["/etc/pagedkv/deployment-secret"] == ("pagedkv-deployment-secret", False)
    assert params["blockd"]["redis_password_file"] == secrets_standin() / "redis" / "password"
    assert params["blockd"]["deployment_secret_file"] == secrets_standin() / "deployment-secret" / "deployment-secret"


def _fake_executor() -> tuple[zmq.Socket, int]:
    socket = zmq.Context.instance().socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    return socket, socket.bind_to_random_port("tcp://127.0.0.1")


def test_the_executor_readiness_probe_asks_the_executor_its_load(tmp_path: Path) -> None:
    """The probe's own code, run as the kubelet runs it (python -c), against a ROUTER that answers as an
    executor does: exit 0 once it got a load report, non-zero when nothing answers."""
    _, executor_c = container_of(rendered("gpu"), "executor")
    command = executor_c["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["python", "-c"]
    bind_port = _port(_flag(argv(executor_c), "--bind"))[1]
    assert f"'tcp://127.0.0.1:{bind_port}'" in command[2]
    socket, port = _fake_executor()
    try:
        code = command[2].replace(f":{bind_port}'", f":{port}'")
        probe = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert socket.poll(30_000), "the probe sent nothing"
        identity, frame = socket.recv_multipart()
        assert isinstance(ep.decode_inbound(frame), ep.GetLoad)
        load = ep.LoadReport(
            pool_id="executor-0", running=0, waiting=0, free_blocks=8, num_blocks=8, kv_utilization=0.0,
            preemptions=0, steps=0,
        )  # fmt: skip
        socket.send_multipart([identity, ep.encode(load)])
        assert probe.wait(timeout=30) == 0
    finally:
        socket.close()
    silent = textwrap.dedent(code).replace("timeout_s=5", "timeout_s=0.5")
    assert subprocess.run([sys.executable, "-c", silent], cwd=ROOT, capture_output=True, timeout=60).returncode != 0


def test_the_executor_readiness_probe_uses_the_operator_key(tmp_path: Path) -> None:
    """With PAGEDKV_KEYS (as the executor pods have it) the probe connects with the operator key and gets its load
    report from a CURVE-only socket that admits gateway and operator keys, as the executor's does; without keys
    it never completes the handshake and fails."""
    _, executor_c = container_of(rendered("gpu"), "executor")
    code = executor_c["readinessProbe"]["exec"]["command"][2]
    keys = tmp_path / "keys"
    generate(keys)
    context = zmq.Context()
    auth = ServerAuth(context, KeySet(keys), (Role.GATEWAY, Role.OPERATOR))
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    auth.secure(socket)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    code = code.replace(":5560'", f":{port}'")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("PAGEDKV_KEYS", None)
    try:
        probe = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**env, "PAGEDKV_KEYS": str(keys)})
        assert socket.poll(30_000), "the probe sent nothing"
        identity, frame = socket.recv_multipart(copy=False)
        assert auth.principal(frame) is not None and auth.principal(frame).role is Role.OPERATOR
        assert isinstance(ep.decode_inbound(frame.bytes), ep.GetLoad)
        load = ep.LoadReport(
            pool_id="executor-0", running=0, waiting=0, free_blocks=8, num_blocks=8, kv_utilization=0.0,
            preemptions=0, steps=0,
        )  # fmt: skip
        socket.send_multipart([identity.bytes, ep.encode(load)])
        assert probe.wait(timeout=30) == 0
        unkeyed = subprocess.run(
            [sys.executable, "-c", code.replace("timeout_s=5", "timeout_s=0.5")],
            cwd=ROOT, env=env, capture_output=True, timeout=60,
        )  # fmt: skip
        assert unkeyed.returncode != 0
        assert not socket.poll(100), "a client without keys got a request through"
    finally:
        socket.close()
        auth.stop()
        context.term()
