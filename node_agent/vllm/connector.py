"""vLLM's v1 KV connector on FlatCake: the node agent's catalog, this process's bytes (as the SGLang backend).

vLLM builds one instance per role (vLLM 0.32, ``distributed/kv_transfer/kv_connector/v1/base.py``):

- **scheduler** (the engine core): ``get_num_new_matched_tokens`` says how many tokens past vLLM's own
  prefix-cache hit FlatCake holds (whole blocks, at most up to the prompt's last block) and how they load
  (FC-MAS, as vLLM allows it: by the slowest medium they need). A prefix wholly in DRAM loads in the step
  that schedules the request, layer by layer under its forward; one with a page on SSD loads outside the
  steps: vLLM parks the request (``WAITING_FOR_REMOTE_KVS``) and runs the ready ones meanwhile, until the
  worker reports the load done (``get_finished``). ``build_connector_meta`` plans each step's loads and saves
  (``plan.Tracker``) with each save's placement hints, and ships them to the worker inside vLLM's
  metadata. The hints are derived here, where every lookup is seen (``ChainSignals``: a prompt several
  waiting requests continue is shared), then the deployment's ``placement_hints`` (extra config), then
  the request's own ``kv_transfer_params: {"flatcake": {...}}`` (``service/hints.py``).
- **worker**: ``register_kv_caches`` takes the per-layer KV tensors, each ``[blocks][...]`` with one block
  contiguous (on the CPU ``[blocks, kv_heads, block_size, 2 x head_size]``, a layout the attention kernel
  packs: a block is moved whole, as opaque bytes); ``start_load_kv`` starts the step's loads on threads
  (``service/transfers.py``), ``wait_for_layer_load`` waits for one layer's bytes only; ``wait_for_save`` queues the
  store of the blocks the step completed, as references: a thread copies them out of vLLM's buffer and
  stores them after the step. vLLM frees a finished or preempted request's blocks without asking (saves
  hold none), and the next forward may write them: ``handle_preemptions``, which vLLM calls before every
  forward, copies out what the thread has not yet of the requests the step's metadata names finished or
  preempted. ``step_stall_s``: the time the step waited on the connector (a layer's bytes, such a copy,
  room in the save queue), reported to the agent (``flatcake_connector_stall_seconds``).

One vLLM block is one FlatCake page of ``layers x page_bytes`` (``page_bytes``: a layer's block, padded to
4 KiB); the geometry is checked against the agent's when the worker registers. Extra config:
``async_loads`` (``ssd``: a prefix with a page on SSD loads outside the steps; ``all``; ``none``: every
load in its step), ``save_queue_bytes`` (blocks waiting to be stored, 1 GiB; beyond it a step waits),
``save_retry_s`` (how long a save waits for a restarted agent, 30 s). Placement signals come from the
block-hash chain, as the SGLang backend derives them (``policy/signals.py``). A block that fails
to load is reported to vLLM (``get_block_ids_with_load_errors``), which recomputes it with
``kv_load_failure_policy: recompute``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from flatcake.errors import FlatCakeError
from flatcake.node_agent.datapath.buffers import aligned_empty, round_up
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.datapath.target import PagedTarget
from flatcake.node_agent.policy.gva import needs_ssd
from flatcake.node_agent.policy.signals import ChainSignals
from flatcake.node_agent.service.client import RemoteCatalog, connect
from flatcake.node_agent.service.hints import deployment_hints, run_hints, tenant_suffix
from flatcake.node_agent.service.transfers import STORAGE_FAULTS, AsyncLoads, LayerLoads, SaveJob, SaveQueue
from flatcake.node_agent.vllm.plan import Load, Save, Tracker, block_keys, lookup_range, rank_suffix

# Under vLLM's logger tree: vLLM configures only its own loggers, so this one prints where vLLM's do.
log = logging.getLogger("vllm.flatcake.connector")

DEFAULT_SOCKET = "/run/flatcake/agent.sock"
ASYNC_LOADS = ("ssd", "all", "none")  # which loads park their request outside the steps


class FlatCakeConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, pickled from the scheduler to the worker."""

    def __init__(self, loads: list[Load], saves: list[Save], released: set[str] | None = None) -> None:
        self.loads = loads
        self.saves = saves
        self.released = released or set()  # finished or preempted since the last step: vLLM may reuse their blocks


class FlatCakeConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.socket = str(extra.get("socket", DEFAULT_SOCKET))
        self.block_size = int(vllm_config.cache_config.block_size)
        self.mla = bool(vllm_config.model_config.use_mla)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.is_scheduler = role == KVConnectorRole.SCHEDULER
        # The scheduler looks up rank 0's shard; each worker stores and loads its own.
        rank = 0 if self.is_scheduler else _tp_rank()
        self.suffix = rank_suffix(rank, self.tp_size, self.mla) + tenant_suffix(extra)
        self.writer = not self.mla or rank == 0
        group = kv_cache_config.kv_cache_groups[0] if kv_cache_config is not None else None
        self.layer_names: list[str] = list(group.layer_names) if group is not None else []
        self.raw_bytes = int(group.kv_cache_spec.page_size_bytes) if group is not None else 0
        self.page_bytes = round_up(self.raw_bytes) if self.raw_bytes else 0
        self.engine: Engine | None = None
        self.signals = ChainSignals()  # scheduler side: lookups and writes of every request
        self.defaults = deployment_hints(extra)
        self.async_loads = str(extra.get("async_loads", "ssd"))
        if self.async_loads not in ASYNC_LOADS:
            raise ValueError(f"kv_connector_extra_config.async_loads: {self.async_loads!r} is not one of "
                             f"{', '.join(ASYNC_LOADS)}")  # fmt: skip
        self.save_queue_bytes = int(extra.get("save_queue_bytes", 1 << 30))
        self.save_retry_s = float(extra.get("save_retry_s", 30.0))
        # scheduler side
        self.tracker = Tracker(self.block_size)
        self._requests: dict[str, Any] = {}
        self._request_keys: dict[str, list[str]] = {}  # req_id -> keys of its hashed blocks so far
        self._matched: dict[str, tuple[int, bool]] = {}  # req_id -> first block FlatCake supplies, parked
        self._parked: list[Load] = []  # loads of parked requests, for the next step's metadata
        # worker side
        self._layers: list[npt.NDArray[np.uint8]] = []  # each layer as [blocks][raw_bytes]
        self._target: PagedTarget | None = None  # vLLM's KV buffer as a restore destination (_in_place)
        self._target_geometry = (0, 0)  # layer 0's first block's offset in it, and the block stride
        self._load_errors: set[int] = set()
        self._layer_index: dict[str, int] = {}
        self._step_loads: tuple[LayerLoads, list[Load]] | None = None  # this step's layer-wise loads
        self._async = AsyncLoads(logger=log, name="flatcake-vllm-loads")
        self._async_blocks: dict[str, list[int]] = {}  # parked request -> the blocks its load fills
        self._saves: SaveQueue | None = None
        self.stall = {"load": 0.0, "save": 0.0}  # seconds steps waited on the connector, not yet reported
        log.info("FlatCake connector (%s): socket %s, %d layers x %d B per block (padded to %d)",
                 "scheduler" if self.is_scheduler else "worker", self.socket, len(self.layer_names),
                 self.raw_bytes, self.page_bytes)  # fmt: skip

    def _engine(self) -> Engine:
        if self.engine is None:  # the agent refuses a pool of another geometry than vLLM's blocks
            known = bool(self.page_bytes)
            self.engine = connect(self.socket, layers=len(self.layer_names) if known else None,
                                  page_bytes=self.page_bytes if known else None)  # fmt: skip
        return self.engine

    def _keys(self, request: Any) -> list[str]:
        """The request's block keys; only blocks hashed since the last call are converted (this runs for
        every scheduled request every step)."""
        keys = self._request_keys.setdefault(request.request_id, [])
        hashes = request.block_hashes
        if len(hashes) > len(keys):
            keys.extend(block_keys(hashes[len(keys) :], self.suffix))
        return keys

    # ---- scheduler side ----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        if not self.tracker.may_offer(request.request_id):
            return 0, False
        keys = self._keys(request)
        blocks = lookup_range(num_computed_tokens, request.num_prompt_tokens, self.block_size, len(keys))
        if not blocks:
            return 0, False
        ask = keys[blocks.start : blocks.stop]
        self.signals.observe(keys[: blocks.start], ask)
        try:
            hit, park = self._lookup(ask)
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake connector: lookup failed: %s", exc)
            return 0, False
        if not hit:
            return 0, False
        self._matched[request.request_id] = (blocks.start, park)
        return hit * self.block_size, park

    def _lookup(self, keys: list[str]) -> tuple[int, bool]:
        """Blocks of ``keys`` FlatCake holds (a prefix), and whether their load parks the request: FC-MAS's
        rule, by the slowest medium the prefix needs (``async_loads: ssd``), or always, or never."""
        engine = self._engine()
        catalog = engine.catalog
        if self.async_loads != "ssd" or not isinstance(catalog, RemoteCatalog):
            return engine.exists(keys), self.async_loads == "all"
        hit, gvas, _ = catalog.lookup(keys)
        return hit, needs_ssd(gvas)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or matched is None:
            return
        first, park = matched
        n = num_external_tokens // self.block_size
        if park:  # vLLM parks the request: its load goes with the next metadata, outside any step
            ids = list(blocks.get_block_ids()[0])
            self._parked.append(self.tracker.async_load(request.request_id, self._keys(request), ids, first, n))
        else:
            self.tracker.expect_load(request.request_id, first, n)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        loads, self._parked = self._parked, []
        saves: list[Save] = []

        def plan(req_id: str, block_ids: Sequence[int] | None, replace: bool, computed: int) -> None:
            request = self._requests.get(req_id)
            if request is None:
                return
            after = computed + int(scheduler_output.num_scheduled_tokens.get(req_id, 0))
            load, save = self.tracker.step(req_id, self._keys(request), block_ids, replace_blocks=replace,
                                           computed_after=after, prompt_tokens=request.num_prompt_tokens)  # fmt: skip
            if load is not None:
                loads.append(load)
            if save is not None:
                self._derive(save, request)
                saves.append(save)

        for new in scheduler_output.scheduled_new_reqs:
            plan(new.req_id, new.block_ids[0], True, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            plan(req_id, ids[0] if ids else None, req_id in cached.resumed_req_ids, cached.num_computed_tokens[i])
        released = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        return FlatCakeConnectorMetadata(loads, saves, released)

    def _derive(self, save: Save, request: Any) -> None:
        """The save's runs and their hints, from the chains this scheduler has seen (recorded now: the save
        runs within this step; one that fails leaves only a stale session note behind)."""
        passed = (getattr(request, "kv_transfer_params", None) or {}).get("flatcake") or {}
        try:
            runs = self.signals.write(save.prefix, save.keys, self.block_size)
            save.runs = [(r.start, r.stop, run_hints(r, self.defaults, passed, where="kv_transfer_params.flatcake"))
                         for r in runs]  # fmt: skip
        except (FlatCakeError, ValueError) as exc:  # the request's hints are bad: its blocks are not stored
            log.warning("FlatCake connector: request %s: %s; its blocks are not stored", save.req_id, exc)
            save.runs = []
            return
        self.signals.record(save.keys, runs, open_turn=save.turn_open)

    def update_connector_output(self, connector_output: Any) -> None:
        """The worker's report of a step: which parked loads failed (their blocks among the invalid ones)."""
        super().update_connector_output(connector_output)
        self.tracker.load_results(connector_output.invalid_block_ids or (), connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.tracker.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        self._request_keys.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None  # vLLM may free the blocks: the worker's handle_preemptions copies out pending saves

    # ---- worker side -------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = self.layer_names or list(kv_caches)
        layers = []
        for name in names:
            t = kv_caches[name]
            if t.device.type != "cpu":
                raise ValueError(f"FlatCake connector: layer {name} is on {t.device}; this connector moves host "
                                 "memory (vLLM's CPU backend)")  # fmt: skip
            per_block = t[0].numel() * t.element_size()
            if self.raw_bytes and per_block != self.raw_bytes:
                raise ValueError(f"FlatCake connector: layer {name} holds {per_block} B per block, the KV cache "
                                 f"spec says {self.raw_bytes}")  # fmt: skip
            self.raw_bytes = per_block
            layers.append(t.view(torch.uint8).reshape(t.shape[0], per_block).numpy())
        self._layers = layers
        self.page_bytes = round_up(self.raw_bytes)
        self.layer_names = names
        self._layer_index = {name: i for i, name in enumerate(names)}
        found = _in_place([kv_caches[n] for n in names], self.raw_bytes)
        if found is not None:
            self._target, self._target_geometry = found[0], (found[1], found[2])
        self._engine()  # the agent's pool must have this geometry: refused here, not at the first request
        log.info("FlatCake connector: %d layers registered, %d B per block, loads %s", len(layers), self.raw_bytes,
                 "in place" if self._target else "through a copy")  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start the step's loads: those of scheduled requests layer by layer under the forward (one restore,
        on a thread), those of parked requests on the loading thread (reported by ``get_finished``)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, FlatCakeConnectorMetadata) or not meta.loads:
            return
        engine = self._engine()
        for load in meta.loads:
            if not load.sync:
                self._async_blocks[load.req_id] = load.block_ids
                dest, copy = self._dest(load.block_ids)
                # Counted first: counters go to the agent with a lease's release, which the load may reach first.
                engine.stats.add("connector_pages_async", len(load.keys))
                self._async.submit(load.req_id, len(load.keys), functools.partial(self._load_whole, load, dest, copy))
        sync = [load for load in meta.loads if load.sync]
        if sync:
            keys = [k for load in sync for k in load.keys]
            dest, copy = self._dest([b for load in sync for b in load.block_ids])
            engine.stats.add("connector_pages_layerwise", len(keys))
            loads = LayerLoads(
                lambda: engine.get(keys, dest),
                len(self._layers),
                len(keys),
                copy,
                logger=log,
                name="flatcake-vllm-layers",
            )
            self._step_loads = (loads, sync)

    def _dest(self, block_ids: Sequence[int]) -> tuple[Any, Callable[[int], None] | None]:
        """Where a load lands: in place, straight into vLLM's KV buffer where its layers are views of one buffer
        at one stride (vLLM's CPU allocation); else an aligned buffer and a function that copies one layer of
        it into vLLM's blocks once that layer landed."""
        if self._target is not None:
            base, block_stride = self._target_geometry
            t = self._target
            offsets = [base + b * block_stride for b in block_ids]
            return PagedTarget(t.memory, t.layers, offsets, t.layer_stride, t.piece_offsets, t.piece_bytes), None
        dest = aligned_empty((len(self._layers), len(block_ids), self.page_bytes))
        ids = np.asarray(block_ids, dtype=np.int64)

        def copy(layer: int) -> None:
            self._layers[layer][ids] = dest[layer, :, : self.raw_bytes]

        return dest, copy

    def _load_whole(self, load: Load, dest: Any, copy: Callable[[int], None] | None) -> set[int]:
        """A parked request's load (on the loading thread): the page indexes it lacks."""
        with self._engine().get(load.keys, dest) as restore:
            for layer in restore:
                if copy is not None:
                    copy(layer)
            return set(restore.missing)

    def _fail(self, block_ids: Sequence[int], missing: set[int]) -> None:
        """Report a load's blocks from its first missing page on: vLLM recomputes them (a prefix stays)."""
        if missing:
            self._load_errors.update(block_ids[min(missing) :])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called by each attention layer before it reads the cache: wait for this layer's bytes only."""
        if self._step_loads is None:
            return
        started = time.monotonic()
        self._step_loads[0].wait(self._layer_index.get(layer_name, len(self._layers) - 1))
        self.stall["load"] += time.monotonic() - started

    def _end_step_loads(self) -> None:
        """The step's layer-wise loads have ended (every layer was waited for): report their misses."""
        if self._step_loads is None:
            return
        loads, plan = self._step_loads
        self._step_loads = None
        started = time.monotonic()
        missing = loads.join()
        self.stall["load"] += time.monotonic() - started
        at = 0
        for load in plan:
            self._fail(load.block_ids, {i - at for i in missing if at <= i < at + len(load.keys)})
            at += len(load.keys)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward (vLLM calls it every step): the blocks of requests finished or preempted
        since the last step may be written by this forward; copy out the saves of theirs still queued."""
        meta = kv_connector_metadata
        if isinstance(meta, FlatCakeConnectorMetadata) and meta.released and self._saves is not None:
            seconds, pages = self._saves.release(meta.released)
            self.stall["save"] += seconds
            if pages:
                self._engine().stats.add("connector_pages_released", pages)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are saved whole in ``wait_for_save``, once every layer has written them."""

    def wait_for_save(self) -> None:
        """After the forward: queue the store of the blocks the step completed (copied out and stored after the
        step); a full queue makes the step wait (a stall, reported)."""
        self._end_step_loads()
        meta = self._get_connector_metadata()
        if isinstance(meta, FlatCakeConnectorMetadata) and self.writer:
            for save in meta.saves:
                self._save(save)
        self._report_stall()

    def _save(self, save: Save) -> None:
        if not save.runs:
            return
        if self._saves is None:
            self._saves = SaveQueue(
                self._store, self.save_queue_bytes, self.save_retry_s, logger=log, name="flatcake-vllm-saves"
            )
        nbytes = len(save.block_ids) * len(self._layers) * self.page_bytes
        job = SaveJob(save.req_id, nbytes, functools.partial(self._gather, save), pages=len(save.block_ids))
        self._engine().stats.add("connector_pages_saved", len(save.block_ids))  # first, as loads count theirs
        self.stall["save"] += self._saves.submit(job)

    def _gather(self, save: Save) -> list[tuple[list[str], npt.NDArray[np.uint8], Any]]:
        """The save's blocks copied out of vLLM's buffer, as its puts (on the save thread, or the step's
        ``handle_preemptions``)."""
        ids = np.asarray(save.block_ids, dtype=np.int64)
        kv = aligned_empty((len(self._layers), len(ids), self.page_bytes))
        for layer, blocks in enumerate(self._layers):
            kv[layer, :, : self.raw_bytes] = blocks[ids]
        puts = []
        for start, stop, hints in save.runs:
            part = kv[:, start:stop]
            if len(save.runs) > 1:  # a slice of a layer-major buffer is strided: the engine takes C order
                part, view = aligned_empty(part.shape), part
                part[...] = view
            puts.append((save.keys[start:stop], part, hints))
        return puts

    def _store(self, puts: list[tuple[list[str], npt.NDArray[np.uint8], Any]]) -> None:
        engine = self._engine()
        for keys, part, hints in puts:
            engine.put(keys, part, hints)

    def _report_stall(self) -> None:
        """Add the steps' waits to the engine's counters (sent to the agent with its next release)."""
        if self.engine is None:
            return
        for phase, seconds in self.stall.items():
            if seconds:
                self.engine.stats.add(f"connector_stall_us_{phase}", int(seconds * 1e6))
        self.stall = {"load": 0.0, "save": 0.0}

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Parked requests whose loads ended (their misses reported with them); saves hold no block."""
        done = self._async.done()
        for req_id, missing in done:
            self._fail(self._async_blocks.pop(req_id, []), missing)
        return None, {req_id for req_id, _ in done} or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._end_step_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        """Store what the save queue holds (for at most ``save_retry_s``), then close."""
        self._end_step_loads()
        self._async.stop()
        if self._saves is not None:
            self._saves.stop(self.save_retry_s)
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def _in_place(tensors: Sequence[torch.Tensor], raw: int) -> tuple[PagedTarget, int, int] | None:
    """vLLM's per-layer KV tensors as one restore destination, with layer 0's offset and the block stride,
    when they are contiguous views of one CPU buffer at one stride apart (vLLM's CPU backend allocates one
    buffer for all layers); None otherwise (the copying path)."""
    first = tensors[0]
    storage = first.untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous() for t in tensors):
        return None
    ptrs = [t.data_ptr() for t in tensors]
    stride = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
    if any(b - a != stride for a, b in itertools.pairwise(ptrs)) or (len(ptrs) > 1 and stride <= 0):
        return None
    memory: npt.NDArray[np.uint8] = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
    target = PagedTarget(memory, len(tensors), [], stride, [0], raw)
    return target, ptrs[0] - int(memory.ctypes.data), first.stride(0) * first.element_size()


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):  # no parallel group (a single process)
        return 0
