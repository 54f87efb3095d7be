"""What the SGLang HiCache backend (``backend.py``) and the unified-cache linker (``linker.py``) share, so a
page either one stores is the page the other finds: the agent socket's default, the faults a storage call
answers as a miss, and the per-rank key suffix. Both name pages by SGLang's chained page hashes
(``mem_cache/utils.py`` ``get_storage_hash_str``: the HiCache tree's node hashes and the linker's tail
hashes are the same chain) plus this suffix."""

from __future__ import annotations

from typing import Any

from flatcake.errors import FlatCakeError
from flatcake.node_agent.service.hints import tenant_suffix

DEFAULT_SOCKET = "/run/flatcake/agent.sock"
# What a storage call may meet in normal operation, answered as a miss (or a failed set) so that SGLang
# recomputes: a full pool, a page reclaimed meanwhile, a failed write, an agent that went away. Anything
# else (a wrong shape, a bad argument) is a bug and propagates rather than hiding as a miss.
STORAGE_FAULTS = (FlatCakeError, ConnectionError, TimeoutError)


def key_suffix(*, mla: bool, tp_rank: int, tp_size: int, pp_rank: int = 0, pp_size: int = 1, cp_rank: int = 0,
               cp_size: int = 1, extra: dict[str, Any] | None = None) -> str:  # fmt: skip
    """What follows a page hash in its key: MHA shards heads across TP ranks, so each rank stores its own
    bytes under ``@tp{rank}of{size}``; MLA's latent cache is the same on every rank, so ranks share one key.
    Pipeline and context-parallel ranks hold different layers or tokens (``@pp``, ``@cp``); the tenant
    (``service/hints.py``) ends every key."""
    suffix = "" if mla else f"@tp{tp_rank}of{tp_size}"
    if pp_size > 1:
        suffix += f"@pp{pp_rank}of{pp_size}"
    if cp_size > 1:
        suffix += f"@cp{cp_rank}of{cp_size}"
    return suffix + tenant_suffix(extra or {})
