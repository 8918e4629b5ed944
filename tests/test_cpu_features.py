"""dtype on CPU: auto is float32 and says why; a half dtype without native matmuls is honoured with a warning."""

from __future__ import annotations

import logging

import pytest

from engine import cpu_features
from engine.config import EngineConfig
from engine.cpu_features import half_dtype_support

AVX2_ONLY = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"}
ZEN_4 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"}


def test_half_support_is_read_off_the_flags():
    assert half_dtype_support("bfloat16", AVX2_ONLY) == (
        False,
        "the CPU has none of avx512_bf16, amx_bf16 (bfloat16 matmuls run ~20x slower per FLOP than float32)",
    )
    assert half_dtype_support("bfloat16", SAPPHIRE_RAPIDS) == (True, "the CPU has avx512_bf16 and amx_bf16")
    assert half_dtype_support("float16", SAPPHIRE_RAPIDS)[0] and not half_dtype_support("float16", AVX2_ONLY)[0]
    assert half_dtype_support("bfloat16", frozenset()) == (False, "the CPU's flags could not be read")


def test_the_panel_linear_is_for_avx2_cpus_without_avx512_for_zen_4_and_for_intel_avx512():
    wins = cpu_features.panel_linear_wins
    assert wins(AVX2_ONLY, ("AuthenticAMD", 25)) and wins(AVX2_ONLY, ("GenuineIntel", 6))  # Zen 3, Haswell
    assert wins(ZEN_4, ("AuthenticAMD", 25))  # AVX-512 on 256-bit units: the zmm tile
    assert wins(SAPPHIRE_RAPIDS, ("GenuineIntel", 6))  # two 512-bit FMA ports: the 14 x 32 tile (measured)
    assert not wins(ZEN_4, ("AuthenticAMD", 26))  # Zen 5: full-width AVX-512, where oneDNN is faster (measured)
    assert not wins(AVX2_ONLY - {"fma"}, ("AuthenticAMD", 25)) and not wins(frozenset(), ("", None))


def test_the_bf16_panel_linear_is_for_zen_4_only():
    wins = cpu_features.bf16_panel_linear_wins
    assert wins(ZEN_4, ("AuthenticAMD", 25))  # avx512_bf16 without AMX: VDPBF16PS over the panels
    assert not wins(SAPPHIRE_RAPIDS, ("GenuineIntel", 6))  # AMX: oneDNN's tiles
    assert not wins(ZEN_4 - {"avx512_bf16"}, ("AuthenticAMD", 25))  # no native bf16: bf16 is not packed at all
    assert not wins(ZEN_4, ("AuthenticAMD", 26)) and not wins(ZEN_4, ("GenuineIntel", 6))  # not measured: oneDNN
    assert not wins(AVX2_ONLY, ("AuthenticAMD", 25)) and not wins(frozenset(), ("", None))


def test_the_cpu_identity_comes_from_proc_cpuinfo():
    vendor, family = cpu_features.cpu_identity()
    assert (vendor, family) == ("", None) or (vendor and (family is None or family > 0))


def test_cpu_flags_come_from_proc_cpuinfo():
    flags = cpu_features.cpu_flags()
    assert not flags or "fpu" in flags  # every x86 CPU lists fpu; other platforms may list nothing


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # EngineConfig checks only that the directory exists
    return tmp_path


@pytest.mark.parametrize("flags", [AVX2_ONLY, SAPPHIRE_RAPIDS], ids=["avx2", "amx"])
def test_auto_on_cpu_is_float32_and_the_log_says_why(model_dir, monkeypatch, caplog, flags):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    with caplog.at_level(logging.INFO, logger="engine.config"):
        assert EngineConfig(model=str(model_dir), device="cpu").dtype == "float32"
    expected = "would be faster here" if "amx_bf16" in flags else "none of avx512_bf16, amx_bf16"
    assert "dtype auto: float32" in caplog.text and expected in caplog.text


def test_bfloat16_without_native_matmuls_is_kept_with_a_warning_naming_the_reason(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: AVX2_ONLY)
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        assert EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16").dtype == "bfloat16"
    assert "dtype bfloat16 requested on CPU" in caplog.text and "avx512_bf16" in caplog.text


def test_bfloat16_with_native_matmuls_gets_no_warning(model_dir, monkeypatch, caplog):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16")
    assert "requested on CPU" not in caplog.text
