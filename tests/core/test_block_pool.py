import pytest

from kvserve.core.block_pool import BlockPool


def test_pop_gives_one_ref_and_push_returns_block():
    pool = BlockPool(4)
    assert pool.num_free == 4 and pool.num_used == 0
    a, b = pool.pop_free(), pool.pop_free()
    assert a != b
    assert pool.ref_cnt[a] == pool.ref_cnt[b] == 1
    assert pool.num_free == 2 and pool.num_used == 2
    assert pool.incref(a) == 2
    assert pool.num_used == 2  # a second reference does not make a second used block
    assert pool.decref(a) == 1
    assert pool.decref(a) == 0
    assert pool.num_used == 1
    pool.push_free([a])
    assert pool.num_free == 3 and pool.is_free(a) and not pool.is_free(b)
    pool.check_integrity()


def test_every_block_can_be_taken_exactly_once():
    pool = BlockPool(8)
    got = [pool.pop_free() for _ in range(8)]
    assert sorted(got) == list(range(8))
    assert pool.num_free == 0 and pool.num_used == 8
    with pytest.raises(IndexError):
        pool.pop_free()
    pool.check_integrity()


def test_misuse_is_caught():
    pool = BlockPool(2)
    b = pool.pop_free()
    with pytest.raises(AssertionError, match="freed with ref 1"):
        pool.push_free([b])
    pool.decref(b)
    pool.push_free([b])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.push_free([b])
    with pytest.raises(AssertionError, match="released with ref 0"):
        pool.decref(b)
    with pytest.raises(AssertionError, match="in the free queue"):
        pool.incref(b)


def test_check_integrity_detects_corruption():
    pool = BlockPool(3)
    b = pool.pop_free()
    pool.check_integrity()
    pool.ref_cnt[b] = 2  # bypassing incref keeps the counter right but ...
    pool.check_integrity()
    pool.ref_cnt[b] = 0  # ... a used block with ref 0 breaks the used counter
    with pytest.raises(AssertionError, match="used counter"):
        pool.check_integrity()
    pool = BlockPool(3)
    pool.ref_cnt[0] = 1  # a block in the free queue with a reference
    with pytest.raises(AssertionError, match="free block 0 has ref 1"):
        pool.check_integrity()


def test_bad_size():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_core_modules_never_import_torch():
    """core/ is pure bookkeeping: importing all of it (scheduler included) loads no torch."""
    import subprocess
    import sys

    code = ("import sys, kvserve.core.scheduler, kvserve.core.kv_manager, kvserve.core.radix_cache; "
            "bad = [m for m in ('torch', 'numpy') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"core imports {proc.stdout.strip()} {proc.stderr[-500:]}"
