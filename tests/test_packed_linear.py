"""PackedLinear (oneDNN-prepacked weights on CPU): the same outputs as nn.Linear, and packing only where it is
native: fp32, and bf16 on CPUs with native bf16 matmuls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import engine.layers.packed_linear as packed_module
from engine.cpu_features import half_dtype_support
from engine.layers.packed_linear import PackedLinear, can_pack

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
