"""``flatcake emulate``'s HTTP face: the OpenAI and SGLang endpoints over one ``Emulator``
(loadgen/emulator/core.py says what is real and what is modelled)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

import flatcake
from flatcake.errors import ConfigError
from flatcake.loadgen import tokens
from flatcake.loadgen.emulator import params as P
from flatcake.loadgen.emulator.config import EmulatorConfig, MiB
from flatcake.loadgen.emulator.core import Emulator, Outcome

log = logging.getLogger(__name__)

EMULATOR: web.AppKey[Emulator] = web.AppKey("emulator")


# ---- HTTP ----------------------------------------------------------------------------------------
# The OpenAI and SGLang endpoints; what each accepts, and the 400 naming what it does not, is
# loadgen/emulator/params.py. The output is synthetic: token i is the 4 characters " tNN" (NN = i mod
# 100), one token under the tokenization rule.
MODEL_NAME = "flatcake-emulator"
HTTP: web.AppKey[_Http] = web.AppKey("http")


@dataclass
class _Http:
    """The HTTP side's own state: requests being answered (``/flush_cache`` refuses while any are)."""

    inflight: int = 0


def output_token(i: int) -> str:
    """The ``i``-th synthetic output token: 4 characters, so one token under the tokenization rule."""
    return f" t{i % 100:02d}"


@dataclass
class _Event:
    """One prompt's generation step: new text (every choice of the prompt has the same), the tokens so
    far, and the finish reason on its last step (``length``, or ``stop`` with the stop string)."""

    prompt: int
    outcome: Outcome
    delta: str
    tokens: int
    finish: str | None = None
    matched: str | None = None


class _Cut:
    """The synthetic output cut at a stop string (its text excluded, as OpenAI and SGLang do) or at the
    token limit; text that may still begin a stop string is held back until it cannot."""

    def __init__(self, limit: int, stops: list[str]) -> None:
        self.limit, self.stops = limit, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text, self.sent, self.tokens = "", 0, 0
        self.finish: str | None = None
        self.matched: str | None = None

    def step(self) -> str:
        """Generate one token; returns the text that may be sent now."""
        self.text += output_token(self.tokens)
        self.tokens += 1
        hits = [(self.text.find(s), s) for s in self.stops if s in self.text]
        if hits:
            at, self.matched = min(hits)
            self.finish, end = "stop", at
        elif self.tokens >= self.limit:
            self.finish, end = "length", len(self.text)
        else:
            end = max(self.sent, len(self.text) - self.hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta


async def _run_prompt(
    emu: Emulator, index: int, prompt: list[int], limit: int, stops: list[str], queue: asyncio.Queue[Any]
) -> None:
    """Prefill one prompt, then decode it: the first token at once, then one per decode step."""
    try:
        out = await emu.prefill(prompt)
        cut = _Cut(limit, stops)
        delta = cut.step()
        queue.put_nowait(_Event(index, out, delta, cut.tokens, cut.finish, cut.matched))
        if cut.finish is None:
            async for _ in emu.decode(limit - 1):
                delta = cut.step()
                if delta or cut.finish:
                    queue.put_nowait(_Event(index, out, delta, cut.tokens, cut.finish, cut.matched))
                if cut.finish:
                    break
    except Exception as exc:  # the handler re-raises it: a prompt's failure fails the request
        queue.put_nowait(exc)


async def _events(emu: Emulator, prompts: list[list[int]], limit: int, stops: list[str]) -> AsyncIterator[_Event]:
    """Every prompt's steps as they happen (the prompts run concurrently, each through the emulator's
    scheduler, as a serving engine runs a batch's prompts)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    tasks = [asyncio.create_task(_run_prompt(emu, i, p, limit, stops, queue)) for i, p in enumerate(prompts)]
    try:
        left = len(prompts)
        while left:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            left -= item.finish is not None
            yield item
    finally:
        for t in tasks:
            t.cancel()


def _hits(emu: Emulator, outs: Sequence[Outcome]) -> dict[str, int]:
    pt = emu.cfg.page_tokens
    return {m: sum(o.hit_pages[m] for o in outs) * pt for m in ("hbm", "dram", "ssd")}


def _details(emu: Emulator, outs: Sequence[Outcome]) -> dict[str, int]:
    """SGLang's ``cached_tokens_details``: device (HBM), host (DRAM) and storage (SSD) tokens."""
    hits = _hits(emu, outs)
    return {"device": hits["hbm"], "host": hits["dram"], "storage": hits["ssd"]}


def _usage(emu: Emulator, outs: Sequence[Outcome], completion: int) -> dict[str, Any]:
    pt = emu.cfg.page_tokens
    prompt = sum(o.prompt_tokens for o in outs)
    queues = [o.queue for o in outs]
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o.cached_tokens(pt) for o in outs)},
        "flatcake": {"hit_tokens": _hits(emu, outs), "declined_tokens": sum(o.declined_pages for o in outs) * pt,
                     "queue": queues[0] if len(queues) == 1 else queues, "system": emu.cfg.mode},
    }  # fmt: skip


@contextlib.asynccontextmanager
async def _answering(request: web.Request) -> AsyncIterator[Emulator]:
    state = request.app[HTTP]
    state.inflight += 1
    try:
        yield request.app[EMULATOR]
    finally:
        state.inflight -= 1


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def _stream_response(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


@dataclass
class _Answer:
    """Every prompt's result once all have finished, in prompt order."""

    outs: list[Outcome]
    texts: list[str]
    done: list[_Event]


async def _answer(
    emu: Emulator, prompts: list[list[int]], limit: int, stops: list[str],
    write: Callable[[_Event, str], Awaitable[None]] | None = None,
) -> _Answer:  # fmt: skip
    """Run the prompts; ``write`` (streaming) gets each event with its prompt's text so far. The one
    loop behind ``/v1/completions``, ``/v1/chat/completions`` and ``/generate``."""
    outs: dict[int, Outcome] = {}
    texts = [""] * len(prompts)
    done: dict[int, _Event] = {}
    async for ev in _events(emu, prompts, limit, stops):
        outs[ev.prompt] = ev.outcome
        texts[ev.prompt] += ev.delta
        if ev.finish is not None:
            done[ev.prompt] = ev
        if write is not None:
            await write(ev, texts[ev.prompt])
    order = range(len(prompts))
    return _Answer([outs[i] for i in order], texts, [done[i] for i in order])


async def _end_stream(resp: web.StreamResponse) -> web.StreamResponse:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _stream_usage(body: dict[str, Any], stream: bool) -> bool:
    """OpenAI's ``stream_options``: allowed only with ``stream``; whether ``include_usage`` asks for the
    final usage chunk (``choices: []``)."""
    options = P.nested(body, "stream_options")
    if options and not stream:
        raise P.bad_request("stream_options: only allowed when stream is true", "stream_options")
    P.check_params(options, frozenset({"include_usage"}), {}, "stream_options.")
    return P.flag(options, "include_usage")


@dataclass(frozen=True)
class _OpenAIOptions:
    """What both OpenAI endpoints take alike, parsed and checked once."""

    n: int
    stops: list[str]
    stream: bool
    include_usage: bool
    details: bool  # SGLang's return_cached_tokens_details
    model: str


def _openai_options(body: dict[str, Any]) -> _OpenAIOptions:
    stream = P.flag(body, "stream")
    return _OpenAIOptions(
        n=P.bounded_int(body.get("n"), "n", 1, P.MAX_N),
        stops=P.stops(body.get("stop"), "stop"),
        stream=stream,
        include_usage=_stream_usage(body, stream),
        details=P.flag(body, "return_cached_tokens_details"),
        model=str(body.get("model") or MODEL_NAME),
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI ``POST /v1/completions``: text or token-id prompts, batches, ``n``, ``stop``, ``stream``
    (the usage chunk with ``choices: []`` only when ``stream_options.include_usage`` asks for it)."""
    body = await P.body_of(request)
    P.check_params(body, P.OAI_SERVED, P.OAI_OFF)
    prompts, _ = P.prompts(body.get("prompt"), "prompt")
    limit = P.bounded_int(body.get("max_tokens"), "max_tokens", 16, 65536)
    opts = _openai_options(body)
    n, stops, details = opts.n, opts.stops, opts.details
    if body.get("best_of") is not None and P.bounded_int(body["best_of"], "best_of", 1, P.MAX_N) != n:
        raise P.bad_request("best_of: only best_of = n is served (the emulator does not rank choices)", "best_of")
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": cid, "object": "text_completion", "created": created, "model": opts.model, "choices": choices,
                **extra}  # fmt: skip

    async with _answering(request) as emu:
        if not opts.stream:
            got = await _answer(emu, prompts, limit, stops)
            choices = [{"index": i * n + j, "text": got.texts[i], "logprobs": None, "finish_reason": ev.finish}
                       for i, ev in enumerate(got.done) for j in range(n)]  # fmt: skip
            usage = _usage(emu, got.outs, n * sum(ev.tokens for ev in got.done))
            return web.json_response(chunk(choices, usage=usage, **_sglext(emu, got.outs, details)))
        resp = await _stream_response(request)

        async def write(ev: _Event, _: str) -> None:
            choices = [{"index": ev.prompt * n + j, "text": ev.delta, "logprobs": None,
                        "finish_reason": ev.finish} for j in range(n)]  # fmt: skip
            await resp.write(_sse(chunk(choices, **(_sglext(emu, [ev.outcome], details) if ev.finish else {}))))

        got = await _answer(emu, prompts, limit, stops, write)
        if opts.include_usage:
            await resp.write(_sse(chunk([], usage=_usage(emu, got.outs, n * sum(ev.tokens for ev in got.done)))))
        return await _end_stream(resp)


def _sglext(emu: Emulator, outs: Sequence[Outcome], details: bool) -> dict[str, Any]:
    """SGLang's ``sglext`` extension, when ``return_cached_tokens_details`` asked for it."""
    return {"sglext": {"cached_tokens_details": _details(emu, outs)}} if details else {}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI ``POST /v1/chat/completions``: ``messages`` rendered by ``chat_prompt`` and tokenized by
    the shared rule; ``max_completion_tokens`` (or ``max_tokens``; default 128, SGLang's), ``n``,
    ``stop``, ``stream`` (``chat.completion.chunk`` deltas; the usage chunk only with
    ``stream_options.include_usage``)."""
    body = await P.body_of(request)
    P.check_params(body, P.CHAT_SERVED, P.CHAT_OFF)
    prompt = tokens.encode(P.chat_prompt(body.get("messages")))
    limits = {
        k: P.bounded_int(body.get(k), k, 128, 65536) for k in ("max_completion_tokens", "max_tokens") if k in body
    }
    if len(set(limits.values())) > 1:
        raise P.bad_request("max_tokens: differs from max_completion_tokens; give one of them", "max_tokens")
    limit = next(iter(limits.values()), 128)
    opts = _openai_options(body)
    n, stops, details = opts.n, opts.stops, opts.details
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def reply(kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": cid, "object": kind, "created": created, "model": opts.model, "choices": choices, **extra}

    async with _answering(request) as emu:
        if not opts.stream:
            got = await _answer(emu, [prompt], limit, stops)
            ev = got.done[0]
            choices = [{"index": j, "message": {"role": "assistant", "content": got.texts[0]}, "logprobs": None,
                        "finish_reason": ev.finish} for j in range(n)]  # fmt: skip
            usage = _usage(emu, got.outs, n * ev.tokens)
            return web.json_response(reply("chat.completion", choices, usage=usage,
                                           **_sglext(emu, got.outs, details)))  # fmt: skip
        resp = await _stream_response(request)
        first = True

        async def write(ev: _Event, _: str) -> None:
            nonlocal first
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if ev.delta or first:
                delta["content"] = ev.delta
            first = False
            choices = [{"index": j, "delta": delta, "logprobs": None, "finish_reason": ev.finish} for j in range(n)]
            extra = _sglext(emu, [ev.outcome], details) if ev.finish else {}
            await resp.write(_sse(reply("chat.completion.chunk", choices, **extra)))

        got = await _answer(emu, [prompt], limit, stops, write)
        if opts.include_usage:
            usage = _usage(emu, got.outs, n * got.done[0].tokens)
            await resp.write(_sse(reply("chat.completion.chunk", [], usage=usage)))
        return await _end_stream(resp)


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang ``POST /generate``: ``text`` or ``input_ids`` (one prompt or a batch), ``sampling_params``
    (``max_new_tokens``, ``stop``), ``stream`` (cumulative text per event, as SGLang streams)."""
    body = await P.body_of(request)
    P.check_params(body, P.GEN_SERVED, P.GEN_OFF)
    if ("text" in body) == ("input_ids" in body):
        raise P.bad_request("text or input_ids: give exactly one of them", "input_ids")
    name = "text" if "text" in body else "input_ids"
    if name == "text" and not (isinstance(body["text"], str) or _strings(body["text"])):
        raise P.bad_request("text: a string or a list of strings (token ids go in input_ids)", "text")
    if name == "input_ids" and (isinstance(body["input_ids"], str) or _strings(body["input_ids"])):
        raise P.bad_request("input_ids: token ids (list of int) or a list of them (text goes in text)", "input_ids")
    prompts, batched = P.prompts(body[name], name)
    sp = P.nested(body, "sampling_params")
    P.check_params(sp, P.SP_SERVED, P.SP_OFF, "sampling_params.")
    limit = P.bounded_int(sp.get("max_new_tokens"), "sampling_params.max_new_tokens", 128, 65536)
    stops = P.stops(sp.get("stop"), "sampling_params.stop")
    stream = P.flag(body, "stream")
    rids = body.get("rid")

    def result(ev: _Event, text: str) -> dict[str, Any]:
        rid = rids[ev.prompt] if isinstance(rids, list) and ev.prompt < len(rids) else rids
        u = _usage(emu, [ev.outcome], ev.tokens)
        finish = None
        if ev.finish == "length":
            finish = {"type": "length", "length": ev.tokens}
        elif ev.finish == "stop":
            finish = {"type": "stop", "matched": ev.matched}
        meta = {"id": str(rid) if rid is not None else f"{ev.prompt}-{cid}", "finish_reason": finish,
                "prompt_tokens": ev.outcome.prompt_tokens, "completion_tokens": ev.tokens,
                "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                "cached_tokens_details": _details(emu, [ev.outcome]), "flatcake": u["flatcake"]}  # fmt: skip
        out: dict[str, Any] = {"text": text, "meta_info": meta}
        if batched and stream:
            out["index"] = ev.prompt
        return out

    cid = uuid.uuid4().hex
    async with _answering(request) as emu:
        if not stream:
            got = await _answer(emu, prompts, limit, stops)
            results = [result(ev, got.texts[i]) for i, ev in enumerate(got.done)]
            return web.json_response(results if batched else results[0])
        resp = await _stream_response(request)

        async def write(ev: _Event, text: str) -> None:
            await resp.write(_sse(result(ev, text)))

        await _answer(emu, prompts, limit, stops, write)
        return await _end_stream(resp)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


async def models(request: web.Request) -> web.Response:
    """OpenAI ``GET /v1/models``: the one model served (any ``model`` in a request is answered)."""
    cfg = request.app[EMULATOR].cfg
    name = cfg.model or MODEL_NAME
    return web.json_response({"object": "list", "data": [
        {"id": name, "object": "model", "created": int(time.time()), "owned_by": "flatcake", "root": name},
    ]})  # fmt: skip


async def model_info(request: web.Request) -> web.Response:
    """SGLang ``GET /get_model_info`` (and ``/model_info``). No tokenizer ships: text is tokenized by
    the 4-characters rule, so ``tokenizer_path`` is null and clients that need one bring their own."""
    cfg = request.app[EMULATOR].cfg
    return web.json_response({"model_path": cfg.model or MODEL_NAME, "tokenizer_path": None, "is_generation": True,
                              "preferred_sampling_params": None, "weight_version": "default",
                              "has_image_understanding": False, "has_audio_understanding": False,
                              "model_type": None, "architectures": None,
                              "tokenization": f"{tokens.CHARS_PER_TOKEN} characters per token"})  # fmt: skip


async def server_info(request: web.Request) -> web.Response:
    """SGLang ``GET /server_info``: the emulator's configuration (bench_serving records it)."""
    cfg = request.app[EMULATOR].cfg
    return web.json_response({"flatcake_emulator": dataclasses.asdict(cfg), "internal_states": [{}],
                              "version": flatcake.__version__})  # fmt: skip


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang ``/flush_cache`` (vLLM: ``/reset_prefix_cache``): empties HBM's prefix cache, not the
    storage under test. Refused while requests are being answered, as SGLang refuses."""
    refused = web.Response(status=400, text="Cache not flushed. (When there are running or waiting requests, "
                                            "the operation will not be performed.)\n")  # fmt: skip
    if request.app[HTTP].inflight:
        return refused
    pages = await request.app[EMULATOR].flush_hbm(lambda: bool(request.app[HTTP].inflight))
    if pages is None:  # requests arrived while it waited for write-backs
        return refused
    return web.Response(text=f"Cache flushed. ({pages} HBM pages dropped; the storage under test keeps its pages)\n")


async def metrics_handler(request: web.Request) -> web.Response:
    emu: Emulator = request.app[EMULATOR]
    return web.Response(body=generate_latest(emu.registry), content_type="text/plain", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


def make_app(cfg: EmulatorConfig, emulator: Emulator | None = None) -> web.Application:
    """The HTTP app. ``emulator``: one already made (``serve`` makes it after binding); else the app
    makes its own at startup."""
    app = web.Application(client_max_size=64 * MiB)
    app[HTTP] = _Http()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/generate", generate)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/flush_cache", "/reset_prefix_cache"):
        app.router.add_post(path, flush_cache)
    app.router.add_get("/flush_cache", flush_cache)
    app.router.add_get("/metrics", metrics_handler)
    for path in ("/health", "/healthz", "/health_generate"):
        app.router.add_get(path, health)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        app[EMULATOR] = emulator if emulator is not None else Emulator(cfg)
        await app[EMULATOR].start()
        yield
        await app[EMULATOR].stop()

    app.cleanup_ctx.append(lifecycle)
    return app


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any pool is made: a bad address costs nothing."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port: {port} is not a TCP port (0..65535; 0 picks a free one)")
    if not host or "/" in host:  # a URL (the load generator's --host takes one) or nothing
        raise ConfigError(f"--host: {host!r} is not an address to listen on; expected an IP address or a name, "
                          "without scheme or port (e.g. 127.0.0.1, ::1, or 0.0.0.0 for every interface)")  # fmt: skip
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError):
        raise ConfigError(
            f"--host: {host!r} is neither an IP address nor a name this machine resolves "
            "(e.g. 127.0.0.1, ::1, or 0.0.0.0 for every interface)"
        ) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port} ({exc.strerror}); pick another "
                          "port (0 picks a free one) or stop what holds it") from None  # fmt: skip
    return sock


def create(cfg: EmulatorConfig) -> Emulator:
    """The emulator and its pools; if making them fails, the directories this call created go too
    (a failed start leaves no pool files behind)."""
    root = Path(cfg.data_dir)
    made = next((d for d in (root, root / cfg.mode) if not d.exists()), None)
    try:
        return Emulator(cfg)
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise


def serve(cfg: EmulatorConfig, host: str, port: int) -> None:
    """Bind, then make the pools, then serve until interrupted."""
    sock = bind(host, port)
    if host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
        log.warning("emulator listening on %s", host)
    try:
        emulator = create(cfg)
    except BaseException:
        sock.close()
        raise
    web.run_app(make_app(cfg, emulator), sock=sock, print=lambda m: log.info("%s", m))
