"""``bench serve``'s emulated systems, pure: the emulator configured as the real SGLang deployment (geometry,
pools, DRAM split), its prefill rate from the calibration, and the checks that refuse what cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flatcake.errors import ConfigError
from flatcake.loadgen import names
from flatcake.loadgen.bench import serve, serve_emulated
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.node_agent import geometry

pytestmark = pytest.mark.unit

# The slice's model (loadgen/serve/model.py): 6 layers, 2 KV heads x 64 dims, bf16, SGLang's 64-token page.
GEOMETRY = {"layers": 6, "page_tokens": 64, "page_bytes": 64 * 2 * 2 * 64 * 2}
SPAN = 6 * 64 * 512  # one page, every layer: 3,072 B a token
RATES = serve_emulated.Rates(2_000.0, 64.0, "test")


def _calibration(path: Path, per_token: float = 0.0004) -> Path:
    rows = [{"where": "this machine, slice", "prefill_s_per_token": per_token},
            {"where": "this machine, mha", "prefill_s_per_token": 0.1}]  # fmt: skip
    path.write_text(json.dumps({"reference": {}, "here": rows}))
    return path


def test_the_slice_model_s_geometry_is_the_one_mirrored(tmp_path: Path) -> None:
    from flatcake.loadgen.serve.model import make_model

    model = make_model(tmp_path / "model")
    assert serve.kv_geometry(model) == GEOMETRY
    assert geometry.load(model, page_tokens=64).page_bytes * 6 // 64 == 3072


def test_every_emulated_system_mirrors_the_geometry_and_the_device_pool() -> None:
    cfg = serve.ServeConfig(systems=serve.EMULATED, device_tokens=6_144)
    for system in serve.EMULATED:
        emu = serve_emulated.mirror(system, cfg, GEOMETRY, RATES)
        assert (emu.layers, emu.page_tokens, emu.bytes_per_token_layer) == (6, 64, 512)
        assert emu.page_span == SPAN
        assert emu.hbm_bytes == 6_144 * 3_072  # 96 pages: SGLang's --max-total-tokens
        assert emu.ssd_bytes == serve.ssd_pool_bytes(GEOMETRY) == 32 * 64 * SPAN
        assert emu.scope_file_bytes == 64 * SPAN  # FlatCake's SSD files, as storage_for makes them
        assert (emu.prefill_tokens_per_s, emu.decode_tokens_per_s) == (2_000.0, 64.0)
        assert emu.prefetch_policy == cfg.prefetch_policy and emu.model is None


def test_emu_flatcake_splits_dram_as_deployed_host_pool_plus_flatcake_s_pool() -> None:
    cfg = serve.ServeConfig(systems=("emu-flatcake",), dram_bytes=32 << 20, host_ratio=1.5)
    emu = serve_emulated.mirror("emu-flatcake", cfg, GEOMETRY, RATES)
    host = 9_216 * 3_072  # --hicache-ratio 1.5 of 6,144 tokens
    flatcake = (32 << 20) // SPAN * SPAN  # the agent's DramConfig in storage_for
    assert (emu.mode, emu.storage) == ("flatcake", "flatcake")
    assert emu.dram_bytes == host + flatcake
    # The split lands on the real pools exactly, not a page short after the emulator's rounding.
    assert emu.l3_dram_bytes == flatcake and emu.host_tier_bytes == host
    odd = serve_emulated.mirror("emu-flatcake", serve.ServeConfig(dram_bytes=(5 << 20) + 12_345), GEOMETRY, RATES)
    assert odd.l3_dram_bytes == ((5 << 20) + 12_345) // SPAN * SPAN


def test_emu_hicache_file_has_the_host_pool_and_keeps_its_files_in_the_page_cache() -> None:
    emu = serve_emulated.mirror("emu-hicache-file", serve.ServeConfig(), GEOMETRY, RATES)
    assert (emu.mode, emu.storage) == ("tiered", "hicache-file")
    assert emu.dram_bytes == emu.host_tier_bytes == 9_216 * 3_072 and emu.l3_dram_bytes == 0
    assert not emu.drop_page_cache  # SGLang's HiCacheFile leaves them there in the real server


def test_the_native_what_if_owns_the_same_dram_total_with_no_host_tier() -> None:
    cfg = serve.ServeConfig(dram_bytes=32 << 20)
    shipped = serve_emulated.mirror("emu-flatcake", cfg, GEOMETRY, RATES)
    native = serve_emulated.mirror("emu-flatcake-native", cfg, GEOMETRY, RATES)
    assert native.rules == "native" and native.host_tier_bytes == 0
    assert native.l3_dram_bytes == native.dram_bytes == shipped.dram_bytes


def test_the_prefill_rate_is_the_calibration_s_slice_row(tmp_path: Path) -> None:
    rates = serve_emulated.calibrated_rates(_calibration(tmp_path / "cal.json", 0.0004))
    assert rates.prefill_tokens_per_s == pytest.approx(2_500.0)  # not the mha row's 10 tokens/s
    assert rates.decode_tokens_per_s == pytest.approx(1 / serve_emulated.DECODE_S_PER_TOKEN)
    shipped = serve_emulated.calibrated_rates(serve.CALIBRATION)  # the committed one: this CPU's
    assert 1_000 < shipped.prefill_tokens_per_s < 10_000


def test_a_missing_calibration_names_bench_serve_calibrate(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"calibration: .*missing.json does not exist.*bench serve --calibrate"):
        serve_emulated.calibrated_rates(tmp_path / "missing.json")
    (tmp_path / "no-slice.json").write_text(json.dumps({"here": [{"where": "this machine, mha"}]}))
    with pytest.raises(ConfigError, match=r"no 'slice' row.*bench serve --calibrate"):
        serve_emulated.calibrated_rates(tmp_path / "no-slice.json")


def test_a_run_with_a_missing_calibration_stops_before_any_point(tmp_path: Path) -> None:
    cfg = serve.ServeConfig(systems=("emu-flatcake",), calibration=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="bench serve --calibrate"):
        serve.run(cfg, tmp_path / "out", log=lambda _: None)
    assert not (tmp_path / "out" / "emu-flatcake").exists()


def test_the_emulated_systems_need_sglang_and_are_opt_in() -> None:
    with pytest.raises(ConfigError, match=r"engine: 'vllm' cannot run emu-flatcake-native.*engine sglang"):
        serve.ServeConfig(engine="vllm", systems=("vllm", "emu-flatcake-native"))
    assert set(serve.EMULATED) <= set(names.names("serve"))
    assert not set(serve.EMULATED) & set(names.names("serve-vllm"))
    assert not set(serve.EMULATED) & set(serve.ServeConfig().systems)
    assert serve.default_systems("sglang") == ("flatcake", "flatcake-linker", "hicache-file", "hicache-mooncake")
    assert set(serve_emulated.SYSTEMS) == set(serve.EMULATED)
    for system, (_, _, real) in serve_emulated.SYSTEMS.items():  # each counterpart is a real serve system
        assert real is None or real in serve.default_systems("sglang"), system


def test_tiers_come_from_the_emulator_s_hits_and_native_dram_is_storage() -> None:
    records = [{"ok": True, "ttft_s": 0.5, "hit_tokens": {"hbm": 128, "dram": 64, "ssd": 256}},
               {"ok": False, "ttft_s": None, "hit_tokens": {"hbm": 999}}]  # fmt: skip
    assert serve_emulated.tiers("emu-flatcake", records) == {"device": 128, "host": 64, "storage": 256}
    assert serve_emulated.tiers("emu-flatcake-native", records) == {"device": 128, "host": 0, "storage": 320}


def test_the_emulator_command_line_carries_the_mirror(tmp_path: Path) -> None:
    from flatcake.loadgen.bench import emulated

    emu = serve_emulated.mirror("emu-flatcake", serve.ServeConfig(), GEOMETRY, RATES)
    args = emulated.command(emu, 8123, tmp_path)
    flags = dict(zip(args[2::2], args[3::2], strict=False))
    assert flags["--mode"] == "flatcake" and flags["--page-tokens"] == "64" and flags["--layers"] == "6"
    assert flags["--bytes-per-token-layer"] == "512" and float(flags["--prefill-tokens-per-s"]) == 2_000.0
    assert int(flags["--dram-bytes"]) == emu.dram_bytes and "--model" not in flags
    again = EmulatorConfig(mode="flatcake", layers=6, page_tokens=64, bytes_per_token_layer=512,
                           dram_bytes=int(flags["--dram-bytes"]),
                           storage_dram_share=float(flags["--storage-dram-share"]))  # fmt: skip
    assert again.l3_dram_bytes == emu.l3_dram_bytes  # the share survives the command line
