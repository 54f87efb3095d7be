"""The README's headline figures are what the committed runs say (issue 41): each is recomputed here from
docs/results/*.json and must appear in the README as written, so a rerun that changes them fails until the
README says the new numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def _result(name: str) -> dict:
    """A committed run (docs/results/NAME)."""
    return json.loads((RESULTS / name).read_text())


def _mean(report: dict, label: str, qps: float) -> float:
    return float(report["systems"][label][f"{qps:g}"]["spread"]["ttft_mean_s"]["median"])


def _span(values: list[float]) -> str:
    """A ratio or a range of ratios as the README writes them: 1.16× or 1.16-2.04×."""
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}×" if lo == hi else f"{lo}-{hi}×"


def e2e_ratio(report: dict, system: str, peer: str) -> str:
    rates = sorted(float(q) for q in report["systems"][system])
    return _span([_mean(report, system, q) / _mean(report, peer, q) for q in rates])


def e2e_figures() -> list[str]:
    out = []
    for name in ("e2e-shipped.json", "e2e-shipped-trace2.json"):
        report = _result(name)
        for system, peers in (("flatcake", ("hicache-file", "tiered", "hicache-mooncake")),
                              ("flatcake-native", ("hicache-file", "tiered"))):  # fmt: skip
            out += [e2e_ratio(report, system, peer) for peer in peers]
    split = _result("e2e-shipped-split.json")
    out += [e2e_ratio(split, "flatcake-dram0", "hicache-file"), e2e_ratio(split, "flatcake", "hicache-file")]
    return out


def vllm_figure() -> str:
    rows = {r["system"]: r for r in _result("serve-vllm.json")["systems"]}
    return _span([rows["flatcake"]["ttft_mean_spread_s"]["median"] / rows["vllm"]["ttft_mean_spread_s"]["median"]])


def test_the_readmes_main_job_figures_are_the_committed_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [f for f in e2e_figures() if f not in readme]
    assert not missing, f"figures of docs/results not in the README (rerun? update the README): {missing}"


def test_the_vllm_figure_names_its_baseline() -> None:
    readme = (ROOT / "README.md").read_text()
    figure = vllm_figure()
    at = readme.index(figure)
    assert "prefix cache alone" in readme[at : at + 300], "the vLLM figure must say what it is measured against"
    # and against vLLM's own DRAM offloading, the baseline a vLLM user would pick
    rows = {r["system"]: r for r in _result("serve-vllm.json")["systems"]}
    offload = _span(
        [rows["flatcake"]["ttft_mean_spread_s"]["median"] / rows["vllm-offload"]["ttft_mean_spread_s"]["median"]]
    )
    at = readme.index(f"and {offload} that of vLLM")
    assert "own DRAM offloading" in readme[at : at + 200]


def test_the_vllm_slice_where_storage_matters_is_the_committed_run() -> None:
    """Issue 43: FlatCake against vLLM's own offloading on the 8-user slice, overall and repeat by repeat."""
    readme = (ROOT / "README.md").read_text()
    report = _result("serve-vllm-8users.json")
    rows = {r["system"]: r for r in report["systems"]}
    overall = _span([rows["flatcake"]["ttft_mean_s"] / rows["vllm-offload"]["ttft_mean_s"]])
    runs = {(r["system"], r["repeat"]): r["ttft_mean_s"] for r in report["runs"]}
    paired = [runs["flatcake", k] / runs["vllm-offload", k] for k in sorted({k for _, k in runs})]
    flat = " ".join(readme.split())
    at = flat.index(f"at {overall} its mean TTFT")
    assert f"({' and '.join(_span([p]) for p in paired)} repeat by repeat)" in flat[at : at + 80]

    # and against vLLM's own DRAM + disk offloading, where FlatCake loses
    def against_disk(name: str) -> str:
        rows = {r["system"]: r for r in _result(name)["systems"]}
        return _span([rows["flatcake"]["ttft_mean_s"] / rows["vllm-offload-disk"]["ttft_mean_s"]])

    assert (f"has {against_disk('serve-vllm-8users-disk-copies.json')} its mean TTFT "
            f"({against_disk('serve-vllm-8users-disk.json')} with Table 2)") in flat  # fmt: skip


def test_the_copies_figures_are_the_committed_runs() -> None:
    """Issue 42: the simulator's ratios at the paper's shape, and the e2e ratio that keeps table2 the default."""
    readme = (ROOT / "README.md").read_text()
    runs = _result("simulate-copies.json")["runs"]
    tiered = {(r["users"], r["qps"]): r["ttft_mean_s"] for r in runs if r["system"] == "tiered"}

    def ratios(placement: str, share: float) -> list[float]:
        return [r["ttft_mean_s"] / tiered[(r["users"], r["qps"])] for r in runs
                if r["system"] == "flatcake" and r["placement"] == placement and r["storage_dram_share"] == share]  # fmt: skip

    assert f"with copies and 90% of DRAM in its pool, has {_span(ratios('copies', 0.9))} the idealized" in " ".join(
        readme.split()
    )
    assert f"where Table 2 has {_span(ratios('table2', 0.5))}." in " ".join(readme.split())
    real = _result("simulate-real-l3.json")["runs"]
    shipped = {(r["users"], r["qps"]): r["ttft_mean_s"] for r in runs
               if r["system"] == "flatcake" and r["placement"] == "copies" and r["storage_dram_share"] == 0.9}  # fmt: skip

    def against(system: str, users: int) -> str:
        return _span([shipped[(users, r["qps"])] / r["ttft_mean_s"] for r in real
                      if r["system"] == system and r["users"] == users])  # fmt: skip

    flat = " ".join(readme.split())
    assert f"{against('hicache-file', 256)} and {against('hicache-mooncake', 256)} their mean TTFT at 256" in flat
    assert f"only {against('hicache-file', 64)} and {against('hicache-mooncake', 64)} at 64 users" in flat
    peers = _result("peers-dsv4-flash-placement.json")["copies"]["systems"]
    share = {name: f"{peers[name]['dram_hit_fraction']:.0%}" for name in ("flatcake", "tiered")}
    assert (
        f"copies serve {share['flatcake']} of restored pages from DRAM against the LRU tier's {share['tiered']}" in flat
    )
    dram0 = _result("e2e-dram0-tiered.json")
    tie = {q: f"{_mean(dram0, 'flatcake-dram0', q) / _mean(dram0, 'tiered', q):.2f}×" for q in (2, 4)}
    assert f"ties the idealized tiered cache: {tie[2]} its mean TTFT at 2 QPS and {tie[4]} at 4" in flat
    e2e = _result("e2e-copies.json")
    ratio = {q: f"{_mean(e2e, 'flatcake-copies', q) / _mean(e2e, 'flatcake', q):.2f}×" for q in (2, 4)}
    assert f"copies do not win clearly: {ratio[2]} Table 2's mean TTFT at 2 QPS and {ratio[4]} at 4 QPS" in flat


def test_the_sglang_slice_and_the_calibration_are_the_committed_runs() -> None:
    """Issue 43: FlatCake's backend and linker against SGLang's file backend and Mooncake on the 8-user slice,
    and how much cheaper a restore is here than on the GPU reference."""
    flat = " ".join((ROOT / "README.md").read_text().split())
    rows = {r["system"]: r["ttft_mean_s"] for r in _result("serve-sglang-8users.json")["systems"]}
    ratio = lambda a, b: _span([rows[a] / rows[b]])  # noqa: E731
    assert (
        f"(FlatCake {ratio('flatcake', 'hicache-file')} the file backend, {ratio('flatcake', 'hicache-mooncake')} Mooncake)"
        in flat
    )
    assert f"it is {ratio('flatcake-linker', 'hicache-file')} the file backend's mean TTFT" in flat
    cal = _result("serve-calibration.json")
    (slice_row,) = [r for r in cal["here"] if r["where"].endswith("slice")]
    assert f"costs {slice_row['restore_over_prefill']:.1%} of prefilling it, {slice_row['factor']:.0f}× less" in flat
