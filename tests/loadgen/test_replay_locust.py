"""`flatcake loadgen run` as Locust users expect it: one Locust entry per request (the aggregated
rate is the replay's), a final CSV that holds every request, Locust's --csv and --html, its own flags
passed through after --, and a progress line per interval."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.traces.formats import TraceRequest, write_trace
from tests.support.emulators import Server

pytestmark = pytest.mark.integration


def test_locust_counts_each_request_once_and_its_final_csv_holds_them_all(tmp_path: Path) -> None:
    n = 60
    trace = tmp_path / "trace.jsonl"
    write_trace(str(trace), (TraceRequest(i * 20, 600, 8, (i % 7, 100 + i)) for i in range(n)))
    server = Server(EmulatorConfig(mode="none", data_dir=str(tmp_path / "emu"), decode_tokens_per_s=5000.0))
    out = tmp_path / "out"
    try:
        exe = Path(sys.executable).parent / "flatcake"
        run = subprocess.run(
            [str(exe), "loadgen", "run", "--host", f"http://127.0.0.1:{server.port}", "--trace", str(trace),
             "--qps", "30", "--results", str(out / "results.jsonl"), "--csv", str(out / "locust"),
             "--html", str(out / "locust.html"), "--progress", "0.5", "--max-output", "4", "--prompt-format", "text",
             "--", "--csv-full-history"],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        server.stop()
    assert run.returncode == 0, run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(records) == n and all(r["ok"] for r in records)
    assert all(r["prompt_tokens"] == 600 for r in records)  # sent as text, counted as the trace's tokens
    rows = {row["Name"]: row for row in csv.DictReader((out / "locust_stats.csv").open())}
    assert int(rows["Aggregated"]["Request Count"]) == n  # each request once, and none lost at quit
    assert int(rows["/v1/completions TTFT"]["Request Count"]) == n
    history = list(csv.DictReader((out / "locust_stats_history.csv").open()))
    assert any(row["Name"] == "/v1/completions TTFT" for row in history)  # --csv-full-history reached Locust
    assert (out / "locust.html").stat().st_size > 1000
    progress = [line for line in run.stderr.splitlines() if f"/{n} answered" in line]
    assert progress and f"{n}/{n} answered" in progress[-1]


def test_a_refused_connection_is_recorded_as_no_answer_not_http_0(tmp_path: Path) -> None:
    """Nothing listens at the target: every request's record says there was no answer and why (Locust
    reports status 0 there, which read as 'HTTP 0')."""
    from flatcake.net import free_port

    trace = tmp_path / "trace.jsonl"
    write_trace(str(trace), (TraceRequest(i * 10, 100, 4, (i,)) for i in range(3)))
    exe = Path(sys.executable).parent / "flatcake"
    results = tmp_path / "results.jsonl"
    run = subprocess.run(
        [str(exe), "loadgen", "run", "--host", f"http://127.0.0.1:{free_port()}", "--trace", str(trace),
         "--qps", "30", "--results", str(results), "--max-output", "4"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(records) == 3 and not any(r["ok"] for r in records), run.stderr[-2000:]
    assert all(r["error"].startswith("no answer: ") and "HTTP 0" not in r["error"] for r in records), records
