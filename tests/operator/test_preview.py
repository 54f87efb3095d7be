"""``flatcake operator render``: what the operator would apply for a FlatCakeCache, offline (issue 31):
the CRD's defaults, the operator's checks, and the objects a reconcile applies, each a valid object."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from flatcake.cli import build_parser, main
from tests.support.helm import KUBERNETES

pytestmark = pytest.mark.unit

CACHE = """
apiVersion: flatcake.io/v1alpha1
kind: FlatCakeCache
metadata: {name: kv, namespace: serving}
spec:
  nodeSelector: {flatcake.io/node: "true"}
  kv: {layers: 28, pageBytes: 131072, pageTokens: 64}
  dram: {size: 8Gi, hugepageSize: 2Mi}
  ssd: {devices: [/dev/disk/by-id/nvme-A, /dev/disk/by-id/nvme-B], fileSize: 4Gi, fileCount: 16}
"""


def render(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    path = tmp_path / "cache.yaml"
    path.write_text(text)
    code = main(["operator", "render", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_render_shows_what_a_reconcile_applies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = render(tmp_path, CACHE, capsys)
    assert code == 0, err
    docs = list(yaml.safe_load_all(out))
    kinds = [d["kind"] for d in docs]
    assert kinds == ["ServiceAccount", "RoleBinding", "ConfigMap", "DaemonSet", "Service", "ServiceMonitor"]
    assert all(d["metadata"]["namespace"] == "serving" for d in docs)
    config = json.loads(next(d for d in docs if d["kind"] == "ConfigMap")["data"]["engine.json"])
    assert (config["layers"], config["page_bytes"], config["page_tokens"]) == (28, 131072, 64)
    assert config["dram"]["bytes"] == 8 << 30 and config["ssd"]["file_count"] == 16
    assert config["prepare"]["devices"] == ["/dev/disk/by-id/nvme-A", "/dev/disk/by-id/nvme-B"]
    assert config["placement"]["mode"] == "table2"  # the CRD's default, applied as the API server would
    for doc in docs:
        if doc["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_render_refuses_what_the_operator_refuses_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    both = CACHE.replace("fileSize: 4Gi", "directory: /mnt/kv, fileSize: 4Gi")
    code, out, err = render(tmp_path, both, capsys)
    assert code != 0 and not out and "spec.ssd" in err and "exactly one" in err
    small = CACHE.replace("fileSize: 4Gi", "fileSize: 64Ki")
    code, _, err = render(tmp_path, small, capsys)
    assert code != 0 and "spec.ssd.fileSize" in err
    code, _, err = render(tmp_path, "kind: ConfigMap\n", capsys)
    assert code != 0 and "expected a FlatCakeCache" in err


def test_the_operator_command_still_runs_by_default() -> None:
    args = build_parser().parse_args(["operator", "--namespace", "kv"])
    assert args.action == "run" and args.namespace == ["kv"]
    assert build_parser().parse_args(["operator", "render", "c.yaml"]).file == ["c.yaml"]


def test_render_refuses_what_the_api_server_would_naming_each_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 46: the CRD's own schema, offline. Misspelt fields were silently dropped; out-of-range and
    unlisted values rendered. Every problem is listed, an unknown field with its nearest known name."""
    bad = (
        CACHE.replace("hugepageSize: 2Mi", "hugePageSize: 2Mi")
        .replace("fileCount: 16", "fileCount: 100000")
        .replace("nodeSelector:", "nodeselector:")
        + "  placment: {mode: table2}\n  metrics: {port: 80}\n  wipePolicy: Sometimes\n"
    )
    code, out, err = render(tmp_path, bad, capsys)
    assert code != 0 and not out
    for line in (
        "spec.dram.hugePageSize: unknown field; did you mean spec.dram.hugepageSize?",
        "spec.nodeselector: unknown field; did you mean spec.nodeSelector?",
        "spec.placment: unknown field; did you mean spec.placement?",
        "spec.ssd.fileCount: 100000 is out of range; it must be <= 65536",
        "spec.metrics.port: 80 is out of range; it must be >= 1024",
        "spec.wipePolicy: 'Sometimes' is not one of",
    ):
        assert line in err, (line, err)
    code, _, err = render(tmp_path, CACHE.replace("  ssd:", "  sdd:"), capsys)
    assert code != 0 and "spec.sdd: unknown field; did you mean spec.ssd?" in err


def test_render_takes_the_namespace_flag_where_the_cache_names_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cache.yaml"
    path.write_text(CACHE.replace("metadata: {name: kv, namespace: serving}", "metadata: {name: kv}"))
    assert main(["operator", "render", str(path), "--namespace", "tenant-a"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert {d["metadata"]["namespace"] for d in docs} == {"tenant-a"}
