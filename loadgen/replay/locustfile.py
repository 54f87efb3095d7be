"""Locust replay of a trace at its recorded (scaled) times against an inference endpoint.

Run by ``flatcake loadgen run`` (or ``locust -f`` this file with the options below). Each process
replays its share of the trace (worker i of N takes requests i, i+N, ...); each request streams its
response, and one JSON line per request goes to ``--results``. Locust counts each request once, as
``POST <path> TTFT``: its response time is the time to first token and its size the bytes streamed
(end-to-end latency and cached tokens are in the results and the report), so Locust's request rate
is the replay's. A progress line goes to stderr every ``--progress-interval`` seconds.

In Locust's distributed mode the workers send their records to the master as messages, and the
master writes the one results file and stops the run once every worker reports its share answered:
worker pods in a cluster need no shared volume.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
from locust import HttpUser, constant, events, task
from locust.env import Environment
from locust.runners import WORKER_REPORT_INTERVAL, LocalRunner, MasterRunner, WorkerRunner
from locust.stats import CSV_STATS_INTERVAL_SEC
from prometheus_client import CollectorRegistry, start_http_server

from flatcake import metrics as M
from flatcake.loadgen.replay.requests import APIS, Item, Record, body, path, prompt_tokens, read_stream, schedule
from flatcake.loadgen.traces.formats import read_trace


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    parser.add_argument("--trace", required=True, help="Mooncake or FlatCake JSONL trace")
    parser.add_argument("--trace-limit", type=int, default=0, help="replay only the first N requests")
    parser.add_argument("--qps", type=float, default=1.0, help="target arrival rate")
    parser.add_argument("--api", choices=list(APIS), default="openai")
    parser.add_argument("--max-output", type=int, default=16, help="cap on output tokens per request")
    parser.add_argument("--vocab", type=int, default=0, help="fold token ids below a served model's vocabulary")
    parser.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                        help="token ids, or text (4 characters a token: flatcake.loadgen.tokens)")  # fmt: skip
    parser.add_argument("--results", default="results.jsonl", help="per-request JSON lines (one file per process)")
    parser.add_argument("--system", default="unknown", help="name of the system under test, for the report")
    parser.add_argument("--replay-workers", type=int, default=1, help="how many processes share the trace")
    parser.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus metrics here (0: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="address for --metrics-port (0.0.0.0 in a pod)")
    parser.add_argument("--progress-interval", type=float, default=10.0,
                        help="seconds between progress lines on stderr (0: none)")  # fmt: skip


class _Replay:
    """The process's share of the schedule, handed out in order to whichever user is free."""

    def __init__(self, env: Environment) -> None:
        o = env.parsed_options
        assert o is not None, "run under the locust command line, which parses the replay options"
        reqs = list(read_trace(o.trace, o.trace_limit or None))
        share = max(getattr(env.runner, "worker_index", 0), 0), max(o.replay_workers, 1)
        self.items = [it for it in schedule(reqs, o.qps) if it.index % share[1] == share[0]]
        self.next = 0
        self.sent = 0  # requests sent (taken ones wait for their time first)
        self.done = 0
        self.quitting = False
        self.start = time.perf_counter() + 0.5
        self.runner = env.runner
        self.out = None if isinstance(env.runner, WorkerRunner) else _open_results(o.results)
        # Processes on one host (loopback) take port + worker index; in a pod each has the port to itself.
        offset = share[0] if o.metrics_host.startswith("127.") else 0
        self.metrics = _Metrics(o.metrics_port + offset, o.metrics_host) if o.metrics_port else None
        # A worker's progress is the master's to print (it sees every worker's records).
        local = isinstance(env.runner, LocalRunner)
        self.progress = _Progress(o, len(self.items), lambda: self.sent) if local else None

    def emit(self, rec: Record) -> None:
        if self.out is not None:
            self.out.write(rec.to_json() + "\n")
        else:
            assert self.runner is not None
            self.runner.send_message(RECORD, {"record": rec.to_json()})

    def finish(self) -> None:
        """This process's share is answered: a local run quits, a worker tells the master."""
        if self.quitting:
            return
        self.quitting = True
        if isinstance(self.runner, WorkerRunner):
            self.runner.send_message(DONE, {"worker": self.runner.worker_index})
        elif isinstance(self.runner, LocalRunner):
            # Not from a user's own greenlet, which quit() kills; and after Locust's CSV writer (which
            # writes every CSV_STATS_INTERVAL_SEC and not at quit) has seen the last answers.
            gevent.spawn_later(QUIT_AFTER_S, self.runner.quit)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.out is not None:
            self.out.close()

    def take(self) -> Item | None:
        if self.next >= len(self.items):
            return None
        item = self.items[self.next]
        self.next += 1
        return item


RECORD, DONE = "flatcake_record", "flatcake_done"
# Locust writes its CSV files every CSV_STATS_INTERVAL_SEC, never at quit: a run quitting at its last
# answer lost the requests answered since the last write (198 of 200). One more write first; a master
# also waits for its workers' next stats report.
QUIT_AFTER_S = 2.5 * CSV_STATS_INTERVAL_SEC
MASTER_QUIT_AFTER_S = WORKER_REPORT_INTERVAL + QUIT_AFTER_S


def _open_results(path: str) -> Any:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return open(out, "w", buffering=1)


class _Collector:
    """The master of a distributed run: writes the workers' records, quits when all are done."""

    def __init__(self, env: Environment) -> None:
        o = env.parsed_options
        assert o is not None and isinstance(env.runner, MasterRunner)
        self.runner = env.runner
        self.expected = max(o.replay_workers, 1)
        self.done: set[int] = set()
        self.out = _open_results(o.results)
        total = len(list(read_trace(o.trace, o.trace_limit or None)))
        self.progress = _Progress(o, total, None)

    def record(self, line: str) -> None:
        self.out.write(line + "\n")
        rec = json.loads(line)
        self.progress.add(bool(rec["ok"]), rec["ttft_s"])

    def worker_done(self, index: int) -> None:
        self.done.add(index)
        if len(self.done) == self.expected:
            gevent.spawn_later(MASTER_QUIT_AFTER_S, self.runner.quit)

    def close(self) -> None:
        self.progress.stop()
        self.out.close()


class _Progress:
    """One line per interval on stderr while a run goes (Locust's ``--only-summary`` prints nothing
    until the end): requests answered of the total, errors, in flight, and TTFT so far."""

    def __init__(self, o: Any, total: int, sent: Any) -> None:
        self.label, self.total, self.sent = f"{o.system} at {o.qps:g} QPS", total, sent
        self.answered = self.errors = 0
        self.ttft: list[float] = []
        self.started = time.monotonic()
        interval = float(o.progress_interval)
        self.greenlet = gevent.spawn(self._loop, interval) if interval > 0 else None

    def add(self, ok: bool, ttft: float | None) -> None:
        self.answered += 1
        self.errors += not ok
        if ttft is not None:
            self.ttft.append(ttft)

    def line(self) -> str:
        parts = [f"{self.answered}/{self.total} answered", f"{self.errors} errors"]
        if self.sent is not None:
            parts.append(f"{self.sent() - self.answered} in flight")
        if self.ttft:
            q = statistics.quantiles(self.ttft, n=100) if len(self.ttft) > 1 else self.ttft * 99
            parts.append(f"TTFT P50 {q[49]:.3f} s, P99 {q[98]:.3f} s")
        return f"[{time.monotonic() - self.started:6.0f} s] {self.label}: " + ", ".join(parts)

    def _loop(self, interval: float) -> None:
        while True:
            gevent.sleep(interval)
            print(self.line(), file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.greenlet is not None:
            self.greenlet.kill(block=False)


class _Counted:
    """The response's lines, counting the bytes streamed (Locust's size for a streamed request)."""

    def __init__(self, lines: Iterator[bytes]) -> None:
        self.lines, self.bytes = lines, 0

    def __iter__(self) -> Iterator[bytes]:
        for line in self.lines:
            self.bytes += len(line) + 1
            yield line


class _Metrics:
    """The load generator's catalogue metrics, on their own port (one per process)."""

    def __init__(self, port: int, host: str) -> None:
        self.registry = CollectorRegistry()
        self.ttft = M.histogram("flatcake_loadgen_ttft_seconds", self.registry)
        self.e2e = M.histogram("flatcake_loadgen_e2e_seconds", self.registry)
        self.requests = M.counter("flatcake_loadgen_requests", self.registry)
        start_http_server(port, addr=host, registry=self.registry)

    def record(self, rec: Record) -> None:
        self.requests.labels(rec.system, "ok" if rec.ok else "error").inc()
        if rec.ttft_s is not None:
            self.ttft.labels(rec.system).observe(rec.ttft_s)
        if rec.e2e_s is not None:
            self.e2e.labels(rec.system).observe(rec.e2e_s)


_replay: _Replay | None = None
_collector: _Collector | None = None


def _on_record(environment: Environment, msg: Any, **_: Any) -> None:
    if _collector is not None:
        _collector.record(msg.data["record"])


def _on_done(environment: Environment, msg: Any, **_: Any) -> None:
    if _collector is not None:
        _collector.worker_done(int(msg.data["worker"]))


@events.init.add_listener
def _init(environment: Environment, **_: Any) -> None:
    if isinstance(environment.runner, MasterRunner):
        environment.runner.register_message(RECORD, _on_record)
        environment.runner.register_message(DONE, _on_done)


@events.test_start.add_listener
def _start(environment: Environment, **_: Any) -> None:
    global _replay, _collector
    if isinstance(environment.runner, LocalRunner | WorkerRunner):
        _replay = _Replay(environment)
    elif isinstance(environment.runner, MasterRunner):
        _collector = _Collector(environment)


@events.test_stop.add_listener
def _stop(environment: Environment, **_: Any) -> None:
    for part in (_replay, _collector):
        if part is not None:
            part.close()


class TraceUser(HttpUser):
    wait_time = constant(0)

    @task
    def replay(self) -> None:
        r = _replay
        if r is None:
            gevent.sleep(0.1)
            return
        item = r.take()
        if item is None:  # this process's share is sent: stop when the last answer is in
            if r.done == len(r.items):
                r.finish()
            gevent.sleep(0.2)
            return
        delay = r.start + item.at - time.perf_counter()
        if delay > 0:
            gevent.sleep(delay)
        self._send(r, item)

    def _send(self, r: _Replay, item: Item) -> None:
        o = self.environment.parsed_options
        assert o is not None
        sent = time.perf_counter()
        rec = Record(item.index, o.system, o.qps, item.at, sent - r.start, None, None, 0, 0, 0, {}, False)
        r.sent += 1
        try:
            tokens = prompt_tokens(item.request, o.vocab)  # inside: a request that cannot be built is recorded
            rec.prompt_tokens = len(tokens)
            n_out = max(1, min(item.request.output_length, o.max_output))
            payload = body(o.api, tokens, n_out, text=o.prompt_format == "text")
            with self.client.post(path(o.api), json=payload, stream=True, catch_response=True,
                                  name=f"{path(o.api)} TTFT", timeout=600) as resp:  # fmt: skip
                if resp.status_code != 200:
                    # Locust gives status 0 where no answer came (refused, reset, timed out): say that.
                    why = (
                        f"HTTP {resp.status_code}"
                        if resp.status_code
                        else f"no answer: {resp.error or 'connection failed'}"
                    )
                    resp.failure(why)
                    rec.error = why
                else:
                    lines = _Counted(resp.iter_lines())
                    ttft, chunks, usage = read_stream(o.api, iter(lines), sent)
                    rec.ttft_s, rec.e2e_s = ttft, time.perf_counter() - sent
                    rec.output_tokens = int(usage.get("output", chunks))
                    rec.cached_tokens = int(usage.get("cached", 0))
                    rec.hit_tokens = {k: int(v) for k, v in usage.get("hits", {}).items()}
                    rec.ok = ttft is not None
                    # Locust's one entry for this request: the TTFT, and the bytes streamed.
                    resp.request_meta["response_length"] = lines.bytes
                    if ttft is None:
                        rec.error = "no output token"
                        resp.failure(rec.error)
                    else:
                        resp.request_meta["response_time"] = ttft * 1000
                        resp.success()
        except Exception as exc:  # a stream cut or timed out: recorded, the replay goes on
            rec.error = f"{exc.__class__.__name__}: {exc}"
            # Locust reports a request whose with-block raised nothing itself: counted here, once.
            self.environment.events.request.fire(
                request_type="POST", name=f"{path(o.api)} TTFT", response_time=(time.perf_counter() - sent) * 1000,
                response_length=0, exception=exc, context={},
            )  # fmt: skip
        # Counted as answered only once Locust's entry and the record are out: the run ends when
        # every request is counted, and its final stats and results must hold this one.
        r.emit(rec)
        if r.metrics is not None:
            r.metrics.record(rec)
        if r.progress is not None:
            r.progress.add(rec.ok, rec.ttft_s)
        r.done += 1
