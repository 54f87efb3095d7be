"""Model presets: the KV geometry one GPU rank stores, per page-layer, and what a prefill and a decode
step cost on a named GPU, for the models the benchmarks use. Each number says where it comes from
(docs/benchmarks.md shows the arithmetic).

A page is ``page_tokens`` tokens of one layer; its bytes are padded up to 4 KiB so every page-layer
offset is O_DIRECT/GDS aligned, as the engine requires.

Compute is modelled, storage is not: prefill time is FLOPs / (peak x MFU), with the FLOPs of the
active weights (2 per parameter per token) plus attention over the cached and new tokens; decode is
one read of the active weights per token (batch 1) at a share of HBM bandwidth. The MFUs are stated
assumptions, not measurements (docs/benchmarks.md cites what they rest on).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatcake.node_agent import ConfigError
from flatcake.node_agent.constants import ALIGN


@dataclass(frozen=True)
class Gpu:
    """One GPU's datasheet numbers (dense, no sparsity)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float  # = bf16 where the GPU has no FP8 tensor cores
    hbm_gb: float
    hbm_tb_s: float
    source: str


GPUS = {
    "h200": Gpu("h200", bf16_tflops=989.0, fp8_tflops=1979.0, hbm_gb=141.0, hbm_tb_s=4.8,
                source="NVIDIA H200 SXM datasheet: 989 TFLOPS BF16, 1,979 FP8 (dense), 141 GB HBM3e at 4.8 TB/s"),
    "a100": Gpu("a100", bf16_tflops=312.0, fp8_tflops=312.0, hbm_gb=80.0, hbm_tb_s=2.039,
                source="NVIDIA A100 SXM 80GB datasheet: 312 TFLOPS BF16 (dense), no FP8; 80 GB HBM2e at 2,039 GB/s"),
}  # fmt: skip

# SGLang's --mem-fraction-static is of this order on 80-141 GB GPUs: weights and KV pool take this
# share of HBM, activations and CUDA graphs the rest.
MEM_FRACTION_STATIC = 0.88
DECODE_BANDWIDTH_SHARE = 0.8  # batch-1 decode reaches about this share of HBM bandwidth


@dataclass(frozen=True)
class Compute:
    """What one rank computes: its share of the active weights and of each layer's attention."""

    active_params: float  # whole model, per token
    ranks: int  # the tensor/expert-parallel group that shares the work and the KV
    weight_bytes_per_param: float  # 2 (bf16) or 1 (fp8)
    total_params: float  # what sits in HBM
    attn_dim: int  # query heads x head dim, whole model, per layer
    fp8: bool
    mfu: float
    attended: int | None = None  # sparse attention: at most this many context tokens per query
    source: str = ""


@dataclass(frozen=True)
class ModelPreset:
    name: str
    layers: int
    page_tokens: int
    kv_bytes_per_token_layer: float  # per GPU rank
    mla: bool  # one latent per token (shared by all ranks) rather than heads sharded across ranks
    source: str
    compute: Compute | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """All layers, one rank, as stored (page-layers padded to 4 KiB)."""
        return self.layers * self.page_layer_bytes // self.page_tokens

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0, gpu: str = "h200") -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` of reused prefix, on one rank of
        the group (all ranks work in parallel)."""
        c = self._compute()
        g = gpu_profile(gpu)
        linear = 2.0 * c.active_params / c.ranks * new_tokens
        # Each new token attends to the cached prefix and the new tokens before it (causal): QK^T and
        # PV, 2 FLOPs per multiply-add each.
        mean_context = cached_tokens + (new_tokens + 1) / 2
        if c.attended is not None:
            mean_context = min(mean_context, c.attended)
        attention = 4.0 * self.layers * c.attn_dim / c.ranks * new_tokens * mean_context
        peak = (g.fp8_tflops if c.fp8 else g.bf16_tflops) * 1e12
        return (linear + attention) / (peak * c.mfu)

    def decode_s_per_token(self, gpu: str = "h200") -> float:
        c = self._compute()
        g = gpu_profile(gpu)
        return c.active_params / c.ranks * c.weight_bytes_per_param / (g.hbm_tb_s * 1e12 * DECODE_BANDWIDTH_SHARE)

    def hbm_kv_bytes(self, gpu: str = "h200") -> int:
        """The KV pool one rank has: its static share of HBM less its share of the weights."""
        c = self._compute()
        g = gpu_profile(gpu)
        weights = c.total_params / c.ranks * c.weight_bytes_per_param
        return max(0, int(g.hbm_gb * 1e9 * MEM_FRACTION_STATIC - weights))

    def _compute(self) -> Compute:
        if self.compute is None:
            raise ConfigError(f"model: {self.name!r} has no compute profile; use a preset ({', '.join(PRESETS)})")
        return self.compute

    def calibration(self, gpu: str = "h200") -> dict[str, object]:
        """The numbers a benchmark ran with, and their sources, for its report."""
        c = self._compute()
        g = gpu_profile(gpu)
        return {
            "model": self.name, "gpu": g.name, "layers": self.layers, "page_tokens": self.page_tokens,
            "kv_bytes_per_token_per_rank": self.kv_bytes_per_token, "ranks": c.ranks,
            "prefill_tokens_per_s_8k": round(8192 / self.prefill_s(8192, 0, gpu)),
            "prefill_s_8k_new_after_120k_cached": round(self.prefill_s(8192, 120_000, gpu), 4),
            "decode_ms_per_token": round(1000 * self.decode_s_per_token(gpu), 3),
            "hbm_kv_bytes_per_rank": self.hbm_kv_bytes(gpu), "mfu": c.mfu,
            "sources": [self.source, c.source, g.source],
        }  # fmt: skip

    @property
    def raw_page_layer_bytes(self) -> int:
        return round(self.kv_bytes_per_token_layer * self.page_tokens)

    @property
    def page_layer_bytes(self) -> int:
        return -(-self.raw_page_layer_bytes // ALIGN) * ALIGN  # O_DIRECT-aligned, as the engine stores it

    @property
    def span_bytes(self) -> int:
        """One page of all layers (``page_bytes`` everywhere else means one layer's: ``page_layer_bytes``)."""
        return self.layers * self.page_layer_bytes


PRESETS = {
    # Llama-3.1-70B: 80 layers, 8 KV heads x 128 dims, bf16: K and V are 2 x 8 x 128 x 2 B = 4 KiB per
    # token per layer; TP4 shards the KV heads, so 1 KiB per rank; 256-token pages: 256 KiB.
    "llama3-70b-tp4": ModelPreset(
        "llama3-70b-tp4", layers=80, page_tokens=256, kv_bytes_per_token_layer=1024.0, mla=False,
        source="Llama-3.1-70B config.json: num_hidden_layers 80, num_key_value_heads 8, head_dim 128; bf16; TP4",
        compute=Compute(active_params=70.6e9, total_params=70.6e9, ranks=4, weight_bytes_per_param=2, attn_dim=64 * 128,
                        fp8=False, mfu=0.5,
                        source="Llama-3.1-70B: 70.6B parameters, 64 query heads x 128; bf16, 4 ranks; MFU 0.5 assumed "
                               "(long dense prefills are compute-bound; see docs/benchmarks.md)"),
    ),
    # DeepSeek-V4-Flash, FP8 KV: the paper's 7.5 KiB per token per rank over its 43 layers (the
    # compressed CSA/HCA KV and indexer rows a prefix cache stores, averaged over layers; the raw
    # 128-token sliding window is recomputed, not stored); 256-token pages: 44.7 KB per page-layer,
    # padded to 48 KiB.
    "dsv4-flash": ModelPreset(
        "dsv4-flash", layers=43, page_tokens=256, kv_bytes_per_token_layer=7.5 * 1024 / 43, mla=True,
        source="DeepSeek-V4-Flash config.json: num_hidden_layers 43; FlatCake paper: 7.5 KiB/token/rank, FP8",
        # 284B parameters, 13B active per token (MoE, 6 of 256 experts + 1 shared), FP8 on the paper's 8
        # ranks; 64 query heads x 512 dims; its sparse attention reads at most ~2K selected tokens per
        # query (plus a heavily compressed rest), modelled as a cap of 2,048 attended tokens.
        compute=Compute(active_params=13e9, total_params=284e9, ranks=8, weight_bytes_per_param=1, attn_dim=64 * 512,
                        fp8=True, mfu=0.3, attended=2048,
                        source="DeepSeek-V4-Flash model card: 284B total / 13B activated, 43 layers, 64 heads x 512, "
                               "FP8; 8 ranks as in the paper; MFU 0.3 assumed for MoE (expert imbalance, all-to-all)"),
    ),
}  # fmt: skip
DEFAULT = "dsv4-flash"


def gpu_profile(name: str) -> Gpu:
    if name not in GPUS:
        raise ConfigError(f"gpu: {name!r} is not known; choose one of {', '.join(GPUS)}")
    return GPUS[name]


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
