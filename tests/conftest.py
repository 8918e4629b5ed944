"""Test-wide setup: Triton runs in its interpreter where there is no GPU; GPU tests skip cleanly without CUDA."""

import os

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


@pytest.fixture(scope="session")
def tokenizer():
    from gateway.demo.tokenizer import train_tokenizer

    return train_tokenizer()
