"""The baseline FlatCake is compared with when history outgrows DRAM: vLLM's own multi-tier offloading
(``TieringOffloadingSpec``: its DRAM tier as the primary, its ``fs`` tier below) in a real vLLM server on this
machine's CPU, with the worker from loadgen/serve/vllm_offload.py copying into the primary tier's shared
region. Three prompts that together outgrow the DRAM tier push the first one out of it; after
``/reset_prefix_cache`` the first prompt's blocks come back from the fs tier's files, and give vLLM's own
prefix-cache hit's greedy logprobs and the cold run's tokens."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flatcake.loadgen.serve.model import make_model
from flatcake.loadgen.serve.vllm import SHM, VLLMServer, tiering_transfer_config
from flatcake.node_agent import geometry
from tests.support.waiting import wait_until

BLOCK = 128
BLOCKS = 17  # full blocks of each prompt
PROMPT = BLOCKS * BLOCK + 57
DRAM_BLOCKS = 24  # the DRAM tier holds one prompt, not three
EXTERNAL = "vllm:external_prefix_cache_hits_total"  # tokens a KV connector supplied (v1/metrics/loggers.py)
# Prompt tokens by the tier that supplied them: TieringOffloadingManager.get_load_source says "disk" for a
# block it promoted from the fs tier (the tier's cache_hit_source), "host" for one found in its DRAM tier.
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
WORKER = "CPU-platform offload worker"  # vllm_offload.READY (not imported: no vllm here)


@pytest.mark.unit
def test_the_disk_tier_config_is_vllms_multi_tier_setup_with_our_worker(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="offload_dir .* needs offload_gib > 0"):
        VLLMServer(tmp_path, workdir=tmp_path, port=1, offload_dir=tmp_path / "fs", python=Path("/none"))
    server = VLLMServer(tmp_path, workdir=tmp_path, port=1, offload_gib=0.5, offload_dir=tmp_path / "fs",
                        python=Path("/none"))  # fmt: skip
    config = json.loads(server.command()[server.command().index("--kv-transfer-config") + 1])
    assert config == tiering_transfer_config(0.5, tmp_path / "fs", server.engine_id)
    assert config == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": server.engine_id,
                      "kv_connector_extra_config": {"spec_name": "CPUPlatformTieringSpec",
                                                    "spec_module_path": "flatcake.loadgen.serve.vllm_offload",
                                                    "cpu_bytes_to_use": 1 << 29,
                                                    "secondary_tiers": [{"type": "fs", "root_dir": str(tmp_path / "fs")}]}}  # fmt: skip
    # Each server names its own region, so two servers never share one and a leftover is found by name.
    other = VLLMServer(
        tmp_path, workdir=tmp_path, port=1, offload_gib=0.5, offload_dir=tmp_path / "fs", python=Path("/none")
    )
    assert other.engine_id != server.engine_id


def _prompt(seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(PROMPT)]


def _block_files(root: Path) -> int:
    return sum(1 for _ in root.rglob("*.bin"))


@pytest.mark.system
def test_a_prefix_pushed_out_of_vllms_dram_tier_comes_back_from_its_disk_tier(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    g = geometry.load(model, page_tokens=BLOCK)
    dram = DRAM_BLOCKS * g.layers * g.page_bytes  # one vLLM block holds every layer's page
    first, second, third = (_prompt(seed, vocab) for seed in (1, 2, 3))
    fs = tmp_path / "fs"
    server = VLLMServer(
        model, workdir=tmp_path / "vllm", offload_gib=dram / (1 << 30), offload_dir=fs, block_size=BLOCK
    )
    with server:
        cold = server.complete(first)
        assert cold.prompt_tokens == PROMPT
        native = server.complete(first)  # vLLM's own prefix cache
        server.complete(second)
        server.complete(third)
        # Every block of the three prompts reached the fs tier (stored to DRAM, then cascaded to a file each).
        wait_until(lambda: _block_files(fs) == 3 * BLOCKS, what=f"{3 * BLOCKS} block files under {fs}")
        assert server.metric(EXTERNAL) == 0  # nothing came from an offload tier yet
        server.reset_prefix_cache()  # retried until no block is held
        warm = server.complete(first)
        # The first prompt's 17 blocks came from the disk tier: vLLM's cache was emptied, and its DRAM tier
        # (24 blocks, LRU) has held the 34 blocks of the two later prompts since.
        assert server.metric(EXTERNAL) == BLOCKS * BLOCK
        assert server.metric(BY_SOURCE, source="disk") == BLOCKS * BLOCK
        assert server.metric(BY_SOURCE, source="host") == 0
        assert warm.token_logprobs == native.token_logprobs  # bit-identical to vLLM's own cached KV
        assert warm.text == cold.text
    # The server ran our tiering spec, its worker copied into the shared region the fs tier reads, and the
    # region is gone with the server.
    log = (tmp_path / "vllm" / "server.log").read_text(errors="replace")
    assert "Loading out-of-tree offloading spec 'CPUPlatformTieringSpec' from 'flatcake.loadgen.serve." in log
    assert "Created TieringOffloadingManager with primary tier (lru, 24 chunks) and 1 secondary tier(s)" in log
    region = f"/dev/shm/vllm_offload_{server.engine_id}.mmap"
    assert f"{WORKER}: {g.layers} KV tensors, {DRAM_BLOCKS} host chunks of 1 block(s)" in log and region in log
    assert f"{WORKER}: first load, {BLOCKS} block(s)" in log
    assert not list(SHM.glob(f"vllm_offload_{server.engine_id}*"))
