"""Who gets the cores: each rank runs --cpu-threads intra-op threads (default: torch's count, or
one per pinned core), and the HTTP process of `kvserve serve` keeps one thread."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import pytest
import torch

from kvserve import LLM
from kvserve.config import EngineConfig
from kvserve.worker.worker import bind_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    """The uni executor's Worker runs in this process: give the other tests their count back."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _rank_threads(**kwargs) -> list[int]:
    llm = LLM(dtype="float32", num_kv_blocks=16, **kwargs)
    try:
        return [info["threads"] for info in llm.engine.executor.collective_rpc("model_info")]
    finally:
        llm.close()


def test_cpu_threads_sets_each_ranks_threads(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    torch.set_num_threads(2)
    assert _rank_threads(model=path) == [2]  # no flag: the process's count stands
    assert _rank_threads(model=path, cpu_threads=1) == [1]
    assert torch.get_num_threads() == 1  # one rank, in this process (uni)


def test_binding_gives_one_thread_per_core_unless_told(caplog):
    cores = tuple(sorted(os.sched_getaffinity(0)))  # pinning to what we have changes no affinity
    bind_threads(cores)
    assert torch.get_num_threads() == len(cores)
    bind_threads(cores, 1)
    assert torch.get_num_threads() == 1
    with caplog.at_level(logging.WARNING, logger="kvserve.worker.worker"):
        bind_threads(cores, len(cores) + 1)
    assert torch.get_num_threads() == len(cores) + 1
    assert f"{len(cores) + 1} intra-op threads on {len(cores)} pinned cores" in caplog.text
    assert sorted(os.sched_getaffinity(0)) == list(cores)


def test_http_process_keeps_one_thread(tiny_model_factory, monkeypatch):
    """`kvserve serve` leaves the cores to the engine process, which it spawns first (a spawned
    process starts with torch's own thread count) so that both start side by side."""
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.server import launch

    seen = []

    async def start(config, **kwargs):  # stands in for spawning the engine process
        seen.append("engine")
        await asyncio.sleep(0.5)  # meanwhile this process loads the tokenizer
        seen.append(torch.get_num_threads())
        raise RuntimeError("engine not started in this test")

    monkeypatch.setattr(AsyncEngine, "start", start)
    torch.set_num_threads(2)
    try:
        config = EngineConfig.from_kwargs(model=str(tiny_model_factory("llama")), dtype="float32")
        with pytest.raises(RuntimeError, match="engine not started"):
            asyncio.run(launch.serve(argparse.Namespace(), config))
        assert seen == ["engine", 1] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
