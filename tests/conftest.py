"""Fixtures shared by the test files (helpers without fixtures live in support.py)."""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (hydra_lm/kernels) run in Triton's interpreter: read when a kernel is defined, so set
    # before any test imports one. On a GPU host they compile for the GPU, as they run.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support import VARIANTS, prepare, write_corpus


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` both selects a test (``-m gpu``) and skips it where no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    return request.param, VARIANTS[request.param]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A tiny prepared corpus (byte-level BPE, 300 tokens), built once per session."""
    root = tmp_path_factory.mktemp("tiny_data")
    return prepare(write_corpus(root / "corpus"), root / "data")


@pytest.fixture(autouse=True)
def restore_tf32(monkeypatch):
    """The trainer turns TF32 on for the process; every later test gets the flags back (a leaked TF32 took a
    flex-versus-dense gradient check past its fp32 tolerance)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
