"""Weights on huge pages (worker/kernels/memory.py): same values, same storage size, 2 MB aligned."""

from __future__ import annotations

import sys

import pytest
import torch

from kvserve.worker.kernels import memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_large_tensor_is_copied_to_an_aligned_mapping():
    t = torch.randint(-128, 127, (2048, 2050), dtype=torch.int8)  # not a multiple of 2 MB
    h = memory.on_huge_pages(t)
    assert h.data_ptr() != t.data_ptr() and h.data_ptr() % memory.HUGE == 0
    assert torch.equal(h, t) and h.dtype == t.dtype and h.is_contiguous()
    assert h.untyped_storage().nbytes() == t.numel()  # weight_bytes counts storages: no padding in it
    del t
    assert int(h.float().sum()) == int(h.sum())  # the mapping outlives the source


def test_small_or_strided_tensors_stay_as_they_are():
    small = torch.zeros(1024, 1024, dtype=torch.uint8)
    assert memory.on_huge_pages(small) is small
    big = torch.zeros(4096, 2048)[:, ::2]
    assert memory.on_huge_pages(big) is big
