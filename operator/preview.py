"""``flatcake operator render CACHE.yaml``: what the operator would apply for a FlatCakeCache, without
a cluster. The spec gets the CRD's defaults (as the API server gives them), then the operator's own
path: its spec checks, the engine configuration and the agent's rules on it, and the objects a
reconcile applies (``render.objects``). First the API server's schema checks, offline, against the CRD's
own schema (``crds.problems``: unknown fields with the nearest known name, types, bounds, enums, patterns;
every problem listed). What needs the cluster is not done: the nodes' fit (hugepages, filesystem size),
the NodeID map, and the CRD's CEL rules (``kubectl apply --dry-run=server`` runs those)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from flatcake import crds
from flatcake.errors import ConfigError
from flatcake.operator import render
from flatcake.operator.spec import parse_spec

KIND = "FlatCakeCache"


def load_crd_schema(path: str | Path | None = None) -> dict[str, Any]:
    """The FlatCakeCache openAPIV3Schema: from ``path`` (a CRD YAML, e.g. the chart's
    ``crds/flatcakecaches.yaml``, or ``kubectl get crd flatcakecaches.flatcake.io -o yaml``), else from
    this checkout's ``crds/``."""
    if path is None:
        try:
            return crds.schema("flatcakecaches")
        except FileNotFoundError:
            raise ConfigError(
                "--crd: no crds/ beside this installation; give the CRD's YAML (the chart's "
                "crds/flatcakecaches.yaml, or kubectl get crd flatcakecaches.flatcake.io -o yaml)"
            ) from None
    try:
        crd = yaml.safe_load(Path(path).read_text())
        schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    except (OSError, yaml.YAMLError, KeyError, TypeError, IndexError) as exc:
        raise ConfigError(f"--crd: {path} is not a CustomResourceDefinition's YAML ({exc})") from None
    return schema


def objects(
    body: dict[str, Any], schema: dict[str, Any], agent_cluster_role: str, namespace: str = "default"
) -> list[dict[str, Any]]:
    """The objects the operator would apply for ``body`` (a FlatCakeCache, as YAML gives it), in its
    ``metadata.namespace`` or else ``namespace`` (``kubectl apply -n``'s)."""
    kind = body.get("kind") if isinstance(body, dict) else type(body).__name__
    if not isinstance(body, dict) or kind != KIND:
        raise ConfigError(f"kind: expected a {KIND} (apiVersion flatcake.io/v1alpha1), got {kind!r}")
    meta = body.get("metadata") or {}
    cache = render.Cache(str(meta.get("name", "")), str(meta.get("namespace") or namespace), "preview")
    render.check_cache(cache)
    spec_schema = schema["properties"]["spec"]
    unknown = sorted(set(body) - {"apiVersion", "kind", "metadata", "spec", "status"})
    found = [f"{name}: unknown top-level field of a {KIND}" for name in unknown]
    found += crds.problems(spec_schema, body.get("spec") or {}, "spec")
    if found:
        raise ConfigError(f"{len(found)} field(s) the API server would refuse:\n  " + "\n  ".join(found))
    spec = parse_spec(crds.apply_defaults(spec_schema, copy.deepcopy(dict(body.get("spec") or {}))))
    config = render.engine_config(spec, cache, wipe=spec.wipe_policy == "Wipe")
    render.check_engine_config(config)
    return render.objects(spec, cache, config, agent_cluster_role, spec.service_monitor)


class _Dumper(yaml.SafeDumper):
    """YAML as a person reads it back: no anchors for objects used twice (the env both containers share),
    multi-line strings (engine.json) as literal blocks rather than one escaped line."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_Dumper.add_representer(str, _str)


def dump(objects: list[dict[str, Any]]) -> str:
    """The objects as ``kubectl apply -f`` takes them."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False)
