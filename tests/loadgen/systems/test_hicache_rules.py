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


class _Job:
    def __init__(self, name: str, op: hicache.Prefetch | None, retry: bool = False) -> None:
        self.name, self.op, self.retry = name, op, retry


def test_a_scheduling_pass_skips_what_may_not_stop_and_takes_the_first_that_may() -> None:
    """SGLang's FCFS pass, once for the emulator and the simulator: declined prefetches retried in queue
    order, a prefetch that may not stop yet skipped (its timeout deadline reported to wake at), the first
    request that may run taken with its prefetch terminated; none: the earliest deadline."""
    unfinished, done = hicache.Prefetch(pages=8), hicache.Prefetch(pages=8, finished=True)
    retried: list[str] = []
    queue = [_Job("ssd", unfinished), _Job("declined", None, retry=True), _Job("ready", done)]
    job, wake = hicache.schedule(queue, "timeout", 100.0, 256, lambda j: retried.append(j.name))
    assert job is queue[1] and wake is None and retried == ["declined"]  # a request with no prefetch may run
    assert not unfinished.terminated and unfinished.wait_started == 100.0  # its clock started, skipped
    job, wake = hicache.schedule([queue[0], queue[2]], "timeout", 100.5, 256, retried.append)
    assert job is queue[2] and done.terminated
    job, wake = hicache.schedule([queue[0]], "timeout", 101.0, 256, retried.append)
    assert job is None and wake == pytest.approx(101.5)  # 1.5 s after the pass that first found it unfinished
    job, _ = hicache.schedule([queue[0]], "timeout", 101.6, 256, retried.append)
    assert job is queue[0] and unfinished.terminated  # past the timeout: scheduled, its prefetch stopped
    assert hicache.schedule([_Job("w", hicache.Prefetch(pages=8))], "wait_complete", 0.0, 256, retried.append) == (
        None,
        None,
    )  # wait_complete: no deadline, it waits for the prefetch
    assert hicache.schedule([], "best_effort", 0.0, 256, retried.append) == (None, None)


def test_the_emulator_and_the_simulator_schedule_through_the_one_pass() -> None:
    """Both run ``hicache.schedule`` (nothing under loadgen keeps a second copy of the loop): the AST of
    each caller names it, and neither calls ``may_stop`` itself any more."""
    import ast
    from pathlib import Path

    from flatcake import loadgen

    root = Path(loadgen.__file__).parent
    for path in (root / "emulator" / "core.py", root / "simulate" / "sglang_rules.py"):
        calls = {n.func.attr for n in ast.walk(ast.parse(path.read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}  # fmt: skip
        assert "schedule" in calls and "may_stop" not in calls, path
