"""``flatcake loadgen run``: Locust, headless, replaying a trace against an inference endpoint.

Locally the target must be on loopback (``--allow-remote`` is for staging clusters). Every run is
bounded: it stops when its share of the trace is answered, and ``--run-time`` (the schedule's span
plus a margin) stops it in any case.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from flatcake.loadgen.replay.requests import schedule
from flatcake.loadgen.traces.formats import read_trace

LOCUSTFILE = Path(__file__).with_name("locustfile.py")


@dataclass(frozen=True)
class LoadgenConfig:
    host: str
    trace: str
    qps: float
    system: str
    results: str
    csv_prefix: str | None = None
    limit: int | None = None
    api: str = "openai"
    max_output: int = 16
    vocab: int = 0  # fold prompt token ids below a served model's vocabulary (0: as generated, < 50,000)
    prompt_format: str = "ids"  # ids | text (the shared 4-characters-a-token rule)
    users: int = 64
    role: str = "local"  # local | master | worker
    master_host: str = "127.0.0.1"
    master_port: int = 5557  # master: bind port; worker: where the master listens
    workers: int = 1  # processes that share the trace (master: how many to expect)
    allow_remote: bool = False
    metrics_port: int = 0  # serve the load generator's Prometheus metrics (on loopback, worker i: port + i)
    metrics_host: str = "127.0.0.1"
    margin_s: float = 120.0
    html: str | None = None  # Locust's HTML report
    progress_s: float = 10.0  # a progress line per interval on stderr (0: none)
    locust_args: tuple[str, ...] = ()  # Locust's own flags, passed through last (they win)


def check_url(url: str, flag: str = "--host") -> None:
    """``--host`` is a base URL: scheme, host and optional port (what Locust's --host takes)."""
    expected = f"{flag}: {url!r} is not a base URL; expected http://HOST:PORT, e.g. http://127.0.0.1:8000"
    try:
        parsed = urlparse(url)
        parsed.port  # noqa: B018 - raises on a port that is not a number in 0..65535
    except ValueError:  # a port out of range, or a bracketed IPv6 address left open
        raise ValueError(expected) from None
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(expected)


def check_loopback(url: str, flag: str = "--host") -> None:
    check_url(url, flag)
    host = urlparse(url).hostname or ""
    try:
        addrs = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        raise ValueError(f"{flag}: cannot resolve {host!r} in {url!r}; expected http://HOST:PORT with a HOST "
                         "this machine resolves, e.g. http://127.0.0.1:8000") from None  # fmt: skip
    if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"{flag}: {url} is not on loopback; local runs only target this machine "
                         "(pass --allow-remote for a staging cluster)")  # fmt: skip


def command(cfg: LoadgenConfig) -> list[str]:
    reqs = list(read_trace(cfg.trace, cfg.limit))
    span = schedule(reqs, cfg.qps)[-1].at if reqs else 0.0
    exe = Path(sys.executable).parent / "locust"
    cmd = [str(exe), "-f", str(LOCUSTFILE), "--headless", "--host", cfg.host, "--only-summary",
           "--trace", cfg.trace, "--qps", str(cfg.qps), "--api", cfg.api, "--max-output", str(cfg.max_output),
           "--prompt-format", cfg.prompt_format,
           "--results", cfg.results, "--system", cfg.system, "--replay-workers", str(cfg.workers),
           "--run-time", f"{int(span + cfg.margin_s)}s", "--stop-timeout", "60"]  # fmt: skip
    if cfg.limit:
        cmd += ["--trace-limit", str(cfg.limit)]
    if cfg.vocab:
        cmd += ["--vocab", str(cfg.vocab)]
    if cfg.metrics_port:
        cmd += ["--metrics-port", str(cfg.metrics_port), "--metrics-host", cfg.metrics_host]
    if cfg.role != "worker":
        cmd += ["-u", str(cfg.users), "-r", str(cfg.users)]
    if cfg.csv_prefix and cfg.role != "worker":
        cmd += ["--csv", cfg.csv_prefix]
    if cfg.html and cfg.role != "worker":
        cmd += ["--html", cfg.html]
    cmd += ["--progress-interval", f"{cfg.progress_s:g}"]
    if cfg.role == "master":
        cmd += ["--master", "--expect-workers", str(cfg.workers), "--master-bind-port", str(cfg.master_port)]
    elif cfg.role == "worker":
        cmd += ["--worker", "--master-host", cfg.master_host, "--master-port", str(cfg.master_port)]
    return cmd + list(cfg.locust_args)


def run(cfg: LoadgenConfig, quiet: bool = True) -> int:
    check_url(cfg.host)
    if not cfg.allow_remote:
        check_loopback(cfg.host)
    if cfg.qps <= 0:
        raise ValueError(f"--qps: {cfg.qps:g} must be > 0 (requests per second)")
    if not Path(cfg.trace).is_file():
        raise ValueError(
            f"--trace: {cfg.trace!r} is not a file; give a trace (JSONL), e.g. one from flatcake trace synth"
        )
    Path(cfg.results).parent.mkdir(parents=True, exist_ok=True)
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run(command(cfg), stdout=out, stderr=out, check=False).returncode
