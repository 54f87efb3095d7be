"""The emulator's configuration: what it stores (``mode``), the model it stands in for, its HBM, DRAM
and SSD, and how it schedules; checked when made."""

from __future__ import annotations

from dataclasses import dataclass

from flatcake.errors import ConfigError
from flatcake.loadgen.models import ModelPreset, gpu_profile, preset
from flatcake.loadgen.names import L3_BACKENDS
from flatcake.loadgen.systems import hicache_rules as hicache
from flatcake.node_agent.constants import PLACEMENT_MODES, SCHEDULER_POLICIES

# flatcake: SGLang HiCache's rules over FlatCake's backend as L3 (FlatCake as it ships); flatcake-native: the
# paper's engine-integrated FlatCake (FC-MAS, restores streamed at dispatch), a what-if until an engine ships it;
# tiered: SGLang HiCache's rules over the L3 named by ``l3``; dram: its host tier alone; none: nothing stored.
MODES = ("flatcake", "flatcake-native", "tiered", "dram", "none")
MiB = 1 << 20
# tiered: the idealized SSD log, SGLang's HiCacheFile, or Mooncake Store (SGLang's Mooncake backend)
# The modes SGLang schedules (its prefetch, stop and no-late-read rules); the native what-if is the other one.
SGLANG_MODES = ("flatcake", "tiered", "dram", "none")


@dataclass(frozen=True)
class EmulatorConfig:
    mode: str = "flatcake"
    data_dir: str = ".flatcake-emulator"
    agent_socket: str | None = None  # flatcake mode: use this node agent instead of an in-process engine
    # A model preset sets the KV geometry (layers, page bytes) and the GPU's costs; without one the
    # geometry and rates below are used as given.
    model: str | None = None
    gpu: str = "h200"
    page_tokens: int = 256
    layers: int = 4
    bytes_per_token_layer: int = 64  # a 256-token page is 16 KiB per layer
    hbm_bytes: int = 16 * MiB
    dram_bytes: int = 64 * MiB  # FlatCake's DRAM pool, or the tiered host tier (SGLang's host pool)
    ssd_bytes: int = 2048 * MiB  # FlatCake's file pool, or the tiered L3 log
    scope_file_bytes: int = 8 * MiB  # FlatCake: one session scope's file
    prefill_tokens_per_s: float = 100_000.0  # without a model preset
    decode_tokens_per_s: float = 200.0  # without a model preset
    # flatcake-native only (the SGLang modes are FCFS as SGLang schedules): mas (None: the default) or fcfs
    scheduler: str | None = None
    prefetch_policy: str = hicache.DEFAULT_PREFETCH_POLICY  # SGLang's prefetch stop policy
    prefetchers: int = 2  # flatcake-native: concurrent SSD prefetches
    placement: str = "table2"  # flatcake, flatcake-native: placement.mode of its engine (PLACEMENT_MODES)
    l3: str = "log"  # tiered: the storage below the host tier (L3_BACKENDS)
    # hicache-file: evict each page file from the OS page cache once written (fdatasync, then
    # POSIX_FADV_DONTNEED), so its reads hit the device as every other system's do (O_DIRECT); False
    # leaves the page cache as the OS keeps it (memory beyond the DRAM budget serving reads).
    drop_page_cache: bool = True
    # flatcake: the share of the DRAM budget that is FlatCake's pool; the rest is SGLang's host pool. 0: all
    # of it SGLang's, FlatCake on SSD alone (Table 2's DRAM placements overflow to SSD).
    storage_dram_share: float = 0.5

    @property
    def page_bytes(self) -> int:
        return self.page_tokens * self.bytes_per_token_layer

    @property
    def page_span(self) -> int:
        return self.layers * self.page_bytes

    @property
    def rules(self) -> str:
        """Whose rules the request path follows: ``sglang`` (HiCache's, every shipped system) or ``native``."""
        return "sglang" if self.mode in SGLANG_MODES else "native"

    @property
    def storage(self) -> str | None:
        """The L3 under SGLang's host tier: ``flatcake`` (FlatCake's backend), ``l3`` for tiered, else None."""
        if self.mode == "flatcake":
            return "flatcake"
        return self.l3 if self.mode == "tiered" else None

    @property
    def l3_dram_bytes(self) -> int:
        """DRAM the L3 holds of ``dram_bytes``: half for an L3 that is DRAM plus SSD (FlatCake's DRAM pool,
        Mooncake's segment; SGLang's host pool, the other half, must stay larger than the GPU's pool), none
        for the others. flatcake-native has no host tier: its pool is the whole budget."""
        if self.storage == "flatcake":
            return int(self.dram_bytes * self.storage_dram_share) // self.page_span * self.page_span
        if self.storage == "hicache-mooncake":
            return self.dram_bytes // 2
        return self.dram_bytes if self.mode == "flatcake-native" else 0

    @property
    def host_tier_bytes(self) -> int:
        """SGLang's host pool: the DRAM budget less the L3's (none for flatcake-native)."""
        return self.dram_bytes - self.l3_dram_bytes

    @property
    def page_cache(self) -> str:
        """How this mode's storage reads meet the OS page cache (the report's calibration says it)."""
        if self.storage == "hicache-file":
            return (
                "dropped after each page file is written: reads hit the device"
                if self.drop_page_cache
                else ("kept: reads may be served from memory beyond the DRAM budget")
            )
        if self.storage == "hicache-mooncake":
            return "Mooncake's offload reads O_DIRECT through io_uring (MOONCAKE_OFFLOAD_USE_URING=1); writes buffered"
        if self.storage is None and self.mode != "flatcake-native":
            return "no storage reads"
        return "bypassed: O_DIRECT reads"

    @property
    def preset(self) -> ModelPreset | None:
        return preset(self.model) if self.model else None

    def prefill_seconds(self, new_tokens: int, cached_tokens: int) -> float:
        p = self.preset
        if p is not None:
            return p.prefill_s(new_tokens, cached_tokens, self.gpu) if new_tokens else 0.0
        return new_tokens / self.prefill_tokens_per_s

    def decode_seconds_per_token(self) -> float:
        p = self.preset
        return p.decode_s_per_token(self.gpu) if p is not None else 1.0 / self.decode_tokens_per_s

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode: {self.mode!r} must be one of {MODES}")
        if self.l3 not in L3_BACKENDS:
            raise ConfigError(f"l3: {self.l3!r} must be one of {', '.join(L3_BACKENDS)}")
        # Checked before anything is created (``serve`` binds, then makes the pools).
        for name in ("hbm_bytes", "ssd_bytes", "scope_file_bytes", "layers", "page_tokens", "bytes_per_token_layer",
                     "prefetchers"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name}: {value!r} must be a positive integer")
        if not isinstance(self.dram_bytes, int) or self.dram_bytes < 0:
            raise ConfigError(f"dram_bytes: {self.dram_bytes!r} must be an integer >= 0")
        for name in ("prefill_tokens_per_s", "decode_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: {getattr(self, name)!r} must be > 0")
        p = self.preset  # an unknown model or GPU is refused here, naming the field
        gpu_profile(self.gpu)
        if p is not None:  # the preset's geometry, padded page-layers as the engine stores them
            object.__setattr__(self, "layers", p.layers)
            object.__setattr__(self, "page_tokens", p.page_tokens)
            object.__setattr__(self, "bytes_per_token_layer", p.page_layer_bytes // p.page_tokens)
        if self.page_bytes % 4096:  # pages are read with O_DIRECT
            raise ConfigError(f"page_tokens x bytes_per_token_layer ({self.page_tokens} x {self.bytes_per_token_layer}"
                              ") must be a multiple of 4096: with 64 bytes per token-layer, use a multiple of 64 "
                              "page tokens")  # fmt: skip
        if self.placement not in PLACEMENT_MODES:
            raise ConfigError(f"placement: {self.placement!r} must be one of {', '.join(PLACEMENT_MODES)}")
        if self.scheduler is not None and self.scheduler not in SCHEDULER_POLICIES:
            raise ValueError(f"scheduler: {self.scheduler!r} must be one of {', '.join(SCHEDULER_POLICIES)}")
        hicache.check_policy(self.prefetch_policy)
        if not 0 <= self.storage_dram_share < 1:
            raise ConfigError(f"storage_dram_share: {self.storage_dram_share!r} must be at least 0 and below 1 (the "
                              "rest of the DRAM budget is SGLang's host pool, which cannot be empty)")  # fmt: skip
