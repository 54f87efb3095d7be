"""The emulator as an inference server: the OpenAI and SGLang conventions common clients rely on, run
with the clients themselves (``openai``, ``sglang.bench_serving`` with three backends)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from flatcake.loadgen import tokens
from flatcake.loadgen.emulator.config import EmulatorConfig
from flatcake.loadgen.emulator.params import chat_prompt
from flatcake.loadgen.emulator.server import output_token
from flatcake.loadgen.replay.requests import body, path, prompt_tokens, read_stream
from flatcake.loadgen.traces.formats import TraceRequest
from tests.support import bench_serving
from tests.support.emulators import Server
from tests.support.waiting import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(EmulatorConfig(data_dir=str(tmp_path_factory.mktemp("emu")), ssd_bytes=64 << 20,
                                   scope_file_bytes=4 << 20, decode_tokens_per_s=2000.0))  # fmt: skip
    yield server
    server.stop()


def call(server: Server, path: str, payload: object | None = None) -> tuple[int, Any]:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=data,
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw.decode()


def events(server: Server, path: str, payload: dict[str, Any]) -> list[Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as r:
        lines = [line.strip()[6:] for line in r.read().split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_the_tokenization_rule_is_shared_and_prefix_stable() -> None:
    r = TraceRequest(0, 700, 1, (5, 6))
    ids = prompt_tokens(r)
    assert tokens.encode(tokens.decode(ids)) == ids  # a trace sent as text caches as the same ids
    assert body("sglang", ids, 4, text=True)["text"] == tokens.decode(ids)
    assert tokens.count("x" * 9) == 3 and len(tokens.encode("x" * 9)) == 3
    text = "The quick brown fox jumps over the lazy dog, twice over."
    assert tokens.encode(text + " and more")[:14] == tokens.encode(text)[:14]  # 4k shared chars: k shared ids
    assert all(len(output_token(i)) == tokens.CHARS_PER_TOKEN for i in (0, 7, 99, 123))


def test_usage_chunk_only_when_asked_for(emulator: Server) -> None:
    plain = events(emulator, "/v1/completions", {"prompt": "hello world", "max_tokens": 3, "stream": True})
    assert all(e["choices"] for e in plain) and not any("usage" in e for e in plain)  # what OpenAI does
    assert "".join(e["choices"][0]["text"] for e in plain) == " t00 t01 t02"
    assert plain[-1]["choices"][0]["finish_reason"] == "length"
    asked = events(emulator, "/v1/completions", {"prompt": "hello world", "max_tokens": 3, "stream": True,
                                                 "stream_options": {"include_usage": True}})  # fmt: skip
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 3
    assert asked[-1]["usage"]["prompt_tokens"] == tokens.count("hello world") == 3
    status, err = call(emulator, "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}})
    assert status == 400 and err["error"]["param"] == "stream_options"


def test_serving_endpoints(emulator: Server) -> None:
    status, listing = call(emulator, "/v1/models")
    assert status == 200 and listing["data"][0]["id"] == "flatcake-emulator"
    assert call(emulator, "/health")[0] == 200 and call(emulator, "/health_generate")[0] == 200
    status, info = call(emulator, "/get_model_info")
    assert status == 200 and info["is_generation"] is True and info["tokenizer_path"] is None
    assert call(emulator, "/server_info")[1]["flatcake_emulator"]["mode"] == "flatcake"
    prompt = list(range(600))  # two full 256-token pages
    call(emulator, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})
    hot = call(emulator, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})[1]
    assert hot["meta_info"]["cached_tokens_details"]["device"] == 512  # both pages still in HBM
    status, text = call(emulator, "/flush_cache", {})
    assert status == 200 and text.startswith("Cache flushed")
    assert call(emulator, "/reset_prefix_cache", {})[0] == 200  # vLLM's name for it
    cold = call(emulator, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})[1]
    details = cold["meta_info"]["cached_tokens_details"]
    assert details["device"] == 0 and details["host"] + details["storage"] == 512  # restored from storage


def test_generate_takes_text_and_batches(emulator: Server) -> None:
    status, one = call(emulator, "/generate", {"text": "abcd" * 10, "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and one["text"] == " t00 t01" and one["meta_info"]["prompt_tokens"] == 10
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 2}
    status, batch = call(emulator, "/generate", {"text": ["ab", "abcdefgh"], "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and [r["meta_info"]["prompt_tokens"] for r in batch] == [1, 2]
    streamed = events(emulator, "/generate", {"input_ids": [[1, 2], [3, 4, 5]], "stream": True,
                                              "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
    last = {e["index"]: e for e in streamed}
    assert set(last) == {0, 1} and all(e["text"] == " t00 t01" for e in last.values())
    status, stopped = call(
        emulator, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 9, "stop": " t03"}}
    )
    assert stopped["text"] == " t00 t01 t02" and stopped["meta_info"]["finish_reason"] == {
        "type": "stop",
        "matched": " t03",
    }


def test_completions_batches_n_and_stop(emulator: Server) -> None:
    status, out = call(emulator, "/v1/completions", {"prompt": ["one", "two two two"], "n": 2, "max_tokens": 2})
    assert status == 200 and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == 1 + 3 and out["usage"]["completion_tokens"] == 8
    status, out = call(emulator, "/v1/completions", {"prompt": "x", "max_tokens": 10, "stop": ["t02", "zz"]})
    assert out["choices"][0]["text"] == " t00 t01 " and out["choices"][0]["finish_reason"] == "stop"
    streamed = events(emulator, "/v1/completions", {"prompt": "x", "max_tokens": 10, "stop": " t02", "stream": True})
    assert "".join(e["choices"][0]["text"] for e in streamed) == " t00 t01"


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/v1/completions", {"prompt": "x", "logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "logprobs": 0}, "logprobs"),  # 0 asks for the chosen token's
        ("/v1/completions", {"prompt": "x", "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/generate", {"text": "x", "return_logprob": True}, "return_logprob"),
        ("/generate", {"text": "x", "sampling_params": {"n": 2}}, "sampling_params.n"),
        ("/generate", {"text": "x", "sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        ("/generate", {"text": "x", "input_ids": [1]}, "input_ids"),
        ("/generate", {"text": [1, 2]}, "text"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": "a"}]}, "messages[0].name"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 3},
            "max_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions"),
    ],
)
def test_unsupported_parameters_are_refused_by_name(
    emulator: Server, path: str, payload: dict[str, Any], param: str
) -> None:
    status, err = call(emulator, path, payload)
    assert status == 400 and err["error"]["param"] == param and param in err["error"]["message"], err


def test_sampling_parameters_are_accepted(emulator: Server) -> None:
    # What clients send by default (bench_serving: best_of, temperature, ignore_eos) is answered.
    status, _ = call(emulator, "/v1/completions", {"prompt": "x", "best_of": 1, "temperature": 0.0, "ignore_eos": True,
                                                   "top_p": 0.9, "seed": 3, "logprobs": None})  # fmt: skip
    assert status == 200
    status, _ = call(emulator, "/generate", {"text": "x", "return_logprob": False, "logprob_start_len": -1, "lora_path": None,
                                             "sampling_params": {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 1}})  # fmt: skip
    assert status == 200


def test_the_openai_client(emulator: Server) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{emulator.port}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["flatcake-emulator"]
    chunks = list(
        client.completions.create(model="flatcake-emulator", prompt="a prompt as text", max_tokens=3, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == " t00 t01 t02"
    batch = client.completions.create(model="m", prompt=["a", "b"], n=2, max_tokens=1)
    assert len(batch.choices) == 4 and batch.usage is not None and batch.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="m", prompt="x", logprobs=2)
    ids = prompt_tokens(TraceRequest(0, 300, 1, (9,)))
    for text in (False, True):  # the load generator's requests, as ids and as text, parse the same
        req = body("openai", ids, 2, text=text)
        raw = [f"data: {json.dumps(e)}".encode() for e in events(emulator, "/v1/completions", req)]
        ttft, chunks_seen, usage = read_stream("openai", iter(raw), 0.0)
        assert ttft is not None and chunks_seen == 2 and usage["output"] == 2


def test_the_load_generators_chat_requests(emulator: Server) -> None:
    """``loadgen run --api chat``: the trace prompt as one user message; two requests sharing a trace
    prefix share a cached page through the chat template."""
    first, second = (prompt_tokens(TraceRequest(0, 700, 1, ids)) for ids in ((11, 12), (11, 13)))
    assert first[:512] == second[:512] and first != second
    seen = []
    for ids in (first, second):
        req = body("chat", ids, 2)
        assert path("chat") == "/v1/chat/completions" and req["messages"][0]["content"] == tokens.decode(ids)
        raw = [f"data: {json.dumps(e)}".encode() for e in events(emulator, path("chat"), req)]
        ttft, chunks_seen, usage = read_stream("chat", iter(raw), 0.0)
        assert ttft is not None and chunks_seen == 2 and usage["output"] == 2
        seen.append(usage["cached"])
    assert seen[1] >= 256  # the shared 512 trace tokens hold at least one whole page after the template


def test_the_chat_template_makes_a_conversation_a_growing_prefix() -> None:
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_prompt(turn1) == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    turn2 = [*turn1, {"role": "assistant", "content": [{"type": "text", "text": " t00"}, {"type": "text", "text": " t01"}]},
             {"role": "user", "content": "More"}]  # fmt: skip
    p1, p2 = chat_prompt(turn1), chat_prompt(turn2)
    assert p2.startswith(p1) and p2[len(p1) :].startswith(" t00 t01<|end|>")
    assert tokens.encode(p2)[: len(p1) // 4] == tokens.encode(p1)[: len(p1) // 4]  # the ids share the prefix too


def test_chat_completions(emulator: Server) -> None:
    system = [{"role": "system", "content": "You are an emulator. " * 60}]  # ~1,300 characters: 1 full page
    first = call(emulator, "/v1/chat/completions", {"messages": [*system, {"role": "user", "content": "a"}],
                                                    "max_completion_tokens": 2})[1]  # fmt: skip
    assert first["object"] == "chat.completion" and first["choices"][0]["message"] == {"role": "assistant",
                                                                                    "content": " t00 t01"}  # fmt: skip
    assert first["choices"][0]["finish_reason"] == "length"
    prompt = chat_prompt([*system, {"role": "user", "content": "a"}])
    assert first["usage"]["prompt_tokens"] == tokens.count(prompt) and first["usage"]["completion_tokens"] == 2
    # The next turn carries the whole first one: its first page is found in the cache.
    convo = [
        *system,
        {"role": "user", "content": "a"},
        first["choices"][0]["message"],
        {"role": "user", "content": "b"},
    ]
    plain = events(emulator, "/v1/chat/completions", {"messages": convo, "max_tokens": 3, "stream": True, "n": 2})
    assert all(e["object"] == "chat.completion.chunk" and e["choices"] for e in plain) and not any(
        "usage" in e for e in plain
    )
    assert plain[0]["choices"][0]["delta"]["role"] == "assistant" and len(plain[0]["choices"]) == 2
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in plain) == " t00 t01 t02"
    assert plain[-1]["choices"][1]["finish_reason"] == "length"
    asked = events(emulator, "/v1/chat/completions", {"messages": convo, "stop": " t01", "stream": True,
                                                      "stream_options": {"include_usage": True}})  # fmt: skip
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 2  # the stop string was generated
    assert asked[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 256
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in asked[:-1]) == " t00"
    assert asked[-2]["choices"][0]["finish_reason"] == "stop"


def test_the_openai_client_chat(emulator: Server) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{emulator.port}/v1", api_key="unused")
    messages: list[Any] = [{"role": "user", "content": "tell me " * 200}]
    reply = client.chat.completions.create(model="flatcake-emulator", messages=messages, max_completion_tokens=3)
    assert reply.choices[0].message.content == " t00 t01 t02" and reply.usage is not None
    assert reply.usage.prompt_tokens == tokens.count(chat_prompt(messages))
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " t00 t01"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 2
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 256
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="m", messages=messages,
                                       tools=[{"type": "function", "function": {"name": "f"}}])  # fmt: skip


@pytest.mark.parametrize("backend", ["sglang", "sglang-oai", "vllm", "sglang-oai-chat", "vllm-chat"])
def test_sglang_bench_serving(emulator: Server, backend: str, tmp_path: Path) -> None:
    """SGLang's own benchmark client, offline: random token ids decoded by a local tokenizer that
    follows the emulator's rule, so its prompt lengths are the emulator's."""
    assert importlib.util.find_spec("sglang") is not None, (
        "SGLang is not installed: pip install -r requirements/sglang.txt (bin/test installs it with "
        "FLATCAKE_EXTRAS='sglang peers')"
    )
    tokenizer = bench_serving.make_tokenizer(tmp_path / "tokenizer")
    result = tmp_path / "result.jsonl"
    cmd = [sys.executable, bench_serving.__file__, "--backend", backend, "--base-url", f"http://127.0.0.1:{emulator.port}",
           "--tokenizer", str(tokenizer), "--dataset-name", "random-ids", "--num-prompts", "4",
           "--random-input-len", "300", "--random-output-len", "3", "--random-range-ratio", "1.0",
           "--request-rate", "inf", "--ready-check-timeout-sec", "10", "--disable-tqdm", "--flush-cache",
           "--output-file", str(result), "--seed", "1"]  # fmt: skip
    if backend.startswith("sglang"):  # SGLang's sglext cached_tokens_details
        cmd.append("--cache-report")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(result.read_text().splitlines()[-1])
    assert out["completed"] == 4 and out["total_input_tokens"] == 4 * 300, out
    assert out["total_output_tokens"] == 4 * 3 and out["mean_ttft_ms"] > 0


def test_a_flush_waits_for_write_backs_in_flight(tmp_path: Path) -> None:
    """Under load a write-back can still be running when the response has gone; its pages stay pinned in
    HBM until stored. A flush waits for it, so the next request starts cold (issue 29: failed on a busy
    machine with device == 512 after the flush)."""
    import threading

    from flatcake.loadgen.emulator.server import EMULATOR

    server = Server(EmulatorConfig(data_dir=str(tmp_path), ssd_bytes=64 << 20, scope_file_bytes=4 << 20,
                                   decode_tokens_per_s=2000.0))  # fmt: skip
    try:
        emu = server.runner.app[EMULATOR]
        gate, stored = threading.Event(), threading.Event()
        store = emu.storage.store

        def slow_store(*args: Any) -> Any:
            assert gate.wait(30)
            placed = store(*args)
            stored.set()
            return placed

        emu.storage.store = slow_store  # type: ignore[method-assign]
        prompt = list(range(600))
        call(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})
        assert not stored.is_set()  # answered; its write-back is held at the gate
        flushed: list[Any] = []
        t = threading.Thread(target=lambda: flushed.append(call(server, "/flush_cache", {})))
        t.start()
        t.join(0.5)
        assert not flushed, "the flush returned while a write-back was still running"
        gate.set()
        t.join(30)
        assert flushed and flushed[0][0] == 200 and stored.is_set()
        cold = call(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})[1]
        assert cold["meta_info"]["cached_tokens_details"]["device"] == 0
    finally:
        gate.set()
        server.stop()


def test_a_flush_is_refused_when_requests_arrived_while_it_waited(tmp_path: Path) -> None:
    """A flush waiting for a write-back checks again for requests before it drops anything: one admitted
    meanwhile (its prefix found in HBM) is still running, so the flush is refused, as SGLang refuses it
    (issue 45: before, it dropped HBM under the running request)."""
    import threading

    from flatcake.loadgen.emulator.server import EMULATOR, HTTP

    server = Server(EmulatorConfig(data_dir=str(tmp_path), ssd_bytes=64 << 20, scope_file_bytes=4 << 20,
                                   decode_tokens_per_s=200.0))  # fmt: skip
    gate = threading.Event()
    try:
        emu = server.runner.app[EMULATOR]
        store = emu.storage.store

        def held_store(*args: Any) -> Any:
            assert gate.wait(30)
            return store(*args)

        emu.storage.store = held_store  # type: ignore[method-assign]
        prompt = list(range(600))
        call(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}})
        flushed: list[Any] = []
        t = threading.Thread(target=lambda: flushed.append(call(server, "/flush_cache", {})))
        t.start()
        wait_until(lambda: bool(emu._writes), what="the write-back to be held")
        later: list[Any] = []
        r = threading.Thread(target=lambda: later.append(call(server, "/generate", {
            "input_ids": prompt + [7] * 300, "sampling_params": {"max_new_tokens": 200}})))  # fmt: skip
        r.start()
        wait_until(lambda: server.runner.app[HTTP].inflight > 0, what="a request admitted during the flush")
        gate.set()
        t.join(30)
        assert flushed and flushed[0][0] == 400, flushed
        r.join(60)
        assert later and later[0][1]["meta_info"]["cached_tokens_details"]["device"] >= 512  # its prefix held
    finally:
        gate.set()
        server.stop()
