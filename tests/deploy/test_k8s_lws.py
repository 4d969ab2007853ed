"""deploy/k8s/overlays/gpu-lws: executors as LeaderWorkerSet groups whose ranks span nodes, rendered and checked
with the same tools as the other overlays (tests/deploy/test_k8s.py), without a cluster.

kubernetes-validate has no schema for the LeaderWorkerSet custom resource (and cannot fetch its CRD offline), so
the object's own fields are checked here against the leaderworkerset.x-k8s.io/v1 API (the field names and enums
of its Go types), and its two pod templates, which are core Kubernetes, are validated strictly by
kubernetes-validate as v1 PodTemplates and scanned by checkov as Pods. Then every rank's command and environment,
with the variables the LeaderWorkerSet controller adds, is parsed by the real pagedkv-executor and placed in its
group as the executor would place it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from executor.parallel_rendezvous import DEFAULT_PORT, Placement, placement
from tests.deploy.test_k8s import (
    CUSTOM_RESOURCES,
    NAMESPACE,
    _mounts,
    _report,
    _validate,
    allowed_sources,
    argv,
    check_cli,
    find,
    parse,
    resolve_env,
    secrets_standin,
    tool,
)
from tests.deploy.test_k8s import (
    _render as render_overlay,
)

OVERLAY = "gpu-lws"
LWS = ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
# The fields of leaderworkerset.x-k8s.io/v1 (api/leaderworkerset/v1/leaderworkerset_types.go of the
# LeaderWorkerSet project): what a manifest may set, and the enums' values.
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {
    "leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy", "volumeClaimTemplates",
    "persistentVolumeClaimRetentionPolicy",
}  # fmt: skip
LWS_ROLLOUT = {"type", "rollingUpdateConfiguration"}
LWS_ROLLING = {"partition", "maxUnavailable", "maxSurge"}
LWS_ENUMS = {
    "startupPolicy": {"LeaderCreated", "LeaderReady"},
    "restartPolicy": {"Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"},
    "rolloutStrategy.type": {"RollingUpdate"},
    "subdomainPolicy": {"Shared", "UniquePerReplica"},
}
Obj = dict[str, Any]


def objects() -> list[Obj]:
    return [dict(o) for o in render_overlay(OVERLAY)[1]]


def lws(objs: list[Obj]) -> Obj:
    [found] = [o for o in objs if (o["apiVersion"], o["kind"]) == LWS]
    return found


def templates(objs: list[Obj]) -> dict[str, Obj]:
    spec = lws(objs)["spec"]["leaderWorkerTemplate"]
    return {"leader": spec["leaderTemplate"], "worker": spec["workerTemplate"]}


def as_workloads(objs: list[Obj]) -> list[Obj]:
    """The rendered objects with the LeaderWorkerSet standing as the workloads the shared checks know: the leaders
    as StatefulSet `executor` (its pods are executor-N), the workers as StatefulSet `executor-worker`."""
    group = lws(objs)
    rest = [o for o in objs if o is not group]
    for role, template in templates(objs).items():
        name = "executor" if role == "leader" else "executor-worker"
        replicas = group["spec"]["replicas"] * (
            1 if role == "leader" else group["spec"]["leaderWorkerTemplate"]["size"] - 1
        )
        rest.append(
            {
                "apiVersion": "apps/v1",
                "kind": "StatefulSet",
                "metadata": {"name": name, "namespace": NAMESPACE, "labels": group["metadata"]["labels"]},
                "spec": {"replicas": replicas, "serviceName": "executor", "template": template},
            }
        )
    return rest


def lws_environment(obj: Obj, leader: int, rank: int) -> dict[str, str]:
    """What the LeaderWorkerSet controller adds to every container of group `leader`'s rank `rank`."""
    name = obj["metadata"]["name"]
    return {
        "LWS_LEADER_ADDRESS": f"{name}-{leader}.{name}.{NAMESPACE}",
        "LWS_GROUP_SIZE": str(obj["spec"]["leaderWorkerTemplate"]["size"]),
        "LWS_WORKER_INDEX": str(rank),
    }


def test_the_overlay_runs_groups_in_place_of_the_executor_statefulset() -> None:
    objs = objects()
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert ("StatefulSet", "executor") not in kinds and ("LeaderWorkerSet", "executor") in kinds
    for expected in [
        ("Deployment", "blockd"), ("Deployment", "gateway"), ("StatefulSet", "redis"), ("Service", "executor"),
        ("NetworkPolicy", "executor-group"), ("NetworkPolicy", "executor"),
    ]:  # fmt: skip
        assert expected in kinds, expected
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == NAMESPACE, f"{o['kind']}/{o['metadata']['name']}"
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "pagedkv"
    for role, template in templates(objs).items():
        labels = template["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == "executor" and labels["pagedkv/tp-role"] == role
        assert labels["app.kubernetes.io/part-of"] == "pagedkv"
        [container] = template["spec"]["containers"]
        assert re.fullmatch(r"pagedkv:\S+", container["image"]), container["image"]  # the images transformer reached it


def test_the_leaderworkerset_has_only_fields_of_its_v1_api() -> None:
    group = lws(objects())
    spec = group["spec"]
    assert set(spec) <= LWS_SPEC, set(spec) - LWS_SPEC
    template = spec["leaderWorkerTemplate"]
    assert set(template) <= LWS_TEMPLATE, set(template) - LWS_TEMPLATE
    assert set(spec["rolloutStrategy"]) <= LWS_ROLLOUT
    assert set(spec["rolloutStrategy"]["rollingUpdateConfiguration"]) <= LWS_ROLLING
    assert set(spec["networkConfig"]) == {"subdomainPolicy"}
    assert spec["startupPolicy"] in LWS_ENUMS["startupPolicy"]
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once its workers joined
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"  # the group stops as a unit: recreate it whole
    assert spec["rolloutStrategy"]["type"] in LWS_ENUMS["rolloutStrategy.type"]
    assert spec["networkConfig"]["subdomainPolicy"] == "Shared"
    assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
    assert isinstance(template["size"], int) and template["size"] >= 2  # a group of one is the gpu overlay
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        assert set(pod) == {"metadata", "spec"}


def _builtin(objs: list[Obj]) -> list[Obj]:
    """The core objects, with each LeaderWorkerSet pod template as a v1 PodTemplate (which has a schema)."""
    out = [o for o in objs if (o["apiVersion"], o["kind"]) not in {*CUSTOM_RESOURCES, LWS}]
    for role, template in templates(objs).items():
        out.append(
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": f"executor-{role}", "namespace": NAMESPACE},
                "template": template,
            }
        )
    return out


def test_every_object_and_both_pod_templates_validate(tmp_path: Path) -> None:
    builtin = _builtin(objects())
    done = _validate(builtin, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    passed = re.findall(r"passed for resource (\S+) against version", out)
    assert sorted(passed) == sorted(f"{o['kind'].lower()}/{o['metadata']['name']}" for o in builtin), out
    # Strict: a misspelt field in a template fails.
    broken = _builtin(objects())
    [worker] = [o for o in broken if o["metadata"]["name"] == "executor-worker"]
    worker["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"
    done = _validate(broken, tmp_path)
    assert done.returncode != 0 and "'imagePullPolice' was unexpected" in done.stdout + done.stderr


def test_checkov_finds_nothing_unjustified_in_the_group_pods(tmp_path: Path) -> None:
    objs = objects()
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"executor-{role}", "namespace": NAMESPACE, **template["metadata"]},
            "spec": template["spec"],
        }
        for role, template in templates(objs).items()
    ]
    rest = [o for o in objs if (o["apiVersion"], o["kind"]) != LWS]
    (tmp_path / "lws.yaml").write_text(yaml.safe_dump_all([*rest, *pods], sort_keys=False))
    done = subprocess.run(
        [tool("checkov"), "--directory", str(tmp_path), "--framework", "kubernetes", "--output", "json",
         "--skip-download"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "BC_API_KEY": "", "PRISMA_API_URL": ""},
    )  # fmt: skip
    report = json.loads(done.stdout)
    summary, results = report["summary"], report["results"]
    assert summary["parsing_errors"] == 0 and summary["passed"] > 100, summary
    scanned = {c["resource"] for c in results.get("passed_checks", [])}
    assert {"Pod.pagedkv.executor-leader", "Pod.pagedkv.executor-worker"} <= scanned, sorted(scanned)
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']}" for c in results.get("failed_checks", [])]
    assert not failed, "checkov failures (fix, or skip with a reason):\n" + _report(failed)
    for skipped in results.get("skipped_checks", []):
        reason = skipped["check_result"].get("suppress_comment") or ""
        assert len(reason) > 30, f"{skipped['check_id']} on {skipped['resource']} is skipped without a reason"


def test_each_rank_parses_and_is_placed_in_its_group() -> None:
    objs = objects()
    group = lws(objs)
    size = group["spec"]["leaderWorkerTemplate"]["size"]
    problems = check_cli(as_workloads(objs))
    assert not problems, "\n" + _report(problems)
    service = find(objs, "Service", "executor")
    assert service["metadata"]["name"] == group["metadata"]["name"]  # the Shared subdomain: the leaders' DNS names
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"zmq": 5560, "tp-join": DEFAULT_PORT}
    for role, template in templates(objs).items():
        [container] = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["tp-join"] == DEFAULT_PORT
        assert (
            container["resources"]["requests"]["nvidia.com/gpu"]
            == 1
            == container["resources"]["limits"]["nvidia.com/gpu"]
        )
        assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
        assert _mounts({"spec": {"template": template}}, container)["/etc/pagedkv/keys"] == (
            "pagedkv-executor-keys",
            False,
        )
        for rank in [0] if role == "leader" else range(1, size):
            pod = "executor-1" if role == "leader" else f"executor-1-{rank}"
            env = {**resolve_env(container, pod), **lws_environment(group, 1, rank)}
            assert "--insecure" not in argv(container) and "PAGEDKV_INSECURE" not in env
            params = parse(argv(container), env)[0].params
            assert params["keys_dir"] == secrets_standin() / "keys"
            assert params["device_spec"] == "cuda"
            where = placement(params["tensor_parallel_size"], params["tp_rank"], params["tp_master"], env)
            assert where == Placement(size, rank, f"executor-1.executor.{NAMESPACE}:{DEFAULT_PORT}"), role
    # The gateway reaches the leaders only, by the names the StatefulSet's pods had.
    gateway = find(objs, "Deployment", "gateway")
    env = resolve_env(gateway["spec"]["template"]["spec"]["containers"][0], "gateway-0")
    expected = [f"tcp://executor-{i}.executor:5560" for i in range(group["spec"]["replicas"])]
    assert env["PAGEDKV_GATEWAY_EXECUTORS"].split(",") == expected


def test_ranks_reach_each_other_and_the_gateways_only_the_leaders_port() -> None:
    objs = as_workloads(objects())
    ranks = {"executor", "executor-worker"}
    assert allowed_sources(objs, "executor", 5560) == {"gateway", *ranks}
    assert allowed_sources(objs, "executor", DEFAULT_PORT) == ranks  # the join: ranks only
    assert allowed_sources(objs, "executor", 40123) == ranks  # the store and the collectives' own ports
    assert allowed_sources(objs, "blockd", 5557) == {"gateway", *ranks}
    assert allowed_sources(objs, "redis", 6379) == {"blockd"}
