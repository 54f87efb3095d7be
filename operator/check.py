"""``flatcake operator check FILE...``: manifests checked offline as the API server would check them
(``kubectl create --dry-run=client`` checks nothing offline since 1.27). Built-in kinds against
Kubernetes' own schemas (the kubernetes-validate package: strict, so unknown fields are refused), the
project's kinds (FlatCakeCache, FlatCakeNode) against their CRDs (``crds.problems``). A kind with no
schema here (a ServiceMonitor, say) is named as not checked rather than passed in silence. What needs a
cluster (admission webhooks, CEL rules, quotas) is not done."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flatcake import crds
from flatcake.errors import ConfigError

KUBERNETES = "1.34"  # the version the chart and the docs target
GROUP = "flatcake.io"
PLURALS = {"FlatCakeCache": "flatcakecaches", "FlatCakeNode": "flatcakenodes"}


@dataclass
class Report:
    """What ``check`` found: problems (the API server would refuse these) and notes (kinds not checked)."""

    checked: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def check(sources: Iterable[tuple[str, str]], version: str = KUBERNETES) -> Report:
    """Check every YAML document of each ``(name, text)`` source."""
    report = Report()
    for name, text in sources:
        try:
            docs = list(yaml.safe_load_all(text))
        except yaml.YAMLError as exc:
            report.problems.append(f"{name}: not YAML ({exc})")
            continue
        for n, doc in enumerate(docs, 1):
            if doc is None:  # an empty document between separators
                continue
            where = f"{name}: document {n}"
            if not isinstance(doc, dict) or not isinstance(doc.get("kind"), str) or "apiVersion" not in doc:
                report.problems.append(f"{where}: not a Kubernetes object (apiVersion and kind are required)")
                continue
            what = f"{doc['kind']}/{(doc.get('metadata') or {}).get('name', '?')}"
            report.checked += 1
            found, note = _problems(doc, version)
            report.problems += [f"{where} ({what}): {p}" for p in found]
            if note:
                report.notes.append(f"{where} ({what}): {note}")
    return report


def _problems(doc: dict[str, Any], version: str) -> tuple[list[str], str]:
    kind, api = doc["kind"], str(doc["apiVersion"])
    if api.split("/")[0] == GROUP:
        if kind not in PLURALS:
            return [f"kind: {kind!r} is not a kind of {GROUP} (known: {', '.join(PLURALS)})"], ""
        # The CRD's schema describes metadata, spec and status; the API server checks apiVersion and kind.
        schema = crds.schema(PLURALS[kind])
        found = [f"{name}: required" for name in schema.get("required", []) if name not in doc]
        for name, sub in schema["properties"].items():
            if name in doc and name != "metadata":
                found += crds.problems(sub, doc[name], name)
        return found, ""
    try:
        import kubernetes_validate  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            "operator check: built-in kinds are checked with the kubernetes-validate package; install it "
            "(pip install 'flatcake[check]')"
        ) from None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [], f"not checked: no schema for {api} {kind} here (a custom resource of another project?)"
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path) or "(the object)"
        return [f"{path}: {exc.message} (Kubernetes {version})"], ""
    return [], ""


def read(paths: list[str], stdin: Any) -> list[tuple[str, str]]:
    """Each path's text (``-``: standard input), or a ConfigError naming the one that cannot be read."""
    out = []
    for path in paths:
        try:
            out.append((path, stdin.read() if path == "-" else Path(path).read_text()))
        except OSError as exc:
            raise ConfigError(f"operator check: cannot read {path} ({exc.strerror or exc})") from None
    return out
