"""The whole pipeline, side by side: torchforge's ``forge.observability``, forge_obs, and the floor,
on real Monarch meshes, in one benchmark run.

    python bench/bench_pipeline_vs_torchforge.py             # N in 1,2,4,8 procs x K in 10,100,1000 keys
    python bench/bench_pipeline_vs_torchforge.py --quick     # N in 1,8; fewer pairs and steps

Three implementations, each driven by a process of its own (``--driver``) that spawns one proc
mesh of N procs and keeps it for every K:

- **torchforge**: its own ``forge.observability`` (``metrics.py``, ``metric_actors.py``,
  ``utils.py``, ``env.py``, ``util/logging.py``), loaded as ``bench_vs_torchforge.py`` loads it:
  from a torchforge git directory (``TORCHFORGE_GIT_DIR``, default the fetched mirror) into a
  temporary directory, with empty package ``__init__`` files, a ``pytz`` stand-in and
  ``forge.controller.actor.ForgeActor`` as Monarch's ``Actor`` (as ``scripts/torchforge_suite.sh``
  does) as the only stubs; nothing of torchforge is kept in this repository. Its
  ``LocalFetcherActor`` on the mesh (``get_or_create_metric_logger(mesh)``), its
  ``GlobalLoggingActor``, ``init_backends({"console": global_reduce})``.
- **forge_obs**: ``provisioner_hooks.install()``, ``get_or_create_metric_logger``,
  ``init_backends({"console": global_reduce, "jsonl": None, "timeline": False})``.
- **the floor**: what a cut must do at least, written plainly on Monarch: an endpoint on every
  rank that swaps the rank's arrays of numbers and returns them as one pickle (one message per
  rank), one vectorised merge (NumPy) on the controller, and the values written to the console as
  torchforge writes them (one line per key).

Every step, each rank records K keys (``bench/k<i>``, MEAN, value ``step + rank + i/8``: exact in
binary) through an endpoint call, then the controller calls ``flush(step)``. The figure is the CPU
of every process (the driver and every process below it, read with each process's CPU clock,
``clock_gettime`` on its ``CLOCK_PROCESS_CPUTIME_ID``) per step, from flush to logged: a block of
S steps recording and flushing, until every step reached the console, minus a block of S steps
that only record, in the same driver just before. Blocks alternate between implementations in
the same run: ABC CBA per pair (A = torchforge, B = forge_obs, C = the floor). Per cell: the median
over the pairs, and their spread (min-max of the per-pair figures and ratios).

Checked in every block: every step's every value logged, equal to its arithmetic
(``step + i/8 + (N-1)/2``); and each step's time from its ``flush`` call to the console (p99 over
the pairs; target 1 s). Targets: forge_obs's CPU per step at least 5x below torchforge's in every
cell; within 3x of the floor at 1,000 keys. Results: a table, and bench/results/pipeline_vs_torchforge.json.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MONARCH_FILE_LOG", "error")
os.environ.setdefault("HYPERACTOR_MESH_SUPERVISION_POLL_FREQUENCY", "1s")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "bench")]
from _timing import percentile  # noqa: E402  (bench/, beside this script)

TF_GIT = os.environ.get("TORCHFORGE_GIT_DIR", "/work/.mirror/meta-pytorch+torchforge/repo")
TF_REV = os.environ.get("TORCHFORGE_REV", "HEAD")
IMPLS = ("torchforge", "forge_obs", "floor")
TARGET_VS_TORCHFORGE = 5.0
TARGET_VS_FLOOR = 3.0
TARGET_LATENCY_P99_S = 1.0
_MARK = "@@bench "
_TF_FILES = {
    "src/forge/observability/metrics.py": "forge/observability/metrics.py",
    "src/forge/observability/metric_actors.py": "forge/observability/metric_actors.py",
    "src/forge/observability/utils.py": "forge/observability/utils.py",
    "src/forge/env.py": "forge/env.py",
    "src/forge/util/logging.py": "forge/util/logging.py",
}


# ---------------------------------------------------------------------------- torchforge, loaded
def export_torchforge(tmp: Path) -> str | None:
    """torchforge's observability modules written under ``tmp`` (see the module docstring);
    returns the revision, or None when there is no torchforge git directory."""
    rev = subprocess.run(["git", "--git-dir", TF_GIT, "rev-parse", "--short", TF_REV], capture_output=True, text=True)
    if rev.returncode != 0:
        return None
    for src, dst in _TF_FILES.items():
        text = subprocess.run(["git", "--git-dir", TF_GIT, "show", f"{TF_REV}:{src}"], capture_output=True,
                              text=True, check=True).stdout
        (tmp / dst).parent.mkdir(parents=True, exist_ok=True)
        (tmp / dst).write_text(text)
    for pkg in ("forge", "forge/util", "forge/observability", "forge/controller"):
        (tmp / pkg).mkdir(parents=True, exist_ok=True)
        (tmp / pkg / "__init__.py").write_text("")  # stubs: the real ones import the whole of forge
    (tmp / "forge/controller/actor.py").write_text("from monarch.actor import Actor as ForgeActor  # noqa: F401\n")
    (tmp / "pytz.py").write_text("import datetime\nUTC = datetime.timezone.utc\n")  # stub: pytz is not installed
    return rev.stdout.strip()


# ---------------------------------------------------------------------------- CPU of a process tree
def _cpu_clock(pid: int) -> int:
    """The CPU-time clock of process ``pid`` (Linux: ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``)."""
    return ((~pid) << 3) | 2


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [root], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out.extend(kids)
        todo.extend(kids)
    return out


class TreeCpu:
    """CPU nanoseconds of a fixed set of processes, each read from its own CPU clock (exact, not
    the 10 ms ticks of /proc)."""

    def __init__(self, pids: list[int]) -> None:
        self.clocks = [(p, _cpu_clock(p)) for p in pids]

    def read(self) -> dict[int, int]:
        out = {}
        for pid, clock in self.clocks:
            try:
                out[pid] = time.clock_gettime_ns(clock)
            except OSError:
                out[pid] = 0
        return out


# ---------------------------------------------------------------------------- the actors
from monarch.actor import Actor, endpoint, this_host  # noqa: E402


def value_of(step: int, rank: int, i: int) -> float:
    return step + rank + i / 8


class Recorder(Actor):
    """Records K keys per step on its rank, through the implementation under test; for the floor
    it also is the rank's side of the cut."""

    def __init__(self, impl: str) -> None:
        from monarch.actor import current_rank

        self.impl = impl
        self.rank = int(current_rank().rank)
        self.keys: list[str] = []
        if impl == "torchforge":
            from forge.observability.metrics import Reduce, record_metric
        elif impl == "forge_obs":
            from forge_obs import Reduce, record_metric
        else:
            Reduce, record_metric = None, None
        self.record_metric, self.mean = record_metric, (Reduce.MEAN if Reduce is not None else None)
        self.sums: list = []
        self.counts: list = []

    @endpoint
    async def record(self, step: int, n_keys: int) -> None:
        if len(self.keys) != n_keys:
            self.keys = [f"bench/k{i}" for i in range(n_keys)]
        base = step + self.rank
        if self.record_metric is not None:
            rec, mean = self.record_metric, self.mean
            for i, k in enumerate(self.keys):
                rec(k, base + i / 8, mean)
            return
        if len(self.sums) != n_keys:
            self.sums, self.counts = [0.0] * n_keys, [0] * n_keys
        sums, counts = self.sums, self.counts
        for i in range(n_keys):  # the floor's record_metric: its arrays, by key id
            sums[i] += base + i / 8
            counts[i] += 1

    @endpoint
    async def cut(self) -> bytes:
        """The floor's rank side: swap the arrays, one pickle of the numbers (one message)."""
        import pickle
        from array import array

        n = len(self.sums)
        sums, counts = self.sums, self.counts
        self.sums, self.counts = [0.0] * n, [0] * n
        return pickle.dumps((array("d", sums).tobytes(), array("d", counts).tobytes()), protocol=5)


# ---------------------------------------------------------------------------- a driver
class Driver:
    """One implementation on one mesh of ``procs`` procs: ``setup``, then blocks."""

    def __init__(self, impl: str, procs: int, tmp: str) -> None:
        self.impl, self.procs, self.tmp = impl, procs, tmp
        self.step = 0
        self.logged: dict[int, tuple[float, dict]] = {}  # step -> (when it reached the console, {key: value})
        self.called: dict[int, float] = {}
        self.own: dict[int, dict] = {}  # step -> forge_obs's own CPU accounting (obs/cpu_<part>_s)
        self._waiting: tuple | None = None  # (step, loop, event)

    # -------------------------------------------------- the console, watched
    def _arrived(self, step: int, metrics: list) -> None:
        """A step reached the console (called in the console's own call, any thread)."""
        self.logged[step] = (time.monotonic(), {m.key: m.value for m in metrics if m.key.startswith("bench/")})
        w = self._waiting
        if w is not None and step >= w[0]:
            w[1].call_soon_threadsafe(w[2].set)

    def _watch(self, backend_cls_or_obj: object) -> None:
        orig = backend_cls_or_obj.log_batch
        driver = self

        if asyncio.iscoroutinefunction(orig):
            async def log_batch(*args, **kwargs):
                metrics, step = _metrics_step(args, kwargs)
                out = await orig(*args, **kwargs)
                driver._arrived(step, metrics)
                return out
        else:
            def log_batch(*args, **kwargs):
                metrics, step = _metrics_step(args, kwargs)
                out = orig(*args, **kwargs)
                driver._arrived(step, metrics)
                return out
        backend_cls_or_obj.log_batch = log_batch

    async def wait_logged(self, step: int) -> None:
        if step in self.logged:
            return
        ev = asyncio.Event()
        self._waiting = (step, asyncio.get_running_loop(), ev)
        try:
            while step not in self.logged:
                await asyncio.wait_for(ev.wait(), 60)
                ev.clear()
        finally:
            self._waiting = None

    # -------------------------------------------------- set-up
    async def setup(self) -> None:
        if self.impl == "forge_obs":
            import provisioner_hooks
            from forge_obs import get_or_create_metric_logger

            provisioner_hooks.install()
            self.mlogger = await get_or_create_metric_logger(process_name="Controller")
            await self.mlogger.init_backends.call_one({
                "console": {"logging_mode": "global_reduce", "stream": "stderr"}, "jsonl": None, "timeline": False,
                "run": {"root": self.tmp, "id": f"bench{self.procs}"}})
            from forge_obs.controller.state import CONTROLLER

            console = next(w.backend for w in CONTROLLER.pipeline.outputs.workers if w.name == "console")
            self._watch(console)
            log_step = console.log_step

            def own_cpu(record):  # forge_obs's own accounting of its CPU (obs/cpu_<part>_s), for the table
                own = self.own[record.step] = {}
                for m in reversed(record.global_metrics):  # the obs/ keys come last
                    if not m.key.startswith("obs/"):
                        break
                    if m.key.startswith("obs/cpu_") and m.key != "obs/cpu_s":
                        own[m.key[8:-2]] = m.value
                return log_step(record)

            console.log_step = own_cpu
        elif self.impl == "torchforge":
            metrics = importlib.import_module("forge.observability.metrics")
            self._watch(metrics.ConsoleBackend)  # the GlobalLoggingActor runs in this process
        self.pm = this_host().spawn_procs(per_host={"procs": self.procs}, name=f"bench_{self.impl}")
        self.rec = self.pm.spawn("recorder", Recorder, self.impl)
        if self.impl == "torchforge":
            actors = importlib.import_module("forge.observability.metric_actors")
            self.mlogger = await actors.get_or_create_metric_logger(process_name="Controller")
            await actors.get_or_create_metric_logger(self.pm, process_name="bench")
            await self.mlogger.init_backends.call_one({"console": {"logging_mode": "global_reduce"}})
        await self.rec.record.call(0, 1)
        self.pids = descendants(os.getpid())

    async def flush(self, step: int) -> None:
        self.called[step] = time.monotonic()
        if self.impl != "floor":
            await self.mlogger.flush.call_one(step)
            return
        import numpy as np

        answers = await self.rec.cut.call()
        sums, counts = [], []
        for _point, b in answers.items():
            s, c = __import__("pickle").loads(b)
            sums.append(np.frombuffer(s))
            counts.append(np.frombuffer(c))
        means = np.sum(sums, axis=0) / np.sum(counts, axis=0)
        keys = [f"bench/k{i}" for i in range(len(means))]
        sys.stderr.write("\n".join(f"  {k}: {v}" for k, v in zip(keys, means.tolist())) + "\n")
        self.logged[step] = (time.monotonic(), dict(zip(keys, means.tolist())))

    # -------------------------------------------------- a block
    async def block(self, keys: int, steps: int, warm: int) -> dict:
        tree = TreeCpu(self.pids)
        for _ in range(warm):
            await self._step(keys, flush=True)
        await self.wait_logged(self.step - 1)
        c0 = tree.read()
        for _ in range(steps):
            await self._step(keys, flush=False)
        c1 = tree.read()
        await self._step(keys, flush=True, record=False)  # takes what the record-only part left
        await self.wait_logged(self.step - 1)
        first = self.step
        c2 = tree.read()
        for _ in range(steps):
            await self._step(keys, flush=True)
        await self.wait_logged(self.step - 1)
        c3 = tree.read()
        me = os.getpid()
        rec = {p: c1[p] - c0[p] for p in c0}
        both = {p: c3[p] - c2[p] for p in c2}
        flush_ns = {p: both[p] - rec[p] for p in both}
        bad = self._check(first, self.step, keys)
        lat = [self.logged[s][0] - self.called[s] for s in range(first, self.step)]
        own: dict[str, float] = {}
        for s in range(first, self.step):
            for part, v in self.own.get(s, {}).items():
                own[part] = own.get(part, 0.0) + v * 1e3 / steps
        return {"own_ms": own, "cpu_ms": sum(flush_ns.values()) / steps / 1e6, "ctl_ms": flush_ns[me] / steps / 1e6,
                "ranks_ms": sum(v for p, v in flush_ns.items() if p != me) / steps / 1e6,
                "record_ms": sum(rec.values()) / steps / 1e6, "latency_s": lat, "wrong": bad}

    async def _step(self, keys: int, flush: bool, record: bool = True) -> None:
        if record:
            await self.rec.record.call(self.step, keys)
        if flush:
            await self.flush(self.step)
        self.step += 1

    def _check(self, first: int, end: int, keys: int) -> list[str]:
        """Every value of steps ``first`` .. ``end - 1`` as logged, against its arithmetic."""
        bad = []
        n = self.procs
        for s in range(first, end):
            got = self.logged.get(s, (0, {}))[1]
            if len(got) != keys:
                bad.append(f"step {s}: {len(got)} of {keys} keys logged")
            for i in range(keys):
                want = s + i / 8 + (n - 1) / 2
                if got.get(f"bench/k{i}") != want:
                    bad.append(f"step {s} bench/k{i}: {got.get(f'bench/k{i}')} != {want}")
        return bad[:5]

    async def stop(self) -> None:
        if self.impl != "floor":
            await self.mlogger.shutdown.call_one()
        await self.pm.stop()


def _metrics_step(args: tuple, kwargs: dict) -> tuple[list, int]:
    """``(metrics, step)`` of a ``log_batch(self?, metrics, global_step, ...)`` call."""
    rest = [a for a in args if isinstance(a, (list, int)) and not isinstance(a, bool)]
    metrics = kwargs.get("metrics", next(a for a in rest if isinstance(a, list)))
    step = kwargs.get("global_step", next(a for a in rest if isinstance(a, int)))
    return metrics, step


async def run_driver(impl: str, procs: int) -> None:
    tmp = tempfile.mkdtemp(prefix="bench_pipeline_")
    d = Driver(impl, procs, tmp)
    await d.setup()
    _say({"ready": True, "pids": len(d.pids)})
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        cmd = json.loads(line)
        if cmd["op"] == "stop":
            break
        _say(await d.block(cmd["keys"], cmd["steps"], cmd["warm"]))
    await d.stop()
    _say({"stopped": True})


def _say(obj: dict) -> None:
    sys.stdout.write(_MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- the orchestrator
class Child:
    def __init__(self, impl: str, procs: int, env: dict, log: Path) -> None:
        self.impl = impl
        self.log = open(log, "w")
        self.p = subprocess.Popen([sys.executable, __file__, "--driver", impl, "--procs", str(procs)], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)

    def read(self) -> dict:
        while True:
            line = self.p.stdout.readline()
            if not line:
                raise RuntimeError(f"driver {self.impl} ended (rc={self.p.wait()}): see {self.log.name}")
            if line.startswith(_MARK):
                return json.loads(line[len(_MARK):])

    def ask(self, cmd: dict) -> dict:
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        return self.read()

    def stop(self) -> None:
        try:
            self.ask({"op": "stop"})
            self.p.wait(60)
        except Exception:  # noqa: BLE001
            self.p.kill()
        self.log.close()


def run_cells(procs_list: list[int], keys_list: list[int], pairs: int, steps: int, warm: int,
              env: dict, logdir: Path) -> list[dict]:
    cells = []
    for n in procs_list:
        kids = {impl: Child(impl, n, env, logdir / f"{impl}_{n}.log") for impl in IMPLS}
        try:
            for k in kids.values():
                k.read()
            for keys in keys_list:
                res: dict[str, list[dict]] = {impl: [] for impl in IMPLS}
                for p in range(pairs):
                    for impl in (IMPLS if p % 2 == 0 else IMPLS[::-1]):  # ABC CBA
                        res[impl].append(kids[impl].ask({"op": "block", "keys": keys, "steps": steps, "warm": warm}))
                cells.append(summarise(n, keys, res))
                print_row(cells[-1], flush=True)
        finally:
            for k in kids.values():
                k.stop()
    return cells


def summarise(n: int, keys: int, res: dict[str, list[dict]]) -> dict:
    cell: dict = {"procs": n, "keys": keys}
    for impl, blocks in res.items():
        cell[impl] = {"cpu_ms": statistics.median(b["cpu_ms"] for b in blocks),
                      "cpu_ms_pairs": [b["cpu_ms"] for b in blocks],
                      "ctl_ms": statistics.median(b["ctl_ms"] for b in blocks),
                      "ranks_ms": statistics.median(b["ranks_ms"] for b in blocks),
                      "record_ms": statistics.median(b["record_ms"] for b in blocks),
                      "latency_p99_s": percentile([x for b in blocks for x in b["latency_s"]], 0.99),
                      "wrong": [w for b in blocks for w in b["wrong"]][:5],
                      "own_ms": {p: statistics.median(b["own_ms"].get(p, 0.0) for b in blocks)
                                 for p in sorted({p for b in blocks for p in b["own_ms"]})}}
    ours = res["forge_obs"]
    cell["ratio_pairs"] = [t["cpu_ms"] / o["cpu_ms"] if o["cpu_ms"] > 0 else float("inf")
                           for t, o in zip(res["torchforge"], ours)]
    cell["floor_pairs"] = [o["cpu_ms"] / f["cpu_ms"] if f["cpu_ms"] > 0 else float("inf")
                           for o, f in zip(ours, res["floor"])]
    cell["ratio"] = statistics.median(cell["ratio_pairs"])
    cell["vs_floor"] = statistics.median(cell["floor_pairs"])
    return cell


def print_header() -> None:
    print("| N | K | torchforge ms/step | forge_obs ms/step (controller + ranks) | floor ms/step "
          "| torchforge / forge_obs (pairs) | target | forge_obs / floor (pairs) | target "
          "| to console p99 (forge_obs) | exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")


def print_row(c: dict, flush: bool = False) -> None:
    tf, ours, fl = c["torchforge"], c["forge_obs"], c["floor"]
    rp, fp = c["ratio_pairs"], c["floor_pairs"]
    exact = "yes" if not (tf["wrong"] or ours["wrong"] or fl["wrong"]) else "NO: " + "; ".join(
        tf["wrong"][:1] + ours["wrong"][:1] + fl["wrong"][:1])
    floor_target = f"<= {TARGET_VS_FLOOR:.0f}x" if c["keys"] >= 1000 else "-"
    print(f"| {c['procs']} | {c['keys']} | {tf['cpu_ms']:.2f} | {ours['cpu_ms']:.2f} ({ours['ctl_ms']:.2f} + "
          f"{ours['ranks_ms']:.2f}) | {fl['cpu_ms']:.2f} | **{c['ratio']:.1f}x** ({min(rp):.1f}-{max(rp):.1f}) | "
          f">= {TARGET_VS_TORCHFORGE:.0f}x | {c['vs_floor']:.1f}x ({min(fp):.1f}-{max(fp):.1f}) | {floor_target} | "
          f"{ours['latency_p99_s'] * 1e3:.0f} ms (<= {TARGET_LATENCY_P99_S:.0f} s) | {exact} |", flush=flush)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="N in 1,8; 2 pairs of 20 steps")
    ap.add_argument("--procs", type=int, nargs="*", default=None)
    ap.add_argument("--keys", type=int, nargs="*", default=None)
    ap.add_argument("--pairs", type=int, default=None, help="ABC CBA pairs per cell (default 4, --quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps per block (default 40, --quick 20)")
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--driver", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pipeline_vs_torchforge.json"))
    args = ap.parse_args()
    if args.driver:
        if args.driver == "torchforge":
            sys.path.insert(0, os.environ["BENCH_TF_DIR"])
        asyncio.run(run_driver(args.driver, args.procs[0]))
        return 0
    procs_list = args.procs or ([1, 8] if args.quick else [1, 2, 4, 8])
    keys_list = args.keys or [10, 100, 1000]
    pairs = args.pairs or (2 if args.quick else 4)
    steps = args.steps or (20 if args.quick else 40)
    with tempfile.TemporaryDirectory(prefix="bench_tf_") as tfdir:
        rev = export_torchforge(Path(tfdir))
        if rev is None:
            print(f"bench_pipeline_vs_torchforge: no torchforge git directory at {TF_GIT} (set TORCHFORGE_GIT_DIR); skipped")
            return 0
        env = dict(os.environ, BENCH_TF_DIR=tfdir, PYTHONPATH=os.pathsep.join(
            p for p in (tfdir, str(ROOT / "src"), str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH")) if p))
        env.pop("FORGE_DISABLE_METRICS", None)
        logdir = Path(tempfile.mkdtemp(prefix="bench_pipeline_logs_"))
        print(f"torchforge {rev} vs forge_obs vs the floor; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}; "
              f"{pairs} pairs of {steps} steps per cell; driver logs in {logdir}", flush=True)
        print_header()
        cells = run_cells(procs_list, keys_list, pairs, steps, args.warm, env, logdir)
    print("\n## CPU per step, from flush to logged, all processes (median over pairs; spread min-max)")
    print_header()
    for c in cells:
        print_row(c)
    met = {"vs_torchforge": all(c["ratio"] >= TARGET_VS_TORCHFORGE for c in cells),
           "vs_floor_1000": all(c["vs_floor"] <= TARGET_VS_FLOOR for c in cells if c["keys"] >= 1000),
           "latency_p99": all(c["forge_obs"]["latency_p99_s"] <= TARGET_LATENCY_P99_S for c in cells),
           "exact": all(not c[i]["wrong"] for c in cells for i in IMPLS)}
    print(f"\ntargets: >= {TARGET_VS_TORCHFORGE:.0f}x torchforge in every cell: {met['vs_torchforge']}; "
          f"<= {TARGET_VS_FLOOR:.0f}x the floor at 1,000 keys: {met['vs_floor_1000']}; "
          f"to the console p99 <= {TARGET_LATENCY_P99_S:.0f} s: {met['latency_p99']}; every value exact: {met['exact']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torchforge_rev": rev, "python": platform.python_version(), "cpus": os.cpu_count(),
                               "load": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "pairs": pairs, "steps": steps, "cells": cells, "met": met}, indent=2))
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
