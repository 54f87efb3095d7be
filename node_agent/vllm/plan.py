"""What FlatCake's vLLM connector loads and saves each step: pure bookkeeping, no vLLM import.

vLLM hashes each full block of a request's tokens, chained from the first (``request.block_hashes``,
sha256 by default: the same bytes in every process and across restarts), so a block's hash names the
whole prefix up to it: FlatCake's page key, with the rank's shard (``@tp{rank}of{size}``) and a
namespace so that another engine's pages never match. One vLLM block is one FlatCake page.

The scheduler side asks which blocks past vLLM's own prefix-cache hit FlatCake holds
(``lookup_range``), and each step plans, per request, the blocks to load (once, when the request is
first scheduled) and the full blocks this step completes that are not yet saved (``Tracker``). The
plan travels to the worker inside vLLM's connector metadata (pickled), as plain lists.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from flatcake.node_agent.policy.placement import Hints

NAMESPACE = "vllm:"


def block_keys(hashes: Sequence[bytes], suffix: str) -> list[str]:
    """FlatCake keys of vLLM block hashes (bytes, or objects whose bytes are the hash)."""
    return [f"{NAMESPACE}{bytes(h).hex()}{suffix}" for h in hashes]


def rank_suffix(tp_rank: int, tp_size: int, replicated: bool) -> str:
    """The rank's shard of a block: KV heads are split across tensor-parallel ranks (MLA's latent cache is
    the same on every rank: one key, one writer)."""
    return "" if replicated else f"@tp{tp_rank}of{tp_size}"


def lookup_range(num_computed_tokens: int, prompt_tokens: int, block_size: int, hashed_blocks: int) -> range:
    """Blocks FlatCake may supply: from vLLM's own hit (whole blocks) up to, not including, the block of the
    prompt's last token (vLLM must compute at least one token to sample the next)."""
    start = num_computed_tokens // block_size
    stop = min(hashed_blocks, (prompt_tokens - 1) // block_size)
    return range(start, max(start, stop))


@dataclass(frozen=True)
class Load:
    req_id: str
    keys: list[str]
    block_ids: list[int]
    # In the step's forward, layer by layer (the request is scheduled this step), or outside any step: vLLM
    # parks the request (WAITING_FOR_REMOTE_KVS) until the worker reports it loaded (``get_finished``).
    sync: bool = True


@dataclass
class Save:
    req_id: str
    keys: list[str]
    block_ids: list[int]
    prefix: list[str]  # the keys before ``keys`` in the request's chain (placement signals)
    turn_open: bool = False  # the prompt is still being prefilled: the next save continues this turn
    runs: list[tuple[int, int, Hints]] = field(default_factory=list)  # puts: [start, stop) with their hints


@dataclass
class _Request:
    keys: list[str]  # keys of the request's full blocks so far
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # leading full blocks stored (saved here, loaded, or found stored)


class Tracker:
    """Per-request state on the scheduler side; ``step`` turns one scheduling step into loads and saves."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._requests: dict[str, _Request] = {}
        self._loads: dict[str, tuple[int, int]] = {}  # req_id -> (first block, blocks) to load when scheduled
        self._parked: dict[str, set[int]] = {}  # req_id -> the blocks its load outside the steps fills
        self._failed: set[str] = set()  # requests a load failed for: never offered FlatCake's pages again

    def expect_load(self, req_id: str, first_block: int, blocks: int) -> None:
        """vLLM allocated blocks for ``blocks`` external blocks from ``first_block`` (update_state_after_alloc)."""
        if blocks > 0:
            self._loads[req_id] = (first_block, blocks)

    def async_load(self, req_id: str, keys: Sequence[str], block_ids: Sequence[int], first: int, n: int) -> Load:
        """vLLM parked the request and gave it ``block_ids`` (all its blocks, update_state_after_alloc): the
        load of blocks ``[first, first + n)``, run outside the steps. They count as stored from now on; when
        the request is scheduled after the load, only what it computes is saved."""
        r = self._requests.setdefault(req_id, _Request(list(keys)))
        r.keys, r.block_ids = list(keys), list(block_ids)
        r.saved = max(r.saved, first + n)
        self._parked[req_id] = set(r.block_ids[first : first + n])
        return Load(req_id, r.keys[first : first + n], r.block_ids[first : first + n], sync=False)

    def may_offer(self, req_id: str) -> bool:
        """Whether FlatCake's pages may be offered to ``req_id``: not after a load of them failed (vLLM asks
        again when it recomputes from the first block, and the same pages would fail the same way, for ever).
        A request whose load succeeded may be offered them again (preempted, it restarts from nothing)."""
        return req_id not in self._failed

    def load_results(self, invalid_blocks: Collection[int], finished: Collection[str]) -> None:
        """The worker's report of one step (vLLM's ``update_connector_output``): the blocks that failed to
        load and the parked requests whose load ended. Both come in the same report: a parked request whose
        blocks are among the invalid ones failed."""
        if invalid_blocks:
            bad = set(invalid_blocks)
            for req_id, blocks in list(self._parked.items()):
                if blocks & bad:
                    self._failed.add(req_id)
                    del self._parked[req_id]
        for req_id in finished:
            self._parked.pop(req_id, None)

    def step(self, req_id: str, keys: Sequence[str], block_ids: Sequence[int] | None, *, replace_blocks: bool,
             computed_after: int, prompt_tokens: int) -> tuple[Load | None, Save | None]:  # fmt: skip
        """One scheduled request this step: ``keys`` are its full blocks' keys now, ``block_ids`` the blocks
        vLLM gave it this step (all of them when ``replace_blocks``: new or resumed), ``computed_after`` its
        tokens computed once this step has run (of a ``prompt_tokens`` prompt)."""
        r = self._requests.setdefault(req_id, _Request(list(keys)))
        r.keys = list(keys)
        if block_ids is not None:
            r.block_ids = list(block_ids) if replace_blocks else [*r.block_ids, *block_ids]
        load = None
        if req_id in self._loads:
            first, n = self._loads.pop(req_id)
            load = Load(req_id, r.keys[first : first + n], r.block_ids[first : first + n])
            r.saved = max(r.saved, first + n)  # stored already: that is where they come from
        full = min(computed_after // self.block_size, len(r.keys), len(r.block_ids))
        save = None
        if full > r.saved:
            save = Save(req_id, r.keys[r.saved : full], r.block_ids[r.saved : full], r.keys[: r.saved],
                        computed_after < prompt_tokens)  # fmt: skip
            r.saved = full
        return load, save

    def finished(self, req_id: str) -> None:
        self._requests.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._parked.pop(req_id, None)
        self._failed.discard(req_id)
