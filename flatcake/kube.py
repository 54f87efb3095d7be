"""A small generic REST client over the ``kubernetes`` package's ApiClient (auth, TLS, config).

The operator manages objects of several kinds the same way (get, create, merge-patch, delete), so one
resource-agnostic path serves them all instead of a typed API class per kind."""

from __future__ import annotations

import json
import urllib.parse
from dataclasses import dataclass
from typing import Any

import kubernetes


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_path(self) -> str:
        """The API group version's path (its discovery document)."""
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        parts = [self.group_path]
        if self.namespaced and namespace:
            parts.append(f"namespaces/{namespace}")
        parts.append(self.plural)
        if name:
            parts.append(name)
        if subresource:
            parts.append(subresource)
        return "/".join(parts)


CONFIG_MAPS = Resource("", "v1", "configmaps")
SERVICES = Resource("", "v1", "services")
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts")
SECRETS = Resource("", "v1", "secrets")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies")
EVENTS = Resource("", "v1", "events")
NODES = Resource("", "v1", "nodes", namespaced=False)
DAEMON_SETS = Resource("apps", "v1", "daemonsets")
ROLE_BINDINGS = Resource("rbac.authorization.k8s.io", "v1", "rolebindings")
SERVICE_MONITORS = Resource("monitoring.coreos.com", "v1", "servicemonitors")
CACHES = Resource("flatcake.io", "v1alpha1", "flatcakecaches")
FLATCAKE_NODES = Resource("flatcake.io", "v1alpha1", "flatcakenodes")
BY_KIND = {
    "ConfigMap": CONFIG_MAPS,
    "Service": SERVICES,
    "ServiceAccount": SERVICE_ACCOUNTS,
    "DaemonSet": DAEMON_SETS,
    "RoleBinding": ROLE_BINDINGS,
    "ServiceMonitor": SERVICE_MONITORS,
    "NetworkPolicy": NETWORK_POLICIES,
    "FlatCakeNode": FLATCAKE_NODES,
}


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


class Kube:
    def __init__(self, client: kubernetes.client.ApiClient, user_agent: str) -> None:
        self.client = client
        self.client.user_agent = user_agent  # names the component in audit logs

    @classmethod
    def from_environment(cls, user_agent: str) -> Kube:
        """In-cluster service account when inside a pod, else the kubeconfig (as kubectl)."""
        try:
            kubernetes.config.load_incluster_config()  # type: ignore[no-untyped-call]
        except kubernetes.config.ConfigException:
            try:
                kubernetes.config.load_kube_config()  # type: ignore[no-untyped-call]
            except (kubernetes.config.ConfigException, OSError) as exc:
                raise RuntimeError(
                    f"no Kubernetes credentials ({exc}): run in a pod with a service account, or point "
                    "KUBECONFIG at a kubeconfig file"
                ) from None
        return cls(kubernetes.client.ApiClient(), user_agent)

    @classmethod
    def for_url(cls, url: str, user_agent: str) -> Kube:
        """An unauthenticated client for a local API (tests, `kubectl proxy`)."""
        config = kubernetes.client.Configuration()
        config.host = url.rstrip("/")
        config.verify_ssl = False
        return cls(kubernetes.client.ApiClient(config), user_agent)

    def request(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
                content_type: str = "application/json") -> Any:  # fmt: skip
        if query:
            path = f"{path}?{urllib.parse.urlencode(query)}"
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method_, url, headers, body_, _ = self.client.param_serialize(
            method, path, header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        response = self.client.call_api(method_, url, header_params=headers, body=body_, _request_timeout=30)
        data = response.read()  # type: ignore[no-untyped-call]
        if response.status >= 400:
            try:
                message = json.loads(data).get("message", data)
            except ValueError:
                message = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
            raise KubeError(response.status, method, path, str(message))
        return json.loads(data) if data else None

    def get(self, res: Resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            obj: dict[str, Any] = self.request("GET", res.path(namespace, name))
            return obj
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, res: Resource, namespace: str | None = None, selector: dict[str, str] | None = None
             ) -> list[dict[str, Any]]:  # fmt: skip
        """Objects matching every label in ``selector`` (equality only). The match is re-checked on
        the items, so a server (or test double) that ignores labelSelector cannot widen it."""
        selector = selector or {}
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))} if selector else None
        items: list[dict[str, Any]] = self.request("GET", res.path(namespace), query=query).get("items", [])
        return [o for o in items if selector.items() <= (o.get("metadata", {}).get("labels") or {}).items()]

    def create(self, res: Resource, body: dict[str, Any]) -> dict[str, Any]:
        obj: dict[str, Any] = self.request("POST", res.path(body["metadata"].get("namespace")), body)
        return obj

    def patch(self, res: Resource, namespace: str | None, name: str, body: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:  # fmt: skip
        obj: dict[str, Any] = self.request(
            "PATCH", res.path(namespace, name, subresource), body, content_type="application/merge-patch+json"
        )
        return obj

    def delete(self, res: Resource, namespace: str | None, name: str) -> bool:
        try:
            self.request("DELETE", res.path(namespace, name))
            return True
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise

    def has_resource(self, res: Resource) -> bool:
        """Whether the cluster serves this resource (discovery), e.g. a CRD that may be absent."""
        try:
            listing = self.request("GET", res.group_path)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return any(r.get("name") == res.plural for r in listing.get("resources", []))


def is_subset(wanted: Any, actual: Any) -> bool:
    """Whether every field of ``wanted`` is already in ``actual`` (the API server adds defaults, so
    equality is too strict to decide that nothing needs patching)."""
    if isinstance(wanted, dict):
        return isinstance(actual, dict) and all(k in actual and is_subset(v, actual[k]) for k, v in wanted.items())
    if isinstance(wanted, list):
        return (isinstance(actual, list) and len(wanted) == len(actual)
                and all(is_subset(w, a) for w, a in zip(wanted, actual, strict=True)))  # fmt: skip
    return bool(wanted == actual)


def apply(kube: Kube, body: dict[str, Any]) -> str:
    """Create the object, or merge-patch it when it differs; returns created | patched | unchanged."""
    res = BY_KIND[body["kind"]]
    meta = body["metadata"]
    existing = kube.get(res, meta.get("namespace"), meta["name"])
    if existing is None:
        kube.create(res, body)
        return "created"
    if is_subset(body, existing):
        return "unchanged"
    kube.patch(res, meta.get("namespace"), meta["name"], body)
    return "patched"
