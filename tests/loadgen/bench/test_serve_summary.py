"""``bench serve``'s probe verdict, pure: a probe whose prefix never came back from storage says nothing
about storage, so its row says n/a, never "matches cold"."""

from __future__ import annotations

import pytest

from flatcake.loadgen.bench import serve

pytestmark = pytest.mark.unit


def _record(i: int) -> dict[str, object]:
    return {"ok": True, "sent": float(i), "ttft_s": 0.1 + i / 100, "prompt_tokens": 1000, "output_tokens": 8,
            "hit_tokens": {"device": 500, "host": 0, "storage": 100}}  # fmt: skip


def test_the_probe_verdict_needs_the_probe_to_come_from_storage() -> None:
    records = [_record(i) for i in range(4)]
    from_storage = serve.summarize("flatcake", 1.0, records, 10.0, True, 960, None)
    not_from_storage = serve.summarize("vllm", 1.0, records, 10.0, True, 0, None)
    assert from_storage["logprobs_match_cold"] is True
    assert not_from_storage["logprobs_match_cold"] is None  # matched, but nothing came from storage
    differed = serve.summarize("flatcake", 1.0, records, 10.0, False, 960, None)
    rows = serve.summary([from_storage, differed, not_from_storage])
    by = {r["system"]: r for r in rows}
    assert by["flatcake"]["logprobs_match_cold"] is False  # one repeat differed: the point says so
    assert by["vllm"]["logprobs_match_cold"] is None
    table = serve.format_table({"systems": rows})
    assert "| n/a (probe not from storage) |" in table and "| NO |" in table


def test_the_connector_report_is_the_run_s_counters_and_reaches_the_table() -> None:
    """``bench serve --engine vllm``: how FlatCake's connector moved the run's blocks and how long the steps
    waited on it, from the agent's client counters before and after the run (microseconds reported as s)."""
    before = {"connector_stall_us_load": 1_000_000, "connector_pages_async": 5}
    after = {"connector_stall_us_load": 1_250_000, "connector_stall_us_save": 40_000, "connector_pages_async": 25,
             "connector_pages_layerwise": 3, "connector_pages_saved": 90}  # fmt: skip
    report = serve.connector_report(before, after)
    assert report["load"] == "layerwise+async" and report["save"] == "async"
    assert report["step_stall_s_by_phase"] == {"load": 0.25, "save": 0.04}
    assert report["step_stall_s"] == pytest.approx(0.29)
    assert report["connector_pages"] == {"layerwise": 3, "async": 20, "saved": 90, "released": 0}
    row = {**serve.summarize("flatcake", 1.0, [_record(i) for i in range(4)], 10.0, True, 960, None), **report}
    (summary,) = serve.summary([row])
    assert summary["load"] == "layerwise+async" and summary["step_stall_s"] == pytest.approx(0.29)
    assert serve.format_table({"systems": [summary]}).splitlines()[-1].endswith("| 0.29 |")


def test_the_slice_s_size_is_checked_naming_the_field() -> None:
    for field, value in (("users", 0), ("device_tokens", 512), ("dram_bytes", 1000)):
        with pytest.raises(ValueError, match=f"{field}: {value} must be"):
            serve.ServeConfig(**{field: value})
    assert serve.ServeConfig(users=8, device_tokens=4096, dram_bytes=32 << 20).users == 8


def test_flatcake_s_placement_is_a_bench_setting_checked_by_name() -> None:
    assert serve.ServeConfig(placement="copies").placement == "copies"
    with pytest.raises(ValueError, match="placement: 'tiered' must be one of table2, adaptive, copies"):
        serve.ServeConfig(placement="tiered")


def test_vllms_own_tiers_report_blocks_by_tier_and_the_disk_they_used() -> None:
    """``vllm-offload-disk``: blocks its DRAM and disk tiers served (medians over repeats) reach the table's
    DRAM / SSD column, and the bytes its fs tier wrote are reported beside FlatCake's SSD pool."""
    base = serve.summarize("vllm-offload-disk", 1.0, [_record(i) for i in range(4)], 10.0, True, 960, None)
    rows = [{**base, "vllm_tier_pages": {"host": host, "disk": disk}, "disk_bytes": used,
             "flatcake_ssd_pool_bytes": 768 << 20} for host, disk, used in ((10, 40, 100), (12, 50, 300), (20, 45, 200))]  # fmt: skip
    (summary,) = serve.summary(rows)
    assert summary["vllm_tier_pages"] == {"host": 12, "disk": 45}
    assert summary["disk_bytes"] == 200 and summary["flatcake_ssd_pool_bytes"] == 768 << 20
    assert "| 12 / 45 |" in serve.format_table({"systems": [summary]})
    # FlatCake's pool in this bench: 32 files of 64 pages of every layer (vLLM: 6 layers x 64 KiB pages).
    assert serve.ssd_pool_bytes({"layers": 6, "page_bytes": 64 << 10}) == 2048 * 6 * (64 << 10)


def test_a_linker_s_hits_count_as_storage() -> None:
    """With the unified-cache linker SGLang has no host tier and reports what the linker loaded as host
    tokens: FlatCake's share of the prompt is that."""
    records = [{**_record(i), "hit_tokens": {"device": 500, "host": 300, "storage": 0}} for i in range(4)]
    row = serve.summarize("flatcake-linker", 1.0, records, 10.0, True, 960, None)
    assert row["cached_tokens_by_tier"] == {"device": 2000, "host": 0, "storage": 1200}
    assert row["storage_hit_share"] == pytest.approx(0.3)
    assert serve.summarize("flatcake", 1.0, records, 10.0, True, 960, None)["storage_hit_share"] == 0.0
