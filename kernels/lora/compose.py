"""add_lora for a backend, composed from its shrink and expand, and the shrink's buffer as the torch ops take it."""

from collections.abc import Callable

from torch import Tensor

from .meta import LoraMeta


def shrink_out(x: Tensor, lora_a: Tensor, meta: LoraMeta) -> Tensor:
    """The buffer lora_shrink writes and lora_expand reads: z [T, S * R] in x's dtype (the torch and C++ ops; the
    Triton ops may ask for partial sums instead). x: [T, H_in] · lora_a: [N, S * R, H_in]"""
    return x.new_empty(x.shape[0], lora_a.shape[1])


def compose_add_lora(
    lora_shrink: Callable,
    lora_expand: Callable,
    new_shrink_out: Callable = shrink_out,
    lora_fused: Callable | None = None,
    fused_pays: Callable | None = None,
) -> Callable:
    """add_lora from a backend's ops; with lora_fused(y, x, lora_a, lora_b, meta, output_slices), one launch for a
    layer where fused_pays(H_in, R, output_slices) and no buffer is given."""

    def add_lora(
        y: Tensor,
        x: Tensor,
        lora_a: Tensor,
        lora_b: Tensor,
        meta: LoraMeta,
        output_slices: tuple[int, ...],
        buffer: Tensor | None = None,
    ) -> None:
        """y[t] += (x[t] @ lora_a[i].T) @ lora_b[i].T per slice, i = token_adapter_idx[t]: in one launch where the
        backend fuses the layer and no buffer is given, else lora_shrink into buffer (the backend's shrink_out when
        None), then lora_expand."""
        if not meta.has_lora:
            return
        if lora_fused is not None and buffer is None and fused_pays(x.shape[1], lora_b.shape[2], output_slices):
            lora_fused(y, x, lora_a, lora_b, meta, output_slices)
            return
        z = buffer if buffer is not None else new_shrink_out(x, lora_a, meta)
        lora_shrink(z, x, lora_a, meta)
        lora_expand(y, z, lora_b, meta, output_slices)

    return add_lora
