"""A client process for the multi-process and crash tests (run as a script).

    kv_client.py SOCKET LOG SECONDS SEED [--sessions N] [--turns N]

Writes sessions of pages whose bytes are a pure function of the key, logging ``attempt <keys>``
before each put and ``published <keys>`` after it returns, and reading back (and checking) what it
wrote. Exits 0 when its time is up, 3 when the agent went away, 1 on a wrong byte.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from typing import TextIO

import numpy as np

from flatcake.node_agent.datapath.buffers import aligned_empty
from flatcake.node_agent.datapath.engine import Engine
from flatcake.node_agent.policy.placement import Hints
from flatcake.node_agent.service.client import connect


def page_bytes_for(key: str, layers: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(key.encode())).integers(0, 256, (layers, page_bytes), dtype=np.uint8)


def fill(keys: list[str], layers: int, page_bytes: int) -> np.ndarray:
    kv = aligned_empty((layers, len(keys), page_bytes))
    for j, key in enumerate(keys):
        kv[:, j] = page_bytes_for(key, layers, page_bytes)
    return kv


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("socket")
    ap.add_argument("log")
    ap.add_argument("seconds", type=float)
    ap.add_argument("seed", type=int)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--pages", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1 << 30)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds to sleep between rounds")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    try:
        engine = connect(args.socket)
    except ConnectionError:
        return 3
    with open(args.log, "a", buffering=1) as log:
        return run(engine, log, args, rng)


def run(engine: Engine, log: TextIO, args: argparse.Namespace, rng: np.random.Generator) -> int:
    c = engine.config
    deadline = time.monotonic() + args.seconds
    round_no = 0
    try:
        while time.monotonic() < deadline and round_no < args.rounds:
            round_no += 1
            for s in range(args.sessions):
                history: list[str] = []
                for t in range(args.turns):
                    keys = [f"c{args.seed}-r{round_no}-s{s}-t{t}-p{j}" for j in range(args.pages)]
                    log.write("attempt " + " ".join(keys) + "\n")
                    hints = Hints(turn=t + 1, parent_key=history[-1] if history else None,
                                  prefix_refcount=1 + int(rng.random() < 0.3))  # fmt: skip
                    engine.put(keys, fill(keys, c.layers, c.page_bytes), hints)
                    log.write("published " + " ".join(keys) + "\n")
                    history += keys
                hit = engine.exists(history)
                dest = np.zeros((c.layers, len(history), c.page_bytes), np.uint8)
                with engine.get(history[:hit], dest) as restore:
                    missing = restore.run()
                bad = [
                    k
                    for i, k in enumerate(history[:hit])
                    if i in missing or not np.array_equal(dest[:, i], page_bytes_for(k, c.layers, c.page_bytes))
                ]
                if bad:
                    print(f"corrupt pages: {bad[:3]}", file=sys.stderr)
                    return 1
                log.write(f"verified {hit}\n")
            time.sleep(args.pause)
    except (ConnectionError, BrokenPipeError):
        return 3
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
