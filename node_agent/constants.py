"""Facts the node agent, the operator and the benchmarks share, each defined once.

The operator may import this module and ``config`` and nothing else of the node agent (import-linter
checks it), so it holds plain values only: no I/O and no imports from the rest of the package.
"""

from __future__ import annotations

ALIGN = 4096
"""Byte alignment of every pool offset, page and staging slice: O_DIRECT and libcufile DMA need it."""

NODE_BITS = 12
MAX_NODE_ID = (1 << NODE_BITS) - 1
"""NodeIDs are the 12-bit field ``[59:48]`` of a GVA: at most 4,096 nodes per cache."""

HUGEPAGE_BYTES = {"2Mi": 2 << 20, "1Gi": 1 << 30}
HUGEPAGE_SIZES = (*HUGEPAGE_BYTES, "none")

CLIENT_ID_ENV = "FLATCAKE_CLIENT_ID"
"""Who a client says it is (``register``'s ``client``; the webhook sets it to the pod's namespace/name): the
key of ``agent.max_clients_per_process`` for a client whose pid the agent cannot see (another PID
namespace: every pod, under the operator). Fairness, not authentication: the kernel's pid wins where seen."""
JOURNAL_FILE = "journal.log"
EPOCH_FILE = "epoch"
"""The agent's state files, in ``agent.state_dir`` (catalog/state_dir.py); the operator mounts the epoch
file read-only into inference pods (their writes hold it), the journal nowhere."""

SCHEDULER_POLICIES = ("mas", "fcfs")
PLACEMENT_MODES = (
    "table2",
    "adaptive",
    "copies",
)  # placement.mode: Table 2; corrected by measured reuse; + DRAM copies
"""FC-MAS, or SGLang's FCFS (the ablation: arrival order, a request still prefetching is skipped)."""

IO_BACKENDS = ("auto", "posix", "kvikio")
JOURNAL_FSYNC_POLICIES = ("always", "interval", "never")
EXTENT_POLICIES = ("warn", "refuse")
TRANSFER_PROTOCOLS = ("tcp", "rdma")
"""Transports of Mooncake's transfer engine that cross-node reads use (cluster.transfer_protocol)."""

VERIFY_READS = ("off", "ssd", "all")
"""Which restored pages a reader checks against their published crc32: none, SSD pages, or all."""

MAX_FRAME = 16 << 20
"""Largest control-protocol frame: a 65,536-key lookup of 64-character keys fits with room to spare."""

SGLANG_BACKEND = {
    "backend_name": "flatcake",
    "module_path": "flatcake.node_agent.sglang",
    "class_name": "FlatCakeStorage",
    "interface_v1": True,
    "hicache_storage_pass_prefix_keys": True,
}
"""SGLang's ``--hicache-storage-backend-extra-config`` for FlatCake's backend, less its ``socket``: the
dynamic backend to load, its batch interface, and prefix keys passed (the placement signals; SGLang
passes them only for a JSON true)."""

SGLANG_LINKER = {"linker": "FlatCakeLinker", "linker_module_path": "flatcake.node_agent.sglang.linker"}
"""SGLang's ``--unified-cache-external-linker-config`` for FlatCake's linker, less its ``linker_extra_config``
(which names the agent's ``socket``)."""


VLLM_CONNECTOR = {
    "kv_connector": "FlatCakeConnector",
    "kv_connector_module_path": "flatcake.node_agent.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}
"""vLLM's ``--kv-transfer-config`` for FlatCake's connector, less ``kv_connector_extra_config`` (its
``socket``): the connector to load, both roles, and a block FlatCake cannot deliver computed instead."""


def watermark_problem(low: float, high: float) -> str | None:
    """Why a pair of SSD reclaim watermarks is invalid, or None: reclaim starts above ``high`` and
    frees whole scopes until usage is at most ``low``, so ``0 < low <= high <= 1``."""
    if 0 < low <= high <= 1:
        return None
    return f"need 0 < low <= high <= 1, got low={low} and high={high}"
