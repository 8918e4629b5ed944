"""kernels/linear (the fp32 panel linear for AVX2 and AVX-512 CPUs): F.linear's outputs at every shape its blocking
splits (row tails of its 6-row AVX2 and 14-row AVX-512 tiles, AVX-512's pairs of panels and the one panel left of an
odd count, k chunks, the 96- and 112-row chunks), with and without bias, on strided rows, the same on one thread and
two and for a row alone or in any batch; a weight or input it cannot take is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import panel_linear_ops


@pytest.fixture
def ops(require_cpu_kernel):
    found = panel_linear_ops()
    if found is None:
        pytest.skip("the C++ kernels were built for a CPU without AVX2 / FMA")
    return found


@pytest.mark.parametrize(
    "m, k, n",
    [
        *[(1, 7, 16), (2, 9, 16), (3, 20, 16), (5, 255, 32), (6, 256, 48), (7, 257, 16), (11, 64, 16)],
        *[(13, 33, 48), (14, 70, 32), (15, 300, 80), (21, 300, 32), (28, 17, 112), (34, 40, 16)],
        *[(64, 512, 1024), (73, 600, 64), (113, 64, 48), (200, 96, 32), (230, 513, 80)],
    ],
)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_panel_linear_computes_what_f_linear_does(ops, m, k, n, bias):
    generator = torch.Generator().manual_seed(m * 1000 + k)
    weight = torch.randn(n, k, generator=generator)  # [N, K]
    x = torch.randn(m, k, generator=generator)  # [M, K]
    b = torch.randn(n, generator=generator) if bias else None
    out = ops.packed_linear_cpu(x, ops.pack_linear_weight_cpu(weight), b)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_the_panel_linear_reads_strided_rows_and_gives_the_same_sums_on_any_thread_count(ops):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 100, generator=generator)
    wide = torch.randn(20, 130, generator=generator)
    x = wide[:, 10:110]  # [20, 100], rows 130 apart
    packed = ops.pack_linear_weight_cpu(weight)
    assert torch.equal(ops.pack_linear_weight_cpu(weight.t().contiguous().t()), packed)  # a strided weight packs too
    out = ops.packed_linear_cpu(x, packed, None)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = ops.packed_linear_cpu(x, packed, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, out)  # one FMA chain per output, in k order, whoever computes it


def test_the_panel_linear_refuses_what_it_cannot_take_by_name(ops):
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.pack_linear_weight_cpu(torch.randn(40, 8))
    packed = ops.pack_linear_weight_cpu(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="x's K"):
        ops.packed_linear_cpu(torch.randn(3, 9), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.packed_linear_cpu(torch.randn(3, 8), packed, torch.randn(16))
    with pytest.raises(RuntimeError, match="float32"):
        ops.packed_linear_cpu(torch.randn(3, 8, dtype=torch.float64), packed, None)


def test_a_row_gets_the_same_bits_alone_as_in_any_batch(ops):
    """Each output is one FMA chain over k in order, whatever tile, tail, chunk of rows or pair of panels it lands
    in: a decode step's sequence gets the same logits in a batch of 1 as of 64 (five panels: two pairs and one
    alone)."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(80, 300, generator=generator)  # [N, K]
    bias = torch.randn(80, generator=generator)
    packed = ops.pack_linear_weight_cpu(weight)
    x = torch.randn(230, 300, generator=generator)  # [M, K]
    whole = ops.packed_linear_cpu(x, packed, bias)
    for rows in (1, 5, 14, 15, 29, 113):
        start = 230 - rows
        assert torch.equal(ops.packed_linear_cpu(x[start:], packed, bias), whole[start:]), rows
    assert torch.equal(ops.packed_linear_cpu(x[7:8], packed, bias), whole[7:8])
