"""KV geometry from a model's ``config.json``: the ``layers``, ``page_bytes`` and ``page_tokens`` a
FlatCakeCache (``spec.kv``) and an agent's ``EngineConfig`` must give, worked out as SGLang's host pool
holds a page, instead of by hand.

What one page of one layer is, per tensor-parallel rank (SGLang 0.5.23, ``mem_cache/memory_pool_host.py``):
- **Dense attention (MHA/GQA: Llama, Qwen2, Mistral ...)**: K and V of ``page_tokens`` tokens, each
  ``kv_heads_per_rank x head_dim`` elements. A rank holds ``num_key_value_heads / tp`` heads; with more
  ranks than KV heads each rank holds one (replicated), as SGLang does.
- **MLA (DeepSeek-V2/V3)**: one latent row per token, ``kv_lora_rank + qk_rope_head_dim`` elements,
  the same on every rank (not sharded: one writer stores it for all).

Replicated dense KV (more ranks than KV heads) is stored once per rank (``copies``): the SGLang backend
keys pages by rank, so ranks holding the same head write the same bytes under different keys. Storing
each head once would need the backend to know SGLang's head-to-rank map; until then the cache is sized
for ``copies`` times the bytes, and ``flatcake geometry`` says so.

Element size: the served KV cache's dtype (SGLang's ``--kv-cache-dtype``; ``auto`` is the model's
``torch_dtype``). ``page_bytes`` is the raw size rounded up to 4 KiB, as the SGLang backend registers
it (O_DIRECT alignment).

Hybrid models keep sidecar pools beside the KV pool (SGLang's v2 storage interface, ``PoolName``); the
KV pool, which the backend registers with the agent, covers the full-attention layers only, and each
sidecar page is stored as ``chunks`` pages of that geometry (``sglang/backend.py``):
- **Sliding-window hybrids** SGLang splits (``is_hybrid_swa_model``: GPT-OSS and configs saying
  ``is_hybrid_swa``): ``layer_types`` names each layer; the ``swa`` pool holds K and V of the sliding
  layers, hit policy TRAILING_PAGES over ``ceil(window / page_tokens)`` pages. Gemma-2/3 SGLang serves
  with hybrid SWA memory off (one KV pool over every layer), and a model without ``layer_types``
  (Mistral's ``sliding_window``, Qwen2's ``use_sliding_window``) likewise keeps every layer in the KV pool.
- **Linear-attention hybrids** (Qwen3-Next, Qwen3.5: ``full_attention_interval``): layer ``l`` is full
  attention when ``(l + 1) % interval == 0``; the ``mamba`` pool holds one request state per page (conv
  state in bf16, recurrent state in fp32 unless ``mamba_ssm_dtype`` says otherwise) for each linear
  layer, hit policy TRAILING_PAGES over the last page (``configs/mamba_utils.py``, ``pool_host/mamba.py``).
Other layouts are refused with the fix (give ``kv`` by hand) rather than guessed: DeepSeek-V3.2 (its DSA
indexer keys are a second pool), DeepSeek-V4 (SGLang
0.5.23's KV pool for it is logical, holding no bytes; its bytes are in SWA and compressed sidecars),
Nemotron-H and Falcon-H1 patterns, and sliding-window layer types of architectures not named above.
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


# Architectures SGLang 0.5.23 serves with a separate SWA pool split by ``layer_types`` (model_config.py
# is_hybrid_swa_model), and those whose sliding layers it keeps in the one KV pool (gemma2_gemma3.py).
HYBRID_SWA_TYPES = frozenset({"gpt_oss"})
SWA_IN_KV_TYPES = frozenset({"gemma2", "gemma3", "gemma3_text"})
LINEAR_HYBRID_TYPES = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})
STATE_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Sidecar:
    """A pool beside the KV pool, as SGLang's v2 storage interface hands its pages to the backend."""

    name: str  # SGLang's PoolName: "swa", "mamba"
    layers: int  # layers whose state the pool holds
    page_tokens: int  # tokens one of its pages covers (a Mamba page is one request's state: 0)
    page_bytes: int  # one page of the pool, all its layers
    hit_policy: str  # "trailing_pages": a hit needs the last ``trailing_pages`` pages before its end
    trailing_pages: int
    chunks: int  # pages of the cache's geometry (layers x pageBytes) one of its pages is stored as


@dataclass(frozen=True)
class Geometry:
    """One model's KV page as a FlatCake pool stores it (one rank's share)."""

    model_type: str
    attention: str  # "mha", "gqa" (fewer KV heads than query heads), "mqa" (one KV head) or "mla" (a latent row)
    layers: int
    page_tokens: int
    bytes_per_token_layer: int  # one rank's KV bytes for one token in one layer
    raw_page_bytes: int  # one page of one layer, as SGLang's host pool holds it
    page_bytes: int  # raw_page_bytes rounded up to the O_DIRECT alignment: kv.pageBytes
    replicated: bool  # every rank holds the same KV (MLA; or more ranks than KV heads)
    total_layers: int = 0  # the model's layers (``layers`` are those in the KV pool, sidecars hold the rest)
    sidecars: tuple[Sidecar, ...] = ()
    # Ranks that store the same bytes: SGLang's backend suffixes every key with its rank unless the KV is
    # MLA (one writer stores it for all), so with more ranks than KV heads each head's pages are stored
    # once per rank holding it. The cache pays that many times the bytes; size the pool for it.
    copies: int = 1

    def stored_bytes_per_page(self) -> dict[str, int]:
        """Bytes one page of each pool takes in the cache (sidecars padded to whole chunks)."""
        span = self.layers * self.page_bytes
        return {"kv": span, **{s.name: s.chunks * span for s in self.sidecars}}

    def kv(self) -> dict[str, int]:
        """The FlatCakeCache's ``spec.kv``."""
        return {"layers": self.layers, "pageBytes": self.page_bytes, "pageTokens": self.page_tokens}

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv": self.kv(), "stored_bytes_per_page": self.stored_bytes_per_page()}


def from_config(config: Mapping[str, Any], *, tp: int = 1, page_tokens: int = 64, kv_dtype: str = "auto") -> Geometry:
    """The geometry of a model given its ``config.json`` (as a mapping), served with ``tp`` ranks,
    ``page_tokens``-token pages and SGLang's ``--kv-cache-dtype kv_dtype``."""
    if tp < 1:
        raise ConfigError(f"tp: {tp} must be >= 1 (the serving engine's --tp-size)")
    if page_tokens < 1:
        raise ConfigError(f"page_tokens: {page_tokens} must be >= 1 (the serving engine's --page-size)")
    c = dict(config.get("text_config") or config)  # multimodal configs nest the language model's
    model_type = str(c.get("model_type") or config.get("model_type") or "unknown")
    _refuse_unknown_layouts(c, model_type)
    element = _element_bytes(c, kv_dtype)
    total = _int(c, "num_hidden_layers")
    kinds = _layer_kinds(c, model_type, total)
    layers = kinds.count("full")
    if c.get("kv_lora_rank"):
        row = _int(c, "kv_lora_rank") + _int(c, "qk_rope_head_dim")
        per_token, attention, replicated = row * element, "mla", True
        copies = 1
    else:
        kv_heads = _kv_heads(c)
        per_token, replicated = _mha_bytes_per_token(c, tp, element), tp > kv_heads
        heads = c.get("num_attention_heads")
        attention = "mqa" if kv_heads == 1 else ("gqa" if isinstance(heads, int) and kv_heads < heads else "mha")
        copies = tp // kv_heads if replicated else 1
    raw = per_token * page_tokens
    page_bytes = _aligned(raw)
    span = layers * page_bytes
    sidecars: list[Sidecar] = []
    if "sliding" in kinds:
        swa = kinds.count("sliding")
        window = _int(c, "sliding_window")
        flat = swa * per_token * page_tokens
        sidecars.append(Sidecar("swa", swa, page_tokens, flat, "trailing_pages", -(-window // page_tokens),
                                -(-flat // span)))  # fmt: skip
    if "linear" in kinds:
        linear = kinds.count("linear")
        flat = linear * _linear_state_bytes(c, tp)
        sidecars.append(Sidecar("mamba", linear, 0, flat, "trailing_pages", 1, -(-flat // span)))
    return Geometry(model_type, attention, layers, page_tokens, per_token, raw, page_bytes, replicated, total,
                    tuple(sidecars), copies)  # fmt: skip


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _kv_heads(c: Mapping[str, Any]) -> int:
    return int(c.get("num_key_value_heads") or _int(c, "num_attention_heads"))


def _mha_bytes_per_token(c: Mapping[str, Any], tp: int, element: int) -> int:
    """K and V of one rank's KV heads for one token of one layer."""
    heads = _int(c, "num_attention_heads")
    head_dim = int(c.get("head_dim") or _int(c, "hidden_size") // heads)
    return 2 * _kv_heads_per_rank(_kv_heads(c), tp) * head_dim * element


def _layer_kinds(c: Mapping[str, Any], model_type: str, total: int) -> list[str]:
    """Each layer's cache as SGLang 0.5.23 pools it: "full" (the KV pool), "sliding" (the SWA pool),
    "linear" (the Mamba pool)."""
    if model_type in LINEAR_HYBRID_TYPES or "full_attention_interval" in c:
        interval = _int(c, "full_attention_interval")
        return ["full" if (i + 1) % interval == 0 else "linear" for i in range(total)]
    types = c.get("layer_types")
    hybrid_swa = model_type in HYBRID_SWA_TYPES or c.get("is_hybrid_swa") is True
    if not types or not hybrid_swa:
        return ["full"] * total  # every layer in the one KV pool (sliding or not)
    if not isinstance(types, list) or len(types) != total:
        raise ConfigError(f"layer_types: {len(types) if isinstance(types, list) else types!r} entries for "
                          f"num_hidden_layers {total}; expected one per layer")  # fmt: skip
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ConfigError(f"layer_types: {unknown} are not full_attention or sliding_attention; give spec.kv by hand")
    return ["sliding" if t == "sliding_attention" else "full" for t in types]


def _linear_state_bytes(c: Mapping[str, Any], tp: int) -> int:
    """One linear-attention layer's request state on one rank (SGLang ``Mamba2StateShape`` for Qwen3-Next):
    conv state ``(conv_dim / tp, kernel - 1)`` and recurrent state ``(heads / tp, head_dim, state)``."""
    key_heads, value_heads = _int(c, "linear_num_key_heads"), _int(c, "linear_num_value_heads")
    key_dim, value_dim, kernel = (
        _int(c, "linear_key_head_dim"),
        _int(c, "linear_value_head_dim"),
        _int(c, "linear_conv_kernel_dim"),
    )
    groups = key_heads if key_heads % tp == 0 else tp  # SGLang widens the groups to the ranks when uneven
    if value_heads % tp:
        raise ConfigError(f"tp: {tp} ranks cannot share linear_num_value_heads {value_heads} evenly; use a divisor")
    conv_dim = value_dim * value_heads + 2 * groups * key_dim
    ssm = str(c.get("mamba_ssm_dtype") or "float32")
    if ssm not in STATE_DTYPES:
        raise ConfigError(f"mamba_ssm_dtype: {ssm!r} must be one of {', '.join(STATE_DTYPES)}")
    conv = conv_dim // tp * (kernel - 1) * 2  # bf16 (SGLANG_MAMBA_CONV_DTYPE's default)
    recurrent = value_heads // tp * value_dim * key_dim * STATE_DTYPES[ssm]
    return conv + recurrent


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


def _refuse_unknown_layouts(c: Mapping[str, Any], model_type: str) -> None:
    """Layouts whose pools this derivation does not know, refused by name with the fix."""
    why = ""
    if model_type == "deepseek_v32" or "index_topk" in c:
        why = ("DeepSeek Sparse Attention: beside the MLA latent, SGLang keeps the indexer's keys "
               f"({c.get('index_head_dim', '?')} dims per token and layer) in a second pool this derivation does "
               "not size")  # fmt: skip
    elif model_type.startswith("deepseek_v4") or "compress_ratios" in c:
        why = ("a compressed-attention model: SGLang 0.5.23 keeps its bytes in SWA and compressed sidecar pools "
               "(deepseek_v4_c4, c128, indexer, states) behind a KV pool that holds none")  # fmt: skip
    elif any(k in c for k in ("layers_block_type", "hybrid_override_pattern", "mamba_d_ssm")):
        why = "a Mamba hybrid whose layer pattern this derivation does not read (Nemotron-H, Falcon-H1)"
    elif (
        "sliding_attention" in (c.get("layer_types") or [])
        and model_type not in HYBRID_SWA_TYPES | SWA_IN_KV_TYPES
        and c.get("is_hybrid_swa") is None
    ):  # fmt: skip
        why = "a sliding-window model: SGLang splits pools per architecture, and which it does for this one is unknown"
    if why:
        raise ConfigError(f"{model_type}: {why}; give spec.kv (layers, pageBytes, pageTokens) by hand from the "
                          "serving engine's host pool")  # fmt: skip


def _int(c: Mapping[str, Any], name: str) -> int:
    value = c.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name}: {value!r} in config.json is not a positive integer (is this a model's config?)")
    return value
