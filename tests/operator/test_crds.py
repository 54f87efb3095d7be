"""Every CRD field is described (issue 18): `kubectl explain` is how operators read them."""

from __future__ import annotations

import pytest

from devtools import crd_docs
from flatcake import crds

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("plural", ["flatcakecaches", "flatcakenodes"])
def test_every_crd_field_has_a_description(plural: str) -> None:
    root = crds.schema(plural)
    found = list(crd_docs.fields(root))
    paths = {f.path for f in found}
    # The walk reaches nested objects, array items and their properties (else this test proves little).
    assert {"spec", "status", "status.conditions", "status.conditions[]", "status.conditions[].type"} <= paths
    assert str(root.get("description", "")).strip(), f"{plural}: the kind itself has no description"
    undescribed = [f.path for f in found if not str(f.schema.get("description", "")).strip()]
    assert not undescribed, f"crds/{plural}.yaml: fields without a description: {undescribed}"


def test_the_walk_covers_every_kind_of_nesting() -> None:
    paths = {f.path for f in crd_docs.fields(crds.schema("flatcakecaches"))}
    assert {"spec.ssd.devices[]", "spec.nodeSelector.*", "spec.metrics.serviceMonitor.interval",
            "spec.tolerations[]", "status.nodes[].nodeId", "metadata.name"} <= paths  # fmt: skip
    assert len(paths) >= 70


def test_descriptions_state_the_defaults_they_document() -> None:
    """A description that names a default names the schema's own (they are edited in one file)."""
    for f in crd_docs.fields(crds.schema("flatcakecaches")["properties"]["spec"]):
        if "default" in f.schema and not isinstance(f.schema["default"], dict | list):
            text = " ".join(str(f.schema["description"]).split())
            default = str(f.schema["default"]).lower()
            assert f"default {default}" in text.lower(), (f.path, f.schema["default"], text)
