"""The operator's test API server: kmock's KubernetesEmulator, extended through its own handler hook
(``_handle``) with the parts of a real API server that the operator relies on.

Emulated here, not real (and so not proven by these tests):
- object metadata: ``uid``, ``resourceVersion``, ``creationTimestamp``, and ``generation`` bumped
  when a custom resource's spec changes;
- CRD admission for flatcake.io objects: validation against the CRD's OpenAPI schema (jsonschema;
  the CEL ``x-kubernetes-validations`` rules are not evaluated) and structural defaulting;
- DaemonSet controller status (``desiredNumberScheduled``/``numberReady``) is set by the tests
  themselves where a scenario waits on it.
Not emulated at all: garbage collection by owner reference (tests assert the references instead),
RBAC, the status subresource's isolation, strategic merge (kmock merges patches as JSON merge)."""

from __future__ import annotations

import copy
import datetime
import itertools
import uuid
from typing import Any

import attrs
import jsonschema
import kmock
import yaml

from flatcake.crds import apply_defaults
from tests.support import ROOT

CRDS = {
    (doc["spec"]["group"], doc["spec"]["names"]["plural"]): doc
    for doc in (yaml.safe_load(p.read_text()) for p in sorted((ROOT / "crds").glob("*.yaml")))
}
_versions = itertools.count(1000)


def crd_schema(group: str, plural: str) -> dict[str, Any]:
    schema: dict[str, Any] = CRDS[(group, plural)]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def admit(group: str, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
    """Default, then validate; raises jsonschema.ValidationError like the API server's 422."""
    schema = crd_schema(group, plural)
    obj = apply_defaults(schema, copy.deepcopy(obj))
    jsonschema.validate(obj, schema, cls=jsonschema.Draft7Validator)
    return obj


@attrs.define(kw_only=True)
class ApiServer(kmock.KubernetesEmulator):
    # Faults to inject: (HTTP method, plural) -> how many of the next such requests fail with a 500
    # before anything is stored (kmock's own reactions answer after storing).
    faults: dict[tuple[str, str], int] = attrs.field(factory=dict)
    # Objects the real API server would refuse (its validation of built-in kinds is not emulated):
    # (HTTP method, plural) -> the message of a 422 Invalid answered to every such request.
    refusals: dict[tuple[str, str], str] = attrs.field(factory=dict)

    async def _handle(self, request: Any) -> Any:
        res = request.resource
        method = str(request.method).upper().rsplit(".", 1)[-1]
        key = (method, res.plural if res is not None else "")
        if self.faults.get(key, 0) > 0:
            self.faults[key] -= 1
            raise kmock.KubernetesError(status=500, reason="InternalError", message="injected fault")
        if key in self.refusals:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=self.refusals[key])
        if (
            res is not None
            and request.action in (kmock.action.CREATE, kmock.action.UPDATE)
            and isinstance(request.data, dict)
        ):
            data = copy.deepcopy(request.data) if isinstance(request.data, dict) else request.data
            try:
                data = self._admit(request, res, data)
            except jsonschema.ValidationError as exc:
                where = ".".join(str(p) for p in exc.absolute_path)
                raise kmock.KubernetesError(status=422, reason="Invalid", message=f"{where}: {exc.message}") from None
            if isinstance(request.data, dict):  # the request is frozen and matched by identity: edit in place
                request.data.clear()
                request.data.update(data)
        return await super()._handle(request)

    def _admit(self, request: Any, res: Any, data: dict[str, Any]) -> dict[str, Any]:
        custom = (res.group, res.plural) in CRDS
        if request.action == kmock.action.CREATE:
            meta = data.setdefault("metadata", {})
            meta.setdefault("namespace", request.namespace)
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
            meta.setdefault("generation", 1)
            if custom:
                data = admit(res.group, res.plural, data)
        else:
            key = (res, request.namespace, request.name)
            existing = self.objects[key] if key in self.objects else None  # noqa: SIM401 (no .get on ObjectsArray)
            if custom and existing is not None and not existing.deleted and "spec" in data:
                merged = _merge(copy.deepcopy(existing.raw), data)
                admitted = admit(res.group, res.plural, merged)
                data = {**data, "spec": admitted["spec"]}
                if admitted["spec"] != existing.raw.get("spec"):
                    generation = existing.raw.get("metadata", {}).get("generation", 1) + 1
                    data["metadata"] = {**(data.get("metadata") or {}), "generation": generation}
        data.setdefault("metadata", {})["resourceVersion"] = str(next(_versions))
        return data


def _merge(base: Any, patch: Any) -> Any:
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return patch
    for k, v in patch.items():
        if v is None:
            base.pop(k, None)
        else:
            base[k] = _merge(base.get(k), v)
    return base


def declare_resources(api: kmock.KubernetesEmulator, *, service_monitors: bool) -> None:
    """Discovery, as kopf needs it (verbs included, or kopf waits forever)."""
    verbs = ["list", "watch", "get", "create", "patch", "delete"]
    info = kmock.ResourceInfo
    api.resources["v1/namespaces"] = info(kind="Namespace", namespaced=False, verbs=verbs)
    api.resources["v1/nodes"] = info(kind="Node", namespaced=False, verbs=verbs)
    api.resources["v1/pods"] = info(kind="Pod", namespaced=True, verbs=verbs)  # the pod-wiring webhook's
    api.resources["v1/configmaps"] = info(kind="ConfigMap", namespaced=True, verbs=verbs)
    api.resources["v1/services"] = info(kind="Service", namespaced=True, verbs=verbs)
    api.resources["v1/serviceaccounts"] = info(kind="ServiceAccount", namespaced=True, verbs=verbs)
    api.resources["v1/events"] = info(kind="Event", namespaced=True, verbs=verbs)
    api.resources["apps/v1/daemonsets"] = info(kind="DaemonSet", namespaced=True, verbs=verbs, subresources=["status"])
    api.resources["rbac.authorization.k8s.io/v1/rolebindings"] = info(kind="RoleBinding", namespaced=True, verbs=verbs)
    api.resources["flatcake.io/v1alpha1/flatcakecaches"] = info(
        kind="FlatCakeCache", namespaced=True, verbs=verbs, subresources=["status"]
    )
    api.resources["flatcake.io/v1alpha1/flatcakenodes"] = info(
        kind="FlatCakeNode", namespaced=True, verbs=verbs, subresources=["status"]
    )
    if service_monitors:
        api.resources["monitoring.coreos.com/v1/servicemonitors"] = info(
            kind="ServiceMonitor", namespaced=True, verbs=verbs
        )
