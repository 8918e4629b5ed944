"""An adapter whose weights-file header and config match one read before is read through the kept layout
(adapters/file_layout.py): the same LoRAWeights as the full checks give, its values still checked, and a change to
anything the checks looked at (config, header, rank limit, base model) read the whole way again."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from adapters import AdapterError, BaseModelSpec, file_layout, load_lora
from adapters.locked_lru import LockedLRU
from tests.hf_models import make_adapter

MAX_RANK = 16
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def layouts(monkeypatch):
    """An empty layout cache, for this test alone."""
    fresh = LockedLRU(file_layout.MAX_LAYOUTS)
    monkeypatch.setattr(file_layout, "LAYOUTS", fresh)
    monkeypatch.setattr("adapters.lora_weights.LAYOUTS", fresh)
    return fresh


def fully_checked(path: Path, spec: BaseModelSpec, monkeypatch, max_rank: int = MAX_RANK):
    """load_lora with no layout kept: every check run."""
    with monkeypatch.context() as m:
        empty = LockedLRU(file_layout.MAX_LAYOUTS)
        m.setattr("adapters.lora_weights.LAYOUTS", empty)
        return load_lora(path, spec, max_rank)


def assert_same(read, expected) -> None:
    assert (read.rank, read.digest, read.target_modules, read.num_bytes, read.alpha, read.largest) == (
        expected.rank,
        expected.digest,
        expected.target_modules,
        expected.num_bytes,
        expected.alpha,
        expected.largest,
    )
    assert list(read.weights) == list(expected.weights)  # module order
    for module, (a, b, scaling) in expected.weights.items():
        got_a, got_b, got_scaling = read.weights[module]
        assert got_a.dtype == got_b.dtype == torch.float32
        torch.testing.assert_close(got_a, a, rtol=0, atol=0)
        torch.testing.assert_close(got_b, b, rtol=0, atol=0)
        assert got_scaling == scaling


def set_value(directory: Path, tensor: str, index: int, value: float) -> None:
    """One value of one stored tensor changed, the file rewritten with the same header."""
    path = directory / WEIGHTS
    header = path.read_bytes()[: 8 + int.from_bytes(path.read_bytes()[:8], "little")]
    tensors = load_file(path)
    tensors[tensor].view(-1)[index] = value
    save_file(tensors, path, metadata={"format": "pt"})
    assert path.read_bytes().startswith(header)


@pytest.mark.parametrize(
    "config",
    [
        LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
        LoraConfig(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"v_proj": 4}),
    ],
    ids=["all-linear", "rank-pattern"],
)
def test_an_adapter_of_a_known_layout_reads_as_the_full_checks_read_it(
    base, spec, tmp_path, layouts, monkeypatch, config
):
    first = make_adapter(base, tmp_path / "a", seed=1, config=config)
    second = make_adapter(base, tmp_path / "b", seed=2, config=config)
    assert_same(load_lora(first, spec, MAX_RANK), fully_checked(Path(first), spec, monkeypatch))
    assert len(layouts) == 1 and layouts.hits == 0
    read = load_lora(second, spec, MAX_RANK)
    assert layouts.hits == 1  # through the layout
    expected = fully_checked(Path(second), spec, monkeypatch)
    assert_same(read, expected)
    assert read.digest != load_lora(first, spec, MAX_RANK).digest


def test_a_half_precision_adapter_of_a_known_layout_reads_as_fp32(base, spec, tmp_path, layouts, monkeypatch):
    for name, seed in (("a", 1), ("b", 2)):
        make_adapter(base, tmp_path / name, seed=seed)
        tensors = load_file(tmp_path / name / WEIGHTS)
        save_file({k: t.half() for k, t in tensors.items()}, tmp_path / name / WEIGHTS, metadata={"format": "pt"})
    load_lora(tmp_path / "a", spec, MAX_RANK)
    read = load_lora(tmp_path / "b", spec, MAX_RANK)
    assert layouts.hits == 1
    assert_same(read, fully_checked(tmp_path / "b", spec, monkeypatch))


@pytest.mark.parametrize(("ab", "value"), [("lora_A", math.nan), ("lora_B", math.inf)])
def test_a_known_layout_with_a_non_finite_value_is_refused_naming_the_tensor(base, spec, tmp_path, layouts, ab, value):
    make_adapter(base, tmp_path / "a", seed=1)
    make_adapter(base, tmp_path / "b", seed=2)
    load_lora(tmp_path / "a", spec, MAX_RANK)
    tensor = f"base_model.model.model.layers.1.mlp.up_proj.{ab}.weight"
    set_value(tmp_path / "b", tensor, 3, value)
    with pytest.raises(AdapterError, match=rf"model\.layers\.1\.mlp\.up_proj\.{ab} holds NaN or Inf"):
        load_lora(tmp_path / "b", spec, MAX_RANK)
    assert layouts.hits == 1  # the layout was found; its values sent the read the whole way


def test_another_config_is_read_the_whole_way(base, spec, tmp_path, layouts, monkeypatch):
    make_adapter(base, tmp_path / "a", seed=1)
    make_adapter(base, tmp_path / "b", seed=1)
    load_lora(tmp_path / "a", spec, MAX_RANK)
    config = tmp_path / "b" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_alpha": 4}))
    read = load_lora(tmp_path / "b", spec, MAX_RANK)
    assert layouts.hits == 0 and len(layouts) == 2
    assert {s for _, _, s in read.weights.values()} == {0.5}  # 4 / 8, not the first config's 16 / 8
    config.write_text(json.dumps({**json.loads(config.read_text()), "target_modules": ["q_proj"]}))
    with pytest.raises(AdapterError, match=r"adapter_config\.json does not target it"):
        load_lora(tmp_path / "b", spec, MAX_RANK)


def test_a_lower_rank_limit_or_another_base_model_is_checked_again(base, spec, tmp_path, layouts):
    make_adapter(base, tmp_path / "a", seed=1, r=8)
    make_adapter(base, tmp_path / "b", seed=2, r=8)
    load_lora(tmp_path / "a", spec, MAX_RANK)
    with pytest.raises(AdapterError, match="above the server's max_lora_rank 4"):
        load_lora(tmp_path / "b", spec, 4)
    deeper = BaseModelSpec(num_layers=1, module_shapes=spec.module_shapes)
    with pytest.raises(AdapterError, match="in layer 1, but the base model has 1 layers"):
        load_lora(tmp_path / "b", deeper, MAX_RANK)
    assert layouts.hits == 0


def test_a_truncated_file_with_a_known_header_is_refused(base, spec, tmp_path, layouts):
    make_adapter(base, tmp_path / "a", seed=1)
    make_adapter(base, tmp_path / "b", seed=2)
    load_lora(tmp_path / "a", spec, MAX_RANK)
    path = tmp_path / "b" / WEIGHTS
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(AdapterError, match="cannot read"):
        load_lora(tmp_path / "b", spec, MAX_RANK)
    assert layouts.hits == 1
