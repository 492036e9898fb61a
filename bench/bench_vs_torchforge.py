"""forge_obs against torchforge's ``forge.observability``, side by side in one process and one run.

    .venv/bin/python bench/bench_vs_torchforge.py          # table on stdout, JSON to bench/results/

torchforge is not installable here, but its observability modules are plain Python: this loads
``src/forge/observability/{metrics,perf_tracker,utils}.py``, ``src/forge/env.py`` and
``src/forge/util/logging.py`` from a torchforge git directory (``TORCHFORGE_GIT_DIR``, default the
fetched mirror; ``TORCHFORGE_REV``, default HEAD) into a temporary directory, with empty package
``__init__`` files and a ``pytz`` stand-in (``pytz.UTC``) as the only stubs, and imports them as
``forge.observability.*``. Nothing of torchforge is kept in this repository. Its collector is
initialised (``init_backends`` with no per-rank backend), so ``record_metric`` accumulates, as in a
run; Monarch's real ``current_rank`` is used.

Each figure is the minimum over the repeats of the mean per-call CPU time of the benchmarking
thread (``time.thread_time``) in a tight loop: the cost itself, as little disturbed as can be by
the other jobs on a shared machine; torchforge and forge_obs run in the same process. Figures:

- ``record_metric(key, float, MEAN)``;
- ``@trace`` on a sync function: the call minus the bare call;
- a Tracer cycle: ``Tracer(prefix)``, ``start()``, two ``step()``, ``stop()`` (CPU timer).

Targets: forge_obs as many times faster as before the torchforge-compatibility work, measured
the same way on the 2-core VM at commit ce8ce58 (three runs: record_metric 9.1-9.9x, @trace
9.8-10.6x, Tracer cycle 6.6-7.1x; the target is the low end). The issue's ~12x / ~13x / ~10x were
wall-clock figures on a loaded machine.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this checkout's forge_obs, and bench/, tests/ helpers
import _timing  # noqa: E402  (bench/, beside this script)
from _timing import tracer_cycle  # noqa: E402

TF_GIT = os.environ.get("TORCHFORGE_GIT_DIR", "/work/.mirror/meta-pytorch+torchforge/repo")
TF_REV = os.environ.get("TORCHFORGE_REV", "HEAD")
N = 5_000
REPEAT = int(os.environ.get("BENCH_REPEAT", "15"))
#: figure -> the ratio torchforge/forge_obs measured before the compatibility work (the target; see above)
TARGETS = {"record_metric": 9.1, "@trace overhead": 9.8, "Tracer cycle": 6.6}

_FILES = {
    "src/forge/observability/metrics.py": "forge/observability/metrics.py",
    "src/forge/observability/perf_tracker.py": "forge/observability/perf_tracker.py",
    "src/forge/observability/utils.py": "forge/observability/utils.py",
    "src/forge/env.py": "forge/env.py",
    "src/forge/util/logging.py": "forge/util/logging.py",
}


def load_torchforge(tmp: Path):
    """torchforge's observability modules, imported from ``tmp`` (see the module docstring)."""
    rev = subprocess.run(["git", "--git-dir", TF_GIT, "rev-parse", "--short", TF_REV], capture_output=True, text=True)
    if rev.returncode != 0:
        return None, None
    for src, dst in _FILES.items():
        text = subprocess.run(["git", "--git-dir", TF_GIT, "show", f"{TF_REV}:{src}"], capture_output=True,
                              text=True, check=True).stdout
        (tmp / dst).parent.mkdir(parents=True, exist_ok=True)
        (tmp / dst).write_text(text)
    for pkg in ("forge", "forge/util", "forge/observability"):
        (tmp / pkg / "__init__.py").write_text("")  # stub: the real ones import the whole of forge
    (tmp / "pytz.py").write_text("import datetime\nUTC = datetime.timezone.utc\n")  # stub: pytz is not installed
    sys.path.insert(0, str(tmp))
    metrics = importlib.import_module("forge.observability.metrics")
    perf = importlib.import_module("forge.observability.perf_tracker")
    collector = metrics.MetricCollector()
    asyncio.run(collector.init_backends(None, {}, 0, "bench"))  # accumulating, no per-rank backend
    return (metrics, perf), rev.stdout.strip()


def per_call_us(fn, reset, number: int = N) -> float:
    return _timing.per_call_us(fn, reset, number, REPEAT, timer=time.thread_time)


def f(x):
    return x


def main() -> int:
    os.environ.pop("FORGE_DISABLE_METRICS", None)
    import forge_obs
    from forge_obs.recording.collector import MetricCollector
    from forge_obs.recording.tracer import Tracer, trace

    with tempfile.TemporaryDirectory() as d:
        tf, rev = load_torchforge(Path(d))
        if tf is None:
            print(f"bench_vs_torchforge: no torchforge git directory at {TF_GIT} (set TORCHFORGE_GIT_DIR); skipped")
            return 0
        tf_metrics, tf_perf = tf
        tf_collector = tf_metrics.MetricCollector()
        ours_collector = MetricCollector()

        def tf_reset():
            for acc in tf_collector.accumulators.values():
                acc.reset()
            tf_collector.accumulators.clear()

        def ours_reset():
            ours_collector.reset()

        bare_tf = per_call_us(lambda: f(1), tf_reset)
        bare_ours = per_call_us(lambda: f(1), ours_reset)
        tf_rec, tf_red = tf_metrics.record_metric, tf_metrics.Reduce.MEAN
        ours_rec, ours_red = forge_obs.record_metric, forge_obs.Reduce.MEAN
        g_tf = tf_perf.trace("bench/deco")(f)
        g_ours = trace("bench/deco")(f)
        rows = []
        figures = [
            ("record_metric", "record_metric(key, float, MEAN)",
             lambda: tf_rec("bench/r", 1.5, tf_red), lambda: ours_rec("bench/r", 1.5, ours_red), 0.0, 0.0),
            ("@trace overhead", "@trace on a sync function: overhead",
             lambda: g_tf(1), lambda: g_ours(1), bare_tf, bare_ours),
            ("Tracer cycle", "Tracer() + start + 2 steps + stop (cpu)",
             tracer_cycle(tf_perf.Tracer), tracer_cycle(Tracer), 0.0, 0.0),
        ]
        for key, name, fn_tf, fn_ours, base_tf, base_ours in figures:
            t_tf = per_call_us(fn_tf, tf_reset) - base_tf
            t_ours = per_call_us(fn_ours, ours_reset) - base_ours
            rows.append((key, name, t_tf, t_ours, t_tf / t_ours if t_ours > 0 else None))

    print(f"forge_obs vs torchforge {rev} observability  Python {platform.python_version()}  {os.cpu_count()} CPUs  "
          f"(min of {REPEAT} x {N} calls, CPU us per call, same process)")
    hdr = f"{'figure':42} | {'torchforge us':>13} | {'forge_obs us':>12} | {'ratio':>7} | target"
    print(hdr)
    print("-" * len(hdr))
    out = []
    for key, name, t_tf, t_ours, ratio in rows:
        target = TARGETS[key]
        print(f"{name:42} | {t_tf:13.2f} | {t_ours:12.2f} | {ratio:6.1f}x | >= {target:.1f}x (before)")
        out.append({"figure": name, "torchforge_us": t_tf, "forge_obs_us": t_ours, "ratio": ratio,
                    "target_ratio": target, "meets_target": ratio is not None and ratio >= target})
    res = {"torchforge_rev": rev, "python": platform.python_version(), "cpus": os.cpu_count(),
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "repeat": REPEAT, "calls": N, "rows": out}
    d = Path(__file__).parent / "results"
    d.mkdir(exist_ok=True)
    (d / "bench_vs_torchforge.json").write_text(json.dumps(res, indent=2))
    print(f"JSON: {d / 'bench_vs_torchforge.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
