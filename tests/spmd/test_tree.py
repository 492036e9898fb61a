"""The merge tree's bookkeeping (forge_obs.spmd.tree), driven directly: which step leaves when,
who is named missing, late, skipped, and that nothing is lost or counted twice. The clocks are
given, so that no test waits."""

from __future__ import annotations

from types import SimpleNamespace

from forge_obs.spmd.tree import Tree


def piece(step, *, t0=100.0, main=True, n=1, ranks=(), absent=(), skipped=(), finished=(), data=b"p"):
    return SimpleNamespace(step=step, flushed_at=t0, main=main, n_ranks=n, ranks=tuple(ranks), absent=tuple(absent),
                           skipped=tuple(skipped), held_back=0, finished=tuple(finished),
                           reports={r: {"final": True} for r in finished}, bundle=data)


def out(steps):
    return [(s.step, s.n_ranks, sorted(s.missing), sorted(s.late)) for s in steps]


def test_root_waits_for_every_rank_then_names_missing_once_by_the_horizon():
    t = Tree(local_ranks=[0, 1, 2], children={}, timeout_s=5.0, root=True)
    for r in (0, 1):
        t.cut(r, step=0, flushed_at=100.0, data=b"x")
    assert t.ready(now=200.0, horizon=104.9) == []  # the clock is past, the horizon is not: not named
    assert out(t.ready(now=200.0, horizon=105.0)) == [(0, 2, [2], [2])]
    t.cut(0, step=1, flushed_at=106.0, data=b"x")
    t.cut(1, step=1, flushed_at=106.0, data=b"x")
    assert out(t.ready(now=106.0, horizon=106.0)) == [(1, 2, [2], [])]  # lagging: not waited for again
    t.cut(2, step=2, flushed_at=107.0, data=b"x")  # it comes back: waited for again
    t.cut(0, step=2, flushed_at=107.0, data=b"x")
    assert t.ready(now=107.0, horizon=107.0) == []
    t.cut(1, step=2, flushed_at=107.0, data=b"x")
    assert out(t.ready(now=107.0, horizon=107.0)) == [(2, 3, [], [])]


def test_late_cuts_join_the_next_step_emitted_counted_once():
    t = Tree(local_ranks=[0, 1], children={}, timeout_s=5.0, root=True)
    t.cut(0, step=0, flushed_at=100.0, data=b"a0")
    (s0,) = t.ready(now=105.0, horizon=105.0)
    assert s0.missing == {1} and s0.late_in == []
    t.cut(1, step=0, flushed_at=100.0, data=b"b0")  # rank 1's step 0, after it left
    t.cut(0, step=1, flushed_at=106.0, data=b"a1")
    t.cut(1, step=1, flushed_at=106.0, data=b"b1")
    (s1,) = t.ready(now=106.0, horizon=106.0)
    assert s1.missing == set() and [c for late in s1.late_in for c in late.cuts] == [(1, b"b0")]
    assert s1.late_ranks == 1 and t.counts["late_states"] == 1
    assert sorted(s1.cuts) == [(0, b"a1"), (1, b"b1")]


def test_a_rank_that_flushes_a_later_step_skipped_the_earlier_one():
    t = Tree(local_ranks=[0, 1], children={}, timeout_s=5.0, root=True)
    t.cut(0, step=0, flushed_at=100.0, data=b"x")
    t.cut(1, step=0, flushed_at=100.0, data=b"x")
    t.ready(now=100.0, horizon=100.0)
    t.cut(0, step=1, flushed_at=101.0, data=b"x")
    t.cut(1, step=2, flushed_at=101.0, data=b"x", held_back=1)  # its step 1 values are in step 2
    (s1,) = t.ready(now=101.0, horizon=101.0)
    assert (s1.missing, s1.skipped, s1.n_ranks) == (set(), {1}, 1)
    t.cut(0, step=2, flushed_at=102.0, data=b"x")
    (s2,) = t.ready(now=102.0, horizon=102.0)
    assert (s2.n_ranks, s2.held_back) == (2, 1)


def test_a_gone_rank_is_named_at_once_and_finished_ranks_are_not_missing():
    t = Tree(local_ranks=[0, 1, 2], children={}, timeout_s=30.0, root=True)
    for r in (0, 1, 2):
        t.cut(r, step=0, flushed_at=100.0, data=b"x")
    t.ready(now=100.0, horizon=100.0)
    t.cut(2, step=1, flushed_at=101.0, data=b"x", final=True, report={"shipped": 2})
    t.cut(0, step=1, flushed_at=101.0, data=b"x")
    t.rank_gone(1)  # its process ended: named at once, no timeout
    assert out(t.ready(now=101.0, horizon=101.0)) == [(1, 2, [1], [])]
    t.cut(0, step=2, flushed_at=102.0, data=b"x", final=True)
    (s2,) = t.ready(now=102.0, horizon=102.0)
    assert s2.missing == {1}  # rank 2 finished at step 1: not missing
    assert t.done() and t.waiting() == []  # every rank finished or gone, nothing pending
    t.rank_gone(0)  # a finished rank's connection closes: not gone
    t.rank_gone(2)
    assert t.gone == {1} and sorted(t.finished) == [0, 2]


def test_a_helper_with_a_parent_hands_on_by_its_own_clock_and_names_who_is_absent():
    t = Tree(local_ranks=[4, 5], children={}, timeout_s=10.0, root=False)
    t.cut(4, step=0, flushed_at=100.0, data=b"x")
    assert t.ready(now=104.9, horizon=0.0) == []
    (s,) = t.ready(now=105.0, horizon=0.0)  # half the timeout, by its own clock
    assert (s.n_ranks, s.missing) == (1, {5})
    t.cut(5, step=0, flushed_at=100.0, data=b"late")  # a later piece of step 0, for the parent
    (late,) = t.take_late()
    assert (late.step, late.ranks, late.cuts) == (0, {5}, [(5, b"late")])
    t.cut(4, step=1, flushed_at=106.0, data=b"x")
    assert t.ready(now=106.0, horizon=0.0) == []  # rank 5 answered: waited for again
    t.cut(5, step=1, flushed_at=106.0, data=b"x")
    (s1,) = t.ready(now=106.0, horizon=0.0)
    assert (s1.n_ranks, s1.missing) == (2, set())


def test_root_waits_for_ranks_a_child_named_absent_until_its_own_deadline():
    t = Tree(local_ranks=[0], children={1: [1, 2, 3]}, timeout_s=10.0, root=True)
    t.cut(0, step=0, flushed_at=100.0, data=b"x")
    t.piece(1, piece(0, n=2, absent=[3]))
    assert t.ready(now=109.0, horizon=109.0) == []  # rank 3 may still come, as a later piece
    t.piece(1, piece(0, main=False, ranks=[3], n=1, data=b"r3"))
    (s0,) = t.ready(now=109.0, horizon=109.0)
    assert (s0.n_ranks, s0.missing, s0.pieces) == (4, set(), [b"p", b"r3"])
    t.cut(0, step=1, flushed_at=110.0, data=b"x")
    t.piece(1, piece(1, t0=110.0, n=2, absent=[3]))
    (s1,) = t.ready(now=120.0, horizon=120.0)
    assert (s1.missing, s1.late) == ({3}, {3})
    t.cut(0, step=2, flushed_at=121.0, data=b"x")
    t.piece(1, piece(2, t0=121.0, n=2, absent=[3]))
    (s2,) = t.ready(now=121.0, horizon=121.0)  # rank 3 is lagging: not waited for
    assert (s2.missing, s2.late) == ({3}, set())
    t.piece(1, piece(3, t0=122.0, n=3))  # every rank again: rank 3 counted again
    t.cut(0, step=3, flushed_at=122.0, data=b"x")
    (s3,) = t.ready(now=122.0, horizon=122.0)
    assert (s3.n_ranks, s3.missing) == (4, set()) and t.lagging == set()


def test_a_child_that_never_delivers_a_step_makes_its_whole_subtree_missing_after_the_timeout():
    t = Tree(local_ranks=[0], children={1: [1, 2], 2: [3]}, timeout_s=10.0, root=True)
    t.cut(0, step=0, flushed_at=100.0, data=b"x")
    t.piece(2, piece(0, n=1))
    (s0,) = t.ready(now=110.0, horizon=110.0)
    assert s0.missing == {1, 2} and s0.n_ranks == 2
    t.child_gone(1)
    t.cut(0, step=1, flushed_at=111.0, data=b"x")
    t.piece(2, piece(1, t0=111.0, n=1))
    (s1,) = t.ready(now=111.0, horizon=111.0)
    assert s1.missing == {1, 2} and t.gone == {1, 2}


def test_the_memory_bound_hands_on_the_oldest_step_early_and_counts_it():
    t = Tree(local_ranks=[0, 1], children={}, timeout_s=30.0, root=True, max_pending_bytes=10)
    t.cut(0, step=0, flushed_at=100.0, data=b"123456")
    assert t.ready(now=100.0, horizon=100.0) == []
    t.cut(0, step=1, flushed_at=100.0, data=b"123456")
    (s0,) = t.ready(now=100.0, horizon=100.0)
    assert (s0.step, s0.early, s0.missing, s0.late) == (0, True, {1}, set())
    assert t.counts["early_steps"] == 1 and 1 not in t.lagging  # not blamed: it was not late


def test_drain_hands_on_every_pending_step_and_a_last_one_for_late_states():
    t = Tree(local_ranks=[0, 1], children={}, timeout_s=30.0, root=True)
    t.cut(0, step=0, flushed_at=100.0, data=b"x")
    (s0,) = t.ready(now=130.0, horizon=130.0)
    t.cut(1, step=0, flushed_at=100.0, data=b"late")
    t.cut(0, step=1, flushed_at=131.0, data=b"x")
    steps = t.drain()
    assert [s.step for s in steps] == [1] and steps[0].late_ranks == 1
    t.cut(1, step=0, flushed_at=100.0, data=b"later still")
    (extra,) = t.drain()
    assert extra.step == 2 and extra.late_ranks == 1


def test_a_rank_that_held_back_and_finished_is_skipped_not_missing_in_steps_begun_after_it_left():
    """Rank 1's final cut (step 3, its steps 1-2 held back into it) and its connection's close are
    read before rank 0's cuts of steps 1-2: rank 1 skipped them (its values are in step 3), as it
    does when they were begun first. Who is missing never depends on the order the cuts are read in."""
    for close_first in (True, False):
        t = Tree(local_ranks=[0, 1], children={}, timeout_s=60.0, root=True)
        for r in (0, 1):
            t.cut(r, step=0, flushed_at=100.0, data=b"x")
        t.ready(now=100.0, horizon=100.0)
        if not close_first:
            t.cut(0, step=1, flushed_at=101.0, data=b"x")
        t.cut(1, step=3, flushed_at=101.0, data=b"x", held_back=2, final=True, report={"held_back_flushes": 2})
        t.rank_gone(1)  # it finished: its connection closes
        got = []
        for s in (1, 2):
            if close_first or s == 2:
                t.cut(0, step=s, flushed_at=101.0 + s, data=b"x")
            got += t.ready(now=102.0, horizon=102.0)
        t.cut(0, step=3, flushed_at=104.0, data=b"x", final=True)
        got += t.ready(now=104.0, horizon=104.0)
        assert [(s.step, s.n_ranks, s.missing, s.skipped) for s in got] == \
            [(1, 1, set(), {1}), (2, 1, set(), {1}), (3, 2, set(), set())], close_first
        assert t.done() and t.gone == set() and t.lagging == set()


def test_a_child_whose_ranks_finished_is_not_missing_in_steps_begun_after_it_left():
    """The same order across helpers: the child's last piece (its rank finished at step 3, having
    skipped steps 1-2) and the child's close are read before the root's own rank begins steps 1-2."""
    t = Tree(local_ranks=[0], children={1: [1]}, timeout_s=60.0, root=True)
    t.cut(0, step=0, flushed_at=100.0, data=b"x")
    t.piece(1, piece(0))
    t.ready(now=100.0, horizon=100.0)
    t.piece(1, piece(3, t0=101.0, finished=[1]))
    t.child_gone(1)
    t.cut(0, step=1, flushed_at=102.0, data=b"x")
    t.cut(0, step=2, flushed_at=103.0, data=b"x")
    t.cut(0, step=3, flushed_at=104.0, data=b"x", final=True)
    got = t.ready(now=104.0, horizon=104.0)
    assert [(s.step, s.missing, s.late) for s in got] == [(1, set(), set()), (2, set(), set()), (3, set(), set())]
    assert t.gone == set() and t.done()


def two_levels():
    """A root with rank 0 and a child helper with ranks 1-2, step 0 handed on whole."""
    t = Tree(local_ranks=[0], children={1: [1, 2]}, timeout_s=60.0, root=True)
    t.cut(0, step=0, flushed_at=100.0, data=b"x")
    t.piece(1, piece(0, n=2))
    t.ready(now=100.0, horizon=100.0)
    return t


def test_a_child_that_skipped_a_step_names_its_ranks_skipped_in_either_order():
    """The child's ranks 1-2 held step 1 back into step 2 (its main piece of step 2 comes first,
    before or after the root's own rank begins step 1): step 1 is short by exactly them, skipped,
    not missing; step 2 carries them."""
    for root_first in (True, False):
        t = two_levels()
        if root_first:
            t.cut(0, step=1, flushed_at=101.0, data=b"x")
        t.piece(1, piece(2, t0=101.0, n=2))
        if not root_first:
            t.cut(0, step=1, flushed_at=101.0, data=b"x")
        t.cut(0, step=2, flushed_at=102.0, data=b"x")
        got = t.ready(now=102.0, horizon=102.0)
        assert [(s.step, s.n_ranks, s.missing, s.skipped) for s in got] == \
            [(1, 1, set(), {1, 2}), (2, 3, set(), set())], root_first


def test_a_rank_absent_from_the_piece_after_a_skipped_step_is_awaited_and_counted_once():
    """The child's main piece of step 2 (rank 1 in it, rank 2 not there in time) is its first
    after step 1: rank 1 skipped step 1; rank 2 may still deliver it. It does, as a later piece:
    reported in step 1, never also skipped. Then rank 2 skips step 2 (its later piece is of step
    3): skipped there, not missing."""
    t = two_levels()
    t.cut(0, step=1, flushed_at=101.0, data=b"x")
    t.piece(1, piece(2, t0=101.0, n=1, absent=[2]))
    assert t.ready(now=102.0, horizon=102.0) == []  # rank 2's step 1 may still come
    t.piece(1, piece(1, t0=101.0, main=False, ranks=[2], data=b"r2"))
    t.cut(0, step=2, flushed_at=102.0, data=b"x")
    (s1,) = t.ready(now=102.0, horizon=102.0)
    assert (s1.n_ranks, s1.missing, s1.skipped, s1.pieces) == (2, set(), {1}, [b"r2"])
    t.piece(1, piece(3, t0=103.0, main=False, ranks=[2], data=b"r2"))  # rank 2 skipped step 2
    t.cut(0, step=3, flushed_at=103.0, data=b"x")
    t.piece(1, piece(3, t0=103.0, n=1, absent=[2]))
    (s2,) = t.ready(now=103.0, horizon=103.0)
    assert (s2.n_ranks, s2.missing, s2.skipped) == (2, set(), {2})
    assert t.lagging == set() and t.counts["late_states"] == 0


def test_a_rank_absent_from_a_piece_that_then_flushes_a_later_step_skipped_it():
    """The child handed step 1 on without rank 2 (not there in time); rank 2's next cut is of
    step 2 (its step 1 held back into it): skipped in step 1, not missing."""
    t = two_levels()
    t.cut(0, step=1, flushed_at=101.0, data=b"x")
    t.piece(1, piece(1, t0=101.0, n=1, absent=[2]))
    t.piece(1, piece(2, t0=102.0, n=2))
    t.cut(0, step=2, flushed_at=102.0, data=b"x")
    got = t.ready(now=102.0, horizon=102.0)
    assert [(s.step, s.n_ranks, s.missing, s.skipped) for s in got] == [(1, 2, set(), {2}), (2, 3, set(), set())]


def test_a_middle_helper_names_the_ranks_of_a_child_that_skipped_a_step():
    """Three levels: helper 1 (rank 4; child helper 2 with rank 5) hands step 1 up; helper 2's
    rank skipped it: helper 1's piece names rank 5 skipped, and the root counts it."""
    mid = Tree(local_ranks=[4], children={2: [5]}, timeout_s=60.0, root=False)
    mid.cut(4, step=0, flushed_at=100.0, data=b"x")
    mid.piece(2, piece(0))
    mid.ready(now=100.0, horizon=0.0)
    mid.cut(4, step=1, flushed_at=101.0, data=b"x")
    mid.piece(2, piece(2, t0=101.0))
    (s1,) = mid.ready(now=101.0, horizon=0.0)
    assert (s1.step, s1.n_ranks, s1.missing, s1.skipped) == (1, 1, set(), {5})
    t = Tree(local_ranks=[0], children={1: [4, 5]}, timeout_s=60.0, root=True)
    t.cut(0, step=1, flushed_at=101.0, data=b"x")
    t.piece(1, piece(1, t0=101.0, n=1, absent=sorted(s1.missing), skipped=sorted(s1.skipped)))
    (r1,) = t.ready(now=101.0, horizon=101.0)
    assert (r1.n_ranks, r1.missing, r1.skipped) == (2, set(), {5})


def test_a_source_whose_first_delivery_is_a_later_step_skipped_the_earlier_ones_in_either_order():
    """A rank (or a child helper) whose very first cut (piece) is of a later step held the earlier
    steps back into it: skipped there, not awaited and not missing, whether the step it skipped
    was begun before or after its first delivery was read."""
    for first_is_later in (True, False):
        t = Tree(local_ranks=[0, 1], children={2: [2, 3]}, timeout_s=60.0, root=True)
        if first_is_later:
            t.cut(1, step=2, flushed_at=100.0, data=b"x", held_back=2)
            t.piece(2, piece(2, t0=100.0, n=2))
        t.cut(0, step=0, flushed_at=100.0, data=b"x")
        t.cut(0, step=1, flushed_at=100.5, data=b"x")
        if not first_is_later:
            t.cut(1, step=2, flushed_at=100.0, data=b"x", held_back=2)
            t.piece(2, piece(2, t0=100.0, n=2))
        t.cut(0, step=2, flushed_at=101.0, data=b"x")
        got = t.ready(now=101.0, horizon=101.0)  # nothing is due: no timeout needed
        assert [(s.step, s.n_ranks, s.missing, s.skipped) for s in got] == \
            [(0, 1, set(), {1, 2, 3}), (1, 1, set(), {1, 2, 3}), (2, 4, set(), set())], first_is_later
