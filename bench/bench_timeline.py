"""Structured timeline benchmarks: hot path, bytes per record, writer throughput, export.

    .venv/bin/python bench/bench_timeline.py            # prints a table, writes bench/results/timeline.json
    .venv/bin/python bench/bench_timeline.py --quick    # smaller N, no 64-rank export

Baseline, same run: TorchTitan 0.3.0's structured logger (``torchtitan.observability.
structured_logger``: ``log_trace_span`` + ``generate_gantt_trace``). It is used when importable
(``pip install --no-deps torchtitan==0.3.0``, or ``--titan-src DIR`` pointing at an unpacked
wheel); otherwise the baseline column is empty. Its 64-rank export is not re-run (minutes; the
issue quotes 43-95 s and 3.5 GB on this machine).

Figures are printed, never asserted. The caller's cost per span is the minimum over 21 loops of
its thread CPU time (what it costs the caller; on a shared machine a loop's wall time also counts
the other jobs, so it is printed beside it), against the floor of a span measured in the same
run (the clock twice, two tuples appended to a deque). Export wall time and peak RSS are
measured on a separate ``forge-obs trace`` process with /usr/bin/time (interpreter start-up
included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers

SPAN_NAMES = ["train_step", "data", "h2d", "forward", "loss", "backward", "allreduce", "optim", "metrics", "sync_weights"]


def _py_env(extra_path: str | None = None) -> dict:
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT)] + ([extra_path] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("MONARCH_FILE_LOG", "error")
    return env


def _timed(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """(wall s, peak RSS MB, stdout) of a child process, measured by /usr/bin/time."""
    tb = shutil.which("time") or "/usr/bin/time"
    out = subprocess.run([tb, "-f", "__TIME__ %e %M", *cmd], env=env, capture_output=True, text=True)
    m = re.search(r"__TIME__ ([\d.]+) (\d+)", out.stderr)
    if out.returncode != 0 or not m:
        raise RuntimeError(f"{cmd} failed: {out.stderr[-2000:]}")
    return float(m.group(1)), int(m.group(2)) / 1024, out.stdout


# ------------------------------------------------------------------ forge_obs side
REPEAT = 21


def _best_us(loop, n: int, reset, timer) -> float:
    """Minimum over REPEAT runs of ``loop(n)``'s time per call, in µs (``reset()`` before each)."""
    best = float("inf")
    for _ in range(REPEAT):
        reset()
        t = timer()
        loop(n)
        best = min(best, (timer() - t) / n * 1e6)
    reset()
    return best


class _FloorSpan:
    """The floor of a span: the clock twice, two tuples appended to a deque."""

    __slots__ = ("name", "t0")
    buf: Any = None

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        t = self.t0 = time.perf_counter_ns()
        _FloorSpan.buf.append((1, t, self.name))
        return self

    def __exit__(self, *exc):
        _FloorSpan.buf.append((2, time.perf_counter_ns()))


def _span_loop(rs, name="train_step"):
    def loop(n):
        for _ in range(n):
            with rs(name):
                pass

    return loop


def ours_caller(n: int) -> dict:
    """The caller's cost per span (enter + exit), in thread CPU time and wall time (minimum over
    REPEAT loops of ``n`` spans; a configured timeline, its buffer emptied between loops), against
    the floor measured in the same run; nested, carrying its CPU time, and with torch imported
    (the compile check on)."""
    from collections import deque

    from forge_obs.recording import timeline as tl
    from forge_obs.recording.timeline import recorder

    d = Path(tempfile.mkdtemp(prefix="tlc_"))
    tl.close()
    tl.configure(d, flush_interval_s=3600)  # the writer idle: its work is measured on its own
    tl.set_step(12345)
    _FloorSpan.buf = deque(maxlen=recorder.BUFFER_CAP)
    out: dict = {}
    for timer, unit in ((time.thread_time, "cpu"), (time.perf_counter, "wall")):
        out[f"floor_{unit}_us"] = _best_us(_span_loop(_FloorSpan), n, _FloorSpan.buf.clear, timer)
        out[f"caller_{unit}_us"] = _best_us(_span_loop(tl.record_span), n, recorder.clear, timer)
    with tl.record_span("outer"):
        out["nested_cpu_us"] = _best_us(_span_loop(tl.record_span, "inner"), n, recorder.clear, time.thread_time)
    saved, recorder.CPU_MIN_NS = recorder.CPU_MIN_NS, 0  # every span reads the thread's CPU clock
    try:
        out["with_cpu_time_cpu_us"] = _best_us(_span_loop(tl.record_span, "long"), n, recorder.clear, time.thread_time)
    finally:
        recorder.CPU_MIN_NS = saved
    out["thread_time_ns_us"] = _best_us(lambda k: [time.thread_time_ns() for _ in range(k)], n, lambda: None,
                                        time.thread_time)
    import torch  # noqa: F401 - a training process: records are skipped under torch.compile

    recorder.refresh_compile_check()
    out["torch_cpu_us"] = _best_us(_span_loop(tl.record_span), n, recorder.clear, time.thread_time)
    tl.close()
    shutil.rmtree(d, ignore_errors=True)
    return out


def ours_hot_path(n: int) -> dict:
    from forge_obs.recording import timeline as tl

    d = Path(tempfile.mkdtemp(prefix="tlb_"))
    tl.close()
    rs = tl.record_span
    # the writer's work per span: one pass over n spans, on this thread
    tl.configure(d / "a", flush_interval_s=3600)
    tl.set_step(12345)
    _span_loop(rs)(n)
    t = time.thread_time()
    tl.flush()
    writer = (time.thread_time() - t) / n * 1e6
    tl.close()
    (f,) = (d / "a" / "events").glob("*.jsonl")
    lines = f.read_text().splitlines()
    recs = [ln for ln in lines if ln[:1] == "[" and ln[1:2] != '"']
    bytes_per = sum(len(x) + 1 for x in recs) / len(recs)
    # with attributes and a flow id
    tl.configure(d / "b", flush_interval_s=3600)
    for i in range(2000):
        with rs("generate", flow=f"episode-{i}", n_samples=8):
            pass
    tl.close()
    (f,) = (d / "b" / "events").glob("*.jsonl")
    recs = [ln for ln in f.read_text().splitlines() if ln[:1] == "[" and ln[1:2] != '"']
    bytes_flow = sum(len(x) + 1 for x in recs) / len(recs)
    # tight loop with the writer live (its GIL share lands on the caller)
    tl.configure(d / "c")
    t = time.perf_counter()
    _span_loop(rs)(n)
    live = (time.perf_counter() - t) / n * 1e6
    tl.close()
    shutil.rmtree(d, ignore_errors=True)
    return {"writer_us": writer, "live_loop_us": live, "bytes_per_span": bytes_per,
            "bytes_per_span_flow_attrs": bytes_flow}


def ours_throughput(rate: int, seconds: float) -> dict:
    """Produce ``rate`` spans/s for ``seconds`` (paced), watch the backlog and the file."""
    from forge_obs.recording import timeline as tl
    from forge_obs.recording.timeline import recorder

    d = Path(tempfile.mkdtemp(prefix="tlt_"))
    tl.close()
    tl.configure(d)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rs = tl.record_span
    batch = rate // 100
    produced = 0
    max_backlog = 0
    t0 = time.perf_counter()
    tick = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(batch):
            with rs("generate"):
                pass
        produced += batch
        tick += 1
        max_backlog = max(max_backlog, recorder.pending())
        delay = t0 + tick * 0.01 - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
    achieved = produced / (time.perf_counter() - t0)
    t = time.perf_counter()
    deadline = t + 5
    while recorder.pending() and time.perf_counter() < deadline:
        time.sleep(0.005)
    drain_s = time.perf_counter() - t
    tl.close()
    (f,) = (d / "events").glob("*.jsonl")
    written = sum(1 for ln in f.open() if ln[:1] == "[" and ln[1:2] != '"')
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shutil.rmtree(d, ignore_errors=True)
    return {"rate": achieved, "produced": produced, "written": written, "max_backlog": max_backlog,
            "drain_after_s": drain_s, "rss_growth_mb": (rss1 - rss0) / 1024}


def make_dataset(root: Path, ranks: int, steps: int) -> int:
    """Rank 0 written by the real writer (13 records/step: step + 10 nested spans + event + tag),
    then cloned per rank with its own header (identity, session). Returns records written."""
    from forge_obs.recording import timeline as tl
    from forge_obs.core.identity import current_identity
    from forge_obs.recording.timeline import writer

    tl.close()
    ident = current_identity()
    saved = (ident.mesh, ident.rank, ident.world_size, writer.SESSION)
    src = root / "_src"
    try:
        ident.mesh, ident.rank, ident.world_size = "trainer", 0, ranks
        tl.configure(src, flush_interval_s=0.05)
        rs = tl.record_span
        for s in range(steps):
            tl.set_step(s)
            with rs("train_step", flow=f"v{s}" if s % 10 == 0 else None):
                for name in SPAN_NAMES[1:]:
                    with rs(name):
                        pass
                tl.record_event("weights_pushed", version=s)
            if s % 50 == 0:
                tl.add_step_tag("eval")
            else:
                tl.add_step_tag("train")
        tl.close()
    finally:
        ident.mesh, ident.rank, ident.world_size, writer.SESSION = saved
    (f,) = (src / "events").glob("*.jsonl")
    lines = f.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    body = "".join(lines[1:])
    (root / "events").mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        h = dict(header, rank=r, pid=100000 + r, session=f"bench{r}", coords={"gpus": r}, ctl=False)
        (root / "events" / f"bench_{100000 + r}_trainer_{r}.jsonl").write_text(json.dumps(h) + "\n" + body)
    shutil.rmtree(src)
    return ranks * (len(lines) - 1)


def ours_export(root: Path) -> tuple[float, float, int]:
    out = root / "trace.json"
    wall, rss, _ = _timed([sys.executable, "-c", "import sys; from forge_obs.cli import main; sys.exit(main())",
                           "trace", str(root), "-o", str(out)], _py_env())
    return wall, rss, out.stat().st_size


# ------------------------------------------------------------------ TorchTitan side
TITAN_HOT = r"""
import json, sys, time, glob, os
from torchtitan.observability import structured_logger as sl
out, n = sys.argv[1], int(sys.argv[2])
sl.init_structured_logger(source="trainer", output_dir=out, rank=0)
sl.set_step(12345)
for _ in range(50):
    with sl.log_trace_span("warmup"):
        pass
t = time.perf_counter()
for _ in range(n):
    with sl.log_trace_span("train_step"):
        pass
el = (time.perf_counter() - t) / n * 1e6
files = [f for f in glob.glob(out + "/**/*.jsonl", recursive=True)]
lines = [ln for f in files for ln in open(f)]
span_lines = [ln for ln in lines if "train_step" in ln]
print(json.dumps({"span_us": el, "bytes_per_record": sum(len(x) for x in span_lines) / max(len(span_lines), 1),
                  "records_per_span": len(span_lines) / n}))
"""

TITAN_GEN = r"""
import sys
from torchtitan.observability import structured_logger as sl
out, rank, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = %r
sl.init_structured_logger(source="trainer", output_dir=out, rank=rank)
for s in range(steps):
    sl.set_step(s)
    with sl.log_trace_span(names[0]):
        for name in names[1:]:
            with sl.log_trace_span(name):
                pass
        sl.log_trace_instant("weights_pushed")
    sl.log_trace_scalar({"loss": 0.5})
""" % (SPAN_NAMES + ["metrics2"],)

TITAN_EXPORT = r"""
import sys, glob, os
from torchtitan.observability.structured_logger.gantt_generator import generate_gantt_trace
out = sys.argv[1]
dirs = sorted({os.path.dirname(f) for f in glob.glob(out + "/**/*.jsonl", recursive=True)})
generate_gantt_trace(dirs[0], sys.argv[2])
"""


def titan_available(src: str | None) -> bool:
    code = "import torchtitan.observability.structured_logger"
    r = subprocess.run([sys.executable, "-c", code], env=_py_env(src), capture_output=True, text=True)
    return r.returncode == 0


def titan_hot(src: str | None, n: int) -> dict:
    d = tempfile.mkdtemp(prefix="tt_")
    r = subprocess.run([sys.executable, "-c", TITAN_HOT, d, str(n)], env=_py_env(src), capture_output=True, text=True)
    shutil.rmtree(d, ignore_errors=True)
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def titan_export(src: str | None, ranks: int, steps: int) -> tuple[float, float, int]:
    d = Path(tempfile.mkdtemp(prefix="ttx_"))
    env = _py_env(src)
    for r in range(ranks):
        g = subprocess.run([sys.executable, "-c", TITAN_GEN, str(d), str(r), str(steps)], env=env, capture_output=True, text=True)
        if g.returncode:
            raise RuntimeError(g.stderr[-2000:])
    out = d / "gantt.json"
    wall, rss, _ = _timed([sys.executable, "-c", TITAN_EXPORT, str(d), str(out)], env)
    size = out.stat().st_size
    shutil.rmtree(d, ignore_errors=True)
    return wall, rss, size


# ------------------------------------------------------------------ main
def _caller_rows(caller: dict, th: "dict | None") -> list:
    floor = caller["floor_cpu_us"]
    return [
        ("span enter+exit, caller CPU (µs) | floor", "<= 1", caller["caller_cpu_us"], floor),
        ("  same, wall clock (µs) | titan (wall)", "-", caller["caller_wall_us"], th and th["span_us"]),
        ("  nested in an open span, CPU (µs) | floor", "<= 1", caller["nested_cpu_us"], floor),
        ("  torch imported (compile check), CPU (µs)", "<= 1", caller["torch_cpu_us"], None),
        ("  a span carrying its CPU time, CPU (µs)", "-", caller["with_cpu_time_cpu_us"], None),
        ("  time.thread_time_ns() itself (µs)", "-", caller["thread_time_ns_us"], None),
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--titan-src", default=os.environ.get("TORCHTITAN_SRC"), help="dir holding an unpacked torchtitan wheel")
    ap.add_argument("--no-titan", action="store_true")
    args = ap.parse_args()
    n = 50_000 if args.quick else 200_000
    rows: list[tuple] = []
    res: dict = {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_before": os.getloadavg()}
    titan = (not args.no_titan) and titan_available(args.titan_src)
    res["baseline"] = "torchtitan 0.3.0 structured_logger" if titan else None

    caller = ours_caller(10_000)
    res["caller"] = caller
    hot = ours_hot_path(n)
    res["hot"] = hot
    th = titan_hot(args.titan_src, 2000 if args.quick else 5000) if titan else None
    res["titan_hot"] = th
    rows += _caller_rows(caller, th)
    rows.append(("  + writer work per span, background (µs)", "-", hot["writer_us"], None))
    rows.append(("  tight loop with writer live (µs/span)", "-", hot["live_loop_us"], None))
    rows.append(("bytes per span record", "<= 120", hot["bytes_per_span"],
                 th and th["bytes_per_record"] * th["records_per_span"]))
    rows.append(("  with flow id + 1 attribute (B)", "-", hot["bytes_per_span_flow_attrs"], None))

    tp = ours_throughput(20_000, 2.0 if args.quick else 4.0)
    res["throughput"] = tp
    rows.append(("writer at 20k spans/s: achieved rate", ">= 20000", tp["rate"], None))
    rows.append(("  max backlog (records) / written of produced", "bounded",
                 f"{tp['max_backlog']} / {tp['written']}=={tp['produced']}", None))
    rows.append(("  RSS growth over the run (MB)", "bounded", tp["rss_growth_mb"], None))

    tmp = Path(tempfile.mkdtemp(prefix="tlx_"))
    recs4 = make_dataset(tmp / "r4", 4, 1000)
    w4, m4, s4 = ours_export(tmp / "r4")
    t4 = titan_export(args.titan_src, 4, 1000) if titan else None
    res["export4"] = {"records": recs4, "wall_s": w4, "rss_mb": m4, "trace_bytes": s4, "titan": t4}
    rows.append((f"export 4x1000 steps ({recs4} records): wall s", "<= 1", w4, t4 and t4[0]))
    rows.append(("  peak RSS (MB)", "<= 100", m4, t4 and t4[1]))
    if not args.quick:
        recs64 = make_dataset(tmp / "r64", 64, 1000)
        w64, m64, s64 = ours_export(tmp / "r64")
        res["export64"] = {"records": recs64, "wall_s": w64, "rss_mb": m64, "trace_bytes": s64}
        rows.append((f"export 64x1000 steps ({recs64} records): wall s", "<= 15", w64, None))
        rows.append(("  peak RSS (MB)", "<= 300", m64, None))
    shutil.rmtree(tmp, ignore_errors=True)
    res["load_after"] = os.getloadavg()
    _report(res, rows)
    return 0


def _report(res: dict, rows: list) -> None:
    def fmt(v):
        if v is None:
            return "-"
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    print(f"\nforge_obs timeline benchmarks ({res['cpus']} CPUs, Python {res['python']}, load "
          f"{res['load_before'][0]:.1f} -> {res['load_after'][0]:.1f}); baseline: {res['baseline'] or 'n/a'}")
    print(f"{'figure | baseline':52} {'target':>9} {'forge_obs':>16} {'baseline':>10} {'ratio':>7}")
    for fig, target, ours, base in rows:
        ratio = f"{base / ours:.2g}x" if isinstance(ours, float) and isinstance(base, float) and ours > 0 else ""
        print(f"{fig:52} {target:>9} {fmt(ours):>16} {fmt(base):>10} {ratio:>7}")
    res["rows"] = [[str(x) if not isinstance(x, (int, float)) or x is None else x for x in r] for r in rows]
    outdir = ROOT / "bench" / "results"
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "timeline.json").write_text(json.dumps(res, indent=2, default=str))
    print(f"\nwrote {outdir / 'timeline.json'}")


if __name__ == "__main__":
    sys.exit(main())
