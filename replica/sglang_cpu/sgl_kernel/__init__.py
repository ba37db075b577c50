"""A CPU stand-in for SGLang's ``sgl_kernel`` package, for machines without its CPU build.

SGLang 0.5.23 on ``--device cpu`` imports exactly two symbols from ``sgl_kernel`` at module level
(``copy_all_layer_kv_cache_cpu`` in ``sglang/kernels/ops/kvcache/cache_move.py`` and
``assign_req_to_token_pool_cpu`` in ``sglang/srt/mem_cache/allocation.py``); on a CPU without AMX
every other kernel falls back to native torch ops. PyPI's ``sglang-kernel`` is CUDA-only, so this
module implements those two in plain torch (and ``ctypes`` for the raw-pointer copy).

A few more names are imported at module level on the CPU path by features this server never turns
on (speculative decoding's tree kernels): they resolve to stand-ins that raise when *called*, so the
import succeeds and any use fails loudly. Every other name fails at import (``AttributeError``, so
``from sgl_kernel import x`` raises ``ImportError`` and SGLang's own fallbacks take over).

Installed into the CPU SGLang environment by ``replica/build_sglang_cpu_env.sh``; never imported by
kvroute itself.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]
__version__ = "0.0.0+kvroute.cpu.shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For each request i, write the next ``end[i] - start[i]`` entries of ``out_cache_loc``
    (consumed in order) into ``req_to_token[req_pool_indices[i], start[i]:end[i]]``."""
    del pool_len  # the row width of req_to_token; torch checks bounds itself
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = int(end) - int(start)
        if n <= 0:
            continue
        req_to_token[int(row), int(start) : int(end)] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """For every KV buffer (raw data pointer ``data_ptrs[b]``, row stride ``strides[b]`` bytes),
    copy row ``src_loc[j]`` onto row ``tgt_loc[j]``, in order."""
    ptrs = [int(p) for p in data_ptrs.tolist()]
    row_bytes = [int(s) for s in strides.tolist()]
    tgt = [int(t) for t in tgt_loc.tolist()]
    src = [int(s) for s in src_loc.tolist()]
    for ptr, stride in zip(ptrs, row_bytes, strict=True):
        for t, s in zip(tgt, src, strict=True):
            if t != s:
                ctypes.memmove(ptr + t * stride, ptr + s * stride, stride)


# imported unconditionally on --device cpu, used only by features this server does not enable
_IMPORTED_NOT_USED = {
    "build_tree_kernel_efficient_cpu": "speculative decoding (tree build)",
    "verify_tree_greedy_cpu": "speculative decoding (tree verification)",
    "assign_draft_cache_locs_contiguous_cpu": "speculative decoding (draft cache locations)",
    "assign_extend_cache_locs_cpu": "speculative decoding (extend cache locations)",
    "fill_accept_out_cache_loc_cpu": "speculative decoding (accepted-token cache locations)",
    "fill_bonus_tokens_cpu": "speculative decoding (bonus tokens)",
}


def _unavailable(name: str, feature: str) -> Any:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"sgl_kernel.{name} ({feature}) is not implemented by kvroute's CPU shim of sgl_kernel: "
            "run that feature with SGLang's real kernel package"
        )

    stand_in.__name__ = name
    return stand_in


def __getattr__(name: str) -> Any:
    if name in _IMPORTED_NOT_USED:
        return _unavailable(name, _IMPORTED_NOT_USED[name])
    raise AttributeError(
        f"sgl_kernel.{name} is not available: this is kvroute's CPU shim of sgl_kernel "
        "(only assign_req_to_token_pool_cpu and copy_all_layer_kv_cache_cpu are implemented); "
        "the feature that asked for it needs SGLang's real kernel package (a GPU build)"
    )
