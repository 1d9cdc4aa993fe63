"""The hit-rate monitor's rule, on windows built in memory: 3 low windows in a row start compensation, a good one
ends it, idle windows change nothing, and a sparse level does not hold compensation on."""

from __future__ import annotations

from shared.textcache.monitor import HitRateMonitor, TierCount, Window


def window(index: int, **tiers: tuple[int, int]) -> Window:
    return Window(index=index, start=index * 10.0, tiers={t: TierCount(h, m) for t, (h, m) in tiers.items()})


def monitor(*tiers: str) -> HitRateMonitor:
    return HitRateMonitor(threshold=0.85, low_windows=3, recover_windows=1, min_lookups=20, tiers=tiers or ("overall",))


def test_three_low_windows_in_a_row_then_one_good_window():
    m = monitor()
    assert m.observe([window(0, l1=(80, 20)), window(1, l1=(10, 90))]) is None
    change = m.observe([window(2, l1=(5, 15))])
    assert change is not None and change.mode == "compensating" and change.window == 2
    assert "overall 25.0%" in change.reason
    assert m.observe([window(3, l1=(95, 5))]).mode == "normal"  # type: ignore[union-attr]


def test_overall_counts_hits_at_every_level():
    # 100 lookups: 60 from L1, 30 of the 40 L1 misses from L2, 5 of the 10 L2 misses from L3: 95% overall.
    w = window(0, l1=(60, 40), l2=(30, 10), l3=(5, 5))
    assert w.overall == TierCount(95, 5)
    m = monitor()
    assert m.observe([window(i, l1=(60, 40), l2=(30, 10), l3=(5, 5)) for i in range(5)]) is None
    assert m.mode == "normal"


def test_a_good_window_breaks_the_run_and_each_window_is_judged_once():
    m = monitor()
    m.observe([window(0, l1=(0, 30)), window(1, l1=(0, 30)), window(2, l1=(30, 0)), window(3, l1=(0, 30))])
    assert m.mode == "normal"
    m.observe([window(3, l1=(0, 30))])  # seen already: not a second low window
    assert m.mode == "normal"
    assert m.observe([window(4, l1=(0, 30))]) is None  # windows 3 and 4: two in a row
    assert m.observe([window(5, l1=(0, 30))]).mode == "compensating"  # type: ignore[union-attr]


def test_idle_windows_neither_extend_nor_break_a_run():
    m = monitor()
    m.observe([window(0, l1=(0, 30)), window(1, l1=(0, 30)), window(2, l1=(1, 2)), window(3)])
    assert m.mode == "normal"
    assert m.observe([window(4, l1=(0, 30))]).mode == "compensating"  # type: ignore[union-attr]
    m.observe([window(5), window(6, l1=(3, 3))])
    assert m.mode == "compensating"  # idle: the mode holds


def test_a_single_level_can_be_judged_and_a_sparse_one_does_not_hold_compensation_on():
    m = monitor("l2")
    for i in range(3):
        m.observe([window(i, l1=(0, 40), l2=(10, 30))])  # L2 serves 25% of what reaches it
    assert m.mode == "compensating"
    # Warm: almost everything is an L1 hit, L2 sees 5 lookups (too few to judge); the cluster is busy: good.
    assert m.observe([window(3, l1=(95, 5), l2=(5, 0))]).mode == "normal"  # type: ignore[union-attr]
