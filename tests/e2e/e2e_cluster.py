"""Operator scenarios on a real cluster (see README.md here); run explicitly, never in CI."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.waiting import wait_until

pytestmark = pytest.mark.system  # never collected by bin/test (no test_ prefix); run by path

ROOT = Path(__file__).resolve().parents[2]
NS = "flatcake-e2e"
CACHE = "e2e"
IMAGE = os.environ.get("FLATCAKE_IMAGE", "flatcake:dev")


def kubectl(*args: str, input: str | None = None, check: bool = True) -> str:
    out = subprocess.run(["kubectl", *args], input=input, capture_output=True, text=True, timeout=300)
    if check and out.returncode:
        raise AssertionError(f"kubectl {' '.join(args)}: {out.stderr}")
    return out.stdout


def get(kind: str, name: str) -> dict[str, Any] | None:
    out = subprocess.run(["kubectl", "-n", NS, "get", kind, name, "-o", "json"], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else None


def wait(check: Callable[[], Any], what: str, timeout: float = 300) -> Any:
    return wait_until(check, what=what, timeout=timeout, poll=2.0)  # each check runs kubectl: poll gently


def apply_cache(spec: dict[str, Any]) -> None:
    body = {
        "apiVersion": "flatcake.io/v1alpha1",
        "kind": "FlatCakeCache",
        "metadata": {"name": CACHE, "namespace": NS},
        "spec": spec,
    }
    kubectl("apply", "-f", "-", input=json.dumps(body))


def condition(ctype: str) -> dict[str, Any]:
    obj = get("flatcakecache", CACHE) or {}
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == ctype), {})


def base_spec() -> dict[str, Any]:
    devices = [d for d in os.environ.get("FLATCAKE_E2E_DEVICES", "").split(",") if d]
    ssd: dict[str, Any] = {"devices": devices} if devices else {"directory": "/var/tmp/flatcake-e2e"}
    ssd |= {"fileSize": "64Mi", "fileCount": 4}
    return {
        "image": IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "nodeSelector": {"flatcake.io/node": "true"},
        "kv": {"layers": 43, "pageBytes": 12288},
        "dram": {"size": "64Mi", "hugepageSize": "none"},
        "ssd": ssd,
        "reclaimPolicy": "Delete",
    }


@pytest.fixture(scope="module", autouse=True)
def installed() -> Iterator[None]:
    node = os.environ.get("FLATCAKE_E2E_NODE") or kubectl("get", "nodes", "-o", "jsonpath={.items[0].metadata.name}")
    kubectl("label", "node", node, "flatcake.io/node=true", "--overwrite")
    repo, _, tag = IMAGE.rpartition(":")
    subprocess.run(
        [
            "helm",
            "upgrade",
            "--install",
            "fc",
            str(ROOT / "charts/flatcake"),
            "-n",
            NS,
            "--create-namespace",
            "--set",
            f"image.repository={repo}",
            "--set",
            f"image.tag={tag}",
            "--set",
            "image.pullPolicy=IfNotPresent",
            "--set",
            f"operator.watchNamespaces={{{NS}}}",
            "--wait",
        ],
        check=True,
        timeout=600,
    )
    yield
    kubectl("-n", NS, "delete", "flatcakecache", "--all", "--timeout=300s", check=False)
    subprocess.run(["helm", "uninstall", "fc", "-n", NS], check=False)
    kubectl("delete", "namespace", NS, "--wait=false", check=False)
    kubectl("label", "node", node, "flatcake.io/node-", check=False)


def test_create_deploys_agents_that_report_ready() -> None:
    apply_cache(base_spec())
    wait(lambda: get("daemonset", f"{CACHE}-agent"), "the DaemonSet")
    assert get("configmap", f"{CACHE}-config") and get("service", f"{CACHE}-metrics")
    wait(lambda: condition("Ready").get("status") == "True", "Ready", timeout=600)
    nodes = json.loads(kubectl("-n", NS, "get", "flatcakenodes", "-o", "json"))["items"]
    assert nodes and all(n["status"]["ready"] for n in nodes)


def test_spec_update_rolls_the_daemonset() -> None:
    before = get("daemonset", f"{CACHE}-agent")["spec"]["template"]["metadata"]["annotations"]
    apply_cache(base_spec() | {"io": {"gapBytes": 262144}})
    wait(lambda: get("daemonset", f"{CACHE}-agent")["spec"]["template"]["metadata"]["annotations"] != before, "a roll")
    kubectl("-n", NS, "rollout", "status", f"daemonset/{CACHE}-agent", "--timeout=300s")


def test_invalid_spec_is_degraded() -> None:
    apply_cache(base_spec() | {"dram": {"size": "64Ti", "hugepageSize": "2Mi"}})
    cond = wait(lambda: condition("Degraded").get("status") == "True" and condition("Degraded"), "Degraded")
    assert "spec.dram.size" in cond["message"]
    apply_cache(base_spec())
    wait(lambda: condition("Degraded").get("status") == "False", "recovery")


def test_destructive_change_is_refused() -> None:
    spec = base_spec()
    spec["ssd"] = spec["ssd"] | {"fileCount": 2}
    apply_cache(spec)
    cond = wait(lambda: condition("Degraded").get("status") == "True" and condition("Degraded"), "refusal")
    assert "spec.ssd.fileCount" in cond["message"] and "wipePolicy" in cond["message"]
    apply_cache(base_spec())
    wait(lambda: condition("Degraded").get("status") == "False", "recovery")


def test_operator_restart_changes_nothing() -> None:
    ds = get("daemonset", f"{CACHE}-agent")
    ids = get("configmap", f"{CACHE}-node-ids")["data"]
    kubectl("-n", NS, "rollout", "restart", "deployment/fc-flatcake-operator")
    kubectl("-n", NS, "rollout", "status", "deployment/fc-flatcake-operator", "--timeout=300s")
    # The new operator has looked at the existing cache (kopf logs its resume handler's outcome) before
    # "nothing changed" is checked. Only a restarted operator resumes: the first one saw a creation.
    wait(lambda: "Resuming is processed" in kubectl("-n", NS, "logs", "deployment/fc-flatcake-operator", check=False),
         "the restarted operator to resume the cache")  # fmt: skip
    after = get("daemonset", f"{CACHE}-agent")
    assert after["metadata"]["uid"] == ds["metadata"]["uid"]
    assert after["metadata"]["generation"] == ds["metadata"]["generation"]
    assert get("configmap", f"{CACHE}-node-ids")["data"] == ids


def test_delete_runs_the_reclaim_finalizer() -> None:
    kubectl("-n", NS, "delete", "flatcakecache", CACHE, "--wait=false")
    wait(lambda: get("daemonset", f"{CACHE}-reclaim"), "the reclaim DaemonSet", timeout=120)
    wait(lambda: get("flatcakecache", CACHE) is None, "the cache to go", timeout=600)
    assert get("configmap", f"{CACHE}-node-ids") is None
