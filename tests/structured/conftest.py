"""The default model (SmolLM2-135M, embedded), loaded once per test module."""

from __future__ import annotations

import pytest

from kvserve import LLM


@pytest.fixture(scope="module")
def llm():
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", check_integrity=True)
    yield llm
    llm.engine.close()
