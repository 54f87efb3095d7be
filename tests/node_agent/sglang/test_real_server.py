"""FlatCake inside a real SGLang 0.5.23 server (CPU; issue 28): a real node agent, a real server loading
``flatcake.node_agent.sglang.FlatCakeStorage`` through ``--hicache-storage-backend dynamic``, a small
model of a real architecture with random weights generated here. After ``/flush_cache`` a prompt's
prefix comes back from FlatCake (the server's ``cached_tokens_details`` says ``storage``, the agent's
counters say which medium) and the greedy decode's logprobs equal the cold run's bit for bit. A damaged
page is refused as corrupt (recomputed, same logprobs); with checks off, wrong bytes change them.

The server runs from its own venv (``.venv/sglang-server``, requirements/sglang-server.txt; ``bin/test``
builds it) with the CPU compatibility layer (loadgen/serve/sglang_cpu) on its PYTHONPATH."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flatcake.loadgen.serve.model import make_model
from flatcake.loadgen.serve.server import LAYOUTS, Generation, SGLangServer, server_python
from flatcake.node_agent import EngineConfig, geometry
from flatcake.node_agent.service.main import spawn
from tests.support.agents import agent_stats
from tests.support.engines import small_config

pytestmark = pytest.mark.system

LAYERS, PAGE_TOKENS = 6, 64
PAGE_BYTES = 2 * PAGE_TOKENS * 2 * 64 * 2  # K and V, 64 tokens, 2 KV heads of 64 dims, bf16: the model's page
INSTALL = "bin/test builds it (FLATCAKE_SGLANG_SERVER=1 bin/flatcake --help does too)"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        server_python()
    except FileNotFoundError as exc:
        raise AssertionError(f"{exc}; {INSTALL}") from None
    path = make_model(tmp_path_factory.mktemp("model"), layers=LAYERS)
    # The agent is sized by the geometry derived from the model's config.json: the real server's backend
    # registers its host pool's page with the agent, which refuses another size.
    g = geometry.load(path, page_tokens=PAGE_TOKENS)
    assert (g.layers, g.page_bytes) == (LAYERS, PAGE_BYTES)
    return path


def agent_config(where: Path, verify: str = "ssd") -> EngineConfig:
    return small_config(where, layers=LAYERS, page_bytes=PAGE_BYTES, files=32, file_bytes=8 << 20,
                        dram_bytes=256 * LAYERS * PAGE_BYTES, page_tokens=PAGE_TOKENS,
                        io={"verify_reads": verify})  # fmt: skip


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[Any]:
    with running_agent(tmp_path, "ssd") as proc:
        yield proc


@contextlib.contextmanager
def running_agent(tmp_path: Path, verify: str) -> Iterator[Any]:
    """A node agent process of the model's geometry (its config as ``.config``), stopped at the end."""
    config = agent_config(tmp_path / "node", verify)
    (tmp_path / "node").mkdir(parents=True, exist_ok=True)
    proc = spawn(config, tmp_path / "node")
    proc.config = config
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def stats(config: EngineConfig) -> dict[str, Any]:
    return agent_stats(config.agent.socket)


def restored(config: EngineConfig) -> dict[str, int]:
    """Pages the agent's clients restored so far, by medium (their reports reach the agent's stats)."""
    s = stats(config)["client_stats"]
    return {m: int(s.get(f"restore_pages_{m}", 0)) for m in ("dram", "ssd")}


def backend_config(config: EngineConfig) -> dict[str, Any]:
    return {"backend_name": "flatcake", "module_path": "flatcake.node_agent.sglang", "class_name": "FlatCakeStorage",
            "socket": config.agent.socket, "interface_v1": True, "hicache_storage_pass_prefix_keys": True,
            "placement_hints": {"reply_tokens": 8}}  # fmt: skip


def prompt(seed: int, n: int, vocab: int = 8192) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def stored_then_flushed(server: SGLangServer, ids: list[int], stored: int = 0) -> Generation:
    """Generate cold, wait until HiCache has written the prompt's new pages to FlatCake (``stored``
    tokens of it are there already: not written again), flush the device and host tiers; returns the
    cold generation."""
    before = server.backed_up_tokens()
    cold = server.generate(input_ids=ids)
    server.wait_backed_up(before + (len(ids) - 1) // PAGE_TOKENS * PAGE_TOKENS - stored)
    server.flush_cache()
    return cold


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefixes_come_back_from_flatcakes_ssd_and_dram_with_bit_identical_logprobs(
    model: Path, agent: Any, tmp_path: Path, layout: str
) -> None:
    config = agent.config
    with SGLangServer(model, workdir=tmp_path / "sglang", mem_layout=layout, storage_backend="dynamic",
                      storage_config=backend_config(config)) as server:  # fmt: skip
        server.warm_up()
        # Turn 1: a one-shot prompt, placed on SSD.
        first = prompt(1, 2048)
        cold = stored_then_flushed(server, first)
        before = restored(config)
        warm = server.generate(input_ids=first)
        assert warm.storage_backend == "FlatCakeStorage" and warm.cached_storage == 31 * PAGE_TOKENS, warm
        assert warm.output_ids == cold.output_ids and warm.logprobs == cold.logprobs  # bit for bit
        after = restored(config)
        assert after["ssd"] - before["ssd"] == 31 and after["dram"] == before["dram"]
        # Turn 2 continues turn 1 after a short reply and a short question (together under Table 2's
        # 512-token short reply): a short-turn dialogue, placed in DRAM; turn 1 stays on SSD.
        second = first + cold.output_ids + prompt(2, 248)
        cold2 = stored_then_flushed(server, second, stored=len(first))
        before = restored(config)
        warm2 = server.generate(input_ids=second)
        assert warm2.cached_storage == (len(second) - 1) // PAGE_TOKENS * PAGE_TOKENS, warm2
        assert warm2.output_ids == cold2.output_ids and warm2.logprobs == cold2.logprobs
        after = restored(config)
        assert after["dram"] > before["dram"] and after["ssd"] > before["ssd"], (
            before,
            after,
            stats(config)["placements"],
        )
        placed = stats(config)["placements"]
        assert any(k.startswith("dram/") and v for k, v in placed.items()), placed
        assert any(k.startswith("ssd/") and v for k, v in placed.items()), placed


@pytest.mark.parametrize("verify", ["ssd", "off"])
def test_a_damaged_page_is_refused_or_changes_the_logprobs(model: Path, tmp_path: Path, verify: str) -> None:
    """The control: with the default checks a damaged SSD page is a miss (recomputed: the same logprobs,
    nothing from storage); with checks off the same damage reaches the model and its logprobs differ,
    so the equality above is a real comparison."""
    with running_agent(tmp_path, verify) as agent:
        config = agent.config
        with SGLangServer(model, workdir=tmp_path / "sglang", storage_backend="dynamic",
                          storage_config=backend_config(config)) as server:  # fmt: skip
            server.warm_up()
            ids = prompt(3, 2048)
            cold = stored_then_flushed(server, ids)
            pool = Path(config.ssd.dir)
            files = [p for p in pool.iterdir() if p.is_file() and p.stat().st_size >= config.ssd.file_bytes]
            assert files, f"no pool files in {pool}: {sorted(p.name for p in pool.iterdir())}"
            for path in files:
                with path.open("r+b") as f:
                    f.write(bytes([0xA5]) * config.ssd.file_bytes)
            warm = server.generate(input_ids=ids)
            if verify == "ssd":
                assert not warm.cached_storage and warm.logprobs == cold.logprobs, warm
                assert stats(config)["client_stats"].get("verify_failures", 0) > 0
            else:
                assert warm.cached_storage == 31 * PAGE_TOKENS
                assert warm.logprobs != cold.logprobs


def test_an_agent_killed_under_a_live_server_costs_misses_then_hits_again(model: Path, tmp_path: Path) -> None:
    """Issue 29 item 9: kill -9 of the agent while SGLang serves. Requests meanwhile are recomputed (the
    backend's calls fail as misses; same logprobs, nothing from storage); once the agent is back the
    backend reconnects by itself and the prompt comes back from FlatCake again, bit-identical."""
    import time

    config = agent_config(tmp_path / "node")
    (tmp_path / "node").mkdir(parents=True, exist_ok=True)
    agent = spawn(config, tmp_path / "node")
    try:
        with SGLangServer(model, workdir=tmp_path / "sglang", storage_backend="dynamic",
                          storage_config=backend_config(config)) as server:  # fmt: skip
            server.warm_up()
            ids = prompt(5, 2048)
            cold = stored_then_flushed(server, ids)
            agent.kill()
            agent.wait(30)
            during = server.generate(input_ids=ids)
            assert not during.cached_storage and during.logprobs == cold.logprobs, during
            server.flush_cache()
            started = time.monotonic()
            agent = spawn(config, tmp_path / "node")
            back = server.generate(input_ids=ids)
            served_again_s = time.monotonic() - started
            assert back.cached_storage == 31 * PAGE_TOKENS and back.logprobs == cold.logprobs, back
            assert served_again_s < 10.0  # the restart goal (docs/operations.md), agent start included
    finally:
        agent.terminate()
        agent.wait(30)
