"""FlatCake as SGLang's unified-cache external linker: restores stream layer by layer under the forward.

SGLang 0.5.23 loads it with::

    --enable-unified-cache-external-linker --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "FlatCakeLinker",
        "linker_module_path": "flatcake.node_agent.sglang.linker",
        "linker_extra_config": {"socket": "/run/flatcake/agent.sock"}}'

(``mem_cache/unified_cache/linker_factory.py``: ``FlatCakeLinker(server_args, params, components=...,
extra_config=..., forward_stream=...)`` in each scheduler process; no ``--enable-hierarchical-cache``:
the linker replaces SGLang's host tier, FlatCake's DRAM is the second tier.) What SGLang calls, and what
FlatCake does (``mem_cache/unified_cache/unified_cache_linker.py``):

- ``lookup(rid, transfers)`` on the scheduler thread when a request arrives, with the page hashes of its
  prompt past the device cache: one ``exists`` at the agent, the stored prefix's lengths.
- ``load(rid, transfers)`` once SGLang gave the hit private device slots: the restore is opened here
  (the agent pins the pages; a page reclaimed since the lookup refuses the load, and SGLang computes the
  request instead of aborting it), its I/O waits for the next ``start_layer_wise_loading``.
- ``start_layer_wise_loading()`` as the batch's forward begins: one thread (``service/transfers.py``
  ``LayerLoads``) runs the batch's restores together and calls ``complete(index, layer)`` once a layer's
  bytes are in the device slots; the forward waits for each layer in the pool's layer hook (FC-CIO).
  The last layer is released only after the restores ended and no page is missing: a page that failed
  to read or match its checksum fails the batch (``fail``), ``finish_layer_wise_loading`` says so, and
  SGLang aborts the batch's loading requests before their output is used. A failed load never gives
  wrong bytes to a request that answers.
- ``offload(transfers, session_id)`` as the radix tree inserts a node: queued (``SaveQueue``, bounded by
  ``save_queue_bytes``, 1 GiB), copied out of the device slots and stored off the scheduler thread, in
  order; SGLang keeps the node's slots locked until ``pop_completed_offload`` reports it. Pages the agent
  already holds (a restored prefix inserted again) are not written again.

Pages are the HiCache backend's (``keys.py``, ``device_pages.py``): the same keys and bytes, so a prefix
one stored is a hit for the other on the same agent. Supported pools: SGLang's plain MHA and MLA pools
(which 0.5.23's linker pool assembler refuses: its plain-KV strategy has no linker view; the entry is
built here with SGLang's ``DevicePoolEntry``). Placement hints come from the key chains the linker sees
(``Chains``) and the session id, then ``placement_hints`` and ``$FLATCAKE_SGLANG_HINTS``, as the backend.
Not yet: hybrid models' sidecar pools (SWA, Mamba, DSA, DeepSeek-V4), other nodes' agents
(``cluster.peers``), and a run on a GPU (the copy path is written with torch ops for device buffers but
has run only on the CPU).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import DevicePoolEntry
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter, UnifiedCacheLinker
from sglang.srt.utils import get_device_module

from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.policy.placement import Key
from flatcake.node_agent.policy.signals import ChainSignals
from flatcake.node_agent.service.client import connect
from flatcake.node_agent.service.hints import deployment_hints, run_hints
from flatcake.node_agent.service.transfers import LayerLoads, Restore, SaveJob, SaveQueue
from flatcake.node_agent.sglang.device_pages import Chains, KVPages, end_batch
from flatcake.node_agent.sglang.keys import DEFAULT_SOCKET, STORAGE_FAULTS, key_suffix

log = logging.getLogger(__name__)


class TimedCounter(LayerWiseLoadCounter):  # type: ignore[misc]
    """SGLang's counter, timing how long the forward waited for layers (``connector_stall_us_load``)."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(num_layers)
        self.waited_s = 0.0

    def wait_until(self, threshold: int) -> None:
        started = time.monotonic()
        super().wait_until(threshold)
        self.waited_s += time.monotonic() - started


class _Request:
    """One request's queued load: its restore (opened: the pages pinned), where it lands, its page count."""

    def __init__(self, restore: Restore, rows: list[int], staged: npt.NDArray[np.uint8] | None) -> None:
        self.restore, self.rows, self.staged = restore, rows, staged

    @property
    def pages(self) -> int:
        return len(self.rows)


class _Batch:
    """A batch's restores as one: layer ``l`` is yielded once every request's layer ``l`` landed."""

    def __init__(self, requests: list[_Request]) -> None:
        self.requests = requests
        self.missing: set[int] = set()

    def __iter__(self) -> Iterator[int]:
        for layers in zip(*(r.restore for r in self.requests), strict=True):
            yield layers[0]
        at = 0
        for r in self.requests:
            self.missing |= {at + i for i in r.restore.missing}
            at += r.pages

    def __enter__(self) -> _Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        for r in self.requests:
            r.restore.__exit__(None, None, None)


class _Offloads(SaveQueue):
    """The save queue, keeping each offload's outcome in order for ``pop_completed_offload``."""

    def __init__(self, store: Callable[[Any], None], max_bytes: int, retry_s: float) -> None:
        super().__init__(store, max_bytes, retry_s, logger=log, name="flatcake-sglang-offloads")
        self.results: deque[bool] = deque()

    def _done(self, job: SaveJob, ok: bool) -> None:
        super()._done(job, ok)
        self.results.append(ok)

    def skip(self) -> None:
        """An offload this rank does not write (MLA ranks past 0, which queue none): done at once."""
        with self._cond:
            self.results.append(True)


def plain_kv_entry(kvcache: Any, page_size: int) -> tuple[DevicePoolEntry, int, bool]:
    """SGLang's plain MHA or MLA device pool as a linker pool entry, its layer count, and whether it is MLA."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool

    if type(kvcache) is MHATokenToKVPool:
        if getattr(kvcache, "k_scale_buffer", None) is not None:
            raise ValueError("FlatCake linker: scaled KV caches are not supported")
        layers = len(kvcache.k_buffer)
        mapping: dict[int, int | tuple[int, ...]] = {i: (i, layers + i) for i in range(layers)}  # K, then V
        buffers, mla = [*kvcache.k_buffer, *kvcache.v_buffer], False
    elif type(kvcache) is MLATokenToKVPool:
        layers = len(kvcache.kv_buffer)
        mapping, buffers, mla = {i: i for i in range(layers)}, list(kvcache.kv_buffer), True
    else:
        raise ValueError(f"FlatCake linker: the {type(kvcache).__name__} device pool is not supported (plain MHA "
                         "and MLA pools are); hybrid models keep the HiCache backend (FlatCakeStorage)")  # fmt: skip
    entry = DevicePoolEntry(name=PoolName.KV, indices_from_pool=PoolName.KV, device_pool=kvcache,
                            components=[buffers], layer_mapping=mapping, page_size=page_size,
                            rows_are_pages=False)  # fmt: skip
    return entry, layers, mla


def _tp(params: Any) -> tuple[int, int]:
    """This rank's place in the attention TP group the cache is sharded over (SGLang's own choice)."""
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(group=group)
    return 0, 1


class FlatCakeLinker(UnifiedCacheLinker):  # type: ignore[misc]
    def __init__(self, server_args: Any, params: Any, *, components: Any = None,
                 extra_config: dict[str, Any] | None = None, forward_stream: Any = None) -> None:  # fmt: skip
        self.forward_stream = forward_stream
        extra = dict(extra_config or {})
        self.socket = str(extra.get("socket", DEFAULT_SOCKET))
        self.page_tokens = int(params.page_size)
        entry, layers, self.is_mla = plain_kv_entry(params.token_to_kv_pool_allocator.get_kvcache(), self.page_tokens)
        self.pools: dict[PoolName, Any] = {PoolName.KV: entry}
        self.kv = KVPages(entry, layers, self.page_tokens)
        self.layers = layers
        tp_rank, tp_size = _tp(params)
        self.suffix = key_suffix(mla=self.is_mla, tp_rank=tp_rank, tp_size=tp_size, pp_rank=int(params.pp_rank),
                                 pp_size=int(params.pp_size), cp_rank=int(params.attn_cp_rank),
                                 cp_size=int(params.attn_cp_size), extra=extra)  # fmt: skip
        self.writer = not self.is_mla or tp_rank == 0  # MLA: ranks share pages, rank 0 writes them
        capacity = int(extra.get("signal_capacity", 1 << 16))
        self.signals, self.chains = ChainSignals(capacity), Chains(capacity)
        self.defaults = deployment_hints(extra)
        self.layer_done_counter = TimedCounter(layers)
        self._device = get_device_module()
        self._pending: dict[str, _Request] = {}
        self._loads: dict[int, LayerLoads] = {}
        self._offloads = _Offloads(self._store, int(extra.get("save_queue_bytes", 1 << 30)),
                                   float(extra.get("save_retry_s", 30.0)))  # fmt: skip
        self.engine: Engine = connect(self.socket, layers=layers, page_bytes=self.kv.page_bytes)
        log.info("FlatCake linker: %d layers x %d bytes per page (padded to %d), restores %s, keys%s", layers,
                 self.kv.raw_bytes, self.kv.page_bytes, "in place" if self.kv.in_place else "through a copy",
                 self.suffix or " shared by all ranks")  # fmt: skip

    def _name(self, key: Key) -> Key:
        return str(key) + self.suffix  # SGLang's keys are hex strings

    def _names(self, keys: list[str]) -> list[str]:
        return [k + self.suffix for k in keys]

    @staticmethod
    def _kv(transfers: list[PoolTransfer]) -> PoolTransfer | None:
        return next((t for t in transfers if t.name == PoolName.KV and t.keys), None)

    # ---- loads -------------------------------------------------------------------------------------
    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = self._kv(transfers)
        if kv is None or len(transfers) > 1:  # a sidecar pool: never here (plain pools only), never a hit
            return []
        keys = list(kv.keys or [])
        self.chains.learn(keys)
        self.signals.observe(self.chains.prefix(keys[0]), keys)  # a prompt others wait on is shared
        try:
            hit = self.engine.exists(self._names(keys))
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake linker: lookup for %s failed: %s", rid, exc)
            return []
        return list(range(1, hit + 1))

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = self._kv(transfers)
        if kv is None or kv.device_indices is None or rid in self._pending:
            return False
        keys = list(kv.keys or [])
        rows = self.kv.rows(kv.device_indices)
        target = self.kv.target(rows)
        staged = None if target is not None else aligned_empty((self.layers, len(rows), self.kv.page_bytes))
        try:  # opening pins the pages: a page reclaimed since the lookup is refused now, and SGLang computes
            restore = self.engine.get(self._names(keys), target if target is not None else staged)
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake linker: load of %d pages for %s refused: %s", len(keys), rid, exc)
            return False
        self._pending[rid] = _Request(restore, rows, staged)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        request = self._pending.pop(rid, None)
        if request is None:
            return False
        request.restore.__exit__(None, None, None)  # releases the pins
        return True

    def start_layer_wise_loading(self) -> int:
        if not self._pending:
            return -1
        requests, self._pending = list(self._pending.values()), {}
        index = int(self.layer_done_counter.update_producer())
        ready = self._device.Event()
        ready.record()  # the slots' earlier users on this stream are done before the copies (GPU)
        batch = _Batch(requests)
        pages = sum(r.pages for r in requests)
        self._loads[index] = LayerLoads(lambda: batch, self.layers, pages,
                                        functools.partial(self._landed, index, requests, ready),
                                        functools.partial(self._ended, index), logger=log,
                                        name="flatcake-sglang-layers")  # fmt: skip
        self.engine.stats.add("connector_pages_layerwise", pages)
        return index

    def _landed(self, index: int, requests: list[_Request], ready: Any, layer: int) -> None:
        """Layer ``layer`` of every request is in place (or staged: copied in now); the forward may read it.
        The last layer waits for ``_ended``: only then is ``missing`` final."""
        if layer == 0:
            ready.synchronize()
        staged = [r for r in requests if r.staged is not None]
        if staged:
            self._copy_in(layer, staged)
        if layer < self.layers - 1:
            self.layer_done_counter.complete(index, layer)

    def _copy_in(self, layer: int, requests: list[_Request]) -> None:
        if self.kv.device.type == "cpu":
            for r in requests:
                assert r.staged is not None
                self.kv.copy_in(layer, r.rows, r.staged[layer])
            return
        stream = self._device.Stream()  # the copies finish before the layer is reported (the forward reads it)
        with self._device.stream(stream):
            for r in requests:
                assert r.staged is not None
                self.kv.copy_in(layer, r.rows, r.staged[layer])
        stream.synchronize()

    def _ended(self, index: int, missing: set[int], failed: BaseException | None) -> None:
        if not end_batch(self.layer_done_counter, index, self.layers, missing, failed):
            log.warning("FlatCake linker: load batch %d failed (%d pages missing; %s), SGLang aborts its requests",
                        index, len(missing), failed)  # fmt: skip

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        loads = self._loads.pop(counter_index, None)
        if loads is not None:
            loads.join()  # the thread wrote its last byte and released the pins
        landed = bool(self.layer_done_counter.finish(counter_index))
        self._report_stall()
        return landed

    def _report_stall(self) -> None:
        waited, self.layer_done_counter.waited_s = self.layer_done_counter.waited_s, 0.0
        if waited:
            self.engine.stats.add("connector_stall_us_load", int(waited * 1e6))

    # ---- offloads ----------------------------------------------------------------------------------
    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        kv = self._kv(transfers)
        if kv is None or kv.device_indices is None:
            return False
        keys = list(kv.keys or [])
        self.chains.learn(keys, session_id)
        if not self.writer:
            self._offloads.skip()
            return True
        rows = self.kv.rows(kv.device_indices)
        prefix = self.chains.prefix(keys[0])
        events = self.record_offload_ready()  # the forward that wrote the pages is done before they are read
        nbytes = len(rows) * self.layers * self.kv.page_bytes
        job = SaveJob(session_id or "", nbytes, functools.partial(self._gather, rows, keys, prefix, events),
                      pages=len(rows))  # fmt: skip
        waited = self._offloads.submit(job)
        if waited:
            self.engine.stats.add("connector_stall_us_save", int(waited * 1e6))
        return True

    def _gather(self, rows: list[int], keys: list[str], prefix: list[Key], events: list[Any]) -> Any:
        for event in events:
            event.synchronize()
        return keys, self.kv.copy_out(rows), prefix

    def _store(self, data: tuple[list[str], npt.NDArray[np.uint8], list[Key]]) -> None:
        keys, kv, prefix = data
        stored = self.engine.exists(self._names(keys))  # a restored prefix, inserted again: already there
        if stored == len(keys):
            return
        prefix, keys, kv = [*prefix, *keys[:stored]], keys[stored:], kv[:, stored:]
        runs = self.signals.write(prefix, keys, self.page_tokens)
        for run in runs:
            part = kv[:, run.start : run.stop]
            if part.shape[1] != kv.shape[1] or stored:  # a slice of a layer-major buffer: the engine takes C order
                part, view = aligned_empty(part.shape), part
                part[...] = view
            hints = run_hints(run, self.defaults, {}, self._name)
            self.engine.put(self._names(keys[run.start : run.stop]), part, hints)
        self.signals.record(keys, runs, open_turn=False)
        self.engine.stats.add("connector_pages_saved", len(keys))

    def num_completed_offloads(self) -> int:
        return len(self._offloads.results)

    def pop_completed_offload(self) -> bool:
        return self._offloads.results.popleft()

    # ---- lifecycle ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """SGLang's flush: queued loads dropped, running ones and every offload finished, then a clean slate."""
        for rid in list(self._pending):
            self.cancel_queued_load(rid)
        for loads in self._loads.values():
            loads.join()
        self._loads.clear()
        self._offloads.drain()
        self._offloads.results.clear()
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self._offloads.stop()
        self.engine.close()
