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


def test_the_first_reshard_over_a_non_gloo_group_forms_its_communicator_on_every_rank() -> None:
    """NCCL forms a group's communicator at its first collective, which every rank must join, and a
    round leaves out the ranks with nothing to move: moe.runtime._form_communicator all-reduces one
    element on the first reshard over each non-gloo group (once), and nothing on gloo or for the default
    group. In a one-rank gloo world whose backend the check is told is nccl (no GPU here)."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent('''
        import tempfile
        import torch.distributed as dist
        import moe.runtime as rt

        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
        group, calls, real = dist.new_group([0]), [], dist.all_reduce
        dist.all_reduce = lambda t, group=None: calls.append((group, t.numel())) or real(t, group=group)
        rt._form_communicator(group, None)
        assert calls == [], calls  # gloo needs no forming
        dist.get_backend = lambda group=None: "nccl"
        for g in (group, group, None):
            rt._form_communicator(g, None)
        assert calls == [(group, 1)], calls
        print("formed once")
    ''')
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "formed once" in out.stdout, out.stderr[-2000:]
