"""The benchmarking platform's moving parts: emulator API conformance, replay timing, loopback-only
targets, the report and one small end-to-end run through Locust."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from flatcake.errors import ConfigError
from flatcake.loadgen.bench import e2e, emulated
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.core import page_keys
from flatcake.loadgen.emulator.storage import engine_config
from flatcake.loadgen.replay.requests import prompt_tokens, schedule
from flatcake.loadgen.replay.run import LoadgenConfig, check_loopback, command
from flatcake.loadgen.report import build as R
from flatcake.loadgen.traces.formats import TraceRequest, read_trace
from tests.support.emulators import Server

pytestmark = pytest.mark.integration


@pytest.fixture(params=["flatcake", "tiered"])
def emulator(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Server]:
    server = Server(EmulatorConfig(mode=request.param, data_dir=str(tmp_path), ssd_bytes=256 << 20,
                                   scope_file_bytes=4 << 20, decode_tokens_per_s=1000.0))  # fmt: skip
    yield server
    server.stop()


def test_an_openai_client_streams_from_the_emulator(emulator: Server) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{emulator.port}/v1", api_key="unused")
    prompt = list(range(2000))
    seen = []
    for _ in range(2):
        stream = client.completions.create(model="m", prompt=prompt, max_tokens=4, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = next(c.usage for c in chunks if c.usage)
        assert text.split() == ["t00", "t01", "t02", "t03"]
        assert usage.prompt_tokens == 2000 and usage.completion_tokens == 4
        seen.append(usage.prompt_tokens_details.cached_tokens)  # type: ignore[union-attr]
    assert seen == [0, 1792]  # the second time, all seven full 256-token pages are cached
    full = client.completions.create(model="m", prompt=prompt, max_tokens=2)
    assert full.choices[0].finish_reason == "length" and full.usage is not None


def test_generate_and_bad_requests(emulator: Server) -> None:
    import urllib.error
    import urllib.request

    def post(path: str, payload: object) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://127.0.0.1:{emulator.port}{path}", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    status, body = post("/generate", {"input_ids": list(range(600)), "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and body["text"].split() == ["t00", "t01", "t02"] and body["meta_info"]["prompt_tokens"] == 600
    assert post("/v1/completions", {"prompt": [1.5]})[0] == 400
    status, body = post("/v1/completions", {"prompt": [1, 2], "max_tokens": 0})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    # Malformed fields are the client's error (400, naming the field), never the server's (500).
    for path, payload, field in (
        ("/v1/completions", {"prompt": [1, 2], "stream_options": [1]}, "stream_options"),
        ("/v1/completions", {"prompt": [1, 2], "stream": "yes"}, "stream"),
        (
            "/v1/completions",
            {"prompt": [1, 2], "stream": True, "stream_options": {"include_usage": 1}},
            "include_usage",
        ),
        ("/generate", {"input_ids": [1, 2], "sampling_params": "fast"}, "sampling_params"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "3"}},
            "sampling_params.max_new_tokens",
        ),
        ("/generate", {"input_ids": [1], "stream": 1}, "stream"),
        ("/generate", {"input_ids": "abc"}, "input_ids"),
    ):
        status, body = post(path, payload)
        assert status == 400 and body["error"]["message"].startswith(field), (path, payload, body)
    with urllib.request.urlopen(f"http://127.0.0.1:{emulator.port}/metrics") as r:
        text = r.read().decode()
    assert "flatcake_prompt_tokens_total" in text and "flatcake_hit_tokens_total" in text


def test_page_keys_are_prefix_chained() -> None:
    a, b = page_keys(list(range(600)), 256), page_keys([*range(512), 7, 7, 7], 256)
    assert len(a) == 2 and a == b[:2]  # same first two pages, partial last page not cached
    assert page_keys([9, *range(1, 600)], 256)[1] != a[1]  # a different first page changes every later key


def test_replay_schedule_scales_to_the_target_rate() -> None:
    reqs = [TraceRequest(t, 512, 1, (i,)) for i, t in enumerate([0, 1000, 1500, 4000, 10_000])]
    items = schedule(reqs, qps=2.0)  # native rate: 4 gaps in 10 s = 0.4/s, played 5x faster
    assert [round(i.at, 3) for i in items] == [0.0, 0.2, 0.3, 0.8, 2.0]
    shared = [TraceRequest(0, 700, 1, (5, 6)), TraceRequest(1, 512, 1, (5,))]
    assert prompt_tokens(shared[0])[:512] == prompt_tokens(shared[1])  # shared hash ids: shared tokens


def test_local_runs_only_target_loopback() -> None:
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://localhost:8000")
    with pytest.raises(ValueError, match="not on loopback"):
        check_loopback("http://10.0.0.1:8000")
    cmd = command(LoadgenConfig(host="http://127.0.0.1:1", trace=str(e2e.BUNDLED), qps=4, system="x",
                                results="r.jsonl", limit=20, role="master", workers=2))  # fmt: skip
    assert "--master" in cmd and cmd[cmd.index("--expect-workers") + 1] == "2" and "--run-time" in cmd


def test_end_to_end_through_locust_then_the_report(tmp_path: Path) -> None:
    """A small replay per system through the real Locust, emulator and agent processes."""
    cfg = e2e.E2EConfig(requests=12, qps=(6.0,), systems=("flatcake", "recompute"), repeats=1)
    started = time.monotonic()
    report = e2e.run(cfg, tmp_path, log=lambda _: None)
    runs = {name: runs["6"] for name, runs in report["systems"].items()}
    assert set(runs) == {"flatcake", "recompute"} and all(
        r["requests"] == 12 and r["errors"] == 0 for r in runs.values()
    )
    # Replay timing: every request left within 0.5 s of its scaled schedule.
    for line in (tmp_path / "flatcake" / "qps-6" / "rep-0" / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["sent"] - rec["scheduled"] < 0.5
    ideal = report["meta"]["ideal_hit_rate_pages"]
    assert 0 < runs["flatcake"]["delivered_hit_rate"] <= ideal + 1e-9
    assert runs["recompute"]["hit_composition"]["ssd"] == 0 and runs["flatcake"]["hit_composition"]["ssd"] > 0
    for name in report["plots"]:
        png = tmp_path / name
        assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5_000
    assert (tmp_path / "report.md").read_text().count("| flatcake | 6.0 |") == 1
    html = (tmp_path / "report.html").read_text()  # the page says what report.md says (issue 46)
    assert "<table>" in html and "P99 TTFT" in html and "errors" in html and "Calibration:" in html
    assert "<td>flatcake</td><td>sglang</td><td>flatcake</td>" in html
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["meta"]["requests"] == 12 and saved["model"] == "dsv4-flash"
    assert saved["calibration"]["gpu"] == "a100" and saved["calibration"]["sources"]
    rows = {row["system"]: row for row in saved["summary"]}
    # FlatCake as it ships runs under SGLang's rules (its FCFS scheduler); the report says whose rules.
    assert set(rows) == {"flatcake", "recompute"} and rows["flatcake"]["scheduler"] == "fcfs"
    assert rows["flatcake"]["rules"] == "sglang"
    run = saved["systems_run"]["flatcake"]
    assert run["l3"] == "flatcake" and run["late_pages"] == "recomputed" and run["host_tier_bytes"] > 0
    assert saved["calibration"]["page_cache"]["flatcake"].startswith("bypassed")
    writes = saved["systems"]["flatcake"]["6"]["l3_writes"]  # SGLang's backup thread wrote through to FlatCake
    assert writes["stored"] > 0 and writes["failed"] == 0
    agent = saved["systems"]["flatcake"]["6"]["agent"]  # the node agent's own counters, from its /metrics
    assert sum(agent["placed_pages"].values()) > 0 and set(agent) >= {"reclaimed_scopes", "restored_pages"}
    assert saved["systems"]["recompute"]["6"]["agent"] is None
    assert "| flatcake | sglang | flatcake |" in (tmp_path / "report.md").read_text()
    for row in rows.values():  # what the checks read, spreads over (here one) repeat
        assert set(row["delivered_hit_rate"]) == {"min", "median", "max"} and row["repeats"] == 1
        assert isinstance(row["saturated"], bool) and 0 <= row["dram_hit_share"] <= 1
    assert saved["ideal_hit_rate"] == ideal
    assert "flatcake" in R.format_table(report)
    assert time.monotonic() - started < 240
    assert len(list(read_trace(tmp_path / "trace.jsonl"))) == 12  # the slice every stage read


def test_a_rate_past_capacity_is_flagged_saturated(tmp_path: Path) -> None:
    """Recompute-only on the modelled GPU, every request arriving at once: the backlog is reported."""
    cfg = e2e.E2EConfig(requests=8, qps=(200.0,), systems=("recompute",), repeats=1)
    report = e2e.run(cfg, tmp_path, log=lambda _: None)
    point = report["systems"]["recompute"]["200"]
    assert point["saturated"] and "backlog" in point["saturation"][0]
    assert "SATURATED" in R.format_table(report) and report["summary"][0]["saturated"] is True


def test_report_names_the_context_of_runs_made_elsewhere(tmp_path: Path) -> None:
    """`flatcake loadgen run` against any endpoint, then `flatcake report --context`: the page says where."""
    from flatcake.loadgen.replay.requests import Record

    run = tmp_path / "vllm-staging" / "qps-2"
    run.mkdir(parents=True)
    recs = [
        Record(i, "vllm-staging", 2.0, i * 0.5, i * 0.5, 0.2, 0.4, 1000, 16, 600, {"hbm": 600}, True) for i in range(4)
    ]
    (run / "results.jsonl").write_text("".join(r.to_json() + "\n" for r in recs))
    exe = Path(sys.executable).parent / "flatcake"
    out = subprocess.run(
        [str(exe), "report", str(tmp_path), "--context", "staging-eu/kv"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["meta"]["context"] == "staging-eu/kv" and set(report["systems"]) == {"vllm-staging"}
    assert report["systems"]["vllm-staging"]["2"]["delivered_hit_rate"] == pytest.approx(0.6)
    assert "staging-eu/kv" in (tmp_path / "report.md").read_text()


def test_the_placement_ablation_runs_flatcake_once_per_mode(tmp_path: Path) -> None:
    """Placement modes run for both FlatCakes; the scheduler ablation only for the native what-if (FlatCake as it
    ships is scheduled by SGLang)."""
    cfg = e2e.E2EConfig(systems=("flatcake", "flatcake-native", "tiered"), schedulers=("mas", "fcfs"),
                        placements=("table2", "adaptive"), repeats=1)  # fmt: skip
    labels = sorted({p.label for p in e2e.points(cfg, (2.0,))})
    assert labels == ["flatcake", "flatcake-adaptive", "flatcake-native", "flatcake-native-adaptive",
                      "flatcake-native-fcfs", "flatcake-native-fcfs-adaptive", "tiered"]  # fmt: skip
    with pytest.raises(ValueError, match="placements: 'lru' is not one of table2, adaptive"):
        e2e.E2EConfig(placements=("lru",))
    # The mode reaches the engine the emulator (or the point's node agent) runs.
    emu = EmulatorConfig(data_dir=str(tmp_path), placement="adaptive")
    assert engine_config(emu, tmp_path).placement.mode == "adaptive"


def test_prompt_ids_of_a_merged_multi_user_trace_and_folded_to_a_small_vocabulary() -> None:
    from flatcake.loadgen.replay.requests import block_tokens
    from flatcake.loadgen.tokens import VOCAB
    from flatcake.loadgen.traces.synth import USER_ID_STRIDE, SynthConfig, synthesize

    # The same ids as the unreduced formula wherever that did not overflow (every single-user trace).
    assert block_tokens(12345, 4) == [(12345 * 2_654_435_761 + i) % VOCAB for i in range(4)]
    far = 3 * USER_ID_STRIDE + 17  # user 3's block ids: the unreduced product overflowed int64
    assert block_tokens(far, 3) == [(far * 2_654_435_761 + i) % VOCAB for i in range(3)]
    reqs = list(synthesize(SynthConfig("agentic", requests=3, seed=1, scale=0.01, users=4)))
    folded = [prompt_tokens(r, 8192) for r in reqs]
    assert all(0 <= t < 8192 for ids in folded for t in ids)
    assert [len(ids) for ids in folded] == [len(prompt_tokens(r)) for r in reqs]


def test_flatcakes_dram_split_runs_as_its_own_rows(tmp_path: Path) -> None:
    """flatcake as it ships splits the DRAM budget between SGLang's host pool and its own; --storage-dram-share
    runs other splits beside the default half (0: everything to SGLang's host pool, FlatCake on SSD)."""
    cfg = e2e.E2EConfig(systems=("flatcake", "tiered"), storage_dram_shares=(0.5, 0.0), repeats=1)
    points = e2e.points(cfg, (2.0,))
    assert sorted(p.label for p in points) == ["flatcake", "flatcake-dram0", "tiered"]
    base = EmulatorConfig(data_dir=str(tmp_path), dram_bytes=64 << 20)
    ssd_only = e2e.point_config(base, next(p for p in points if p.label == "flatcake-dram0"))
    assert ssd_only.l3_dram_bytes == 0 and ssd_only.host_tier_bytes == 64 << 20
    half = e2e.point_config(base, next(p for p in points if p.label == "flatcake"))
    assert half.l3_dram_bytes == half.host_tier_bytes == 32 << 20
    assert e2e.system_rules(ssd_only)["storage_dram_bytes"] == 0
    with pytest.raises(ConfigError, match="storage_dram_share: 1.0 must be at least 0 and below 1"):
        EmulatorConfig(storage_dram_share=1.0)


def test_a_server_that_dies_at_start_is_reported_with_its_log(tmp_path: Path) -> None:
    """bench e2e names the log of a process that exited before it served, and shows its last lines."""
    log = tmp_path / "emulator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import sys; print('port 1 is taken'); sys.exit(2)"],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        with pytest.raises(RuntimeError) as caught:
            emulated.wait_for(lambda: False, proc, "the emulator", log)
    assert f"the emulator exited with 2; see {log}" in str(caught.value)
    assert "port 1 is taken" in str(caught.value)
