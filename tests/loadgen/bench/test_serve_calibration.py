"""``bench serve --calibrate``'s arithmetic (loadgen/bench/serve_calibration.py), without a server: the GPU
reference's KV bytes are Llama-3.1-70B's (80 layers x 8 KV heads x 128 dims, K and V, bf16, all four
ranks), its ratio follows the storage's read rate, and the slice's shapes hold the KV bytes they say."""

from __future__ import annotations

from pathlib import Path

import pytest

from flatcake.loadgen import models
from flatcake.loadgen.bench import serve_calibration as cal
from flatcake.loadgen.serve.model import make_model

pytestmark = pytest.mark.unit


def test_the_gpu_reference_restores_llama_70b_s_kv_against_its_modelled_prefill() -> None:
    slow = cal.gpu_reference("llama3-70b-tp4", "h200", read_bytes_per_s=10e9)
    fast = cal.gpu_reference("llama3-70b-tp4", "h200", read_bytes_per_s=20e9)
    assert slow["kv_bytes_per_token"] == 80 * 8 * 128 * 2 * 2
    assert slow["restore_over_prefill"] == pytest.approx(2 * fast["restore_over_prefill"])
    # 70.6B parameters on four H200s at MFU 0.5: tens of microseconds a token, not milliseconds
    assert 20e-6 < slow["prefill_s_per_token"] < 200e-6
    # an MLA model's latent KV is the same on every rank: one copy is restored, not one per rank
    mla = models.preset("dsv4-flash")
    assert cal.gpu_reference("dsv4-flash", "h200", 10e9)["kv_bytes_per_token"] == mla.kv_bytes_per_token


def test_the_shapes_hold_the_kv_bytes_they_say(tmp_path: Path) -> None:
    sizes = {name: cal.kv_bytes_per_token(make_model(tmp_path / name, **cal.SHAPES[name]))  # type: ignore[arg-type]
             for name in cal.SHAPES}  # fmt: skip
    assert sizes["slice"] == 2 * 6 * 2 * 64 * 2  # the serve slice: 6 layers, 2 KV heads of 64, bf16
    assert sizes["mha"] == sizes["mha-small-mlp"] == 5 * sizes["slice"]
