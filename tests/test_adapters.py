"""adapters/: real PEFT adapters (written by peft through make_adapter) read through load_lora, and refused when bad."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel
from peft.tuners.lora import Linear as PeftLoraLinear
from safetensors.torch import load as load_safetensors
from safetensors.torch import load_file, save_file

from adapters import AdapterError, BaseModelSpec, load_lora, lora_weights
from adapters import content_digest as digests
from adapters.locked_lru import LockedLRU
from adapters.lora_weights import magnitudes
from tests.hf_models import make_adapter, make_model

MAX_RANK = 16


def edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_tensors(directory: Path, edit) -> None:
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    save_file(edit(tensors), path, metadata={"format": "pt"})


def test_base_spec_shapes(base, spec):
    assert spec.num_layers == 2
    assert spec.module_shapes == {
        "q_proj": (64, 64),
        "k_proj": (64, 32),
        "v_proj": (64, 32),
        "o_proj": (64, 64),
        "gate_proj": (64, 128),
        "up_proj": (64, 128),
        "down_proj": (128, 64),
    }
    assert BaseModelSpec.from_dims(64, 128, 4, 2, None, 2).module_shapes == spec.module_shapes
    for name, module in base.named_modules():
        if name.endswith("_proj"):
            assert spec.module_shapes[name.rsplit(".", 1)[-1]] == (module.in_features, module.out_features)


CONFIGS = {
    "r4-qv": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8-all-linear": LoraConfig(r=8, lora_alpha=8, target_modules="all-linear"),
    "r16-regex": LoraConfig(r=16, lora_alpha=32, target_modules=r".*\.(k_proj|o_proj|down_proj)"),
    "rslora": LoraConfig(
        r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "k_proj", "gate_proj", "up_proj"]
    ),
    "patterns": LoraConfig(
        r=8,
        lora_alpha=4,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 4, "layers.1.self_attn.q_proj": 16},
        alpha_pattern={"down_proj": 32, r"layers\.0\.self_attn\.v_proj": 3},
    ),
    "layers-to-transform": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"], layers_to_transform=[1]),
    "exclude-modules": LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", exclude_modules=["down_proj", "k_proj"]
    ),
}
QV = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize("lora", CONFIGS.values(), ids=CONFIGS.keys())
def test_loaded_weights_reproduce_peft_delta(base, spec, tmp_path, lora):
    make_adapter(base, tmp_path, config=lora)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    loaded = load_lora(tmp_path, spec, MAX_RANK, name="oracle")
    peft_layers = {
        name: m for name, m in peft_model.named_modules() if isinstance(m, PeftLoraLinear) and "default" in m.lora_A
    }
    expected_keys = set()
    for name, layer in peft_layers.items():
        parts = name.split(".")
        key = (int(parts[parts.index("layers") + 1]), parts[-1])
        expected_keys.add(key)
        lora_a, lora_b, scaling = loaded.weights[key]
        assert lora_a.dtype == lora_b.dtype == torch.float32
        assert torch.equal(lora_a, layer.lora_A["default"].weight)
        assert torch.equal(lora_b, layer.lora_B["default"].weight)
        assert scaling == layer.scaling["default"]
        x = torch.randn(5, layer.in_features)
        with torch.no_grad():
            expected = layer(x) - layer.base_layer(x)
        torch.testing.assert_close(x @ lora_a.T @ lora_b.T * scaling, expected, atol=1e-6, rtol=1e-5)
    assert set(loaded.weights) == expected_keys
    assert loaded.rank == max(a.shape[0] for a, _, _ in loaded.weights.values())
    assert loaded.target_modules == {module for _, module in expected_keys}
    assert loaded.num_bytes == sum(a.nbytes + b.nbytes for a, b, _ in loaded.weights.values())
    assert loaded.name == "oracle" and loaded.path == str(tmp_path)


@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to True")
def test_fan_in_fan_out_leaves_lora_weights_untransposed(base, spec, tmp_path):
    """fan_in_fan_out is about the base weight's layout (GPT-2's Conv1D); peft's lora_A / lora_B are nn.Linear
    always, and peft resets the flag for nn.Linear bases. Loaded by peft itself, the adapter gives our delta."""
    make_adapter(base, tmp_path, r=4, targets=["v_proj", "up_proj"])
    edit_config(tmp_path, fan_in_fan_out=True)
    loaded = load_lora(tmp_path, spec, MAX_RANK)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), tmp_path).eval()
    layer = peft_model.get_submodule("base_model.model.model.layers.1.mlp.up_proj")
    lora_a, lora_b, scaling = loaded.weights[1, "up_proj"]
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = layer(x) - layer.base_layer(x)
    torch.testing.assert_close(x @ lora_a.T @ lora_b.T * scaling, expected, atol=1e-6, rtol=1e-5)


def test_digest_is_content_identity(base, spec, tmp_path):
    make_adapter(base, tmp_path / "a", seed=1, config=QV)
    make_adapter(base, tmp_path / "b", seed=2, config=QV)
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    digest = load_lora(tmp_path / "a", spec, MAX_RANK).digest
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert load_lora(tmp_path / "a", spec, MAX_RANK).digest == digest
    assert load_lora(tmp_path / "copy", spec, MAX_RANK, name="other-name").digest == digest
    assert load_lora(tmp_path / "b", spec, MAX_RANK).digest != digest
    edit_config(tmp_path / "copy", lora_alpha=16)  # same tensors, another scaling: another adapter
    assert load_lora(tmp_path / "copy", spec, MAX_RANK).digest != digest


# The digest's cache (adapters/content_digest.py): a weights file read again unchanged is not hashed again, and one
# written since, even to the same size and modification time, always is.
SETTLE_S = 0.05  # the racy window the tests use: longer than a tick of the kernel's file clock (1-10 ms)


@pytest.fixture
def hashed(monkeypatch):
    """Counts the tensor hashes done; the racy window shortened to SETTLE_S, the cache emptied."""
    monkeypatch.setattr(digests, "RACY_S", SETTLE_S)
    monkeypatch.setattr(digests, "TENSOR_HASHES", LockedLRU(digests.MAX_FILES))
    calls = []
    hash_tensors = digests.hash_tensors

    def counted(tensors):
        calls.append(len(tensors))
        return hash_tensors(tensors)

    monkeypatch.setattr(digests, "hash_tensors", counted)
    return calls


def settle() -> None:
    time.sleep(2 * SETTLE_S)


def test_an_unchanged_weights_file_is_hashed_once(base, spec, tmp_path, hashed):
    make_adapter(base, tmp_path / "a", seed=1)
    settle()
    first = load_lora(tmp_path / "a", spec, MAX_RANK)
    again = load_lora(tmp_path / "a", spec, MAX_RANK, name="same-file")
    assert len(hashed) == 1 and again.digest == first.digest
    shutil.copytree(tmp_path / "a", tmp_path / "copy")  # another file (inode), same content: hashed, same digest
    assert load_lora(tmp_path / "copy", spec, MAX_RANK).digest == first.digest
    assert len(hashed) == 2
    config = tmp_path / "a" / "adapter_config.json"  # the scalings come from the config: read anew, never cached
    config.write_text(config.read_text().replace('"lora_alpha": 16', '"lora_alpha": 4'))
    rescaled = load_lora(tmp_path / "a", spec, MAX_RANK)
    assert rescaled.digest != first.digest and len(hashed) == 2


def test_a_weights_file_written_since_is_hashed_again_even_with_its_old_size_and_mtime(base, spec, tmp_path, hashed):
    make_adapter(base, tmp_path / "a", seed=1)
    make_adapter(base, tmp_path / "b", seed=2)
    settle()
    first = load_lora(tmp_path / "a", spec, MAX_RANK)
    path = tmp_path / "a" / "adapter_model.safetensors"
    st, other = path.stat(), (tmp_path / "b" / "adapter_model.safetensors").read_bytes()
    assert len(other) == st.st_size
    with open(path, "r+b") as f:  # b's weights written over a's, in place: the same file (inode), the same size
        f.write(other)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # and the old modification time put back
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)
    settle()
    rewritten = load_lora(tmp_path / "a", spec, MAX_RANK)
    assert len(hashed) == 2
    assert rewritten.digest != first.digest
    assert rewritten.digest == load_lora(tmp_path / "b", spec, MAX_RANK).digest


def test_a_file_written_within_the_racy_window_is_hashed_every_time(base, spec, tmp_path, hashed, monkeypatch):
    monkeypatch.setattr(digests, "RACY_S", 3600.0)
    make_adapter(base, tmp_path / "a", seed=1)
    digests_seen = {load_lora(tmp_path / "a", spec, MAX_RANK).digest for _ in range(2)}
    assert len(hashed) == 2 and len(digests_seen) == 1
    assert len(digests.TENSOR_HASHES) == 0


def test_default_infix_in_tensor_names_is_accepted(base, spec, tmp_path):
    make_adapter(base, tmp_path / "plain", targets=["q_proj", "down_proj"])
    shutil.copytree(tmp_path / "plain", tmp_path / "infix")
    edit_tensors(tmp_path / "infix", lambda ts: {k.replace(".weight", ".default.weight"): v for k, v in ts.items()})
    plain, infix = load_lora(tmp_path / "plain", spec, MAX_RANK), load_lora(tmp_path / "infix", spec, MAX_RANK)
    assert infix.digest == plain.digest
    assert all(torch.equal(infix.weights[k][1], plain.weights[k][1]) for k in plain.weights)


def test_pickle_weights_need_opt_in_then_equal_safetensors(base, spec, tmp_path):
    make_adapter(base, tmp_path / "st", seed=3, targets=["k_proj", "gate_proj"])
    make_adapter(base, tmp_path / "bin", seed=3, targets=["k_proj", "gate_proj"], safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    with pytest.raises(AdapterError, match=r"adapter 'pickled': has only pickle weights \(adapter_model.bin\)"):
        load_lora(tmp_path / "bin", spec, MAX_RANK, name="pickled")
    from_pickle = load_lora(tmp_path / "bin", spec, MAX_RANK, allow_pickle=True)
    from_safetensors = load_lora(tmp_path / "st", spec, MAX_RANK)
    assert from_pickle.digest == from_safetensors.digest
    assert from_pickle.weights.keys() == from_safetensors.weights.keys()
    for key, (a, b, s) in from_safetensors.weights.items():
        pa, pb, ps = from_pickle.weights[key]
        assert torch.equal(a, pa) and torch.equal(b, pb) and s == ps


def other_base(tokenizer, directory, **overrides):
    return make_model(directory / "other-base", tokenizer, **overrides)


def wrong_hidden_size(base, tokenizer, d):
    make_adapter(other_base(tokenizer, d, hidden_size=96), d, r=4, targets=["q_proj"])


def extra_layer(base, tokenizer, d):
    make_adapter(other_base(tokenizer, d, num_hidden_layers=3), d, config=QV)


def drop_lora_b(base, tokenizer, d):
    make_adapter(base, d, config=QV)
    edit_tensors(
        d,
        lambda ts: {
            k: v for k, v in ts.items() if k != "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
        },
    )


def put_nan(base, tokenizer, d):
    make_adapter(base, d, config=QV)

    def edit(ts):
        ts["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][3, 1] = float("nan")
        return ts

    edit_tensors(d, edit)


def dora_tensors_only(base, tokenizer, d):
    make_adapter(base, d, config=replace(QV, use_dora=True))
    edit_config(d, use_dora=False)


def truncate(base, tokenizer, d):
    make_adapter(base, d, config=QV)
    path = d / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def adapter_then(edit):
    def build(base, tokenizer, d):
        make_adapter(base, d, config=QV)
        edit(d)

    return build


def adapter_with(safe_serialization: bool = True, **lora):
    return lambda base, tokenizer, d: make_adapter(
        base, d, config=replace(QV, **lora), safe_serialization=safe_serialization
    )


BAD = {
    "wrong-base-shapes": (
        wrong_hidden_size,
        "model.layers.0.self_attn.q_proj.lora_A has shape (4, 96), the base model's q_proj takes 64 inputs",
    ),
    "layer-beyond-base": (extra_layer, "layers.2.self_attn", "in layer 2, but the base model has 2 layers"),
    "rank-above-max": (adapter_with(r=32, lora_alpha=32), "has rank 32, above the server's max_lora_rank 16"),
    "dora": (adapter_with(use_dora=True), "DoRA (use_dora)", "not support"),
    "dora-tensors": (dora_tensors_only, "lora_magnitude_vector", "DoRA is not supported"),
    "bias-lora-only": (adapter_with(bias="lora_only"), "bias='lora_only'", "only bias='none'"),
    "bias-all": (adapter_with(bias="all"), "bias='all'"),
    "modules-to-save": (adapter_with(modules_to_save=["lm_head"]), "modules_to_save", "not support"),
    "lm-head-target": (adapter_with(target_modules=["q_proj", "lm_head"]), "targets lm_head", "q_proj"),
    "embedding-target": (adapter_with(target_modules=["embed_tokens", "v_proj"]), "targets embed_tokens"),
    "pickle-only": (adapter_with(safe_serialization=False), "pickle weights", "adapter_model.safetensors"),
    "missing-config": (adapter_then(lambda d: (d / "adapter_config.json").unlink()), "no adapter_config.json"),
    "missing-weights": (
        adapter_then(lambda d: (d / "adapter_model.safetensors").unlink()),
        "no weights file (adapter_model.safetensors)",
    ),
    "truncated-weights": (truncate, "cannot read", "adapter_model.safetensors"),
    "nan": (put_nan, "model.layers.0.self_attn.q_proj.lora_B holds NaN or Inf"),
    "missing-lora-b": (drop_lora_b, "model.layers.1.self_attn.v_proj has lora_A but no lora_B"),
    "rank-differs-from-config": (adapter_then(lambda d: edit_config(d, r=8)), "rank 4", "gives r=8"),
    "untargeted-weights": (
        adapter_then(lambda d: edit_config(d, target_modules=["q_proj"])),
        "v_proj has LoRA weights, but adapter_config.json does not target it",
    ),
    "targeted-without-weights": (
        adapter_then(lambda d: edit_config(d, target_modules=["q_proj", "v_proj", "o_proj"])),
        "targets model.layers.0.self_attn.o_proj, but no weights are given",
    ),
    "not-lora": (adapter_then(lambda d: edit_config(d, peft_type="IA3")), "peft_type 'IA3'", "only LORA"),
    "config-not-json": (adapter_then(lambda d: (d / "adapter_config.json").write_text("{r: 8")), "not valid JSON"),
}


@pytest.mark.parametrize("build, words", [(build, words) for build, *words in BAD.values()], ids=BAD.keys())
def test_bad_adapter_is_refused_with_a_clear_message(base, spec, tokenizer, tmp_path, build, words):
    directory = tmp_path / "adapter"
    build(base, tokenizer, directory)
    with pytest.raises(AdapterError) as refused:
        load_lora(directory, spec, MAX_RANK, name="bad-lora")
    message = str(refused.value)
    assert message.startswith("adapter 'bad-lora': ")
    for word in words:
        assert word in message


def test_error_names_the_path_without_a_name(spec, tmp_path):
    with pytest.raises(AdapterError, match=f"adapter '{tmp_path / 'nowhere'}': .* is not a directory"):
        load_lora(tmp_path / "nowhere", spec, MAX_RANK)
    assert issubclass(AdapterError, ValueError)


def test_magnitudes_are_each_tensors_largest_absolute_value_and_carry_nan_and_inf():
    tensors = [
        torch.tensor([1.0, -3.0, 2.0]),
        torch.tensor([]),
        torch.tensor([0.5, float("nan"), 7.0]),
        torch.tensor([-float("inf"), 1.0]),
        torch.tensor([[4.0, 1.0], [-2.0, 0.0]]),
    ]
    largest = magnitudes(tensors)
    assert largest[0] == 3.0 and largest[1] == 0.0 and math.isnan(largest[2])
    assert largest[3] == math.inf and largest[4] == 4.0


STORED_AS = {
    "float32": lambda ts: ts,
    "float16": lambda ts: {k: t.half() for k, t in ts.items()},
    "bfloat16": lambda ts: {k: t.bfloat16() for k, t in ts.items()},
    "mixed": lambda ts: {k: t.half() if "lora_A" in k else t for k, t in ts.items()},
}


@pytest.mark.parametrize("stored_as", STORED_AS, ids=STORED_AS.keys())
def test_a_loaded_adapter_records_its_largest_magnitude(base, spec, tmp_path, monkeypatch, stored_as):
    make_adapter(base, tmp_path)
    edit_tensors(tmp_path, STORED_AS[stored_as])
    per_tensor = []  # the calls of the tensor-by-tensor measure: none where the file's values are read at once
    monkeypatch.setattr(lora_weights, "magnitudes", lambda ts: per_tensor.append(len(ts)) or magnitudes(ts))
    loaded = load_lora(tmp_path, spec, MAX_RANK)
    tensors = [t for a, b, _ in loaded.weights.values() for t in (a, b)]
    assert loaded.largest == max(float(t.abs().max()) for t in tensors) > 0
    assert per_tensor == ([] if stored_as in ("float32", "float16") else [len(tensors)])


def test_the_payload_is_every_stored_tensor_at_once_where_numpy_reads_their_dtype(base, tmp_path):
    make_adapter(base, tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    for stored_as, readable in [("float32", True), ("float16", True), ("bfloat16", False), ("mixed", False)]:
        edit_tensors(tmp_path, STORED_AS[stored_as])
        data = path.read_bytes()
        stored = load_safetensors(data)
        payload = lora_weights._payload(data, stored)
        assert (payload is not None) == readable, stored_as
        if readable:  # the same values (in the file's order, not by name)
            values = torch.cat([t.reshape(-1) for t in stored.values()]).float()
            assert torch.equal(torch.from_numpy(payload.astype("float32")).sort().values, values.sort().values)
            assert lora_weights._payload(data[:-1], stored) is None  # bytes short of whole values: not read
        edit_tensors(tmp_path, lambda ts: {k: t.float() for k, t in ts.items()})


@pytest.mark.parametrize("stored_as", ["float16", "bfloat16"])
def test_a_non_finite_weight_stored_in_half_precision_is_named(base, spec, tmp_path, stored_as):
    make_adapter(base, tmp_path, config=QV)

    def edit(ts):
        ts = STORED_AS[stored_as](ts)
        ts["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"][0, 2] = float("inf")
        return ts

    edit_tensors(tmp_path, edit)
    with pytest.raises(AdapterError, match=r"layers\.1\.self_attn\.v_proj\.lora_A holds NaN or Inf"):
        load_lora(tmp_path, spec, MAX_RANK)
