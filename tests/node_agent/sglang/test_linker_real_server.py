"""FlatCake's unified-cache linker inside a real SGLang 0.5.23 server (CPU; issue 43 item 4): a real node
agent, a real server loading the linker through ``--unified-cache-external-linker-backend dynamic`` (as
``tests.support.sglang_linker.GatedLinker``: FlatCake's linker with each layer held back until the forward
waits for it, tracing the order), the small model of test_real_server.py.

A prompt computed cold is offloaded through the linker (its pages land at the agent under the keys the
HiCache backend uses: checked by computing them here); after ``/flush_cache`` the prompt comes back from
FlatCake (the agent's clients restored its 31 pages; SGLang reports a linker hit as ``host`` tokens), each
layer released to the forward only after the forward began waiting for it and before the next layer was,
and the greedy logprobs equal the cold run's bit for bit (test_real_server.py's tolerance)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sglang.srt.mem_cache.utils import get_hash_str

from flatcake.loadgen.serve.server import ROOT, SGLangServer
from flatcake.node_agent import connect
from tests.node_agent.sglang.test_real_server import LAYERS, PAGE_BYTES, PAGE_TOKENS, prompt, restored
from tests.node_agent.sglang.test_real_server import agent as agent
from tests.node_agent.sglang.test_real_server import model as model
from tests.support.waiting import wait_until

pytestmark = pytest.mark.system


def linker_config(socket: str, trace: Path) -> dict[str, Any]:
    return {"linker": "GatedLinker", "linker_module_path": "tests.support.sglang_linker",
            "linker_extra_config": {"socket": socket, "trace": str(trace), "placement_hints": {"reply_tokens": 8}}}  # fmt: skip


def page_keys(ids: list[int]) -> list[str]:
    """The prompt's page keys as SGLang hashes them (``get_storage_hash_str`` without a namespace) and both
    FlatCake paths name them (``@tp0of1``)."""
    pages = len(ids) // PAGE_TOKENS
    hashes = get_hash_str(ids[: pages * PAGE_TOKENS], None, page_size=PAGE_TOKENS)
    assert isinstance(hashes, list)
    return [h + "@tp0of1" for h in hashes]


def test_a_prefix_offloaded_through_the_linker_streams_back_layer_by_layer_with_identical_logprobs(
    model: Path, agent: Any, tmp_path: Path
) -> None:
    config = agent.config
    trace = tmp_path / "trace.jsonl"
    tests = tmp_path / "testpath"  # only ``tests`` on the server's path: the tree's root holds an ``operator``
    tests.mkdir()
    (tests / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
    with SGLangServer(model, workdir=tmp_path / "sglang", storage_backend=None, extra_paths=[tests],
                      linker_config=linker_config(config.agent.socket, trace)) as server:  # fmt: skip
        server.warm_up()
        ids = prompt(11, 2048)
        cold = server.generate(input_ids=ids)
        assert cold.cached_tokens == 0, cold
        keys = page_keys(ids)
        probe = connect(config.agent.socket, layers=LAYERS, page_bytes=PAGE_BYTES)
        try:
            wait_until(lambda: probe.exists(keys) == len(keys), what="the linker's offload to reach the agent")
        finally:
            probe.close()
        server.flush_cache()
        trace.write_text("")
        before = restored(config)
        warm = server.generate(input_ids=ids)
        hit = (len(ids) - 1) // PAGE_TOKENS * PAGE_TOKENS  # the last prompt token is always computed
        assert warm.cached_tokens == hit and warm.cached_host == hit and warm.cached_device == 0, warm
        assert warm.output_ids == cold.output_ids and warm.logprobs == cold.logprobs  # bit for bit
        after = restored(config)
        assert sum(after.values()) - sum(before.values()) == hit // PAGE_TOKENS, (before, after)
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    assert not [r for r in records if r["kind"] == "timeout"], records
    batches = {r["index"] for r in records}
    assert len(batches) == 1, records  # the warm request's one load batch
    at: dict[tuple[str, int], int] = {}  # each kind's first time per layer (the forward waits once per K and V)
    for r in records:
        at.setdefault((r["kind"], r["layer"]), r["t"])
    for layer in range(LAYERS):
        # The forward waited for the layer before its bytes were released, and read it only after.
        assert at[("wait", layer)] <= at[("complete", layer)] <= at[("read", layer)], (layer, records)
        if layer + 1 < LAYERS:  # layer l was read while layer l + 1 was still held back: streaming, not all at once
            assert at[("read", layer)] < at[("complete", layer + 1)], (layer, records)
