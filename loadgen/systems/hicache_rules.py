"""SGLang HiCache's storage-prefetch rules, as pure decisions: when a prefetch may start, when the
scheduler may stop waiting for it, how long it may wait, and the scheduling pass itself
(``schedule``). The emulator's SGLang-side modes and the simulator both run them, from here.

Read from SGLang 0.5.23 (cited by file and function; no code taken):
- ``srt/arg_groups/fields/memory.py``: ``hicache_storage_prefetch_policy`` is one of ``best_effort``,
  ``wait_complete``, ``timeout``; the server default is ``timeout``. Declined or missed storage
  lookups are re-issued, at most ``hicache_storage_prefetch_retry_max_attempts`` (8) times.
- ``srt/mem_cache/unified_radix_cache.py``, ``prefetch_from_storage``: a prefetch shorter than
  ``prefetch_threshold`` (256 tokens) is not started; one asked for while
  ``cache_controller.prefetch_rate_limited()`` is declined and retried later; a started one adds its
  tokens to ``prefetch_tokens_occupied``.
- ``srt/managers/cache_controller.py``, ``prefetch_rate_limited``: limited once the occupied tokens
  reach ``prefetch_capacity_limit`` = half the host pool (cache mode). ``_page_transfer``: one I/O
  thread reads an operation in batches of ``STORAGE_BATCH_SIZE`` (128) pages and stops between
  batches once the operation is terminated; completed pages count batch by batch.
- ``unified_radix_cache.py``, ``_can_terminate_prefetch`` and ``check_prefetch_progress``: at each
  scheduling pass ``best_effort`` stops the prefetch and keeps what has arrived; ``wait_complete``
  keeps the request waiting until all of it has arrived; ``timeout`` waits until
  ``prefetch_timeout_base`` (1.0 s) + pages x ``page_size`` / 1024 x ``prefetch_timeout_per_ki_token``
  (0.25 s), counted from the first pass that found it unfinished (``_start_storage_prefetch_wait``).
- ``srt/managers/scheduler.py``, the prefill batch loop: a request whose prefetch cannot stop yet is
  skipped (``continue``) and later requests in the waiting queue may be scheduled ahead of it; the
  waiting queue is ordered by ``schedule_policy``, default ``fcfs``.
- ``srt/mem_cache/storage_prefetch.py`` (``StoragePrefetchRetries``) with ``scheduler.py``
  ``_process_storage_prefetch_retries``: a lookup that found nothing or less than the threshold
  (``poll_miss``) is asked again after ``hicache_storage_prefetch_retry_poll_interval`` (8) scheduling
  passes, at most ``..._retry_max_attempts`` (8) times, never for the head of the waiting queue (its
  pending retry is dropped); a partial hit is never asked again. At admission SGLang matches only HBM
  and host pages (``init_next_round_input``): pages that reached storage after a request's lookups are
  not read for it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
DEFAULT_PREFETCH_POLICY = "timeout"
PREFETCH_THRESHOLD_TOKENS = 256
TIMEOUT_BASE_S = 1.0
TIMEOUT_PER_KI_TOKEN_S = 0.25
STORAGE_BATCH_PAGES = 128
RETRY_MAX_ATTEMPTS = 8
RETRY_POLL_INTERVAL = 8  # scheduling passes between a missed lookup and its retry


def check_policy(policy: str) -> str:
    if policy not in PREFETCH_POLICIES:
        raise ValueError(f"prefetch_policy: {policy!r} must be one of {', '.join(PREFETCH_POLICIES)}")
    return policy


def capacity_tokens(host_pool_tokens: int) -> int:
    """Tokens that may be in flight in prefetches: half the host pool, the rest kept for write-back."""
    return host_pool_tokens // 2


def rate_limited(occupied_tokens: int, host_pool_tokens: int) -> bool:
    return occupied_tokens >= capacity_tokens(host_pool_tokens)


def worth_prefetching(tokens: int) -> bool:
    return tokens >= PREFETCH_THRESHOLD_TOKENS


def timeout_s(pages: int, page_tokens: int) -> float:
    return TIMEOUT_BASE_S + pages * page_tokens / 1024 * TIMEOUT_PER_KI_TOKEN_S


@dataclass
class Prefetch:
    """One storage prefetch of a request's L3 span, as the scheduler sees it."""

    pages: int
    completed: int = 0  # pages arrived, batch by batch
    finished: bool = False  # the I/O thread is done with it (all read, or stopped, or failed)
    terminated: bool = False  # the scheduler stopped it; the I/O thread reads no further batch
    wait_started: float | None = None  # the first pass that found it unfinished (timeout policy)

    def may_stop(self, policy: str, now: float, page_tokens: int) -> bool:
        """Whether a scheduling pass at ``now`` may stop waiting and schedule the request. The first
        pass that finds it unfinished starts the timeout clock."""
        if self.finished:
            return True
        if policy == "best_effort":
            return True
        if self.wait_started is None:
            self.wait_started = now
        if policy == "wait_complete":
            return False
        return now - self.wait_started > timeout_s(self.pages, page_tokens)

    def deadline(self, page_tokens: int) -> float | None:
        """When a waiting ``timeout`` prefetch may be stopped (for the scheduler's next wake-up)."""
        if self.wait_started is None:
            return None
        return self.wait_started + timeout_s(self.pages, page_tokens)


def miss_retry_at(passes: int, attempts: int) -> int | None:
    """The pass at which a lookup that missed is asked again, or None once the retries are spent."""
    return passes + RETRY_POLL_INTERVAL if attempts < RETRY_MAX_ATTEMPTS else None


class MissedLookup(Protocol):
    lookups: int  # lookups asked again so far
    lookup_at: int | None  # the pass that asks again; None: none pending


W = TypeVar("W", bound=MissedLookup)


def due_lookups(waiting: Sequence[W], passes: int) -> list[W]:
    """The waiting requests whose missed lookup is asked again at pass ``passes``, in queue order (each
    counted); the head's pending retry is dropped instead (SGLang's ``_process_storage_prefetch_retries``)."""
    due = []
    for i, job in enumerate(waiting):
        if job.lookup_at is not None and passes >= job.lookup_at:
            job.lookup_at = None
            if i:
                job.lookups += 1
                due.append(job)
    return due


class Queued(Protocol):
    retry: bool  # declined for capacity: asked again at each pass
    op: Prefetch | None  # its storage prefetch, if one started


Q = TypeVar("Q", bound=Queued)


def schedule(
    waiting: Sequence[Q], policy: str, now: float, page_tokens: int, retry: Callable[[Q], None]
) -> tuple[Q | None, float | None]:
    """One scheduling pass over the FCFS waiting queue (SGLang's prefill batch loop, one request at a
    time): in queue order, ``retry`` a declined prefetch, skip a request whose prefetch may not stop yet
    under ``policy``, and stop (terminate) the prefetch of the first that may run. Returns that request
    (the caller takes it off the queue), or None and the earliest ``timeout`` deadline to wake at."""
    wake: float | None = None
    for job in waiting:
        if job.retry:
            retry(job)
        op = job.op
        if op is not None and not op.terminated:
            if not op.may_stop(policy, now, page_tokens):
                deadline = op.deadline(page_tokens) if policy == "timeout" else None
                if deadline is not None:
                    wake = deadline if wake is None else min(wake, deadline)
                continue
            op.terminated = True
        return job, None
    return None, wake


def lock(counts: dict[Any, int], keys: Iterable[Any], delta: int) -> None:
    """Add ``delta`` to each key's lock count (SGLang's ``inc_lock_ref``/``dec_lock_ref`` on the radix
    nodes a request or a pending backup holds); a page whose count drops to zero is unlocked (absent), and
    eviction passes over locked pages."""
    for key in keys:
        n = counts.get(key, 0) + delta
        if n > 0:
            counts[key] = n
        else:
            counts.pop(key, None)
