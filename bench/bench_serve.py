"""``forge-obs serve`` at scale: a synthetic run directory of 1,000 keys x 10,000 steps x 64 ranks.

The run: ``metrics.jsonl`` with one global row per step holding ``--keys`` keys (one of them a
p50/p90/p99 distribution) and, per step, one row per rank (``--ranks``) with ``--rank-keys``
keys each. The per-rank rows carry fewer keys than the global row: 1,000 keys x 64 ranks x
10,000 steps would be 640 M values (about 15 GB of JSON); 16 keys per rank keep the file near
1 GB while every rank of every step is there. The server runs as ``forge-obs serve`` in its own
process (its RSS is that process's), measured over HTTP as the page calls it:

- **cold open**: the first ``/api/run`` of the run (answered after one chunk; a reader thread
  reads the rest, a chunk at a time), and the time until the whole file is read;
- **first paint**: ``/api/run`` + the overview's and the first group's charts (``/api/series``
  at 800 points each), the page's calls when it opens (warm server);
- **update**: one step appended to ``metrics.jsonl``, until ``/api/poll`` shows it and a chart's
  ``/api/series`` holds it (median of ``--updates``); the page polls once a second, so a user
  sees a step within this + <= 1 s;
- **per-rank chart**: ``/api/ranks`` of a key over 64 ranks;
- **zoom**: a drag to 100 steps in the middle of the run refetches the overview's and the first
  group's charts for that range, read back exactly from ``metrics.jsonl`` (every step);
- **CSV export**: one key's exact value at every step of the run, streamed from ``metrics.jsonl``;
- **50 clients** polling a run as 50 open pages do (``--clients``, for ``--load-s`` seconds, each
  request a new connection, a separate process): answered requests, failures, latency; baseline,
  the same load on a server with the standard library's listen backlog of 5 (in the same run);
- **server RSS** after all that, and its peak (VmHWM);
- baseline, same machine, same file: one full re-read of ``metrics.jsonl`` (JSON-decoding every
  line), what a viewer without incremental tailing pays at every update.
- with ``--browser`` (Chromium installed): headless Chromium (already started) from navigation
  to the overview's charts drawn.

    python bench/bench_serve.py                       # full size (generates ~1 GB under /tmp)
    python bench/bench_serve.py --steps 2000 --keys 200 --ranks 16

Prints a table and writes bench/results/serve.json. Figures, never timed asserts.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers


def generate(run_dir: Path, keys: int, steps: int, ranks: int, rank_keys: int) -> int:
    """Write the synthetic run; returns its size in bytes."""
    run_dir.mkdir(parents=True)
    (run_dir / "meta.json").write_text(json.dumps({"run_id": run_dir.name, "status": "running",
                                                   "start_time": 1.7e9}))
    rng = random.Random(0)
    groups = ("trainer", "generator", "buffer", "reward", "reference")
    names = [f"{groups[i % len(groups)]}/metric_{i:04d}" for i in range(keys - 3)] + [
        "trainer/loss", "reward/reward", "trainer/policy_version"]
    rnames = [f"trainer/rank_metric_{i:02d}_s" for i in range(rank_keys)]
    enc = json.JSONEncoder(separators=(",", ":")).encode
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(steps):
            f.write(_step_lines(s, names, rnames, ranks, rng, enc))
    return (run_dir / "metrics.jsonl").stat().st_size


def _step_lines(s: int, names: list, rnames: list, ranks: int, rng: random.Random, enc) -> str:
    base = [round(rng.random(), 4) for _ in range(len(names))]
    m = dict(zip(names, base))
    m["trainer/loss"], m["trainer/policy_version"] = 1.0 / (s + 1), s // 4
    m["generator/response_len"] = {"p50": 100 + s % 50, "p90": 150 + s % 50, "p99": 200 + s % 50, "count": 64}
    wall = 1.7e9 + s
    out = [enc({"run_id": "bench", "step": s, "mode": "global_reduce", "wall_time": wall, "metrics": m})]
    rv = [round(rng.random(), 4) for _ in range(len(rnames))]
    for r in range(ranks):
        out.append(enc({"run_id": "bench", "step": s, "mode": "per_rank_reduce", "wall_time": wall,
                        "source": {"label": f"trainer/Trainer/r{r}", "rank": r},
                        "metrics": {k: v + r * 0.01 for k, v in zip(rnames, rv)}}))
    return "\n".join(out) + "\n"


def _truncate(path: Path, steps: int) -> None:
    """Cut ``path`` before the first row of step ``steps`` (rows a previous run appended)."""
    key = f'"step":{steps},'.encode()
    with open(path, "rb+") as f:
        f.seek(max(0, path.stat().st_size - (64 << 20)))
        pos = f.tell()
        data = f.read()
        i = data.find(b"\n" + key[:0] + b'{"run_id":"bench",' + key)
        if i >= 0:
            f.truncate(pos + i + 1)


class Client:
    def __init__(self, port: int) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)

    def get(self, path: str) -> dict:
        self.c.request("GET", path)
        r = self.c.getresponse()
        body = r.read()
        assert r.status == 200, (path, r.status, body[:200])
        return json.loads(body)


def rss_mb(pid: int) -> tuple[float, float]:
    vals = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            vals[k] = int(v.split()[0]) / 1024
    return vals["VmRSS"], vals["VmHWM"]


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def first_paint(cl: Client, rid: str) -> float:
    t = time.perf_counter()
    info = cl.get(f"/api/run?id={rid}")
    charts = [p["keys"] for p in info["panels"]] + [[k["key"]] for k in info["groups"][0]["keys"][:12] if not k["flat"]]
    for keys in charts:
        cl.get(f"/api/series?id={rid}&n=800&" + "&".join(f"k={k}" for k in keys))
    return time.perf_counter() - t


def update_latency(cl: Client, run_dir: Path, rid: str, step: int, keys: list, rnames: list, ranks: int) -> float:
    v0 = cl.get(f"/api/poll?id={rid}")["version"]
    line = _step_lines(step, keys, rnames, ranks, random.Random(step), json.JSONEncoder(separators=(",", ":")).encode)
    t = time.perf_counter()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(line)
    while cl.get(f"/api/poll?id={rid}")["version"] == v0:
        pass
    s = cl.get(f"/api/series?id={rid}&n=800&k=trainer/loss")
    assert s["steps"][-1] == step, s["steps"][-5:]
    return time.perf_counter() - t


def full_reread_s(path: Path) -> float:
    from forge_obs.analysis.store import read_jsonl

    t = time.perf_counter()
    n = sum(1 for _ in read_jsonl(path))
    assert n > 0
    return time.perf_counter() - t


def browser_paint_s(url: str) -> float | None:
    try:
        from tests.support.browser import Browser, chromium_path
    except ImportError:
        return None
    if chromium_path() is None:
        return None
    with Browser(skip=False) as b:
        b.open("about:blank")  # the browser's own start-up is not the page's
        t = time.perf_counter()
        page = b.open(url)
        page.wait_for("document.querySelectorAll('#overview .chart canvas').length >= 2", timeout_s=600)
        return time.perf_counter() - t


LOAD = r"""
import http.client, json, sys, threading, time
port, clients, seconds, rid = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
paths = [f"/api/poll?id={rid}", f"/api/run?id={rid}", f"/api/series?id={rid}&k=trainer/loss&n=800", f"/api/poll?id={rid}",
         f"/api/ranks?id={rid}&k=trainer/rank_metric_00_s&n=400", "/api/runs", "/", "/static/app.js"]
lat, failed, lock, start = [], [0], threading.Lock(), threading.Barrier(clients)
def client(i):
    start.wait()
    end, k = time.monotonic() + seconds, i
    while time.monotonic() < end:
        t = time.monotonic()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request("GET", paths[k % len(paths)]); r = c.getresponse(); r.read(); c.close()
            ok = r.status == 200
        except Exception:
            ok = False
        k += 1
        with lock:
            lat.append(time.monotonic() - t)
            failed[0] += not ok
ts = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
[t.start() for t in ts]; [t.join() for t in ts]
lat.sort()
print(json.dumps({"requests": len(lat), "failed": failed[0], "p50_s": lat[len(lat) // 2], "p99_s": lat[int(len(lat) * 0.99)],
                  "max_s": lat[-1]}))
"""

#: a server as ``forge-obs serve`` starts it, with the listen backlog given (the baseline: 5)
SERVER = r"""
import sys
from forge_obs.analysis import local_server
local_server.LocalHTTPServer.request_queue_size = int(sys.argv[2])
from forge_obs.analysis.serve import ServeServer
srv = ServeServer(sys.argv[1], 0)
print(srv.url, flush=True)
try:
    srv.serve_forever()
except KeyboardInterrupt:
    srv.close()
"""


def load(root: Path, rid: str, backlog: int | None, clients: int, seconds: float, env: dict) -> dict:
    """``clients`` page-like pollers for ``seconds`` against a fresh server on ``root`` (this
    package's backlog, or ``backlog``)."""
    cmd = [sys.executable, "-c", SERVER, str(root), str(backlog)] if backlog else \
        [sys.executable, "-m", "forge_obs.cli", "serve", str(root), "--port", "0"]
    srv = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(srv.stdout.readline().split("http://127.0.0.1:")[1].split("/")[0])
        Client(port).get(f"/api/run?id={rid}")  # opened and read before the load starts
        out = subprocess.run([sys.executable, "-c", LOAD, str(port), str(clients), str(seconds), rid], env=env,
                             capture_output=True, text=True, timeout=seconds + 300)
        return json.loads(out.stdout)
    finally:
        stop(srv)


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (the server's Ctrl+C), SIGKILL when it is still there after ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def zoom_s(cl: Client, info: dict, rid: str, lo: int) -> tuple[float, bool]:
    """The page's refetch after a zoom to steps [lo, lo + 99]: the overview's and the first
    group's 12 charts at 800 points; and whether every chart came back exact."""
    charts = [p["keys"] for p in info["panels"]] + [[k["key"]] for k in info["groups"][0]["keys"][:12] if not k["flat"]]
    t, exact = time.perf_counter(), True
    for keys in charts:
        s = cl.get(f"/api/series?id={rid}&n=800&lo={lo}&hi={lo + 99}&" + "&".join(f"k={k}" for k in keys))
        exact = exact and s["resolution"]["exact"] and len(s["steps"]) == 100
    return time.perf_counter() - t, exact


def csv_s(port: int, rid: str) -> tuple[float, int]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    t = time.perf_counter()
    c.request("GET", f"/api/csv?id={rid}&k=trainer/loss&name=loss")
    body = c.getresponse().read()
    return time.perf_counter() - t, body.count(b"\n") - 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rank-keys", type=int, default=16)
    ap.add_argument("--updates", type=int, default=20)
    ap.add_argument("--browser", action="store_true")
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--load-s", type=float, default=20.0)
    ap.add_argument("--load-steps", type=int, default=300, help="steps of the run the clients poll (the same shape)")
    ap.add_argument("--dir", type=Path, default=None,
                    help="where to generate (default: a temporary directory); a run already there is reused")
    args = ap.parse_args()
    tmp = args.dir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    root, rid = tmp / "runs", "big"
    run_dir = root / rid
    if args.dir is not None and (run_dir / "metrics.jsonl").exists():  # generated by an earlier run: cut back to --steps
        _truncate(run_dir / "metrics.jsonl", args.steps)
        size = (run_dir / "metrics.jsonl").stat().st_size
    else:
        gen_s, size = timed(lambda: generate(run_dir, args.keys, args.steps, args.ranks, args.rank_keys))
        print(f"generated {size / 2**20:.0f} MiB in {gen_s:.0f}s: {run_dir}", flush=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), FORGE_OBS_QUIET="1")
    srv = subprocess.Popen([sys.executable, "-m", "forge_obs.cli", "serve", str(root), "--port", "0"],
                           stdout=subprocess.PIPE, text=True, env=env)
    try:
        port = int(srv.stdout.readline().split("http://127.0.0.1:")[1].split("/")[0])
        cl = Client(port)
        t = time.perf_counter()
        first_s, _info = timed(lambda: cl.get(f"/api/run?id={rid}"))  # answered at once, the reading goes on
        while cl.get(f"/api/poll?id={rid}")["reading"] is not None:
            time.sleep(0.2)  # a benchmark's poll of the server's own progress, not a test's sync
        cold_s = time.perf_counter() - t
        info = cl.get(f"/api/run?id={rid}")
        assert info["steps"] == args.steps, info["steps"]
        rss_open = rss_mb(srv.pid)
        paints = [first_paint(cl, rid) for _ in range(5)]
        rank_s = min(timed(lambda: cl.get(f"/api/ranks?id={rid}&n=800&k=trainer/rank_metric_00_s"))[0] for _ in range(3))
        names = [f"{('trainer', 'generator', 'buffer', 'reward', 'reference')[i % 5]}/metric_{i:04d}" for i in range(args.keys - 3)]
        names += ["trainer/loss", "reward/reward", "trainer/policy_version"]
        rnames = [f"trainer/rank_metric_{i:02d}_s" for i in range(args.rank_keys)]
        zooms = [zoom_s(cl, info, rid, lo) for lo in (args.steps // 2, args.steps // 3, args.steps // 4)]
        csv_t, csv_rows = csv_s(port, rid)
        ups = [update_latency(cl, run_dir, rid, args.steps + i, names, rnames, args.ranks) for i in range(args.updates)]
        browser = browser_paint_s(f"http://127.0.0.1:{port}/#/run/{rid}") if args.browser else None
        rss, hwm = rss_mb(srv.pid)
        reread = full_reread_s(run_dir / "metrics.jsonl")
    finally:
        stop(srv)
    small = tmp / "load"
    if not (small / "runs" / "small" / "metrics.jsonl").exists():
        generate(small / "runs" / "small", args.keys, args.load_steps, args.ranks, args.rank_keys)
    loaded = load(small / "runs", "small", None, args.clients, args.load_s, env)
    loaded_base = load(small / "runs", "small", 5, args.clients, args.load_s, env)
    res = {
        "run": {"keys": args.keys, "steps": args.steps, "ranks": args.ranks, "rank_keys": args.rank_keys,
                "metrics_jsonl_mib": round(size / 2**20)},
        "cold_open_s": round(cold_s, 2), "first_answer_s": round(first_s, 3), "first_paint_s": round(statistics.median(paints), 3),
        "update_s": round(statistics.median(ups), 4), "update_max_s": round(max(ups), 4),
        "per_rank_chart_s": round(rank_s, 3), "browser_first_paint_s": None if browser is None else round(browser, 2),
        "server_rss_mib": round(rss), "server_peak_rss_mib": round(hwm), "rss_after_open_mib": round(rss_open[0]),
        "baseline_full_reread_s": round(reread, 2),
        "zoom_100_steps_s": round(statistics.median(z[0] for z in zooms), 3), "zoom_exact": all(z[1] for z in zooms),
        "csv_one_key_s": round(csv_t, 2), "csv_rows": csv_rows,
        "clients": args.clients, "load_s": args.load_s, "load": loaded, "load_baseline_backlog_5": loaded_base,
    }
    lat = lambda d: f"p50 {d['p50_s'] * 1000:.0f} ms, p99 {d['p99_s'] * 1000:.0f} ms, max {d['max_s']:.1f} s"
    rows = [
        ("first paint (API: run + overview + 12 charts)", f"{res['first_paint_s']:.3f} s", "< 1 s"),
        ("update: appended step visible in the API", f"{res['update_s'] * 1000:.1f} ms (max {res['update_max_s'] * 1000:.0f})",
         "< 1 s with the page's 1 s poll; << baseline"),
        ("baseline: full re-read of metrics.jsonl", f"{res['baseline_full_reread_s']:.1f} s", "(what each update would cost)"),
        ("per-rank chart (64 ranks)", f"{res['per_rank_chart_s']:.3f} s", "< 1 s"),
        ("cold open: first answer / whole file read", f"{first_s:.2f} s / {cold_s:.0f} s", "< 1 s / once per server"),
        ("browser: navigation to overview drawn", "-" if browser is None else f"{browser:.2f} s", "< 2 s"),
        ("server RSS (peak)", f"{res['server_rss_mib']} MiB ({res['server_peak_rss_mib']})", "bounded: < 1 GiB, not the file size"),
        ("zoom to 100 steps: the page's charts again, exact", f"{res['zoom_100_steps_s']:.3f} s"
         + ("" if res["zoom_exact"] else " (NOT exact)"), "< 1 s, every step"),
        ("CSV: one key, every step, exact", f"{csv_t:.1f} s ({csv_rows} rows)", "streamed; baseline: the full re-read"),
        (f"{args.clients} clients x {args.load_s:.0f} s: failed / answered", f"{loaded['failed']} / {loaded['requests']}",
         "0 failed"),
        ("   latency", lat(loaded), "no 30 s waits"),
        ("   baseline, listen backlog 5: failed / answered", f"{loaded_base['failed']} / {loaded_base['requests']}", ""),
        ("   baseline latency", lat(loaded_base), ""),
    ]
    print(f"\nforge-obs serve, {args.keys} keys x {args.steps} steps x {args.ranks} ranks "
          f"({args.rank_keys} keys per rank), metrics.jsonl {res['run']['metrics_jsonl_mib']} MiB")
    w = max(len(r[0]) for r in rows)
    for name, fig, target in rows:
        print(f"  {name:<{w}}  {fig:>34}   " + (f"target {target}" if target else ""))
    out = ROOT / "bench" / "results" / "serve.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
