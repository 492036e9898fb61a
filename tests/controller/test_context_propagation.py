"""A trace context that travels with a Monarch endpoint call (forge_obs.controller.call_context):
the callee receives exactly its arguments, its spans are children of the caller's span (one link
per call, concurrent calls each to their own caller), and the critical path follows that exact
link where inference alone names another process. Real Monarch meshes, a user's script."""

from __future__ import annotations

import contextvars
import json

from forge_obs.analysis.critical_path import analyse
from forge_obs.analysis.critical_path import graph as cp_graph
from forge_obs.recording import timeline as tl
from forge_obs.recording.timeline import recorder
from tests.support.helpers import ROOT, run_as_user

SCRIPT = ROOT / "tests" / "user_scripts" / "linked_calls.py"


def _in_a_fresh_thread(body) -> None:
    """Run ``body`` in a new thread: a track of its own and an empty context, whatever spans
    earlier tests of this process left open (planted hangs) on the main thread."""
    import threading

    err: list = []

    def run():
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test
            err.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if err:
        raise err[0]


def _path(r: dict) -> list:
    return [(s["mesh"], s["rank"], s["name"], s["link"]) for s in r["path"]]


def test_linked_calls_from_a_users_script(tmp_path):
    res = run_as_user(SCRIPT, tmp_path, str(tmp_path))
    out = {d["check"]: d for d in map(json.loads, res.stdout.splitlines())}
    assert "done" in out
    # the callee received exactly what it was sent, under a span (linked) as outside any
    a = out["args"]
    assert a["same"] is True and a["pair"] == [1, 0, 3]
    seen = a["outside"]
    assert seen["type"] == "tuple" and len(seen["args"]) == 305 and seen["args"][:3] == ["0", "1", "2"]
    assert seen["args"][300:] == ["'s'", "None", "2.5", "Point(1, 2)", "{'k': [1, 2]}"] and seen["points"] == [True]
    assert seen["kwargs"] == {f"k{i}": str(i) for i in range(50)}
    assert out["concurrent"]["tags"] == ["a", "b"]

    g = cp_graph.load(tmp_path / "calls")
    by = {}
    for s in g.spans:
        by.setdefault(s.name, []).append(s)
    # two concurrent calls into one async actor: each callee span is linked to its own caller
    (wa,), (wb,) = by["work_a"], by["work_b"]
    assert wa.caller.name == "wait_a" and wb.caller.name == "wait_b"
    assert wa.caller.lane != wb.caller.lane and wa.stream.mesh == "workers"
    # calls made outside any span carry nothing, on an async and on a thread-based actor
    assert by["unlinked"][0].caller is None and by["unlinked"][0].link is None
    assert by["sync_linked"][0].caller.name == "ctl_sync"
    assert by["sync_unlinked"][0].caller is None and by["sync_unlinked"][0].link is None
    (leaf,) = by["nested_leaf"]  # a mesh process's call, under its span, to another actor
    assert leaf.caller.name == "relay" and leaf.caller.stream.mesh == "workers" and by["relay"][0].caller is None
    gen = {s.stream.rank: s for s in by["generate"]}
    assert gen[0].caller.name == "ctl_step" and gen[1].caller is None

    # step 1: the controller awaited replica 0; replica 1 ran a longer generate that nobody awaited
    r = {x["step"]: x for x in analyse(g)}[1]
    assert ("gen", 0, "generate", "call") in _path(r)
    assert not [p for p in _path(r) if p[0] == "gen" and p[1] == 1]
    for s in g.spans:  # the same run, links removed: inference alone picks the wrong process
        s.caller, s.called = None, []
    r0 = {x["step"]: x for x in analyse(g)}[1]
    assert ("gen", 1, "generate", "inferred") in _path(r0)
    assert not [p for p in _path(r0) if p[0] == "gen" and p[1] == 0]


def test_call_link_only_under_a_span(tmp_path):
    check = tl.link_check()
    tl.set_link_check(None)  # no Monarch message here: a link holds for its context
    tl.close()
    recorder.clear()  # earlier tests' records made before any configure are not this run's
    tl.configure(tmp_path)
    links = []

    def body():
        assert tl.call_link() is None  # outside any span: nothing
        with tl.record_span("outer"):
            with tl.record_span("inner"):
                link = tl.call_link()
            assert type(link) is str and tl.call_link() != link
            task_ctx = contextvars.copy_context()  # what a task created here inherits
            assert type(task_ctx.run(tl.call_link)) is str
        assert tl.call_link() is None
        assert task_ctx.run(tl.call_link) is None  # a task that outlived the span: no longer under it
        # a handler's incoming link marks its top-level spans only
        tl.set_incoming(link, None)
        with tl.record_span("callee"):
            with tl.record_span("nested"):
                pass
        tl.set_incoming(None)
        links.append(link)

    try:
        _in_a_fresh_thread(body)
    finally:
        tl.close()
        tl.set_link_check(check)
    (link,) = links
    g = cp_graph.load(tmp_path)
    by = {s.name: s for s in g.spans}
    assert by["callee"].link == link and by["nested"].link is None
    assert by["callee"].caller is by["inner"] and by["inner"].called == [by["callee"]]


TRACED = ROOT / "tests" / "user_scripts" / "traced_spans.py"


def test_trace_on_endpoints_writes_linked_spans_from_a_users_script(tmp_path):
    """``@trace`` alone (no ``record_span``): every traced call is a span named after its prefix,
    linked to the span that made the call, from the controller to a mesh and from a mesh process
    to another mesh; the critical path follows those links; a ``Tracer``'s region and its steps are
    spans too, and each span carries its thread's CPU time (busy work against a sleep)."""
    from forge_obs.analysis import reader

    res = run_as_user(TRACED, tmp_path, str(tmp_path))
    assert json.loads(res.stdout.splitlines()[-1]) == {"results": [[0, 0], [1, 1], [2, 2]]}
    g = cp_graph.load(tmp_path / "traced")
    by: dict = {}
    for s in g.spans:
        by.setdefault(s.name, []).append(s)
    ctl = by["controller/step"]
    assert sorted(s.step for s in ctl) == [0, 1, 2] and all(g.controller(s) for s in ctl)
    steps = by["trainer/train_step"]
    assert len(steps) == 6 and len({s.stream.rank for s in steps}) == 2
    for s in steps:  # each trainer call is linked to the controller's traced span that made it
        assert s.caller is not None and s.caller.name == "controller/step"
        assert s.caller.start <= s.start and s.end <= s.caller.end
    assert sorted((s.caller.step, s.stream.rank) for s in steps) == [(k, r) for k in range(3) for r in (0, 1)]
    refs = by["ref/logprobs"]
    assert len(refs) == 6
    for s in refs:  # a call made inside a traced endpoint of another mesh: linked to that endpoint's span
        assert s.caller is not None and s.caller.name == "trainer/train_step" and s.caller.stream is not s.stream
        assert s.caller.start <= s.start and s.end <= s.caller.end
    for s in by["trainer/phases"]:  # the Tracer's region, inside the endpoint's span, and its step inside it
        assert s.parent is not None and s.parent.name == "trainer/train_step"
    assert len(by["trainer/phases"]) == 6
    assert all(s.parent is not None and s.parent.name == "trainer/phases" for s in by["trainer/phases/forward"])
    path = {x["step"]: x for x in analyse(g)}[1]
    assert ("trainer/train_step", "call") in {(p["name"], p["link"]) for p in path["path"]}

    run = reader.scan(tmp_path / "traced")
    cpu = {}
    for it in reader.walk(run):
        if it[0] is reader.SPAN and it[3] in ("trainer/phases", "ref/logprobs"):
            cpu.setdefault(it[3], []).append((it[8], it[6]))  # (cpu_us, dur_us)
    # the busy region spent its time on the CPU; the sleeping endpoint waited (first call of each
    # name always carries its CPU time; both are long enough to carry it every time)
    assert all(c is not None and 30_000 <= c <= d for c, d in cpu["trainer/phases"])
    assert all(c is not None and c < d / 4 for c, d in cpu["ref/logprobs"])


def test_trace_span_carries_the_incoming_link(tmp_path):
    """A ``@trace`` span opened at top level while a linked message is handled carries the link,
    as a ``record_span`` span does; the spans nested in it do not."""
    from forge_obs.recording.tracer import trace

    check = tl.link_check()
    tl.set_link_check(None)
    tl.close()
    recorder.clear()  # earlier tests' records made before any configure are not this run's
    tl.configure(tmp_path)

    @trace("callee/traced")
    def traced():
        with tl.record_span("nested"):
            pass

    links = []

    def body():
        with tl.record_span("caller"):
            links.append(tl.call_link())
        tl.set_incoming(links[0], None)
        traced()
        tl.set_incoming(None, None)

    try:
        _in_a_fresh_thread(body)
    finally:
        tl.close()
        tl.set_link_check(check)
    (link,) = links
    g = cp_graph.load(tmp_path)
    by = {s.name: s for s in g.spans}
    assert by["callee/traced"].link == link and by["callee/traced"].caller is by["caller"]
    assert by["nested"].link is None and by["nested"].parent is by["callee/traced"]


def test_a_task_created_under_a_span_calls_under_it(tmp_path):
    """A call made in a task created while a span was open (``asyncio.gather`` of coroutines
    that call endpoints) is linked to that span, whether it was opened in a task or around the
    event loop by sync code; a task still running after the span ended is not."""
    import asyncio

    check = tl.link_check()
    tl.set_link_check(None)
    tl.close()
    recorder.clear()  # earlier tests' records made before any configure are not this run's
    tl.configure(tmp_path)
    links = {}

    async def child(tag):
        links[tag] = tl.call_link()

    async def main():
        with tl.record_span("async_parent"):
            await asyncio.gather(child("in_task"))
        t = asyncio.get_running_loop().create_task(child("late"))
        await t

    def body():
        asyncio.run(main())
        with tl.record_span("sync_parent"):
            asyncio.run(child("under_sync"))
        asyncio.run(child("outside"))

    try:
        _in_a_fresh_thread(body)
    finally:
        tl.close()
        tl.set_link_check(check)
    assert links["late"] is None and links["outside"] is None
    g = cp_graph.load(tmp_path)
    for tag, link in (("in_task", links["in_task"]), ("under_sync", links["under_sync"])):
        assert type(link) is str, tag
    names = {s.name: s for s in g.spans}
    # the "call" events sit on the open span's track, inside it: the caller the graph finds
    calls = {}
    from forge_obs.analysis import reader

    for it in reader.walk(reader.scan(tmp_path)):
        if it[0] is reader.INSTANT and it[3] == "call":
            calls[it[6]["p"]] = (it[2], it[5])
    for tag, parent in (("in_task", "async_parent"), ("under_sync", "sync_parent")):
        lane, ts = calls[links[tag]]
        p = names[parent]
        assert lane == p.lane and p.start <= ts <= p.end, tag
