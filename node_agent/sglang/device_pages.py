"""The linker's pure parts: where a stored page lies in SGLang's device KV pool, and the key chains it learns.

``KVPages`` maps FlatCake's stored page (``[layers][page_bytes]``) onto the device pool's per-layer buffers
as SGLang's linker pool entries describe them (``hybrid_cache/linker_pool_assembler.py``
``DevicePoolEntry``: ``kv_buffer``, ``layer_mapping``, ``prepare_locations``). Layer ``l`` of a page is the
entry's buffers for ``l`` in order (MHA: K then V; MLA: the latent buffer), each ``page_size`` rows of
that buffer: the same bytes, in the same order, as the HiCache backend stores from a ``layer_first`` or
``page_first`` host page, so either path restores what the other wrote. Restores land in place
(``PagedTarget``) where every buffer is a CPU view of one storage at one layer stride; otherwise through
an aligned host buffer, copied into the device rows one layer at a time (``copy_in``).

``end_batch`` is the rule that keeps a failed load from answering: the last layer of a batch is released
only once its restores ended with no page missing.

``Chains`` remembers, in bounded memory, the page before each page the linker has seen in one call
(lookups and offloads carry consecutive page hashes) and the last page each session offloaded: SGLang
hands a linker no prefix chain, so this is the prefix the placement signals (``policy/signals.py``) get.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from flatcake.node_agent.datapath.buffers import aligned_empty, round_up
from flatcake.node_agent.datapath.target import PagedTarget
from flatcake.node_agent.policy.placement import Key


class KVPages:
    """One device pool entry as FlatCake pages: ``layers`` x ``raw_bytes`` (padded to ``page_bytes``).

    ``entry`` needs ``kv_buffer`` (the buffers, each ``[rows][...]`` with one row contiguous),
    ``layer_mapping`` (layer -> the index, or indexes, of its buffers) and ``prepare_locations(indices)``
    (each page's first row, checked aligned and in range); ``span`` is the rows a page holds
    (``page_size`` where rows are tokens, 1 where rows are pages)."""

    def __init__(self, entry: Any, layers: int, span: int) -> None:
        self.entry, self.layers, self.span = entry, int(layers), int(span)
        self.buffers: list[list[tuple[torch.Tensor, int, int]]] = []  # per layer: (rows as bytes, offset, size)
        for layer in range(self.layers):
            mapped = entry.layer_mapping[layer]
            indexes = [mapped] if isinstance(mapped, int) else list(mapped)
            items, offset = [], 0
            for i in indexes:
                buf = entry.kv_buffer[i]
                rows = buf.view(torch.uint8).reshape(buf.shape[0], -1)  # a view: its rows are the pool's
                size = rows.shape[1] * self.span
                items.append((rows, offset, size))
                offset += size
            self.buffers.append(items)
        sizes = {sum(size for _, _, size in items) for items in self.buffers}
        if len(sizes) != 1:
            raise ValueError(f"device pool: layers hold different page sizes {sorted(sizes)}; FlatCake pages "
                             "need one size per layer")  # fmt: skip
        self.raw_bytes = sizes.pop()
        self.page_bytes = round_up(self.raw_bytes)
        self.device = self.buffers[0][0][0].device
        self._in_place = self._regular()

    def rows(self, indices: torch.Tensor) -> list[int]:
        """Each page's first row in the buffers (SGLang checks the slots are whole, aligned, in range)."""
        return [int(r) for r in self.entry.prepare_locations(indices)]

    def _regular(self) -> tuple[npt.NDArray[np.uint8], int, int, list[int], int, int] | None:
        """Where every buffer is a contiguous CPU view of one storage, with each layer's pieces at one offset
        from the layer's first and the layers one stride apart (an allocation of the whole pool at once):
        the storage as bytes, the first piece's offset in it, the layer stride, the piece offsets, the
        piece size and the row stride. None for separate allocations (SGLang's CPU and CUDA pools today)."""
        first = self.buffers[0][0][0]
        if first.device.type != "cpu":
            return None
        storage = first.untyped_storage()
        sizes = {size for items in self.buffers for _, _, size in items}
        strides = {rows.stride(0) for items in self.buffers for rows, _, _ in items}
        if len(sizes) != 1 or len(strides) != 1 or any(
            rows.untyped_storage().data_ptr() != storage.data_ptr() or not rows.is_contiguous()
            for items in self.buffers for rows, _, _ in items
        ):  # fmt: skip
            return None
        ptrs = np.array([[rows.data_ptr() for rows, _, _ in items] for items in self.buffers], dtype=np.int64)
        pieces = ptrs[0] - ptrs[0, 0]
        stride = int(ptrs[1, 0] - ptrs[0, 0]) if self.layers > 1 else 0
        expected = ptrs[0, 0] + stride * np.arange(self.layers)[:, None] + pieces[None, :]
        if not (ptrs == expected).all():
            return None
        memory: npt.NDArray[np.uint8] = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()
        base = int(ptrs[0, 0]) - int(memory.ctypes.data)
        return memory, base, stride, pieces.tolist(), sizes.pop(), strides.pop()

    @property
    def in_place(self) -> bool:
        return self._in_place is not None

    def target(self, rows: Sequence[int]) -> PagedTarget | None:
        """The pages at ``rows`` as a restore destination in the pool's own memory, or None (copy path)."""
        if self._in_place is None:
            return None
        memory, base, stride, pieces, size, row_stride = self._in_place
        offsets = [base + r * row_stride for r in rows]
        return PagedTarget(memory, self.layers, offsets, stride, pieces, size)

    def _row_index(self, rows: Sequence[int]) -> torch.Tensor:
        index = torch.as_tensor(list(rows), dtype=torch.int64)[:, None] + torch.arange(self.span)[None, :]
        return index.reshape(-1).to(self.device)

    def copy_in(self, layer: int, rows: Sequence[int], src: npt.NDArray[np.uint8]) -> None:
        """Layer ``layer`` of pages ``src`` (``[pages][>= raw_bytes]``) into the device rows ``rows``."""
        index = self._row_index(rows)
        for buf, offset, size in self.buffers[layer]:
            part = torch.from_numpy(np.ascontiguousarray(src[:, offset : offset + size]))
            buf.index_copy_(0, index, part.reshape(len(index), -1).to(buf.device, non_blocking=False))

    def copy_out(self, rows: Sequence[int]) -> npt.NDArray[np.uint8]:
        """The pages at ``rows`` as an aligned ``[layers][pages][page_bytes]`` buffer (what a put takes)."""
        kv = aligned_empty((self.layers, len(rows), self.page_bytes))
        index = self._row_index(rows)
        for layer, items in enumerate(self.buffers):
            for buf, offset, size in items:
                kv[layer, :, offset : offset + size] = buf.index_select(0, index).cpu().numpy().reshape(len(rows), size)
        return kv


def end_batch(counter: Any, index: int, layers: int, missing: set[int], failed: BaseException | None) -> bool:
    """A load batch's restores ended: release its last layer (every page arrived) or fail the batch, which
    lets the forward go on and makes SGLang's ``finish`` report it (the batch's requests are aborted before
    their output is used). ``counter`` is SGLang's ``LayerWiseLoadCounter``; layers before the last were
    released as they landed. Whether the batch landed."""
    if failed is not None or missing:
        counter.fail(index, failed or RuntimeError(f"FlatCake linker: {len(missing)} page(s) did not arrive"))
        return False
    counter.complete(index, layers - 1)
    return True


class Chains:
    """The page before each page seen in one call, and each session's last offloaded page (LRU-bounded)."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._parent: OrderedDict[Key, Key] = OrderedDict()
        self._session_tail: OrderedDict[str, Key] = OrderedDict()
        self._lock = threading.Lock()

    def _remember(self, table: OrderedDict[Any, Key], key: Any, value: Key) -> None:
        table[key] = value
        table.move_to_end(key)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def learn(self, keys: Sequence[Key], session: str | None = None) -> None:
        """``keys`` are consecutive pages of one chain; a session's offload ends at its last one."""
        with self._lock:
            for a, b in itertools.pairwise(keys):
                self._remember(self._parent, b, a)
            if session and keys:
                head = keys[0]
                tail = self._session_tail.get(session)
                if head not in self._parent and tail is not None and tail != head:
                    self._remember(self._parent, head, tail)  # the session's earlier pages come before
                self._remember(self._session_tail, session, keys[-1])

    def prefix(self, key: Key, limit: int = 1 << 14) -> list[Key]:
        """The known pages before ``key``, oldest first (as far back as the chain is known)."""
        out: list[Key] = []
        seen = {key}
        with self._lock:
            at = self._parent.get(key)
            while at is not None and at not in seen and len(out) < limit:
                out.append(at)
                seen.add(at)
                at = self._parent.get(at)
        out.reverse()
        return out
