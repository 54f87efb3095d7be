"""The vLLM connector's planning (node_agent/vllm/plan.py): which blocks a step loads and saves."""

from __future__ import annotations

import pytest

from flatcake.node_agent.vllm.plan import Tracker, block_keys, lookup_range, rank_suffix

pytestmark = pytest.mark.unit

BS = 128


def test_keys_name_the_chain_the_rank_and_the_engine() -> None:
    assert block_keys([b"\x01\xff", b"\x02"], "@tp1of2") == ["vllm:01ff@tp1of2", "vllm:02@tp1of2"]
    assert rank_suffix(1, 2, replicated=False) == "@tp1of2" and rank_suffix(1, 2, replicated=True) == ""


def test_lookup_stops_before_the_block_of_the_prompts_last_token() -> None:
    assert lookup_range(0, 2281, BS, 17) == range(0, 17)  # 2281 tokens: 17 full blocks, the last one stays
    assert lookup_range(0, 2176, BS, 17) == range(0, 16)  # the last token is in block 16: vLLM computes it
    assert lookup_range(1024, 2281, BS, 17) == range(8, 17)  # past vLLM's own hit
    assert lookup_range(0, 100, BS, 0) == range(0, 0) and not lookup_range(2176, 2281, BS, 17)


def test_a_request_loads_once_then_saves_what_each_step_completes() -> None:
    t = Tracker(BS)
    keys = [f"k{i}" for i in range(17)]
    t.expect_load("r", first_block=2, blocks=10)  # vLLM's own hit: 2 blocks; FlatCake: 10 more
    load, save = t.step("r", keys, list(range(100, 117)), replace_blocks=True, computed_after=2048,
                        prompt_tokens=2281)  # fmt: skip
    assert load is not None and load.keys == keys[2:12] and load.block_ids == list(range(102, 112))
    assert save is not None and save.keys == keys[12:16] and save.prefix == keys[:12] and save.turn_open
    # The next chunk completes block 16 and closes the prompt; decode adds no full block yet.
    load, save = t.step("r", keys, None, replace_blocks=False, computed_after=2281, prompt_tokens=2281)
    assert load is None and save is not None and save.keys == ["k16"] and save.block_ids == [116]
    assert not save.turn_open
    assert t.step("r", keys, None, replace_blocks=False, computed_after=2282, prompt_tokens=2281) == (None, None)
    # Decode fills block 17: saved once vLLM has hashed it (its key is known) and given it a block.
    load, save = t.step("r", [*keys, "k17"], [117], replace_blocks=False, computed_after=2305, prompt_tokens=2281)
    assert save is not None and save.keys == ["k17"] and save.block_ids == [117]


def test_a_resumed_request_takes_its_new_blocks_and_a_finished_one_is_forgotten() -> None:
    t = Tracker(BS)
    keys = ["a", "b", "c"]
    _, save = t.step("r", keys[:1], [5, 6], replace_blocks=True, computed_after=BS, prompt_tokens=3 * BS)
    assert save is not None and save.block_ids == [5]
    # Preempted and resumed: vLLM gives the whole new block list (CachedRequestData.resumed_req_ids).
    _, save = t.step("r", keys, [7, 8, 9], replace_blocks=True, computed_after=3 * BS, prompt_tokens=3 * BS)
    assert save is not None and save.keys == ["b", "c"] and save.block_ids == [8, 9]
    t.finished("r")
    _, save = t.step("r", keys, [1, 2, 3], replace_blocks=True, computed_after=3 * BS, prompt_tokens=3 * BS)
    assert save is not None and save.keys == keys  # a new request under the same id starts afresh


def test_a_tenant_keys_blocks_apart_and_is_checked() -> None:
    """The connector's suffix is the rank's shard plus the deployment's tenant (extra config)."""
    from flatcake.errors import ConfigError
    from flatcake.node_agent.service.hints import tenant_suffix

    h = [b"\x01" * 16]
    a = block_keys(h, rank_suffix(0, 2, False) + tenant_suffix({"tenant": "team-a"}))
    b = block_keys(h, rank_suffix(0, 2, False) + tenant_suffix({"tenant": "team-b"}))
    none = block_keys(h, rank_suffix(0, 2, False) + tenant_suffix({}))
    assert len({a[0], b[0], none[0]}) == 3 and a[0].endswith("@tp0of2@t:team-a")
    with pytest.raises(ConfigError, match="tenant: 7 must be"):
        tenant_suffix({"tenant": 7})


def test_a_failed_parked_load_is_never_offered_again_a_finished_one_is() -> None:
    """vLLM asks for external tokens again after a failed load (recomputing from the first block) and after
    a preemption: the first would fail the same way for ever, the second should load again."""
    t = Tracker(block_size=4)
    keys = [f"k{i}" for i in range(6)]
    t.async_load("bad", keys, [10, 11, 12, 13, 14, 15], first=0, n=4)
    t.async_load("good", keys, [20, 21, 22, 23, 24, 25], first=1, n=3)
    t.load_results(invalid_blocks={12, 13}, finished={"bad", "good"})
    assert not t.may_offer("bad") and t.may_offer("good")
    # later reports name blocks the failed request no longer owns: they do not fail the one that loaded
    t.load_results(invalid_blocks={21}, finished=set())
    assert t.may_offer("good")
    t.finished("bad")  # a new request under the same id (vLLM reuses none, but state must not leak)
    assert t.may_offer("bad")
