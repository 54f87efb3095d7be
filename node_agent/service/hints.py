"""Placement hints a serving engine's connector passes with a put: Table 2's fields as the key chain
derives them (``policy/signals.py``), then what the deployment sets for every request, then what the
request itself passes (SGLang's ``extra_info.extra_info``, vLLM's ``kv_transfer_params``). Shared by the
SGLang backend and the vLLM connector."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

from flatcake.errors import ConfigError
from flatcake.node_agent.policy.placement import Hints, Key
from flatcake.node_agent.policy.signals import Run

HINT_FIELDS = ("prefix_refcount", "turn", "prev_reply_tokens", "context_tokens", "reply_tokens")
# What a request may pass: Table 2's fields, and ``expected_reuse`` (how many requests will read the
# pages: a floor on ``prefix_refcount``, so the shared-prompt rule can fire before SGLang shows it).
REQUEST_FIELDS = (*HINT_FIELDS, "expected_reuse")
# What a deployment may set for every request: only what a key chain cannot tell.
DEPLOYMENT_FIELDS = ("reply_tokens", "expected_reuse")
HINTS_ENV = "FLATCAKE_SGLANG_HINTS"  # read by both connectors (the name is older than vLLM's)


TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def tenant_suffix(extra: dict[str, Any]) -> str:
    """What a deployment's ``tenant`` (storage extra config) adds to every page key: pages of two tenants
    never share a key, even for one prompt (the engines' own ``cache_salt`` already seeds their hashes;
    this separates deployments that set none). The webhook sets it to the pod's namespace."""
    tenant = extra.get("tenant")
    if tenant is None or tenant == "":
        return ""
    if not isinstance(tenant, str) or not TENANT.fullmatch(tenant):
        raise ConfigError(f"tenant: {tenant!r} must be 1-63 letters, digits, '.', '_' or '-' (a namespace name "
                          "fits)")  # fmt: skip
    return f"@t:{tenant}"


def deployment_hints(extra: dict[str, Any]) -> dict[str, int]:
    """``placement_hints`` from the storage extra config, overridden field by field by the JSON object in
    ``$FLATCAKE_SGLANG_HINTS`` (for deployments that cannot change SGLang's launch arguments)."""
    merged: dict[str, Any] = {}
    sources: list[tuple[str, Any]] = [("placement_hints", extra.get("placement_hints") or {})]
    if os.environ.get(HINTS_ENV):
        try:
            sources.append((HINTS_ENV, json.loads(os.environ[HINTS_ENV])))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{HINTS_ENV}: not JSON ({exc}); set it to an object like "
                              '{"reply_tokens": 4096}') from None  # fmt: skip
    for where, given in sources:
        if not isinstance(given, dict):
            raise ConfigError(f'{where}: {given!r} must be an object like {{"reply_tokens": 4096}}')
        unknown = sorted(set(given) - set(DEPLOYMENT_FIELDS))
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {unknown}; a deployment sets only {list(DEPLOYMENT_FIELDS)} "
                              "(the rest is derived from the serving engine's key chain)")  # fmt: skip
        for k, v in given.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{where}.{k}: {v!r} must be a non-negative integer")
        merged.update(given)
    return merged


def run_hints(run: Run, defaults: Mapping[str, Any], passed: Mapping[str, Any],
              namer: Callable[[Key], Key] = lambda k: k, where: str = "request") -> Hints:  # fmt: skip
    """Table 2's hints for one run: derived fields, then the deployment's ``defaults``, then the request's
    ``passed`` fields (REQUEST_FIELDS; others are ignored). ``namer`` turns the chain's parent key into
    the stored name. A request's bad value is its data, not a bug: a ``ConfigError`` naming ``where``."""
    fields: dict[str, Any] = {k: v for k, v in run.fields.items() if k != "parent_key"}
    parent = run.fields.get("parent_key")
    fields["parent_key"] = namer(parent) if parent is not None else None
    given = {**defaults, **{k: passed[k] for k in REQUEST_FIELDS if k in passed}}
    reuse = given.pop("expected_reuse", None)
    fields.update(given)
    if reuse is not None:
        if not isinstance(reuse, int) or isinstance(reuse, bool):
            raise ConfigError(f"{where}.expected_reuse: {reuse!r} must be a non-negative integer")
        fields["prefix_refcount"] = max(int(fields.get("prefix_refcount", 1)), reuse)
    try:
        return Hints.from_dict(fields)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
