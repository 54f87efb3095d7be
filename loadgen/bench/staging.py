"""``flatcake loadgen staging`` (first named ``loadgen bench``, still accepted): a benchmark run in a
staging cluster, as the chart's Job and workers run it.

The master replays the trace at each QPS point in turn through Locust's distributed mode (it writes
every worker's records), then writes the report with the system under test and the cluster context
in it. Each worker takes part in the same points in the same order. Results land in ``--results``
(a PVC in the cluster); without one the master keeps its pod for ``--hold`` seconds for `kubectl cp`.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flatcake.loadgen.bench.e2e import run_meta
from flatcake.loadgen.replay.run import LoadgenConfig, check_url, run
from flatcake.loadgen.report import build as R


@dataclass(frozen=True)
class StagingBench:
    role: str  # master | worker
    target: str  # the inference endpoint's base URL
    trace: str
    results: str  # directory: <system>/qps-<q>/results.jsonl, report.*
    qps: tuple[float, ...]
    system: str
    workers: int = 2
    master_host: str = "127.0.0.1"
    master_port: int = 5557
    limit: int | None = None
    api: str = "openai"
    max_output: int = 16
    users: int = 64
    page_tokens: int = 256
    context: str = ""
    hold_s: float = 0.0
    metrics_port: int = 0  # workers: serve the load generator's metrics on all addresses (0: off)

    def __post_init__(self) -> None:
        if self.role not in ("master", "worker"):
            raise ValueError(f"role: {self.role!r} must be master or worker")
        if not self.qps or any(q <= 0 for q in self.qps):
            raise ValueError(f"qps: {self.qps} must be one or more rates > 0")
        if self.workers < 1:
            raise ValueError(f"workers: {self.workers} must be >= 1")

    def point(self, qps: float) -> LoadgenConfig:
        run_dir = Path(self.results) / self.system / f"qps-{qps:g}"
        return LoadgenConfig(
            host=self.target, trace=self.trace, qps=qps, system=self.system,
            results=str(run_dir / "results.jsonl"), csv_prefix=str(run_dir / "locust"), limit=self.limit,
            api=self.api, max_output=self.max_output, users=self.users, role=self.role,
            master_host=self.master_host, master_port=self.master_port, workers=self.workers, allow_remote=True,
            metrics_port=self.metrics_port if self.role == "worker" else 0, metrics_host="0.0.0.0",
        )  # fmt: skip


def bench(cfg: StagingBench, log: Callable[[str], None] = print) -> int:
    check_url(cfg.target, "--host")  # before the trace is read or anything is written
    results = Path(cfg.results)
    if cfg.role == "master":
        results.mkdir(parents=True, exist_ok=True)
        meta = run_meta(cfg.trace, cfg.limit, cfg.page_tokens, cfg.qps, (cfg.system,), context=cfg.context)
        meta |= {"target": cfg.target, "api": cfg.api, "workers": cfg.workers,
                 "description": f"Locust master + {cfg.workers} workers against {cfg.target}"}  # fmt: skip
        (results / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    for i, qps in enumerate(cfg.qps, 1):
        log(f"[{i}/{len(cfg.qps)}] {cfg.role}: {cfg.system} at {qps:g} QPS against {cfg.target}")
        if cfg.role == "master":
            shutil.rmtree(results / cfg.system / f"qps-{qps:g}", ignore_errors=True)
        rc = run(cfg.point(qps), quiet=False)
        if rc not in (0, 1):  # 1: Locust saw failed requests, which the records show
            log(f"locust ({cfg.role}) exited with {rc} at {qps:g} QPS")
            return rc
    if cfg.role == "master":
        report = R.write(results)
        print(R.format_table(report))
        print(json.dumps(report, indent=1), file=sys.stderr)  # in the pod log even without a volume
        log(f"report: {results / 'report.md'} (report.json, report.html, plots)")
        if cfg.hold_s > 0:
            log(f"holding {cfg.hold_s:.0f}s: kubectl cp <namespace>/<this pod>:{results} ./results")
            time.sleep(cfg.hold_s)
    return 0
