"""kernels/cpu_native.py's build: a build lock left by a killed build no longer blocks every later build."""

from __future__ import annotations

import os
import time

import torch.utils.cpp_extension

from kernels import cpu_native


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    lock = tmp_path / "lock"
    assert not cpu_native.remove_stale_build_lock(tmp_path)  # no lock: nothing to do
    lock.touch()
    assert not cpu_native.remove_stale_build_lock(tmp_path) and lock.exists()  # a build under way: left alone
    old = time.time() - cpu_native.STALE_BUILD_LOCK_S - 5
    os.utime(lock, (old, old))
    with caplog.at_level("WARNING", logger="kernels.cpu_native"):
        assert cpu_native.remove_stale_build_lock(tmp_path)
    assert not lock.exists()
    assert "stale build lock" in caplog.text


def test_the_build_clears_a_stale_lock_in_torchs_build_directory_first(tmp_path, monkeypatch):
    """Where torch would wait for ever (FileBaton polls until the lock goes), the build goes on."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = tmp_path / cpu_native.EXTENSION_NAME
    build_dir.mkdir()
    lock = build_dir / "lock"
    lock.touch()
    old = time.time() - cpu_native.STALE_BUILD_LOCK_S - 5
    os.utime(lock, (old, old))
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kwargs: seen.append(lock.exists()))
    cpu_native._build()
    assert seen == [False]  # the lock was gone when torch's build began
