"""HiCache's host<->device KV copies for ``--hicache-io-backend direct``, in torch indexing.

The names and signatures of ``sgl_kernel.kvcacheio`` (sglang-kernel 0.4.x). On the CPU the "device"
pool is host memory too, so these are plain gathers and scatters. Pages are ``page_size`` consecutive
slots; indices arrive one per token, page-aligned. MHA passes K and V tensors (``[k..., v...]``), MLA one.

- ``transfer_kv_direct``: layer-first on both sides, any list of per-layer tensors.
- ``transfer_kv_per_layer_direct_pf_lf``: one layer, from the ``page_first_direct`` host pool
  (``[pages, layers, page_size, heads, head_dim]``) to the device pool's per-layer tensors.
- ``transfer_kv_all_layer_direct_lf_pf``: every layer, device pool -> ``page_first_direct`` host pool.
"""

from __future__ import annotations

import torch


def _pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    return indices[::page_size].to(torch.int64)


def _tokens(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    starts = _pages(indices, page_size)
    return (starts[:, None] + torch.arange(page_size, dtype=torch.int64)).reshape(-1)


def transfer_kv_direct(
    src_layers: list[torch.Tensor],
    dst_layers: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    if len(src_layers) != len(dst_layers) or src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_direct: mismatched layers or indices")
    if src_indices.numel() == 0:
        return
    src_idx, dst_idx = src_indices.to(torch.int64).cpu(), dst_indices.to(torch.int64).cpu()
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst.index_copy_(0, dst_idx.to(dst.device), src.index_select(0, src_idx.to(src.device)).to(dst.dtype))


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_per_layer_direct_pf_lf: mismatched indices")
    if src_indices.numel() == 0:
        return
    mla = len(src_ptrs) == 1
    layers = len(dst_ptrs) if mla else len(dst_ptrs) // 2
    src_pages = _pages(src_indices.cpu(), page_size) // page_size
    dst_tokens = _tokens(dst_indices.cpu(), page_size)
    sources = [(0, 0)] if mla else [(0, 0), (1, layers)]
    for j in range(layers):
        for slot, offset in sources:
            src, dst = src_ptrs[slot], dst_ptrs[j + offset]
            values = src[:, layer_id + j].index_select(0, src_pages.to(src.device))
            values = values.reshape(-1, *values.shape[2:])
            dst.index_copy_(0, dst_tokens.to(dst.device), values.to(dst.dtype))


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: list[torch.Tensor],
    dst_ptrs: list[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError("transfer_kv_all_layer_direct_lf_pf: mismatched indices")
    if src_indices.numel() == 0:
        return
    mla = len(dst_ptrs) == 1
    layers = len(src_ptrs) if mla else len(src_ptrs) // 2
    src_tokens = _tokens(src_indices.cpu(), page_size)
    dst_pages = _pages(dst_indices.cpu(), page_size) // page_size
    targets = [(0, 0)] if mla else [(0, 0), (1, layers)]
    for j in range(layers):
        for slot, offset in targets:
            src, dst = src_ptrs[j + offset], dst_ptrs[slot]
            values = src.index_select(0, src_tokens.to(src.device))
            values = values.view(dst_pages.numel(), page_size, *src.shape[1:])
            dst[:, j].index_copy_(0, dst_pages.to(dst.device), values.to(dst.dtype))
