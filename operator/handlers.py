"""kopf handlers: FlatCakeCache → node agents (DaemonSet, ConfigMaps, Service, ServiceMonitor, RBAC).

Reconciliation is level-based and idempotent: every create, update, resume and periodic resync reads
the cluster, renders what should exist (``render``), applies only differences, and writes the
status aggregated from the FlatCakeNodes. Decisions (spec checks, destructive changes, NodeIDs,
status) are the pure modules beside this one; here is only the I/O around them.

Handlers are synchronous: kopf runs them in its thread pool, and the blocking ``kubernetes`` client
keeps them simple."""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import secrets
from typing import Any

import kopf

from flatcake import kube as K
from flatcake.operator import changes, inject, nodeids, render, scheduling
from flatcake.operator.spec import GROUP, VERSION, CacheSpec, SpecError, check_node_count, check_node_fit, parse_spec
from flatcake.operator.status import NodeReport, aggregate

FINALIZER = "flatcake.io/finalizer"
# Not under flatcake.io/: kopf ignores annotations under its own storage prefix when it diffs.
REPORTS_DIGEST = "nodes.flatcake.io/reports"
USER_AGENT = "flatcake-operator"
RESYNC_SECONDS = float(os.environ.get("FLATCAKE_RESYNC_SECONDS", "60"))
RECLAIM_POLL_SECONDS = float(os.environ.get("FLATCAKE_RECLAIM_POLL_SECONDS", "5"))
RETRY_SECONDS = 10.0  # after an API error (kopf's default backoff is a minute)
CACHES = (GROUP, VERSION, "flatcakecaches")


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="flatcake.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="flatcake.io")
    if getattr(memo, "kube", None) is None:  # tests hand in a client for their API server
        memo.kube = K.Kube.from_environment(USER_AGENT)
    if getattr(memo, "agent_cluster_role", None) is None:
        memo.agent_cluster_role = os.environ.get("FLATCAKE_AGENT_CLUSTER_ROLE", "flatcake-agent")
    # The pod-wiring webhook (inject_pod): served where the chart gives a certificate; its
    # MutatingWebhookConfiguration is the chart's (it holds the CA), not managed by kopf.
    port = os.environ.get("FLATCAKE_WEBHOOK_PORT")
    if getattr(settings.admission, "server", None) is None:
        if port:
            settings.admission.server = kopf.WebhookServer(
                addr="0.0.0.0", port=int(port), certfile=os.environ.get("FLATCAKE_WEBHOOK_CERT"),
                pkeyfile=os.environ.get("FLATCAKE_WEBHOOK_KEY"), insecure=not os.environ.get("FLATCAKE_WEBHOOK_CERT"),
            )  # fmt: skip
        else:  # webhook off: kopf stops when a handler has no server, so it gets one nothing routes to
            settings.admission.server = kopf.WebhookServer(addr="127.0.0.1", port=None, insecure=True)


def _selected_nodes(kube: K.Kube, spec: CacheSpec) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The nodes that get an agent, and why each other node matching spec.nodeSelector gets none."""
    chosen, excluded = [], {}
    for node in kube.list(K.NODES, selector=spec.node_selector):
        why = scheduling.why_excluded(node, spec.tolerations, spec.affinity)
        if why is None:
            chosen.append(node)
        else:
            excluded[node["metadata"]["name"]] = why
    return chosen, excluded


def _reports(kube: K.Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    return [o for o in kube.list(K.FLATCAKE_NODES, namespace, selector={"flatcake.io/cache": name})
            if o.get("spec", {}).get("cache") == name]  # fmt: skip


def _deployed_config(kube: K.Kube, cache: render.Cache) -> dict[str, Any] | None:
    cm = kube.get(K.CONFIG_MAPS, cache.namespace, render.names(cache)["config"])
    if cm is None:
        return None
    deployed: dict[str, Any] = json.loads(cm.get("data", {}).get(render.CONFIG_KEY, "{}"))
    return deployed


def _write_node_ids(kube: K.Kube, cache: render.Cache, current: dict[str, Any] | None, ids: dict[str, int]) -> None:
    """Create the NodeID map, or patch ``current`` (the map as read) where the IDs changed."""
    body = render.node_ids_map(cache, ids)
    if current is None:
        kube.create(K.CONFIG_MAPS, body)
        return
    before = _parse_node_ids(current)
    if before != ids:
        removed: dict[str, Any] = {node: None for node in before.keys() - ids.keys()}  # merge-patch deletes
        kube.patch(K.CONFIG_MAPS, cache.namespace, body["metadata"]["name"], {"data": {**removed, **body["data"]}})


def _parse_node_ids(config_map: dict[str, Any] | None) -> dict[str, int]:
    return nodeids.parse({k: v for k, v in (config_map or {}).get("data", {}).items() if v is not None})


def reconcile(kube: K.Kube, body: kopf.Body, agent_cluster_role: str, logger: Any) -> dict[str, Any]:
    """One full pass for one cache; returns the new status. Spec problems do not raise: they leave
    what is deployed untouched and come back as a Degraded status (and a Warning event)."""
    meta = body["metadata"]
    cache = render.Cache(meta["name"], meta["namespace"], meta.get("uid", ""))
    problem = ""
    selected: list[str] = []
    excluded: dict[str, str] = {}
    reports = [NodeReport.from_object(r) for r in _reports(kube, cache.namespace, cache.name)]
    try:
        render.check_cache(cache)
        spec = parse_spec(dict(body.get("spec", {})))
        nodes, excluded = _selected_nodes(kube, spec)
        selected = sorted(n["metadata"]["name"] for n in nodes)
        check_node_count(len(selected))
        device_bytes = {r.node: r.device_bytes for r in reports}
        for node in nodes:
            name = node["metadata"]["name"]
            check_node_fit(spec, name, node.get("status", {}).get("allocatable", {}), device_bytes.get(name))
        wanted = render.engine_config(spec, cache, wipe=spec.wipe_policy == "Wipe")
        render.check_engine_config(wanted)  # the agent's own rules: what it would refuse is not deployed
        deployed = _deployed_config(kube, cache)
        if deployed is not None and spec.wipe_policy != "Wipe":
            found = changes.destructive_changes(deployed, wanted)
            if found:
                change = found[0]
                raise SpecError(change.field, f"{change.why}; this destroys the KV stored on every node. Revert "
                                              "the change, or set spec.wipePolicy: Wipe to allow it")  # fmt: skip
        ids_map = kube.get(K.CONFIG_MAPS, cache.namespace, render.names(cache)["node_ids"])
        ids = nodeids.assign(_parse_node_ids(ids_map), selected, [r.node for r in reports if r.holds_data])
        _write_node_ids(kube, cache, ids_map, ids)
        if spec.cross_node:
            ensure_peer_secret(kube, cache)
        monitor = spec.service_monitor and kube.has_resource(K.SERVICE_MONITORS)
        for obj in render.objects(spec, cache, wanted, agent_cluster_role, monitor):
            outcome = K.apply(kube, obj)
            if outcome != "unchanged":
                logger.info("%s %s %s", outcome, obj["kind"], obj["metadata"]["name"])
    except K.KubeError as exc:
        # 400 and 422 answer what was sent, not the API server's state: the same spec is refused again
        # on every retry, so it is a spec problem (Degraded), not a transient error to retry soon.
        if exc.status not in (400, 422):
            raise
        problem = f"spec: the API server refused what this spec renders ({exc}); fix the field it names"
        logger.error("not deployed: %s", problem)
        kopf.warn(body, reason="InvalidSpec", message=problem)
    except SpecError as exc:
        problem = str(exc)
        logger.error("not deployed: %s", problem)
        kopf.warn(body, reason="InvalidSpec", message=problem)
    return aggregate(
        selected=selected, excluded=excluded, reports=reports, problem=problem,
        generation=int(meta.get("generation", 0)), previous=dict(body.get("status", {})), now=_now(),
    )  # fmt: skip


def ensure_peer_secret(kube: K.Kube, cache: render.Cache) -> None:
    """The cache's peer secret, created once (a random 32 bytes) and never rewritten: agents that restart
    read the same one (peer_auth.py). Deleted with the cache (owner reference)."""
    if kube.get(K.SECRETS, cache.namespace, render.names(cache)["peer_secret"]) is None:
        kube.create(K.SECRETS, render.peer_secret(cache, secrets.token_urlsafe(32)))


def _reconcile_or_retry(body: kopf.Body, memo: kopf.Memo, logger: Any) -> dict[str, Any]:
    """API errors (a busy or restarting API server) are retried soon; the pass is idempotent."""
    try:
        return reconcile(memo.kube, body, memo.agent_cluster_role, logger)
    except K.KubeError as exc:
        raise kopf.TemporaryError(f"{exc}; retrying in {RETRY_SECONDS:g}s", delay=RETRY_SECONDS) from exc


@kopf.on.resume(*CACHES)
@kopf.on.create(*CACHES)
@kopf.on.update(*CACHES)
def cache_changed(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: Any, **_: Any) -> None:
    patch.status.update(_reconcile_or_retry(body, memo, logger))


@kopf.timer(*CACHES, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=RESYNC_SECONDS / 2)
def cache_resync(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, logger: Any, **_: Any) -> None:
    """Nodes joining or leaving the selector change nothing in the cache itself: resync periodically."""
    patch.status.update(_reconcile_or_retry(body, memo, logger))


@kopf.on.event(GROUP, VERSION, "flatcakenodes")
def node_reported(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """An agent wrote its FlatCakeNode: label its node, and when what the status is made of changed,
    mark the cache (annotation REPORTS_DIGEST) so that its own handler runs a pass. The cache handler
    stays the only writer of the cache's status: two writers would race and undo each other."""
    kube: K.Kube = memo.kube
    namespace, cache_name = body["metadata"].get("namespace"), body.get("spec", {}).get("cache")
    if not cache_name:
        return
    cache = kube.get(K.CACHES, namespace, cache_name)
    if cache is None or cache["metadata"].get("deletionTimestamp"):
        return
    ident = render.Cache(cache_name, namespace, cache["metadata"].get("uid", ""))
    try:
        render.check_cache(ident)
        spec = parse_spec(cache.get("spec", {}))
        render.check_engine_config(render.engine_config(spec, ident))
        selected = sorted(n["metadata"]["name"] for n in _selected_nodes(kube, spec)[0])
    except SpecError:
        selected = []  # the cache handler reports the spec; no node is ready for an invalid one
    _label_node(kube, ident, NodeReport.from_object(body), selected)
    digest = reports_digest([NodeReport.from_object(r) for r in _reports(kube, namespace, cache_name)])
    if (cache["metadata"].get("annotations") or {}).get(REPORTS_DIGEST) != digest:
        kube.patch(K.CACHES, namespace, cache_name, {"metadata": {"annotations": {REPORTS_DIGEST: digest}}})


def reports_digest(reports: list[NodeReport]) -> str:
    """What of the node reports the cache status shows (usage changes alone do not count)."""
    rows = sorted((r.node, r.node_id, r.ready, r.dram_capacity, r.ssd_capacity, r.last_error, r.holds_data)
                  for r in reports)  # fmt: skip
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def _label_node(kube: K.Kube, cache: render.Cache, report: NodeReport, selected: list[str]) -> None:
    """Keep the node's ready label in step with its agent's report (removed when not ready)."""
    node = kube.get(K.NODES, None, report.node)
    if node is None:
        return
    key = render.ready_label(cache)
    want = "true" if report.ready and report.node in selected else None
    if (node["metadata"].get("labels") or {}).get(key) != want:
        kube.patch(K.NODES, None, report.node, {"metadata": {"labels": {key: want}}})


@kopf.on.delete(*CACHES)
def cache_deleted(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Finalizer. Retain: the owned objects go with the cache (owner references), the nodes' pools and
    the NodeID map stay for a cache recreated under the same name. Delete: a reclaim DaemonSet erases
    every node's pool first; the finalizer is released only when all its pods report done."""
    kube: K.Kube = memo.kube
    meta = body["metadata"]
    cache = render.Cache(meta["name"], meta["namespace"], meta.get("uid", ""))
    n = render.names(cache)
    try:
        render.check_cache(cache)  # a cache refused for its name was never deployed: nothing to reclaim
        spec = parse_spec(dict(body.get("spec", {})))
    except SpecError as exc:
        logger.error("cannot reclaim with an invalid spec (%s); releasing the cache, node data is kept", exc)
        return
    if spec.reclaim_policy != "Delete":
        logger.info("reclaimPolicy Retain: node pools and NodeIDs (ConfigMap %s) are kept", n["node_ids"])
        return
    K.apply(kube, render.reclaim_daemon_set(spec, cache))
    ds = kube.get(K.DAEMON_SETS, cache.namespace, n["reclaim"]) or {}
    status = ds.get("status", {})
    desired, ready = status.get("desiredNumberScheduled"), status.get("numberReady", 0)
    if desired is None or ready < desired:
        raise kopf.TemporaryError(f"reclaim: {ready}/{desired if desired is not None else '?'} nodes erased",
                                  delay=RECLAIM_POLL_SECONDS)  # fmt: skip
    kube.delete(K.DAEMON_SETS, cache.namespace, n["reclaim"])
    kube.delete(K.CONFIG_MAPS, cache.namespace, n["node_ids"])
    for report in _reports(kube, cache.namespace, cache.name):
        kube.delete(K.FLATCAKE_NODES, cache.namespace, report["metadata"]["name"])
    logger.info("reclaimPolicy Delete: pools erased on %d nodes", desired)


@kopf.on.mutate("pods", id="inject", labels={inject.CACHE_LABEL: kopf.PRESENT}, operations=["CREATE"])
def inject_pod(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    """Wire an inference pod to the FlatCakeCache its label names (operator/inject.py), or refuse it
    when that cache is absent or Degraded."""
    pod = dict(body)
    pod_namespace = str(body.get("metadata", {}).get("namespace", ""))
    namespace, name = inject.cache_of(pod, default_namespace=pod_namespace)
    kube: K.Kube = memo.kube
    cache = kube.get(K.CACHES, namespace, name) if name else None
    why = inject.refusal(namespace, name, cache, pod_namespace)
    if why is None and cache is not None:
        ident = render.Cache(name, namespace, cache["metadata"].get("uid", ""))
        try:
            wiring = render.pod_wiring(parse_spec(dict(cache.get("spec", {}))), ident)
        except SpecError as exc:
            why = f"FlatCakeCache {namespace}/{name}: {exc}; fix it before starting pods that use it"
    if why is not None:
        raise kopf.AdmissionError(why, code=403)
    spec = inject.mutate(pod, inject.for_tenant(wiring, pod_namespace))
    for key, value in spec.items():
        if value != pod.get("spec", {}).get(key):
            patch.spec[key] = value
    patch.metadata.annotations[inject.INJECTED_ANNOTATION] = f"{namespace}.{name}"
    logger.info("wired to FlatCakeCache %s/%s", namespace, name)


def run(namespaces: list[str], liveness: str | None = None) -> None:
    """``flatcake operator``: watch the given namespaces, or all of them when none are given. The
    credentials are checked before kopf starts, so a missing kubeconfig is one clear error."""
    logging.basicConfig(level=logging.INFO)
    memo = kopf.Memo(kube=K.Kube.from_environment(USER_AGENT))
    kopf.run(clusterwide=not namespaces, namespaces=namespaces, standalone=True, liveness_endpoint=liveness,
             memo=memo)  # fmt: skip
