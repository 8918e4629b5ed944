"""Batched LoRA: torch ops vs a naive per-token fp32 loop; Triton ops (interpreted on CPU) vs torch."""

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import Tensor

from bench.gpu import graph_meta
from kernels.lora import LoraMeta, add_lora, get_lora_ops
from kernels.lora import torch_ops as torch_module
from kernels.lora.host_pack import TORCH_DTYPES, HostPack
from kernels.lora.meta import GRAPH_TILE_TOKENS, NO_TILE, fill_graph_layout, fill_tile_table, graph_tiles, tile_table

torch_ops = get_lora_ops("torch")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
TRITON_DEVICE = "cpu" if INTERPRETED else "cuda"  # the Triton tests run compiled on a GPU where there is one


def device_of(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


LAYERS = {  # (H_in, output_slices): odd sizes, and packed layers
    "dense": (72, (136,)),
    "qkv": (100, (40, 24, 24)),
    "gate_up": (72, (52, 52)),
    "wide_in": (300, (40, 24, 24)),  # H_in over two of the fp32 shrink's 128-column steps: split-K has parts
    "wide_out": (72, (300, 200)),  # slices of 3 and 2 of the expand's 128-column tiles, the last ones partial
}
POPULARITY = ["distinct", "uniform", "skewed", "identical", "segments"]


@dataclass
class Case:
    x: Tensor  # [T, H_in], NaN on rows without an adapter: nothing may read them
    lora_a: Tensor  # [N, S * R, H_in]
    lora_b: Tensor  # [N, H_out, R]
    output_slices: tuple[int, ...]
    token_adapter_idx: list[int]
    meta: LoraMeta
    out: Tensor  # [T, S * R] random: shrink must leave the rows without an adapter as they are
    y: Tensor  # [T, H_out] random: the base output
    expected_z: Tensor  # [T, S * R] naive shrink; NaN on rows without an adapter (the expand's input)
    expected_y: Tensor  # [T, H_out] y + naive expand

    @property
    def has_adapter(self) -> Tensor:
        return torch.tensor(self.token_adapter_idx) >= 0


def naive_lora(x, lora_a, lora_b, token_adapter_idx, output_slices) -> tuple[Tensor, Tensor]:
    """Token by token in fp32: (z [T, S * R], NaN rows for -1; delta [T, H_out], zero rows for -1)."""
    rank = lora_b.shape[2]
    z = torch.full((x.shape[0], lora_a.shape[1]), float("nan"))
    delta = torch.zeros(x.shape[0], lora_b.shape[1])
    for t, i in enumerate(token_adapter_idx):
        if i < 0:
            continue
        z[t] = lora_a[i].float() @ x[t].float()
        offset = 0
        for s, size in enumerate(output_slices):
            delta[t, offset : offset + size] = (
                lora_b[i, offset : offset + size].float() @ z[t, s * rank : (s + 1) * rank]
            )
            offset += size
    return z, delta


def assign_adapters(num_tokens, num_adapters, popularity, with_pads, gen) -> list[int]:
    """Adapter rows per token; with_pads: some tokens use no adapter (-1)."""
    if popularity == "distinct":  # every adapter in turn: as many distinct ones as the batch holds
        idx = torch.arange(num_tokens) % num_adapters
    elif popularity == "uniform":
        idx = torch.randint(0, num_adapters, (num_tokens,), generator=gen)
    elif popularity == "skewed":  # zipf-like, the hot row not row 0
        weights = torch.arange(1, num_adapters + 1).float() ** -1.5
        idx = (torch.multinomial(weights, num_tokens, replacement=True, generator=gen) + 1) % num_adapters
    elif popularity == "identical":
        idx = torch.full((num_tokens,), num_adapters - 1)
    else:  # "segments": prefill-like runs, base-model tokens (-1) one run of their own
        low = -1 if with_pads else 0
        return torch.randint(low, num_adapters, (num_tokens,), generator=gen).sort().values.tolist()
    if with_pads:
        idx[3::4] = -1
    return idx.tolist()


def make_case(
    num_tokens, num_adapters, rank, popularity, layer, with_pads=True, dtype=torch.float32, seed=0, device="cpu"
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    hidden_in, output_slices = LAYERS[layer]
    width, hidden_out = len(output_slices) * rank, sum(output_slices)
    token_adapter_idx = assign_adapters(num_tokens, num_adapters, popularity, with_pads, gen)
    has_adapter = torch.tensor(token_adapter_idx) >= 0

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    x = randn(num_tokens, hidden_in).masked_fill(~has_adapter[:, None], float("nan"))
    lora_a = randn(num_adapters, width, hidden_in, scale=hidden_in**-0.5)
    lora_b = randn(num_adapters, hidden_out, rank, scale=rank**-0.5)
    out, y = randn(num_tokens, width), randn(num_tokens, hidden_out)
    z, delta = naive_lora(x, lora_a, lora_b, token_adapter_idx, output_slices)
    tensors = [t.to(device) for t in (x, lora_a, lora_b, out, y, z, y.float() + delta)]
    meta = LoraMeta.build(token_adapter_idx, device)
    return Case(*tensors[:3], output_slices, token_adapter_idx, meta, *tensors[3:])


def assert_rows(actual, expected, has_adapter, tol=1e-5):
    """Close on the rows with an adapter; bit for bit what was there on the others."""
    has_adapter = has_adapter.to(actual.device)
    torch.testing.assert_close(actual[has_adapter].float(), expected[has_adapter].float(), rtol=tol, atol=tol)
    assert torch.equal(actual[~has_adapter], expected[~has_adapter].to(actual.dtype)), "a -1 row was touched"


def expected_out(case: Case) -> Tensor:
    return torch.where(case.has_adapter[:, None].to(case.out.device), case.expected_z.to(case.out.dtype), case.out)


def check_ops(ops, case: Case, tol=1e-5) -> None:
    """lora_shrink, lora_expand and add_lora of one backend against the naive reference."""
    out = case.out.clone()
    ops.lora_shrink(out, case.x, case.lora_a, case.meta)
    assert_rows(out, expected_out(case), case.has_adapter, tol)
    y = case.y.clone()
    ops.lora_expand(y, case.expected_z.to(case.y.dtype), case.lora_b, case.meta, case.output_slices)
    assert_rows(y, case.expected_y, case.has_adapter, tol)
    y = case.y.clone()
    ops.add_lora(y, case.x, case.lora_a, case.lora_b, case.meta, case.output_slices)
    assert_rows(y, case.expected_y, case.has_adapter, tol)


@pytest.mark.parametrize("with_pads", [False, True], ids=["all_lora", "with_pads"])
@pytest.mark.parametrize("layer", ["dense", "qkv"])
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("rank", [4, 8, 16, 64])
@pytest.mark.parametrize("num_adapters", [1, 3, 8])
@pytest.mark.parametrize("num_tokens", [1, 7, 64])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_ops_match_naive_reference(backend, num_tokens, num_adapters, rank, popularity, layer, with_pads, request):
    """torch (its layouts) and cpu (C++: one call per op, each token on its own adapter's row)."""
    if backend == "cpu":
        request.getfixturevalue("require_cpu_kernel")
    check_ops(get_lora_ops(backend), make_case(num_tokens, num_adapters, rank, popularity, layer, with_pads))


def test_cpu_expand_sees_an_adapter_row_rewritten_in_place(require_cpu_kernel):
    """Its transposed copy of lora_b is remade when a row is overwritten (an adapter activated into it)."""
    ops = get_lora_ops("cpu")
    case = make_case(7, 3, 8, "uniform", "qkv")
    check_ops(ops, case)
    case.lora_b[1].mul_(-2.0)  # what the adapter cache's copy_ into a row does to the version counter
    y = case.y.clone()
    ops.lora_expand(y, case.expected_z, case.lora_b, case.meta, case.output_slices)
    _, expected_y = naive_lora(case.x, case.lora_a, case.lora_b, case.token_adapter_idx, case.output_slices)
    assert_rows(y, case.y + expected_y, case.has_adapter, 1e-5)


def test_cpu_ops_refuse_a_row_past_the_stack(require_cpu_kernel):
    case = make_case(7, 3, 8, "uniform", "dense")
    bad = case.meta.token_adapter_idx.clone()
    bad[0] = 3
    with pytest.raises(RuntimeError, match="is not a row"):
        order = case.meta.sorted_token_idx
        require_cpu_kernel.lora_shrink_cpu(case.out.clone(), case.x, case.lora_a, bad, order, None, 0)


def test_cpu_ops_refuse_an_order_naming_a_token_without_adapter(require_cpu_kernel):
    case = make_case(7, 3, 8, "uniform", "dense", with_pads=True)
    order = case.meta.sorted_token_idx.clone()
    order[0] = 3  # token 3 has no adapter (every fourth is a pad)
    with pytest.raises(RuntimeError, match="is not a token with an adapter"):
        require_cpu_kernel.lora_shrink_cpu(
            case.out.clone(), case.x, case.lora_a, case.meta.token_adapter_idx, order, None, 0
        )


@pytest.mark.parametrize("layer", ["dense", "qkv"])
def test_cpu_ops_skip_what_lies_past_each_rows_rank(layer, require_cpu_kernel):
    """Rows of rank 3, 8 and 1 in a stack of R = 8 (their A rows and B columns past the rank zero, as the adapter
    cache writes them): the same result as the full-rank reference, and shrink writes 0 past each rank."""
    case = make_case(64, 3, 8, "uniform", layer)
    ranks = torch.tensor([3, 8, 1])
    num_slices = len(case.output_slices)
    for row, r in enumerate(ranks.tolist()):
        for s in range(num_slices):
            case.lora_a[row, s * 8 + r : (s + 1) * 8] = 0
        case.lora_b[row, :, r:] = 0
    z, delta = naive_lora(case.x, case.lora_a, case.lora_b, case.token_adapter_idx, case.output_slices)
    meta = LoraMeta.build(case.token_adapter_idx, "cpu", row_ranks=ranks, max_rank=8)
    ops = get_lora_ops("cpu")
    out = torch.full_like(case.out, float("nan"))  # shrink must write every column of a token with an adapter
    ops.lora_shrink(out, case.x, case.lora_a, meta)
    torch.testing.assert_close(out[case.has_adapter], z[case.has_adapter], rtol=1e-5, atol=1e-5)
    z_holes = out.clone()
    for row, r in enumerate(ranks.tolist()):  # expand must not read past a row's rank
        for s in range(num_slices):
            z_holes[torch.tensor(case.token_adapter_idx) == row, s * 8 + r : (s + 1) * 8] = float("nan")
    y = case.y.clone()
    ops.lora_expand(y, z_holes, case.lora_b, meta, case.output_slices)
    assert_rows(y, case.y + delta, case.has_adapter, 1e-5)
    y = case.y.clone()
    ops.add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.output_slices)  # both in one call
    assert_rows(y, case.y + delta, case.has_adapter, 1e-5)
    with pytest.raises(RuntimeError, match="is not a rank"):
        bad = LoraMeta.build(case.token_adapter_idx, "cpu", row_ranks=torch.tensor([3, 9, 1]), max_rank=8)
        ops.lora_shrink(out, case.x, case.lora_a, bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer", ["qkv", "wide_in", "wide_out"])
def test_cpu_ops_give_a_token_the_same_bits_in_any_batch(layer, dtype, require_cpu_kernel):
    """A token's z and y do not depend on how many tokens share its adapter (runs of 1 to 8, tiles of each width
    the kernels take, the last columns of a slice in a narrower tile) nor on its place among them: each output is
    the same chain of FMAs whatever the tile. Rank 3 of 8 on row 1 (its columns past 3 skipped)."""
    ops = get_lora_ops("cpu")
    case = make_case(1, 2, 8, "identical", layer, with_pads=False, dtype=dtype)
    hidden_in, output_slices = LAYERS[layer]
    gen = torch.Generator().manual_seed(1)
    others = torch.randn(16, hidden_in, generator=gen).to(dtype)  # [16, H_in]: the token's neighbours
    token = others[5]
    ranks = torch.tensor([8, 3])
    for s in range(len(output_slices)):
        case.lora_a[1, s * 8 + 3 : (s + 1) * 8] = 0
    case.lora_b[1, :, 3:] = 0
    for row in (0, 1):
        alone = LoraMeta.build([row], "cpu", row_ranks=ranks, max_rank=8)
        z_alone = torch.zeros(1, case.lora_a.shape[1], dtype=dtype)
        ops.lora_shrink(z_alone, token[None], case.lora_a, alone)
        y_alone = case.y[:1].clone()
        ops.add_lora(y_alone, token[None], case.lora_a, case.lora_b, alone, output_slices)
        for count in range(2, 17):
            x = others[:count].clone()  # [count, H_in]; the token is one of them from count 6 on, else the last
            at = 5 if count > 5 else count - 1
            x[at] = token
            idx = [row] * count
            idx[0] = 1 - row  # another adapter's token first: the run starts past the batch's first row
            meta = LoraMeta.build(idx, "cpu", row_ranks=ranks, max_rank=8)
            z = torch.zeros(count, case.lora_a.shape[1], dtype=dtype)
            ops.lora_shrink(z, x, case.lora_a, meta)
            y = case.y[:1].expand(count, -1).clone()
            ops.add_lora(y, x, case.lora_a, case.lora_b, meta, output_slices)
            assert torch.equal(z[at], z_alone[0]), (row, count)
            assert torch.equal(y[at], y_alone[0]), (row, count)


def available_layouts(meta: LoraMeta) -> list[str]:
    return ["sorted"] + ["runs"] * (meta.run_starts is not None) + ["padded"] * (meta.padded_rows is not None)


@pytest.mark.parametrize("with_pads", [False, True], ids=["all_lora", "with_pads"])
@pytest.mark.parametrize(
    ("num_tokens", "num_adapters", "popularity", "layer", "layouts"),
    [
        (64, 8, "distinct", "qkv", {"sorted", "padded"}),
        (64, 8, "skewed", "gate_up", {"sorted"}),
        (40, 3, "segments", "qkv", {"sorted", "runs", "padded"}),
        (9, 3, "uniform", "dense", {"sorted", "padded"}),
    ],
)
def test_every_torch_layout_matches_naive_reference(
    num_tokens, num_adapters, popularity, layer, layouts, with_pads, monkeypatch
):
    case = make_case(num_tokens, num_adapters, 8, popularity, layer, with_pads, seed=1)
    assert set(available_layouts(case.meta)) == layouts
    for layout in layouts:
        monkeypatch.setattr(torch_module, "choose_layout", lambda *args, layout=layout: layout)
        check_ops(torch_ops, case)


def test_torch_layout_choice():
    decode = make_case(64, 8, 8, "uniform", "qkv").meta
    assert torch_module.choose_layout(decode, 512, 1) == "padded"
    prefill = LoraMeta.build([i // 128 for i in range(2048)], "cpu")  # 16 seqs of 128 tokens
    assert torch_module.choose_layout(prefill, 4096, 1) == "runs"
    mixed = LoraMeta.build([i % 4 for i in range(2048)], "cpu")  # interleaved, 512 tokens each
    assert torch_module.choose_layout(mixed, 4096, 1) == "sorted"
    one = LoraMeta.build([2] * 64, "cpu")
    assert one.padded_rows is None and torch_module.choose_layout(one, 512, 1) == "runs"


def test_meta_groups_tokens_by_adapter():
    meta = LoraMeta.build([2, -1, 0, 2, 0, 5], "cpu")
    assert meta.has_lora and meta.num_tokens == 6 and meta.active_adapters == [0, 2, 5]
    assert meta.sorted_token_idx.tolist() == [2, 4, 0, 3, 5]
    assert (meta.seg_starts, meta.seg_ends, meta.max_seg_len) == ([0, 2, 4], [2, 4, 5], 2)
    assert meta.seg_indptr.tolist() == [0, 2, 4, 5] and meta.seg_indptr.dtype == torch.int32
    assert meta.seg_adapter_idx.tolist() == [0, 2, 5] and meta.run_starts is None
    assert meta.padded_token_idx.tolist() == [2, 4, 0, 3, 5, 5]
    assert meta.padded_rows.tolist() == [0, 1, 2, 3, 4] and meta.padded_is_pad.flatten().tolist()[-1]
    runs = LoraMeta.build(torch.tensor([-1, 3, 3, 1, 1, 1, -1]), "cpu")
    assert runs.active_adapters == [1, 3] and runs.run_starts == [3, 1]
    assert LoraMeta.build([4] * 5, "cpu").run_starts == [0]
    assert LoraMeta.build([1, 1, 0, 1], "cpu").run_starts is None
    for no_lora in ([-1, -1, -1], []):
        meta = LoraMeta.build(no_lora, "cpu")
        assert not meta.has_lora and meta.active_adapters == [] and meta.sorted_token_idx.numel() == 0
    with pytest.raises(ValueError, match="-1 for no adapter"):
        LoraMeta.build([0, -2], "cpu")


def test_a_cpu_meta_keeps_its_own_copy_of_the_step_rows():
    """On a CPU the meta's tensors share the arrays build made (no packing), never the caller's array."""
    rows = np.array([1, -1, 0, 1])
    meta = LoraMeta.build(rows, "cpu")
    rows[:] = 3
    assert meta.token_adapter_idx.tolist() == [1, -1, 0, 1] and meta.sorted_token_idx.tolist() == [2, 0, 3]


def test_meta_without_torch_layouts_holds_the_same_kernel_inputs():
    idx = [2, -1, 0, 2, 0, 5]
    full, lean = LoraMeta.build(idx, "cpu"), LoraMeta.build(idx, "cpu", torch_layouts=False)
    assert lean.run_starts is None and lean.padded_token_idx is None and lean.padded_is_pad is None
    for field in ("token_adapter_idx", "sorted_token_idx", "seg_indptr", "seg_adapter_idx", "tile_table"):
        assert torch.equal(getattr(full, field), getattr(lean, field)), field
    for field in ("active_adapters", "seg_starts", "seg_ends", "max_seg_len", "tile_tokens"):
        assert getattr(full, field) == getattr(lean, field), field


def test_host_pack_moves_mixed_arrays_in_one_buffer():
    arrays = {
        "a": np.arange(5, dtype=np.int64) - 2,
        "b": np.array([[7, -1, 3]], dtype=np.int32),  # 12 bytes: the next array starts aligned at 64
        "c": np.array([[True], [False]]),
        "empty": np.zeros((2, 0), dtype=np.int32),
        "d": np.array([1 << 40], dtype=np.int64),
    }
    pack = HostPack(arrays)
    assert pack.offsets == {"a": 0, "b": 48, "c": 64, "empty": 80, "d": 80} and pack.nbytes == 96
    out = pack.to("cpu")
    for name, array in arrays.items():
        assert out[name].dtype == TORCH_DTYPES[array.dtype] and out[name].shape == array.shape
        assert np.array_equal(out[name].numpy(), array), name
    assert out["a"].untyped_storage().data_ptr() == out["d"].untyped_storage().data_ptr()  # one buffer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_host_pack_on_cuda_matches_the_host_arrays():
    arrays = {"a": np.arange(1000, dtype=np.int64), "b": np.arange(7, dtype=np.int32), "c": np.ones(3, dtype=bool)}
    for _ in range(3):  # the page-locked buffers are recycled: each step's copy must still be its own
        out = HostPack(arrays).to("cuda")
        arrays = {name: array[::-1].copy() for name, array in arrays.items()}
        for name, tensor in out.items():
            assert tensor.is_cuda and np.array_equal(tensor.cpu().numpy(), arrays[name][::-1]), name


@pytest.mark.parametrize("tile_tokens", [0, 16, 64])
def test_tile_table_covers_every_token_once_within_its_segment(tile_tokens):
    idx = [3] * 130 + [0, 5, 5, -1] + [0] * 17 + [-1] * 3  # one long segment, a 2-token one, an 18-token one
    meta = LoraMeta.build(idx, "cpu", tile_tokens=tile_tokens)
    assert meta.tile_tokens == (tile_tokens or 64)  # from the longest segment, at most 64
    segs, starts = meta.tile_table.tolist()
    bounds = meta.seg_indptr.tolist()
    covered = []
    for seg, start in zip(segs, starts, strict=True):
        end = min(start + meta.tile_tokens, bounds[seg + 1])
        assert bounds[seg] <= start < end
        covered += range(start, end)
    assert covered == list(range(len(meta.sorted_token_idx)))  # each once, in order
    expected_tiles = sum(-(-n // meta.tile_tokens) for n in (18, 130, 2))
    assert len(segs) == expected_tiles and meta.tile_table.dtype == torch.int32
    assert LoraMeta.build([4, 4], "cpu").tile_tokens == 16 and LoraMeta.build([-1], "cpu").tile_table.shape == (2, 0)


def test_graph_layout_sorts_tokens_by_row_into_fixed_buffers():
    rows = [2, -1, 0, 2, -1, 0, 0]  # 7 tokens over 3 rows (row 1 empty), two without an adapter
    sorted_idx, seg_indptr = np.full(7, 99), np.zeros(4, dtype=np.int32)
    tiles = np.zeros((2, graph_tiles(7, 3)), dtype=np.int32)
    fill_graph_layout(rows, sorted_idx, seg_indptr, tiles)
    assert sorted_idx.tolist() == [2, 5, 6, 0, 3, 99, 99]  # row 0's tokens, then row 2's; the rest untouched
    assert seg_indptr.tolist() == [0, 3, 3, 5]
    assert tiles[:, :2].tolist() == [[0, 2], [0, 3]] and (tiles[0, 2:] == NO_TILE).all()


def test_graph_tile_table_fits_any_step_of_its_bucket():
    gen = torch.Generator().manual_seed(0)
    for num_tokens, num_rows in [(1, 1), (16, 4), (64, 8), (37, 16)]:
        width = graph_tiles(num_tokens, num_rows)
        for _ in range(20):
            rows = torch.randint(-1, num_rows, (torch.randint(0, num_tokens + 1, (1,), generator=gen).item(),))
            counts = torch.bincount(rows[rows >= 0], minlength=num_rows)
            seg_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
            table = torch.zeros(2, width, dtype=torch.int32)
            fill_tile_table(table.numpy(), seg_indptr.numpy())
            used = table[0] != NO_TILE
            expected = tile_table(seg_indptr, GRAPH_TILE_TOKENS)
            assert torch.equal(table[:, : expected.shape[1]], torch.from_numpy(expected))
            assert int(used.sum()) == expected.shape[1] and not used[expected.shape[1] :].any()


@pytest.mark.parametrize("tile_tokens", [16, 0])
def test_triton_ops_cut_long_segments_into_tiles(tile_tokens):
    """A 130-token prompt beside a few decode tokens: several tiles of one segment, tiles of different segments
    in one launch, the last tile of each partly past its segment."""
    case = make_case(150, 4, 8, "uniform", "qkv", device=TRITON_DEVICE)
    idx = [2] * 130 + [0, 3, -1, 3, 1] * 4
    meta = LoraMeta.build(idx, TRITON_DEVICE, tile_tokens=tile_tokens)
    x = case.x.nan_to_num()
    z, delta = naive_lora(x.cpu(), case.lora_a.cpu(), case.lora_b.cpu(), idx, case.output_slices)
    case = dataclasses.replace(
        case, x=x, token_adapter_idx=idx, meta=meta, expected_z=z.to(TRITON_DEVICE), expected_y=case.y + delta.to(x)
    )
    check_ops(get_lora_ops("triton"), case)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_no_adapter_in_the_batch_does_nothing(backend):
    ops = get_lora_ops(backend)
    case = make_case(7, 3, 8, "uniform", "qkv", device=device_of(backend))
    meta = LoraMeta.build([-1] * 7, device_of(backend))
    out, y = case.out.clone(), case.y.clone()
    ops.lora_shrink(out, case.x, case.lora_a, meta)
    ops.lora_expand(y, case.expected_z, case.lora_b, meta, case.output_slices)
    ops.add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.output_slices)
    assert torch.equal(out, case.out) and torch.equal(y, case.y)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_rows_without_adapter_untouched(backend):
    """NaN inputs on the -1 rows must neither be written nor leak into other rows."""
    ops = get_lora_ops(backend)
    case = make_case(9, 3, 8, "uniform", "qkv", device=device_of(backend))
    idx = case.token_adapter_idx
    assert -1 in idx and any(i >= 0 for i in idx)
    y = case.y.clone()
    ops.add_lora(y, case.x, case.lora_a, case.lora_b, case.meta, case.output_slices)
    no_adapter = ~case.has_adapter
    assert torch.equal(y[no_adapter], case.y[no_adapter]) and not y.isnan().any()


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_strided_views_and_given_buffer(backend):
    """x, y and out as column views of wider tensors, as a fused projection makes them."""
    ops = get_lora_ops(backend)
    device = device_of(backend)
    case = make_case(11, 3, 8, "skewed", "qkv", device=device)
    wide_x = torch.full((11, case.x.shape[1] + 7), float("nan"), device=device)
    x = wide_x[:, 3 : 3 + case.x.shape[1]]
    x.copy_(case.x)
    wide_y = torch.zeros(11, case.y.shape[1] + 5, device=device)
    y = wide_y[:, 5:]
    y.copy_(case.y)
    buffer = torch.zeros(11, case.out.shape[1] + 2, device=device)[:, 1:-1]
    ops.add_lora(y, x, case.lora_a, case.lora_b, case.meta, case.output_slices, buffer=buffer)
    assert_rows(y, case.expected_y, case.has_adapter)
    assert torch.equal(wide_y[:, :5].cpu(), torch.zeros(11, 5))


TRITON_CASES = [  # (T, N, R, popularity, layer, with_pads): the interpreter is slow, so a representative few
    (1, 1, 16, "identical", "dense", False),
    (1, 8, 4, "uniform", "qkv", False),
    (7, 3, 4, "uniform", "qkv", True),
    (7, 3, 8, "skewed", "dense", True),
    (7, 1, 64, "segments", "gate_up", True),
    (7, 8, 16, "distinct", "qkv", True),
    (64, 8, 16, "distinct", "qkv", True),
    (64, 8, 64, "skewed", "gate_up", False),
    (64, 3, 8, "segments", "qkv", True),
    (64, 8, 4, "identical", "dense", True),
    (64, 3, 4, "uniform", "gate_up", True),
]


@pytest.mark.parametrize(("num_tokens", "num_adapters", "rank", "popularity", "layer", "with_pads"), TRITON_CASES)
def test_triton_ops_match_torch_ops(num_tokens, num_adapters, rank, popularity, layer, with_pads):
    case = make_case(num_tokens, num_adapters, rank, popularity, layer, with_pads, device=TRITON_DEVICE)
    triton_ops = get_lora_ops("triton")
    check_ops(triton_ops, case)
    outs, ys = [], []
    for ops in (triton_ops, torch_ops):
        outs.append(case.out.clone())
        ops.lora_shrink(outs[-1], case.x, case.lora_a, case.meta)
        ys.append(case.y.clone())
        ops.add_lora(ys[-1], case.x, case.lora_a, case.lora_b, case.meta, case.output_slices)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("parts", [2, 3, 5])
@pytest.mark.parametrize("popularity", ["uniform", "segments"])
def test_triton_split_k_partials_add_up_in_the_expand(parts, popularity):
    """The shrink into [P, T, S * R] fp32 partial sums over parts of H_in (5 parts of 3 steps: two parts hold none
    and must write zeros over the buffer's garbage), the expand adding them: the naive results."""
    import kernels.lora.triton_ops as triton_module

    case = make_case(64, 8, 16, popularity, "wide_in", device=TRITON_DEVICE)
    partials = torch.randn(parts, *case.out.shape, device=TRITON_DEVICE)  # garbage the shrink must overwrite
    triton_module.lora_shrink(partials, case.x, case.lora_a, case.meta)
    rows = case.has_adapter.to(TRITON_DEVICE)
    torch.testing.assert_close(partials.sum(0)[rows], case.expected_z[rows], rtol=1e-5, atol=1e-5)
    y = case.y.clone()
    triton_module.lora_expand(y, partials, case.lora_b, case.meta, case.output_slices)
    assert_rows(y, case.expected_y, case.has_adapter)
    y = case.y.clone()
    triton_module.add_lora(y, case.x, case.lora_a, case.lora_b, case.meta, case.output_slices, buffer=partials)
    assert_rows(y, case.expected_y, case.has_adapter)
    with pytest.raises(ValueError, match="fp32"):
        triton_module.lora_shrink(partials.half(), case.x, case.lora_a, case.meta)


FUSED_CASES = [  # (T, N, R, popularity, layer): odd ranks and widths, several column tiles, -1 rows
    (1, 1, 4, "identical", "dense"),
    (7, 3, 8, "skewed", "qkv"),
    (40, 3, 16, "segments", "wide_out"),
    (64, 8, 64, "uniform", "gate_up"),
    (64, 8, 5, "distinct", "wide_in"),
]


@pytest.mark.parametrize(("num_tokens", "num_adapters", "rank", "popularity", "layer"), FUSED_CASES)
def test_triton_fused_add_lora_matches_naive_reference(num_tokens, num_adapters, rank, popularity, layer):
    """Shrink and expand in one launch: each (tile, slice, column tile) program's own z, rows without an adapter
    (NaN x) untouched; through a CUDA graph's meta too (one segment per row, unused tiles exiting)."""
    import kernels.lora.triton_ops as triton_module

    case = make_case(num_tokens, num_adapters, rank, popularity, layer, device=TRITON_DEVICE)
    y = case.y.clone()
    triton_module.lora_fused(y, case.x, case.lora_a, case.lora_b, case.meta, case.output_slices)
    assert_rows(y, case.expected_y, case.has_adapter)
    rows = torch.tensor(case.token_adapter_idx)
    with_adapter = rows >= 0
    graph = graph_meta(rows[with_adapter], num_adapters, TRITON_DEVICE)  # as DecodeGraphs fills it
    y = case.y[with_adapter.to(TRITON_DEVICE)].clone()
    triton_module.lora_fused(y, case.x[with_adapter.to(TRITON_DEVICE)], case.lora_a, case.lora_b, graph,
                             case.output_slices)  # fmt: skip
    expected = case.expected_y[with_adapter.to(TRITON_DEVICE)]
    torch.testing.assert_close(y, expected.to(y.dtype), rtol=1e-5, atol=1e-5)


def test_triton_add_lora_fuses_only_small_layers_and_without_a_buffer(monkeypatch):
    """One launch where the repeated shrink is small (the 56M Llama's layers), two kernels for a 1B-class layer, a
    rank past one step, a given buffer, or FUSE_MAX_REPEATED_K 0: each way the naive result."""
    import kernels.lora.triton_ops as triton_module

    assert triton_module.fused_pays(512, 8, (512, 256, 256)) and triton_module.fused_pays(1408, 8, (512,))
    assert triton_module.fused_pays(512, 64, (1408, 1408))
    assert not triton_module.fused_pays(2048, 16, (2048, 512, 512)) and not triton_module.fused_pays(8192, 16, (2048,))
    assert not triton_module.fused_pays(512, 128, (512,))
    launches = []
    for name in ("_fused", "_shrink", "_expand"):
        launch = getattr(triton_module, name)
        monkeypatch.setattr(triton_module, name, lambda *args, _l=launch, _n=name: launches.append(_n) or _l(*args))
    case = make_case(64, 3, 8, "uniform", "qkv", device=TRITON_DEVICE)
    for buffer, fuse_max, expected in [(None, 8192, ["_fused"]), (case.out.clone(), 8192, ["_shrink", "_expand"]),
                                       (None, 0, ["_shrink", "_expand"])]:  # fmt: skip
        monkeypatch.setattr(triton_module, "FUSE_MAX_REPEATED_K", fuse_max)
        launches.clear()
        y = case.y.clone()
        triton_module.add_lora(y, case.x, case.lora_a, case.lora_b, case.meta, case.output_slices, buffer=buffer)
        assert launches == expected
        assert_rows(y, case.expected_y, case.has_adapter)
    with pytest.raises(ValueError, match="rank of at most 64"):
        big = make_case(4, 1, 128, "identical", "dense", device=TRITON_DEVICE)
        triton_module.lora_fused(big.y, big.x, big.lora_a, big.lora_b, big.meta, big.output_slices)


@pytest.mark.parametrize("group_tiles", [1, 2, 3, 8])
@pytest.mark.parametrize("rank", [16, 128])
def test_triton_expand_walks_groups_of_column_tiles(group_tiles, rank, monkeypatch):
    """Each expand program walks group_tiles column tiles of a slice (the group past a slice's end exits, the last
    tile is partial); a rank of 128 takes two 64-column steps of z per tile, 16 one step loaded once."""
    import kernels.lora.triton_ops as triton_module

    monkeypatch.setattr(triton_module, "expand_group_tiles", lambda programs, device: group_tiles)
    case = make_case(40, 3, rank, "skewed", "wide_out", device=TRITON_DEVICE)
    y = case.y.clone()
    triton_module.lora_expand(y, case.expected_z, case.lora_b, case.meta, case.output_slices)
    assert_rows(y, case.expected_y, case.has_adapter)


def test_triton_expand_groups_column_tiles_only_when_programs_are_many(monkeypatch):
    """132 multiprocessors, groups allowed up to 8 tiles: one column tile per program up to 4 programs per
    multiprocessor, then groups. By default (y moved in vectors) every program takes one tile."""
    import kernels.lora.triton_ops as triton_module

    monkeypatch.setattr(triton_module, "multiprocessors", lambda device: 132)
    cuda = torch.device("cuda")
    assert triton_module.expand_group_tiles(128 * 128, cuda) == 1
    monkeypatch.setattr(triton_module, "MAX_EXPAND_GROUP_TILES", 8)
    assert triton_module.expand_group_tiles(8 * 96, cuda) == 1  # a decode step's 8 tiles over qkv's 96 column tiles
    assert triton_module.expand_group_tiles(32 * 128, cuda) == 7  # a 2048-token prefill's gate_up
    assert triton_module.expand_group_tiles(128 * 128, cuda) == 8


def test_triton_shrink_out_splits_h_in_only_when_programs_are_few(monkeypatch):
    """On a device of 132 multiprocessors: a decode step's few tiles get fp32 partials over a power of two of parts
    of H_in (at most one per 256-column step, at most 4), a long prefill's many tiles the plain [T, S * R] buffer."""
    import kernels.lora.triton_ops as triton_module

    monkeypatch.setattr(triton_module, "multiprocessors", lambda device: 132)
    lora_a = torch.empty(16, 48, 2048, dtype=torch.bfloat16)  # [N, S * R, H_in]: 48 columns = 2 column tiles
    decode = LoraMeta.build(torch.arange(64) % 8, "cpu")  # 8 tiles
    z = triton_module.shrink_out(torch.empty(64, 2048, dtype=torch.bfloat16), lora_a, decode)
    assert z.shape == (4, 64, 48) and z.dtype == torch.float32  # 16 programs want 9 parts: at most 4
    prefill = LoraMeta.build(torch.arange(16384) // 1024, "cpu")  # 16 segments of 1024: 256 tiles of 64
    z = triton_module.shrink_out(torch.empty(16384, 2048, dtype=torch.bfloat16), lora_a, prefill)
    assert z.shape == (16384, 48) and z.dtype == torch.bfloat16
    assert triton_module.shrink_parts(8, 48, torch.empty(1, 512, dtype=torch.bfloat16)) == 2  # 2 steps of H_in
    assert triton_module.shrink_parts(64, 48, torch.empty(1, 4096, dtype=torch.bfloat16)) == 2  # 128 programs want 2


BF16_DOT_BROKEN = pytest.mark.skipif(
    INTERPRETED, reason="Triton's interpreter tl.dot multiplies bf16 bit patterns (triton#11584)"
)


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [
        ("torch", torch.float16),
        ("torch", torch.bfloat16),
        ("triton", torch.float16),
        pytest.param("triton", torch.bfloat16, marks=BF16_DOT_BROKEN),
    ],
)
@pytest.mark.parametrize("popularity", ["uniform", "segments"])
def test_half_precision(backend, dtype, popularity):
    case = make_case(64, 8, 16, popularity, "qkv", dtype=dtype, device=device_of(backend))
    y = case.y.clone()
    get_lora_ops(backend).add_lora(y, case.x, case.lora_a, case.lora_b, case.meta, case.output_slices)
    assert y.dtype == dtype
    assert_rows(y, case.expected_y, case.has_adapter, tol={torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype])


@pytest.mark.parametrize("popularity", ["uniform", "segments"])
def test_cpu_ops_run_bfloat16_in_cpp_at_least_as_close_as_torch(popularity, require_cpu_kernel, monkeypatch):
    """bf16 through the C++ ops (torch's ops turned off: nothing may fall back to them): within bf16 tolerance of
    the fp32 reference, and no further from it than torch's bf16 ops (z stays fp32, y is rounded once)."""
    import kernels.lora.cpu_ops as cpu_module

    case = make_case(64, 8, 16, popularity, "qkv", dtype=torch.bfloat16)
    reference = torch_ops.add_lora
    y_torch = case.y.clone()
    reference(y_torch, case.x, case.lora_a, case.lora_b, case.meta, case.output_slices)
    monkeypatch.setattr(cpu_module, "torch_ops", None)  # a fall back would raise AttributeError
    check_ops(get_lora_ops("cpu"), case, tol=3e-2)
    y_cpu = case.y.clone()
    get_lora_ops("cpu").add_lora(y_cpu, case.x, case.lora_a, case.lora_b, case.meta, case.output_slices)
    assert y_cpu.dtype == torch.bfloat16
    rows_with = case.has_adapter

    def error(y: Tensor) -> float:
        return (y[rows_with].float() - case.expected_y[rows_with]).abs().mean().item()

    assert error(y_cpu) <= error(y_torch)


@pytest.mark.parametrize("backend", ["torch", "triton", "cpu"])
def test_ops_reject_mismatched_shapes(backend):
    ops = get_lora_ops(backend)
    case = make_case(7, 3, 8, "uniform", "qkv", device=device_of(backend))
    with pytest.raises(ValueError, match="lora_a"):
        ops.lora_shrink(case.out, case.x[:, :-1], case.lora_a, case.meta)
    with pytest.raises(ValueError, match="past the 2 stacked rows"):
        ops.lora_shrink(case.out, case.x, case.lora_a[:2], case.meta)
    with pytest.raises(ValueError, match="output_slices"):
        ops.lora_expand(case.y, case.expected_z, case.lora_b, case.meta, (40, 24, 23))
    with pytest.raises(ValueError, match="rows"):
        ops.lora_expand(case.y[:-1], case.expected_z[:-1], case.lora_b, case.meta, case.output_slices)


def test_backend_by_name_and_default_add_lora():
    with pytest.raises(ValueError, match="unknown LoRA backend"):
        get_lora_ops("cuda")
    assert add_lora is torch_ops.add_lora


def test_kernels_import_lazily_and_nothing_of_ours():
    code = (
        "import sys, kernels.lora\n"
        "assert 'triton' not in sys.modules\n"
        "ours = ('engine', 'adapters', 'registry', 'gateway')\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ours]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("popularity", ["distinct", "skewed", "segments"])
def test_triton_ops_match_torch_ops_on_cuda(dtype, popularity):
    """A real-sized packed layer: 512 tokens over 32 adapters of rank 16, H_in 4096, qkv (4096, 1024, 1024)."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_adapters, rank, output_slices = 512, 32, 16, (4096, 1024, 1024)
    idx = assign_adapters(num_tokens, num_adapters, popularity, True, gen)
    meta = LoraMeta.build(idx, "cuda")
    x = torch.randn(num_tokens, 4096, device="cuda", dtype=dtype)
    lora_a = torch.randn(num_adapters, 3 * rank, 4096, device="cuda", dtype=dtype) / 64
    lora_b = torch.randn(num_adapters, sum(output_slices), rank, device="cuda", dtype=dtype) / 4
    y = torch.randn(num_tokens, sum(output_slices), device="cuda", dtype=dtype)
    ref = y.float()
    torch_ops.add_lora(ref, x.float(), lora_a.float(), lora_b.float(), meta, output_slices)
    get_lora_ops("triton").add_lora(y, x, lora_a, lora_b, meta, output_slices)
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)


def test_expand_asserts_the_largest_alignment_every_slice_has():
    import kernels.lora.triton_ops as triton_module

    def align(output_slices):
        return triton_module._slice_layout(output_slices, torch.device("cpu"), triton_module.SLICE_ALIGN)[1]

    assert align((4096, 1024, 1024)) == 16
    assert align((40, 24, 24)) == 8
    assert align((52, 52)) == 4
    assert align((33, 16)) == 1


@pytest.mark.parametrize("slice_align", [16, 1])
def test_triton_expand_moves_y_in_16_byte_vectors_when_its_slices_are_aligned(slice_align):
    """y's columns start at a slice bound read from memory: unless the expand asserts the bounds' alignment, Triton
    cannot vectorize y's loads and stores and moves it two bytes at a time (H100, a 2048-token prefill's gate_up
    expand: ~53% of the copy rate). Compiled for Hopper here (tests/triton_ptx.py, outside the interpreter), bf16,
    a decode graph's 16-token tiles over 4 parts."""
    pytest.importorskip("triton")
    meta = {"sorted_token_idx_ptr": "*i64", "seg_indptr_ptr": "*i64", "seg_adapter_idx_ptr": "*i64",
            "tile_seg_ptr": "*i32", "tile_start_ptr": "*i32", "slice_bounds_ptr": "*i32"}  # fmt: skip
    ints = {"rank": 16, "col_groups": 8, "group_tiles": 8, "stride_yt": 6144, "stride_yh": 1, "stride_zp": 256 * 48,
            "stride_zt": 48, "stride_zw": 1, "stride_bn": 6144 * 16, "stride_bh": 16, "stride_br": 1}  # fmt: skip
    constexprs = {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 16, "PARTS": 4, "ONE_K_STEP": True,
                  "DOT_PRECISION": "tf32", "SLICE_ALIGN": slice_align}  # fmt: skip
    spec = {"kernel": "kernels.lora.triton_ops:_expand_kernel", "launch": "EXPAND_LAUNCH", "constexprs": constexprs,
            "pointers": {"y_ptr": "*bf16", "z_ptr": "*fp32", "lora_b_ptr": "*bf16", **meta}, "ints": ints}  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = [sys.executable, os.path.join(os.path.dirname(__file__), "triton_ptx.py"), json.dumps(spec)]
    done = subprocess.run(probe, capture_output=True, text=True, env=env, timeout=300)
    if done.returncode == 3:  # a Triton without its CUDA backend's compiler
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, done.stderr[-2000:]
    accesses = json.loads(done.stdout)  # {PTX instruction: count}
    two_byte = accesses.get("ld.global.b16", 0) + accesses.get("st.global.b16", 0)
    vector_stores = accesses.get("st.global.v4.b32", 0)
    if slice_align == 16:
        assert two_byte == 0 and vector_stores > 0, accesses
    else:  # the test's own control: the same kernel without the assertion does move y element by element
        assert two_byte > 0 and vector_stores == 0, accesses
