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


def test_the_build_clears_a_stale_lock_in_its_build_directory_first(tmp_path, monkeypatch):
    """Where torch would wait for ever (FileBaton polls until the lock goes), the build goes on; torch builds in the
    directory build_directory names."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = cpu_native.build_directory()
    assert build_dir.parent == tmp_path / "loraplex"
    build_dir.mkdir(parents=True)
    lock = build_dir / "lock"
    lock.touch()
    old = time.time() - cpu_native.STALE_BUILD_LOCK_S - 5
    os.utime(lock, (old, old))
    seen = []
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load", lambda **kwargs: seen.append((lock.exists(), kwargs["build_directory"]))
    )
    cpu_native._build()
    assert seen == [(False, str(build_dir))]  # the lock was gone when torch's build began
    os.utime(build_dir, (old, old))
    cpu_native._build()  # a later load (no lock to remove) marks its build used
    assert build_dir.stat().st_mtime > old + 60


def test_each_checkout_and_version_of_the_sources_builds_in_a_directory_of_its_own(tmp_path, monkeypatch):
    """The key follows the sources' directory and contents: a CI clone beside a work tree does not rebuild its
    build, and an edited kernel gets a new one."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    checkouts = []
    for name in ("work", "clone"):
        (tmp_path / name / "lora" / "csrc").mkdir(parents=True)
        (tmp_path / name / "lora" / "csrc" / "lora_cpu.cpp").write_text("int x;")
        checkouts.append(tmp_path / name)
    work = cpu_native.build_directory(checkouts[0])
    assert work == cpu_native.build_directory(checkouts[0])  # stable
    assert work != cpu_native.build_directory(checkouts[1])  # another checkout
    (checkouts[0] / "lora" / "csrc" / "lora_cpu.cpp").write_text("int y;")
    assert work != cpu_native.build_directory(checkouts[0])  # an edited source
    assert cpu_native.build_directory().name.startswith(cpu_native.EXTENSION_NAME + "-")


def test_builds_unused_for_a_week_are_removed_and_others_kept(tmp_path):
    ours = tmp_path / "loraplex"  # <cache>/loraplex/<name>-<key>; torch's own: <cache>/py311_cpu/<name>
    current, recent, stale = (ours / f"{cpu_native.EXTENSION_NAME}-{key}" for key in ("aa", "bb", "cc"))
    legacy, legacy_recent = (tmp_path / tag / cpu_native.EXTENSION_NAME for tag in ("py311_cpu", "py312_cpu"))
    for directory in (current, recent, stale, legacy, legacy_recent):
        directory.mkdir(parents=True)
        (directory / "lib.so").write_bytes(b"")
    old = time.time() - cpu_native.STALE_BUILD_DIRECTORY_S - 60
    for path in (current / "lib.so", current, stale / "lib.so", stale, recent / "lib.so", legacy / "lib.so", legacy):
        os.utime(path, (old, old))  # `recent`: built long ago, its directory's time set by a load since
    assert cpu_native.remove_stale_build_directories(current) == [stale, legacy]
    assert current.exists() and recent.exists() and legacy_recent.exists()
    assert not stale.exists() and not legacy.exists()
