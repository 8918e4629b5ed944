"""Adapters that would poison the logits are refused when read (issue 15), with AdapterError naming the problem: an
absurd or non-finite scaling, non-finite weights (named by tensor), weights that overflow the serving dtype, and
an adapter made for another base model, named as such rather than by a side effect of its depth. Checked through
AdapterCache.load / read: the path the gateway's registration and `--lora-modules` startup take."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file, save_file

from adapters import AdapterError, BaseModelSpec, load_lora
from adapters.cache import AdapterCache
from adapters.ref import LoRARequest
from engine.models.llama import lora_targets
from tests.hf_models import make_adapter, make_model

QV = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
Q_PROJ_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def make_cache(spec: BaseModelSpec, dtype: torch.dtype = torch.float32) -> AdapterCache:
    return AdapterCache(spec, lora_targets, 2, 4, 8, torch.device("cpu"), dtype)


def read_refused(spec: BaseModelSpec, directory: Path, dtype: torch.dtype = torch.float32) -> str:
    """The AdapterError message of reading the adapter through an AdapterCache (load and read agree)."""
    cache = make_cache(spec, dtype)
    lora = LoRARequest("bad@1", str(directory))
    try:
        with pytest.raises(AdapterError) as refused:
            cache.load(lora)
        with pytest.raises(AdapterError, match=re.escape(str(refused.value))):
            cache.read(lora)
    finally:
        cache.shutdown()
    message = str(refused.value)
    assert message.startswith("adapter 'bad@1': ")
    return message


def edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))  # inf and NaN as JSON's extensions


def edit_tensor(directory: Path, name: str, edit) -> None:
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors[name])
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"lora_alpha": 1e300}, ["model.layers.0.self_attn.q_proj", "lora_alpha / r = 1e+300 / 4", "up to 1000"]),
        ({"lora_alpha": 4001}, ["scaling lora_alpha / r = 4001 / 4 = 1000.25"]),
        ({"lora_alpha": -1e300}, ["= -2.5e+299"]),
        ({"lora_alpha": 1e4, "use_rslora": True}, ["lora_alpha / sqrt(r) = 10000 / sqrt(4) = 5000"]),
        ({"alpha_pattern": {"v_proj": 1e300}}, ["model.layers.0.self_attn.v_proj has scaling", "1e+300 / 4"]),
        ({"lora_alpha": math.inf}, ["lora_alpha=inf", "finite"]),
        ({"lora_alpha": math.nan}, ["lora_alpha=nan", "finite"]),
    ],
    ids=["1e300", "just-above-1000", "-1e300", "rslora", "alpha-pattern", "inf", "nan"],
)
def test_an_absurd_or_non_finite_scaling_is_refused_naming_it(base, spec, tmp_path, changes, words):
    make_adapter(base, tmp_path, config=QV)
    edit_config(tmp_path, **changes)
    message = read_refused(spec, tmp_path)
    for word in words:
        assert word in message, message


def test_a_scaling_of_1000_is_served(base, spec, tmp_path):
    make_adapter(base, tmp_path, config=QV)
    edit_config(tmp_path, lora_alpha=4000)
    assert {s for _, _, s in load_lora(tmp_path, spec, 8).weights.values()} == {1000.0}


@pytest.mark.parametrize(
    ("tensor", "value"),
    [(Q_PROJ_B, math.nan), (Q_PROJ_B.replace("lora_B", "lora_A"), math.inf), (Q_PROJ_B, -math.inf)],
    ids=["nan-in-B", "inf-in-A", "-inf-in-B"],
)
def test_a_non_finite_weight_is_refused_naming_the_tensor(base, spec, tmp_path, tensor, value):
    make_adapter(base, tmp_path, config=QV)
    edit_tensor(tmp_path, tensor, lambda t: t.view(-1).__setitem__(5, value))
    ab = "lora_B" if "lora_B" in tensor else "lora_A"
    assert f"model.layers.0.self_attn.q_proj.{ab} holds NaN or Inf" in read_refused(spec, tmp_path)


def test_weights_that_overflow_the_serving_dtype_are_refused(base, spec, tmp_path):
    make_adapter(base, tmp_path, config=QV)
    edit_config(tmp_path, lora_alpha=4000)  # scaling 1000, allowed
    edit_tensor(tmp_path, Q_PROJ_B, lambda t: t.view(-1).__setitem__(0, 100.0))  # 1e5 once scaled: past fp16's 65504
    message = read_refused(spec, tmp_path, torch.float16)
    assert "layer 0 q_proj" in message and "overflows torch.float16" in message
    cache = make_cache(spec, torch.float32)  # float32 holds it
    cache.load(LoRARequest("ok@1", str(tmp_path)))
    cache.shutdown()


@pytest.fixture(scope="module")
def adapter_for_another_base(tmp_path_factory, tokenizer):
    """An adapter made for a base of hidden size 128 and 2 layers."""
    directory = tmp_path_factory.mktemp("other")
    hf = make_model(directory / "base", tokenizer, hidden_size=128, num_attention_heads=4)
    return make_adapter(hf, directory / "adapter", config=QV)


def test_an_adapter_for_a_base_of_another_hidden_size_is_named_so_on_a_deeper_base(adapter_for_another_base):
    bigger = BaseModelSpec.from_dims(192, 256, 4, 2, None, 4)  # 4 layers: the adapter's 2 used to be the complaint
    message = read_refused(bigger, Path(adapter_for_another_base))
    assert "lora_A has shape (4, 128), the base model's q_proj takes 192 inputs, not 128" in message
    assert "made for another base model" in message
    assert "no weights are given" not in message


def test_an_adapter_for_a_deeper_base_of_another_hidden_size_is_named_so_too(tmp_path, tokenizer, spec):
    deeper = make_model(tmp_path / "base", tokenizer, hidden_size=128, num_hidden_layers=4)
    make_adapter(deeper, tmp_path / "adapter", config=QV)
    message = read_refused(spec, tmp_path / "adapter")  # 2 layers of hidden 64
    assert "takes 64 inputs, not 128" in message and "made for another base model" in message
