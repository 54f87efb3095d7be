"""The Helm chart with the real helm (v4, from PyPI; bin/_bootstrap puts it in .venv/bin): lint,
render for several value combinations, and validate every manifest against the Kubernetes OpenAPI
schemas (kubernetes-validate, pinned version) and the FlatCake CRD schemas."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from devtools import chart
from tests.support.helm import KUBERNETES, helm, render
from tests.support.kube_api import admit

pytestmark = pytest.mark.system

CHART = chart.CHART
COMBINATIONS = {
    "defaults": [],
    "everything": [
        "--set",
        "exampleCache.enabled=true",
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "prometheusRule.enabled=true",
        "--set",
        "serviceMonitor.labels.release=kps",
        "--set",
        "operator.watchNamespaces={kv,bench}",
    ],
    "minimal": [
        "--set",
        "dashboards.enabled=false",
        "--set",
        "rbac.create=false",
        "--set",
        "serviceAccount.create=false",
        "--set",
        "serviceAccount.name=existing",
    ],
}
EXTERNAL_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_helm_lint_is_clean(name: str) -> None:
    out = helm("lint", "--strict", str(CHART), *COMBINATIONS[name])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_every_rendered_manifest_validates(name: str) -> None:
    docs = render(*COMBINATIONS[name])
    kinds = [(d["apiVersion"], d["kind"]) for d in docs]
    assert ("apps/v1", "Deployment") in kinds and kinds.count(
        ("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    ) == 2
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key == ("flatcake.io/v1alpha1", "FlatCakeCache"):
            admit("flatcake.io", "flatcakecaches", doc)  # the CRD's own schema
        elif key in EXTERNAL_KINDS:
            assert doc["spec"], doc  # Prometheus Operator CRDs are not in the Kubernetes schemas
        else:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    if name == "minimal":
        assert not {"ClusterRole", "ServiceAccount", "ConfigMap"} & {k for _, k in kinds}
        deployment = next(d for d in docs if d["kind"] == "Deployment")
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


def test_example_cache_on_devices_drops_the_default_directory() -> None:
    """Issue 31: devices given for the example cache replace its default directory (the CRD takes exactly
    one); the operator parses what is rendered; the install notes show a kv and no bare /dev/nvme0n1."""
    from flatcake.operator.spec import parse_spec

    docs = render("--set", "exampleCache.enabled=true", "--set",
                  "exampleCache.spec.ssd.devices={/dev/disk/by-id/nvme-A,/dev/disk/by-id/nvme-B}")  # fmt: skip
    cache = next(d for d in docs if d["kind"] == "FlatCakeCache")
    assert cache["spec"]["ssd"]["devices"] == ["/dev/disk/by-id/nvme-A", "/dev/disk/by-id/nvme-B"]
    assert "directory" not in cache["spec"]["ssd"]
    admitted = admit("flatcake.io", "flatcakecaches", cache)
    assert parse_spec(admitted["spec"]).devices == ("/dev/disk/by-id/nvme-A", "/dev/disk/by-id/nvme-B")
    default = next(d for d in render("--set", "exampleCache.enabled=true") if d["kind"] == "FlatCakeCache")
    assert default["spec"]["ssd"]["directory"] == "/mnt/flatcake" and default["spec"]["kv"]["pageBytes"] == 131072
    notes = helm("install", "fc", str(CHART), "--dry-run=client", "--namespace", "flatcake").stdout
    assert "kv: {layers:" in notes and "flatcake geometry" in notes and "/dev/nvme0n1" not in notes


def test_values_schema_names_the_bad_field() -> None:
    out = helm("template", "fc", str(CHART), "--set", "operator.resyncSeconds=1")
    assert out.returncode != 0 and "resyncSeconds" in out.stderr
    out = helm("template", "fc", str(CHART), "--set", "image.pullPolicy=Sometimes")
    assert out.returncode != 0 and "pullPolicy" in out.stderr
    out = helm("template", "fc", str(CHART), "--set", "operatr.resources=1")
    assert out.returncode != 0 and "operatr" in out.stderr


def test_chart_copies_are_current() -> None:
    assert chart.stale() == [], "the chart's copies are stale: run bin/generate"


def test_dashboard_config_maps_are_the_dashboards() -> None:
    """Issue 6: the chart's ConfigMaps carry exactly dashboards/*.json, labelled for Grafana's sidecar."""
    docs = [d for d in render() if d["kind"] == "ConfigMap"]
    sources = {p.name: json.loads(p.read_text()) for p in (chart.REPO / "dashboards").glob("*.json")}
    shipped = {}
    for cm in docs:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((key, text),) = cm["data"].items()
        shipped[key] = json.loads(text)
    assert shipped == sources and len(shipped) == 5


def test_prometheus_rule_carries_the_shipped_rules() -> None:
    rule = next(d for d in render("--set", "prometheusRule.enabled=true") if d["kind"] == "PrometheusRule")
    source = yaml.safe_load((chart.REPO / "dashboards" / "prometheus-rules.yml").read_text())
    assert rule["spec"] == source


def test_crds_validate_and_the_chart_ships_them() -> None:
    for path in sorted((chart.REPO / "crds").glob("*.yaml")):
        kubernetes_validate.validate(yaml.safe_load(path.read_text()), KUBERNETES, strict=True)
    shipped = {d["metadata"]["name"] for d in render() if d["kind"] == "CustomResourceDefinition"}
    assert shipped == {"flatcakecaches.flatcake.io", "flatcakenodes.flatcake.io"}


def test_notes_tell_what_to_apply_next() -> None:
    out = helm("install", "fc", str(CHART), "--dry-run=client", "--namespace", "flatcake")
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert "kind: FlatCakeCache" in notes and "kubectl label node" in notes
    assert '"hicache_storage_pass_prefix_keys": true' in notes  # SGLang's placement signals on


def test_name_overrides_and_operator_pod_options_render() -> None:
    """Issue 18: nameOverride/fullnameOverride, and the operator pod's priority, annotations, labels and
    pull secrets, each from values.yaml into the rendered Deployment (which still validates)."""
    docs = render("--set", "fullnameOverride=kv", "--set", "operator.priorityClassName=system-cluster-critical",
                  "--set", "operator.podAnnotations.team=infra", "--set", "operator.podLabels.tier=cache",
                  "--set-json", 'imagePullSecrets=[{"name": "regcred"}]')  # fmt: skip
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    kubernetes_validate.validate(deployment, KUBERNETES, strict=True)
    assert deployment["metadata"]["name"] == "kv-operator"
    pod = deployment["spec"]["template"]
    assert pod["spec"]["priorityClassName"] == "system-cluster-critical"
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["metadata"]["annotations"] == {"team": "infra"} and pod["metadata"]["labels"]["tier"] == "cache"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"  # the selector's labels stay
    named = render("--set", "nameOverride=cake")
    assert next(d for d in named if d["kind"] == "Deployment")["metadata"]["name"] == "fc-cake-operator"
    defaults = next(d for d in render() if d["kind"] == "Deployment")["spec"]["template"]
    assert "priorityClassName" not in defaults["spec"] and "annotations" not in defaults["metadata"]


def test_the_webhook_reaches_the_operators_handler_over_tls_it_trusts() -> None:
    """The pod-wiring webhook: the API server calls <release>-webhook on /inject (the handler's id) and
    trusts the CA in the configuration; the Service reaches the operator's port, whose certificate names
    the Service's host; only labelled pods are sent. Off, none of it is rendered."""
    import base64
    import subprocess

    docs = render("--set", "fullnameOverride=kv")
    by_kind = {d["kind"]: d for d in docs if d["kind"] in ("MutatingWebhookConfiguration", "Service", "Secret")}
    hook = by_kind["MutatingWebhookConfiguration"]["webhooks"][0]
    service = hook["clientConfig"]["service"]
    assert service["path"] == "/inject" and service["name"] == "kv-webhook"
    assert hook["objectSelector"]["matchExpressions"] == [{"key": "flatcake.io/cache", "operator": "Exists"}]
    assert hook["rules"][0]["resources"] == ["pods"] and hook["rules"][0]["operations"] == ["CREATE"]
    secret = by_kind["Secret"]["data"]
    assert hook["clientConfig"]["caBundle"] == secret["ca.crt"]
    shown = subprocess.run(["openssl", "x509", "-noout", "-ext", "subjectAltName"], input=base64.b64decode(
        secret["tls.crt"]), capture_output=True, check=True).stdout.decode()  # fmt: skip
    assert f"DNS:kv-webhook.{by_kind['Service']['metadata']['namespace']}.svc" in shown, shown
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FLATCAKE_WEBHOOK_PORT"] == "9443" and env["FLATCAKE_WEBHOOK_CERT"] == "/webhook/tls.crt"
    assert {"name": "webhook", "containerPort": 9443} in container["ports"]
    off = render("--set", "webhook.enabled=false")
    assert not [d for d in off if d["kind"] == "MutatingWebhookConfiguration"]
    op = next(d for d in off if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "FLATCAKE_WEBHOOK_PORT" not in {e["name"] for e in op["env"]}


def _strict_documents(text: str) -> list[dict]:
    """YAML documents, refusing a mapping with a key twice (PyYAML keeps the last one silently)."""

    class Strict(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict:
        keys = [loader.construct_object(k) for k, _ in node.value]
        dupes = {k for k in keys if keys.count(k) > 1}
        assert not dupes, f"duplicate keys {dupes} at line {node.start_mark.line + 1}"
        return loader.construct_mapping(node)

    Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return [d for d in yaml.load_all(text, Loader=Strict) if d]


def test_example_cache_names_each_field_once_and_passes_the_operators_checks(tmp_path) -> None:
    """Issue 46: with exampleCache.spec.image set the cache rendered image twice; a nodeSelector given was
    merged into the default label instead of replacing it. The rendered cache passes `flatcake operator
    render` (the CRD's schema offline, then the operator's own checks)."""
    from flatcake.cli import main

    values = ["--set", "exampleCache.enabled=true", "--set", "exampleCache.spec.image=registry.local/fc:2",
              "--set", "exampleCache.spec.nodeSelector.pool=kv"]  # fmt: skip
    out = helm("template", "fc", str(CHART), "--namespace", "flatcake", *values)
    assert out.returncode == 0, out.stderr
    cache = next(d for d in _strict_documents(out.stdout) if d["kind"] == "FlatCakeCache")
    assert cache["spec"]["image"] == "registry.local/fc:2" and cache["spec"]["nodeSelector"] == {"pool": "kv"}
    default = next(d for d in render("--set", "exampleCache.enabled=true") if d["kind"] == "FlatCakeCache")
    assert default["spec"]["nodeSelector"] == {"flatcake.io/node": "true"} and default["spec"]["image"]
    path = tmp_path / "cache.yaml"
    path.write_text(yaml.safe_dump(cache))
    assert main(["operator", "render", str(path)]) == 0
