"""``GatedLinker``: FlatCake's SGLang linker with each layer held back until the forward waits for it.

Loaded inside a real SGLang server (tests/node_agent/sglang/test_linker_real_server.py puts the source tree
on the server's ``PYTHONPATH`` and names ``tests.support.sglang_linker`` as ``linker_module_path``). A layer's
bytes, once they landed in the staging buffer, are copied into the device slots and released to the forward
only after the forward has begun waiting for that layer (or ``gate_s`` passed: a ``timeout`` record). A
forward that read a layer without waiting would read slots not yet written, and a layer released before the
forward waits would not show the wait; the trace (JSON lines: ``kind`` ``wait`` / ``complete`` / ``read`` /
``timeout``, ``index``, ``layer``, ``t`` in monotonic ns) lets the test check the order."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from flatcake.node_agent.sglang.linker import FlatCakeLinker, TimedCounter


class TracingCounter(TimedCounter):
    """SGLang's counter, recording when the forward starts and ends waiting for a layer of a load batch and
    when the linker completes one."""

    def __init__(self, num_layers: int, linker: GatedLinker) -> None:
        super().__init__(num_layers)
        self.linker = linker

    def wait_until(self, threshold: int) -> None:
        index = self.consumer_index
        loading = self.futures.get(index) is not None
        if loading:
            self.linker.record("wait", index, threshold)
            self.linker.waiting(index, threshold).set()
        super().wait_until(threshold)
        if loading:
            self.linker.record("read", index, threshold)

    def complete(self, index: int, layer: int) -> None:
        self.linker.record("complete", index, layer)
        super().complete(index, layer)


class GatedLinker(FlatCakeLinker):
    def __init__(self, *args: Any, extra_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        extra = dict(extra_config or {})
        self.trace = Path(extra.pop("trace"))
        self.gate_s = float(extra.pop("gate_s", 60.0))
        self._lock = threading.Lock()
        self._waits: dict[tuple[int, int], threading.Event] = {}
        super().__init__(*args, extra_config=extra, **kwargs)
        self.layer_done_counter = TracingCounter(self.layers, self)  # SGLang registers it after construction

    def record(self, kind: str, index: int, layer: int) -> None:
        line = json.dumps({"kind": kind, "index": index, "layer": layer, "t": time.monotonic_ns()})
        with self._lock, self.trace.open("a") as f:
            f.write(line + "\n")

    def waiting(self, index: int, layer: int) -> threading.Event:
        with self._lock:
            return self._waits.setdefault((index, layer), threading.Event())

    def _landed(self, index: int, requests: list[Any], ready: Any, layer: int) -> None:
        if not self.waiting(index, layer).wait(self.gate_s):
            self.record("timeout", index, layer)
        super()._landed(index, requests, ready, layer)
