"""KV geometry from published config.json files (tests/node_agent/model_configs): what a FlatCakeCache's
``kv`` must say for each model, tensor-parallel degree, page size and KV dtype. The SGLang system test
ties the formula to a real server: its agent is sized by it, and SGLang's registration would refuse
a page of another size (tests/node_agent/sglang/test_real_server.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flatcake.cli import main
from flatcake.errors import ConfigError
from flatcake.node_agent import geometry

pytestmark = pytest.mark.unit

CONFIGS = Path(__file__).parent / "model_configs"


def load(name: str, **kw: object) -> geometry.Geometry:
    return geometry.load(CONFIGS / f"{name}.json", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "tp", "page_tokens", "kv_dtype", "layers", "per_token", "page_bytes", "replicated"),
    [
        # Dense GQA: K and V of the rank's KV heads x head_dim (hidden / heads), bf16.
        ("llama-3.1-8b-instruct", 1, 64, "auto", 32, 2 * 8 * 128 * 2, 262144, False),
        ("llama-3.1-8b-instruct", 8, 64, "auto", 32, 2 * 1 * 128 * 2, 32768, False),
        ("llama-3.1-8b-instruct", 16, 64, "auto", 32, 2 * 1 * 128 * 2, 32768, True),  # more ranks than KV heads
        ("llama-3.1-70b-instruct", 4, 64, "auto", 80, 1024, 65536, False),  # the llama3-70b-tp4 preset's 1 KiB
        ("llama-3.1-70b-instruct", 4, 256, "auto", 80, 1024, 262144, False),
        ("llama-3.1-70b-instruct", 4, 64, "fp8_e4m3", 80, 512, 32768, False),
        ("qwen2.5-7b-instruct", 1, 64, "auto", 28, 2 * 4 * 128 * 2, 131072, False),  # hidden 3584 / 28 heads
        ("qwen2.5-7b-instruct", 2, 1, "auto", 28, 2 * 2 * 128 * 2, 4096, False),  # 1024 B, padded to 4 KiB
        # MLA: one latent row of kv_lora_rank + qk_rope_head_dim per token, on every rank alike.
        ("deepseek-v3", 8, 64, "auto", 61, (512 + 64) * 2, 73728, True),
        ("deepseek-v3", 1, 64, "fp8_e4m3", 61, 512 + 64, 36864, True),
    ],
)
def test_published_models(name: str, tp: int, page_tokens: int, kv_dtype: str, layers: int, per_token: int,
                          page_bytes: int, replicated: bool) -> None:  # fmt: skip
    g = load(name, tp=tp, page_tokens=page_tokens, kv_dtype=kv_dtype)
    assert (g.layers, g.bytes_per_token_layer, g.page_bytes, g.replicated) == (
        layers,
        per_token,
        page_bytes,
        replicated,
    )
    assert g.raw_page_bytes == per_token * page_tokens and g.page_bytes % 4096 == 0
    assert g.kv() == {"layers": layers, "pageBytes": page_bytes, "pageTokens": page_tokens}
    # Llama 3.1 and Qwen2.5 share each KV head among several query heads: GQA, and named so.
    assert g.attention == ("mla" if name.startswith("deepseek") else "gqa")
    assert g.total_layers == layers  # dense: every layer is in the KV pool (it said 0)
    assert g.copies == (16 // 8 if replicated and not name.startswith("deepseek") else 1)


def test_attention_kinds_and_replicated_dense_kv_are_named_with_their_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    llama = json.loads((CONFIGS / "llama-3.1-8b-instruct.json").read_text())
    assert geometry.from_config({**llama, "num_key_value_heads": 32}).attention == "mha"
    assert geometry.from_config({**llama, "num_key_value_heads": 1}).attention == "mqa"
    assert main(["geometry", str(CONFIGS / "llama-3.1-8b-instruct.json"), "--tp", "16"]) == 0
    assert "size the cache for 2x the bytes" in capsys.readouterr().out  # 16 ranks over 8 KV heads
    assert main(["geometry", str(CONFIGS / "llama-3.1-8b-instruct.json"), "--tp", "8"]) == 0
    assert "size the cache" not in capsys.readouterr().out


def test_sliding_window_hybrid_keeps_its_full_layers_in_the_kv_pool_and_the_rest_in_swa() -> None:
    """GPT-OSS: 12 full and 12 sliding layers of 8 KV heads x 64 (bf16), a 128-token window. SGLang's KV pool
    (what the backend registers) holds the full layers; the swa pool a page of every sliding layer."""
    g = load("gpt-oss-20b", page_tokens=64)
    assert (g.layers, g.total_layers, g.bytes_per_token_layer, g.page_bytes) == (12, 24, 2 * 8 * 64 * 2, 131072)
    (swa,) = g.sidecars
    assert (swa.name, swa.layers, swa.page_bytes) == ("swa", 12, 64 * 2 * 8 * 64 * 12 * 2)  # (2, page, L, heads, dim)
    assert (swa.hit_policy, swa.trailing_pages, swa.chunks) == ("trailing_pages", 2, 1)  # ceil(128 / 64) pages
    assert load("gpt-oss-20b", page_tokens=16).sidecars[0].trailing_pages == 8
    assert g.stored_bytes_per_page() == {"kv": 12 * 131072, "swa": 12 * 131072}


def test_linear_attention_hybrid_stores_one_request_state_per_page_beside_its_kv() -> None:
    """Qwen3-Next: every 4th of 48 layers is full attention (2 KV heads x 256); the 36 linear layers keep a
    request state each: conv (conv_dim / tp, kernel - 1) in bf16, recurrent (heads / tp, 128, 128) in fp32."""
    g = load("qwen3-next-80b-a3b-instruct", page_tokens=64)
    assert (g.layers, g.total_layers, g.page_bytes, g.replicated) == (12, 48, 2 * 2 * 256 * 2 * 64, False)
    (mamba,) = g.sidecars
    conv_dim = 128 * 32 + 2 * 16 * 128
    state = conv_dim * 3 * 2 + 32 * 128 * 128 * 4
    assert (mamba.name, mamba.layers, mamba.page_bytes, mamba.page_tokens) == ("mamba", 36, 36 * state, 0)
    assert (mamba.hit_policy, mamba.trailing_pages) == ("trailing_pages", 1)
    assert mamba.chunks == -(-36 * state // (12 * g.page_bytes))  # 50 cache pages per state
    tp4 = load("qwen3-next-80b-a3b-instruct", tp=4, page_tokens=64)
    assert tp4.replicated and tp4.page_bytes == 65536  # 4 ranks over 2 KV heads: one head each
    assert tp4.sidecars[0].page_bytes == 36 * (conv_dim // 4 * 3 * 2 + 8 * 128 * 128 * 4)
    with pytest.raises(ConfigError, match="mamba_ssm_dtype: 'int8' must be one of"):
        geometry.from_config({**json.loads((CONFIGS / "qwen3-next-80b-a3b-instruct.json").read_text()),
                              "mamba_ssm_dtype": "int8"})  # fmt: skip


def test_what_cannot_be_derived_is_refused_naming_the_fix(tmp_path: Path) -> None:
    qwen = json.loads((CONFIGS / "qwen2.5-7b-instruct.json").read_text())
    with pytest.raises(ConfigError, match="tp: 3 ranks cannot share 4 KV heads evenly"):
        geometry.from_config(qwen, tp=3)
    # Qwen2's sliding window is not a pool of its own in SGLang: every layer stays in the KV pool.
    assert geometry.from_config({**qwen, "use_sliding_window": True}).layers == 28
    with pytest.raises(ConfigError, match="deepseek_v4: a compressed-attention model.*give spec.kv"):
        load("deepseek-v4-flash")
    v3 = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    v32 = {**v3, "model_type": "deepseek_v32", "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64}
    with pytest.raises(
        ConfigError, match=r"deepseek_v32: DeepSeek Sparse Attention.*indexer's keys \(128 dims.*spec.kv"
    ):
        geometry.from_config(v32)
    with pytest.raises(ConfigError, match="sliding-window model: SGLang splits pools per architecture"):
        geometry.from_config({**qwen, "layer_types": ["sliding_attention", "full_attention"] * 14})
    with pytest.raises(ConfigError, match="Mamba hybrid whose layer pattern"):
        geometry.from_config({**qwen, "hybrid_override_pattern": "M*M*"})
    with pytest.raises(ConfigError, match="kv_dtype: 'int3' must be one of"):
        geometry.from_config(qwen, kv_dtype="int3")
    with pytest.raises(ConfigError, match="num_hidden_layers: None in config.json is not a positive integer"):
        geometry.from_config({"model_type": "llama", "num_attention_heads": 8})
    with pytest.raises(ConfigError, match="no such file"):
        geometry.load(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        geometry.load(tmp_path)  # a model directory: its config.json


def test_multimodal_configs_use_the_language_models_text_config() -> None:
    llama = json.loads((CONFIGS / "llama-3.1-8b-instruct.json").read_text())
    nested = {"model_type": "llava", "text_config": llama}
    assert geometry.from_config(nested) == geometry.from_config(llama)


def test_the_command_prints_the_caches_kv(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["geometry", str(CONFIGS / "qwen2.5-7b-instruct.json")]) == 0
    text = capsys.readouterr().out
    assert "kv: {layers: 28, pageBytes: 131072, pageTokens: 64}" in text
    assert "sglang: --tp-size 1 --page-size 64 --kv-cache-dtype auto" in text  # what the engine must be started with
    assert main(["geometry", str(CONFIGS / "deepseek-v3.json"), "--tp", "8", "--json", "--page-tokens", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv"] == {"layers": 61, "pageBytes": 36864, "pageTokens": 32} and out["replicated"] is True
    assert out["sglang_flags"] == "--tp-size 8 --page-size 32 --kv-cache-dtype auto"
    assert main(["geometry", str(CONFIGS / "qwen3-next-80b-a3b-instruct.json")]) == 0
    text = capsys.readouterr().out
    assert "the KV pool holds 12 of 48 layers" in text and "pool mamba: 36 layers" in text
    assert "kv: {layers: 12, pageBytes: 131072, pageTokens: 64}" in text
    assert main(["geometry", str(CONFIGS / "qwen2.5-7b-instruct.json"), "--tp", "3"]) != 0  # a clear error, no trace
    assert "cannot share 4 KV heads" in capsys.readouterr().err
