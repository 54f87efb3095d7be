"""The emulator's tiered mode follows SGLang HiCache's prefetch rules, and FlatCake's FC-MAS still
orders requests as the paper's Figure 4 does, through the emulator's real stores and threads.

A gate holds the storage reads a test wants to control, so each case waits for evidence (a read
started, a request queued, a counter), never for a fixed time."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.core import Emulator, Outcome, page_keys
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.node_agent import Hints, aligned_empty
from tests.support.waiting import async_wait_until

pytestmark = pytest.mark.integration

PT = 64  # tokens per page; 4 layers x 4 KiB per page-layer


def _config(tmp_path: Path, mode: str, **kw: Any) -> EmulatorConfig:
    base: dict[str, Any] = dict(mode=mode, data_dir=str(tmp_path / mode), page_tokens=PT, layers=4,
                                bytes_per_token_layer=64, hbm_bytes=64 * 16384, dram_bytes=8 * 16384,
                                ssd_bytes=16 << 20, scope_file_bytes=1 << 20, prefill_tokens_per_s=1e6)  # fmt: skip
    return EmulatorConfig(**{**base, **kw})


def _prompt(first: int, pages: int) -> list[int]:
    return list(range(first, first + pages * PT))


def _store_on_ssd(emu: Emulator, tokens: list[int]) -> list[str]:
    keys = page_keys(tokens, PT)
    kv = aligned_empty((emu.cfg.layers, len(keys), emu.cfg.page_bytes))
    kv[...] = 7
    if emu.storage.tiered is not None:
        emu.storage.tiered.put(keys, kv)
        emu.storage.tiered.flush()  # out of the host tier: only a storage prefetch brings them back
    else:
        assert emu.storage.engine is not None
        emu.storage.engine.put(keys, kv, Hints(context_tokens=1 << 20))  # an agent session: placed on SSD
    assert emu.storage.media(keys) == ["ssd"] * len(keys)
    return keys


class Gate:
    """Holds the reads ``which`` selects until opened; says when one is waiting."""

    def __init__(self, emu: Emulator, which: Callable[[list[str], bool], bool]) -> None:
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.opened_at = 0.0
        restore = emu.storage.restore

        def gated(keys: list[str], promote: bool = False, dest: Any = None) -> tuple[int, list[float]]:
            if which(keys, promote):
                self.entered.set()
                assert self.opened.wait(60), "the test never opened the gate"
            return restore(keys, promote, dest)

        emu.storage.restore = gated  # type: ignore[method-assign]

    def open(self) -> None:
        self.opened_at = time.monotonic()
        self.opened.set()


async def _entered(gate: Gate) -> bool:
    return gate.entered.is_set()


async def _passes(emu: Emulator, n: int = 3) -> None:
    """Let the scheduler run a few passes (each wakes on the condition)."""
    assert emu._cond is not None
    for _ in range(n):
        async with emu._cond:
            emu._cond.notify_all()
        await asyncio.sleep(0)


def _run(emu: Emulator, scenario: Callable[[], Any]) -> Any:
    async def main() -> Any:
        await emu.start()
        try:
            return await scenario()
        finally:
            await emu.stop()

    return asyncio.run(main())


def test_wait_complete_never_starts_prefill_before_its_prefetch_ends(tmp_path: Path) -> None:
    emu = Emulator(_config(tmp_path, "tiered", prefetch_policy="wait_complete"))
    tokens = _prompt(0, 5)
    _store_on_ssd(emu, tokens)
    gate = Gate(emu, lambda keys, promote: promote)  # the prefetch thread's reads

    async def scenario() -> Outcome:
        request = asyncio.create_task(emu.prefill(tokens))
        await async_wait_until(lambda: _entered(gate), what="the prefetch to start reading")
        await _passes(emu)
        assert not request.done() and len(emu.waiting) == 1  # skipped at every pass so far
        gate.open()
        return await request

    out = _run(emu, scenario)
    assert out.prefill_start >= gate.opened_at
    assert out.hit_pages["ssd"] == 5 and out.declined_pages == 0


@pytest.mark.parametrize("mode", ["tiered", "flatcake"])
def test_timeout_starts_prefill_after_sglangs_timeout_and_recomputes(tmp_path: Path, mode: str) -> None:
    """Under SGLang's rules (the baselines, and FlatCake as it ships as SGLang's L3) a prefetch the timeout
    stopped is not finished at dispatch: its pages are recomputed, never read from storage inline."""
    emu = Emulator(_config(tmp_path, mode, prefetch_policy="timeout"))
    tokens = _prompt(0, 5)
    stored = _store_on_ssd(emu, tokens)
    gate = Gate(emu, lambda keys, promote: promote)
    reads: list[tuple[list[str], bool]] = []
    gated = emu.storage.restore

    def seen(keys: list[str], promote: bool = False, dest: Any = None) -> tuple[int, list[float]]:
        reads.append((list(keys), promote))
        return gated(keys, promote, dest)

    emu.storage.restore = seen  # type: ignore[method-assign]

    async def scenario() -> Outcome:
        request = asyncio.create_task(emu.prefill(tokens))
        await async_wait_until(lambda: _entered(gate), what="the prefetch to start reading")
        out = await request  # the scheduler stops waiting on its own; the read is still held
        gate.open()
        return out

    out = _run(emu, scenario)
    assert out.prefill_start - out.arrival >= hicache.timeout_s(5, PT)
    assert not gate.opened_at or gate.opened_at > out.prefill_start
    assert out.hit_pages["ssd"] == 0 and out.unprefetched_pages == 5  # recomputed, as SGLang would
    # The only storage read of those pages was the prefetch's (a late read inline would be a second).
    assert [promote for keys, promote in reads if set(keys) & set(stored)] == [True]


def test_best_effort_takes_what_has_arrived_without_waiting(tmp_path: Path) -> None:
    emu = Emulator(_config(tmp_path, "tiered", prefetch_policy="best_effort"))
    tokens = _prompt(0, 5)
    _store_on_ssd(emu, tokens)
    gate = Gate(emu, lambda keys, promote: promote)

    async def scenario() -> Outcome:
        out = await emu.prefill(tokens)
        gate.open()
        return out

    out = _run(emu, scenario)
    assert out.hit_pages["ssd"] == 0 and out.unprefetched_pages == 5


def test_a_declined_prefetch_is_retried_at_a_later_pass(tmp_path: Path) -> None:
    # Host pool of 8 pages: prefetches may hold 4 pages' tokens in flight. A holds 5 (its read is
    # gated), so B is declined; once A is scheduled B's retry starts its prefetch. C keeps the GPU
    # busy meanwhile (all its tokens are new, at 16 pages/s), as a long prefill ahead of them would.
    emu = Emulator(_config(tmp_path, "tiered", prefetch_policy="wait_complete", prefill_tokens_per_s=PT * 4.0))
    a, b = _prompt(0, 5), _prompt(100_000, 5)
    _store_on_ssd(emu, a)
    _store_on_ssd(emu, b)
    gate = Gate(emu, lambda keys, promote: promote and keys == page_keys(a, PT))
    declined = emu.m["flatcake_prefetch_declined"].labels("tiered")
    retried = emu.m["flatcake_prefetch_retries"].labels("tiered")

    async def scenario() -> tuple[Outcome, Outcome]:
        c = asyncio.create_task(emu.prefill(_prompt(900_000, 8)))
        await async_wait_until(lambda: _async(not emu.waiting), what="C to be scheduled")
        ra = asyncio.create_task(emu.prefill(a))
        await async_wait_until(lambda: _entered(gate), what="A's prefetch to start")
        rb = asyncio.create_task(emu.prefill(b))
        await async_wait_until(lambda: _async(declined._value.get() == 1), what="B's prefetch to be declined")
        assert not c.done()
        gate.open()
        await c
        return await ra, await rb

    out_a, out_b = _run(emu, scenario)
    assert retried._value.get() >= 1
    assert out_a.hit_pages["ssd"] == 5 and out_b.hit_pages["ssd"] == 5 and out_b.declined_pages == 0


async def _async(value: bool) -> bool:
    return value


@pytest.mark.parametrize("policy", ["mas", "fcfs"])
def test_dram_ready_requests_run_while_an_ssd_one_prepares(tmp_path: Path, policy: str) -> None:
    """The paper's Figure 4: a long SSD-bound request arrives first, then short ones that need nothing
    from SSD. FC-MAS prefills the short ones while the long one's restore runs, and so does SGLang's
    FCFS, which skips a request still prefetching (the paper's FCFS held them behind it)."""
    emu = Emulator(_config(tmp_path, "flatcake-native", scheduler=policy, dram_bytes=4 << 20))
    long = _prompt(0, 6)
    _store_on_ssd(emu, long)
    gate = Gate(emu, lambda keys, promote: keys == page_keys(long, PT))  # the SSD request's prefetch

    async def scenario() -> tuple[Outcome, list[Outcome]]:
        first = asyncio.create_task(emu.prefill(long))
        await async_wait_until(lambda: _entered(gate), what="the SSD restore to start")
        short = [asyncio.create_task(emu.prefill(_prompt(500_000 + 10_000 * i, 1))) for i in range(3)]
        done = await asyncio.gather(*short)  # they finish while the restore is still held
        gate.open()
        return await first, done

    first, short = _run(emu, scenario)
    assert first.hit_pages["ssd"] == 6
    assert all(s.first_token <= gate.opened_at < first.prefill_start for s in short)


def test_a_missed_lookup_is_asked_again_eight_passes_later(tmp_path: Path) -> None:
    """SGLang re-issues a storage lookup that found nothing after 8 scheduling passes (a pass per prefill
    here), unless the request has reached the head of the queue. B queues behind ten short requests while
    a long prefill runs; its pages reach storage only after its first lookup missed (another request's
    write-back); the retry finds and prefetches them. Without the rule B recomputes them."""
    emu = Emulator(_config(tmp_path, "tiered", prefetch_policy="wait_complete", prefill_tokens_per_s=PT * 4.0))
    b = _prompt(100_000, 5)
    retried = emu.m["flatcake_prefetch_retries"].labels("tiered")

    async def scenario() -> Outcome:
        long = asyncio.create_task(emu.prefill(_prompt(900_000, 8)))  # 2 s on the GPU
        await async_wait_until(lambda: _async(not emu.waiting), what="the long prefill to be scheduled")
        ahead = []
        for i in range(10):  # one page each: a quarter second each, one scheduling pass each
            ahead.append(asyncio.create_task(emu.prefill(_prompt(200_000 + 1_000 * i, 1))))
            await async_wait_until(lambda n=i + 1: _async(len(emu.waiting) == n), what="a request to queue")
        rb = asyncio.create_task(emu.prefill(b))
        await async_wait_until(lambda: _async(len(emu.waiting) == 11), what="B to queue")
        job_b = emu.waiting[10]
        assert job_b.ssd_keys == [] and job_b.lookup_at is not None  # B's lookup missed: a retry is armed
        _store_on_ssd(emu, b)
        assert not long.done()
        await asyncio.gather(long, *ahead)
        return await rb

    out = _run(emu, scenario)
    assert retried._value.get() >= 1
    assert out.hit_pages["ssd"] == 5 and out.unprefetched_pages == 0


@pytest.mark.parametrize("mode", ["flatcake-native", "tiered"])
def test_prepared_pages_wait_in_bounded_host_staging_not_hbm(tmp_path: Path, mode: str) -> None:
    """Issue 27: a request's pages read from SSD before its dispatch wait in host staging, never in HBM
    (where they would evict other sessions' prefixes), for both sides; the tokens prepared are bounded
    by half the host pool (SGLang's rule): tiered declines a prefetch past it, FlatCake's waits for a
    dispatch to free staging. At dispatch the pages are copied in and count as SSD hits."""
    emu = Emulator(_config(tmp_path, mode, prefetch_policy="wait_complete", prefill_tokens_per_s=PT * 4.0))
    bound = hicache.capacity_tokens(emu.host_pool_tokens)  # 8 host pages: 4 pages' tokens
    prompts = [_prompt(10_000 * (i + 1), 6) for i in range(3)]
    stored = [_store_on_ssd(emu, p) for p in prompts]
    reads: list[list[str]] = []
    restore = emu.storage.restore

    def counted(keys: list[str], promote: bool = False, dest: Any = None) -> tuple[int, list[float]]:
        reads.append(list(keys))
        return restore(keys, promote, dest)

    emu.storage.restore = counted  # type: ignore[method-assign]

    async def scenario() -> list[Outcome]:
        blocker = asyncio.create_task(emu.prefill(_prompt(900_000, 8)))  # 2 s of GPU: the others wait
        await async_wait_until(lambda: _async(emu.staging_tokens == 0 and not emu.waiting and not emu._jobs),
                               what="the blocker to be scheduled")  # fmt: skip
        tasks = [asyncio.create_task(emu.prefill(p)) for p in prompts]
        jobs = emu._jobs.values() if mode == "flatcake-native" else emu.waiting

        def one_prepared() -> bool:
            return len(jobs) == 3 and sum(len(j.held) == 6 for j in jobs) == 1

        await async_wait_until(lambda: _async(one_prepared()), what="one request's pages to be prepared")
        assert not blocker.done()
        prepared = {key for j in jobs for key in j.held}
        assert prepared and not prepared & set(emu.hbm), "prepared pages went into HBM"
        assert emu.staging_tokens == 6 * PT > bound  # one request alone may exceed the bound; no second starts
        assert [r for r in reads if any(k in s for s in stored for k in r)] == [
            next(s for s in stored if s[0] in prepared)
        ]
        if mode == "tiered":
            assert emu.m["flatcake_prefetch_declined"].labels(mode)._value.get() >= 1
        await blocker
        return list(await asyncio.gather(*tasks))

    outs = _run(emu, scenario)
    assert emu.staging_tokens == 0
    if mode == "flatcake-native":  # it waits, never declines: every request gets its SSD pages
        assert [o.hit_pages["ssd"] for o in outs] == [6, 6, 6]
    else:  # FCFS: the first arrival was the one prepared; its pages reached the prefill from staging
        assert outs[0].hit_pages["ssd"] == 6
