"""The metrics catalogue: every FlatCake metric's name, type, labels, unit and help, in one place.

Processes register what they export from here (``family`` for values read from state at scrape
time, ``histogram`` for observed latencies); dashboards are generated from the same list.
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


@dataclass(frozen=True)
class Spec:
    name: str  # without the _total suffix of counters
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    unit: str
    help: str


_SPECS = [
    # Agent control plane.
    Spec("flatcake_agent_requests", "counter", ("op",), "", "Control requests served, by operation."),
    Spec("flatcake_agent_request_errors", "counter", ("op", "code"), "", "Control requests answered with an error."),
    Spec("flatcake_agent_request_seconds", "histogram", ("op",), "seconds", "Control request service time."),
    Spec("flatcake_agent_clients", "gauge", (), "", "Connected clients."),
    Spec("flatcake_agent_open_handles", "gauge", ("kind",), "", "Unpublished allocations and held leases."),
    Spec("flatcake_agent_ready", "gauge", (), "", "1 once recovery finished and the socket is served."),
    Spec("flatcake_recovered_pages", "gauge", (), "", "Pages recovered from the journal at start-up."),
    Spec("flatcake_recovery_dropped_pages", "gauge", (), "", "Journaled pages dropped at start-up: checksum mismatch."),
    Spec(
        "flatcake_recheck_pages",
        "counter",
        ("outcome",),
        "",
        "Pages of the scopes readers reported damaged pages in, read again by the agent: dropped (checksum "
        "mismatch: no longer served) or passed.",
    ),
    Spec(
        "flatcake_recovery_superseded_pages",
        "gauge",
        (),
        "",
        "Journaled pages dropped at start-up: a later record took their space or key (a damaged record hid a free).",
    ),
    Spec("flatcake_recovery_skipped_records", "gauge", (), "", "Damaged journal records skipped at start-up."),
    Spec(
        "flatcake_recovery_checked_pages",
        "gauge",
        (),
        "",
        "Recovered pages whose bytes the background scan has checked so far (progress).",
    ),
    Spec(
        "flatcake_recovery_unchecked_pages",
        "gauge",
        (),
        "",
        "Recovered pages the background scan has yet to check (their readers check them meanwhile).",
    ),
    Spec(
        "flatcake_agent_epoch",
        "gauge",
        (),
        "",
        "The agent's epoch: raised at every start; older allocations are fenced.",
    ),
    Spec(
        "flatcake_journal_errors",
        "counter",
        ("kind",),
        "",
        "Journal writes that failed: append (the put failed, nothing published), sync (background fsync) or "
        "compact (online compaction; the old journal stays in use).",
    ),
    Spec("flatcake_journal_bytes", "gauge", (), "bytes", "Size of the agent's journal (compacted online)."),
    Spec("flatcake_journal_compactions", "counter", (), "", "Journal compactions: at start and online."),
    Spec(
        "flatcake_agent_dropped_connections",
        "counter",
        ("reason",),
        "",
        "Connections the agent closed: busy (max_clients, cluster.max_peer_clients), idle_timeout, frame_timeout, "
        "http_busy, unauthenticated (a peer that failed the cache's handshake).",
    ),
    Spec(
        "flatcake_shared_index_slots",
        "gauge",
        ("state",),
        "",
        "Slots of the shared-memory key index clients read without the agent: live, deleted (tombstones), free.",
    ),
    Spec(
        "flatcake_shared_index_rebuilds",
        "counter",
        (),
        "",
        "Shared index tables rebuilt: tombstones cleared, or grown after an entry found no slot.",
    ),
    Spec(
        "flatcake_index_lookups",
        "counter",
        ("path",),
        "",
        "Client lookups (exists) answered from the shared index (shared) or by the agent (agent: no usable index).",
    ),
    # Capacity and placement.
    Spec("flatcake_capacity_bytes", "gauge", ("medium",), "bytes", "Capacity of each medium."),
    Spec("flatcake_used_bytes", "gauge", ("medium",), "bytes", "Space held by scopes on each medium."),
    Spec("flatcake_scopes", "gauge", ("medium",), "", "Live session scopes on each medium."),
    Spec("flatcake_reclaimed_scopes", "counter", ("medium",), "", "Scopes freed whole by reclaim."),
    Spec("flatcake_reclaimed_bytes", "counter", ("medium",), "bytes", "Bytes freed by reclaim."),
    Spec("flatcake_placements", "counter", ("medium", "reason"), "", "Pages placed, by medium and reason."),
    Spec(
        "flatcake_copy_pages_held", "gauge", (), "", "DRAM copies of SSD-homed pages held now (placement.mode copies)."
    ),
    Spec(
        "flatcake_copy_pages",
        "counter",
        ("event",),
        "",
        "DRAM copies by event: admitted_write, admitted_restore, served (pages leases read from a copy), evicted, "
        "evicted_unread (evicted before any lease read them), evicted_write and evicted_unread_write (those of "
        "them made at a write), declined (not made: too few copies made that way were read before eviction), "
        "unfilled (reserved at a restore, not filled).",
    ),
    # Data path (counted by whoever moves the bytes: the engine, or clients reporting to the agent).
    Spec("flatcake_ssd_read_commands", "counter", (), "", "SSD read commands issued by restores."),
    Spec("flatcake_ssd_read_bytes", "counter", (), "bytes", "Bytes read from SSD by restores."),
    Spec("flatcake_ssd_requested_bytes", "counter", (), "bytes", "Bytes restores asked for (read amplification)."),
    Spec("flatcake_ssd_descriptors", "counter", (), "", "Page-layer descriptors merged into read commands."),
    Spec("flatcake_restore_pages", "counter", ("medium",), "", "Pages restored, by medium."),
    Spec(
        "flatcake_connector_stall_seconds",
        "counter",
        ("phase",),
        "seconds",
        "Time vLLM's steps waited on FlatCake's connector: a layer's bytes (load), room in the save queue and "
        "copying out the blocks of finished or preempted requests not yet stored (save).",
    ),
    Spec(
        "flatcake_connector_pages",
        "counter",
        ("kind",),
        "",
        "Pages FlatCake's vLLM connector moved: loaded under a step's forward layer by layer (layerwise), loaded "
        "while vLLM parked the request (async), stored after the step (saved), copied out by a step because "
        "their request finished or was preempted before the save thread reached them (released).",
    ),
    Spec("flatcake_pages_missing", "counter", (), "", "Pages a restore could not read (left to recompute)."),
    Spec("flatcake_io_errors", "counter", ("kind",), "", "I/O errors by kind (errno name, short_read, write)."),
    Spec("flatcake_staging_waits", "counter", (), "", "Restores that waited for a staging window."),
    Spec(
        "flatcake_verify_failures",
        "counter",
        (),
        "",
        "Restored pages whose bytes did not match their checksum (served as a miss, never as data).",
    ),
    Spec(
        "flatcake_fenced_writes", "counter", (), "", "Puts refused before writing: allocated before an agent restart."
    ),
    Spec(
        "flatcake_fenced_reads", "counter", (), "", "Restores refused before reading: leased before an agent restart."
    ),
    Spec("flatcake_write_bytes", "counter", ("kind",), "bytes", "Bytes written: logical, dram, ssd."),
    # Serving (the emulator, or an inference engine's scheduler hook).
    Spec("flatcake_requests", "counter", ("system",), "", "Requests served."),
    Spec("flatcake_prompt_tokens", "counter", ("system",), "", "Prompt tokens requested."),
    Spec(
        "flatcake_hit_tokens",
        "counter",
        ("system", "medium"),
        "",
        "Prompt tokens whose KV was in HBM before prefill, by where it came from (hbm, dram, ssd).",
    ),
    Spec(
        "flatcake_miss_tokens",
        "counter",
        ("system", "reason"),
        "",
        "Prompt tokens recomputed: uncached, declined (staging full), not_prefetched (on SSD but not prefetched "
        "at admission: tiered), failed (I/O).",
    ),
    Spec(
        "flatcake_prefetch_declined",
        "counter",
        ("system",),
        "",
        "SSD prefetches declined at admission: tokens in flight reached half the host pool (tiered, as SGLang).",
    ),
    Spec(
        "flatcake_prefetch_retries",
        "counter",
        ("system",),
        "",
        "Declined SSD prefetches tried again at a later scheduling pass (tiered, as SGLang).",
    ),
    Spec("flatcake_prefetch_seconds", "histogram", ("system",), "seconds", "SSD prefetch time per request."),
    Spec(
        "flatcake_l3_write_pages",
        "counter",
        ("system", "result"),
        "",
        "Pages written through to the L3 under SGLang's host tier (its backup thread), by result: stored, or "
        "failed (refused for space, as Mooncake refuses a full segment, or an I/O error; SGLang drops them).",
    ),
    Spec(
        "flatcake_ssd_restore_bytes",
        "counter",
        ("system",),
        "bytes",
        "Bytes of SSD pages restored (prefetched, or read at dispatch).",
    ),
    Spec(
        "flatcake_ssd_restore_busy_seconds",
        "counter",
        ("system",),
        "seconds",
        "Seconds with at least one SSD restore in flight: restored bytes over this is the storage's rate as the "
        "run saw it.",
    ),
    Spec("flatcake_queue_depth", "gauge", ("system", "queue"), "", "Requests waiting, by queue."),
    Spec(
        "flatcake_queue_wait_seconds",
        "histogram",
        ("system", "queue"),
        "seconds",
        "Time from arrival to prefill start, by the queue the request joined.",
    ),
    Spec(
        "flatcake_staging_tokens",
        "gauge",
        ("system",),
        "",
        "Tokens of started SSD prefetches not yet taken by their request (tiered: SGLang's occupied tokens).",
    ),
    Spec(
        "flatcake_placed_pages",
        "counter",
        ("system", "medium"),
        "",
        "Pages stored, by the medium placement chose (dram, ssd).",
    ),
    Spec(
        "flatcake_placed_reused_pages",
        "counter",
        ("system", "medium"),
        "",
        "Stored pages asked for again by a later prompt, by the medium they were placed on.",
    ),
    Spec(
        "flatcake_placed_lost_pages",
        "counter",
        ("system", "medium"),
        "",
        "Of those, pages no longer stored when first asked for again (reclaimed), by their placed medium.",
    ),
    Spec(
        "flatcake_staging_bytes",
        "gauge",
        ("system",),
        "bytes",
        "Bytes held by restore staging now: FlatCake's windows in use, or the tiered staging pool.",
    ),
    Spec(
        "flatcake_server_ttft_seconds",
        "histogram",
        ("system",),
        "seconds",
        "Arrival to first token, measured by the server.",
    ),
    # Load generator.
    Spec("flatcake_loadgen_ttft_seconds", "histogram", ("system",), "seconds", "Time to first token, client side."),
    Spec("flatcake_loadgen_e2e_seconds", "histogram", ("system",), "seconds", "End-to-end latency, client side."),
    Spec("flatcake_loadgen_requests", "counter", ("system", "outcome"), "", "Replayed requests by outcome."),
]
CATALOG: dict[str, Spec] = {s.name: s for s in _SPECS}


# SGLang's own series (``--enable-metrics``; sglang/srt/observability/metrics_collector.py, 0.5.23) that
# the production dashboards and alerts read: the serving side of a FlatCake deployment is SGLang itself,
# not the emulator. Not exported by FlatCake; listed so that dashboards name only known series. SGLang
# names them ``sglang:...``, but a Prometheus scrape negotiates OpenMetrics, in which SGLang serves them
# as ``sglang_...``: what Prometheus stores, and so what queries name (seen with Prometheus 2.42).
SGLANG_SPECS = (
    Spec("sglang_prompt_tokens", "counter", ("model_name",), "", "SGLang: prompt tokens processed."),
    Spec("sglang_cached_tokens", "counter", ("model_name", "cache_source"), "",
         "SGLang: prompt tokens served from its cache, by source (device, host, storage: the L3 backend)."),
    Spec("sglang_num_requests", "counter", ("model_name",), "", "SGLang: requests processed."),
    Spec("sglang_time_to_first_token_seconds", "histogram", ("model_name",), "seconds",
         "SGLang: time to first token."),
)  # fmt: skip
SGLANG: dict[str, Spec] = {s.name: s for s in SGLANG_SPECS}


def exposed_name(spec: Spec) -> str:
    """The series name Prometheus shows (counters gain ``_total``)."""
    return spec.name + "_total" if spec.kind == "counter" else spec.name


def family(name: str, samples: Iterable[tuple[tuple[str, ...], float]]) -> Metric:
    """A metric family of catalogue metric ``name`` with ``(label values, value)`` samples."""
    spec = CATALOG[name]
    fam: Metric
    if spec.kind == "counter":
        fam = CounterMetricFamily(spec.name, spec.help, labels=spec.labels, unit="")
    elif spec.kind == "gauge":
        fam = GaugeMetricFamily(spec.name, spec.help, labels=spec.labels, unit="")
    else:
        raise ValueError(f"{name}: a {spec.kind} is observed, not read from state")
    for labels, value in samples:
        fam.add_metric(list(labels), value)
    return fam


LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def histogram(name: str, registry: CollectorRegistry) -> Histogram:
    spec = CATALOG[name]
    if spec.kind != "histogram":
        raise ValueError(f"{name}: is a {spec.kind}, not a histogram")
    return Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=LATENCY_BUCKETS)


def counter(name: str, registry: CollectorRegistry) -> Counter:
    spec = CATALOG[name]
    if spec.kind != "counter":
        raise ValueError(f"{name}: is a {spec.kind}, not a counter")
    return Counter(spec.name, spec.help, spec.labels, registry=registry)


def gauge(name: str, registry: CollectorRegistry) -> Gauge:
    spec = CATALOG[name]
    if spec.kind != "gauge":
        raise ValueError(f"{name}: is a {spec.kind}, not a gauge")
    return Gauge(spec.name, spec.help, spec.labels, registry=registry)


# Engine Stats counter -> (catalogue metric, label values).
STATS_MAP: dict[str, tuple[str, tuple[str, ...]]] = {
    "read_commands": ("flatcake_ssd_read_commands", ()),
    "read_bytes": ("flatcake_ssd_read_bytes", ()),
    "requested_bytes": ("flatcake_ssd_requested_bytes", ()),
    "descriptors": ("flatcake_ssd_descriptors", ()),
    "restore_pages_dram": ("flatcake_restore_pages", ("dram",)),
    "restore_pages_ssd": ("flatcake_restore_pages", ("ssd",)),
    "pages_missing": ("flatcake_pages_missing", ()),
    "staging_waits": ("flatcake_staging_waits", ()),
    "write_bytes_logical": ("flatcake_write_bytes", ("logical",)),
    "write_bytes_dram": ("flatcake_write_bytes", ("dram",)),
    "write_bytes_ssd": ("flatcake_write_bytes", ("ssd",)),
    "write_errors": ("flatcake_io_errors", ("write",)),
    "verify_failures": ("flatcake_verify_failures", ()),
    "fenced_writes": ("flatcake_fenced_writes", ()),
    "fenced_reads": ("flatcake_fenced_reads", ()),
    "index_lookups_shared": ("flatcake_index_lookups", ("shared",)),
    "index_lookups_agent": ("flatcake_index_lookups", ("agent",)),
    "connector_stall_us_load": ("flatcake_connector_stall_seconds", ("load",)),
    "connector_stall_us_save": ("flatcake_connector_stall_seconds", ("save",)),
    "connector_pages_layerwise": ("flatcake_connector_pages", ("layerwise",)),
    "connector_pages_async": ("flatcake_connector_pages", ("async",)),
    "connector_pages_saved": ("flatcake_connector_pages", ("saved",)),
    "connector_pages_released": ("flatcake_connector_pages", ("released",)),
}
# Counters kept in integer units where the metric's unit is larger (microseconds reported as seconds).
STATS_SCALE = {"connector_stall_us_load": 1e-6, "connector_stall_us_save": 1e-6}

DROP_REASONS = ("busy", "idle_timeout", "frame_timeout", "http_busy", "unauthenticated")


IO_ERROR_KINDS = ("eio", "short_read", "write")

# What a client may report to the agent: the engine's Stats counters (not peaks) and io_errors_<kind>
# for an errno name; anything else is refused, so clients cannot mint Prometheus series.
CLIENT_STATS = frozenset(
    {*STATS_MAP, "put_pages", "restores", "write_commands", "dram_hugepage_fallback", "copy_pages_written"}
)
IO_ERROR_NAMES = frozenset(
    {"io_errors_short_read", "io_errors_other"} | {f"io_errors_{n.lower()}" for n in errno.errorcode.values()}
)
MAX_STAT_DELTA = (1 << 63) - 1


def is_client_stat(name: object) -> bool:
    return isinstance(name, str) and (name in CLIENT_STATS or name in IO_ERROR_NAMES)


def stats_families(counts: dict[str, int]) -> list[Metric]:
    """Families for engine ``Stats`` counters (``io_errors_<kind>`` map to flatcake_io_errors).

    Every mapped counter is exported from the start, at 0 until it moves, so rates and alerts on
    errors have a series to evaluate before the first error."""
    grouped: dict[str, list[tuple[tuple[str, ...], float]]] = {}
    defaults = dict.fromkeys(STATS_MAP, 0) | dict.fromkeys((f"io_errors_{k}" for k in IO_ERROR_KINDS), 0)
    for key, value in (defaults | counts).items():
        if key in STATS_MAP:
            name, labels = STATS_MAP[key]
        elif key.startswith("io_errors_"):
            name, labels = "flatcake_io_errors", (key.removeprefix("io_errors_"),)
        else:
            continue
        grouped.setdefault(name, []).append((labels, float(value) * STATS_SCALE.get(key, 1.0)))
    return [family(name, samples) for name, samples in grouped.items()]


def markdown_table() -> str:
    """The catalogue as the Markdown table in docs/metrics.md (regenerate with bin/generate)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    rows += [f"| `{exposed_name(s)}` | {s.kind} | {', '.join(s.labels) or '-'} | {s.help} |" for s in _SPECS]
    rows += ["", "SGLang's own series that the production dashboards and alerts read (not exported by FlatCake):", "",
             "| metric | type | labels | meaning |", "|---|---|---|---|"]  # fmt: skip
    rows += [f"| `{exposed_name(s)}` | {s.kind} | {', '.join(s.labels)} | {s.help} |" for s in SGLANG_SPECS]
    return "\n".join(rows)
