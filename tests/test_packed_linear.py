"""PackedLinear (prepacked weights on CPU: oneDNN's layout, or kernels/linear's panels): the same outputs as
nn.Linear, packing only where it is native (fp32, and bf16 on CPUs with native bf16 matmuls), and panels only where
they pay (`engine.cpu_features.panel_linear_wins`, 16 | out_features)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine.layers.packed_linear as packed_module
from engine.cpu_features import half_dtype_support
from engine.layers.packed_linear import PackedLinear, can_pack, panel_ops_for
from kernels.linear import bf16_panel_linear_ops, panel_linear_ops

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_computes_what_the_linear_does(dtype):
    if not can_pack(CPU, dtype):
        pytest.skip(f"{dtype} is not packed on this CPU ({half_dtype_support('bfloat16')[1]})")
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=True).to(dtype)
    x = torch.randn(7, 96, dtype=dtype)
    expected = F.linear(x.float(), linear.weight.float(), linear.bias.float())
    out = PackedLinear(linear)(x)
    assert out.dtype == dtype and out.shape == (7, 200)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: its own rounding of the output
    torch.testing.assert_close(out.float(), expected, rtol=tolerance, atol=tolerance)


def test_bf16_is_packed_only_where_the_cpu_multiplies_it_natively(monkeypatch):
    monkeypatch.setattr(packed_module, "half_dtype_support", lambda dtype: (False, "no avx512_bf16"))
    assert can_pack(CPU, torch.float32) == torch.backends.mkldnn.is_available()
    assert not can_pack(CPU, torch.bfloat16)
    monkeypatch.setattr(packed_module, "half_dtype_support", lambda dtype: (True, "avx512_bf16"))
    assert can_pack(CPU, torch.bfloat16) == torch.backends.mkldnn.is_available()
    assert not can_pack(CPU, torch.float16) and not can_pack(torch.device("meta"), torch.float32)


def test_a_linear_in_panels_computes_what_the_linear_does(require_cpu_kernel):
    ops = panel_linear_ops()
    if ops is None:
        pytest.skip("the C++ kernels were built for a CPU without AVX2 / FMA")
    torch.manual_seed(0)
    linear = nn.Linear(96, 208, bias=True)
    packed = PackedLinear(linear, ops)
    assert packed.packed_weight.shape == (13, 96, 16) and "layout=panels" in repr(packed)
    x = torch.randn(2, 7, 96)  # a leading batch dimension, as the layer-by-layer forward may pass
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(x[0, :, :]), linear(x[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("rows", "in_features"), [(1, 96), (5, 33), (13, 512), (200, 1101)])
def test_a_linear_in_bf16_panels_rounds_the_fp32_sums_once(require_cpu_kernel, rows, in_features):
    """Each output is its fp32 sum of bf16 products (+ bias) rounded to bf16 once: equal to the exactly rounded sum
    but where the order of the fp32 sum tips the rounding, and there one bf16 step away. 1-13 rows are the partial
    register tiles, 200 rows two chunks of rows, 1101 an odd K (the padded pair) over three chunks of k."""
    ops = bf16_panel_linear_ops()
    if ops is None:
        pytest.skip("the C++ kernels were built for a CPU without AVX512-BF16")
    torch.manual_seed(rows)
    linear = nn.Linear(in_features, 48, bias=True).to(torch.bfloat16)
    packed = PackedLinear(linear, ops)
    assert packed.packed_weight.shape == (3, (in_features + 1) // 2, 16, 2) and "layout=panels" in repr(packed)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    exact = (x.double() @ linear.weight.double().t() + linear.bias.double()).float()  # [rows, 48]
    rounded = exact.to(torch.bfloat16)
    out = packed(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 48)
    off = out != rounded
    assert off.float().mean() < 0.05  # the sum's order decides only near a rounding boundary
    step = (rounded.float().abs() * 2.0**-7).clamp_min(2.0**-126)  # one bf16 step (8 significant bits)
    assert ((out.float() - rounded.float()).abs() <= step).all()
    torch.testing.assert_close(packed(x.view(1, rows, in_features)), out.view(1, rows, 48), rtol=0, atol=0)
    assert packed(x[:0]).shape == (0, 48)


def test_panels_are_chosen_for_each_dtype_where_they_win_and_16_divides_the_outputs(monkeypatch):
    ops, bf16_ops = object(), object()
    monkeypatch.setattr(packed_module, "panel_linear_ops", lambda: ops)
    monkeypatch.setattr(packed_module, "bf16_panel_linear_ops", lambda: bf16_ops)
    monkeypatch.setattr(packed_module, "panel_linear_wins", lambda: True)
    monkeypatch.setattr(packed_module, "bf16_panel_linear_wins", lambda: False)
    assert panel_ops_for(nn.Linear(8, 32)) is ops
    assert panel_ops_for(nn.Linear(8, 40)) is None  # 40 columns: not whole panels, oneDNN takes it
    assert panel_ops_for(nn.Linear(8, 32).to(torch.bfloat16)) is None
    monkeypatch.setattr(packed_module, "bf16_panel_linear_wins", lambda: True)  # AMD Zen 4
    assert panel_ops_for(nn.Linear(8, 32).to(torch.bfloat16)) is bf16_ops
    assert panel_ops_for(nn.Linear(8, 40).to(torch.bfloat16)) is None
    monkeypatch.setattr(packed_module, "panel_linear_wins", lambda: False)  # AMD Zen 5, say: oneDNN's
    assert panel_ops_for(nn.Linear(8, 32)) is None
    assert panel_ops_for(nn.Linear(8, 32).to(torch.float16)) is None
