"""Every question against the run's length: the index (forge_obs.analysis.index) against the
code before it, on GRPO-shaped synthetic runs of 1k / 10k / 100k / 1M steps.

The runs are tests/support/path_runs.grpo_run's (9 processes, concurrent rollouts, replica 1's
``generate`` slow from the middle on), written once into a cache folder (``--cache``, default
/tmp/forge_obs_runs; the 1M-step run is the 100k one repeated ten times, shifted in time and
steps) and reused. Each command runs as a user runs it: ``python -m forge_obs.cli ...`` in a
fresh process, wall time:

- **first question**: ``why --step N`` on a run without an index (it builds it);
- **warm**: ``why --step N``, ``why --slowest 3``, ``sql`` filtered on one step, ``sql count(*)``
  (median of ``--repeat``), ``doctor`` the first time after the build and again (it keeps its
  diagnosis beside the index);
- **serve**: ``forge-obs serve RUN`` started on the run: its first paint (the server listening ->
  the page's first answers: ``/api/run``, ``/api/poll``, ``/api/findings``) and the whole run
  readable (the index holds every line, the doctor's findings are in, the last step's critical
  path is answered), on the run with its index and without (the server's indexer builds it);
- **baseline**: the same commands with the code of ``--base`` (default ``main``, exported with
  ``git archive``), its first question building its index, where they finish within
  ``--base-timeout-s``;
- **live**: a writer appends one step every ``1 / --live-rate`` s to a run while the live
  indexer (``python -m forge_obs.analysis.index.live``) follows it: the indexer's CPU share of
  one core, and the time from a step's flush until ``sql`` / ``why`` see it.

    python bench/bench_run_length.py                       # 1k 10k 100k 1M
    python bench/bench_run_length.py --steps 1000 10000    # a quick look

Prints a table and writes bench/results/run_length.json. Figures, never timed asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def make_run(cache: Path, steps: int) -> Path:
    """The cached GRPO-shaped run of ``steps`` steps (written when missing)."""
    from tests.support.path_runs import grpo_run

    out = cache / f"grpo_{steps}"
    if (out / ".complete").exists():
        return out
    shutil.rmtree(out, ignore_errors=True)
    if steps <= 100_000:
        grpo_run(out, steps, slow_replica=(1, 0.8), slow_from=steps // 2)
    else:
        _repeat(out, steps)
    (out / ".complete").write_text("")
    return out


def _repeat(out: Path, steps: int) -> None:
    """A run of ``steps`` steps made of 100k-step blocks (clean ones, then slow ones), each
    shifted in time and in step numbers (flow ids too), streamed to disk."""
    from tests.support.path_runs import grpo_run

    block = 100_000
    with tempfile.TemporaryDirectory(prefix="bench_rl_") as tmp:
        clean = grpo_run(Path(tmp) / "clean", block)
        slow = grpo_run(Path(tmp) / "slow", block, slow_replica=(1, 0.8))
        (out / "events").mkdir(parents=True)
        names = sorted(p.name for p in (clean / "events").glob("*.jsonl"))
        span_us = max(_last_end(clean), _last_end(slow)) + 10_000
        outs = {n: open(out / "events" / n, "w") for n in names}
        try:
            for k in range(steps // block):
                src = clean if k < steps // block // 2 else slow
                for n in names:
                    _append_block(src / "events" / n, outs[n], k, k * span_us, k * block)
        finally:
            for f in outs.values():
                f.close()


def _last_end(run: Path) -> int:
    end = 0
    for p in (run / "events").glob("*.jsonl"):
        for line in p.read_text().splitlines()[1:]:
            r = json.loads(line)
            if isinstance(r[0], int):
                end = max(end, r[0] + r[1])
    return end


def _append_block(src: Path, f, k: int, dt: int, ds: int) -> None:
    import re

    flow = re.compile(r'"(policy-v|rollout-)(\d+)')
    with open(src) as lines:
        head = next(lines)
        if k == 0:
            f.write(head)
        for line in lines:
            r = json.loads(line)
            if r[0] in ("N", "L"):
                if k == 0:
                    f.write(line)
                continue
            if isinstance(r[0], int):
                r[0] += dt
                r[4] = None if r[4] is None else r[4] + ds
            elif r[0] == "S":
                r[1] += dt
                r[3] += ds
            elif r[0] == "Z":
                continue
            text = json.dumps(r)
            f.write(flow.sub(lambda m: f'"{m.group(1)}{int(m.group(2)) + ds}', text) + "\n")


def _cli(src: Path, *args: str, timeout: float = 3600) -> tuple[float, float, str]:
    """``python -m forge_obs.cli ARGS`` with ``src`` first on the path: (wall s, CPU s, stdout)."""
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{ROOT}")
    before = os.times()
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "forge_obs.cli", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    wall = time.perf_counter() - t
    after = os.times()
    if p.returncode not in (0, 1):
        raise RuntimeError(f"forge-obs {' '.join(args)}: exit {p.returncode}: {p.stderr[-800:]}")
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system), p.stdout


def _commands(run: Path, step: int) -> dict:
    return {"why --step N": ("why", str(run), "--step", str(step)),
            "why --slowest 3": ("why", str(run), "--slowest", "3"),
            "sql, one step": ("sql", str(run), f"SELECT name, mesh, rank, dur_ms FROM spans WHERE step = {step}"),
            "sql count(*)": ("sql", str(run), "SELECT count(*) FROM spans"),
            "doctor": ("doctor", str(run))}


FIRST = "first question (builds the index)"


def first_question(run: Path, src: Path, timeout: float) -> dict:
    """``why --step N`` on ``run`` without an index, with the code in ``src``: it builds the index
    (wall and CPU s, its worker processes' CPU included)."""
    step = int(run.name.split("_")[1]) // 2 + 1
    shutil.rmtree(run / "index", ignore_errors=True)
    wall, cpu, _ = _cli(src, "why", str(run), "--step", str(step), timeout=timeout)
    return {"wall_s": wall, "cpu_s": cpu}


def measure(run: Path, src: Path, repeat: int, timeout: float, first: bool) -> dict:
    """The commands on ``run`` with the code in ``src`` (None where one ran past ``timeout``)."""
    steps = int(run.name.split("_")[1])
    step = steps // 2 + 1
    out: dict = {}
    if first:
        out[FIRST] = first_question(run, src, timeout)
    for name, args in _commands(run, step).items():
        walls, cpus = [], []
        if name == "doctor":  # first after the build (computes), then again (its kept diagnosis)
            for f in run.glob("index/doctor.json"):
                f.unlink()
            try:
                w, c, _ = _cli(src, *args, timeout=timeout)
            except subprocess.TimeoutExpired:
                w = c = None
            out["doctor (first after the build)"] = None if w is None else {"wall_s": w, "cpu_s": c}
        try:
            for _ in range(repeat):
                w, c, _ = _cli(src, *args, timeout=timeout)
                walls.append(w)
                cpus.append(c)
        except subprocess.TimeoutExpired:
            out[name] = None
            continue
        out[name] = {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus)}
    return out


def serve(run: Path, src: Path, timeout: float) -> dict:
    """``forge-obs serve RUN`` as a user runs it: the first paint (the server listening -> the
    page's first answers) and the whole run readable (the process started -> the index holds
    every line, the slowest steps and the last step's critical path are answered, the doctor's
    findings are in)."""
    import re
    import signal
    import urllib.request

    def get(url: str) -> dict:
        with urllib.request.urlopen(url, timeout=120) as r:
            return json.loads(r.read())

    steps = int(run.name.split("_")[1])
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{ROOT}")
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "forge_obs.cli", "serve", str(run), "--port", "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        url = re.search(r"http://\S+/", p.stdout.readline()).group(0)
        listening = time.perf_counter() - t0
        api = f"{url}api/%s?id={run.name}"
        get(api % "run"), get(api % "poll"), get(api % "findings")
        first = time.perf_counter() - t0 - listening
        t1 = time.perf_counter()
        get(api % "run"), get(api % "poll"), get(api % "findings")
        again = time.perf_counter() - t1
        while time.perf_counter() - t0 < timeout:
            idx = get(api % "poll")["index"] or {}
            found = get(api % "findings")
            path = get(api % "step" + f"&step={steps - 1}")["critical_path"]
            if idx.get("fresh") and found["state"] == "ok" and path["available"] and get(api % "run")["slowest"]:
                break
            time.sleep(0.2)
        whole = time.perf_counter() - t0
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return {"listening_s": listening, "first_paint_s": first, "first_answers_again_s": again,
            "whole_run_s": whole if whole < timeout else None}


def _base_src(base: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="forge_obs_base_"))
    arch = subprocess.run(["git", "-C", str(ROOT), "archive", base, "src"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(d)], input=arch, check=True)
    return d / "src"


def _size_mb(paths) -> float:
    return sum(p.stat().st_size for p in paths if p.is_file()) / 1e6


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) * _TICK_S


def live(cache: Path, rate: float, seconds: float, interval_s: float, cpu_share: float = 0.0,
         code: Path = ROOT / "src") -> dict:
    """A writer appends a step every ``1/rate`` s while the live indexer (of the code in ``code``)
    follows the run."""
    from forge_obs.analysis.index import open_index

    src = make_run(cache, 1000)
    groups = _by_step(src)
    with tempfile.TemporaryDirectory(prefix="bench_live_") as tmp:
        run = Path(tmp) / "run"
        (run / "events").mkdir(parents=True)
        for name, (head, _g) in groups.items():
            (run / "events" / name).write_text(head)
        env = dict(os.environ, PYTHONPATH=f"{code}{os.pathsep}{ROOT}")
        proc = subprocess.Popen([sys.executable, "-m", "forge_obs.analysis.index.live", str(run), "--interval-s",
                                 str(interval_s), "--parent", str(os.getpid()), "--cpu-share", str(cpu_share)], env=env)
        _started(run, proc)  # its start-up (imports, its first update) is not the indexing's cost
        cpu0, t0 = _proc_cpu(proc.pid), time.perf_counter()
        lat: list = []
        n = 0
        while time.perf_counter() - t0 < seconds and n < 990:
            for name, (_h, g) in groups.items():
                with open(run / "events" / name, "a") as f:
                    f.write("".join(g.get(n, ())))
            flushed = time.perf_counter()
            if n % 5 == 4:  # every 5th step: until sql and why see it
                lat.append(_seen(run, n - 1, flushed))
            n += 1
            time.sleep(max(0.0, t0 + (n / rate) - time.perf_counter()))
        cpu = _proc_cpu(proc.pid) - cpu0
        wall = time.perf_counter() - t0
        proc.terminate()
        proc.wait(60)
        check = open_index(run).connect().execute("SELECT count(*) FROM _steps").fetchone()[0]
    return {"steps_written": n, "rate_steps_per_s": rate, "interval_s": interval_s, "cpu_share_cap": cpu_share,
            "wall_s": wall,
            "indexer_cpu_s": cpu, "indexer_cpu_share_of_one_core": cpu / wall,
            "seen_latency_s": {"median": statistics.median(lat), "max": max(lat)} if lat else None,
            "steps_indexed": check}


def _started(run: Path, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Until the live indexer's first update is done (its manifest written) and its CPU time is
    still for 0.5 s (nothing to index yet)."""
    deadline = time.perf_counter() + timeout_s
    while not (run / "index" / "manifest.json").exists() and time.perf_counter() < deadline:
        time.sleep(0.05)
    cpu = -1.0
    while time.perf_counter() < deadline and proc.poll() is None and cpu != _proc_cpu(proc.pid):
        cpu = _proc_cpu(proc.pid)
        time.sleep(0.5)


def _seen(run: Path, step: int, flushed: float) -> float:
    """Seconds from ``flushed`` until step ``step`` is a finished step of the index (read as a
    command reads it, without updating it: the live indexer must have)."""
    from forge_obs.analysis.index import has_index, open_index

    while time.perf_counter() - flushed < 60:
        if has_index(run):
            try:
                con = open_index(run, update=False, warn=False).connect()
                hit = con.execute("SELECT count(*) FROM _steps WHERE step = ? AND NOT unfinished", [step]).fetchone()[0]
                con.close()
            except Exception:  # noqa: BLE001 - a segment merged away between the manifest and the read
                hit = 0
            if hit:
                return time.perf_counter() - flushed
        time.sleep(0.02)
    return float("inf")


def _by_step(run: Path) -> dict:
    """file name -> (header and definitions, {step: its lines})."""
    out = {}
    for p in sorted((run / "events").glob("*.jsonl")):
        lines = p.read_text().splitlines(keepends=True)
        head = [lines[0]]
        groups: dict = {}
        for line in lines[1:]:
            r = json.loads(line)
            if r[0] in ("N", "L"):
                head.append(line)
            elif r[0] == "S":
                groups.setdefault(r[3], []).append(line)
            elif isinstance(r[0], int):
                groups.setdefault(r[4], []).append(line)
        out[p.name] = ("".join(head), groups)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1000, 10_000, 100_000, 1_000_000])
    ap.add_argument("--cache", type=Path, default=Path("/tmp/forge_obs_runs"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base", default="main", help="the git revision measured as the baseline")
    ap.add_argument("--base-max-steps", type=int, default=100_000, help="measure the baseline up to this length")
    ap.add_argument("--base-timeout-s", type=float, default=600)
    ap.add_argument("--live-rate", type=float, default=10.0)
    ap.add_argument("--live-s", type=float, default=30.0)
    ap.add_argument("--live-interval-s", type=float, nargs="+", default=[1.0, 1.5, 2.0])
    ap.add_argument("--live-cpu-share", type=float, default=0.0, help="the live indexer's --cpu-share (0: none)")
    ap.add_argument("--build-only", action="store_true",
                    help="only the first question (the index's build), against --base at every length")
    args = ap.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    base = _base_src(args.base)
    res: dict = {"uptime": os.popen("uptime").read().strip(), "runs": {}}
    for steps in args.steps:
        run = make_run(args.cache, steps)
        r = res["runs"][steps] = {"jsonl_mb": _size_mb((run / "events").glob("*.jsonl"))}
        print(f"{steps} steps: {r['jsonl_mb']:.1f} MB of JSONL", flush=True)
        if args.build_only:
            r["index"] = {FIRST: first_question(run, ROOT / "src", 3600)}
            r["index_mb"] = _size_mb((run / "index").glob("*.parquet"))
            r["base"] = {FIRST: first_question(run, base, 3600)}
            shutil.rmtree(run / "index", ignore_errors=True)
            print(json.dumps(r, indent=1), flush=True)
            continue
        r["index"] = measure(run, ROOT / "src", args.repeat if steps < 1_000_000 else 1, 3600, first=True)
        r["index_mb"] = _size_mb((run / "index").glob("*.parquet"))
        r["serve"] = serve(run, ROOT / "src", 3600)  # the index built: what a run indexed live finds
        shutil.rmtree(run / "index", ignore_errors=True)
        r["serve_cold"] = serve(run, ROOT / "src", 3600)  # no index: the server's indexer builds it
        if steps <= args.base_max_steps:  # the code of --base, its first question building its own index
            r["base"] = measure(run, base, 1, args.base_timeout_s, first=True)
            shutil.rmtree(run / "index", ignore_errors=True)
        print(json.dumps(r, indent=1), flush=True)
    if not args.build_only:
        res["live"] = [live(args.cache, args.live_rate, args.live_s, iv, args.live_cpu_share)
                       for iv in args.live_interval_s]
    shutil.rmtree(base.parent, ignore_errors=True)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / ("run_length_build.json" if args.build_only else "run_length.json")).write_text(json.dumps(res, indent=2))
    print(table(res))


TARGETS = {"first question (builds the index)": "<= 20 s", "why --step N": "<= 0.5 s", "why --slowest 3": "<= 1 s",
           "sql, one step": "<= 0.5 s", "sql count(*)": "<= 0.5 s", "doctor (first after the build)": "<= 5 s",
           "doctor": "<= 5 s"}


def table(res: dict) -> str:
    runs = res["runs"]
    sizes = list(runs)
    head = "| command | " + " | ".join(f"{int(s):,} steps" for s in sizes) + " | target (100k) |"
    lines = [head, "|" + "---|" * (len(sizes) + 2)]

    def cell(d: "dict | None", cpu: bool = False) -> str:
        if d is None:
            return "-"
        return f"{d['wall_s']:.2f} s" + (f" (CPU {d['cpu_s']:.1f} s)" if cpu and d.get("cpu_s") is not None else "")

    for name, target in TARGETS.items():
        row = [cell(runs[s]["index"].get(name), name == FIRST) +
               (f" (was {cell(runs[s]['base'].get(name), name == FIRST)})"
                if "base" in runs[s] and runs[s]["base"].get(name) else "") for s in sizes]
        lines.append(f"| {name} | " + " | ".join(row) + f" | {target} |")
    for key, label in (("serve", "serve, index built"), ("serve_cold", "serve, no index yet")):
        if all(key in runs[s] for s in sizes):
            lines.append(f"| {label}: first paint / whole run readable | " + " | ".join(
                f"{runs[s][key]['first_paint_s']:.2f} / " + ("-" if runs[s][key]["whole_run_s"] is None else
                                                               f"{runs[s][key]['whole_run_s']:.1f} s") for s in sizes)
                + " | <= 1 s / <= 20 s |")
    lines.append("| index size / JSONL | " + " | ".join(
        f"{runs[s]['index_mb']:.1f} / {runs[s]['jsonl_mb']:.1f} MB" for s in sizes) + " | <= 1 |")
    if 10_000 in runs and 100_000 in runs and "why --step N" in runs[100_000]["index"]:
        g = {n: runs[100_000]["index"][n]["wall_s"] / runs[10_000]["index"][n]["wall_s"]
             for n in ("why --step N", "sql, one step")}
        lines.append("| growth 10k -> 100k, one-step questions | " + ", ".join(f"{n}: {v:.2f}x" for n, v in g.items())
                     + " |" * len(sizes) + " <= 1.5x |")
    for lv in res.get("live") or []:
        lat = lv["seen_latency_s"] or {}
        lines.append(f"\nlive: {lv['steps_written']} steps at {lv['rate_steps_per_s']}/s, indexer every "
                     f"{lv['interval_s']} s: {100 * lv['indexer_cpu_share_of_one_core']:.2f} % of one core (target <= 1 %); "
                     f"a step is a finished step of the index {lat.get('median', float('nan')):.2f} s (median), "
                     f"{lat.get('max', float('nan')):.2f} s (max) after its flush (target <= 2 s)")
    lines.append(f"\n{res['uptime']}")
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--table":
        print(table(json.loads((ROOT / "bench" / "results" / "run_length.json").read_text())))
    else:
        main()
