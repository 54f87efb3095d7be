"""The CRDs (crds/*.yaml, their single source) as a checkout holds them (``schema``), the API server's
structural defaulting (``apply_defaults``), which the operator's preview and the tests' API server apply,
and its schema checks (``problems``: unknown fields, types, bounds, enums, patterns), which the preview
runs first so that a typo is refused offline as ``kubectl apply`` would refuse it. docs/configuration.md's
table is generated from them by devtools/crd_docs.py."""

from __future__ import annotations

import copy
import difflib
from importlib import resources
from typing import Any

import jsonschema
import yaml

CRDS = "flatcake.crd_files"  # the package the checkout's crds/ folder installs as (pyproject.toml)


def schema(plural: str) -> dict[str, Any]:
    """The openAPIV3Schema of ``crds/<plural>.yaml`` (one version), as installed with the package."""
    crd = yaml.safe_load(resources.files(CRDS).joinpath(f"{plural}.yaml").read_text())
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


def _strict(schema: Any) -> Any:
    """The openAPIV3Schema as a JSON Schema that refuses unknown fields, as the API server does (it prunes
    them, and strict field validation refuses them): ``additionalProperties: false`` wherever an object
    lists its properties and keeps no unknown ones; int-or-string and the CEL rules left to the server."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if schema.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    return out


def problems(schema: dict[str, Any], obj: Any, path: str) -> list[str]:
    """What the API server would refuse in ``obj`` under ``schema`` (at ``path``, e.g. ``spec``): one line
    each, naming the field and the fix (an unknown field's nearest known name)."""
    validator = jsonschema.Draft202012Validator(_strict(schema))
    out = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path]):
        where = ".".join([path, *(str(p) for p in error.absolute_path)])
        if error.validator == "additionalProperties":
            known = sorted(error.schema.get("properties", {}))
            for name in sorted(set(error.instance) - set(known)):
                near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                hint = f"did you mean {where}.{near[0]}?" if near else f"known fields: {', '.join(known)}"
                out.append(f"{where}.{name}: unknown field; {hint}")
        elif error.validator in ("minimum", "maximum"):
            bound = ">=" if error.validator == "minimum" else "<="
            out.append(f"{where}: {error.instance!r} is out of range; it must be {bound} {error.validator_value}")
        elif error.validator == "enum":
            out.append(f"{where}: {error.instance!r} is not one of {', '.join(map(str, error.validator_value))}")
        elif error.validator == "pattern":
            out.append(f"{where}: {error.instance!r} does not match the pattern {error.validator_value}")
        else:
            out.append(f"{where}: {error.message}")
    return out
