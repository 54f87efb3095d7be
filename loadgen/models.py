"""Model presets: the KV geometry one GPU rank stores, per page-layer, for the models the benchmarks
use. Each preset says where its numbers come from (docs/benchmarks.md shows the arithmetic).

A page is ``page_tokens`` tokens of one layer; its bytes are padded up to 4 KiB so every page-layer
offset is O_DIRECT/GDS aligned, as the engine requires.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatcake.node_agent import ConfigError, round_up


@dataclass(frozen=True)
class ModelPreset:
    name: str
    layers: int
    page_tokens: int
    kv_bytes_per_token_layer: float  # per GPU rank
    mla: bool  # one latent per token (shared by all ranks) rather than heads sharded across ranks
    source: str

    @property
    def raw_page_layer_bytes(self) -> int:
        return round(self.kv_bytes_per_token_layer * self.page_tokens)

    @property
    def page_layer_bytes(self) -> int:
        return round_up(self.raw_page_layer_bytes)

    @property
    def page_bytes(self) -> int:
        """One page of all layers."""
        return self.layers * self.page_layer_bytes


PRESETS = {
    # Llama-3.1-70B: 80 layers, 8 KV heads x 128 dims, bf16: K and V are 2 x 8 x 128 x 2 B = 4 KiB per
    # token per layer; TP4 shards the KV heads, so 1 KiB per rank; 256-token pages: 256 KiB.
    "llama3-70b-tp4": ModelPreset(
        "llama3-70b-tp4", layers=80, page_tokens=256, kv_bytes_per_token_layer=1024.0, mla=False,
        source="Llama-3.1-70B config.json: num_hidden_layers 80, num_key_value_heads 8, head_dim 128; bf16; TP4",
    ),
    # DeepSeek-V4-Flash, FP8 KV: the paper's 7.5 KiB per token per rank over its 43 layers (the
    # compressed CSA/HCA KV and indexer rows a prefix cache stores, averaged over layers; the raw
    # 128-token sliding window is recomputed, not stored); 256-token pages: 44.7 KB per page-layer,
    # padded to 48 KiB.
    "dsv4-flash": ModelPreset(
        "dsv4-flash", layers=43, page_tokens=256, kv_bytes_per_token_layer=7.5 * 1024 / 43, mla=True,
        source="DeepSeek-V4-Flash config.json: num_hidden_layers 43; FlatCake paper: 7.5 KiB/token/rank, FP8",
    ),
}  # fmt: skip
DEFAULT = "dsv4-flash"


def preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ConfigError(f"model: {name!r} is not a preset; choose one of {', '.join(PRESETS)}")
    return PRESETS[name]


def custom(layers: int, page_layer_bytes: int, page_tokens: int) -> ModelPreset:
    """A geometry given by hand (``--layers --page-layer-bytes --page-tokens``); stored as a flat byte
    page per layer (SGLang's MLA layout), which fits any page-layer size."""
    for name, value in (("layers", layers), ("page_layer_bytes", page_layer_bytes), ("page_tokens", page_tokens)):
        if value <= 0:
            raise ConfigError(f"{name}: {value} must be positive")
    per_token = page_layer_bytes / page_tokens
    return ModelPreset("custom", layers, page_tokens, per_token, True, "given on the command line")
