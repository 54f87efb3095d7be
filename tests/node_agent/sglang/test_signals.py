"""Table 2's signals derived from SGLang's key chains (``prefix_keys``), through SGLang's real ABC and
factory against a running agent, and ``ChainSignals`` on its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from flatcake.errors import ConfigError
from flatcake.node_agent.policy.signals import STORAGE_BATCH_SIZE, ChainSignals
from flatcake.node_agent.service.hints import HINTS_ENV, deployment_hints
from flatcake.node_agent.sglang.backend import FlatCakeStorage
from tests.node_agent.sglang.test_backend import DIM, HEADS, LAYERS, PAGE, HostPool, make_backend
from tests.support.agents import AgentThread

pytestmark = pytest.mark.integration
Start = Callable[..., AgentThread]
PAGE_BYTES = 2 * PAGE * HEADS * DIM * 2


def keys(tag: str, n: int) -> list[str]:
    return [f"{tag}{i:063x}"[:64] for i in range(n)]


def info(prefix: list[str] | None) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def scope_of(agent: AgentThread, key: str) -> int:
    loc = agent.agent.catalog.table.lookup(key + "@tp0of1")
    assert loc is not None
    return int(loc.scope)


def medium_of(agent: AgentThread, key: str) -> str:
    table = agent.agent.catalog.table
    return table.scopes[scope_of(agent, key)].medium.name.lower()


def backend_on(agent_thread: Start, **extra: Any) -> tuple[AgentThread, FlatCakeStorage]:
    agent = agent_thread(layers=LAYERS, page_bytes=PAGE_BYTES, files=8, file_bytes=64 * LAYERS * PAGE_BYTES)
    backend = make_backend(agent, HostPool(False, "page_first"), extra=extra)
    assert isinstance(backend, FlatCakeStorage)
    return agent, backend


def slots(n: int) -> torch.Tensor:
    return torch.arange(0, n * PAGE)


def test_later_short_turns_of_a_chain_start_a_dram_scope_that_the_next_turns_join(agent_thread: Start) -> None:
    agent, backend = backend_on(agent_thread)
    t1, t2, t3 = keys("a", 3), keys("b", 2), keys("c", 1)
    assert backend.batch_set_v1(t1, slots(3), info([])) == [True] * 3
    assert backend.batch_exists(t2, info(t1)) == 0  # SGLang's prefetch query before the next turn
    assert backend.batch_set_v1(t2, slots(2), info(t1)) == [True] * 2
    assert backend.batch_set_v1(t3, slots(1), info(t1 + t2)) == [True]
    session = backend.signals.session(t3[0])
    assert session is not None and (session.root, session.turn) == (t1[0], 3)
    assert session.appended == (2 * PAGE, 1 * PAGE)  # tokens turns 2 and 3 appended: short replies
    # Turn 1 is one-shot (SSD); turn 2 is a short chat's (DRAM, a scope of its own: nothing migrates);
    # turn 3 continues turn 2's scope.
    assert scope_of(agent, t2[0]) == scope_of(agent, t3[0]) != scope_of(agent, t1[0])
    assert medium_of(agent, t1[0]) == "ssd" and medium_of(agent, t2[0]) == "dram"
    placements = agent.agent.catalog.placements.snapshot()
    assert placements == {"ssd/one_shot": 3, "dram/short_chat": 2, "dram/inherited": 1}
    backend.close()


def test_a_prompt_shared_by_several_live_requests_goes_to_dram(agent_thread: Start) -> None:
    agent, backend = backend_on(agent_thread)
    prompt, a, b, c = keys("5", 4), keys("a", 2), keys("b", 2), keys("c", 2)
    # Three requests look the prompt up (SGLang's hit query) before the first of them writes it.
    for own in (a, b, c):
        assert backend.batch_exists(prompt + own, info([])) == 0
    assert backend.signals.continuations(prompt[-1]) == 3
    assert backend.batch_set_v1(prompt + a, slots(6), info([])) == [True] * 6
    assert {medium_of(agent, k) for k in prompt} == {"dram"}
    assert medium_of(agent, a[0]) == "ssd" and scope_of(agent, a[0]) != scope_of(agent, prompt[0])
    # The others find the prompt on the device (prefix_keys) and write their own pages: each starts a
    # session of its own rather than joining the shared prompt's scope.
    assert backend.batch_set_v1(b, slots(2), info(prompt)) == [True] * 2
    assert scope_of(agent, b[0]) not in (scope_of(agent, prompt[0]), scope_of(agent, a[0]))
    placements = agent.agent.catalog.placements.snapshot()
    assert placements == {"dram/shared_prompt": 4, "ssd/one_shot": 4}
    backend.close()


def test_without_prefix_keys_it_degrades_to_one_shot(agent_thread: Start) -> None:
    """SGLang's default (``hicache_storage_pass_prefix_keys`` off): ``prefix_keys`` is None."""
    agent, backend = backend_on(agent_thread)
    t1, t2 = keys("a", 3), keys("b", 2)
    assert backend.batch_set_v1(t1, slots(3), info(None)) == [True] * 3
    assert backend.batch_set_v1(t2, slots(2), info(None)) == [True] * 2
    assert scope_of(agent, t1[0]) != scope_of(agent, t2[0])
    assert agent.agent.catalog.placements.snapshot() == {"ssd/one_shot": 5}
    backend.close()


def test_deployment_hints_come_from_extra_config_and_the_environment(
    agent_thread: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent, backend = backend_on(agent_thread, placement_hints={"expected_reuse": 3})
    assert backend.batch_set_v1(keys("a", 2), slots(2), info([])) == [True] * 2
    assert agent.agent.catalog.placements.snapshot() == {"dram/shared_prompt": 2}
    monkeypatch.setenv(HINTS_ENV, '{"reply_tokens": 4096}')
    assert deployment_hints({"placement_hints": {"reply_tokens": 1}}) == {"reply_tokens": 4096}
    with pytest.raises(ConfigError, match="unknown field"):
        deployment_hints({"placement_hints": {"turn": 2}})
    monkeypatch.setenv(HINTS_ENV, "{")
    with pytest.raises(ConfigError, match=HINTS_ENV):
        deployment_hints({})
    backend.close()


def test_a_write_split_into_storage_batches_stays_one_turn() -> None:
    s = ChainSignals()
    first, rest = keys("a", STORAGE_BATCH_SIZE), keys("b", 3)
    s.observe([], first)
    s.record(first, s.derive([], first, 16))
    s.observe(first, rest)
    runs = s.derive(first, rest, 16)
    assert [r.fields["turn"] for r in runs] == [1]
    s.record(rest, runs)
    nxt = keys("c", 1)
    s.observe(first + rest, nxt)
    (run,) = s.derive(first + rest, nxt, 16)
    assert run.fields["turn"] == 2 and run.fields["parent_key"] == rest[-1]
    assert run.fields["context_tokens"] == (STORAGE_BATCH_SIZE + 4) * 16


def test_memory_is_bounded_and_forgetting_degrades_gracefully() -> None:
    s = ChainSignals(capacity=8)
    chain = keys("a", 40)
    s.observe([], chain)
    s.record(chain, s.derive([], chain, 16))
    assert len(s._children) <= 8 and len(s._sessions) <= 8
    assert s.session(chain[0]) is None and s.session(chain[-1]) is not None
    (run,) = s.derive(chain[:2], keys("b", 1), 16)  # a forgotten parent: turn 2, as before signals existed
    assert run.fields["turn"] == 2 and run.fields["parent_key"] == chain[1]
