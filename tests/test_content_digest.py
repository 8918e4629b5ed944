"""The adapter digest's cache (adapters/content_digest.py): a weights file read again unchanged is not hashed again,
and one written since, even to the same size and modification time, always is."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from adapters import BaseModelSpec, load_lora
from adapters import content_digest as digests
from tests.hf_models import make_adapter, make_model

MAX_RANK = 16
SETTLE_S = 0.05  # the racy window the tests use: longer than a tick of the kernel's file clock (1-10 ms)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    return make_model(tmp_path_factory.mktemp("base"), tokenizer)


@pytest.fixture(scope="module")
def spec(base):
    return BaseModelSpec.from_hf_config(base.config)


@pytest.fixture
def hashed(monkeypatch):
    """Counts the tensor hashes done; the racy window shortened to SETTLE_S, the cache emptied."""
    monkeypatch.setattr(digests, "RACY_S", SETTLE_S)
    monkeypatch.setattr(digests, "TENSOR_HASHES", digests._TensorHashes(digests.MAX_FILES))
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
