"""PackedLinear (prepacked weights on CPU: oneDNN's layout, or kernels/linear's panels on AVX2 CPUs): the same
outputs as nn.Linear, packing only where it is native (fp32, and bf16 on CPUs with native bf16 matmuls), and panels
only where they pay (fp32, AVX2 without AVX-512, 16 | out_features)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine.layers.packed_linear as packed_module
from engine.cpu_features import half_dtype_support
from engine.layers.packed_linear import PackedLinear, can_pack, panel_ops_for
from kernels.linear import panel_linear_ops

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


def test_panels_are_chosen_for_fp32_where_they_win_and_16_divides_the_outputs(monkeypatch):
    ops = object()
    monkeypatch.setattr(packed_module, "panel_linear_ops", lambda: ops)
    monkeypatch.setattr(packed_module, "panel_linear_wins", lambda: True)
    assert panel_ops_for(nn.Linear(8, 32)) is ops
    assert panel_ops_for(nn.Linear(8, 40)) is None  # 40 columns: not whole panels, oneDNN takes it
    assert panel_ops_for(nn.Linear(8, 32).to(torch.bfloat16)) is None
    monkeypatch.setattr(packed_module, "panel_linear_wins", lambda: False)  # Intel AVX-512, say: oneDNN's
    assert panel_ops_for(nn.Linear(8, 32)) is None
