"""Shared pytest fixtures. Several engineers add fixtures here: add, do not remove."""

from __future__ import annotations

from pathlib import Path

import pytest

from codraft.testing import make_tiny_target


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama target folder (4 layers, H=64, 2 query heads on 1 KV head, head_dim
    32, V=512) with a byte-level BPE tokenizer and ChatML template; transformers and vLLM load it.
    """
    return make_tiny_target(tmp_path_factory.mktemp("tiny_llama"), arch="llama")
