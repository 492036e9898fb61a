"""Cuts and step assembly without Monarch: order, acknowledgements, timeouts, late and final
states, meshes declared by ranks, failing backends."""

import asyncio
import threading

import pytest

from forge_obs.backends.base import LoggerBackend
from forge_obs.controller.pipeline import FlushPipeline


def _snap(**sums):
    return {"states": {k: {"reduction_type": "sum", "sum": float(v)} for k, v in sums.items()},
            "counters": {"values_recorded": len(sums)}}


class Keep(LoggerBackend):
    def init(self, run=None, **kw):
        self.records = []

    def log_step(self, record):
        self.records.append(record)


def _pipeline(timeout=5.0, **backends):
    bes = backends or {"keep": Keep({"logging_mode": ["global_reduce", "per_rank_reduce"]})}
    for b in bes.values():
        b.init()
    return FlushPipeline(backends=bes, run_id="r", flush_timeout_s=timeout), bes


def _ident(mesh, r):
    return {"label": f"{mesh}/r{r}", "mesh": mesh, "rank": r}


def _ranks(n, mesh_id="m", name="trainer"):
    return {(mesh_id, r): f"{name}/r{r}" for r in range(n)}


def _answer(p, cut, r, mesh_id="m", name="trainer", **sums):
    p.ack(cut.seq, (mesh_id, r))
    p.states(cut.seq, (mesh_id, r), _ident(name, r), _snap(**sums))


async def test_steps_leave_in_order_even_when_ranks_answer_out_of_order():
    p, bes = _pipeline()
    p.start()
    c0 = p.begin_cut(0, None, _ranks(2))
    c1 = p.begin_cut(1, None, _ranks(2))
    _answer(p, c1, 0, x=10)
    _answer(p, c1, 1, x=20)
    _answer(p, c0, 1, x=2)
    _answer(p, c0, 0, x=1)
    await p.close()
    recs = bes["keep"].records
    assert [r.step for r in recs] == [0, 1]
    assert [r.global_dict()["x"] for r in recs] == [3.0, 30.0]
    assert sorted(recs[0].per_rank) == ["trainer/r0", "trainer/r1"]
    assert recs[0].global_dict()["obs/missing_ranks"] == 0


async def test_missing_rank_costs_one_timeout_then_is_not_waited_for():
    p, bes = _pipeline(timeout=0.3)
    p.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    c0 = p.begin_cut(0, None, _ranks(2))
    _answer(p, c0, 0, x=1)
    assert not p.wait_cut(c0, 0.05)  # rank 1 has not acknowledged: the cut stays open
    await p.drain()
    first = loop.time() - t0
    assert c0.closed and c0.late == [("m", 1)]
    c1 = p.begin_cut(1, None, _ranks(2))
    _answer(p, c1, 0, x=1)
    assert c1.closed  # rank 1 is lagging: only rank 0 was waited for
    await p.drain()
    second = loop.time() - first - t0
    r0, r1 = bes["keep"].records
    assert r0.missing == ["trainer/r1"] and r0.late == ["trainer/r1"]
    assert r0.global_dict()["obs/missing_ranks"] == 1 and r0.global_dict()["obs/late_ranks"] == 1
    assert r1.missing == ["trainer/r1"] and r1.late == []
    assert first >= 0.3  # waited for the timeout once ...
    assert second < first  # ... but not again for a rank already known to be missing
    # the straggler's late states for step 0 are not lost: they join the next step
    p.ack(c0.seq, ("m", 1))
    p.states(c0.seq, ("m", 1), _ident("trainer", 1), _snap(x=5))
    c2 = p.begin_cut(2, None, _ranks(2))
    _answer(p, c2, 0, x=1)
    _answer(p, c2, 1, x=1)
    await p.close()
    r2 = bes["keep"].records[2]
    assert r2.global_dict()["x"] == 7.0 and r2.missing == []
    assert r2.global_dict()["obs/late_states"] == 1


async def test_a_cut_waits_for_every_ack_including_meshes_declared_by_ranks():
    p, _ = _pipeline()
    p.start()
    cut = p.begin_cut(0, None, _ranks(1))
    p.ack(cut.seq, ("kid", 0))  # a child's ack may overtake its parent's
    assert not cut.closed
    p.ack(cut.seq, ("m", 0), [("kid", 2, "leaf", "Leaf", False)])  # the parent declares 2 ranks
    assert not cut.closed and cut.expected == {("m", 0), ("kid", 0), ("kid", 1)}
    p.ack(cut.seq, ("kid", 1))
    assert cut.closed and cut.late == []
    assert p.book.labels[("kid", 1)] == "leaf/Leaf/r1"
    nxt = p.begin_cut(1, None, _ranks(1))
    assert nxt.expected == {("m", 0), ("kid", 0), ("kid", 1)}  # known from the last ack
    await p.close()


async def test_final_states_of_a_stopped_mesh_answer_the_next_cut():
    p, bes = _pipeline()
    p.start()
    p.final(0, ("g", 0), _ident("gen", 0), _snap(x=4))  # arrives before the cut that expects it
    cut = p.begin_cut(0, _snap(y=1), ranks={}, stopping={("g", 0): "gen/r0"})
    assert cut.closed  # the final states were its answer
    await p.close()
    (rec,) = bes["keep"].records
    assert rec.global_dict()["x"] == 4.0 and rec.global_dict()["y"] == 1.0
    assert rec.missing == []


async def test_a_final_never_lands_in_a_cut_before_the_last_one_its_rank_took():
    p, bes = _pipeline()
    p.start()
    c0 = p.begin_cut(0, None, _ranks(1))
    c1 = p.begin_cut(1, None, _ranks(1))
    _answer(p, c1, 0, x=1)  # rank took cut 1 (seq 2) ...
    p.final(c1.seq, ("m", 0), _ident("trainer", 0), _snap(x=100))  # ... then stopped
    _answer(p, c0, 0, x=1)
    c2 = p.begin_cut(2, None)
    await p.close()
    got = {r.step: r.global_dict().get("x") for r in bes["keep"].records}
    assert got == {0: 1.0, 1: 1.0, 2: 100.0} and c2.seq > c1.seq


async def test_per_rank_views_are_skipped_when_no_backend_wants_them():
    p, bes = _pipeline(keep=Keep({"logging_mode": "global_reduce"}))
    p.start()
    p.begin_cut(0, _snap(y=1))
    await p.close()
    assert bes["keep"].records[0].per_rank == {}
    assert bes["keep"].records[0].global_dict()["y"] == 1.0


async def test_empty_final_step_is_not_logged():
    p, bes = _pipeline()
    p.start()
    p.begin_cut(0, _snap(y=1))
    p.begin_cut(1, {"states": {}, "counters": {}}, final=True)
    await p.close()
    assert [r.step for r in bes["keep"].records] == [0]


class Boom(LoggerBackend):
    def log_step(self, record):
        raise RuntimeError("disk full")


async def test_a_failing_backend_does_not_stop_the_others(caplog):
    keep = Keep({})
    p, bes = _pipeline(boom=Boom({}), keep=keep)
    p.start()
    for s in range(3):
        p.begin_cut(s, _snap(x=s))
    await p.close()
    assert [r.step for r in keep.records] == [0, 1, 2]
    assert p.backend_errors == 3 and p.backend_report()["boom"]["errors"] == 3
    assert p.backend_report()["keep"] == {"steps": 3, "dropped_steps": 0, "errors": 0}
    # obs/backend_errors is the count so far when the step was assembled (the backends run apart)
    assert all(0 <= r.global_dict()["obs/backend_errors"] <= 3 for r in keep.records)
    assert sum("'boom'" in r.getMessage() for r in caplog.records) == 1  # reported once


class Slow(LoggerBackend):
    def init(self, run=None, **kw):
        self.gate = threading.Event()
        self.steps = []

    def log_step(self, record):
        self.gate.wait(30)
        self.steps.append(record.step)


async def test_begin_cut_does_not_wait_for_backends():
    slow = Slow({})
    p, _ = _pipeline(slow=slow)
    p.start()
    for s in range(3):
        p.begin_cut(s, _snap(x=1))  # returns although the backend is blocked
    await asyncio.sleep(0)
    assert slow.steps == []
    slow.gate.set()
    await p.close()
    assert slow.steps == [0, 1, 2]


def test_conflicting_reductions_across_ranks_count_as_dropped():
    async def go():
        p, bes = _pipeline()
        p.start()
        cut = p.begin_cut(0, _snap(k=1), _ranks(1, name="t"))
        p.ack(cut.seq, ("m", 0))
        p.states(cut.seq, ("m", 0), _ident("t", 0), {"states": {"k": {"reduction_type": "max", "max": 3.0}}})
        await p.close()
        return bes["keep"].records[0]

    rec = asyncio.run(go())
    assert "k" not in rec.global_dict()
    assert rec.per_rank  # per-rank views are computed when a backend asks for them
    assert rec.global_dict()["obs/dropped_values"] >= 1


@pytest.mark.parametrize("mode", ["global", "per_rank"])
def test_per_rank_metrics_are_labelled(mode):
    async def go():
        p, bes = _pipeline()
        p.start()
        cut = p.begin_cut(0, None, _ranks(2))
        for r in range(2):
            _answer(p, cut, r, x=r + 1)
        await p.close()
        return bes["keep"].records[0]

    rec = asyncio.run(go())
    if mode == "global":
        assert rec.global_dict()["x"] == 3.0
    else:
        assert {lbl: [m.value for m in ms] for lbl, ms in rec.per_rank.items()} == {"trainer/r0": [1.0], "trainer/r1": [2.0]}
        assert all(m.source == lbl for lbl, ms in rec.per_rank.items() for m in ms)


async def test_states_a_closed_cut_asked_for_are_opened_as_they_come():
    """A large cut's ranks send their states once asked: each is unpickled as it arrives while
    no flush waits (the step's assembly then has only the last one's work left), and left as
    bytes while one does; bytes that do not unpickle still cost only their rank, counted."""
    from forge_obs.wire.snapshot import dumps

    p, bes = _pipeline()
    asked = []
    p.ask_exports = lambda seq, meshes: asked.append((seq, meshes))
    p.start()
    cut = p.begin_cut(0, None, _ranks(3))
    for r in range(3):
        p.ack(cut.seq, ("m", r))
    p.request_exports(cut)
    assert asked == [(cut.seq, ["m"])]
    p.states(cut.seq, ("m", 0), _ident("trainer", 0), dumps(_snap(x=1)))
    received = p.cuts.find(cut.seq).received[("m", 0)]
    assert isinstance(received[1], dict)  # unpickled; its states, pickled one by one, decoded at assembly
    nxt = p.begin_cut(1, None, _ranks(3))  # a flush waits: the inbox thread only moves bytes
    p.states(cut.seq, ("m", 2), _ident("trainer", 2), dumps(_snap(x=2)))
    assert isinstance(p.cuts.find(cut.seq).received[("m", 2)][1], bytes)
    p.states(cut.seq, ("m", 1), _ident("trainer", 1), b"not a pickle")
    for r in range(3):
        p.ack(nxt.seq, ("m", r))
        p.states(nxt.seq, ("m", r), _ident("trainer", r), _snap(x=10))
    await p.close()
    rec, nxt_rec = bes["keep"].records
    g = rec.global_dict()
    assert g["x"] == 3.0
    assert g["obs/dropped/undecodable"] == 1
    assert sorted(rec.per_rank) == ["trainer/r0", "trainer/r2"]
    assert nxt_rec.global_dict()["x"] == 30.0


def test_a_ranks_values_are_reduced_once_for_all_the_backends_that_read_them(monkeypatch):
    """Backends read a step's per-rank values on their own threads: the second reader, arriving
    while the first is reducing, gets the first's result instead of reducing again."""
    from forge_obs.backends import record

    views = record.RankViews({"trainer/r0": _snap(loss=2.0)})
    calls, second, threads = [], [], []
    real = record.snapshot_values

    def reducing(snap):
        calls.append(snap)
        if len(calls) == 1:  # the other backend reads the same rank meanwhile
            t = threading.Thread(target=lambda: second.append(views.values("trainer/r0")))
            t.start()
            t.join(timeout=0.5)  # reduced once, it waits for this reduction to end; else it reduces too
            threads.append(t)
        return real(snap)

    monkeypatch.setattr(record, "snapshot_values", reducing)
    assert views.values("trainer/r0") == {"loss": 2.0}
    threads[0].join()
    assert len(calls) == 1 and second == [{"loss": 2.0}]


class Batches(LoggerBackend):
    """Takes the steps a batch at a time (log_steps); ``fail_at``: a step whose batch raises."""

    def __init__(self, config=None, fail_at=None):
        super().__init__(config)
        self.batches, self.fail_at = [], fail_at

    def log_steps(self, records):
        if self.fail_at is not None and any(r.step == self.fail_at for r in records):
            raise RuntimeError("this backend cannot take the batch")
        self.batches.append([r.step for r in records])


async def test_steps_reach_the_backends_in_batches_within_their_time_in_order_and_none_dropped():
    """Cuts completed faster than the backends are woken: each backend gets every step once, in
    order, a batch per wake-up (the worker hands over at most half a queue at once, so a batch
    alone never fills it). A backend that takes batches and fails one loses that batch's steps only, counted."""
    keep, batches, failing = Keep({}), Batches({}), Batches({}, fail_at=5)
    keep.init()
    n, batch_s = 200, 0.3  # more than one batch (128: half the default queue), less than a queue
    p = FlushPipeline(backends={"keep": keep, "batches": batches, "failing": failing}, run_id="r",
                      flush_timeout_s=5.0, batch_s=batch_s)
    p.start()
    for step in range(n):
        cut = p.begin_cut(step, None, _ranks(1))
        _answer(p, cut, 0, x=step)
    await p.drain(timeout_s=10)
    assert [r.step for r in keep.records] == list(range(n))
    assert [r.global_dict()["x"] for r in keep.records] == [float(s) for s in range(n)]
    assert [s for b in batches.batches for s in b] == list(range(n))
    assert len(batches.batches) < n / 10  # a batch per wake-up, not a step
    report = p.backend_report()
    assert report["keep"]["dropped_steps"] == report["batches"]["dropped_steps"] == 0
    lost = [b for b in batches.batches if 5 in b][0]
    assert report["failing"]["errors"] == len(lost) and report["failing"]["steps"] == n
    assert [s for b in failing.batches for s in b] == [s for s in range(n) if s not in lost]
    await p.close()


async def test_a_step_waits_at_most_its_batch_time_and_drain_does_not_wait_for_it():
    import time

    keep = Keep({})
    keep.init()
    arrived = {}

    class Stamp(LoggerBackend):
        def log_step(self, record):
            arrived[record.step] = time.monotonic()

    p = FlushPipeline(backends={"keep": keep, "stamp": Stamp({})}, run_id="r", flush_timeout_s=5.0, batch_s=0.4)
    p.start()
    cut = p.begin_cut(0, None, _ranks(1))
    _answer(p, cut, 0, x=1)
    t0 = time.monotonic()
    while 0 not in arrived and time.monotonic() - t0 < 5:
        await asyncio.sleep(0.01)
    assert 0.3 <= arrived[0] - t0 < 2.0  # a batch's time: the worker lets it pass once a cut is ready
    cut = p.begin_cut(1, None, _ranks(1))
    _answer(p, cut, 0, x=2)
    t1 = time.monotonic()
    await p.drain(timeout_s=5)  # a caller waiting for every step: no batch waits for its time
    assert 1 in arrived and arrived[1] - t1 < 0.3
    await p.close()
