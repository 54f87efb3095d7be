"""SGLang HiCache's prefetch rules, as the tiered baseline applies them."""

from __future__ import annotations

import pytest

from flatcake.loadgen.systems import hicache_rules as hicache

pytestmark = pytest.mark.unit


def test_the_timeout_grows_with_the_prefetch_as_sglang_computes_it() -> None:
    assert hicache.timeout_s(0, 256) == pytest.approx(1.0)
    assert hicache.timeout_s(8, 256) == pytest.approx(1.0 + 8 * 256 / 1024 * 0.25)  # 1.5 s for 2K tokens
    assert hicache.timeout_s(4, 64) == pytest.approx(1.0625)


def test_each_stop_policy_decides_as_sglang_does() -> None:
    for policy, stops_at in (("best_effort", 0.0), ("wait_complete", None), ("timeout", 1.5)):
        op = hicache.Prefetch(pages=8)
        assert op.may_stop(policy, 100.0, 256) is (stops_at == 0.0)  # first pass: unfinished
        assert op.may_stop(policy, 101.4, 256) is (stops_at == 0.0)
        assert op.may_stop(policy, 101.6, 256) is (stops_at is not None)  # past 1.5 s from the first pass
        op.finished = True
        assert op.may_stop(policy, 101.6, 256)  # a finished prefetch never holds its request
    op = hicache.Prefetch(pages=8)
    assert op.deadline(256) is None  # the clock starts at the first pass that finds it unfinished
    op.may_stop("timeout", 50.0, 256)
    assert op.deadline(256) == pytest.approx(51.5)


def test_prefetches_are_limited_to_half_the_host_pool_and_short_ones_skipped() -> None:
    assert not hicache.rate_limited(4095, 8192) and hicache.rate_limited(4096, 8192)
    assert not hicache.worth_prefetching(255) and hicache.worth_prefetching(256)
    assert hicache.DEFAULT_PREFETCH_POLICY == "timeout"  # SGLang 0.5.23's server default
    with pytest.raises(ValueError, match="prefetch_policy: 'eager' must be one of best_effort, wait_complete, timeout"):
        hicache.check_policy("eager")
