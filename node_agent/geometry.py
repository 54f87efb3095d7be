"""KV geometry from a model's ``config.json``: the ``layers``, ``page_bytes`` and ``page_tokens`` a
FlatCakeCache (``spec.kv``) and an agent's ``EngineConfig`` must give, worked out as SGLang's host pool
holds a page, instead of by hand.

What one page of one layer is, per tensor-parallel rank (SGLang 0.5.23, ``mem_cache/memory_pool_host.py``):
- **Dense attention (MHA/GQA: Llama, Qwen2, Mistral ...)**: K and V of ``page_tokens`` tokens, each
  ``kv_heads_per_rank x head_dim`` elements. A rank holds ``num_key_value_heads / tp`` heads; with more
  ranks than KV heads each rank holds one (replicated), as SGLang does.
- **MLA (DeepSeek-V2/V3)**: one latent row per token, ``kv_lora_rank + qk_rope_head_dim`` elements,
  the same on every rank (not sharded: one writer stores it for all).

Element size: the served KV cache's dtype (SGLang's ``--kv-cache-dtype``; ``auto`` is the model's
``torch_dtype``). ``page_bytes`` is the raw size rounded up to 4 KiB, as the SGLang backend registers
it (O_DIRECT alignment). Hybrid and sliding-window models (attention that is not full on every layer,
Mamba layers, DeepSeek-V4's compressed attention) keep other pools beside the KV pool; their geometry
is refused here with the fix (give ``kv`` by hand) rather than guessed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from flatcake.errors import ConfigError
from flatcake.node_agent.constants import ALIGN

# SGLang's --kv-cache-dtype choices, and what ``auto`` reads from the model's torch_dtype: element bytes.
KV_DTYPES = {"auto": 0, "bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "fp8_e5m2": 1}
TORCH_DTYPES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class Geometry:
    """One model's KV page as a FlatCake pool stores it (one rank's share)."""

    model_type: str
    attention: str  # "mha" (K and V per head) or "mla" (one latent row per token)
    layers: int
    page_tokens: int
    bytes_per_token_layer: int  # one rank's KV bytes for one token in one layer
    raw_page_bytes: int  # one page of one layer, as SGLang's host pool holds it
    page_bytes: int  # raw_page_bytes rounded up to the O_DIRECT alignment: kv.pageBytes
    replicated: bool  # every rank holds the same KV (MLA; or more ranks than KV heads)

    def kv(self) -> dict[str, int]:
        """The FlatCakeCache's ``spec.kv``."""
        return {"layers": self.layers, "pageBytes": self.page_bytes, "pageTokens": self.page_tokens}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv": self.kv()}


def from_config(config: Mapping[str, Any], *, tp: int = 1, page_tokens: int = 64, kv_dtype: str = "auto") -> Geometry:
    """The geometry of a model given its ``config.json`` (as a mapping), served with ``tp`` ranks,
    ``page_tokens``-token pages and SGLang's ``--kv-cache-dtype kv_dtype``."""
    if tp < 1:
        raise ConfigError(f"tp: {tp} must be >= 1 (the serving engine's --tp-size)")
    if page_tokens < 1:
        raise ConfigError(f"page_tokens: {page_tokens} must be >= 1 (the serving engine's --page-size)")
    c = dict(config.get("text_config") or config)  # multimodal configs nest the language model's
    model_type = str(c.get("model_type") or config.get("model_type") or "unknown")
    _refuse_hybrid(c, model_type)
    element = _element_bytes(c, kv_dtype)
    layers = _int(c, "num_hidden_layers")
    if c.get("kv_lora_rank"):
        row = _int(c, "kv_lora_rank") + _int(c, "qk_rope_head_dim")
        per_token, attention, replicated = row * element, "mla", True
    else:
        heads = _int(c, "num_attention_heads")
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or _int(c, "hidden_size") // heads)
        per_rank = _kv_heads_per_rank(kv_heads, tp)
        per_token, attention, replicated = 2 * per_rank * head_dim * element, "mha", tp > kv_heads
    raw = per_token * page_tokens
    return Geometry(model_type, attention, layers, page_tokens, per_token, raw, -(-raw // ALIGN) * ALIGN, replicated)


def load(path: str | Path, **kw: Any) -> Geometry:
    """``from_config`` of a ``config.json`` file, or of the one in a model directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file; give a model's config.json or its directory") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object (a model's config.json)")
    return from_config(data, **kw)


def _kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    if tp <= kv_heads:
        if kv_heads % tp:
            raise ConfigError(f"tp: {tp} ranks cannot share {kv_heads} KV heads evenly; use a divisor of {kv_heads}")
        return kv_heads // tp
    if tp % kv_heads:
        raise ConfigError(f"tp: {tp} ranks cannot replicate {kv_heads} KV heads evenly; use a multiple of {kv_heads}")
    return 1


def _element_bytes(c: Mapping[str, Any], kv_dtype: str) -> int:
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"kv_dtype: {kv_dtype!r} must be one of {', '.join(KV_DTYPES)} (SGLang's --kv-cache-dtype)")
    if kv_dtype != "auto":
        return KV_DTYPES[kv_dtype]
    dtype = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16")
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"torch_dtype: {dtype!r} is not a KV cache dtype; give kv_dtype ({', '.join(KV_DTYPES)})")
    return TORCH_DTYPES[dtype]


def _refuse_hybrid(c: Mapping[str, Any], model_type: str) -> None:
    sliding = bool(c.get("use_sliding_window")) or "sliding_attention" in (c.get("layer_types") or [])
    mixed = any(k in c for k in ("full_attention_interval", "layers_block_type", "hybrid_override_pattern"))
    compressed = model_type.startswith("deepseek_v4") or "compress_ratios" in c
    if sliding or mixed or compressed:
        kind = "sliding-window" if sliding else "compressed-attention" if compressed else "hybrid"
        raise ConfigError(
            f"{model_type}: a {kind} model keeps pools beside its KV pool, which this derivation does not "
            "cover yet; give spec.kv (layers, pageBytes, pageTokens) by hand from the serving engine's host pool"
        )


def _int(c: Mapping[str, Any], name: str) -> int:
    value = c.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}: {value!r} in config.json is not a positive integer (is this a model's config?)")
    return value
