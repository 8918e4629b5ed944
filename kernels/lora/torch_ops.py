"""Batched multi-LoRA shrink and expand in torch: the reference for the Triton kernels and the fast path on CPU.

Each op picks one of three layouts from the meta's host-side counts, never loops over tokens:
- "runs": every adapter's tokens are one run of the batch (one adapter for all, or prefill seqs): one
  matmul per active adapter on row ranges of x and y, no gather and no scatter;
- "padded": many small segments (decode): the segments gathered into one [A, max_seg_len, .] batch, padded,
  and one bmm against the active adapters' weights;
- "sorted": otherwise: one gather into adapter order, one matmul per active adapter, one scatter back.
On CPU a torch call costs ~10 us whatever its size, so small segments go to "padded" (a fixed handful of
calls) and large ones to a per-adapter loop (no padding, no extra copies).
"""

import torch
from torch import Tensor

from .compose import compose_add_lora
from .compose import shrink_out as shrink_out  # the ops' interface: the shrink's buffer
from .meta import LoraMeta, check_expand, check_shrink

# On 2 CPU threads a torch call costs about as much as writing this many floats to padded temporaries
# (allocation and page faults included): "padded" wins while it writes fewer per call it saves (measured, fp32).
FLOATS_PER_CALL = 1 << 16


def choose_layout(meta: LoraMeta, padded_floats_per_row: int, calls_per_adapter: int) -> str:
    """The layout of one op, "runs" | "padded" | "sorted", from host-side counts: "padded" writes
    max_seg_len * padded_floats_per_row floats per active adapter where a loop makes calls_per_adapter calls
    (twice that with the gather and scatter of "sorted")."""
    if meta.padded_token_idx is not None:
        calls_saved = calls_per_adapter * (1 if meta.run_starts is not None else 2)
        if meta.max_seg_len * padded_floats_per_row <= FLOATS_PER_CALL * calls_saved:
            return "padded"
    return "runs" if meta.run_starts is not None else "sorted"


def lora_shrink(out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta) -> None:
    """out[t] = x[t] @ lora_a[i].T, i = token_adapter_idx[t]; rows with i == -1 untouched.
    out: [T, S * R] · x: [T, H_in] · lora_a: [N, S * R, H_in]"""
    if not meta.has_lora:
        return
    check_shrink(out, x, lora_a, meta)
    layout = choose_layout(meta, x.shape[1], 1)
    if layout == "padded":
        _shrink_padded(out, x, lora_a, meta)
        return
    rows = zip(meta.active_adapters, meta.seg_starts, meta.seg_ends, strict=True)
    if layout == "runs":
        for i, (adapter, start, end) in enumerate(rows):
            run = slice(meta.run_starts[i], meta.run_starts[i] + end - start)
            torch.mm(x[run], lora_a[adapter].T, out=out[run])
        return
    sorted_x = x.index_select(0, meta.sorted_token_idx)  # [L, H_in]
    sorted_out = torch.empty(sorted_x.shape[0], out.shape[1], dtype=out.dtype, device=out.device)  # [L, S * R]
    for adapter, start, end in rows:
        torch.mm(sorted_x[start:end], lora_a[adapter].T, out=sorted_out[start:end])
    out.index_copy_(0, meta.sorted_token_idx, sorted_out)


def lora_expand(y: Tensor, z: Tensor, lora_b: Tensor, meta: LoraMeta, output_slices: tuple[int, ...]) -> None:
    """y[t, off_s:off_s + out_s] += z[t, s * R:(s + 1) * R] @ lora_b[i, off_s:off_s + out_s].T for each slice s,
    i = token_adapter_idx[t], off_s = sum(output_slices[:s]); rows with i == -1 untouched.
    y: [T, H_out] · z: [T, S * R] · lora_b: [N, H_out, R], H_out = sum(output_slices)"""
    if not meta.has_lora:
        return
    check_expand(y, z, lora_b, meta, output_slices)
    num_slices = len(output_slices)
    layout = choose_layout(meta, y.shape[1] * (2 if num_slices > 1 else 1), num_slices)  # the deltas, and their cat
    if layout == "padded":
        _expand_padded(y, z, lora_b, meta, output_slices)
        return
    rank, offsets = lora_b.shape[2], _offsets(output_slices)
    rows = zip(meta.active_adapters, meta.seg_starts, meta.seg_ends, strict=True)
    if layout == "runs":
        for i, (adapter, start, end) in enumerate(rows):
            run = slice(meta.run_starts[i], meta.run_starts[i] + end - start)
            for s, (lo, hi) in enumerate(offsets):
                y[run, lo:hi].addmm_(z[run, s * rank : (s + 1) * rank], lora_b[adapter, lo:hi].T)
        return
    sorted_z = z.index_select(0, meta.sorted_token_idx)  # [L, S * R]
    delta = torch.empty(sorted_z.shape[0], y.shape[1], dtype=y.dtype, device=y.device)  # [L, H_out]
    for adapter, start, end in rows:
        for s, (lo, hi) in enumerate(offsets):
            seg_delta = delta[start:end, lo:hi]
            torch.mm(sorted_z[start:end, s * rank : (s + 1) * rank], lora_b[adapter, lo:hi].T, out=seg_delta)
    y.index_add_(0, meta.sorted_token_idx, delta)


def _shrink_padded(out: Tensor, x: Tensor, lora_a: Tensor, meta: LoraMeta) -> None:
    num_active, max_len = meta.num_active, meta.max_seg_len
    padded_x = x.index_select(0, meta.padded_token_idx).view(num_active, max_len, x.shape[1])  # [A, M, H_in]
    padded_out = torch.bmm(padded_x, _active_rows(lora_a, meta).transpose(1, 2))  # [A, M, S * R]
    rows = padded_out.view(-1, out.shape[1]).index_select(0, meta.padded_rows)  # [L, S * R]
    out.index_copy_(0, meta.sorted_token_idx, rows)


def _expand_padded(y: Tensor, z: Tensor, lora_b: Tensor, meta: LoraMeta, output_slices: tuple[int, ...]) -> None:
    num_active, max_len, rank = meta.num_active, meta.max_seg_len, lora_b.shape[2]
    padded_z = z.index_select(0, meta.padded_token_idx).masked_fill_(meta.padded_is_pad, 0)  # [A * M, S * R]
    padded_z = padded_z.view(num_active, max_len, z.shape[1])
    b_t = _active_rows(lora_b, meta).transpose(1, 2)  # [A, R, H_out]
    deltas = [
        torch.bmm(padded_z[:, :, s * rank : (s + 1) * rank], b_t[:, :, lo:hi])  # [A, M, out_s]
        for s, (lo, hi) in enumerate(_offsets(output_slices))
    ]
    delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=2)  # [A, M, H_out]
    # Pad rows add an exact 0 to a token of their own segment: no [L, H_out] gather of the real rows needed.
    y.index_add_(0, meta.padded_token_idx, delta.view(-1, y.shape[1]))


def _active_rows(weights: Tensor, meta: LoraMeta) -> Tensor:
    """weights[active_adapters]: no copy when every row is active."""
    if meta.num_active == weights.shape[0]:
        return weights
    return weights.index_select(0, meta.seg_adapter_idx)


def _offsets(output_slices: tuple[int, ...]) -> list[tuple[int, int]]:
    bounds, lo = [], 0
    for size in output_slices:
        bounds.append((lo, lo + size))
        lo += size
    return bounds


add_lora = compose_add_lora(lora_shrink, lora_expand)
