"""What ``flatcake emulate``'s endpoints accept, read from a request with a 400 that names the field
otherwise (the OpenAI error shape), and the chat template that turns messages into a prompt.

The OpenAI (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) and SGLang (``/generate``,
``/flush_cache``, ...) conventions that common clients rely on (``openai``, ``sglang.bench_serving``
with the sglang, sglang-oai, vllm and their -chat backends, Locust). Prompts are text or token ids;
text is tokenized by the rule in flatcake.loadgen.tokens (4 characters a token), which the load
generator shares. The output is synthetic: token i is the 4 characters " tNN" (NN = i mod 100), one
token under the same rule.

A parameter is served, accepted as a no-op (sampling parameters: they choose among a model's tokens,
and there is no model), or refused with a 400 that names it: never silently ignored.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from flatcake.loadgen import tokens

MAX_BATCH = 256  # prompts in one request
MAX_N = 128  # choices per prompt
MAX_STOPS = 4  # OpenAI's limit on stop strings

# Accepted and changing nothing: they shape sampling, and the output is synthetic.
SAMPLING = frozenset({"temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "ignore_eos", "logit_bias", "user"})  # fmt: skip
# Accepted only at their "off" value (a non-default value would ask for something not served).
OAI_OFF: dict[str, tuple[object, ...]] = {
    "logprobs": (None,), "echo": (None, False), "suffix": (None, ""), "lora_path": (None,), "image_data": (None,),
}  # fmt: skip
OAI_SERVED = frozenset({"model", "prompt", "max_tokens", "min_tokens", "stream", "stream_options", "n", "best_of",
                        "stop", "return_cached_tokens_details"})  # fmt: skip
# Chat: tools, structured output and logprobs ask for what a synthetic output cannot give.
CHAT_OFF: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, ()), "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}), "lora_path": (None,), "parallel_tool_calls": (None, True),
}  # fmt: skip
CHAT_SERVED = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "stream",
                         "stream_options", "n", "stop", "return_cached_tokens_details"})  # fmt: skip
GEN_OFF: dict[str, tuple[object, ...]] = {
    "return_logprob": (None, False), "top_logprobs_num": (None, 0), "token_ids_logprob": (None,),
    "lora_path": (None,), "return_routed_experts": (None, False), "return_hidden_states": (None, False),
    "image_data": (None,), "custom_logit_processor": (None,),
}  # fmt: skip
# logprob_start_len and return_text_in_logprobs only matter with return_logprob, which is refused.
GEN_SERVED = frozenset({"text", "input_ids", "sampling_params", "stream", "rid", "logprob_start_len",
                        "return_text_in_logprobs"})  # fmt: skip
SP_OFF: dict[str, tuple[object, ...]] = {
    "n": (None, 1), "stop_token_ids": (None, ()), "json_schema": (None,), "regex": (None,), "ebnf": (None,),
    "structural_tag": (None,),
}  # fmt: skip
SP_SERVED = frozenset({"max_new_tokens", "min_new_tokens", "stop", "skip_special_tokens",
                       "spaces_between_special_tokens", "no_stop_trim", "sampling_seed"})  # fmt: skip


def bad_request(message: str, param: str | None = None) -> web.HTTPBadRequest:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": None}
    return web.HTTPBadRequest(text=json.dumps({"error": error}), content_type="application/json")


def _same(value: object, allowed: tuple[object, ...]) -> bool:
    # Type-aware: 0 is not False (logprobs=0 asks for logprobs), () stands for any empty list.
    return any(
        value is a or (type(value) is type(a) and value == a) or (a == () and isinstance(value, list) and not value)
        for a in allowed
    )


def check_params(
    body: dict[str, Any], served: frozenset[str], off: dict[str, tuple[object, ...]], prefix: str = ""
) -> None:
    unknown = sorted(set(body) - served - SAMPLING - set(off))
    if unknown:
        names = ", ".join(prefix + u for u in unknown)
        raise bad_request(f"{names}: not supported by the emulator (docs/benchmarks.md lists what is)", unknown[0])
    for name, allowed in off.items():
        if name in body and not _same(body[name], allowed):
            shown = " or ".join("[]" if a == () else json.dumps(a) for a in allowed)
            raise bad_request(
                f"{prefix}{name}: {json.dumps(body[name])} is not supported by the emulator (its output is "
                f"synthetic); leave it unset or {shown}",
                prefix + name,
            )


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def prompts(value: Any, name: str) -> tuple[list[list[int]], bool]:
    """The token ids of each prompt, and whether the request was a batch. Text is tokenized by the
    shared rule (flatcake.loadgen.tokens)."""
    if isinstance(value, str):
        return [tokens.encode(value)], False
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            batch = [tokens.encode(v) for v in value]
        elif all(isinstance(v, list) for v in value):
            if not all(_token_ids(v) and v for v in value):
                raise bad_request(f"{name}: each prompt of a batch must be non-empty token ids (list of int)", name)
            batch = list(value)
        elif _token_ids(value):
            return [list(value)], False
        else:
            batch = []
        if batch:
            if len(batch) > MAX_BATCH:
                raise bad_request(f"{name}: {len(batch)} prompts; at most {MAX_BATCH} in one request", name)
            return batch, True
    raise bad_request(f"{name}: a string, a list of strings, token ids (list of int) or a list of token-id lists", name)


async def body_of(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError:
        raise bad_request("body is not JSON") from None
    if not isinstance(body, dict):
        raise bad_request("body must be an object")
    return body


def nested(body: dict[str, Any], name: str) -> dict[str, Any]:
    """An optional nested object (``stream_options``, ``sampling_params``): absent or null is empty."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request(f"{name}: an object, got {type(value).__name__}", name)
    return value


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name}: true or false, got {type(value).__name__}", name)
    return value


def bounded_int(value: Any, name: str, default: int, hi: int) -> int:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or value > hi:
        raise bad_request(f"{name}: an integer in 1..{hi}", name)
    return value


def stops(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise bad_request(f"{name}: a non-empty string or a list of at most {MAX_STOPS} of them", name)
    return stops


# The chat template: each message is ``<|ROLE|>\n`` + its text + ``<|end|>\n``, and the prompt ends with
# ``<|assistant|>\n`` (where the reply goes). A message's rendering depends on it alone, and the
# generation prompt is how the assistant's message begins, so turn k+1's prompt (turn k's messages, the
# reply, a new user message) starts with turn k's prompt: a growing conversation is a shared prefix,
# and under the 4-characters rule a shared token prefix (page keys follow it).
CHAT_ROLES = ("system", "user", "assistant")


def chat_prompt(messages: Any) -> str:
    """The prompt text of OpenAI chat ``messages`` (content: a string or a list of ``text`` parts,
    joined). Bad input is a 400 naming the message and field."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: an object with role and content", where)
        extra = sorted(set(m) - {"role", "content"})
        if extra:
            raise bad_request(f"{where}.{extra[0]}: not supported by the emulator (only role and content)",
                               f"{where}.{extra[0]}")  # fmt: skip
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"{where}.role: {json.dumps(role)} must be one of {', '.join(CHAT_ROLES)}",
                               f"{where}.role")  # fmt: skip
        out.append(f"<|{role}|>\n{_chat_text(m.get('content'), where + '.content')}<|end|>\n")
    return "".join(out) + "<|assistant|>\n"


def _chat_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                   f"supported, got {json.dumps(kind)}", f"{where}[{j}]")  # fmt: skip
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}: a string or a non-empty list of text parts", where)
