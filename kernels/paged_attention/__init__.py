"""Paged attention over a block-paged KV cache, by backend name: torch (the reference), cpu (torch with a C++ decode
kernel reading K/V in place) and triton (CUDA)."""

import importlib
from types import ModuleType

from torch import Tensor

from .meta import PagedAttentionMeta

BACKENDS = ("torch", "triton", "cpu")

__all__ = ["BACKENDS", "PagedAttentionMeta", "get_paged_attention", "paged_attention"]


def get_paged_attention(name: str) -> ModuleType:
    """The backend module `name` ("torch" | "triton" | "cpu"), with store_kv(k, v, k_cache, v_cache, meta) and
    attention(q, k_cache, v_cache, meta, scale); Triton is imported only here, on first use."""
    if name not in BACKENDS:
        raise ValueError(f"unknown paged attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return importlib.import_module(f"{__name__}.{name}_ops")


def paged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    meta: PagedAttentionMeta,
    scale: float,
    backend: str = "torch",
) -> Tensor:
    """Store this step's k, v into the cache, then attend: returns [T, Hq, D].
    q: [T, Hq, D] · k, v: [T, Hkv, D] · k_cache, v_cache: [num_blocks, block_size, Hkv, D]"""
    ops = get_paged_attention(backend)
    ops.store_kv(k, v, k_cache, v_cache, meta)
    return ops.attention(q, k_cache, v_cache, meta, scale)
