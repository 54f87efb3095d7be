"""``flatcake trace stats``: what a trace promises a prefix cache, before any system is measured.

- ideal hit rate: an infinite cache hits every block seen before (hash ids are prefix-chained, so a
  seen block implies its whole prefix was seen); by blocks, and by tokens (the last block of a request
  holds only what is left of its input).
- one-shot fraction: distinct blocks accessed exactly once.
- reuse distance: for each repeat access, the number of requests between it and the previous access
  of the same block (intervening requests; back-to-back requests have distance 0).
- top-10% share: the share of all accesses taken by the 10% most accessed blocks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from flatcake.loadgen.report import plots
from flatcake.loadgen.traces.formats import TraceRequest

KEYS = (
    "requests", "distinct_blocks", "accesses", "ideal_hit_rate_blocks", "ideal_hit_rate_tokens",
    "one_shot_fraction", "reuse_distance_mean", "reuse_distance_p50", "reuse_distance_p90",
    "reuse_distance_p99", "top10_access_share",
)  # fmt: skip


class _Accumulator:
    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.last_seen: dict[int, int] = {}
        self.distances: list[int] = []
        self.requests = self.accesses = self.hits = 0
        self.tokens = self.hit_tokens = 0

    def add(self, r: TraceRequest) -> None:
        counts, last = self.counts, self.last_seen
        index = self.requests
        for h, tokens in zip(r.hash_ids, r.block_token_counts(), strict=True):
            seen = counts.get(h, 0)
            if seen:
                self.hits += 1
                self.hit_tokens += tokens
                self.distances.append(index - last[h] - 1)
            counts[h] = seen + 1
            last[h] = index
            self.tokens += tokens
        self.accesses += len(r.hash_ids)
        self.requests += 1

    def result(self) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
        per_block = np.sort(np.fromiter(self.counts.values(), dtype=np.int64, count=len(self.counts)))[::-1]
        dist = np.asarray(self.distances, dtype=np.int64)
        top = max(1, int(len(per_block) * 0.1)) if len(per_block) else 0

        def pct(q: float) -> float:
            return float(np.percentile(dist, q)) if len(dist) else 0.0

        stats = {
            "requests": self.requests,
            "distinct_blocks": len(self.counts),
            "accesses": self.accesses,
            "ideal_hit_rate_blocks": self.hits / self.accesses if self.accesses else 0.0,
            "ideal_hit_rate_tokens": self.hit_tokens / self.tokens if self.tokens else 0.0,
            "one_shot_fraction": float((per_block == 1).mean()) if len(per_block) else 0.0,
            "reuse_distance_mean": float(dist.mean()) if len(dist) else 0.0,
            "reuse_distance_p50": pct(50),
            "reuse_distance_p90": pct(90),
            "reuse_distance_p99": pct(99),
            "top10_access_share": float(per_block[:top].sum() / per_block.sum()) if len(per_block) else 0.0,
        }
        return stats, per_block, dist


def compute(requests: Iterable[TraceRequest], total: int | None = None, progress: bool = True) -> dict[str, Any]:
    stats, _, _ = compute_with_data(requests, total, progress)
    return stats


def compute_with_data(
    requests: Iterable[TraceRequest], total: int | None = None, progress: bool = True
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    acc = _Accumulator()
    bar = tqdm(requests, total=total, desc="trace stats", unit="req", file=sys.stderr, disable=not progress,
               mininterval=0.5, leave=False)  # fmt: skip
    for r in bar:
        acc.add(r)
    return acc.result()


def plot(per_block: np.ndarray, distances: np.ndarray, out_dir: str | Path, title: str) -> list[Path]:
    """Cumulative access share by block rank, and the reuse-distance distribution (Figure 2a)."""
    plt = plots.pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(per_block):
        share = np.cumsum(per_block) / per_block.sum()
        rank = np.arange(1, len(per_block) + 1) / len(per_block)
        ax.plot(rank * 100, share * 100)
    plots.label(ax, "blocks, most accessed first (%)", "cumulative share of accesses (%)",
                f"{title}: access concentration")  # fmt: skip
    paths = [plots.save(fig, out / "access_share.png", dpi=120)]
    fig, ax = plt.subplots(figsize=(6, 4))
    if len(distances):
        d = np.sort(distances)
        ax.plot(d, np.arange(1, len(d) + 1) / len(d) * 100)
        ax.set_xscale("symlog")
        for q in (50, 90, 99):
            ax.axvline(np.percentile(d, q), linestyle=":", alpha=0.6)
    plots.label(ax, "reuse distance (intervening requests)", "repeat accesses (CDF, %)", f"{title}: reuse distance")
    paths.append(plots.save(fig, out / "reuse_distance.png", dpi=120))
    return paths


def format_stats(stats: dict[str, Any]) -> str:
    lines = []
    for k in KEYS:
        v = stats[k]
        lines.append(f"{k:<24} {v:.4f}" if isinstance(v, float) else f"{k:<24} {v}")
    return "\n".join(lines)
