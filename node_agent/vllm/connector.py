"""vLLM's v1 KV connector on FlatCake: the node agent's catalog, this process's bytes (as the SGLang backend).

vLLM builds one instance per role (vLLM 0.32, ``distributed/kv_transfer/kv_connector/v1/base.py``):

- **scheduler** (the engine core): ``get_num_new_matched_tokens`` says how many tokens past vLLM's own
  prefix-cache hit FlatCake holds (whole blocks, at most up to the prompt's last block; loaded
  synchronously, before the step's forward); ``build_connector_meta`` plans each step's loads and saves
  (``plan.Tracker``) with each save's placement hints, and ships them to the worker inside vLLM's
  metadata. The hints are derived here, where every lookup is seen (``ChainSignals``: a prompt several
  waiting requests continue is shared), then the deployment's ``placement_hints`` (extra config), then
  the request's own ``kv_transfer_params: {"flatcake": {...}}`` (``service/hints.py``).
- **worker**: ``register_kv_caches`` takes the per-layer KV tensors, each ``[blocks][...]`` with one block
  contiguous (on the CPU ``[blocks, kv_heads, block_size, 2 x head_size]``, a layout the attention kernel
  packs: a block is moved whole, as opaque bytes); ``start_load_kv`` restores the planned blocks into
  them before the forward; ``wait_for_save`` stores the blocks the step completed, after it.

One vLLM block is one FlatCake page of ``layers x page_bytes`` (``page_bytes``: a layer's block, padded to
4 KiB); the geometry is checked against the agent's when the worker registers. Placement signals come
from the block-hash chain, as the SGLang backend derives them (``policy/signals.py``). A block that fails
to load is reported to vLLM (``get_block_ids_with_load_errors``), which recomputes it with
``kv_load_failure_policy: recompute``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
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
from flatcake.node_agent.policy.signals import ChainSignals
from flatcake.node_agent.service.client import connect
from flatcake.node_agent.service.hints import deployment_hints, run_hints, tenant_suffix
from flatcake.node_agent.vllm.plan import Load, Save, Tracker, block_keys, lookup_range, rank_suffix

# Under vLLM's logger tree: vLLM configures only its own loggers, so this one prints where vLLM's do.
log = logging.getLogger("vllm.flatcake.connector")

DEFAULT_SOCKET = "/run/flatcake/agent.sock"
# What a storage call may meet in normal operation: a miss (vLLM computes), never an engine crash.
STORAGE_FAULTS = (FlatCakeError, ConnectionError, TimeoutError, OSError)


class FlatCakeConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, pickled from the scheduler to the worker."""

    def __init__(self, loads: list[Load], saves: list[Save]) -> None:
        self.loads = loads
        self.saves = saves


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
        # scheduler side
        self.tracker = Tracker(self.block_size)
        self._requests: dict[str, Any] = {}
        self._request_keys: dict[str, list[str]] = {}  # req_id -> keys of its hashed blocks so far
        self._matched: dict[str, int] = {}  # req_id -> first block FlatCake would supply
        # worker side
        self._layers: list[npt.NDArray[np.uint8]] = []  # each layer as [blocks][raw_bytes]
        self._target: PagedTarget | None = None  # vLLM's KV buffer as a restore destination (_in_place)
        self._target_geometry = (0, 0)  # layer 0's first block's offset in it, and the block stride
        self._load_errors: set[int] = set()
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
        keys = self._keys(request)
        blocks = lookup_range(num_computed_tokens, request.num_prompt_tokens, self.block_size, len(keys))
        if not blocks:
            return 0, False
        ask = keys[blocks.start : blocks.stop]
        self.signals.observe(keys[: blocks.start], ask)
        try:
            hit = self._engine().exists(ask)
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake connector: lookup failed: %s", exc)
            return 0, False
        self._matched[request.request_id] = blocks.start
        return hit * self.block_size, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        first = self._matched.pop(request.request_id, None)
        if num_external_tokens > 0 and first is not None:
            self.tracker.expect_load(request.request_id, first, num_external_tokens // self.block_size)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        loads: list[Load] = []
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
        return FlatCakeConnectorMetadata(loads, saves)

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

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self.tracker.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        self._request_keys.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None  # saves run within the step that completes a block: nothing outlives the request

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
        found = _in_place([kv_caches[n] for n in names], self.raw_bytes)
        if found is not None:
            self._target, self._target_geometry = found[0], (found[1], found[2])
        self._engine()  # the agent's pool must have this geometry: refused here, not at the first request
        log.info("FlatCake connector: %d layers registered, %d B per block, loads %s", len(layers), self.raw_bytes,
                 "in place" if self._target else "through a copy")  # fmt: skip

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, FlatCakeConnectorMetadata):
            return
        for load in meta.loads:
            self._load(load)

    def _load(self, load: Load) -> None:
        """Restore the planned blocks: in place, straight into vLLM's KV buffer where its layers are views
        of one buffer at one stride (vLLM's CPU allocation), else through an aligned copy."""
        n, raw = len(load.keys), self.raw_bytes
        in_place = self._target is not None
        if self._target is not None:
            base, block_stride = self._target_geometry
            t = self._target
            offsets = [base + b * block_stride for b in load.block_ids]
            dest: Any = PagedTarget(t.memory, t.layers, offsets, t.layer_stride, t.piece_offsets, t.piece_bytes)
        else:
            dest = aligned_empty((len(self._layers), n, self.page_bytes))
        engine = self._engine()
        try:
            with engine.get(load.keys, dest) as restore:
                missing = restore.run()
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake connector: load of %d blocks failed: %s", n, exc)
            missing = set(range(n))
        good = min(missing, default=n)  # a prefix: vLLM recomputes from the first block that failed
        if not in_place:
            ids = np.asarray(load.block_ids[:good], dtype=np.int64)
            for layer, blocks in enumerate(self._layers):
                blocks[ids] = dest[layer, :good, :raw]
        self._load_errors.update(load.block_ids[good:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads finish in ``start_load_kv``, before the forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Blocks are saved whole in ``wait_for_save``, once every layer has written them."""

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, FlatCakeConnectorMetadata) or not self.writer:
            return
        for save in meta.saves:
            self._save(save)

    def _save(self, save: Save) -> None:
        if not save.runs:
            return
        ids = np.asarray(save.block_ids, dtype=np.int64)
        kv = aligned_empty((len(self._layers), len(ids), self.page_bytes))
        for layer, blocks in enumerate(self._layers):
            kv[layer, :, : self.raw_bytes] = blocks[ids]
        engine = self._engine()
        try:
            for start, stop, hints in save.runs:
                part = kv[:, start:stop]
                if len(save.runs) > 1:  # a slice of a layer-major buffer is strided: the engine takes C order
                    part, view = aligned_empty(part.shape), part
                    part[...] = view
                engine.put(save.keys[start:stop], part, hints)
        except STORAGE_FAULTS as exc:
            log.warning("FlatCake connector: save of %d blocks failed: %s", len(ids), exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
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
