"""The operator's pure decisions: spec checks, NodeIDs, destructive changes, status, rendering."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from flatcake.errors import ConfigError
from flatcake.node_agent import geometry
from flatcake.node_agent.config import EngineConfig
from flatcake.operator import changes, inject, nodeids, render, scheduling
from flatcake.operator.spec import (
    AGENT_MEMORY_BYTES,
    SpecError,
    check_node_count,
    check_node_fit,
    parse_quantity,
    parse_spec,
)
from flatcake.operator.status import NodeReport, aggregate
from tests.support.kube_api import admit

CACHE = render.Cache("main", "kv", "uid-1")


def spec(**over: Any) -> dict[str, Any]:
    body = {"ssd": {"devices": ["/dev/nvme0n1"]}, "kv": {"layers": 43, "pageBytes": 12288}}
    body.update(over)
    admitted: dict[str, Any] = admit("flatcake.io", "flatcakecaches", {"spec": body})["spec"]  # CRD defaults
    return admitted


@pytest.mark.unit
def test_crd_defaults_render_a_config_the_agent_accepts() -> None:
    for ssd in ({"devices": ["/dev/nvme0n1", "/dev/nvme1n1"]}, {"directory": "/data/kv"}):
        for huge in ("2Mi", "1Gi", "none"):
            parsed = parse_spec(spec(ssd=ssd, dram={"hugepageSize": huge}))
            config = EngineConfig.from_dict(render.engine_config(parsed, CACHE))
            assert config.ssd.file_count == 64 and config.ssd.file_bytes == 1 << 30
            assert config.placement.agent_context_tokens == 32768 and config.io.gap_bytes == 65536
            assert config.dram.huge_pages == (huge != "none")
            assert config.cluster.cache == "main" and config.cluster.namespace == "kv"
            assert config.ssd.extent_policy == ("refuse" if "devices" in ssd else "warn")


@pytest.mark.unit
def test_spec_errors_name_the_field() -> None:
    cases = {
        "spec.ssd": spec(ssd={"devices": ["/dev/a"], "directory": "/x"}),
        "spec.dram.size": spec(dram={"size": "4Ki"}),
    }
    for field, body in cases.items():
        with pytest.raises(SpecError) as err:
            parse_spec(body)
        assert err.value.field == field, (field, str(err.value))
        assert isinstance(err.value, ConfigError)  # one family: the CLI and the agent's wire code know it
    broken = spec()
    del broken["kv"]["layers"]
    with pytest.raises(SpecError, match=r"spec\.kv\.layers: is required"):
        parse_spec(broken)
    with pytest.raises(SpecError, match="spec.dram.size"):
        parse_quantity("12GB", "spec.dram.size")


@pytest.mark.unit
def test_what_the_engine_config_refuses_names_the_spec_field() -> None:
    """The engine configuration's rules are checked once, by EngineConfig on the rendered config; its
    refusal comes back naming the spec field the user wrote, with the rule to satisfy."""
    cases = {
        "spec.ssd.lowWatermark": ({"ssd": {"devices": ["/dev/a"], "lowWatermark": 0.95}}, "low=0.95"),
        "spec.ssd.fileSize": ({"ssd": {"devices": ["/dev/a"], "fileSize": "64Ki"}}, "one page of all layers"),
        "spec.io.stagingSlotBytes": ({"io": {"stagingSlotBytes": 4096}}, "at least page_bytes"),
    }
    for field, (over, rule) in cases.items():
        parsed = parse_spec(spec(**over))  # the spec itself reads fine: only the engine knows the rule
        with pytest.raises(SpecError) as err:
            render.check_engine_config(render.engine_config(parsed, CACHE))
        assert err.value.field == field, (field, str(err.value))
        assert str(err.value).startswith(f"{field}: ") and rule in str(err.value), str(err.value)
    unmapped = render.spec_error(ConfigError("ssd.extent_policy: 'x' must be one of warn, refuse"))
    assert unmapped.field == "ssd.extent_policy"  # derived by the operator: the engine path is all there is


@pytest.mark.unit
def test_spec_fields_table_maps_engine_fields_to_crd_fields() -> None:
    from tests.support.kube_api import crd_schema

    def has(schema: dict[str, Any], path: list[str]) -> bool:
        return not path or (path[0] in schema.get("properties", {}) and has(schema["properties"][path[0]], path[1:]))

    spec_schema = crd_schema("flatcake.io", "flatcakecaches")["properties"]["spec"]
    for engine_path, spec_path in render.SPEC_FIELDS.items():
        head, _, pair = engine_path.partition("/")  # "ssd.low_watermark/high_watermark": a rule on two fields
        section = head.rpartition(".")[0]
        for path in [head, f"{section}.{pair}"] if pair else [head]:
            node: Any = EngineConfig()
            for name in path.split("."):
                assert hasattr(node, name), engine_path
                node = getattr(node, name)
        assert spec_path.startswith("spec.") and has(spec_schema, spec_path.split(".")[1:]), spec_path


@pytest.mark.unit
def test_the_crds_enums_are_the_engines_choices_and_adaptive_placement_reaches_the_agent() -> None:
    from flatcake.node_agent.constants import PLACEMENT_MODES
    from tests.support.kube_api import crd_schema

    props = crd_schema("flatcake.io", "flatcakecaches")["properties"]["spec"]["properties"]
    assert tuple(props["placement"]["properties"]["mode"]["enum"]) == PLACEMENT_MODES
    assert "scheduler" not in props  # a benchmark setting (flatcake emulate --scheduler), not the cache's
    assert render.engine_config(parse_spec(spec()), CACHE)["placement"]["mode"] == "table2"
    rendered = render.engine_config(parse_spec(spec(placement={"mode": "adaptive"})), CACHE)
    render.check_engine_config(rendered)
    assert rendered["placement"]["mode"] == "adaptive"
    stale = spec()  # admitted before the schema had the enum: the engine's check names the spec field
    stale["placement"]["mode"] = "lru"
    with pytest.raises(SpecError, match=r"^spec\.placement\.mode: .*table2, adaptive"):
        render.check_engine_config(render.engine_config(parse_spec(stale), CACHE))


@pytest.mark.unit
def test_node_fit_checks_hugepages_and_filesystem() -> None:
    parsed = parse_spec(spec(dram={"size": "2Gi"}))
    with pytest.raises(SpecError, match="spec.dram.size.*node-a.*hugepages-2Mi"):
        check_node_fit(parsed, "node-a", {"hugepages-2Mi": "1Gi"}, None)
    check_node_fit(parsed, "node-a", {"hugepages-2Mi": "2Gi"}, 64 << 30)
    reserving = parse_spec(spec(dram={"size": "2Gi"}, prepare={"restartKubelet": True}))
    check_node_fit(reserving, "node-a", {}, None)  # the agent reserves them
    with pytest.raises(SpecError, match="spec.ssd.fileCount"):
        check_node_fit(parsed, "node-a", {"hugepages-2Mi": "2Gi"}, 32 << 30)  # 64 x 1 GiB
    check_node_count(4096)
    with pytest.raises(SpecError, match="4096"):
        check_node_count(4097)


@given(
    st.lists(st.sampled_from([f"n{i}" for i in range(40)]), unique=True, max_size=40),
    st.lists(st.sampled_from([f"n{i}" for i in range(40)]), unique=True, max_size=40),
    st.lists(st.sampled_from([f"n{i}" for i in range(40)]), unique=True, max_size=40),
)
@pytest.mark.unit
def test_node_ids_are_stable_unique_and_never_reused_while_data_remains(
    first: list[str], second: list[str], holding: list[str]
) -> None:
    ids1 = nodeids.assign({}, first, [])
    ids2 = nodeids.assign(ids1, second, holding)
    assert len(set(ids2.values())) == len(ids2)  # unique
    for node, i in ids1.items():
        if node in second or node in holding:
            assert ids2[node] == i  # stable while selected or holding data
    released = {i for n, i in ids1.items() if n not in ids2}
    kept_holders = {ids1[n] for n in holding if n in ids1}
    assert not released & kept_holders
    assert set(second) <= ids2.keys()


@pytest.mark.unit
def test_node_ids_run_out_with_a_clear_error() -> None:
    full = {f"n{i}": i for i in range(4096)}
    with pytest.raises(SpecError, match="no NodeID left for node new"):
        nodeids.assign(full, [*full, "new"], [])
    assert nodeids.assign(full, ["new"], [])["new"] == 0  # nobody holds data: IDs are free again
    with pytest.raises(ValueError, match="not an integer"):
        nodeids.parse({"a": "x"})


@pytest.mark.unit
def test_destructive_changes() -> None:
    base = render.engine_config(parse_spec(spec()), CACHE)

    def with_(**over: Any) -> list[str]:
        found = changes.destructive_changes(base, render.engine_config(parse_spec(spec(**over)), CACHE))
        assert all(isinstance(c, changes.Change) and c.why for c in found)
        return [c.field for c in found]

    assert with_() == []
    assert with_(io={"gapBytes": 0}, placement={"agentContextTokens": 1000, "mode": "adaptive"}) == []
    assert with_(ssd={"devices": ["/dev/nvme0n1"], "fileCount": 128}) == []  # growing is safe
    assert with_(ssd={"devices": ["/dev/nvme1n1"]}) == ["spec.ssd.devices"]
    assert with_(ssd={"directory": "/data"}) == ["spec.ssd"]
    assert with_(ssd={"devices": ["/dev/nvme0n1"], "fileCount": 8}) == ["spec.ssd.fileCount"]
    assert with_(ssd={"devices": ["/dev/nvme0n1"], "fileSize": "2Gi"}) == ["spec.ssd.fileSize"]
    assert with_(kv={"layers": 80, "pageBytes": 12288}) == ["spec.kv"]


@pytest.mark.unit
def test_status_conditions_and_transitions() -> None:
    def report(node: str, ready: bool, error: str = "") -> NodeReport:
        return NodeReport(node, 0, ready, 1 << 30, 0, 64 << 30, 0, error)

    first = aggregate(selected=["a", "b"], reports=[report("a", True)], problem="", generation=1, previous={}, now="t1")
    assert first["phase"] == "Progressing" and first["readyNodes"] == "1/2"
    conds = {c["type"]: c for c in first["conditions"]}
    assert conds["Ready"]["status"] == "False" and conds["Progressing"]["status"] == "True"
    second = aggregate(
        selected=["a", "b"],
        reports=[report("a", True), report("b", True)],
        problem="",
        generation=1,
        previous=first,
        now="t2",
    )
    conds2 = {c["type"]: c for c in second["conditions"]}
    assert second["phase"] == "Ready" and conds2["Ready"]["lastTransitionTime"] == "t2"
    assert conds2["Degraded"]["lastTransitionTime"] == "t1"  # unchanged status keeps its time
    assert second["ssd"] == "128Gi" and second["dram"] == "2Gi"
    failing = aggregate(
        selected=["a"],
        reports=[report("a", False, "EIO on /dev/nvme0n1")],
        problem="",
        generation=1,
        previous=second,
        now="t3",
    )
    assert failing["phase"] == "Degraded" and "EIO" in failing["conditions"][2]["message"]
    invalid = aggregate(
        selected=["a"],
        reports=[],
        problem="spec.dram.size: too big",
        generation=2,
        previous=copy.deepcopy(second),
        now="t4",
    )
    assert invalid["phase"] == "Degraded" and invalid["conditions"][2]["reason"] == "InvalidSpec"
    assert invalid["observedGeneration"] == 2


@pytest.mark.unit
def test_agent_runs_with_no_privilege_but_ipc_lock() -> None:
    parsed = parse_spec(spec(dram={"size": "1Gi", "hugepageSize": "none"}))
    ds = render.daemon_set(parsed, CACHE, render.engine_config(parsed, CACHE))
    pod = ds["spec"]["template"]["spec"]
    agent = pod["containers"][0]
    assert agent["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
    assert agent["resources"]["limits"] == {"memory": str(AGENT_MEMORY_BYTES + (1 << 30))}  # tmpfs pool
    assert pod["hostPID"] is False
    assert not any(v["name"] == "hugepages" for v in pod["volumes"])
    assert any(m.get("mountPropagation") == "Bidirectional" for m in pod["initContainers"][0]["volumeMounts"])
    # In hugepages: the cache's own hugetlbfs, mounted by prepare in the run directory (Bidirectional, so
    # the host and then the agent see it), never the node-wide /dev/hugepages.
    huge = parse_spec(spec(dram={"size": "1Gi", "hugepageSize": "2Mi"}))
    config = render.engine_config(huge, CACHE)
    pod = render.daemon_set(huge, CACHE, config)["spec"]["template"]["spec"]
    assert config["dram"]["hugetlbfs_dir"] == f"{render.run_dir(CACHE)}/hugepages"
    assert not any(str(v.get("hostPath", {}).get("path", "")).startswith("/dev/hugepages") for v in pod["volumes"])
    prepare, agent = pod["initContainers"][0], pod["containers"][0]
    assert {m["name"]: m.get("mountPropagation") for m in prepare["volumeMounts"]}["run"] == "Bidirectional"
    assert {m["name"]: m.get("mountPropagation") for m in agent["volumeMounts"]}["run"] == "HostToContainer"


@pytest.mark.unit
def test_every_name_the_crd_admits_makes_valid_objects() -> None:
    """The longest and shortest names the schema admits make a valid Service name and label values;
    one longer, or not a DNS-1035 label, is refused by the schema and by the operator alike."""
    import jsonschema

    dns1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    for name in ("a", "z" + "9" * 53 + "x", "cache-" + "a" * 49):
        admit("flatcake.io", "flatcakecaches", {"metadata": {"name": name}, "spec": spec()})
        cache = render.Cache(name, "kv", "uid")
        render.check_cache(cache)
        parsed = parse_spec(spec())
        service = render.service(parsed, cache)["metadata"]["name"]
        assert len(service) <= 63 and dns1035.match(service)
        assert all(len(v) <= 63 for v in render.labels(cache).values())
    for name in ("a" * 56, "a.b", "1a", "a-", "A"):
        with pytest.raises(jsonschema.ValidationError):
            admit("flatcake.io", "flatcakecaches", {"metadata": {"name": name}, "spec": spec()})
        with pytest.raises(SpecError, match="^metadata.name: .* DNS-1035 label"):
            render.check_cache(render.Cache(name, "kv", "uid"))


@pytest.mark.unit
def test_a_socket_path_too_long_for_a_unix_socket_is_refused() -> None:
    render.check_cache(render.Cache("a" * 40, "n" * 41, "uid"))  # 81 together: 107 bytes
    with pytest.raises(SpecError, match=r"^metadata.name: the agent's socket .* 108 bytes, over the 107"):
        render.check_cache(render.Cache("a" * 41, "n" * 41, "uid"))


@pytest.mark.unit
def test_spec_values_that_land_in_labels_and_paths_are_checked() -> None:
    """The operator's own checks (a cache admitted before the schema had its patterns gets them too)."""
    cases: dict[str, tuple[tuple[str, ...], Any]] = {
        "spec.nodeSelector": (("nodeSelector",), {"bad key!": "x"}),
        "spec.nodeSelector.pool": (("nodeSelector",), {"pool": "-x"}),
        "spec.metrics.serviceMonitor.labels.release": (("metrics", "serviceMonitor", "labels"), {"release": "a b"}),
        "spec.ssd.devices[1]": (("ssd", "devices"), ["/dev/nvme0n1", "/dev/../etc/passwd"]),
        "spec.ssd.directory": (("ssd", "directory"), "/data/../etc"),
    }
    for field, (path, value) in cases.items():
        body = spec()  # admitted, then changed behind the schema's back
        node = body
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        if path[-1] == "directory":
            del body["ssd"]["devices"]
        with pytest.raises(SpecError, match=f"^{re.escape(field)}: "):
            parse_spec(body)
    ok = parse_spec(
        spec(
            nodeSelector={"example.com/pool": "fast_1.a"},
            ssd={"devices": ["/dev/disk/by-path/pci-0000:01:00.0-nvme-1"]},
        )
    )
    assert ok.devices == ("/dev/disk/by-path/pci-0000:01:00.0-nvme-1",)


@pytest.mark.unit
def test_hugepage_shares_are_one_host_folder_for_prepare_and_reclaim() -> None:
    """Caches on one node add their hugepage shares in one folder: every cache renders the same one."""
    parsed = parse_spec(spec())
    for cache in (CACHE, render.Cache("other", "ns2", "uid-2")):
        config = EngineConfig.from_dict(render.engine_config(parsed, cache))
        assert config.prepare.hugepage_shares_dir == render.HUGEPAGE_SHARES_DIR
        ds = render.daemon_set(parsed, cache, render.engine_config(parsed, cache))["spec"]["template"]["spec"]
        reclaim = render.reclaim_daemon_set(parsed, cache)["spec"]["template"]["spec"]
        for pod, container in ((ds, ds["initContainers"][0]), (reclaim, reclaim["containers"][0])):
            mount = next(m for m in container["volumeMounts"] if m["mountPath"] == render.HUGEPAGE_SHARES_DIR)
            volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
            assert volume["hostPath"]["path"] == render.HUGEPAGE_SHARES_DIR
        assert all(m["mountPath"] != render.HUGEPAGE_SHARES_DIR for m in ds["containers"][0]["volumeMounts"])


@pytest.mark.unit
def test_agent_probes_allow_a_long_recovery() -> None:
    # /healthz answers during recovery; a startup probe covers a slow start (issue 17, item 2), readiness
    # waits for /readyz, and liveness only counts once the agent has started.
    parsed = parse_spec(spec())
    agent = render.daemon_set(parsed, CACHE, render.engine_config(parsed, CACHE))["spec"]["template"]["spec"][
        "containers"
    ][0]
    startup = agent["startupProbe"]
    assert startup["httpGet"]["path"] == "/healthz"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # ten minutes to start
    assert agent["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert agent["livenessProbe"]["httpGet"]["path"] == "/healthz"
    reclaim = render.reclaim_daemon_set(parsed, CACHE)["spec"]["template"]["spec"]["containers"][0]
    assert "startupProbe" not in reclaim and "livenessProbe" not in reclaim


@pytest.mark.unit
def test_rendered_objects_validate_against_kubernetes_schemas() -> None:
    import kubernetes_validate

    from tests.support.helm import KUBERNETES

    for over in (
        {},
        {"ssd": {"directory": "/data"}, "dram": {"hugepageSize": "none"}},
        {"dram": {"hugepageSize": "1Gi", "size": "2Gi"}, "prepare": {"restartKubelet": True}},
        {"pod": POD_OPTIONS},
        {"crossNode": {"enabled": True, "port": 7600, "transferProtocol": "rdma", "transferDevice": "mlx5_0"}},
    ):
        parsed = parse_spec(spec(**over))
        config = render.engine_config(parsed, CACHE)
        objects = [
            render.config_map(CACHE, config),
            render.node_ids_map(CACHE, {"node-a": 0}),
            render.daemon_set(parsed, CACHE, config),
            render.reclaim_daemon_set(parsed, CACHE),
            render.service(parsed, CACHE),
            render.service_account(CACHE),
            render.role_binding(CACHE, "fc-flatcake-agent"),
            render.peer_secret(CACHE, "value"),
            render.network_policy(parsed, CACHE),
        ]
        for obj in objects:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)
        monitor = render.service_monitor(parsed, CACHE)
        assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
        # Prometheus names every agent target's job after this Service label (FlatCakeAgentDown uses it).
        assert render.service(parsed, CACHE)["metadata"]["labels"][monitor["spec"]["jobLabel"]] == render.AGENT_JOB


@pytest.mark.integration
def test_operator_without_credentials_is_one_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env |= {"KUBECONFIG": str(tmp_path / "missing"), "HOME": str(tmp_path)}
    exe = Path(sys.executable).parent / "flatcake"
    out = subprocess.run(
        [str(exe), "operator", "--namespace", "kv"], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert "no Kubernetes credentials" in out.stderr and "KUBECONFIG" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.unit
def test_ready_label_is_a_valid_label_key_for_any_cache_name() -> None:
    import re

    name_part = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")
    short = render.ready_label(render.Cache("main", "kv", ""))
    assert short == "ready.flatcake.io/kv.main"
    long = render.ready_label(render.Cache("c" * 200, "n" * 63, ""))
    other = render.ready_label(render.Cache("c" * 199 + "d", "n" * 63, ""))
    for key in (short, long, other):
        assert name_part.match(key.split("/", 1)[1]), key
    assert long != other


POD_OPTIONS: dict[str, Any] = {
    "priorityClassName": "system-node-critical",
    "annotations": {"example.com/team": "inference", "sidecar.istio.io/inject": "false"},
    "labels": {"team": "inference"},
    "imagePullSecrets": ["regcred"],
    "resources": {
        "agent": {"requests": {"cpu": "2"}, "limits": {"cpu": "4", "memory": "16Gi"}},
        "prepare": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
    },
}


@pytest.mark.unit
def test_pod_options_reach_the_agent_and_reclaim_pods() -> None:
    parsed = parse_spec(spec(dram={"size": "8Gi", "hugepageSize": "2Mi"}, pod=POD_OPTIONS))
    config = render.engine_config(parsed, CACHE)
    template = render.daemon_set(parsed, CACHE, config)["spec"]["template"]
    pod = template["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert template["metadata"]["labels"]["team"] == "inference"
    assert template["metadata"]["labels"]["flatcake.io/cache"] == "main"  # the selector's labels stay
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert template["metadata"]["annotations"]["flatcake.io/config-hash"] == render.config_hash(config)
    agent = pod["containers"][0]["resources"]
    # The user's CPU and a raised memory limit on top of what the DRAM pool needs (its hugepages).
    assert agent["requests"] == {"cpu": "2", "hugepages-2Mi": str(8 << 30), "memory": str(AGENT_MEMORY_BYTES)}
    assert agent["limits"] == {"cpu": "4", "hugepages-2Mi": str(8 << 30), "memory": "16Gi"}
    assert pod["initContainers"][0]["resources"] == POD_OPTIONS["resources"]["prepare"]
    reclaim = render.reclaim_daemon_set(parsed, CACHE)["spec"]["template"]
    assert reclaim["spec"]["priorityClassName"] == "system-node-critical"
    assert reclaim["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert reclaim["metadata"]["labels"]["team"] == "inference"
    assert reclaim["metadata"]["labels"]["app.kubernetes.io/component"] == "reclaim"
    # Without options the pod carries none of them (the cluster's defaults apply).
    plain = parse_spec(spec())
    bare = render.daemon_set(plain, CACHE, render.engine_config(plain, CACHE))["spec"]["template"]
    assert "priorityClassName" not in bare["spec"] and "imagePullSecrets" not in bare["spec"]
    assert "resources" not in bare["spec"]["initContainers"][0]
    assert set(bare["metadata"]["annotations"]) == {"flatcake.io/config-hash"}


@pytest.mark.unit
def test_bad_pod_options_name_the_field_and_the_fix() -> None:
    tmpfs = {"size": "4Gi", "hugepageSize": "none"}  # the pool is charged to the agent's memory
    cases: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
        "spec.pod.resources.agent.limits.memory": (
            {"resources": {"agent": {"limits": {"memory": "2Gi"}}}}, tmpfs, "below the 4.5Gi the agent needs"),
        "spec.pod.resources.agent.requests.memory": (
            {"resources": {"agent": {"requests": {"memory": "64Gi"}}}}, tmpfs, "exceeds its limit"),
        "spec.pod.resources.agent.limits.hugepages-2Mi": (
            {"resources": {"agent": {"limits": {"hugepages-2Mi": "1Gi"}}}}, {}, "follows spec.dram.size"),
        "spec.pod.resources.prepare.limits.cpu": (
            {"resources": {"prepare": {"limits": {"cpu": "two"}}}}, {}, "not a Kubernetes quantity"),
        "spec.pod.resources.prepare.requests.memory": (
            {"resources": {"prepare": {"requests": {"memory": "1Gi"}, "limits": {"memory": "1Mi"}}}}, {},
            "exceeds its limit"),
        "spec.pod.labels.flatcake.io/cache": ({"labels": {"flatcake.io/cache": "x"}}, {}, "operator's own"),
        "spec.pod.labels.app.kubernetes.io/component": (
            {"labels": {"app.kubernetes.io/component": "x"}}, {}, "operator's own"),
        "spec.pod.annotations.flatcake.io/config-hash": (
            {"annotations": {"flatcake.io/config-hash": "x"}}, {}, "set by the operator"),
    }  # fmt: skip
    for field, (pod, dram, why) in cases.items():
        body = spec(dram=dram) if dram else spec()
        body["pod"] = {**body["pod"], **pod}  # behind the schema's back where it would refuse first
        with pytest.raises(SpecError, match=f"^{re.escape(field)}: .*{why}"):
            parse_spec(body)
    # The schema refuses what it can see: a bad label value, a Secret name with capitals.
    import jsonschema

    for pod in ({"labels": {"team": "a b"}}, {"imagePullSecrets": ["RegCred"]},
                {"resources": {"agent": {"limits": {"cpu": 1.5}}}}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            admit("flatcake.io", "flatcakecaches", {"spec": spec(pod=pod)})


def _node(name: str, labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
          cordoned: bool = False) -> dict[str, Any]:  # fmt: skip
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": taints or [], "unschedulable": cordoned}}  # fmt: skip


@pytest.mark.unit
def test_nodes_without_an_agent_say_why_and_which_field_fixes_it() -> None:
    gpu = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    tainted = _node("gpu-1", taints=[gpu])
    why = scheduling.why_excluded(tainted, [], {})
    assert why is not None and "nvidia.com/gpu=present:NoSchedule" in why and "spec.tolerations" in why
    # Tolerated by key and value, by key with Exists, or by an empty key with Exists; not by another value.
    for toleration in ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                       {"key": "nvidia.com/gpu", "operator": "Exists"}, {"operator": "Exists"}):  # fmt: skip
        assert scheduling.why_excluded(tainted, [toleration], {}) is None, toleration
    assert scheduling.why_excluded(tainted, [{"key": "nvidia.com/gpu", "value": "absent"}], {}) is not None
    assert scheduling.why_excluded(tainted, [{"operator": "Exists", "effect": "NoExecute"}], {}) is not None
    # PreferNoSchedule never keeps a pod off; the taints every daemon pod tolerates do not either.
    soft = {"key": "x", "effect": "PreferNoSchedule"}
    pressure = {"key": "node.kubernetes.io/memory-pressure", "effect": "NoSchedule"}
    assert scheduling.why_excluded(_node("n", taints=[soft, pressure]), [], {}) is None
    cordoned = scheduling.why_excluded(_node("n", cordoned=True), [], {})
    assert cordoned is not None and "uncordon" in cordoned


@pytest.mark.unit
def test_required_node_affinity_narrows_the_nodes_and_preferred_terms_do_not() -> None:
    def required(*terms: dict[str, Any]) -> dict[str, Any]:
        return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}}

    h200 = _node("a", {"gpu": "h200", "nvme": "4"})
    a100 = _node("b", {"gpu": "a100", "nvme": "2"})
    terms = required({"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200", "b200"]}]})
    assert scheduling.why_excluded(h200, [], terms) is None
    why = scheduling.why_excluded(a100, [], terms)
    assert why is not None and "spec.affinity.nodeAffinity" in why
    # Terms are ORed, expressions in a term ANDed; Gt compares integers; matchFields names the node.
    either = required({"matchExpressions": [{"key": "nvme", "operator": "Gt", "values": ["3"]}]},
                      {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["b"]}]})  # fmt: skip
    assert scheduling.why_excluded(h200, [], either) is None and scheduling.why_excluded(a100, [], either) is None
    both = required({"matchExpressions": [{"key": "gpu", "operator": "Exists"},
                                          {"key": "nvme", "operator": "Lt", "values": ["3"]}]})  # fmt: skip
    assert scheduling.why_excluded(h200, [], both) is not None and scheduling.why_excluded(a100, [], both) is None
    assert scheduling.why_excluded(h200, [], required({})) is not None  # an empty term matches no node
    preferred = {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 1,
                    "preference": {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["b200"]}]},
                }
            ]
        }
    }
    assert scheduling.why_excluded(a100, [], preferred) is None
    # The spec carries it to the DaemonSet, and refuses terms the operator could not evaluate.
    parsed = parse_spec(spec(affinity=terms))
    ds = render.daemon_set(parsed, CACHE, render.engine_config(parsed, CACHE))
    assert ds["spec"]["template"]["spec"]["affinity"] == terms
    assert "affinity" not in render.daemon_set(parse_spec(spec()), CACHE, render.engine_config(parsed, CACHE))[
        "spec"]["template"]["spec"]  # fmt: skip
    bad = required({"matchExpressions": [{"key": "gpu", "operator": "Equals", "values": ["h200"]}]})
    with pytest.raises(SpecError, match=r"nodeSelectorTerms\[0\]\.matchExpressions\[0\]\.operator.*not one of In"):
        parse_spec(spec(affinity=bad))
    with pytest.raises(SpecError, match="Exists takes no values"):
        parse_spec(spec(affinity=required({"matchExpressions": [{"key": "g", "operator": "Exists", "values": ["x"]}]})))


@pytest.mark.unit
def test_status_lists_nodes_left_out_and_why() -> None:
    status = aggregate(selected=[], excluded={"gpu-1": "taint t:NoSchedule is not tolerated (add it to spec.tolerations)"},
                       reports=[], problem="", generation=1, previous={}, now="t")  # fmt: skip
    assert status["excludedNodes"] == ["gpu-1: taint t:NoSchedule is not tolerated (add it to spec.tolerations)"]
    progressing = {c["type"]: c for c in status["conditions"]}["Progressing"]
    assert progressing["reason"] == "NoNodes" and "spec.tolerations" in progressing["message"]
    many = aggregate(selected=["a"], excluded={f"n{i:03}": "cordoned" for i in range(50)}, reports=[], problem="",
                     generation=1, previous={}, now="t")  # fmt: skip
    assert len(many["excludedNodes"]) == 10


MODEL_CONFIGS = Path(__file__).parents[1] / "node_agent" / "model_configs"


@pytest.mark.unit
def test_kv_geometry_comes_from_the_named_model_and_given_bytes_are_cross_checked() -> None:
    llama70b = json.loads((MODEL_CONFIGS / "llama-3.1-70b-instruct.json").read_text())
    model = {"config": llama70b, "tensorParallel": 4}
    parsed = parse_spec(spec(kv={"model": model}))
    # 80 layers; 8 KV heads / 4 ranks x 128 dims x K and V x bf16 x 64 tokens = 65536 B a page-layer.
    assert (parsed.layers, parsed.page_bytes, parsed.page_tokens) == (80, 65536, 64)
    config = EngineConfig.from_dict(render.engine_config(parsed, CACHE))
    assert (config.layers, config.page_bytes) == (80, 65536)
    assert parse_spec(spec(kv={"model": model, "layers": 80, "pageBytes": 65536})).page_bytes == 65536  # agree
    with pytest.raises(SpecError, match=r"spec\.kv\.pageBytes: is 131072 but the model gives 65536 .*tensorParallel 4"):
        parse_spec(spec(kv={"model": model, "layers": 80, "pageBytes": 131072}))
    fp8 = parse_spec(spec(kv={"model": {**model, "kvCacheDtype": "fp8_e4m3"}, "pageTokens": 32}))
    assert fp8.page_bytes == 16384  # half the bytes a token, half the tokens a page
    deepseek = json.loads((MODEL_CONFIGS / "deepseek-v3.json").read_text())
    assert parse_spec(spec(kv={"model": {"config": deepseek, "tensorParallel": 8}})).layers == 61
    with pytest.raises(SpecError, match=r"spec\.kv\.model\.config: tp: 3 ranks cannot share 8 KV heads"):
        parse_spec(spec(kv={"model": {"config": llama70b, "tensorParallel": 3}}))
    with pytest.raises(SpecError, match=r"spec\.kv\.layers: is required without spec\.kv\.model"):
        parse_spec(spec(kv={"pageTokens": 64}))  # no silent default model any more


@pytest.mark.unit
def test_the_crds_kv_cache_dtypes_are_the_geometrys() -> None:
    crd = yaml.safe_load((Path(__file__).parents[2] / "crds" / "flatcakecaches.yaml").read_text())
    kv = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["kv"]
    assert kv["properties"]["model"]["properties"]["kvCacheDtype"]["enum"] == list(geometry.KV_DTYPES)
    assert "default" not in kv["properties"]["layers"] and "default" not in kv["properties"]["pageBytes"]


def _inference_pod() -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "sglang-0", "namespace": "serving", "labels": {inject.CACHE_LABEL: "main"},
                         "annotations": {inject.NAMESPACE_ANNOTATION: "kv"}},
            "spec": {"containers": [{"name": "sglang", "image": "lmsysorg/sglang:v0.5.3",
                                     "args": ["--hicache-storage-backend-extra-config",
                                              "$(FLATCAKE_HICACHE_EXTRA_CONFIG)"],
                                     "env": [{"name": "HF_HOME", "value": "/models"}],
                                     "volumeMounts": [{"name": "models", "mountPath": "/models"}]},
                                    {"name": "sidecar", "image": "busybox"}],
                     "volumes": [{"name": "models", "emptyDir": {}}],
                     "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                         "nodeSelectorTerms": [{"matchExpressions": [
                             {"key": "gpu", "operator": "In", "values": ["h200"]}]}]}}}}}  # fmt: skip


@pytest.mark.unit
def test_an_inference_pod_is_wired_to_its_cache_and_keeps_what_it_had() -> None:
    import kubernetes_validate

    from tests.support.helm import KUBERNETES

    parsed = parse_spec(spec(access={"gid": 2000}))
    wiring = render.pod_wiring(parsed, CACHE)
    pod = _inference_pod()
    assert inject.cache_of(pod, "serving") == ("kv", "main")
    mutated = inject.mutate(pod, wiring)
    assert pod == _inference_pod()  # a copy: the request's object is untouched
    sglang, sidecar = mutated["containers"]
    config = render.engine_config(parsed, CACHE)
    assert config["agent"]["group"] == "2000" and mutated["securityContext"]["supplementalGroups"] == [2000]
    env = {e["name"]: e.get("value") for e in sglang["env"]}
    assert env["HF_HOME"] == "/models" and env["FLATCAKE_SOCKET"] == config["agent"]["socket"]
    # Who the pod is, for the agent's per-pod cap (it cannot see a pod's pid): namespace/name, expanded by the
    # kubelet from the downward-API variables defined before it.
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sglang["env"] if "valueFrom" in e}
    assert refs == {"FLATCAKE_POD_NAMESPACE": "metadata.namespace", "FLATCAKE_POD_NAME": "metadata.name"}
    order = [e["name"] for e in sglang["env"]]
    assert env["FLATCAKE_CLIENT_ID"] == "$(FLATCAKE_POD_NAMESPACE)/$(FLATCAKE_POD_NAME)"
    assert order.index("FLATCAKE_CLIENT_ID") > max(order.index(n) for n in refs)
    extra = json.loads(env["FLATCAKE_HICACHE_EXTRA_CONFIG"])
    assert extra["socket"] == config["agent"]["socket"] and extra["class_name"] == "FlatCakeStorage"
    assert extra["hicache_storage_pass_prefix_keys"] is True  # SGLang passes prefix keys only for a JSON true
    # The backend's paths, at the agent's own paths: the socket's and DRAM pool's folder (with the cache's
    # own hugetlbfs in it), the pool files, the epoch file read-only; never the journal or the node's hugepages.
    paths = {m["mountPath"] for m in sglang["volumeMounts"]}
    run, state = os.path.dirname(config["agent"]["socket"]), config["agent"]["state_dir"]
    assert paths == {"/models", run, config["ssd"]["dir"], f"{state}/epoch"}
    assert config["dram"]["hugetlbfs_dir"] == f"{run}/hugepages"  # the default DRAM pool is in 2 MiB hugepages
    assert config["io"]["verify_reads"] == "all"  # pods write the pool: DRAM pages are checked on read too
    assert not any(state == p or state.startswith(p + "/") for p in paths - {f"{state}/epoch"})  # no journal
    assert not state.startswith(config["ssd"]["dir"]) and "/dev/hugepages" not in paths
    mounts = {m["mountPath"]: m for m in sglang["volumeMounts"]}
    assert mounts[f"{state}/epoch"].get("readOnly") is True and mounts[run]["mountPropagation"] == "HostToContainer"
    assert not any(m.get("readOnly") for p, m in mounts.items() if p != f"{state}/epoch")
    assert {m["mountPath"] for m in sidecar["volumeMounts"]} == paths - {"/models"}
    # ANDed into the pod's own required term: an h200 node whose agent is ready.
    (term,) = mutated["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = [e["key"] for e in term["matchExpressions"]]
    assert keys == ["gpu", render.ready_label(CACHE)]
    assert inject.mutate({**pod, "spec": mutated}, wiring) == mutated  # wiring twice adds nothing
    kubernetes_validate.validate({**pod, "spec": mutated}, KUBERNETES, strict=True)
    bare = inject.mutate({"spec": {"containers": [{"name": "c", "image": "i"}]}}, render.pod_wiring(parse_spec(
        spec(dram={"hugepageSize": "none", "size": "1Gi"})), CACHE))  # fmt: skip
    assert "securityContext" not in bare and "/dev/hugepages" not in {
        m["mountPath"] for m in bare["containers"][0]["volumeMounts"]
    }
    assert bare["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"] == [
        {"matchExpressions": [{"key": render.ready_label(CACHE), "operator": "In", "values": ["true"]}]}
    ]


@pytest.mark.unit
def test_a_pod_naming_an_absent_or_degraded_cache_is_refused_naming_the_fix() -> None:
    absent = inject.refusal("kv", "main", None)
    assert absent is not None and "no FlatCakeCache 'main' in namespace 'kv'" in absent and "annotation" in absent
    degraded = inject.refusal("kv", "main", {"status": {"phase": "Degraded", "problem": "spec.kv.layers: ..."}})
    assert degraded is not None and "Degraded (spec.kv.layers: ...)" in degraded
    assert inject.refusal("kv", "main", {"status": {"phase": "Progressing"}}) is None  # the affinity waits for it
    assert inject.refusal("kv", "", None) is not None


@pytest.mark.unit
def test_a_pod_of_another_namespace_is_wired_only_where_the_cache_allows_it() -> None:
    cache = {"spec": {"access": {"namespaces": ["team-a"]}}, "status": {"phase": "Ready"}}
    assert inject.refusal("kv", "main", cache, "kv") is None  # the cache's own namespace
    assert inject.refusal("kv", "main", cache, "team-a") is None
    why = inject.refusal("kv", "main", cache, "team-b")
    assert why is not None and "spec.access.namespaces does not list namespace 'team-b'" in why
    assert inject.refusal("kv", "main", {"spec": {"access": {"namespaces": ["*"]}}}, "team-b") is None
    assert inject.refusal("kv", "main", {"spec": {}}, "team-b") is not None  # default: its own namespace only
    assert parse_spec(spec(access={"namespaces": ["team-a", "*"]})).access_namespaces == ("team-a", "*")
    with pytest.raises(SpecError, match=r"spec.access.namespaces\[0\]: 'Team_A' is not a namespace name"):
        parse_spec(spec(access={"namespaces": ["Team_A"]}))


@pytest.mark.unit
def test_cross_node_reads_are_rendered_into_the_agents() -> None:
    """spec.crossNode: every agent serves other nodes at its pod IP on the port, with the transfer engine's
    transport; off (the default) nothing listens."""
    off = parse_spec(spec())
    assert "listen" not in render.engine_config(off, CACHE)["cluster"]
    agent = render.daemon_set(off, CACHE, render.engine_config(off, CACHE))["spec"]["template"]["spec"]["containers"][0]
    assert "--listen-host" not in agent["command"] and [p["name"] for p in agent["ports"]] == ["metrics"]
    on = parse_spec(spec(crossNode={"enabled": True, "port": 7600, "transferProtocol": "rdma",
                                    "prefillTokensPerSecond": 20000}))  # fmt: skip
    config = render.engine_config(on, CACHE)
    engine = EngineConfig.from_dict(config)  # the agent accepts it
    assert (engine.cluster.listen, engine.cluster.transfer_protocol) == ("0.0.0.0:7600", "rdma")
    assert engine.cluster.prefill_tokens_per_s == 20000.0
    agent = render.daemon_set(on, CACHE, config)["spec"]["template"]["spec"]["containers"][0]
    i = agent["command"].index("--listen-host")
    assert agent["command"][i + 1] == "$(POD_IP)" and {"name": "POD_IP"}.items() <= agent["env"][-1].items()
    assert {"name": "peers", "containerPort": 7600, "protocol": "TCP"} in agent["ports"]
    # The cache's peer secret: the agent reads it from a Secret volume that only the agents mount.
    assert engine.cluster.secret_file == f"{render.PEER_SECRET_DIR}/{render.PEER_SECRET_KEY}"
    pod = render.daemon_set(on, CACHE, config)["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "peer-secret")
    assert volume["secret"] == {"secretName": f"{CACHE.name}-peer-secret", "defaultMode": 0o400}
    assert {"name": "peer-secret", "mountPath": render.PEER_SECRET_DIR, "readOnly": True} in agent["volumeMounts"]
    secret = render.peer_secret(CACHE, "s3cret-value")
    assert secret["kind"] == "Secret" and secret["metadata"]["ownerReferences"] == [CACHE.owner_reference()]
    # Only the cache's pods, from the namespaces allowed to use it, reach the agents (the transfer engine's
    # ports check nobody); the metrics port is open to scrapers.
    policy = render.network_policy(on, CACHE)
    assert any(o["kind"] == "NetworkPolicy" for o in render.objects(on, CACHE, config, "role", False))
    assert not any(o["kind"] == "NetworkPolicy" for o in render.objects(off, CACHE, config, "role", False))
    peers_rule, metrics_rule = policy["spec"]["ingress"]
    (source,) = peers_rule["from"]
    assert source["podSelector"] == {"matchLabels": {"flatcake.io/cache": CACHE.name}}
    assert source["namespaceSelector"]["matchExpressions"][0]["values"] == [CACHE.namespace]
    assert metrics_rule == {"ports": [{"port": on.metrics_port, "protocol": "TCP"}]}
    shared = parse_spec(spec(crossNode={"enabled": True}, access={"namespaces": ["team-a"]}))
    allowed = render.network_policy(shared, CACHE)["spec"]["ingress"][0]["from"][0]["namespaceSelector"]
    assert allowed["matchExpressions"][0]["values"] == [CACHE.namespace, "team-a"]
    assert not any(
        v["name"] == "peer-secret"
        for v in render.daemon_set(off, CACHE, render.engine_config(off, CACHE))["spec"]["template"]["spec"]["volumes"]
    )


@pytest.mark.unit
def test_the_peer_secret_is_created_once_and_never_rewritten() -> None:
    from flatcake import kube as K
    from flatcake.operator import handlers

    class Recording:
        def __init__(self) -> None:
            self.objects: dict[str, dict] = {}

        def get(self, res: K.Resource, namespace: str | None, name: str) -> dict | None:
            return self.objects.get(f"{res.plural}/{namespace}/{name}")

        def create(self, res: K.Resource, body: dict) -> dict:
            meta = body["metadata"]
            self.objects[f"{res.plural}/{meta['namespace']}/{meta['name']}"] = body
            return body

    kube = Recording()
    handlers.ensure_peer_secret(kube, CACHE)  # type: ignore[arg-type]
    (first,) = kube.objects.values()
    value = first["stringData"]["secret"]
    assert len(value) >= 32
    handlers.ensure_peer_secret(kube, CACHE)  # type: ignore[arg-type]
    assert list(kube.objects.values()) == [first] and first["stringData"]["secret"] == value
