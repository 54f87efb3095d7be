"""``flatcake operator check``: manifests checked offline as the API server would (issue 46): built-in
kinds against Kubernetes' schemas, FlatCake's kinds against their CRDs (shipped as package data)."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from flatcake.cli import main
from flatcake.errors import ConfigError
from flatcake.operator import check

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = {
    "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
    "spec": {"selector": {"matchLabels": {"app": "web"}},
             "template": {"metadata": {"labels": {"app": "web"}},
                          "spec": {"containers": [{"name": "c", "image": "nginx"}]}}},
}  # fmt: skip
CACHE = {"apiVersion": "flatcake.io/v1alpha1", "kind": "FlatCakeCache", "metadata": {"name": "kv"},
         "spec": {"ssd": {"directory": "/mnt/kv"}}}  # fmt: skip


def run(*docs: object) -> check.Report:
    return check.check([("m.yaml", yaml.safe_dump_all(docs))])


@pytest.mark.unit
def test_valid_objects_pass_and_a_foreign_kind_is_named_not_passed_in_silence() -> None:
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "m"}}
    r = run(DEPLOYMENT, CACHE, monitor)
    assert r.problems == [] and r.checked == 3
    assert len(r.notes) == 1 and "ServiceMonitor/m" in r.notes[0] and "not checked" in r.notes[0]


@pytest.mark.unit
def test_built_in_kinds_refuse_unknown_fields_and_wrong_types_naming_the_path() -> None:
    typo = yaml.safe_load(yaml.safe_dump(DEPLOYMENT))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    wrong = yaml.safe_load(yaml.safe_dump(DEPLOYMENT))
    wrong["spec"]["replicas"] = "two"
    r = run(typo, wrong)
    assert len(r.problems) == 2
    assert "document 1 (Deployment/web)" in r.problems[0] and "imagePullPolicyy" in r.problems[0]
    assert "spec.replicas" in r.problems[1] and "'two'" in r.problems[1]


@pytest.mark.unit
def test_flatcake_kinds_are_checked_against_their_crds() -> None:
    typo = {**CACHE, "spec": {"ssd": {"directory": "/mnt/kv"}, "placment": {"mode": "table2"},
                              "metrics": {"port": 80}}}  # fmt: skip
    r = run(typo, {**CACHE, "kind": "FlatCakeCach"}, {k: v for k, v in CACHE.items() if k != "spec"})
    assert any("spec.placment: unknown field; did you mean spec.placement?" in p for p in r.problems)
    assert any("spec.metrics.port: 80 is out of range; it must be >= 1024" in p for p in r.problems)
    assert any("'FlatCakeCach' is not a kind of flatcake.io" in p for p in r.problems)
    assert any("document 3" in p and "spec: required" in p for p in r.problems)


@pytest.mark.unit
def test_what_is_not_an_object_is_a_problem_and_an_unreadable_file_names_itself(tmp_path: Path) -> None:
    r = check.check([("a.yaml", "just a string\n---\n"), ("b.yaml", "key: [unclosed\n")])
    assert [p.split(":")[0] for p in r.problems] == ["a.yaml", "b.yaml"]
    assert "not a Kubernetes object" in r.problems[0] and "not YAML" in r.problems[1]
    with pytest.raises(ConfigError, match=r"cannot read .*missing\.yaml"):
        check.read([str(tmp_path / "missing.yaml")], io.StringIO())


@pytest.mark.unit
def test_rendered_examples_pass_and_the_exit_code_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["operator", "render", str(ROOT / "examples" / "cache-qwen2.5-7b.yaml")]) == 0
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(capsys.readouterr().out)
    # As a person reads it: engine.json a literal block, no YAML anchors for the env both containers share.
    assert "engine.json: |" in rendered.read_text() and "&id" not in rendered.read_text()
    assert main(["operator", "check", str(rendered), *map(str, sorted((ROOT / "crds").glob("*.yaml")))]) == 0
    assert "0 problems" in capsys.readouterr().err
    broken = rendered.read_text().replace("serviceAccountName:", "serviceAcountName:", 1)
    monkeypatch.setattr(sys, "stdin", io.StringIO(broken))
    assert main(["operator", "check", "-"]) == 1
    out = capsys.readouterr()
    assert "DaemonSet" in out.out and "serviceAcountName" in out.out and "1 problems" in out.err


@pytest.mark.integration
def test_the_crds_ship_in_the_wheel(tmp_path: Path) -> None:
    """`operator render`/`check` read the CRDs from the package: a wheel (as the image installs) has them."""
    src = tmp_path / "src"  # a copy: setuptools leaves build/ beside the sources it builds
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "results"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                   check=True)  # fmt: skip
    (wheel,) = tmp_path.glob("flatcake-*.whl")
    with zipfile.ZipFile(wheel) as z:
        for crd in sorted((ROOT / "crds").glob("*.yaml")):
            assert z.read(f"flatcake/crd_files/{crd.name}") == crd.read_bytes()
        # and every source module, the CLI's package among them (the package list in pyproject.toml is by hand)
        shipped = {n for n in z.namelist() if n.endswith(".py")}
    assert {f"flatcake/cli/{p.name}" for p in (ROOT / "flatcake" / "cli").glob("*.py")} <= shipped
    assert "flatcake/node_agent/catalog/interface.py" in shipped and "flatcake/loadgen/simulate/native.py" in shipped
