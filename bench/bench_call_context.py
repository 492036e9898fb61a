"""Cost of the trace context that travels with a Monarch endpoint call (forge_obs.controller.call_context).

    .venv/bin/python bench/bench_call_context.py      # table on stdout, JSON to bench/results/

What a call pays on the caller's side, in Monarch's own message building (its argument check and
the pickling of ``(args, kwargs)``, what ``_create_endpoint_message`` runs for every call), for a
call with 3 small arguments: Monarch's functions as shipped (``baseline``), forge_obs's wrappers
outside any span (one context variable and one thread-local read), and under a span (a link id,
one instant event on the span's track, the wrapped tuple pickled as ``_with_parent(link, args)``).
Also the span itself (``record_span`` enter + exit), which now marks the open span in a context
variable, and the callee's unpickling of a linked vs an unlinked message. Each figure is the
minimum over 21 repeats of the mean per-call thread CPU time of a loop (the least disturbed by
other processes on a shared machine).
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import platform
import sys
import tempfile
import time
from pathlib import Path

N = 5_000
REPEAT = 21


def per_call_us(fn, number: int = N) -> float:
    best = float("inf")
    for _ in range(REPEAT):
        t = time.thread_time_ns()
        for _ in range(number):
            fn()
        best = min(best, (time.thread_time_ns() - t) / number / 1e3)
    return best


def main() -> None:
    from monarch._src.actor import actor_mesh
    from monarch._src.actor.actor_mesh import MethodSpecifier

    from forge_obs.controller import call_context
    from forge_obs.recording import timeline as tl

    def endpoint(self, a: int, b: str, c: float = 0.0) -> None: ...

    sig, method = inspect.signature(endpoint), MethodSpecifier.ReturnsResponse("endpoint")
    args, kwargs = (1, "x"), {"c": 2.5}

    def build() -> object:
        actor_mesh._check_endpoint_arguments(method, sig, args, kwargs)
        return actor_mesh.pickle((args, kwargs), allow_tensor_engine_references=True, allow_mesh_references=True)

    tl.configure(tempfile.mkdtemp(prefix="bcc_"), flush_interval_s=0.05)
    call_context.uninstall()
    rows = {"build_baseline": per_call_us(build)}
    call_context.install()
    rows["build_outside_span"] = per_call_us(build)
    with tl.record_span("caller"):
        rows["build_under_span"] = per_call_us(build)
    # the callee's side: what unpickling a message's (args, kwargs) costs, without / with the link
    plain = pickle.dumps((args, kwargs))
    linked = pickle.dumps((call_context._ArgsWithParent(args, "0a1b2c3d.1"), kwargs))
    actor_mesh.DebugContext.set(actor_mesh.DebugContext())  # as in a handler: the message's token
    rows["unpickle_plain"] = per_call_us(lambda: pickle.loads(plain))
    rows["unpickle_linked"] = per_call_us(lambda: pickle.loads(linked))
    assert pickle.loads(linked) == (args, kwargs) and type(pickle.loads(linked)[0]) is tuple
    tl.set_incoming(None)  # leave the handler's context

    def span() -> None:
        with tl.record_span("s"):
            pass

    rows["record_span"] = per_call_us(span, 20_000)
    tl.close()
    labels = [
        ("build_baseline", "message build, Monarch as shipped"),
        ("build_outside_span", "message build, outside any span"),
        ("build_under_span", "message build, under a span (linked)"),
        ("unpickle_plain", "callee unpickle, unlinked message"),
        ("unpickle_linked", "callee unpickle, linked message"),
        ("record_span", "record_span enter + exit"),
    ]
    print(f"forge_obs call-context benchmark  Python {platform.python_version()}  {os.cpu_count()} CPUs  "
          f"(min of {REPEAT} repeats, thread CPU time)")
    print(f"{'figure':42} | {'us':>7} | {'vs baseline':>11}")
    print("-" * 68)
    base = rows["build_baseline"]
    for k, label in labels:
        extra = f"{rows[k] - base:+7.2f}" if k.startswith("build_") and k != "build_baseline" else ""
        print(f"{label:42} | {rows[k]:7.2f} | {extra:>11}")
    out = Path(__file__).parent / "results" / "bench_call_context.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"per_call_us": rows, "python": sys.version.split()[0]}, indent=1))
    print(f"JSON: {out}")


if __name__ == "__main__":
    main()
