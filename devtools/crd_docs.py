"""docs/configuration.md's FlatCakeCache table, generated from the CRD (crds/*.yaml, the single source),
and the CRD read as a list of fields, which the test that every field carries a description walks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from flatcake.crds import schema

TABLE_BEGIN = "<!-- begin generated: devtools.crd_docs.markdown_table -->"
TABLE_END = "<!-- end generated -->"


@dataclass(frozen=True)
class Field:
    """One property: ``spec.ssd.devices[]`` for an array's items, ``spec.nodeSelector.*`` for the values
    of a map (``additionalProperties``)."""

    path: str
    schema: dict[str, Any]


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
