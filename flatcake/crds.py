"""The CRDs (crds/*.yaml, their single source) read as lists of fields: what docs/configuration.md's
FlatCakeCache table is generated from (bin/generate), and what the test that every field carries a
description walks; and the API server's structural defaulting (``apply_defaults``), which the operator's
preview and the tests' API server apply."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CRDS = REPO / "crds"
TABLE_BEGIN = "<!-- begin generated: flatcake.crds.markdown_table -->"
TABLE_END = "<!-- end generated -->"


@dataclass(frozen=True)
class Field:
    """One property: ``spec.ssd.devices[]`` for an array's items, ``spec.nodeSelector.*`` for the values
    of a map (``additionalProperties``)."""

    path: str
    schema: dict[str, Any]


def schema(plural: str) -> dict[str, Any]:
    """The openAPIV3Schema of ``crds/<plural>.yaml`` (one version)."""
    crd = yaml.safe_load((CRDS / f"{plural}.yaml").read_text())
    versions = crd["spec"]["versions"]
    assert len(versions) == 1, "one served version: describe the others too when a second arrives"
    root: dict[str, Any] = versions[0]["schema"]["openAPIV3Schema"]
    return root


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting as the API server does it: absent properties with a default get it,
    then defaulting recurses into present (or just defaulted) objects and array items."""
    if isinstance(obj, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                obj[name] = apply_defaults(sub, obj[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in obj.keys() - schema.get("properties", {}).keys():
                obj[key] = apply_defaults(extra, obj[key])
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in obj]
    return obj


def fields(node: dict[str, Any], prefix: str = "") -> Iterator[Field]:
    """Every property below ``node``, depth first: nested objects, array items and map values."""
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        yield Field(path, sub)
        yield from _below(sub, path)


def _below(node: dict[str, Any], path: str) -> Iterator[Field]:
    yield from fields(node, path + ".")
    if isinstance(node.get("items"), dict):
        yield Field(path + "[]", node["items"])
        yield from _below(node["items"], path + "[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield Field(path + ".*", node["additionalProperties"])
        yield from _below(node["additionalProperties"], path + ".*")


def _type(s: dict[str, Any]) -> str:
    if "enum" in s:
        return " \\| ".join(str(v) for v in s["enum"])
    kind = str(s.get("type", "object"))
    return f"array of {_type(s['items'])}" if kind == "array" and isinstance(s.get("items"), dict) else kind


def markdown_table(plural: str = "flatcakecaches") -> str:
    """The spec's fields as the Markdown table in docs/configuration.md (regenerate with bin/generate):
    type or allowed values, default, and the description ``kubectl explain`` shows."""
    spec = schema(plural)["properties"]["spec"]
    rows = ["| spec field | type | default | description |", "|---|---|---|---|"]
    for f in fields(spec):
        if f.path.endswith((".*", "[]")):
            continue  # a map's values and an array's items are described with the field itself
        # An object with properties gets its defaults field by field, in the rows below it.
        shown = "default" in f.schema and "properties" not in f.schema
        default = f"`{json.dumps(f.schema['default'], ensure_ascii=False)}`" if shown else ""
        text = " ".join(str(f.schema.get("description", "")).split()).replace("|", "\\|")
        rows.append(f"| `{f.path}` | {_type(f.schema)} | {default} | {text} |")
    return "\n".join(rows)
