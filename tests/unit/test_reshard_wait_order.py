"""The order in which the runtime waits gloo works (moe/_reshard_runtime.py `_wait_order`): each
peer's group last work first, and a peer's `done` runs only once every work up to it is waited."""

from __future__ import annotations

from moe._reshard_runtime import _wait_order


def test_groups_are_waited_last_first_and_done_runs_after_its_whole_prefix() -> None:
    # works 0-2: peer A (done at 2); 3-6: peer B (done at 6); 7-8: trailing sends (no done)
    order, after = _wait_order(9, {2: print, 6: print})
    assert order == [2, 1, 0, 6, 5, 4, 3, 8, 7]
    assert after == {0: 2, 3: 6}
    for i, k in after.items():  # by the time done[k] runs, works 0..k have all been waited
        assert set(order[:order.index(i) + 1]) == set(range(k + 1))
    assert sorted(order) == list(range(9))


def test_no_done_waits_everything_last_first_and_empty_is_empty() -> None:
    assert _wait_order(4, {}) == ([3, 2, 1, 0], {})
    assert _wait_order(0, {}) == ([], {})
    assert _wait_order(3, {2: print}) == ([2, 1, 0], {0: 2})
