"""Batched multi-LoRA on CPU: shrink and expand in C++ (kernels/cpu_native.py), one call per op whatever the mix of
adapters in the batch, for float32 and bfloat16 (computed in fp32), walking the tokens in the meta's adapter order;
add_lora runs both in one call (what a LoRA layer makes); anything else (or no compiler) runs torch_ops.

Expand reads lora_b transposed, [N, R, H_out], so that each token adds R contiguous scaled rows: either the owner
of the stack keeps that transpose row by row and says so (`keep_transposed`: the engine's adapter cache), or it is
made here once and kept while the stacked weights are unchanged (their version counter: writing a row in place
bumps it, and every row is transposed again).
"""

import functools
import itertools
import weakref

import torch
from torch import Tensor

from .. import cpu_native
from . import torch_ops
from .compose import shrink_out as shrink_out  # the ops' interface: the shrink's buffer
from .meta import LoraMeta, check_expand, check_shrink

# id(lora_b) -> (a weak reference to it, its version when transposed, lora_b^T)
_transposed: dict[int, tuple[weakref.ref, int, Tensor]] = {}
# id(lora_b) -> (a weak reference to it, lora_b^T kept up to date by the stack's owner)
_kept: dict[int, tuple[weakref.ref, Tensor]] = {}


def _native(*tensors: Tensor):
    """The C++ ops where they take these tensors (on the CPU, all float32 or all bfloat16), else None."""
    native = cpu_native.load()
    dtype = tensors[0].dtype
    if native is None or (dtype is not torch.float32 and dtype is not torch.bfloat16):
        return None
    for t in tensors:  # a plain loop over is_cpu: any() over t.device.type cost 6 µs a layer call (4 tensors)
        if t.dtype is not dtype or not t.is_cpu:
            return None
    return native


def lora_shrink(out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta) -> None:
    """As torch_ops.lora_shrink. out: [T, S * R] · x: [T, H_in] · lora_a: [N, S * R, H_in]"""
    if not meta.has_lora:
        return
    native = _native(out, x, lora_a)
    if native is None:
        return torch_ops.lora_shrink(out, x, lora_a, meta)
    check_shrink(out, x, lora_a, meta)
    native.lora_shrink_cpu(out, x, lora_a, meta.token_adapter_idx, meta.sorted_token_idx, meta.row_ranks, meta.max_rank)


def lora_expand(y: Tensor, z: Tensor, lora_b: Tensor, meta: LoraMeta, output_slices: tuple[int, ...]) -> None:
    """As torch_ops.lora_expand. y: [T, H_out] · z: [T, S * R] · lora_b: [N, H_out, R]"""
    if not meta.has_lora:
        return
    native = _native(y, z, lora_b)
    if native is None:
        return torch_ops.lora_expand(y, z, lora_b, meta, output_slices)
    check_expand(y, z, lora_b, meta, output_slices)
    bounds = slice_bounds(output_slices)
    native.lora_expand_cpu(
        y, z, transposed(lora_b), meta.token_adapter_idx, meta.sorted_token_idx, meta.row_ranks, bounds
    )


def keep_transposed(lora_b: Tensor, lora_bt: Tensor) -> None:
    """Says that lora_bt, a contiguous [N, R, H_out], is lora_b^T and that whoever writes a row of lora_b writes
    the same row of lora_bt: the expand reads it as it is."""
    if lora_bt.shape != (lora_b.shape[0], lora_b.shape[2], lora_b.shape[1]) or not lora_bt.is_contiguous():
        raise ValueError(
            f"lora_bt {tuple(lora_bt.shape)} is not a contiguous transpose of lora_b {tuple(lora_b.shape)}"
        )
    key = id(lora_b)
    _kept[key] = (weakref.ref(lora_b, lambda _, key=key: _kept.pop(key, None)), lora_bt)


def transposed(lora_b: Tensor) -> Tensor:
    """lora_b [N, H_out, R] as a contiguous [N, R, H_out]: the one its owner keeps, else one remade only after
    lora_b changed."""
    key = id(lora_b)
    kept = _kept.get(key)
    if kept is not None and kept[0]() is lora_b:
        return kept[1]
    cached = _transposed.get(key)
    if cached is None or cached[0]() is not lora_b or cached[1] != lora_b._version:
        cached = (weakref.ref(lora_b, lambda _, key=key: _transposed.pop(key, None)), lora_b._version,
                  lora_b.transpose(1, 2).contiguous())  # fmt: skip
        _transposed[key] = cached
    return cached[2]


def add_lora(
    y: Tensor,
    x: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    meta: LoraMeta,
    output_slices: tuple[int, ...],
    buffer: Tensor | None = None,
) -> None:
    """As compose_add_lora's add_lora, in one C++ call (no z tensor): a LoRA layer's whole cost on CPU.
    y: [T, H_out] · x: [T, H_in] · lora_a: [N, S * R, H_in] · lora_b: [N, H_out, R]"""
    if not meta.has_lora:
        return
    native = _native(y, x, lora_a, lora_b)
    if native is None:
        return torch_ops.add_lora(y, x, lora_a, lora_b, meta, output_slices, buffer)
    native.lora_add_cpu(
        y,
        x,
        lora_a,
        transposed(lora_b),
        meta.token_adapter_idx,
        meta.sorted_token_idx,
        meta.row_ranks,
        slice_bounds(output_slices),
    )


@functools.cache
def slice_bounds(output_slices: tuple[int, ...]) -> list[int]:
    """[0, s0, s0 + s1, ...]: where each slice of the output starts, then the end."""
    return [0, *itertools.accumulate(output_slices)]
