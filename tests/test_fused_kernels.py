"""The fused C++ layer ops (kernels/fused) against the torch ops they replace, and the layers that use them.

Each op is compared on odd sizes (vector tails), strided rows and many tokens (several OpenMP tasks); the layers
(RMSNorm, the rotary helper, the MLP) are compared with their torch path by turning the native ops off. In
bfloat16 the ops round where torch's bf16 ops round, so they must give torch's bf16 values (but for a rare last-bit
difference where the fp32 sums are ordered differently)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import engine.layers.norm as norm_module
import engine.layers.rotary as rotary_module
import engine.models.llama as llama_module
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary, rotate_heads

ATOL = 1e-5


def rows(num_tokens: int, width: int, stride: int | None = None, seed: int = 0) -> torch.Tensor:
    """[T, width] float32, its rows `stride` apart (a view into a wider tensor when stride > width)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(num_tokens, stride or width, generator=g)
    return full[:, :width]


@pytest.mark.parametrize("hidden", [64, 577])
@pytest.mark.parametrize("stride", [None, 700])
def test_add_rms_norm_matches_torch_in_place(hidden, stride, require_cpu_kernel):
    x, residual = rows(37, hidden, stride, seed=1), rows(37, hidden, seed=2).clone()
    weight = torch.rand(hidden) + 0.5
    expected_residual = x + residual
    expected = F.rms_norm(expected_residual, (hidden,), weight, eps=1e-6)
    require_cpu_kernel.add_rms_norm_cpu(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_residual, atol=ATOL, rtol=0)
    torch.testing.assert_close(x, expected, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("hidden", [64, 577])
def test_rms_norm_matches_torch(hidden, require_cpu_kernel):
    x, weight = rows(33, hidden, hidden + 9), torch.rand(hidden) + 0.5
    out = torch.empty(33, hidden)
    require_cpu_kernel.rms_norm_cpu(out, x, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (hidden,), weight, eps=1e-5), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("inter", [48, 1409])
def test_silu_and_mul_matches_torch(inter, require_cpu_kernel):
    x = rows(41, 2 * inter, 2 * inter + 3) * 6  # large |gate| too: exp's range ends
    out = torch.empty(41, inter)
    require_cpu_kernel.silu_and_mul_cpu(out, x)
    torch.testing.assert_close(out, F.silu(x[:, :inter]) * x[:, inter:], atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 18])
def test_rotary_rotates_the_first_heads_in_place_and_nothing_else(head_dim, require_cpu_kernel):
    heads, extra = 5, 3  # 5 heads rotated (q and k), 3 more left alone (v)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None)
    positions = torch.tensor([0, 1, 7, 4095, 300, 2, 2, 1000, 5, 9, 64])
    step = rope(positions)
    x = rows(len(positions), (heads + extra) * head_dim, (heads + extra) * head_dim + 4)
    original = x.clone()
    expected = apply_rotary(x[:, : heads * head_dim].reshape(-1, heads, head_dim), step.cos, step.sin)
    require_cpu_kernel.rotary_neox_cpu(x, positions, step.table, heads)
    torch.testing.assert_close(x[:, : heads * head_dim].reshape(-1, heads, head_dim), expected, atol=ATOL, rtol=0)
    assert torch.equal(x[:, heads * head_dim :], original[:, heads * head_dim :])


def test_rotary_refuses_positions_past_its_table(require_cpu_kernel):
    table = RotaryEmbedding(8, 16, 10000.0, None)(torch.tensor([0])).table
    with pytest.raises(RuntimeError, match="past the table"):
        require_cpu_kernel.rotary_neox_cpu(torch.zeros(2, 16), torch.tensor([3, 16]), table, 2)


def assert_same_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Both bf16; within one bf16 step everywhere and bit for bit almost everywhere."""
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=1e-6)
    assert (got == expected).float().mean().item() >= 0.999


def test_bf16_ops_round_where_torch_rounds(require_cpu_kernel):
    bf16, hidden, inter = torch.bfloat16, 577, 1409
    x, residual = rows(37, hidden, 700, seed=1).to(bf16), rows(37, hidden, seed=2).to(bf16)
    weight = (torch.rand(hidden) + 0.5).to(bf16)

    def torch_norm(t):  # RMSNorm's torch path in bf16 (as HF Llama): normalized in fp32, rounded, times weight
        return weight * F.rms_norm(t.float(), (hidden,), eps=1e-6).to(bf16)

    out = torch.empty(37, hidden, dtype=bf16)
    require_cpu_kernel.rms_norm_cpu(out, x, weight, 1e-6)
    assert_same_bf16(out, torch_norm(x))
    x_in_place, summed = x.clone(), residual.clone()
    require_cpu_kernel.add_rms_norm_cpu(x_in_place, summed, weight, 1e-6)
    assert torch.equal(summed, x + residual)
    assert_same_bf16(x_in_place, torch_norm(x + residual))
    gate_up = (rows(41, 2 * inter, 2 * inter + 3) * 6).to(bf16)
    out = torch.empty(41, inter, dtype=bf16)
    require_cpu_kernel.silu_and_mul_cpu(out, gate_up)
    assert_same_bf16(out, F.silu(gate_up[:, :inter]) * gate_up[:, inter:])
    step = RotaryEmbedding(64, 4096, 10000.0, None)(torch.arange(11) * 97)
    qk = rows(11, 8 * 64, 8 * 64 + 16).to(bf16)
    expected = apply_rotary(qk[:, : 6 * 64].reshape(-1, 6, 64), step.cos, step.sin)
    require_cpu_kernel.rotary_neox_cpu(qk, step.positions, step.table, 6)
    assert_same_bf16(qk[:, : 6 * 64].reshape(-1, 6, 64), expected)


def test_ops_refuse_mixed_dtypes(require_cpu_kernel):
    x, weight = torch.randn(4, 32, dtype=torch.bfloat16), torch.ones(32)
    with pytest.raises(RuntimeError, match="weight"):
        require_cpu_kernel.rms_norm_cpu(torch.empty_like(x), x, weight, 1e-6)
    with pytest.raises(RuntimeError, match="out"):
        require_cpu_kernel.silu_and_mul_cpu(torch.empty(4, 16), x)


@pytest.fixture
def torch_only(monkeypatch):
    """Turns the fused ops off in the layers: their torch path, the reference."""

    def off():
        for module in (norm_module, rotary_module, llama_module):
            monkeypatch.setattr(module, "fused_ops", lambda x: None)

    return off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_give_the_same_results_fused_and_unfused(dtype, torch_only, require_cpu_kernel):
    arch = SimpleNamespace(hidden_size=96, intermediate_size=200)  # what MLP reads of a ModelArch
    torch.manual_seed(0)
    mlp = llama_module.MLP(arch).to(dtype)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.rand(96) + 0.5
    norm.to(dtype)
    rope = RotaryEmbedding(16, 128, 10000.0, None)(torch.arange(9) * 13)
    x, residual, qkv = (torch.randn(9, width).to(dtype) for width in (96, 96, 160))

    def run() -> list[torch.Tensor]:
        with torch.inference_mode():
            normed, summed = norm.add_and_norm(x.clone(), residual.clone())
            return [norm(x), normed, summed, mlp(x, None), rotate_heads(qkv.clone(), 8, 16, rope).clone()]

    fused = run()
    torch_only()
    for got, expected in zip(fused, run(), strict=True):
        if dtype == torch.bfloat16:
            assert_same_bf16(got, expected)
        else:
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-5)
