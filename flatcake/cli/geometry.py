"""``flatcake geometry``: a model's KV geometry from its config.json."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flatcake.cli.common import Subparsers


def _geometry(args: argparse.Namespace) -> int:
    from flatcake.node_agent import geometry

    g = geometry.load(args.config, tp=args.tp, page_tokens=args.page_tokens, kv_dtype=args.kv_dtype)
    # The serving engine must hold pages of this geometry: the flags it is started with.
    flags = f"--tp-size {args.tp} --page-size {g.page_tokens} --kv-cache-dtype {args.kv_dtype}"
    if args.json:
        print(json.dumps({**g.to_dict(), "sglang_flags": flags}, indent=1))
        return 0
    share = (
        "every rank holds the same KV"
        if g.replicated
        else (f"each of {args.tp} ranks' share" if args.tp > 1 else "one rank")
    )
    print(f"{g.model_type}: {g.attention.upper()}, {g.layers} layers, {g.bytes_per_token_layer} B per token and "
          f"layer ({share}); a {g.page_tokens}-token page is {g.raw_page_bytes} B per layer, "
          f"{g.page_bytes} B aligned")  # fmt: skip
    if g.copies > 1:
        heads = args.tp // g.copies
        print(f"  {args.tp} ranks over {heads} KV heads: each head's pages are stored by each of the {g.copies} "
              f"ranks holding it (keys carry the rank): size the cache for {g.copies}x the bytes")  # fmt: skip
    if g.sidecars:
        print(f"  the KV pool holds {g.layers} of {g.total_layers} layers; beside it (SGLang's v2 storage interface):")
    for s in g.sidecars:
        covers = f"{s.page_tokens}-token page" if s.page_tokens else "request state"
        print(f"  pool {s.name}: {s.layers} layers, {s.page_bytes} B per {covers}, stored as {s.chunks} cache "
              f"page(s); a hit needs its last {s.trailing_pages} page(s)")  # fmt: skip
    kv = g.kv()
    print(f"spec:\n  kv: {{layers: {kv['layers']}, pageBytes: {kv['pageBytes']}, pageTokens: {kv['pageTokens']}}}")
    print(f"  # or name the model: kv: {{model: {{config: <config.json>, tensorParallel: {args.tp}, "
          f"kvCacheDtype: {args.kv_dtype}}}, pageTokens: {g.page_tokens}}}")  # fmt: skip
    print(f"sglang: {flags}")
    return 0


def add(sub: Subparsers) -> None:
    """``flatcake geometry``: a FlatCakeCache's kv from a model's config.json."""
    geo = sub.add_parser("geometry", help="the kv geometry (layers, pageBytes, pageTokens) of a model's config.json")
    geo.add_argument("config", help="the model's config.json, or its directory")
    geo.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks serving it (SGLang's --tp-size)")
    geo.add_argument("--page-tokens", type=int, default=64, dest="page_tokens",
                     help="tokens per page (SGLang's --page-size)")  # fmt: skip
    geo.add_argument("--kv-dtype", default="auto", dest="kv_dtype",
                     help="SGLang's --kv-cache-dtype: auto (the model's torch_dtype), fp8_e4m3 ...")  # fmt: skip
    geo.add_argument("--json", action="store_true", help="print JSON")
    geo.set_defaults(func=_geometry)
