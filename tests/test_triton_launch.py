"""FastLaunch: the compiled kernel is kept per key and launched directly; the JIT runs on a new key, and always
where the direct launcher does not apply. Unit tests over a stand-in JIT function on the CPU; the CUDA test
launches the LoRA shrink for real both ways."""

import pytest
import torch

from kernels.triton_launch import FastLaunch


class FakeCompiled:
    def __init__(self, log: list, with_launcher: bool = True):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"
        if not with_launcher:
            self.function = None

    def run(self, *launch):
        self.log.append(("direct", launch))


class FakeJit:
    """jit_fn[grid](*args, **options): records the call and returns its compiled kernel."""

    __name__ = "fake_kernel"

    def __init__(self, with_launcher: bool = True):
        self.log: list = []
        self.with_launcher = with_launcher

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("jit", grid, args, options))
            return FakeCompiled(self.log, self.with_launcher)

        return launch


class FakeStream:
    cuda_stream = 1234


@pytest.fixture
def compiled_mode(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_second_launch_of_a_key_calls_the_compiled_launcher(compiled_mode):
    jit = FakeJit()
    launch = FastLaunch(jit, num_warps=4)
    x = torch.zeros(8)
    launch((3, 2), x, 5, "ieee")
    launch((7,), x, 5, "ieee")
    assert [entry[0] for entry in jit.log] == ["jit", "direct"]
    assert jit.log[0][1:] == ((3, 2), (x, 5, "ieee"), {"num_warps": 4})
    assert jit.log[1][1] == (7, 1, 1, 1234, "fn", "meta", None, None, None, x, 5, "ieee")


def test_a_new_key_goes_through_the_jit_again(compiled_mode, monkeypatch):
    jit = FakeJit()
    launch = FastLaunch(jit)
    x = torch.zeros(16)
    launch((1,), x, 5)
    launch((1,), x, 6)  # another int
    launch((1,), x.double(), 5)  # another dtype
    launch((1,), x[1:], 5)  # an address 4 bytes past a multiple of 16
    launch((1,), x[4:], 5)  # 16 bytes past: the first key again
    assert [entry[0] for entry in jit.log] == ["jit", "jit", "jit", "jit", "direct"]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # a kernel is loaded on one device
    launch((1,), x, 5)
    assert jit.log[-1][0] == "jit"


def test_jit_kept_under_the_interpreter_or_without_a_launcher(compiled_mode, monkeypatch):
    jit = FakeJit(with_launcher=False)
    launch = FastLaunch(jit)
    for _ in range(3):
        launch((1,), 5)
    assert [entry[0] for entry in jit.log] == ["jit"] * 3 and not launch.direct
    from triton import knobs

    with monkeypatch.context() as patch:  # a profiler's launch hook: every launch must reach it
        patch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
        jit = FakeJit()
        hooked = FastLaunch(jit)
        for _ in range(3):
            hooked((1,), 5)
        assert [entry[0] for entry in jit.log] == ["jit"] * 3 and not hooked.direct
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    jit = FakeJit()
    interpreted = FastLaunch(jit)
    for _ in range(3):
        interpreted((1,), 5)
    assert [entry[0] for entry in jit.log] == ["jit"] * 3 and not interpreted.compiled


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fast_launch_matches_the_jit_launch():
    from kernels.lora import LoraMeta, torch_ops, triton_ops

    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, width, rows = 40, 256, 48, 4
    a = torch.randn(rows, width, hidden, device="cuda", generator=gen)
    meta = LoraMeta.build([i % (rows + 1) - 1 for i in range(tokens)], "cuda", torch_layouts=False)
    launcher = triton_ops._shrink
    for _ in range(3):  # the first call of the key through the JIT, the next ones direct
        x = torch.randn(tokens, hidden, device="cuda", generator=gen)
        out, ref = torch.zeros(tokens, width, device="cuda"), torch.zeros(tokens, width, device="cuda")
        triton_ops.lora_shrink(out, x, a, meta)
        torch_ops.lora_shrink(ref, x, a, meta)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-3)
    assert launcher.direct and launcher.compiled, "the compiled kernel was not kept for direct launches"
