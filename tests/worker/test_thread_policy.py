"""ThreadPolicy (kvserve/threads.py) driven by injected step times: when it lowers and raises threads."""

from kvserve.threads import ThreadPolicy, _bucket


def run(policy: ThreadPolicy, times: list[float], tokens: int = 1) -> list[int | None]:
    return [policy.observe(t, tokens) for t in times]


def test_quiet_steps_keep_full_threads():
    p = ThreadPolicy(full=4)
    assert run(p, [0.010, 0.011, 0.009, 0.018] * 20) == [None] * 80  # 1.8x is not slow
    assert p.threads == 4


def test_sustained_slow_steps_halve_threads():
    p = ThreadPolicy(full=4, patience=4)
    run(p, [0.010] * 10)
    assert run(p, [0.050] * 3) == [None] * 3
    assert p.observe(0.050, 1) == 2 and p.threads == 2 and p.low == 2


def test_a_quiet_step_resets_the_streak():
    p = ThreadPolicy(full=2, patience=3)
    run(p, [0.010] * 5)
    assert run(p, [0.050, 0.050, 0.010, 0.050, 0.050, 0.010] * 5) == [None] * 30
    assert p.threads == 2


def test_slow_steps_are_not_averaged_in():
    p = ThreadPolicy(full=2, patience=4)
    run(p, [0.010] * 5)
    for _ in range(10):  # a long contended stretch still reads as slow: one drop, however long it lasts
        run(p, [0.050] * 3)
        p.observe(0.010, 1)
    assert p.threads == 2 and p._ewma[(2, 1)] < 0.011


def test_other_step_sizes_have_their_own_expectation():
    p = ThreadPolicy(full=2, patience=2)
    run(p, [0.010] * 5, tokens=1)
    assert run(p, [0.200] * 5, tokens=256) == [None] * 5  # a prefill is not a slow decode
    assert run(p, [0.010] * 3, tokens=1) == [None] * 3
    assert _bucket(1) == 1 and _bucket(3) == 4 and _bucket(4) == 4 and _bucket(5) == 8


def contended(p: ThreadPolicy) -> None:
    run(p, [0.010] * 5)
    run(p, [0.050] * p.patience)
    assert p.threads == p.low


def test_probe_raises_threads_when_the_cores_are_free():
    p = ThreadPolicy(full=2, patience=4, probe_every=8, probe_steps=2)
    contended(p)
    assert run(p, [0.030] * 7) == [None] * 7
    assert p.observe(0.030, 1) == 2  # the 8th step at low starts a probe at full
    assert run(p, [0.012, 0.010]) == [None, None]  # faster than at low: stays
    assert p.threads == 2
    assert run(p, [0.010] * 20) == [None] * 20


def test_failed_probe_goes_back_and_backs_off():
    p = ThreadPolicy(full=2, patience=4, probe_every=8, probe_steps=2, max_probe_every=32)
    contended(p)
    switches = []
    for step in range(200):
        t = 0.030 if p.threads == 1 else 0.060  # still shared: full threads stay slower than one
        r = p.observe(t, 1)
        if r is not None:
            switches.append((step, r))
    ups = [s for s, r in switches if r == 2]
    assert [r for _, r in switches] == [2, 1] * (len(switches) // 2)
    assert [b - a for a, b in zip(ups, ups[1:])] == [18] + [34] * (len(ups) - 2)  # 16, then 32 (max) at low + 2
    assert p.threads == 1


def test_probe_wins_when_full_threads_beat_low_even_shared():
    p = ThreadPolicy(full=2, patience=4, probe_every=8, probe_steps=2)
    contended(p)
    run(p, [0.040] * 8)
    assert p.threads == 2
    assert run(p, [0.035, 0.036]) == [None, None] and p.threads == 2


def test_one_thread_has_nothing_to_lower():
    p = ThreadPolicy(full=1)
    assert run(p, [0.010] * 5 + [1.0] * 20) == [None] * 25
