"""Store a few KV pages through this machine's node agent and read them back (examples/agent.json)."""

import sys

import numpy as np

from flatcake.node_agent import Hints, aligned_empty, connect

socket = sys.argv[1] if len(sys.argv) > 1 else "/tmp/flatcake-example/agent.sock"
with connect(socket) as engine:  # the agent's geometry: layers x page_bytes a page
    layers, page_bytes = engine.config.layers, engine.config.page_bytes
    keys = [f"example/page-{i}" for i in range(4)]  # a serving engine's prefix-chained page hashes
    kv = aligned_empty((layers, len(keys), page_bytes))  # layer-major, 4 KiB aligned, as the engine writes
    kv[...] = np.random.default_rng(0).integers(0, 256, kv.shape, dtype=np.uint8)
    engine.put(keys, kv, Hints(context_tokens=1 << 20))  # a long session: placed on SSD (Table 2)
    back = aligned_empty(kv.shape)
    with engine.get(keys, back) as restore:
        missing = restore.run()  # layer by layer; each layer is usable as soon as it is yielded
    assert not missing and np.array_equal(back, kv), "pages came back different"
    print(f"{len(keys)} pages stored and read back bit-exact ({kv.nbytes} bytes)")
