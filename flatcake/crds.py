"""The CRDs (crds/*.yaml, their single source) as a checkout holds them (``schema``), and the API
server's structural defaulting (``apply_defaults``), which the operator's preview and the tests' API
server apply. docs/configuration.md's table is generated from them by devtools/crd_docs.py."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
CRDS = REPO / "crds"


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
