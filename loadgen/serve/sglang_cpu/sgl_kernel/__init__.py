"""A pure-torch stand-in for the ``sgl_kernel`` names SGLang 0.5.23 imports on the CPU.

PyPI's ``sgl-kernel`` / ``sglang-kernel`` wheels hold CUDA builds only; their CPU ops (``csrc/cpu``)
exist only as a source build. SGLang imports these names at module level under ``if _is_cpu:``
(``mem_cache/allocation.py``, ``kernels/ops/kvcache/cache_move.py``, ``kernels/ops/speculative/*``).
The two that a plain (non-speculative) server calls are written here in torch; the speculative-decoding
ones raise when called. Anything else is absent, so SGLang's own ``try: ... except ImportError`` fallbacks
still take their fallback. ``sgl_kernel.kvcacheio`` holds HiCache's host<->device copies.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

__version__ = "0.0.0+sglang_cpu"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[b], start[b]:end[b]] = out_cache_loc[<b's run>]``, runs back to back
    (the Triton ``assign_req_to_token_pool`` in ``mem_cache/allocation.py``)."""
    at = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[row, start:end] = out_cache_loc[at : at + end - start].to(req_to_token.dtype)
        at += end - start


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer (base address, bytes per slot): slot ``tgt_loc[i]`` := slot ``src_loc[i]``
    (the Triton ``copy_all_layer_kv_cache_tiled``); all sources are read before any target is written."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist(), strict=True))
    for base, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = [ctypes.string_at(base + src * stride, stride) for _, src in pairs]
        for (tgt, _), row in zip(pairs, rows, strict=True):
            ctypes.memmove(base + tgt * stride, row, stride)


def _unsupported(name: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name}: speculative decoding is not supported by the CPU stand-in "
            "(loadgen/serve/sglang_cpu/sgl_kernel)"
        )

    call.__name__ = name
    return call


assign_draft_cache_locs_contiguous_cpu = _unsupported("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _unsupported("assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = _unsupported("build_tree_kernel_efficient_cpu")
fill_accept_out_cache_loc_cpu = _unsupported("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _unsupported("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _unsupported("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _unsupported("verify_tree_greedy_cpu")
