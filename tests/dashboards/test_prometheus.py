"""Every dashboard query, and the shipped rules, against a real Prometheus scraping real processes:
a node agent, an emulator that is its client, the Locust replay's own metrics endpoint, and a real
SGLang server (CPU) whose FlatCake backend uses a second agent (the Overview dashboard and the hit-rate
alerts read SGLang's own series). Queries
are sent as Grafana sends them: variables replaced, `$__rate_interval` computed from the scrape
interval (devtools.dashboards.concrete)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from devtools import dashboards as D
from flatcake.errors import ProtocolError
from flatcake.loadgen.bench import e2e
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.replay.run import LoadgenConfig
from flatcake.loadgen.replay.run import run as run_locust
from flatcake.loadgen.serve.model import make_model
from flatcake.loadgen.serve.server import SGLangServer
from flatcake.net import free_port
from flatcake.node_agent.service.client import AgentConnection
from flatcake.operator.render import AGENT_JOB
from tests.support.agents import AgentThread
from tests.support.emulators import Server
from tests.support.engines import small_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.system

RULES = D.ROOT / "prometheus-rules.yml"
SCRAPE_S = 1.0
# Grafana's $__interval for a panel is the time range over its width in points, at least the scrape
# interval; 5 s is what a 1 h range gets on a wide panel. $__rate_interval is then 6 s here.
RATE_INTERVAL_S = D.rate_interval(SCRAPE_S, interval_s=5.0)


def query(base: str, expr: str, at: float | None = None) -> dict:
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode(params)
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def test_every_panel_query_returns_data(tmp_path: Path, agent_thread: Callable[..., AgentThread]) -> None:
    assert shutil.which("prometheus"), "bin/test installs Debian's prometheus package"
    agent = agent_thread(layers=4, page_bytes=16384, files=64, file_bytes=4 << 20, dram_bytes=4 << 20)
    emu = Server(EmulatorConfig(mode="flatcake", data_dir=str(tmp_path / "emu"), agent_socket=agent.socket,
                                hbm_bytes=2 << 20, prefill_tokens_per_s=50_000.0))  # fmt: skip
    # SGLang's FlatCake backend on an agent of the model's geometry: 4 layers, 64-token pages of one KV
    # head of 64 dims in bf16 (16 KiB a layer).
    sglang_agent = AgentThread(small_config(tmp_path / "node-sglang", layers=4, page_bytes=16384, page_tokens=64,
                                            files=16, file_bytes=4 << 20, dram_bytes=4 << 20))  # fmt: skip
    backend = {"backend_name": "flatcake", "module_path": "flatcake.node_agent.sglang", "class_name": "FlatCakeStorage",
               "socket": sglang_agent.socket, "interface_v1": True}  # fmt: skip
    server = SGLangServer(make_model(tmp_path / "model", layers=4, kv_heads=1), workdir=tmp_path / "sglang",
                          storage_backend="dynamic", storage_config=backend)  # fmt: skip
    loadgen_port, prom_port = free_port(), free_port()
    targets = [f"127.0.0.1:{p}" for p in (emu.port, loadgen_port, server.port)]
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": f"{SCRAPE_S:.0f}s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        # Each agent's node name as the ServiceMonitor's relabeling gives it (operator/render.py).
        "scrape_configs": [{"job_name": AGENT_JOB, "static_configs": [
                               {"targets": [f"127.0.0.1:{agent.port}"], "labels": {"node": "node-a"}},
                               {"targets": [f"127.0.0.1:{sglang_agent.port}"], "labels": {"node": "node-b"}}]},
                           {"job_name": "flatcake", "static_configs": [{"targets": targets}]}],
    }))  # fmt: skip
    prom = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    base = f"http://127.0.0.1:{prom_port}"
    try:
        server.start()

        def ready() -> bool:
            assert prom.poll() is None, "prometheus exited at start"
            try:
                urllib.request.urlopen(base + "/-/ready", timeout=2)
                return True
            except OSError:
                return False

        wait_until(ready, what="prometheus to start")
        conn = AgentConnection(agent.socket)
        with pytest.raises(ProtocolError):  # one refused request, so the error panel has a series
            conn.call("stats")
        conn.close()
        # SGLang: a prompt computed, written to FlatCake, flushed from the device and host tiers and asked
        # again, so its cached tokens have every source (device on the warm-up, storage here).
        server.warm_up()
        prompt = list(range(3, 3 + 1024))
        before = server.backed_up_tokens()
        server.generate(input_ids=prompt)
        server.wait_backed_up(before + 960)
        server.flush_cache()
        assert server.generate(input_ids=prompt).cached_storage
        server.generate(input_ids=prompt)  # from the device
        # Once Prometheus has the device series, one more device hit: a rate needs an increase between
        # two scrapes, and a series' first sample already holds its first counts.
        wait_until(lambda: query(base, 'sglang_cached_tokens_total{cache_source="device"}')["data"]["result"],
                   what="Prometheus to scrape SGLang's cached tokens")  # fmt: skip
        server.generate(input_ids=prompt)
        rc = run_locust(LoadgenConfig(host=f"http://127.0.0.1:{emu.port}", trace=str(e2e.BUNDLED), qps=3.0,
                                      system="flatcake", results=str(tmp_path / "r.jsonl"), limit=24,
                                      metrics_port=loadgen_port, margin_s=60))  # fmt: skip
        assert rc == 0
        # Queries are evaluated at the end of the replay: Locust's endpoint is gone afterwards, and a
        # window of $__rate_interval ending later would hold none of its samples.
        replayed = time.time()
        # All (Grafana sends ".*") and one value picked per variable: the emulator's and load
        # generator's system, the agent's node.
        picks = (
            {"system": ".*", "node": ".*", "model": ".*"},
            {"system": "flatcake", "node": "node-a", "model": ".*"},
        )
        rules_shipped = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])

        def observed() -> tuple[int, list[tuple[str, str]], list[dict[str, str]]]:
            """Targets up, dashboard queries without data, and the loaded rules, as Prometheus sees them."""
            empty = []
            for name in D.NAMES:
                for expr in D.expressions(D.render(name)):
                    for values in picks:
                        concrete = D.concrete(expr, values, RATE_INTERVAL_S)
                        answer = query(base, concrete, at=replayed)
                        assert answer["status"] == "success", (name, concrete, answer)
                        if not answer["data"]["result"]:
                            empty.append((name, concrete))
            rules = json.loads(urllib.request.urlopen(base + "/api/v1/rules", timeout=10).read())["data"]["groups"]
            loaded = [r for g in rules for r in g["rules"]]
            return len(query(base, "up == 1")["data"]["result"]), empty, loaded

        def settled() -> bool:  # scrapes after the replay and a rule evaluation: every panel has data
            up, empty, loaded = observed()
            healthy = all(r["health"] == "ok" for r in loaded)
            return up == 4 and not empty and len(loaded) == rules_shipped and healthy

        with contextlib.suppress(AssertionError):  # on timeout, the asserts below say what is missing
            wait_until(settled, what="scrapes and rule evaluations after the replay", poll=1.0)
        up, empty, loaded = observed()
        assert up == 4  # two agents, the emulator and SGLang; Locust has exited
        assert not empty, empty
        assert len(loaded) == rules_shipped == 11 and all(r["health"] == "ok" for r in loaded), loaded
        # FlatCakeAgentDown's selector matches the agent's target, which is up: the alert is silent.
        assert [s["value"][1] for s in query(base, f'up{{job="{AGENT_JOB}"}}')["data"]["result"]] == ["1", "1"]
        assert not query(base, 'ALERTS{alertname="FlatCakeAgentDown"}')["data"]["result"]
        hit = query(base, "flatcake:cache_hit_rate:rate5m")["data"]["result"]
        assert hit and 0 < float(hit[0]["value"][1]) <= 1
    finally:
        prom.terminate()
        prom.wait(30)
        emu.stop()
        server.stop()
        sglang_agent.stop()
