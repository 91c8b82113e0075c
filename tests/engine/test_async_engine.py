"""AsyncEngine: the engine core in a child process, driven from asyncio over ZeroMQ."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError

ENGINE_KW = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, check_integrity=True)
PROMPTS = [[5, 17, 42, 99, 7], [3, 3, 200, 150, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23],
           [250, 1, 60]]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def run_with_engine(model_dir: str, scenario) -> AsyncEngine:
    """Start an engine, run `scenario(engine)`, always shut down; check nothing is left behind."""
    async def main() -> AsyncEngine:
        eng = await AsyncEngine.start(model=model_dir, **ENGINE_KW)
        try:
            await scenario(eng)
        finally:
            await eng.shutdown()
        return eng

    eng = asyncio.run(main())
    assert not eng.is_alive()
    assert eng.pid not in [p.pid for p in multiprocessing.active_children()]
    with pytest.raises(ProcessLookupError):
        os.kill(eng.pid, 0)  # reaped, not a zombie
    return eng


async def collect_rest(gen) -> None:
    async for _ in gen:
        pass


async def collect(eng: AsyncEngine, prompt, params, **kw) -> tuple[list[int], str, list]:
    toks, text, deltas = [], "", []
    async for d in eng.generate(prompt, params, **kw):
        deltas.append(d)
        for c in d.outputs:
            toks += c.token_ids
            text += c.text
    assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
    return toks, text, deltas


def test_greedy_matches_llm_and_text_deltas_concatenate(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    ref = LLM(model=model_dir, **ENGINE_KW).generate(PROMPTS, params, use_tqdm=False)
    # A stop string from the middle of a reference text: held-back text must never be sent then cut.
    full = ref[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    stop_params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop])
    ref_stop = LLM(model=model_dir, **ENGINE_KW).generate([PROMPTS[0]], stop_params, use_tqdm=False)[0]

    async def scenario(eng: AsyncEngine) -> None:
        info = eng.model_info
        assert (info.max_model_len, info.vocab_size, info.num_kv_blocks, info.block_size) == (256, 320, 64, 16)
        assert info.eos_token_id == 2
        results = await asyncio.gather(*(collect(eng, p, params) for p in PROMPTS),
                                       collect(eng, PROMPTS[0], stop_params))
        for (toks, text, deltas), r in zip(results, ref):
            comp = r.outputs[0]
            assert toks == comp.token_ids
            assert text == comp.text
            assert len(deltas) > 1  # streamed, not one final message
            lps = [p for d in deltas for c in d.outputs for p in (c.logprobs or [])]
            assert [next(iter(p)) for p in lps] == comp.token_ids
            assert lps[0][comp.token_ids[0]].logprob == pytest.approx(comp.logprobs[0][comp.token_ids[0]].logprob)
            last = deltas[-1]
            assert last.outputs[0].finish_reason == comp.finish_reason
            assert last.num_prompt_tokens == len(r.prompt_token_ids)
            assert last.metrics.first_token_time >= last.metrics.arrival_time
        toks, text, deltas = results[-1]
        assert text == ref_stop.outputs[0].text and toks == ref_stop.outputs[0].token_ids
        assert deltas[-1].outputs[0].finish_reason == "stop"
        assert deltas[-1].outputs[0].stop_reason == stop

    run_with_engine(model_dir, scenario)


def test_validation_error_reaches_caller_and_others_finish(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def expect_error(prompt, p=params) -> str:
        with pytest.raises(ValueError) as ei:
            await collect(eng_ref[0], prompt, p)
        return str(ei.value)

    eng_ref: list[AsyncEngine] = []

    async def scenario(eng: AsyncEngine) -> None:
        eng_ref.append(eng)
        good1, empty, too_long, over, good2 = await asyncio.gather(
            collect(eng, PROMPTS[0], params), expect_error([]), expect_error([1] * 256),
            expect_error([1] * 250, SamplingParams(max_tokens=10)), collect(eng, PROMPTS[1], params))
        assert "prompt must not be empty" in empty
        assert "max_model_len" in too_long and "prompt" in too_long
        assert "max_tokens" in over
        assert len(good1[0]) == len(good2[0]) == 8
        with pytest.raises(ValueError, match="request_id"):  # duplicate ids are refused up front
            gen = eng.generate(PROMPTS[0], params, request_id="dup")
            first = await gen.__anext__()
            await collect(eng, PROMPTS[1], params, request_id="dup")
        assert not first.finished
        await gen.aclose()
        stats = await eng.stats()
        assert stats["num_requests"] == 0 and stats["kv_blocks_used"] == 0

    run_with_engine(model_dir, scenario)


def test_leaving_the_iterator_aborts_the_request(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def wait_free(eng: AsyncEngine, timeout: float = 3.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = await eng.stats()
            if stats["kv_blocks_used"] == 0 or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.01)

    async def scenario(eng: AsyncEngine) -> None:
        # aclosing: the ABORT is sent before the next message, so the next stats() sees it.
        async with contextlib.aclosing(eng.generate(PROMPTS[1], params)) as gen:
            async for _ in gen:
                live = await eng.stats()
                assert live["num_running"] == 1 and live["kv_blocks_used"] > 0
                break
        stats = await eng.stats()
        assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_requests"] == 0

        # A plain break (the generator is dropped; asyncio closes it).
        async for _ in eng.generate(PROMPTS[1], params):
            break
        stats = await wait_free(eng)
        assert stats["kv_blocks_used"] == 0 and stats["num_requests"] == 0

        # A cancelled consumer task.
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in eng.generate(PROMPTS[2], params):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await wait_free(eng)
        assert stats["kv_blocks_used"] == 0 and stats["num_requests"] == 0

        # An explicit abort ends the open stream with finish_reason 'abort'.
        gen = eng.generate(PROMPTS[0], params, request_id="x")
        await gen.__anext__()
        await eng.abort("x")
        rest = [d async for d in gen]
        assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert (await eng.stats())["kv_blocks_used"] == 0

    run_with_engine(model_dir, scenario)


def test_killed_engine_raises_engine_dead_error(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def scenario(eng: AsyncEngine) -> None:
        gen = eng.generate(PROMPTS[0], params)
        await gen.__anext__()
        os.kill(eng.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            await asyncio.wait_for(collect_rest(gen), timeout=5.0)
        assert time.monotonic() - t0 < 5.0
        assert not eng.is_alive()
        with pytest.raises(EngineDeadError):
            await collect(eng, PROMPTS[1], params)
        with pytest.raises(EngineDeadError):
            await eng.stats()

    run_with_engine(model_dir, scenario)


def test_shutdown_leaves_nothing_and_bad_startup_reports_child_error(model_dir, tmp_path):
    async def scenario(eng: AsyncEngine) -> None:
        assert eng.is_alive()
        await eng.shutdown()
        await eng.shutdown()  # idempotent
        with pytest.raises(EngineDeadError, match="shut down"):
            await collect(eng, PROMPTS[0], SamplingParams(max_tokens=2))

    eng = run_with_engine(model_dir, scenario)
    assert not os.path.exists(eng._tmpdir)

    async def bad_start() -> None:
        await AsyncEngine.start(model=str(tmp_path / "no-such-model"), dtype="float32")

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(RuntimeError, match="failed to start"):
        asyncio.run(bad_start())
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_fatal_error_in_engine_loop_reaches_open_requests(model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def scenario(eng: AsyncEngine) -> None:
        gen = eng.generate(PROMPTS[0], params)
        await gen.__anext__()
        eng._send({"type": "bogus"})  # an engine-loop bug stands in for any unexpected exception
        with pytest.raises(EngineDeadError, match="unknown message type 'bogus'"):
            await asyncio.wait_for(collect_rest(gen), timeout=5.0)
        assert not eng.is_alive()
        eng._proc.join(timeout=10)  # the error reaches the streams before the process has exited
        assert eng._proc.exitcode == 1

    run_with_engine(model_dir, scenario)
