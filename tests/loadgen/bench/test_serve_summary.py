"""``bench serve``'s probe verdict, pure: a probe whose prefix never came back from storage says nothing
about storage, so its row says n/a, never "matches cold"."""

from __future__ import annotations

import pytest

from flatcake.loadgen.bench import serve

pytestmark = pytest.mark.unit


def _record(i: int) -> dict[str, object]:
    return {"ok": True, "ttft_s": 0.1 + i / 100, "prompt_tokens": 1000, "output_tokens": 8,
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
