"""Model loading: sharded checkpoints, and a clear error for each kind of broken model directory."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model_loader import WeightLoadError, load_model
from engine.models.arch import UnsupportedModelError
from tests.hf_models import make_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    directory = tmp_path_factory.mktemp("llama-load")
    make_model(directory, tokenizer, "llama")
    return directory


def copy_of(model_dir, tmp_path):
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


def load(directory):
    return load_model(directory, torch.float32, "cpu", "torch")


def test_sharded_checkpoint_with_index_loads_the_same_weights(model_dir, tmp_path, tokenizer):
    sharded = tmp_path / "sharded"
    hf = make_model(sharded, tokenizer, "llama")
    hf.save_pretrained(sharded, max_shard_size="40KB")
    for f in sharded.glob("model.safetensors"):
        f.unlink()
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    ours, reference = load(sharded), load(model_dir)
    for (name, a), (_, b) in zip(ours.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_unsupported_architecture_is_named(model_dir, tmp_path):
    broken = copy_of(model_dir, tmp_path)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load(broken)


def test_missing_weight_file_is_named(model_dir, tmp_path):
    broken = copy_of(model_dir, tmp_path)
    (broken / "model.safetensors").unlink()
    with pytest.raises(WeightLoadError, match=r"no \*\.safetensors"):
        load(broken)


def test_truncated_weight_file_is_named(model_dir, tmp_path):
    broken = copy_of(model_dir, tmp_path)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match=r"model\.safetensors"):
        load(broken)


def test_wrong_shape_names_the_tensor(model_dir, tmp_path):
    broken = copy_of(model_dir, tmp_path)
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=f"'{name}'.*\\(3, 3\\)"):
        load(broken)


def test_missing_tensor_is_named(model_dir, tmp_path):
    broken = copy_of(model_dir, tmp_path)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        load(broken)
