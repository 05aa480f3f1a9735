"""Fixtures shared by the test files (helpers without fixtures live in support.py)."""

from pathlib import Path

import pytest

from support import VARIANTS, prepare, write_corpus


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    return request.param, VARIANTS[request.param]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A tiny prepared corpus (byte-level BPE, 300 tokens), built once per session."""
    root = tmp_path_factory.mktemp("tiny_data")
    return prepare(write_corpus(root / "corpus"), root / "data")
