"""The default model (SmolLM2-135M, embedded), loaded once per test module."""

from __future__ import annotations

import pytest

from kvserve import LLM
from kvserve.kernels.tuning import TUNING_ENV


@pytest.fixture(scope="module")
def llm():
    """With the kernels' fixed defaults (no tuning): tests here compare a request's tokens alone and
    in a batch with constrained ones, and tuning may run a linear's larger batches through a dense
    bfloat16 matmul (from 16 rows on a Zen 4 with AVX512-BF16), which moves near-tied tokens."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TUNING_ENV, "off")
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", check_integrity=True)
    yield llm
    llm.engine.close()
