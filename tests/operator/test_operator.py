"""The real kopf operator (flatcake.operator.handlers) against an in-memory API server (kmock plus the
admission and metadata emulation of tests/support/kube_api.py; what is emulated is listed there)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import kopf
import pytest
import pytest_asyncio
import yaml

from flatcake import kube as K
from flatcake.node_agent.config import ClusterConfig, EngineConfig
from flatcake.operator import handlers, render
from tests.support.engines import small_config
from tests.support.kube_api import ApiServer, declare_resources
from tests.support.waiting import async_wait_until

NS = "kv"
CACHE = "main"
pytestmark = [pytest.mark.system, pytest.mark.asyncio, pytest.mark.kmock(cls=ApiServer)]
_server: dict[str, str] = {}


@kopf.on.login()
def _login(**_: Any) -> kopf.ConnectionInfo:
    """Tests log kopf in to the test API server (kmock serves plain HTTP on loopback)."""
    return kopf.ConnectionInfo(server=_server["url"], insecure=True)


def cache_body(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "nodeSelector": {"flatcake.io/node": "true"},
        "dram": {"size": "256Mi", "hugepageSize": "2Mi"},
        "ssd": {"devices": ["/dev/nvme0n1", "/dev/nvme1n1"], "fileSize": "1Gi", "fileCount": 8},
        "kv": {"layers": 43, "pageBytes": 12288},
    }
    base.update(spec)
    return {
        "apiVersion": "flatcake.io/v1alpha1",
        "kind": "FlatCakeCache",
        "metadata": {"name": CACHE, "namespace": NS},
        "spec": base,
    }


def node(name: str, hugepages: str = "1Gi", selected: bool = True) -> dict[str, Any]:
    labels = {"flatcake.io/node": "true"} if selected else {}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"allocatable": {"hugepages-2Mi": hugepages, "memory": "64Gi"}},
    }


class Cluster:
    """The test's view of the API server: HTTP calls as kubectl would make them, and polling."""

    def __init__(self, api: kmock.KubernetesEmulator) -> None:
        self.api = api
        self.url = str(api.url).rstrip("/")

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        headers = {"Content-Type": "application/merge-patch+json" if method == "PATCH" else "application/json"}
        async with aiohttp.ClientSession() as s, s.request(method, self.url + path, json=body, headers=headers) as r:
            return r.status, await r.json(content_type=None)

    async def create(self, res: K.Resource, body: dict[str, Any]) -> dict[str, Any]:
        status, obj = await self.call("POST", res.path(body["metadata"].get("namespace")), body)
        assert status < 300, obj
        return obj

    async def get(self, res: K.Resource, name: str, namespace: str | None = NS) -> dict[str, Any] | None:
        status, obj = await self.call("GET", res.path(namespace, name))
        return obj if status == 200 else None

    async def patch(self, res: K.Resource, name: str, body: dict[str, Any], namespace: str | None = NS) -> Any:
        status, obj = await self.call("PATCH", res.path(namespace, name), body)
        assert status < 300, obj
        return obj

    async def wait(self, check: Callable[[], Any], what: str) -> Any:
        # kmock serves from this loop, so the wait polls with asyncio.sleep, never time.sleep.
        return await async_wait_until(check, what=what, poll=0.1)

    async def cache_status(self) -> dict[str, Any]:
        obj = await self.get(K.CACHES, CACHE)
        return (obj or {}).get("status", {})

    async def condition(self, ctype: str) -> dict[str, Any]:
        return next((c for c in (await self.cache_status()).get("conditions", []) if c["type"] == ctype), {})

    def requests(self, method: str, plural: str) -> int:
        return sum(
            1
            for r in list(self.api)
            if str(r.method).upper().endswith(method) and r.resource is not None and r.resource.plural == plural
        )

    async def report(
        self, node_name: str, *, ready: bool = True, ssd_used: int = 0, error: str = "", device_bytes: int = 1 << 40
    ) -> None:
        """What the node's agent does: node_agent/node/identity.py's reporter, with its own (blocking)
        client, run in a thread as in the agent."""
        from flatcake.node_agent.node import identity as R

        cm = await self.get(K.CONFIG_MAPS, f"{CACHE}-config")
        assert cm is not None
        config = EngineConfig.from_dict(json.loads(cm["data"]["engine.json"]))
        ids = (await self.get(K.CONFIG_MAPS, f"{CACHE}-node-ids") or {}).get("data", {})
        usage = {
            "dram": {"capacity_bytes": config.dram.bytes, "used_bytes": 0},
            "ssd": {"capacity_bytes": config.ssd.file_bytes * config.ssd.file_count, "used_bytes": ssd_used},
        }
        reporter = R.NodeReporter(
            config,
            node_name,
            int(ids[node_name]),
            lambda: usage,
            lambda: ready,
            K.Kube.for_url(self.url, R.USER_AGENT),
            filesystem_bytes=lambda: device_bytes,
        )
        reporter.last_error = error
        await asyncio.to_thread(reporter.report_once)


@contextlib.asynccontextmanager
async def running_operator(api: kmock.KubernetesEmulator, webhook_port: int | None = None) -> AsyncIterator[None]:
    _server["url"] = str(api.url).rstrip("/")
    settings = kopf.OperatorSettings()
    if webhook_port is not None:  # plain HTTP here; the chart gives the operator a certificate
        settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", port=webhook_port, insecure=True)
    settings.scanning.disabled = True  # kmock answers namespace scans with 500
    settings.posting.level = 30  # events at WARNING and above only
    memo = kopf.Memo(kube=K.Kube.for_url(_server["url"], handlers.USER_AGENT), agent_cluster_role="flatcake-agent")
    stop = asyncio.Event()
    task = asyncio.create_task(
        kopf.operator(settings=settings, namespaces=[NS], standalone=True, memo=memo, stop_flag=stop)
    )
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=20)


@pytest_asyncio.fixture
async def cluster(kmock: kmock.KubernetesEmulator) -> AsyncIterator[Cluster]:
    declare_resources(kmock, service_monitors=True)
    c = Cluster(kmock)
    for name in ("node-a", "node-b"):
        await c.create(K.NODES, node(name))
    await c.create(K.NODES, node("node-c", selected=False))
    yield c
    check_rbac(list(kmock))


def _verb(request: Any) -> str:
    method = str(request.method).upper().rsplit(".", 1)[-1]
    if method == "GET":
        if request.name:
            return "get"
        return "watch" if str(request.params.get("watch", "")).lower() in ("true", "1") else "list"
    return {"POST": "create", "PATCH": "patch", "DELETE": "delete", "PUT": "update"}[method]


def check_rbac(requests: list[Any]) -> None:
    """Every request the operator (kopf included) and the agents made is allowed by the chart's
    ClusterRoles, rendered by the real helm: least privilege is checked against use, not guessed."""
    from tests.support.helm import render as render_chart

    roles = {d["metadata"]["name"]: d["rules"] for d in render_chart() if d["kind"] == "ClusterRole"}
    for request in requests:
        agent = request.headers.get("User-Agent", "")
        if (
            request.resource is None
            or request.resource.plural is None
            or not (agent.startswith(("kopf", handlers.USER_AGENT, "flatcake-agent")))
        ):
            continue  # discovery, or the test itself acting as kubectl
        role = roles["fc-flatcake-agent" if agent.startswith("flatcake-agent") else "fc-flatcake-operator"]
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        verb = _verb(request)
        assert any(
            request.resource.group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in role
        ), f"{agent}: {verb} {request.resource.group}/{resource} is not in the chart's RBAC"


async def test_create_renders_agents_and_reports_ready(cluster: Cluster) -> None:
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())
        # The ServiceMonitor is applied last: once it exists, so does the rest.
        sm = await cluster.wait(lambda: cluster.get(K.SERVICE_MONITORS, CACHE), "the ServiceMonitor")
        ds = await cluster.get(K.DAEMON_SETS, f"{CACHE}-agent")
        cm = await cluster.get(K.CONFIG_MAPS, f"{CACHE}-config")
        svc = await cluster.get(K.SERVICES, f"{CACHE}-metrics")
        assert ds and cm and svc and sm
        config = EngineConfig.from_dict(json.loads(cm["data"]["engine.json"]))  # the agent's own parser
        assert config.prepare.devices == ("/dev/nvme0n1", "/dev/nvme1n1")
        assert config.ssd.file_count == 8 and config.ssd.file_bytes == 1 << 30
        assert config.dram.bytes == 256 << 20 and config.cluster.cache == CACHE
        pod = ds["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {"flatcake.io/node": "true"}
        assert pod["initContainers"][0]["securityContext"] == {"privileged": True}
        agent = pod["containers"][0]
        assert agent["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert agent["securityContext"]["privileged"] is False
        assert agent["resources"]["limits"]["hugepages-2Mi"] == str(256 << 20)
        owner = ds["metadata"]["ownerReferences"][0]
        cache = await cluster.get(K.CACHES, CACHE)
        assert owner["uid"] == cache["metadata"]["uid"] and owner["controller"] is True
        ids = (await cluster.get(K.CONFIG_MAPS, f"{CACHE}-node-ids"))["data"]
        assert sorted(ids) == ["node-a", "node-b"] and sorted(ids.values()) == ["0", "1"]

        status = await cluster.wait(cluster.cache_status, "a status")
        assert status["phase"] == "Progressing" and status["readyNodes"] == "0/2"
        for name in ("node-a", "node-b"):
            await cluster.report(name)

        async def ready() -> bool:
            return (await cluster.condition("Ready")).get("status") == "True"

        await cluster.wait(ready, "Ready")
        status = await cluster.cache_status()
        assert status["phase"] == "Ready" and status["readyNodes"] == "2/2"
        assert status["ssd"] == "16Gi" and status["dram"] == "512Mi"
        assert (await cluster.condition("Degraded"))["status"] == "False"
        label = render.ready_label(render.Cache(CACHE, NS, ""))
        for name in ("node-a", "node-b"):
            assert (await cluster.get(K.NODES, name, namespace=None))["metadata"]["labels"][label] == "true"
        await cluster.report("node-b", ready=False, error="EIO reading /dev/nvme1n1")

        async def unlabelled() -> bool:
            labels = (await cluster.get(K.NODES, "node-b", namespace=None))["metadata"]["labels"]
            return label not in labels

        await cluster.wait(unlabelled, "node-b's ready label removed")
        cond = await _degraded_with(cluster, "EIO reading /dev/nvme1n1")
        assert cond["reason"] == "NodeErrors" and "node-b" in cond["message"]


async def test_a_tainted_node_gets_no_node_id_until_tolerated_and_the_status_says_why(cluster: Cluster) -> None:
    tainted = node("node-t")
    tainted["spec"] = {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]}
    await cluster.create(K.NODES, tainted)
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())

        async def listed() -> list[str] | None:
            return (await cluster.cache_status()).get("excludedNodes") or None

        excluded = await cluster.wait(listed, "the tainted node listed as excluded")
        assert excluded == [
            "node-t: taint nvidia.com/gpu=present:NoSchedule is not tolerated (add it to spec.tolerations)"
        ]
        ids = (await cluster.get(K.CONFIG_MAPS, f"{CACHE}-node-ids"))["data"]
        assert sorted(ids) == ["node-a", "node-b"]  # readiness counts only nodes that get an agent
        assert (await cluster.cache_status())["readyNodes"] == "0/2"
        await cluster.patch(
            K.CACHES, CACHE, {"spec": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]}}
        )

        async def three_ids() -> bool:
            cm = await cluster.get(K.CONFIG_MAPS, f"{CACHE}-node-ids")
            return sorted((cm or {}).get("data", {})) == ["node-a", "node-b", "node-t"]

        await cluster.wait(three_ids, "a NodeID for the tolerated node")
        ds = await cluster.get(K.DAEMON_SETS, f"{CACHE}-agent")
        assert ds["spec"]["template"]["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]


async def test_the_webhook_wires_a_labelled_pod_and_refuses_one_naming_no_ready_cache(cluster: Cluster) -> None:
    """What the API server would send: an AdmissionReview for a pod CREATE. A pod labelled with the cache
    gets the JSON patch that wires it; one naming no cache, or a Degraded one, is refused saying why."""
    import base64

    import jsonpatch

    from flatcake.net import free_port
    from flatcake.operator import inject

    port = free_port()

    async def review(pod: dict[str, Any]) -> dict[str, Any]:
        request = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                   "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
                               "resource": {"group": "", "version": "v1", "resource": "pods"},
                               "operation": "CREATE", "namespace": NS, "userInfo": {"username": "test"},
                               "object": pod}}  # fmt: skip
        async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{port}/inject", json=request) as r:
            assert r.status == 200, await r.text()
            answer: dict[str, Any] = (await r.json())["response"]
            return answer

    def pod(labels: dict[str, str], namespace: str = NS, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        meta = {"name": "sglang", "namespace": namespace, "labels": labels, "annotations": annotations or {}}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                "spec": {"containers": [{"name": "sglang", "image": "sglang"}]}}  # fmt: skip

    async with running_operator(cluster.api, webhook_port=port):
        await cluster.create(K.CACHES, cache_body())
        await cluster.wait(cluster.cache_status, "a status")

        async def answering() -> dict[str, Any] | None:
            try:
                return await review(pod({inject.CACHE_LABEL: CACHE}))
            except aiohttp.ClientConnectionError:
                return None  # the webhook server is still starting

        wired = await cluster.wait(answering, "the webhook's answer")
        assert wired["allowed"] is True and wired["patchType"] == "JSONPatch"
        mutated = jsonpatch.apply_patch(pod({inject.CACHE_LABEL: CACHE}), json.loads(base64.b64decode(wired["patch"])))
        env = {e["name"]: e.get("value") for e in mutated["spec"]["containers"][0]["env"]}
        assert json.loads(env["FLATCAKE_HICACHE_EXTRA_CONFIG"])["socket"] == env["FLATCAKE_SOCKET"]
        # The pod's namespace is its tenant: its pages are keyed apart from other namespaces' (SGLang, vLLM).
        assert json.loads(env["FLATCAKE_HICACHE_EXTRA_CONFIG"])["tenant"] == NS
        assert json.loads(env["FLATCAKE_VLLM_KV_TRANSFER_CONFIG"])["kv_connector_extra_config"]["tenant"] == NS
        assert env["FLATCAKE_SOCKET"] == f"/run/flatcake/{NS}.{CACHE}/agent.sock"
        assert mutated["metadata"]["annotations"][inject.INJECTED_ANNOTATION] == f"{NS}.{CACHE}"
        # A pre-set "injected" annotation skips nothing: the pod is wired (and checked) all the same.
        preset = await review(pod({inject.CACHE_LABEL: CACHE}, annotations={inject.INJECTED_ANNOTATION: "x.y"}))
        assert preset["allowed"] is True and preset.get("patch")
        # A pod of another namespace naming this cache is refused unless the cache lists its namespace.
        other = {inject.NAMESPACE_ANNOTATION: NS}
        stranger = await review(pod({inject.CACHE_LABEL: CACHE}, namespace="tenant-b", annotations=other))
        assert stranger["allowed"] is False
        assert "spec.access.namespaces does not list namespace 'tenant-b'" in stranger["status"]["message"]
        preset = {inject.NAMESPACE_ANNOTATION: NS, inject.INJECTED_ANNOTATION: f"{NS}.{CACHE}"}
        sneaky = await review(pod({inject.CACHE_LABEL: CACHE}, namespace="tenant-b", annotations=preset))
        assert sneaky["allowed"] is False
        await cluster.patch(K.CACHES, CACHE, {"spec": {"access": {"namespaces": ["tenant-b"]}}})
        listed = await review(pod({inject.CACHE_LABEL: CACHE}, namespace="tenant-b", annotations=other))
        assert listed["allowed"] is True and listed.get("patch")
        untouched = await review(pod({"app": "other"}))
        assert untouched["allowed"] is True and not untouched.get("patch")  # no label: not the webhook's
        absent = await review(pod({inject.CACHE_LABEL: "nope"}))
        assert absent["allowed"] is False and "no FlatCakeCache 'nope'" in absent["status"]["message"]
        await cluster.patch(K.CACHES, CACHE, {"spec": {"dram": {"size": "1Ti"}}})  # more than a node has
        await _degraded_with(cluster, "spec.dram.size")
        degraded = await review(pod({inject.CACHE_LABEL: CACHE}))
        assert degraded["allowed"] is False and "is Degraded" in degraded["status"]["message"]


async def _deployed(cluster: Cluster) -> tuple[dict[str, Any], EngineConfig]:
    ds = await cluster.wait(lambda: cluster.get(K.DAEMON_SETS, f"{CACHE}-agent"), "the agent DaemonSet")
    cm = await cluster.get(K.CONFIG_MAPS, f"{CACHE}-config")
    assert cm is not None
    return ds, EngineConfig.from_dict(json.loads(cm["data"]["engine.json"]))


def _config_hash(ds: dict[str, Any]) -> str:
    annotations: dict[str, str] = ds["spec"]["template"]["metadata"]["annotations"]
    return annotations["flatcake.io/config-hash"]


async def _degraded_with(cluster: Cluster, field: str) -> dict[str, Any]:
    async def degraded() -> dict[str, Any] | None:
        c = await cluster.condition("Degraded")
        return c if c.get("status") == "True" and field in c.get("message", "") else None

    return await cluster.wait(degraded, f"Degraded naming {field}")


async def test_spec_update_rolls_the_daemonset_with_the_new_config(cluster: Cluster) -> None:
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())
        ds, config = await _deployed(cluster)
        assert config.io.gap_bytes == 65536
        await cluster.patch(K.CACHES, CACHE, {"spec": {"io": {"gapBytes": 262144}, "ssd": {"fileCount": 12}}})

        async def rolled() -> dict[str, Any] | None:
            new = await cluster.get(K.DAEMON_SETS, f"{CACHE}-agent")
            return new if new and _config_hash(new) != _config_hash(ds) else None

        new_ds = await cluster.wait(rolled, "a new pod template")
        _, new_config = await _deployed(cluster)
        assert new_config.io.gap_bytes == 262144 and new_config.ssd.file_count == 12  # a larger pool is safe
        assert new_ds["spec"]["template"]["spec"]["containers"][0]["command"][-1].endswith("engine.json")
        status = await cluster.wait(lambda: _observed(cluster, 2), "observedGeneration 2")
        assert status["phase"] != "Degraded"


async def _observed(cluster: Cluster, generation: int) -> dict[str, Any] | None:
    status = await cluster.cache_status()
    return status if status.get("observedGeneration") == generation else None


async def test_schema_rejects_what_it_can_express(cluster: Cluster) -> None:
    """Admission (the CRD schema) refuses bad types and ranges before the operator sees them."""
    for bad in (
        {"ssd": {"devices": ["/dev/nvme0n1"], "fileCount": 0}},
        {"dram": {"size": "lots"}},
        {"placement": {"mode": "lifo"}},
        {"kv": {"pageBytes": 5000}},
    ):
        body = cache_body(**bad)
        status, answer = await cluster.call("POST", K.CACHES.path(NS), body)
        assert status == 422, (bad, answer)
        assert next(iter(bad)) in answer["message"]
    assert await cluster.get(K.CACHES, CACHE) is None


async def test_schema_rejects_names_that_make_invalid_objects(cluster: Cluster) -> None:
    """Names the API server admits for any object but that make an invalid Service or label: refused
    at admission, naming metadata.name."""
    for name in ("c" * 56, "my.cache", "9lives", "Main"):
        body = cache_body()
        body["metadata"]["name"] = name
        status, answer = await cluster.call("POST", K.CACHES.path(NS), body)
        assert status == 422 and "metadata.name" in answer["message"], (name, answer)
    body = cache_body(nodeSelector={"pool": "x" * 64})
    status, answer = await cluster.call("POST", K.CACHES.path(NS), body)
    assert status == 422 and "nodeSelector" in answer["message"], answer


async def test_a_cache_admitted_with_an_unusable_name_is_degraded_not_retried(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache admitted by an older CRD (upgrading a CRD does not revalidate objects) whose name cannot
    name a Service: Degraded naming metadata.name, and nothing is sent for the API server to refuse."""
    from tests.support import kube_api

    schema = kube_api.crd_schema("flatcake.io", "flatcakecaches")
    monkeypatch.delitem(schema["properties"], "metadata")  # the CRD before names were checked
    name = "my.cache-" + "n" * 50
    body = cache_body()
    body["metadata"]["name"] = name
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, body)

        async def degraded() -> dict[str, Any] | None:
            obj = await cluster.get(K.CACHES, name) or {}
            conds = obj.get("status", {}).get("conditions", [])
            c = next((c for c in conds if c["type"] == "Degraded"), {})
            return c if c.get("status") == "True" else None

        cond = await cluster.wait(degraded, "Degraded")
        assert cond["reason"] == "InvalidSpec" and cond["message"].startswith("metadata.name:")
        assert f"{name}-metrics" in cond["message"] and "at most 55" in cond["message"]
    for plural in ("services", "daemonsets", "configmaps"):
        assert cluster.requests("POST", plural) == 0, plural


async def test_an_object_the_api_server_refuses_degrades_the_cache(cluster: Cluster) -> None:
    """What the operator cannot foresee (a 422 from the API server's own validation) is a Degraded
    condition quoting the refusal, not an error retried every few seconds forever."""
    api: Any = cluster.api
    api.refusals[("POST", "daemonsets")] = 'DaemonSet.apps "main-agent" is invalid: spec.template: refused'
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())
        cond = await _degraded_with(cluster, "the API server refused")
        assert cond["reason"] == "InvalidSpec" and "main-agent" in cond["message"] and "HTTP 422" in cond["message"]
    assert cluster.requests("POST", "daemonsets") == 1  # tried once, not retried at RETRY_SECONDS


async def test_invalid_spec_is_degraded_naming_the_field(cluster: Cluster) -> None:
    """More DRAM than the nodes' allocatable hugepages: admitted by the schema, refused by the operator."""
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body(dram={"size": "4Gi", "hugepageSize": "2Mi"}))
        cond = await _degraded_with(cluster, "spec.dram.size")
        assert "hugepages-2Mi" in cond["message"] and "restartKubelet" in cond["message"]
        assert (await cluster.cache_status())["phase"] == "Degraded"
        assert await cluster.get(K.DAEMON_SETS, f"{CACHE}-agent") is None  # nothing deployed

        async def warned() -> bool:
            return any(
                r.data.get("reason") == "InvalidSpec" and "spec.dram.size" in r.data.get("message", "")
                for r in list(cluster.api)
                if r.resource is not None and r.resource.plural == "events" and isinstance(r.data, dict)
            )

        await cluster.wait(warned, "a Warning event")
        # Fixing the field clears the condition and deploys.
        await cluster.patch(K.CACHES, CACHE, {"spec": {"dram": {"size": "512Mi"}}})
        await _deployed(cluster)

        async def healthy() -> bool:
            return (await cluster.condition("Degraded")).get("status") == "False"

        await cluster.wait(healthy, "Degraded cleared")


async def test_config_the_agent_would_refuse_is_degraded_naming_the_spec_field(cluster: Cluster) -> None:
    """Pool files smaller than one page of all layers: admitted by the schema, refused by the engine
    configuration's own rule on the rendered config, reported by spec field before reaching a node."""
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body(ssd={"devices": ["/dev/nvme0n1"], "fileSize": "64Ki"}))
        cond = await _degraded_with(cluster, "spec.ssd.fileSize")
        assert "one page of all layers" in cond["message"]
        assert await cluster.get(K.DAEMON_SETS, f"{CACHE}-agent") is None  # nothing deployed
        assert await cluster.get(K.CONFIG_MAPS, f"{CACHE}-config") is None


async def test_pool_larger_than_a_nodes_filesystem_is_degraded(cluster: Cluster) -> None:
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())
        await _deployed(cluster)
        await cluster.report("node-a", device_bytes=4 << 30)  # 8 x 1 GiB files do not fit in 4 GiB
        await cluster.patch(K.CACHES, CACHE, {"spec": {"io": {"workers": 3}}})
        cond = await _degraded_with(cluster, "spec.ssd.fileCount")
        assert "node-a" in cond["message"]


async def test_destructive_change_is_refused_unless_wipe_allowed(cluster: Cluster) -> None:
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())
        ds, config = await _deployed(cluster)
        await cluster.patch(K.CACHES, CACHE, {"spec": {"ssd": {"devices": ["/dev/nvme2n1"]}}})
        cond = await _degraded_with(cluster, "spec.ssd.devices")
        assert "wipePolicy" in cond["message"]
        ds_now, config_now = await _deployed(cluster)
        assert config_now == config and _config_hash(ds_now) == _config_hash(ds)  # untouched
        # A smaller pool is destructive too, and stays refused on every later pass.
        await cluster.patch(
            K.CACHES, CACHE, {"spec": {"ssd": {"devices": ["/dev/nvme0n1", "/dev/nvme1n1"], "fileCount": 4}}}
        )
        await _degraded_with(cluster, "spec.ssd.fileCount")
        assert (await _deployed(cluster))[1] == config
        await cluster.patch(K.CACHES, CACHE, {"spec": {"wipePolicy": "Wipe"}})

        async def applied() -> EngineConfig | None:
            _, c = await _deployed(cluster)
            return c if c.ssd.file_count == 4 else None

        wiped = await cluster.wait(applied, "the allowed change")
        assert wiped.prepare.wipe is True


async def test_operator_restart_recreates_nothing_and_keeps_node_ids(cluster: Cluster) -> None:
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())
        await _deployed(cluster)
        for name in ("node-a", "node-b"):
            await cluster.report(name, ssd_used=1 << 20)
        await cluster.wait(lambda: _ready(cluster), "Ready")
    ids = (await cluster.get(K.CONFIG_MAPS, f"{CACHE}-node-ids"))["data"]
    ds = await cluster.get(K.DAEMON_SETS, f"{CACHE}-agent")
    posts = {p: cluster.requests("POST", p) for p in ("daemonsets", "configmaps", "services", "servicemonitors")}
    patches = cluster.requests("PATCH", "daemonsets")
    # node-c joins the selector while the operator is down.
    await cluster.patch(K.NODES, "node-c", {"metadata": {"labels": {"flatcake.io/node": "true"}}}, namespace=None)
    async with running_operator(cluster.api):

        async def three_ids() -> dict[str, str] | None:
            data = ((await cluster.get(K.CONFIG_MAPS, f"{CACHE}-node-ids")) or {}).get("data", {})
            return data if len(data) == 3 else None

        after = await cluster.wait(three_ids, "a NodeID for node-c")
    assert {k: after[k] for k in ids} == ids and after["node-c"] == "2"
    assert {p: cluster.requests("POST", p) for p in posts} == posts  # nothing recreated
    assert cluster.requests("PATCH", "daemonsets") == patches
    assert await cluster.get(K.DAEMON_SETS, f"{CACHE}-agent") == ds


async def test_api_errors_are_retried_until_the_objects_exist(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server fails the operator's first two DaemonSet creations (500): the pass is retried
    (soon, not after kopf's default minute) and completes; nothing is left half-done."""
    monkeypatch.setattr(handlers, "RETRY_SECONDS", 0.5)
    api: Any = cluster.api
    api.faults[("POST", "daemonsets")] = 2
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())
        await _deployed(cluster)
        status = await cluster.wait(cluster.cache_status, "a status")
        assert status["phase"] == "Progressing" and status["readyNodes"] == "0/2"
    assert api.faults[("POST", "daemonsets")] == 0
    assert cluster.requests("POST", "daemonsets") == 3  # two refused, the third created it
    assert cluster.requests("POST", "configmaps") == 2  # config and NodeID map once each: the retry found them


async def _ready(cluster: Cluster) -> bool:
    return (await cluster.condition("Ready")).get("status") == "True"


async def test_delete_with_retain_keeps_node_data(cluster: Cluster) -> None:
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body())
        await _deployed(cluster)
        cache = await cluster.wait(lambda: _finalized(cluster), "the finalizer")
        status, _ = await cluster.call("DELETE", K.CACHES.path(NS, CACHE))
        assert status == 200
        await cluster.wait(lambda: _gone(cluster), "the cache to go")
    assert cache["metadata"]["finalizers"] == [handlers.FINALIZER]
    assert await cluster.get(K.CONFIG_MAPS, f"{CACHE}-node-ids") is not None  # kept for a re-created cache
    assert await cluster.get(K.DAEMON_SETS, f"{CACHE}-reclaim") is None


async def _finalized(cluster: Cluster) -> dict[str, Any] | None:
    obj = await cluster.get(K.CACHES, CACHE)
    return obj if obj and handlers.FINALIZER in obj["metadata"].get("finalizers", []) else None


async def _gone(cluster: Cluster) -> bool:
    return await cluster.get(K.CACHES, CACHE) is None


async def _reclaim_progress(cluster: Cluster, erased: str) -> bool:
    """The finalizer's last retry, as kopf records it on the object: "reclaim: <ready>/<desired> ..."."""
    obj = await cluster.get(K.CACHES, CACHE) or {}
    notes = (obj.get("metadata", {}).get("annotations") or {}).values()
    return any(f"reclaim: {erased} nodes erased" in str(v) for v in notes)


async def test_delete_with_delete_policy_erases_every_node_first(cluster: Cluster) -> None:
    async with running_operator(cluster.api):
        await cluster.create(K.CACHES, cache_body(reclaimPolicy="Delete"))
        await _deployed(cluster)
        for name in ("node-a", "node-b"):
            await cluster.report(name, ssd_used=1 << 20)
        await cluster.wait(lambda: _finalized(cluster), "the finalizer")
        await cluster.call("DELETE", K.CACHES.path(NS, CACHE))
        reclaim = await cluster.wait(lambda: cluster.get(K.DAEMON_SETS, f"{CACHE}-reclaim"), "the reclaim DaemonSet")
        command = " ".join(reclaim["spec"]["template"]["spec"]["containers"][0]["command"])
        assert "flatcake agent reclaim" in command
        # The operator has looked and decided to wait (its retry says so), and the cache is still held.
        await cluster.wait(lambda: _reclaim_progress(cluster, "0/?"), "the finalizer to wait for the nodes")
        assert await cluster.get(K.CACHES, CACHE) is not None  # held by the finalizer while nodes erase
        # The DaemonSet controller's part (emulated): one node done, then both.
        await cluster.patch(
            K.DAEMON_SETS, f"{CACHE}-reclaim", {"status": {"desiredNumberScheduled": 2, "numberReady": 1}}
        )
        await cluster.wait(lambda: _reclaim_progress(cluster, "1/2"), "the finalizer to see one node done")
        assert await cluster.get(K.CACHES, CACHE) is not None
        await cluster.patch(
            K.DAEMON_SETS, f"{CACHE}-reclaim", {"status": {"desiredNumberScheduled": 2, "numberReady": 2}}
        )
        await cluster.wait(lambda: _gone(cluster), "the cache to go")
    assert await cluster.get(K.DAEMON_SETS, f"{CACHE}-reclaim") is None
    assert await cluster.get(K.CONFIG_MAPS, f"{CACHE}-node-ids") is None
    assert await cluster.get(K.FLATCAKE_NODES, f"{CACHE}-node-a") is None


async def test_no_service_monitor_without_its_crd(kmock: kmock.KubernetesEmulator) -> None:
    declare_resources(kmock, service_monitors=False)
    cluster = Cluster(kmock)
    await cluster.create(K.NODES, node("node-a"))
    async with running_operator(kmock):
        await cluster.create(K.CACHES, cache_body(ssd={"directory": "/mnt/nvme/kv"}))
        _, config = await _deployed(cluster)
        assert config.ssd.dir == f"/mnt/nvme/kv/{NS}.{CACHE}/pool" and config.prepare.devices == ()
    assert cluster.requests("POST", "servicemonitors") == 0


async def test_a_real_agent_process_takes_its_node_id_and_reports(
    kmock: kmock.KubernetesEmulator, tmp_path: Path
) -> None:
    """`flatcake agent serve` in cluster mode, as its own process: it waits for its NodeID file, logs in
    with a kubeconfig, writes its FlatCakeNode while serving and reports not-ready when stopped."""
    declare_resources(kmock, service_monitors=False)
    cluster = Cluster(kmock)
    ids = tmp_path / "node-ids"
    ids.mkdir()
    config = dataclasses.replace(
        small_config(tmp_path / "agent"),
        cluster=ClusterConfig(
            cache=CACHE, namespace=NS, cache_uid="uid-1", node_ids_dir=str(ids), report_interval_s=0.2
        ),
    )
    (tmp_path / "engine.json").write_text(json.dumps(config.to_dict()))
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "t",
        "clusters": [{"name": "t", "cluster": {"server": cluster.url}}],
        "users": [{"name": "t", "user": {}}],
        "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env |= {"NODE_NAME": "node-a", "KUBECONFIG": str(tmp_path / "kubeconfig")}
    exe = Path(sys.executable).parent / "flatcake"
    log = open(tmp_path / "agent.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(exe), "agent", "serve", "--config", str(tmp_path / "engine.json")],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    name = f"{CACHE}-node-a"
    try:
        waiting = "waiting for the operator to assign a NodeID"

        async def logged() -> bool:
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()
            return waiting in (tmp_path / "agent.log").read_text()

        await cluster.wait(logged, "the agent to wait for its NodeID")
        assert await cluster.get(K.FLATCAKE_NODES, name) is None  # no NodeID yet: not serving
        (ids / "node-a").write_text("7")

        async def reported(ready: bool) -> dict[str, Any] | None:
            obj = await cluster.get(K.FLATCAKE_NODES, name)
            status = (obj or {}).get("status", {})
            return obj if status.get("ready") is ready and status.get("nodeId") == 7 else None

        obj = await cluster.wait(lambda: reported(True), "the agent's FlatCakeNode")
        assert obj["spec"] == {"cache": CACHE, "nodeName": "node-a"}
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert obj["status"]["ssdCapacityBytes"] == config.ssd.file_bytes * config.ssd.file_count
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 30) == 0
        await cluster.wait(lambda: reported(False), "the agent reporting not ready as it stops")
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    check_rbac(list(kmock))
