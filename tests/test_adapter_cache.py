"""AdapterCache units (no engine): pin counts, LRU eviction of device rows, pinned rows never evicted, removal
while pinned completing at the last release, the host tier's LRU bound (max_cpu_loras), and what a host copy holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from adapters.base_spec import BaseModelSpec
from adapters.cache import AdapterCache
from adapters.lora_weights import load_lora
from adapters.ref import LoRARequest
from engine.models.llama import lora_targets
from tests.hf_models import make_adapter, make_model

NUM_ADAPTERS = 4


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory, tokenizer) -> tuple[BaseModelSpec, list[LoRARequest]]:
    """The tiny base's spec and four random rank-4 adapters on it, a@1 to d@1."""
    root = tmp_path_factory.mktemp("adapter-cache")
    hf = make_model(root / "base", tokenizer, "llama")
    names = "abcd"[:NUM_ADAPTERS]
    loras = [LoRARequest(f"{name}@1", make_adapter(hf, root / name, seed=i, r=4)) for i, name in enumerate(names)]
    return BaseModelSpec.from_hf_config(hf.config), loras


def make_cache(spec: BaseModelSpec, max_loras: int, max_cpu_loras: int) -> AdapterCache:
    return AdapterCache(spec, lora_targets, max_loras, max_cpu_loras, 8, torch.device("cpu"), torch.float32)


def resident(cache: AdapterCache) -> list[str]:
    return [name for name, _ in cache.resident_keys()]


def host(cache: AdapterCache) -> list[str]:
    return [name for name, _ in cache.host_keys()]


@pytest.fixture
def loaded(tiny_adapters):
    """A cache with 2 device rows and every adapter in host memory."""
    spec, loras = tiny_adapters
    cache = make_cache(spec, max_loras=2, max_cpu_loras=NUM_ADAPTERS)
    for lora in loras:
        cache.load(lora)
    yield cache, loras
    cache.shutdown()


def test_pins_count_every_acquire_and_the_row_unpins_at_the_last_release(loaded):
    cache, (a, b, *_) = loaded
    row = cache.acquire(a)
    assert cache.acquire(a) == row and cache.num_pinned == 1  # one row, pinned twice
    assert cache.acquire(b) not in (None, row) and cache.num_pinned == 2
    cache.release(row)
    assert cache.num_pinned == 2  # a's row still has one pin
    cache.release(row)
    assert cache.num_pinned == 1 and cache.tier(a) == "device"  # unpinned, still resident
    with pytest.raises(AssertionError, match="not pinned"):
        cache.release(row)


def test_a_new_adapter_takes_the_least_recently_used_unpinned_row(loaded):
    cache, (a, b, c, _) = loaded
    for lora in (a, b, a):  # a used last
        cache.release(cache.acquire(lora))
    assert resident(cache) == ["b@1", "a@1"]
    row_b = cache._rows.row_of[b.key]
    assert cache.acquire(c) == row_b  # b was the least recently used
    assert resident(cache) == ["a@1", "c@1"] and cache.tier(b) == "host"
    assert cache.stats.device_evictions == 1 and cache.stats.activations == 3


def test_a_pinned_row_is_never_evicted(loaded):
    cache, (a, b, c, d) = loaded
    row_a, row_b = cache.acquire(a), cache.acquire(b)
    assert cache.acquire(c) is None  # every row pinned: c waits
    weights_b = cache.lora_b[0]["qkv_proj"][row_b].clone()
    cache.release(row_a)
    assert cache.acquire(c) == row_a  # the row a no longer pins
    assert cache.acquire(d) is None and cache.tier(a) == "host"
    assert resident(cache) == ["b@1", "c@1"]
    assert torch.equal(cache.lora_b[0]["qkv_proj"][row_b], weights_b)  # b's row never rewritten


def test_removing_a_pinned_adapter_frees_its_row_at_the_last_release(loaded):
    cache, (a, b, c, _) = loaded
    row = cache.acquire(a)
    cache.acquire(a)
    assert cache.evict(a) is True  # still pinned: draining
    assert cache.tier(a) == "disk" and cache.digest(a) is None and "a@1" not in resident(cache)
    cache.load(a)  # registered again meanwhile: its next use must wait for the old row to drain
    assert cache.acquire(a) is None and cache.tier(a) == "host"
    cache.release(row)
    assert cache.acquire(b) is not None  # one pin is left on a's row, so b takes the other row ...
    assert cache.acquire(c) is None  # ... and there is none for c
    cache.release(row)
    assert cache.num_resident == 1  # the last release freed it: only b is left
    assert cache.acquire(c) is not None and resident(cache) == ["b@1", "c@1"]


def test_unloading_keeps_the_host_copy_and_waits_for_pins(loaded):
    cache, (a, *_) = loaded
    row = cache.acquire(a)
    assert cache.unload(a) is True and cache.tier(a) == "host"
    assert cache.acquire(a) is None  # not on that row again until it drains
    cache.release(row)
    assert cache.num_resident == 0 and cache.unload(a) is False
    assert cache.acquire(a) is not None and cache.digest(a) is not None


def test_the_host_tier_keeps_the_max_cpu_loras_most_recently_used(tiny_adapters):
    spec, (a, b, c, d) = tiny_adapters
    cache = make_cache(spec, max_loras=1, max_cpu_loras=2)
    try:
        cache.load(a)
        cache.load(b)
        cache.release(cache.acquire(a))  # a used: b is now the least recently used
        cache.load(c)
        assert host(cache) == ["a@1", "c@1"] and cache.stats.host_evictions == 1
        cache.load(a)  # already there: not read again, but most recently used
        cache.load(d)
        assert host(cache) == ["a@1", "d@1"] and cache.stats.host_evictions == 2
        assert cache.stats.loads == 4  # a was read once
        assert cache.tier(b) == cache.tier(c) == "disk"
        assert cache.digest(b) is not None  # its identity outlives the host copy
    finally:
        cache.shutdown()


def test_a_row_records_the_rank_of_the_adapter_it_holds(loaded):
    """Rank-4 adapters in a stack of R = 8: the CPU kernels read each row's rank to skip its zero columns."""
    cache, (a, *_) = loaded
    assert cache.row_ranks.tolist() == [8, 8]  # rows never written: every column counts
    row = cache.acquire(a)
    assert cache.row_ranks[row] == 4
    cache.release(row)


def test_the_transposed_b_stacks_follow_every_row_written(tiny_adapters):
    """transposed_b: lora_b is lora_bt's transposed view, so writing a row writes both, and the CPU expand never
    transposes a whole stack again after an activation."""
    from kernels.lora import cpu_ops

    spec, loras = tiny_adapters
    cache = AdapterCache(spec, lora_targets, 2, NUM_ADAPTERS, 8, torch.device("cpu"), torch.float32, transposed_b=True)
    try:
        for lora in (*loras, loras[0]):  # four adapters through two rows: rows rewritten
            cache.load(lora)
            cache.release(cache.acquire(lora))
        assert cache.stats.activations == 5 and cache.stats.device_evictions == 3
        for layer_b, layer_bt in zip(cache.lora_b, cache.lora_bt, strict=True):
            for name, b in layer_b.items():
                assert torch.equal(layer_bt[name], b.transpose(1, 2)), name
                assert b.data_ptr() == layer_bt[name].data_ptr() and layer_bt[name].is_contiguous(), name
        row, host = cache.acquire(loras[0]), cache.read(loras[0])
        for (layer, name), (_, bt_row) in host.rows.items():  # B^T rows in host memory too: copies, not transposes
            assert bt_row.shape == cache.lora_bt[layer][name].shape[1:] and bt_row.is_contiguous()  # [R, H_out]
            assert torch.equal(cache.lora_bt[layer][name][row], bt_row), (layer, name)
        cache.release(row)
        b, bt = cache.lora_b[0]["qkv_proj"], cache.lora_bt[0]["qkv_proj"]
        cpu_ops.keep_transposed(b, bt)
        assert cpu_ops.transposed(b) is bt  # used as it is, whatever b's version
        with pytest.raises(ValueError, match="transpose"):
            cpu_ops.keep_transposed(b, bt.transpose(1, 2))
    finally:
        cache.shutdown()
    assert make_cache(spec, 1, 1).lora_bt is None  # only when asked


@pytest.mark.parametrize("transposed_b", [False, True], ids=["b", "bt"])
@pytest.mark.parametrize("alpha_pattern", [{}, {"k_proj": 3, "up_proj": 40}], ids=["one-scaling", "mixed-scalings"])
def test_full_rank_rows_are_the_padded_rows_without_the_padding(
    tiny_adapters, tokenizer, tmp_path, alpha_pattern, transposed_b
):
    """An adapter whose rank is the stack's R takes the path that packs all layers at once (with one scaling or
    mixed ones); under R = 2r it is padded a layer at a time: the same A rows and scaled B columns (B^T's rows with
    transposed_b), and zeros past r."""
    from peft import LoraConfig

    spec, _ = tiny_adapters
    hf = make_model(tmp_path / "base", tokenizer, "llama")
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", alpha_pattern=alpha_pattern)
    lora = LoRARequest("full@1", make_adapter(hf, tmp_path / "full", seed=7, config=config))
    args = (spec, lora_targets, 1, 1)
    exact = AdapterCache(*args, 4, torch.device("cpu"), torch.float32, transposed_b=transposed_b)
    padded = AdapterCache(*args, 8, torch.device("cpu"), torch.float32)
    try:
        rows, padded_rows, weights = exact.read(lora).rows, padded.read(lora).rows, load_lora(lora.path, spec, 8)
        assert rows.keys() == padded_rows.keys()
        for key, (a, b) in rows.items():
            pa, pb = padded_rows[key]
            layer, modules = key[0], lora_targets[key[1]]
            assert torch.equal(pa.view(len(modules), 8, -1)[:, :4].reshape(a.shape), a), key
            assert torch.equal(pb[:, :4], b.T if transposed_b else b) and not pb[:, 4:].any(), key
            expected_b = torch.cat([weights.weights[layer, m][1] * weights.weights[layer, m][2] for m in modules])
            assert torch.equal(pb[:, :4], expected_b), key
    finally:
        exact.shutdown()
        padded.shutdown()


def test_the_host_copy_is_the_packed_rows_alone(tiny_adapters):
    """What `read` keeps of an adapter is its packed rows, and its metadata without the tensors as read: kept
    beside the rows, they would double the host memory every adapter in the host tier holds."""
    spec, (a, *_) = tiny_adapters
    cache = make_cache(spec, max_loras=1, max_cpu_loras=1)
    try:
        host = cache.read(a)
        assert host.rows and all(isinstance(t, torch.Tensor) for row in host.rows.values() for t in row)
        assert list(_tensors_in(host.weights)) == []
        assert host.weights.digest.startswith("sha256:") and host.weights.rank == 4 and host.weights.num_bytes > 0
    finally:
        cache.shutdown()


def _tensors_in(value):
    """Every tensor reachable from `value` through dataclass fields, dicts, lists, tuples and sets."""
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _tensors_in(getattr(value, f.name))
    elif isinstance(value, dict):
        for item in value.items():
            yield from _tensors_in(item)
    elif isinstance(value, list | tuple | set | frozenset):
        for item in value:
            yield from _tensors_in(item)
