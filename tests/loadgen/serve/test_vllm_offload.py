"""The baseline FlatCake is compared with on vLLM: vLLM's own CPU offloading (``OffloadingConnector``, its
``CPUOffloadingManager`` deciding what is offloaded) in a real vLLM server on this machine's CPU, with the
worker from loadgen/serve/vllm_offload.py (upstream's needs CUDA or XPU). A prompt's blocks stored by one
request come back from the offload after ``/reset_prefix_cache`` has emptied vLLM's own cache, and give the
same greedy logprobs as vLLM's own prefix-cache hit (as FlatCake's test, tests/node_agent/vllm/
test_real_server.py, asks of FlatCake's restored blocks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flatcake.loadgen.serve.model import make_model
from flatcake.loadgen.serve.vllm import VLLMServer

BLOCK = 128
SESSION = " ".join(f"word{i} alpha beta gamma" for i in range(200))  # 2,281 tokens: 17 full blocks
BLOCKS = 17
EXTERNAL = "vllm:external_prefix_cache_hits_total"  # tokens a KV connector supplied (v1/metrics/loggers.py)
# Prompt tokens by the tier that supplied them: "host" only from CPUOffloadingManager.get_load_source
# (v1/kv_offload/cpu/manager.py), so neither vLLM's own cache nor another connector can count here.
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
WORKER = "CPU-platform offload worker"  # vllm_offload.READY: the line our worker logs (not imported: no vllm here)


@pytest.mark.unit
def test_offload_and_the_flatcake_connector_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="socket .* offload_gib"):
        VLLMServer(tmp_path, workdir=tmp_path, port=1, socket="/x.sock", offload_gib=1, python=Path("/none"))
    server = VLLMServer(tmp_path, workdir=tmp_path, port=1, offload_gib=0.5, python=Path("/none"))
    config = json.loads(server.command()[server.command().index("--kv-transfer-config") + 1])
    assert config == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 29,
                                                    "spec_name": "CPUPlatformOffloadingSpec",
                                                    "spec_module_path": "flatcake.loadgen.serve.vllm_offload"}}  # fmt: skip
    assert "--kv-transfer-config" not in VLLMServer(tmp_path, workdir=tmp_path, port=1, python=Path("/none")).command()


@pytest.mark.system
def test_a_prefix_comes_back_from_vllms_own_cpu_offload(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    with VLLMServer(model, workdir=tmp_path / "vllm", offload_gib=0.25, block_size=BLOCK) as server:
        cold = server.complete(SESSION)
        assert cold.prompt_tokens == 2281
        native = server.complete(SESSION)  # vLLM's own prefix cache
        # Nothing came from the offload yet: the first request computed its prompt, the second hit vLLM's cache.
        assert server.metric(EXTERNAL) == 0 and server.metric(BY_SOURCE, source="host") == 0
        assert server.metric(BY_SOURCE, source="device") == BLOCKS * BLOCK
        server.reset_prefix_cache()  # retried until no block is held, i.e. the offload's stores have completed
        warm = server.complete(SESSION)
        # The 17 blocks came from the CPU offload tier, none from vLLM's emptied cache.
        assert server.metric(EXTERNAL) == BLOCKS * BLOCK
        assert server.metric(BY_SOURCE, source="host") == BLOCKS * BLOCK
        assert server.metric(BY_SOURCE, source="device") == BLOCKS * BLOCK
        assert warm.token_logprobs == native.token_logprobs  # bit-identical to vLLM's own cached KV
        assert warm.text == cold.text
        assert max(abs(a - b) for a, b in zip(warm.token_logprobs, cold.token_logprobs, strict=True)) < 0.05
    # The server ran our spec and its worker moved the blocks (upstream's worker refuses the CPU platform):
    # one KV tensor per layer, and a load that copied nothing would have failed the logprobs above (tried).
    log = (tmp_path / "vllm" / "server.log").read_text(errors="replace")
    assert "Loading out-of-tree offloading spec 'CPUPlatformOffloadingSpec' from 'flatcake.loadgen.serve." in log
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert f"{WORKER}: {layers} KV tensors, " in log
    assert f"{WORKER}: first store, " in log and f"{WORKER}: first load, {BLOCKS} block(s)" in log
