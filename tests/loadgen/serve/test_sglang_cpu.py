"""The CPU compatibility layer (loadgen/serve/sglang_cpu): each patch reaches the SGLang 0.5.23 module it
is written for, in the server's own venv, and a patched name that moved is a loud error, not a silent
no-op (the server would fail later, far from the cause)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from flatcake.loadgen.serve.server import COMPAT_DIR, server_python

pytestmark = pytest.mark.integration

CHECK = """
import json, sglang.srt.mem_cache.pool_host.base as base, sglang.srt.mem_cache.pool_host.mha as mha
import sglang.srt.mem_cache.pool_host.mla as mla, sgl_kernel.kvcacheio as kio, torchvision.transforms
print(json.dumps({
    "unpinned": getattr(base.HostKVCache.__init__, "_sglang_cpu", False),
    "mha_direct": mha.transfer_kv_direct is kio.transfer_kv_direct,
    "mla_direct": mla.transfer_kv_per_layer_direct_pf_lf is kio.transfer_kv_per_layer_direct_pf_lf,
    "kernel_refused": mha.transfer_kv_all_layer.__module__ == "sitecustomize",
}))
"""

MOVED = """
import types, sitecustomize
for patch, module in ((sitecustomize._unpin_host_pool, "sglang.srt.mem_cache.pool_host.base"),):
    fake = types.ModuleType(module)  # the class the patch replaces is gone from it
    try:
        patch(fake)
    except RuntimeError as exc:
        print(exc)
    else:
        raise SystemExit("no error for a moved name")
"""


def run_server_python(code: str) -> subprocess.CompletedProcess[str]:
    try:
        python = server_python()
    except FileNotFoundError as exc:
        raise AssertionError(f"{exc}; bin/test builds it (FLATCAKE_SGLANG_SERVER=1)") from None
    env = {**os.environ, "PYTHONPATH": str(COMPAT_DIR), "SGLANG_CPU_COMPAT_QUIET": "0"}
    env.pop("VIRTUAL_ENV", None)
    return subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=Path(COMPAT_DIR).parent)  # fmt: skip


def test_every_patch_reaches_the_installed_sglang() -> None:
    done = run_server_python(CHECK)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == {"unpinned": True, "mha_direct": True, "mla_direct": True,
                                                        "kernel_refused": True}  # fmt: skip
    assert "[sglang_cpu]" in done.stderr and "torchvision._meta_registrations skipped" in done.stderr


def test_a_patched_name_that_moved_is_a_clear_error() -> None:
    done = run_server_python(MOVED)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "HostKVCache is gone" in done.stdout and "loadgen/serve/sglang_cpu" in done.stdout


def test_the_server_runs_with_kernels_whose_results_do_not_depend_on_the_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """oneDNN's AMX kernels make a prefix hit's logprobs differ from a whole prefill's (measured on a
    Sapphire Rapids VM, from the device tier too): the harness caps oneDNN below AMX, as a default a
    caller's environment overrides."""
    from flatcake.loadgen.serve.server import DETERMINISTIC_ENV, SGLangServer

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    server = SGLangServer(tmp_path / "model", workdir=tmp_path / "sglang", python=Path("/bin/true"))
    assert server.environment()["ONEDNN_MAX_CPU_ISA"] == DETERMINISTIC_ENV["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert server.environment()["ONEDNN_MAX_CPU_ISA"] == "AVX2"
