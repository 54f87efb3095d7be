"""How a prefill's compute overlaps the KV layers restored for it: one rule, charged to every system.

SGLang 0.5.23 loads host pages into HBM layer by layer and the forward pass of layer ``l`` waits only
for layer ``l``'s copy (``LayerDoneCounter``: the attention backend's KV accessors call
``wait_until(layer)``, ``mem_cache/memory_pool.py``; the copies run in order on one stream,
``managers/cache_controller.py`` ``start_loading``). FlatCake's restores yield layers as they land.
So a prefill of ``L`` layers, ``c`` seconds of compute each, whose layer ``l`` arrives at ``a[l]``,
ends at ``e[L-1]`` with ``e[l] = max(a[l], e[l-1]) + c`` and ``e[-1] = start``: that is,
``start + L*c`` or ``max over l of (a[l] + (L - l) * c)``, whichever is later.

Pure arithmetic: the emulator feeds it the layer times its real restores yield, the simulator the
times its device models give.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def prefill_end(start: float, arrivals: Sequence[float], layers: int, compute_s: float) -> float:
    """When a prefill of ``compute_s`` seconds over ``layers`` layers ends, started at ``start`` with
    layer ``l`` of its restored KV in HBM at ``arrivals[l]`` (no arrivals: nothing restored)."""
    if layers < 1:
        raise ValueError(f"layers: {layers} must be >= 1")
    per_layer = compute_s / layers
    end = start + compute_s
    if len(arrivals):
        if len(arrivals) != layers:
            raise ValueError(f"arrivals: {len(arrivals)} layer times for {layers} layers")
        remaining = (layers - np.arange(layers)) * per_layer
        end = max(end, float(np.max(np.asarray(arrivals, dtype=np.float64) + remaining)))
    return end


def even_arrivals(start: float, done: float, layers: int) -> list[float]:
    """Layer times of a copy that moves every layer in turn at one rate, from ``start`` to ``done``."""
    step = (done - start) / layers
    return [start + (i + 1) * step for i in range(layers)]


def latest(*series: Sequence[float]) -> list[float]:
    """Per layer, the latest of several restores' arrival times (empty series are ignored)."""
    present = [s for s in series if len(s)]
    if not present:
        return []
    return [float(x) for x in np.max(np.asarray(present, dtype=np.float64), axis=0)]
