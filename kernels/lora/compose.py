"""add_lora = lora_shrink then lora_expand, built once for each backend from its two ops."""

from collections.abc import Callable

from torch import Tensor

from .meta import LoraMeta


def compose_add_lora(lora_shrink: Callable, lora_expand: Callable) -> Callable:
    def add_lora(
        y: Tensor,
        x: Tensor,
        lora_a: Tensor,
        lora_b: Tensor,
        meta: LoraMeta,
        output_slices: tuple[int, ...],
        buffer: Tensor | None = None,
    ) -> None:
        """y[t] += (x[t] @ lora_a[i].T) @ lora_b[i].T per slice, i = token_adapter_idx[t]: lora_shrink into buffer
        (z: [T, S * R], allocated here when None), then lora_expand."""
        if not meta.has_lora:
            return
        z = buffer if buffer is not None else x.new_empty(x.shape[0], lora_a.shape[1])  # [T, S * R]
        lora_shrink(z, x, lora_a, meta)
        lora_expand(y, z, lora_b, meta, output_slices)

    return add_lora
