"""Reduce on the way up (forge_obs.wire.bundle, forge_obs.controller.aggregate, forge_obs.wire.plan): exact merges, the
same step records on the aggregated route as on the direct one, and the aggregated route on two
real localhost Monarch hosts (a dead member, a hung leader, a dead leader)."""

from __future__ import annotations

import asyncio
import doctest
import json
import math
import os
import pickle
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from forge_obs.wire.bundle import bundle_snapshot, exact_parts, make_bundle, merge_bundles
from forge_obs.backends.base import LoggerBackend
from forge_obs.controller.pipeline import FlushPipeline
from forge_obs.wire.merge import reduce_snapshots

ROOT = Path(__file__).resolve().parents[2]


def _rank_snapshot(rng: random.Random, i: int) -> dict:
    v = [rng.uniform(-1e6, 1e6) * rng.choice([1.0, 1e-9, 1e12]) for _ in range(5)]
    return {
        "packed": {
            "mean": (["a", "b"], [(v[0], rng.randint(1, 5)), (v[1], 1)]),
            "sum": (["s"], [v[2]]),
            "max": (["mx"], [v[3]]),
            "min": (["mn"], [v[3]]),
            "std": (["sd"], [(4, v[4], abs(v[4]))]),
            "count": (["c"], [rng.randint(0, 9)]),
            "last": (["l"], [(v[0], rng.random())]),
        },
        "states": {"smp": {"reduction_type": "sample", "rows": [{"i": i}], "seen": 1}},
        "counters": {"values_recorded": 9, "dropped_by_reason": {"bad": 1}},
    }


def _groups(rng: random.Random, keys: list) -> list[list]:
    keys = list(keys)
    rng.shuffle(keys)
    out, i = [], 0
    while i < len(keys):
        j = i + rng.randint(1, 8)
        out.append(keys[i:j])
        i = j
    return out


def test_bundles_reduce_to_the_same_values_as_every_rank_at_the_controller():
    """Any grouping of ranks into bundles (one or two levels) reduces to exactly what the
    controller computes from every rank's snapshot: bit for bit for SUM, MEAN, MAX, MIN, COUNT
    and LAST; STD to 1e-9; every SAMPLE row kept below the reservoir's cap."""
    rng = random.Random(7)
    for trial in range(150):
        snaps = {("m", r): _rank_snapshot(rng, r) for r in range(rng.randint(2, 40))}
        flat = {m.key: m.value for m in reduce_snapshots(list(snaps.values()))}
        bundles = [make_bundle({k: snaps[k] for k in g}) for g in _groups(rng, snaps)]
        if trial % 2 and len(bundles) > 2:
            bundles = [merge_bundles(bundles[:3])] + bundles[3:]
        tree = {m.key: m.value for m in reduce_snapshots([bundle_snapshot(b) for b in bundles])}
        for key in ("a", "b", "s", "mx", "mn", "c", "l"):
            assert tree[key] == flat[key], (key, tree[key], flat[key])
        assert math.isclose(tree["sd"], flat["sd"], rel_tol=1e-9)
        assert sorted(r["i"] for r in tree["smp"]) == sorted(r["i"] for r in flat["smp"])
        merged_counters = merge_bundles(bundles)["merged"]["counters"]
        assert merged_counters["values_recorded"] == 9 * len(snaps)
        assert merged_counters["dropped_by_reason"] == {"bad": len(snaps)}


def test_exact_parts_keep_fsum_semantics_for_cancellation_infinities_and_overflow():
    assert math.fsum(exact_parts([1e16, 1.0, -1e16])) == 1.0  # a naive sum gives 0.0
    assert math.fsum(exact_parts([1.0, math.inf])) == math.inf
    assert math.isnan(math.fsum(exact_parts([1.0, math.nan, 2.0])))
    with pytest.raises(ValueError):  # exactly what the controller's fsum raises today
        math.fsum(exact_parts([math.inf, 1.0]) + exact_parts([-math.inf]))
    with pytest.raises(OverflowError):
        math.fsum(exact_parts([1.7e308, 1.7e308]))


def test_a_key_recorded_with_two_reductions_is_dropped_everywhere():
    a = {"packed": {"mean": (["k", "ok"], [(1.0, 1), (2.0, 1)])}, "states": {}}
    b = {"packed": {"sum": (["k"], [3.0]), "mean": (["ok"], [(4.0, 1)])}, "states": {}}
    c = {"packed": {"mean": (["k", "ok"], [(5.0, 1), (6.0, 1)])}, "states": {}}
    b1, b2 = make_bundle({("m", 0): a, ("m", 1): b}), make_bundle({("m", 2): c})
    assert b1["conflicts"] == {"k": ["mean", "sum"]}
    top = merge_bundles([b1, b2])  # the conflicting key goes from the other bundle's rows too
    values = {m.key: m.value for m in reduce_snapshots([bundle_snapshot(top)])}
    assert values == {"ok": 4.0} and top["conflicts"] == {"k": ["mean", "sum"]}


# ---------------------------------------------------------------- pipeline, no Monarch
class _Keep(LoggerBackend):
    def __init__(self, config):
        super().__init__(config)
        self.records = []

    def log_step(self, record):
        self.records.append(record)


def _feed_today(pipe, seq, snaps, silent=()):
    for k, snap in snaps.items():
        if k in silent:
            continue
        pipe.ack(seq, k, ())
        pipe.states(seq, k, {"label": f"m/r{k[1]}", "mesh": "m", "rank": k[1]}, pickle.dumps(snap))


def _feed_agg(pipe, seq, snaps, groups, silent=()):
    for g in groups:
        acked = [k for k in g if k not in silent]
        pipe.ack_batch(seq, [(k, ()) for k in acked], [k for k in g if k in silent])
        idents = {k: {"label": f"m/r{k[1]}", "mesh": "m", "rank": k[1]} for k in acked}
        pipe.bundle(seq, acked, pickle.dumps(make_bundle({k: snaps[k] for k in acked}, per_rank=True)), idents)


def test_aggregated_route_logs_the_same_steps_as_the_direct_one():
    """The same ranks' states, sent one per rank (direct) or as ack batches and bundles, give the
    same step records: global values, per-rank values, raw values, and the same ranks named
    missing and late when one does not answer (the aggregator names it; the cut does not wait
    for the controller's timeout)."""
    rng = random.Random(3)
    keys = [("m", r) for r in range(9)]
    labels = {k: f"m/r{k[1]}" for k in keys}
    groups = [keys[0:3], keys[3:6], keys[6:9]]
    steps = []
    for _ in range(3):
        snaps = {k: _rank_snapshot(rng, k[1]) for k in keys}
        for k, s in snaps.items():
            s["raw"] = [("x", float(k[1]), 1.0)]
        steps.append(snaps)
    mode = {"logging_mode": ["global_reduce", "per_rank_reduce", "per_rank_no_reduce"]}

    async def run(kind):
        be = _Keep(mode)
        timeout = 0.5
        pipe = FlushPipeline({"keep": be}, "t", flush_timeout_s=timeout)
        pipe.start()
        waited = []
        for step, snaps in enumerate(steps):
            silent = {("m", 4)} if step == 1 else set()
            cut = pipe.begin_cut(step, None, labels)
            if kind == "today":
                _feed_today(pipe, cut.seq, snaps, silent)
            else:
                _feed_agg(pipe, cut.seq, snaps, groups, silent)
            t0 = time.monotonic()
            if not pipe.wait_cut(cut, 5):
                pipe.close_cut(cut)
            waited.append(time.monotonic() - t0)
        await pipe.drain()
        await pipe.close()
        return be.records, waited

    today, waited_today = asyncio.run(run("today"))
    agg, waited_agg = asyncio.run(run("agg"))
    assert [r.step for r in agg] == [r.step for r in today] == [0, 1, 2]
    for t, a in zip(today, agg):
        tg = {k: v for k, v in t.global_dict().items() if not k.startswith("obs/")}
        ag = {k: v for k, v in a.global_dict().items() if not k.startswith("obs/")}
        assert set(ag) == set(tg)
        for key, v in tg.items():
            if key == "sd":
                assert math.isclose(ag[key], v, rel_tol=1e-9)
            elif key == "smp":
                assert sorted(r["i"] for r in ag[key]) == sorted(r["i"] for r in v)
            else:
                assert ag[key] == v, key
        for key in ("obs/missing_ranks", "obs/late_ranks", "obs/values_recorded", "obs/ranks_reported"):
            assert a.global_dict()[key] == t.global_dict()[key], key
        pt, pa = t.per_rank_values(), a.per_rank_values()
        assert set(pa) == set(pt)
        for label in pt:
            assert {k: v for k, v in pa[label].items() if k not in ("sd", "smp")} == \
                   {k: v for k, v in pt[label].items() if k not in ("sd", "smp")}, label
        assert {lb: sorted(v) for lb, v in a.raw.items()} == {lb: sorted(v) for lb, v in t.raw.items()}
        assert (a.missing, a.late) == (t.missing, t.late)
    assert today[1].missing == ["m/r4"] and today[1].late == ["m/r4"]
    # today's cut waits for the silent rank until its timeout; the aggregator already named it
    assert waited_today[1] >= 0.45 and waited_agg[1] < 0.45


def test_a_late_bundle_goes_into_the_next_step_once():
    """A bundle whose step already left (a hung aggregator that resumed) lands in the next step
    being assembled, counted in obs/late_states, never twice."""
    be = _Keep({"logging_mode": "global_reduce"})
    keys = [("m", r) for r in range(4)]
    labels = {k: f"m/r{k[1]}" for k in keys}
    snap = {"packed": {"sum": (["n"], [1.0])}, "states": {}}

    async def run():
        pipe = FlushPipeline({"keep": be}, "t", flush_timeout_s=0.3)
        pipe.start()
        c0 = pipe.begin_cut(0, None, labels)
        pipe.ack_batch(c0.seq, [(k, ()) for k in keys[:2]])
        pipe.bundle(c0.seq, keys[:2], pickle.dumps(make_bundle({k: snap for k in keys[:2]})))
        pipe.wait_cut(c0, 2) or pipe.close_cut(c0)  # keys 2-3 (one group) are silent: late
        await pipe.drain()
        c1 = pipe.begin_cut(1, None, labels)
        pipe.ack_batch(c0.seq, [(k, ()) for k in keys[2:]])  # the resumed aggregator's old cut
        pipe.bundle(c0.seq, keys[2:], pickle.dumps(make_bundle({k: snap for k in keys[2:]})))
        pipe.ack_batch(c1.seq, [(k, ()) for k in keys])
        for g in (keys[:2], keys[2:]):
            pipe.bundle(c1.seq, g, pickle.dumps(make_bundle({k: snap for k in g})))
        await pipe.drain()
        await pipe.close()

    asyncio.run(run())
    g0, g1 = be.records[0].global_dict(), be.records[1].global_dict()
    assert g0["n"] == 2.0 and be.records[0].late == ["m/r2", "m/r3"]
    assert g1["n"] == 6.0 and g1["obs/late_states"] == 2.0 and not be.records[1].missing


def test_a_group_whose_leader_does_not_deliver_is_asked_to_resend_within_the_cut():
    """Two groups; group B's leader (m/r5) never answers cut 0. Half of flush_timeout_s after the
    cut, the pipeline asks B's ranks (not A's, whose bundle came) to resend; the live ones do, and
    step 0 has their values with only the leader late and missing. The leader's bundle of that
    cut, arriving later, is dropped (its members' states came by their resends), so every value
    counts once; its own states, resent too, land in the next step."""
    import threading

    be = _Keep({"logging_mode": "global_reduce"})
    keys = [("m", r) for r in range(6)]
    labels = {k: f"m/r{k[1]}" for k in keys}
    groups = {("m", 2): keys[:3], ("m", 5): keys[3:]}
    asked: list = []
    got_ask = threading.Event()

    def snap(r):
        return pickle.dumps({"packed": {"sum": (["n"], [float(r + 1)])}, "states": {}})

    def ident(k):
        return {"label": labels[k], "mesh": "m", "rank": k[1]}

    async def run():
        pipe = FlushPipeline({"keep": be}, "t", flush_timeout_s=1.0,
                             ask_resend=lambda seq, ranks: (asked.append((seq, ranks)), got_ask.set()))
        pipe.start()
        c0 = pipe.begin_cut(0, None, labels, groups=groups)
        pipe.ack_batch(c0.seq, [(k, ()) for k in keys[:3]])
        pipe.bundle(c0.seq, keys[:3], pickle.dumps(make_bundle({k: pickle.loads(snap(k[1])) for k in keys[:3]})),
                    leader=("m", 2))
        assert await asyncio.get_running_loop().run_in_executor(None, got_ask.wait, 5)
        for k in keys[3:5]:  # the live members answer the request
            pipe.ack(c0.seq, k, ())
            pipe.states_resent(c0.seq, k, ident(k), snap(k[1]))
        pipe.wait_cut(c0, 5) or pipe.close_cut(c0)
        await pipe.drain()
        # the stopped leader resumes: its bundle of cut 0 (fenced), then its own resend
        pipe.bundle(c0.seq, keys[3:], pickle.dumps(make_bundle({k: pickle.loads(snap(k[1])) for k in keys[3:]})),
                    leader=("m", 5))
        pipe.ack(c0.seq, keys[5], ())
        pipe.states_resent(c0.seq, keys[5], ident(keys[5]), snap(5))
        pipe.states_resent(c0.seq, keys[4], ident(keys[4]), snap(4))  # a second resend: dropped
        c1 = pipe.begin_cut(1, None, labels, groups=groups)
        _feed_today(pipe, c1.seq, {k: {"packed": {"sum": (["n"], [1.0])}, "states": {}} for k in keys})
        await pipe.drain()
        await pipe.close()
        return pipe

    pipe = asyncio.run(run())
    assert asked == [(1, {"m": [3, 4, 5]})]
    g0, g1 = be.records[0].global_dict(), be.records[1].global_dict()
    assert g0["n"] == 1 + 2 + 3 + 4 + 5 and be.records[0].missing == be.records[0].late == ["m/r5"]
    assert g1["n"] == 6 + 6 and g1["obs/late_states"] == 1 and not be.records[1].missing
    assert pipe.cuts.fenced_bundles == 1 and pipe.cuts.duplicates_dropped == 1


def test_a_member_resends_a_cut_once_and_answers_a_cut_it_has_not_taken_directly():
    """``Route.resend_cut``: what the rank sent its leader for that cut goes to the controller
    (states as RESENT), once; a later resend of everything kept for that leader (a new plan) does
    not repeat it; a cut the controller asked about before the rank took it is answered directly."""
    from forge_obs.controller.aggregate import Route
    from forge_obs.wire.messages import ACK, RESENT, STATES, Ack, States, view, wire

    class Port:
        def __init__(self):
            self.got = []

        def send(self, msg):
            self.got.append(msg)

    ctl, leader = Port(), Port()
    route = Route(("m", 0), ctl)
    route.plan = {"leader": {0: 1}, "ports": {1: leader}}
    for seq in (1, 2):
        route.send(leader, wire(Ack(ACK, seq, ("m", 0), [], None)))
        route.send(leader, wire(States(STATES, seq, ("m", 0), {}, b"s%d" % seq)))
    route.resend_cut(2)
    assert ctl.got == [wire(Ack(ACK, 2, ("m", 0), [], None)), wire(States(RESENT, 2, ("m", 0), {}, b"s2"))]
    assert all(type(m) is tuple for m in ctl.got)  # what travels is a plain tuple
    route.resend(next(iter(route.sent)))
    assert [view(m).seq for m in ctl.got] == [2, 2, 1, 1]
    route.resend_cut(4)
    assert route.target(4, None) is ctl and route.target(5, None) is leader


# ---------------------------------------------------------------- real Monarch, two hosts
def _scenario(*args: str, timeout: float = 240, **env_extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               **env_extra)
    p = subprocess.run([sys.executable, "-m", "tests.support.agg_programs", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise AssertionError(f"scenario failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


@pytest.mark.parametrize("aggregate", ["on", "off"])
def test_two_monarch_hosts_are_exact_and_name_a_dead_rank(aggregate):
    """Two localhost Monarch hosts x 3 procs: each host's ranks answer through one leader (2 ack
    batches + 2 bundles per step instead of 12 messages); global, per-rank and raw values are
    exactly every live rank's; a rank killed while recording step 3 costs that flush the
    leader's wait (< flush_timeout_s), is named late and missing, and is not waited for again.
    The direct route ("off") logs the same values with 2 messages per rank."""
    timeout_s = 4.0
    out = _scenario("--hosts", "2", "--procs", "3", "--steps", "5", "--kill", "4", "--kill-at", "3",
                    "--flush-timeout", str(timeout_s), "--aggregate", aggregate)
    steps = {int(k): v for k, v in out["steps"].items()}
    labels = [f"m/Rec/r{r}" for r in range(6)]
    for step in range(5):
        live = [r for r in range(6) if not (step >= 3 and r == 4)]
        rec = steps[step]
        g = rec["global"]
        assert g["check/sum"] == sum(r + 1 for r in live), step
        assert g["check/count"] == len(live)
        assert g["check/mean"] == sum(live) / len(live)
        assert g["check/max"] == max(live)
        assert sorted(rec["per_rank"]) == sorted(labels[r] for r in live)
        for r in live:
            assert rec["per_rank"][labels[r]] == {"check/sum": r + 1.0, "check/mean": float(r),
                                                  "check/max": float(r), "check/count": 1.0}
            assert sorted(map(tuple, rec["raw"][labels[r]])) == sorted(
                [("check/count", 1), ("check/max", float(r)), ("check/mean", float(r)), ("check/sum", r + 1.0)])
    assert steps[3]["late"] == ["m/Rec/r4"] and steps[3]["missing"] == ["m/Rec/r4"]
    if aggregate == "off":
        # one message per rank: a small cut's states come with its ack
        assert out["messages"]["2"] == 6 and steps[2]["global"]["obs/bundles"] == 0.0
        assert out["blocked_s"]["3"] >= timeout_s * 0.9  # the controller's own timeout
        return
    # the plan settles by the second cut (every fetcher's hello has arrived by then)
    assert out["messages"]["2"] == 4  # one ack batch and one bundle per host
    assert steps[2]["global"]["obs/bundles"] == 2.0
    assert out["blocked_s"]["3"] < timeout_s  # the leader gave up on it first
    assert steps[4]["missing"] == ["m/Rec/r4"] and steps[4]["late"] == []
    assert out["blocked_s"]["4"] < timeout_s  # not waited for again (that would cost the timeout)


def test_a_hung_leader_costs_one_timeout_and_its_group_loses_nothing():
    """Host 1's leader (rank 5) holds its GIL for 6 s from step 2: that flush costs
    flush_timeout_s; its members, asked to resend directly, keep their values in step 2, and only
    rank 5 is named late and missing. The next cut goes around it and, once it resumes, what it
    took arrives with the next step assembled (its queued bundle is dropped: the members' values
    came from their resends): every value of every rank is logged exactly once, none is lost."""
    timeout_s = 2.0
    out = _scenario("--hosts", "2", "--procs", "3", "--steps", "5", "--hang", "5", "--hang-at", "2",
                    "--hang-s", "6", "--flush-timeout", str(timeout_s))
    steps = {int(k): v for k, v in out["steps"].items()}
    _assert_step_of(steps[2], list(range(5)))
    assert steps[2]["late"] == ["m/Rec/r5"] and steps[2]["missing"] == ["m/Rec/r5"]
    assert out["blocked_s"]["2"] >= timeout_s * 0.9
    # step 3 begins once rank 5 answers again; its step-2 values come late, once, with the next
    # step assembled after they arrive (3, or 4 when step 3 left first): per step 6 values, 21
    # summed, plus rank 5's 1 and 6
    later = [steps[s]["global"] for s in (3, 4)]
    assert sum(g["check/count"] for g in later) == 2 * 6 + 1
    assert sum(g["check/sum"] for g in later) == 2 * 21 + 6
    assert later[1]["obs/late_states"] == 1
    assert sum(steps[s]["global"]["check/count"] for s in range(5)) == 5 * 6
    assert all(out["blocked_s"][str(s)] < timeout_s for s in (3, 4))  # not waited for again
    assert all(set(steps[s]["missing"]) <= {"m/Rec/r5"} for s in (3, 4))


def test_a_dead_leaders_members_resend_and_regroup():
    """Host 1's leader (rank 5) exits while recording step 2. What its members sent it comes back
    undeliverable (a 2 s delivery timeout) and they resend it to the controller, or the
    controller asks them for it first: their values are all in step 2, only the dead rank is
    late and missing; from the next cut the group answers through a new leader."""
    out = _scenario("--hosts", "2", "--procs", "3", "--steps", "6", "--kill", "5", "--kill-at", "2",
                    "--flush-timeout", "2", HYPERACTOR_MESSAGE_DELIVERY_TIMEOUT="2s")
    steps = {int(k): v for k, v in out["steps"].items()}
    assert steps[2]["late"] == ["m/Rec/r5"] and steps[2]["missing"] == ["m/Rec/r5"]
    for s in range(2, 6):
        _assert_step_of(steps[s], list(range(5)))
    for s in (3, 4, 5):
        assert steps[s]["missing"] == ["m/Rec/r5"] and not steps[s]["late"]
    # both hosts aggregated again (the inbox may still see late resends of step 2's messages,
    # returned undeliverable after Monarch's delivery timeout, and drops them as duplicates)
    assert steps[5]["global"]["obs/bundles"] == 2.0 and steps[5]["global"]["obs/ranks_reported"] == 5


def _assert_step_of(rec: dict, live: list) -> None:
    """The step's values are exactly the live ranks' own: globally and per rank."""
    g = rec["global"]
    assert (g["check/count"], g["check/sum"], g["check/max"]) == (len(live), sum(r + 1 for r in live), max(live))
    assert g["check/mean"] == sum(live) / len(live)
    assert sorted(rec["per_rank"]) == [f"m/Rec/r{r}" for r in live]


@pytest.mark.parametrize("signal", ["KILL", "STOP"])
def test_a_leader_killed_or_stopped_costs_its_members_nothing(signal):
    """Host 1's leader (rank 5) is killed (SIGKILL) or stopped (SIGSTOP) while recording step 2,
    with Monarch's default delivery timeout (nothing comes back undeliverable in time). The
    controller does not get the group's answer, asks the members to resend theirs directly,
    within the same flush: step 2 has the values of every live rank, only rank 5 is late and
    missing. Later steps go through a new leader without waiting for rank 5. A stopped leader
    that is continued after step 3 brings its own step-2 values late, once."""
    timeout_s = 3.0
    extra = ("--resume-after", "3") if signal == "STOP" else ()
    out = _scenario("--hosts", "2", "--procs", "3", "--steps", "6", "--kill", "5", "--kill-at", "2",
                    "--signal", signal, *extra, "--flush-timeout", str(timeout_s))
    steps = {int(k): v for k, v in out["steps"].items()}
    for s in (0, 1):
        _assert_step_of(steps[s], list(range(6)))
    _assert_step_of(steps[2], list(range(5)))
    assert steps[2]["missing"] == ["m/Rec/r5"] and steps[2]["late"] == ["m/Rec/r5"]
    assert out["blocked_s"]["2"] < timeout_s * 1.5
    _assert_step_of(steps[3], list(range(5)))
    assert steps[3]["missing"] == ["m/Rec/r5"] and steps[3]["late"] == []
    assert out["blocked_s"]["3"] < timeout_s  # rank 5 is not waited for again (that would cost the timeout)
    if signal == "KILL":
        for s in (4, 5):
            _assert_step_of(steps[s], list(range(5)))
            assert steps[s]["missing"] == ["m/Rec/r5"] and steps[s]["late"] == []
        assert steps[5]["global"]["obs/bundles"] == 2.0
        return
    # continued after step 3: its step-2 values come once, with a later step; it records no more
    later = [steps[s]["global"] for s in (4, 5)]
    assert sum(g["check/count"] for g in later) == 2 * 5 + 1
    assert sum(g["check/sum"] for g in later) == 2 * 15 + 6
    assert sum(g["obs/late_states"] for g in later) >= 1


def test_module_examples_run():
    import forge_obs.wire.bundle
    import forge_obs.wire.plan

    for mod in (forge_obs.wire.bundle, forge_obs.wire.plan):
        res = doctest.testmod(mod)
        assert res.attempted > 0 and res.failed == 0, mod.__name__


def test_the_plan_leads_each_host_group_by_its_highest_live_rank_and_fences_replaced_leaders():
    from forge_obs.wire.plan import AUTO_MIN_RANKS, Planner

    p = Planner()
    for r in range(6):
        p.hello(("m", r), f"h{r // 3}", f"port{r}")
    p.hello(("solo", 0), "h0", "portS")
    plan = p.replan("m", 6, set(), True, 10.0, "on", 6)
    assert plan["leader"] == {0: 2, 1: 2, 2: 2, 3: 5, 4: 5, 5: 5} and plan["per_rank"] is True
    assert plan["groups"][5] == [("m", 3), ("m", 4), ("m", 5)]
    assert plan["ack_wait_s"] == 9.0 and plan["step_wait_s"] == 9.5
    v5 = plan["version"][5]
    assert p.current(("m", 5), v5) and p.replan("m", 6, set(), True, 10.0, "on", 6) is None
    assert p.replan("solo", 1, set(), True, 10.0, "on", 7) is None  # a lone rank answers directly
    # the leader of host 1 lags: rank 4 leads with a new version; the old leader's bundles are fenced
    plan = p.replan("m", 6, {("m", 5)}, True, 10.0, "on", 6)
    assert plan["leader"][3] == 4 and plan["lagging"][4] == [("m", 5)]
    assert not p.current(("m", 5), v5) and p.current(("m", 4), plan["version"][4])
    assert plan["version"][2] == 1  # host 0's leader is unchanged: its bundles stay good
    # auto: below AUTO_MIN_RANKS ranks in the job the route is direct; "off" always
    q = Planner()
    for r in range(4):
        q.hello(("a", r), "h", r)
    assert q.replan("a", 4, set(), False, 1.0, "auto", AUTO_MIN_RANKS - 1) is None
    assert q.replan("a", 4, set(), False, 1.0, "auto", AUTO_MIN_RANKS)["leader"] == {r: 3 for r in range(4)}
    assert q.replan("a", 4, set(), False, 1.0, "off", 64)["leader"] == {}  # back to direct: cast once


@pytest.mark.parametrize("public_only", [False, True])
def test_the_aggregator_receives_with_a_timeout_on_either_monarch_api(public_only):
    """The leader's receive: Monarch's receive task (fast path) or the public recv().get(timeout)
    fallback; a timeout returns None and loses no message."""
    from monarch.actor import Channel

    from forge_obs.controller.monarch_internals import receiver_with_timeout

    port, rx = Channel.open()
    recv = receiver_with_timeout(rx, public_only=public_only)
    t0 = time.monotonic()
    assert recv(0.2) is None and time.monotonic() - t0 >= 0.19
    port.send(("a", 1))
    port.send(("b", 2))
    assert recv(5.0) == ("a", 1) and recv(None) == ("b", 2)
    assert recv(0.05) is None
    port.send(("c", 3))
    assert recv(5.0) == ("c", 3)


def test_config_checks_the_aggregate_mode(monkeypatch):
    from forge_obs.controller.config import LoggerConfig

    monkeypatch.delenv("FORGE_OBS_AGGREGATE", raising=False)
    assert LoggerConfig.parse({"jsonl": None}).aggregate == "auto"
    assert LoggerConfig.parse({"jsonl": None, "aggregate": "off"}).aggregate == "off"
    with pytest.raises(ValueError, match="aggregate must be one of 'auto', 'on', 'off'"):
        LoggerConfig.parse({"aggregate": True})
    monkeypatch.setenv("FORGE_OBS_AGGREGATE", "on")
    assert LoggerConfig.parse({"jsonl": None}).aggregate == "on"


def test_streamed_values_and_drops_are_counted_per_rank_through_bundles():
    """Counters that do not add up (the step a rank streamed raw values under) stay per rank in a
    bundle: obs/stream_step_mismatch counts the values streamed under a step their flush did not
    take, as on the direct route; dropped values by reason add up."""
    be = _Keep({"logging_mode": "global_reduce"})
    keys = [("m", r) for r in range(3)]

    def snap(r):
        counters = {"values_recorded": 2, "dropped_values": 1, "dropped_by_reason": {"bad_value": 1}}
        if r:  # rank 1 streamed 5 values under step 0 (right), rank 2 7 under step 3 (wrong)
            counters.update(streamed_early=5 if r == 1 else 7, streamed_step=0 if r == 1 else 3)
        return {"packed": {"sum": (["n"], [1.0])}, "states": {}, "counters": counters}

    async def run():
        pipe = FlushPipeline({"keep": be}, "t", flush_timeout_s=5)
        pipe.start()
        cut = pipe.begin_cut(0, None, {k: f"m/r{k[1]}" for k in keys})
        pipe.ack_batch(cut.seq, [(k, ()) for k in keys])
        pipe.bundle(cut.seq, keys, pickle.dumps(make_bundle({k: snap(k[1]) for k in keys})))
        await pipe.drain()
        await pipe.close()

    asyncio.run(run())
    g = be.records[0].global_dict()
    assert g["n"] == 3.0 and g["obs/bundles"] == 1.0 and g["obs/ranks_reported"] == 3.0
    assert g["obs/stream_step_mismatch"] == 7.0
    assert g["obs/values_recorded"] == 6.0 and g["obs/dropped/bad_value"] == 3.0 and g["obs/dropped_values"] == 3.0


def test_a_malformed_state_in_a_group_costs_only_its_key():
    """A state without its reduction type is set aside and counted; the group's other keys and
    the same key's well-formed states of other ranks still merge exactly."""
    from forge_obs.wire.bundle import merge_packed

    good = {"packed": {"sum": (["n"], [2.0])}, "states": {}, "counters": {"values_recorded": 1}}
    bad = {"packed": {"sum": (["n"], [3.0])}, "states": {"s": {"no_type": 1}}, "counters": {"values_recorded": 2}}
    merged, conflicts, drops = merge_packed([good, bad])
    assert merged["packed"]["sum"] == (["n"], [5.0])
    assert "s" not in merged["states"] and not conflicts
    assert drops == {"bad_state": {"s"}}  # the key, counted once per step
    assert merged["counters"]["values_recorded"] == 3
