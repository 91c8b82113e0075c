"""BackgroundLoads (core/kv_loads.py): the one start / cancel / finish implementation that the KV
tiers' prefetch and the P/D fetch share."""

import threading

from kvserve.core.kv_loads import BackgroundLoads


def test_a_finished_load_is_reported_once_and_its_result_kept_until_taken():
    loads = BackgroundLoads()
    loads.begin("a")
    loads.run("a", lambda: {"block": b"kv"})
    assert loads.finished() == ["a"] and loads.finished() == []
    assert loads.peek("a") == {"block": b"kv"} and loads.peek("a") is not None  # peek leaves it
    assert loads.take("a") == {"block": b"kv"} and loads.take("a") is None
    assert loads.error("a") is None


def test_a_failed_load_reports_its_error_and_no_result():
    loads = BackgroundLoads()
    loads.begin("b")

    def boom():
        raise RuntimeError("peer went away")

    loads.run("b", boom)
    assert loads.finished() == ["b"]
    assert loads.peek("b") is None and loads.error("b") == "peer went away" and loads.error("b") is None


def test_a_load_cancelled_while_it_runs_drops_what_it_brings_and_is_never_reported():
    loads = BackgroundLoads()
    started, release = threading.Event(), threading.Event()
    seen_cancel = []

    def slow():
        started.set()
        release.wait(5)
        seen_cancel.append(loads.cancelled("c"))
        return {"block": b"late"}

    loads.begin("c")
    t = threading.Thread(target=loads.run, args=("c", slow))
    t.start()
    started.wait(5)
    loads.cancel("c")
    release.set()
    t.join(5)
    assert seen_cancel == [True]  # a long load can stop early
    assert loads.finished() == [] and loads.peek("c") is None
    assert not loads._running and not loads._cancelled  # nothing left behind for a reused id
    loads.begin("c")  # the same id again loads normally
    loads.run("c", lambda: 1)
    assert loads.finished() == ["c"] and loads.take("c") == 1


def test_cancel_after_finish_drops_the_result_and_error():
    loads = BackgroundLoads()
    loads.begin("d")
    loads.run("d", lambda: "data")
    loads.cancel("d")
    assert loads.peek("d") is None and loads.error("d") is None and not loads._cancelled


def test_wait_returns_when_a_load_finishes():
    loads = BackgroundLoads()
    loads.begin("e")
    threading.Timer(0.05, loads.run, args=("e", lambda: 1)).start()
    loads.wait(5)
    assert loads.finished() == ["e"]


def test_wait_does_not_block_with_no_load_running():
    """An idle step's wait (kv_loads.IDLE_WAIT_S) must not stall the engine when nothing loads:
    with a huge timeout it returns at once, both before any load and after the last one ended."""
    loads = BackgroundLoads()
    done = threading.Event()
    threading.Thread(target=lambda: (loads.wait(3600), done.set()), daemon=True).start()
    assert done.wait(5)
    loads.begin("f")
    loads.run("f", lambda: 1)
    assert loads.finished() == ["f"]
    done.clear()
    threading.Thread(target=lambda: (loads.wait(3600), done.set()), daemon=True).start()
    assert done.wait(5)
